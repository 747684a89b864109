"""Querent demo: whole-slide tissue mask, patch grid, Querent prediction, attention heatmap and chosen regions."""
