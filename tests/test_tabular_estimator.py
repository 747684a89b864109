"""TabICLClassifier: the scikit-learn contract, mixed inputs, bad inputs, ensembling, batching, caching."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.utils.estimator_checks import parametrize_with_checks

from tabular import TabICLClassifier
from tabular.estimator import _balanced_tree
from tabular.model import TabICL, tabicl_small


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _blobs(n=120, f=4, c=3, seed=None):
    rng = np.random.default_rng(seed if seed is not None else np.random.randint(0, 10_000))
    centers = rng.normal(scale=4.0, size=(c, f))
    y = rng.integers(0, c, n)
    return centers[y] + rng.normal(size=(n, f)), y


# Float32 kernels (matmul blocking, SDPA's query/key split sizes) depend on how many rows are processed
# together, so predictions on a subset differ from the full batch by ~1e-6 (measured: 6e-7 absolute), above
# this check's rtol of 1e-7. Invariance at 1e-5 is asserted in test_test_rows_independent_and_batching_invariant.
_EXPECTED_FAILS = {"check_methods_subset_invariance": "float32 results vary by ~1e-6 with the batch composition"}


@parametrize_with_checks([TabICLClassifier(n_estimators=1)], expected_failed_checks=lambda est: _EXPECTED_FAILS)
def test_sklearn_contract(estimator, check):
    check(estimator)


def test_default_checkpoint_learns_blobs():
    X, y = _blobs(200, 5, 3)
    clf = TabICLClassifier(n_estimators=4).fit(X[:120], y[:120])
    acc = (clf.predict(X[120:]) == y[120:]).mean()
    assert acc > 0.9
    proba = clf.predict_proba(X[120:])
    assert proba.shape == (80, 3) and np.allclose(proba.sum(1), 1)


def test_mixed_pandas_types_missing_and_unseen_categories():
    rng = np.random.default_rng(np.random.randint(0, 10_000))
    n = 90
    y = rng.integers(0, 2, n)
    df = pd.DataFrame({
        "num": y * 3.0 + rng.normal(size=n),
        "txt": np.where(y == 1, "yes", "no").astype(object),
        "cat": pd.Categorical(rng.choice(["a", "b", "c"], n)),
        "flag": rng.random(n) > 0.5,
        "const": 7.0,
        "allnan": np.nan,
    })
    df.loc[::7, "num"] = np.nan
    df.loc[::5, "txt"] = None
    df.loc[3, "num"] = np.inf
    labels = np.where(y == 1, "spam", "ham")
    clf = TabICLClassifier(n_estimators=2).fit(df.iloc[:60], labels[:60])
    assert clf._pre.kinds_ == ["num", "cat", "cat", "cat", "drop", "drop"]
    test = df.iloc[60:].copy()
    test.loc[test.index[0], "txt"] = "never-seen"
    test.loc[test.index[1], "cat"] = np.nan
    proba = clf.predict_proba(test)
    assert proba.shape == (30, 2) and np.isfinite(proba).all() and np.allclose(proba.sum(1), 1)
    assert set(clf.predict(test)) <= {"spam", "ham"} and list(clf.classes_) == ["ham", "spam"]


def test_bad_inputs_have_clear_errors():
    X, y = _blobs(40, 3, 2)
    clf = TabICLClassifier(n_estimators=1).fit(X, y)
    with pytest.raises(ValueError, match="X has 2 features, but TabICLClassifier is expecting 3"):
        clf.predict(X[:, :2])
    with pytest.raises(ValueError, match="0 sample"):
        clf.predict(X[:0])
    with pytest.raises(ValueError, match="missing labels"):
        TabICLClassifier(n_estimators=1).fit(X, np.where(np.arange(40) == 3, np.nan, y.astype(float)))
    with pytest.raises(ValueError, match="Unknown label type"):
        TabICLClassifier(n_estimators=1).fit(X, np.random.randn(40))
    with pytest.raises(ValueError, match="n_estimators"):
        TabICLClassifier(n_estimators=0).fit(X, y)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TabICLClassifier(checkpoint="no/such/file.safetensors").fit(X, y)
    df = pd.DataFrame(X, columns=["a", "b", "c"])
    clf = TabICLClassifier(n_estimators=1).fit(df, y)
    with pytest.raises(ValueError, match="feature names"):
        clf.predict(df.rename(columns={"c": "z"}))


def test_single_class_and_nan_inf_features():
    X, _ = _blobs(30, 3, 2)
    X[0, 0], X[1, 1] = np.nan, -np.inf
    clf = TabICLClassifier(n_estimators=1).fit(X, np.full(30, "only"))
    assert (clf.predict(X) == "only").all() and clf.predict_proba(X).shape == (30, 1)


def test_test_rows_independent_and_batching_invariant():
    X, y = _blobs(100, 4, 3)
    Xt = X[60:].copy()
    a = TabICLClassifier(n_estimators=3, random_state=1).fit(X[:60], y[:60]).predict_proba(Xt)
    b = TabICLClassifier(n_estimators=3, random_state=1, batch_size=7).fit(X[:60], y[:60]).predict_proba(Xt)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    Xt2 = Xt.copy()
    Xt2[5:] = np.random.randn(*Xt2[5:].shape) * 10  # change every other test row
    c = TabICLClassifier(n_estimators=3, random_state=1).fit(X[:60], y[:60]).predict_proba(Xt2)
    np.testing.assert_allclose(a[:5], c[:5], rtol=1e-5, atol=1e-6)
    assert np.abs(a[5:] - c[5:]).max() > 1e-4


def test_train_side_cache_is_reused(monkeypatch):
    X, y = _blobs(80, 4, 2)
    clf = TabICLClassifier(n_estimators=2).fit(X[:50], y[:50])
    calls = []
    orig = TabICL.build_context
    monkeypatch.setattr(TabICL, "build_context", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    p1 = clf.predict_proba(X[50:])
    n_first = len(calls)
    p2 = clf.predict_proba(X[50:])
    assert n_first >= 1 and len(calls) == n_first
    np.testing.assert_allclose(p1, p2)
    # A budget too small to keep the cache recomputes it.
    clf_small = TabICLClassifier(n_estimators=2, memory_budget_mb=0.002).fit(X[:50], y[:50])
    calls.clear()
    clf_small.predict_proba(X[50:56])
    n_small = len(calls)
    clf_small.predict_proba(X[50:56])
    assert n_small >= 1 and len(calls) == 2 * n_small and not clf_small._tree.cache


def test_many_classes_hierarchy():
    tree = _balanced_tree(np.arange(37), 10)
    assert len(tree.groups) == 4 and sorted(np.concatenate(tree.groups).tolist()) == list(range(37))
    assert all(len(g) <= 10 for g in tree.groups)
    rng = np.random.default_rng(np.random.randint(0, 10_000))
    n, C = 260, 13
    y = np.arange(n) % C
    X = np.c_[y + rng.normal(scale=0.05, size=n), rng.normal(size=n)]
    clf = TabICLClassifier(n_estimators=1).fit(X[:200], y[:200])
    proba = clf.predict_proba(X[200:])
    assert proba.shape == (60, C) and np.allclose(proba.sum(1), 1) and (proba >= 0).all()
    assert (clf.predict(X[200:]) == y[200:]).mean() > 1.0 / C  # better than chance through the hierarchy


def test_large_train_sets_split_into_stratified_folds(monkeypatch):
    X, y = _blobs(130, 3, 2)
    clf = TabICLClassifier(n_estimators=2, max_context=30).fit(X[:100], y[:100])
    folds = clf._folds(clf._y_train)
    assert len(folds) == 4 and all(len(f) <= 30 for f in folds)
    assert sorted(np.concatenate(folds).tolist()) == list(range(100))  # every train row is used once
    share = [clf._y_train[f].mean() for f in folds]
    assert max(share) - min(share) < 0.1  # stratified
    sizes = []
    orig = TabICL.build_context
    monkeypatch.setattr(TabICL, "build_context", lambda self, X, *a, **k: sizes.append(X.shape[1]) or orig(self, X, *a, **k))
    proba = clf.predict_proba(X[100:])
    assert proba.shape == (30, 2) and np.allclose(proba.sum(1), 1)
    assert max(sizes) <= 30 and len(sizes) == 4  # one context per fold (members batched within a fold)
    with pytest.raises(ValueError, match="max_context"):
        TabICLClassifier(max_context=1).fit(X, y)


def test_tiny_memory_budget_forces_chunks_with_unchanged_predictions(monkeypatch):
    X, y = _blobs(400, 5, 3)
    Xt = X[300:]
    chunks = []
    orig = TabICL.build_context
    monkeypatch.setattr(TabICL, "build_context", lambda self, *a, **k: chunks.append(k["chunk"]) or orig(self, *a, **k))
    big = TabICLClassifier(n_estimators=3, random_state=2).fit(X[:300], y[:300])
    p_big = big.predict_proba(Xt)
    assert min(chunks) >= 300  # a roomy budget runs every stage in one chunk
    chunks.clear()
    small = TabICLClassifier(n_estimators=3, random_state=2, memory_budget_mb=0.05).fit(X[:300], y[:300])
    p_small = small.predict_proba(Xt)
    assert max(chunks) <= 20 and len(chunks) == 3  # ~16-row chunks: > 15 chunks per stage, one member per batch
    assert not small._tree.cache  # too small to keep the train-side cache
    np.testing.assert_allclose(p_small, p_big, rtol=1e-5, atol=1e-6)


def test_memory_plan_grows_with_the_budget():
    model = TabICL(tabicl_small())
    plans = [TabICLClassifier(memory_budget_mb=mb)._plan(model, 20, 8192, 4, 1000) for mb in (64, 512, 4096, 65536)]
    per_batch, chunk = zip(*plans)
    assert list(per_batch) == sorted(per_batch) and list(chunk[:3]) == sorted(chunk[:3])
    assert per_batch[0] == 1 and per_batch[-1] == 4 and chunk[0] < chunk[2]
    full, chunked, cached = TabICLClassifier._memory_model(model, 20)
    assert full > cached > 0 and chunked > 0
    # The plan respects the activation half of the budget whenever a minimal chunk fits.
    b, c = plans[1]
    assert b * (full * 8192 + chunked * c) <= 512 * 2**20 / 2
    assert TabICLClassifier(batch_size=7)._plan(model, 20, 8192, 4, 1000)[1] == 7


def test_warns_on_tables_wider_than_the_checkpoint_was_pretrained_on(tmp_path):
    import warnings

    from tabular.model import tabicl_tiny
    from tabular.weights_io import load_model, save_model

    path = tmp_path / "narrow.safetensors"
    save_model(TabICL(tabicl_tiny()), path, extra={"pretrained_max_features": 3})
    assert load_model(path).card["pretrained_max_features"] == 3
    X, y = _blobs(n=60, f=5, c=2, seed=0)
    with pytest.warns(UserWarning, match="5 informative features .* at most 3"):
        TabICLClassifier(n_estimators=1, checkpoint=path).fit(X, y)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TabICLClassifier(n_estimators=1, checkpoint=path).fit(X[:, :3], y)
    # The demo's comparison passes the warning on (the hub shows it under the result).
    from tabular.compare import compare_on_table

    df = pd.DataFrame(X, columns=[f"x{i}" for i in range(5)]).assign(label=y)
    out = compare_on_table(df, "label", checkpoint=path, n_estimators=1, baselines=False)
    assert len(out["tabicl_warnings"]) == 1 and "at most 3" in out["tabicl_warnings"][0]
    assert compare_on_table(df.drop(columns=["x3", "x4"]), "label", checkpoint=path, n_estimators=1,
                            baselines=False)["tabicl_warnings"] == []
    # The shipped checkpoint's card records how wide its pretraining tables were; 5 features are within it.
    from tabular.weights_io import default_checkpoint

    assert load_model(default_checkpoint()).card["pretrained_max_features"] == 40
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TabICLClassifier(n_estimators=1).fit(X, y)
