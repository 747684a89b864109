"""End-to-end EMLoC protocols on real models (``python -m apps.emloc.recipes.qwen2vl``)."""
