"""TabICL: in-context classification (and, with the official regression checkpoint, regression) of tables,
scikit-learn compatible.

``from tabular import TabICLClassifier, TabICLRegressor`` — see ``tabular/README.md``. Heavy imports (scikit-learn, pandas) load
only when the estimator is first used.
"""

from __future__ import annotations

__all__ = ["TabICLClassifier", "TabICLRegressor", "load_model"]


def __getattr__(name: str):
    if name == "TabICLClassifier":
        from tabular.estimator import TabICLClassifier

        return TabICLClassifier
    if name == "TabICLRegressor":
        from tabular.regressor import TabICLRegressor

        return TabICLRegressor
    if name == "load_model":  # this project's .safetensors / .pt, or an official TabICL .ckpt
        from tabular.weights_io import load_model

        return load_model
    raise AttributeError(f"module 'tabular' has no attribute {name!r}")
