"""Training recipes for CoMemo on real model architectures (``python -m apps.comemo.recipes.internvl``)."""
