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
