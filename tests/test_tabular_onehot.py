"""One-hot categorical columns (``TabICLClassifier(onehot_max_levels=L)``, ``TablePreprocessor``)."""

import numpy as np
import pandas as pd
import pytest

from tabular import TabICLClassifier
from tabular.preprocess import TablePreprocessor


def _frame():
    return pd.DataFrame({
        "four": ["A", "C", "G", "T", "C", "A"],
        "two": ["x", "y", "x", "y", "x", "y"],
        "many": list("abcdef"),
        "gaps": ["u", None, "v", "u", "w", "v"],
        "num": [0.5, 1.5, 2.5, 3.5, 4.5, 5.5],
    })


def test_columns_with_three_to_max_codes_become_indicators():
    pre = TablePreprocessor(onehot_max_levels=4)
    Xv, is_cat = pre.fit_transform(_frame())
    # four (4 codes) -> 4 indicators; two (2 codes) stays one column; many (6 codes) stays codes; gaps: u, v, w
    # and missing = 4 codes -> 4 indicators; num stays numeric.
    assert pre.kinds_ == ["onehot", "cat", "cat", "onehot", "num"]
    assert Xv.shape == (6, 4 + 1 + 1 + 4 + 1)
    assert list(is_cat) == [True] * 10 + [False]
    np.testing.assert_array_equal(Xv[:, :4], np.eye(4)[[0, 1, 2, 3, 1, 0]])  # A C G T C A
    np.testing.assert_array_equal(Xv[:, 6:10].argmax(1), [0, 3, 1, 0, 2, 1])  # u, missing, v, u, w, v
    assert np.all(Xv[:, :4].sum(1) == 1) and np.all(Xv[:, 6:10].sum(1) == 1)


def test_unseen_categories_at_predict_time():
    pre = TablePreprocessor(onehot_max_levels=4)
    pre.fit_transform(_frame())
    new = _frame().iloc[:2].copy()
    new.loc[0, "four"] = "N"  # never seen; no missing cell at fit in this column: all zeros
    new.loc[1, "gaps"] = "z"  # never seen; missing was seen at fit: the missing indicator, as with codes
    Xv = pre.transform(new)
    assert Xv.shape == (2, 11)
    assert Xv[0, :4].sum() == 0 and np.array_equal(Xv[1, :4], [0, 1, 0, 0])
    assert np.array_equal(Xv[1, 6:10], [0, 0, 0, 1])


def test_default_is_codes_and_bad_values_are_refused():
    pre = TablePreprocessor()
    Xv, _ = pre.fit_transform(_frame())
    assert Xv.shape == (6, 5) and pre.kinds_ == ["cat", "cat", "cat", "cat", "num"]
    for bad in (1, 2, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="onehot_max_levels must be 0"):
            TablePreprocessor(onehot_max_levels=bad)
    with pytest.raises(ValueError, match="onehot_max_levels must be 0"):
        TabICLClassifier(onehot_max_levels=1).fit(_frame(), [0, 1] * 3)


def _one_level_rule(n, width, seed=0):
    """Class 1 when column p0 is "C" (a middle code), 2 when p2 is "G", else 0; the other columns are noise."""
    rng = np.random.default_rng(seed)
    X = pd.DataFrame(rng.choice(list("ACGT"), size=(n, width)), columns=[f"p{i}" for i in range(width)])
    y = np.where(X["p0"] == "C", 1, np.where(X["p2"] == "G", 2, 0))
    return X, y


def test_one_hot_lets_the_model_read_a_rule_on_one_level_among_noise_columns():
    """The failure this option addresses (docs/experiments/tabular.md): with codes, a rule on a middle level of one
    column among a few noise columns is read poorly; one-hot makes it a threshold on one 0/1 column."""
    X, y = _one_level_rule(700, 5)
    tr, te = slice(0, 500), slice(500, None)
    clf = TabICLClassifier(n_estimators=2, onehot_max_levels=10).fit(X[tr], y[tr])
    assert clf._pre.kinds_ == ["onehot"] * 5
    assert (clf.predict(X[te]) == y[te]).mean() >= 0.9
