"""benchmarks.tabular_linear_probe: its tables, and a small run against logistic regression."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.tabular_linear_probe import main, make_table
from tabular.model import TabICL, tabicl_tiny
from tabular.weights_io import save_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tables_are_reproducible_noisy_linear_and_skewed():
    X, y = make_table(400, 12, 0.0, seed=3)
    X2, y2 = make_table(400, 12, 0.0, seed=3)
    assert X.shape == (400, 12) and y.shape == (400,) and set(np.unique(y)) == {0, 1}
    assert np.array_equal(X, X2) and np.array_equal(y, y2)
    assert not np.array_equal(make_table(400, 12, 0.0, seed=4)[1], y)
    assert (X > 0).all(0).any()  # some exponentiated (positive) columns
    # Without label noise the classes are a threshold of a linear score of the factors, which the features
    # measure with noise: a linear model gets most of them, far above chance, and label noise lowers that.
    from sklearn.linear_model import LogisticRegression

    clean = LogisticRegression(max_iter=5000).fit(X[:300], y[:300]).score(X[300:], y[300:])
    Xn, yn = make_table(400, 12, 2.0, seed=3)
    noisy = LogisticRegression(max_iter=5000).fit(Xn[:300], yn[:300]).score(Xn[300:], yn[300:])
    assert clean > 0.75 and noisy < clean
    with pytest.raises(ValueError, match="n_rows >= 20"):
        make_table(10, 3, 0.1, seed=0)


def test_run_compares_each_checkpoint_with_logistic_regression(tmp_path):
    ck = tmp_path / "tiny.safetensors"
    save_model(TabICL(tabicl_tiny()), ck)
    out = tmp_path / "r.json"
    assert main(["--checkpoints", str(ck), "--features", "4", "--rows", "60", "--seeds", "2", "--n-estimators", "1",
                 "--row-probe", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    by_model = {r["model"]: r for r in res["rows"]}
    assert sorted(by_model) == ["HistGradientBoosting", "LogisticRegression", "RandomForest", "kNN", "tiny",
                              "tiny rows+LR"]
    assert by_model["LogisticRegression"]["gap_to_lr"] == 0.0
    t = by_model["tiny"]
    assert len(t["accuracy_per_seed"]) == 2 and t["gap_to_lr"] == pytest.approx(
        t["accuracy"] - by_model["LogisticRegression"]["accuracy"])
    with pytest.raises(SystemExit, match="not found"):
        main(["--checkpoints", str(tmp_path / "absent.safetensors"), "--out", str(out)])
