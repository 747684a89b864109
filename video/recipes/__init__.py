"""Recipes: end-to-end evaluations of real models with the ∞-Video memory."""
