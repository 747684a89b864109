"""The shipped checkpoint's predictions on a fixed table match the stored golden values.

Regenerate (only after deliberately exporting a new checkpoint): ``python -m tabular.golden --write``.
"""

from __future__ import annotations

import json

import numpy as np

from tabular.golden import GOLDEN_PATH, golden_predictions, golden_table


def test_golden_predictions_of_shipped_checkpoint():
    stored = json.loads(GOLDEN_PATH.read_text())
    proba = golden_predictions()
    np.testing.assert_allclose(proba, np.array(stored["proba"]), atol=stored["atol"], rtol=0)
    _, _, Xte = golden_table()
    assert proba.shape == (len(Xte), 3)


def test_golden_predictions_after_fine_tuning():
    stored = json.loads(GOLDEN_PATH.read_text())
    proba = golden_predictions(finetune_steps=stored["finetune_steps"])
    np.testing.assert_allclose(proba, np.array(stored["proba_finetuned"]), atol=stored["finetune_atol"], rtol=0)
    # Fine-tuning moved them: the two golden sets differ by more than the tolerance.
    assert np.abs(np.array(stored["proba_finetuned"]) - np.array(stored["proba"])).max() > 10 * stored["finetune_atol"]
