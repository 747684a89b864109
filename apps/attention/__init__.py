"""Attention-core demo: block selection map, block-sparse error against dense attention, backend timings."""
