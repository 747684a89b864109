"""NCAL: neural-collapse regularization for long-tailed educational text classification.

``from apps.ncal import NCALClassifier`` (scikit-learn fit / predict / predict_proba on lists of texts;
``NCALClassifier.load("tmwpl")`` or ``.load("pmtd")`` for the shipped models). Importing this package loads
nothing heavy: the estimator is imported on first use.
"""

from __future__ import annotations

__all__ = ["NCALClassifier"]


def __getattr__(name: str):
    if name == "NCALClassifier":
        from apps.ncal.estimator import NCALClassifier

        return NCALClassifier
    raise AttributeError(f"module 'apps.ncal' has no attribute {name!r}")
