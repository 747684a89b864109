"""Golden predictions of the shipped checkpoint on a fixed table, so its outputs cannot drift unnoticed.

Regenerate after exporting a new default checkpoint::

    python -m tabular.golden --write

and check with ``python -m tabular.golden`` (exit status 1 on a mismatch) or the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from tabular.weights_io import DEFAULT_WEIGHTS, atomic_write_text

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "golden_table", "golden_predictions", "build_parser", "main"]

GOLDEN_PATH = DEFAULT_WEIGHTS.with_name("tabicl_small_golden.json")
_ATOL = 1e-4


def golden_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fixed 3-class table (NumPy legacy RNG, platform-stable): ``X_train (60, 5)``, ``y_train``, ``X_test (20, 5)``."""
    rs = np.random.RandomState(12345)
    centers = rs.normal(scale=2.0, size=(3, 5))
    y = rs.randint(0, 3, 80)
    X = centers[y] + rs.normal(size=(80, 5))
    X[rs.rand(80, 5) < 0.05] = np.nan
    return X[:60], y[:60], X[60:]


def golden_predictions(checkpoint=None) -> np.ndarray:
    """Class probabilities ``(20, 3)`` of the golden table (4 members, seed 0)."""
    from tabular.estimator import TabICLClassifier

    Xtr, ytr, Xte = golden_table()
    clf = TabICLClassifier(n_estimators=4, random_state=0, checkpoint=checkpoint, device="cpu")
    return clf.fit(Xtr, ytr).predict_proba(Xte)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tabular.golden", description="check or rewrite the golden predictions")
    p.add_argument("--write", action="store_true", help=f"rewrite {GOLDEN_PATH.name} from the current checkpoint")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    proba = golden_predictions()
    if args.write:
        atomic_write_text(GOLDEN_PATH, json.dumps({"command": "python -m tabular.golden --write", "atol": _ATOL,
                                                   "proba": np.round(proba, 6).tolist()}, indent=1) + "\n")
        logger.info("wrote %s", GOLDEN_PATH)
        return 0
    stored = np.array(json.loads(Path(GOLDEN_PATH).read_text())["proba"])
    err = float(np.abs(stored - proba).max())
    logger.info("max abs difference to the golden predictions: %.2e (tolerance %.0e)", err, _ATOL)
    return 0 if err <= _ATOL else 1


if __name__ == "__main__":
    sys.exit(main())
