"""Ready-made training recipes for :mod:`apps.ncal` (``python -m apps.ncal.recipes.llm``)."""
