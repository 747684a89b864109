"""Golden predictions of the shipped checkpoint on a fixed table, so its outputs cannot drift unnoticed.

Regenerate after exporting a new default checkpoint::

    python -m tabular.golden --write

and check with ``python -m tabular.golden`` (exit status 1 on a mismatch) or the test suite.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import numpy as np

from core.infra.cli import run_cli
from core.infra.guard import check_output
from tabular.weights_io import DEFAULT_WEIGHTS, atomic_write_text

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "golden_table", "golden_predictions", "build_parser", "main"]

GOLDEN_PATH = DEFAULT_WEIGHTS.with_name(f"{DEFAULT_WEIGHTS.stem}_golden.json")
_ATOL = 1e-4
_FINETUNE_STEPS = 20  # the fine-tuned golden predictions (gradient steps amplify float rounding: wider tolerance)
_FINETUNE_ATOL = 1e-3


def golden_table() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fixed 3-class table (NumPy legacy RNG, platform-stable): ``X_train (60, 5)``, ``y_train``, ``X_test (20, 5)``."""
    rs = np.random.RandomState(12345)
    centers = rs.normal(scale=2.0, size=(3, 5))
    y = rs.randint(0, 3, 80)
    X = centers[y] + rs.normal(size=(80, 5))
    X[rs.rand(80, 5) < 0.05] = np.nan
    return X[:60], y[:60], X[60:]


def golden_predictions(checkpoint=None, finetune_steps: int = 0) -> np.ndarray:
    """Class probabilities ``(20, 3)`` of the golden table (4 members, seed 0). With ``finetune_steps`` the model is
    fine-tuned first, at the fixed temperature 0.9: no holdout, so the last step's weights are used (on this easy
    table the holdout would keep the pretrained ones)."""
    from tabular.estimator import TabICLClassifier

    Xtr, ytr, Xte = golden_table()
    extra = {"finetune_steps": finetune_steps, "softmax_temperature": 0.9} if finetune_steps else {}
    clf = TabICLClassifier(n_estimators=4, random_state=0, checkpoint=checkpoint, device="cpu", **extra)
    return clf.fit(Xtr, ytr).predict_proba(Xte)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tabular.golden", description="check or rewrite the golden predictions")
    p.add_argument("--write", action="store_true", help=f"rewrite {GOLDEN_PATH.name} from the current checkpoint")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    proba = golden_predictions()
    tuned = golden_predictions(finetune_steps=_FINETUNE_STEPS)
    if args.write:
        check_output(GOLDEN_PATH, ship="tabular")  # the golden values ship beside the medium checkpoint
        record = {"command": "python -m tabular.golden --write", "atol": _ATOL, "proba": np.round(proba, 6).tolist(),
                  "finetune_steps": _FINETUNE_STEPS, "finetune_atol": _FINETUNE_ATOL,
                  "proba_finetuned": np.round(tuned, 6).tolist()}
        atomic_write_text(GOLDEN_PATH, json.dumps(record, indent=1) + "\n")
        logger.info("wrote %s", GOLDEN_PATH)
        return 0
    stored = json.loads(Path(GOLDEN_PATH).read_text())
    ok = True
    for key, value, atol in (("proba", proba, _ATOL), ("proba_finetuned", tuned, _FINETUNE_ATOL)):
        err = float(np.abs(np.array(stored[key]) - value).max())
        logger.info("%s: max abs difference to the golden values %.2e (tolerance %.0e)", key, err, atol)
        ok &= err <= atol
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
