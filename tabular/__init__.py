"""TabICL: in-context classification of tables, scikit-learn compatible.

``from tabular import TabICLClassifier`` — see ``tabular/README.md``. Heavy imports (scikit-learn, pandas) load
only when the estimator is first used.
"""

from __future__ import annotations

__all__ = ["TabICLClassifier"]


def __getattr__(name: str):
    if name == "TabICLClassifier":
        from tabular.estimator import TabICLClassifier

        return TabICLClassifier
    raise AttributeError(f"module 'tabular' has no attribute {name!r}")
