"""``TabICLRegressor`` on a random official regression checkpoint (the official package's format, written here):
parity with ``tabicl.TabICLRegressor`` for every output, the reused context, the target's scale, the quantile
distribution, scikit-learn's estimator checks and the refusals."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.utils.estimator_checks import parametrize_with_checks

pytest.importorskip("tabicl")

from tabicl import TabICLRegressor as OfficialRegressor  # noqa: E402
from tabicl._model.quantile_dist import QuantileToDistribution  # noqa: E402

from tabular import TabICLClassifier, TabICLRegressor  # noqa: E402
from tabular.quantiles import QuantileDistribution  # noqa: E402
from tests.test_tabular_official import SWITCHES, TINY, official_ckpt  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REGRESSION = {"max_classes": 0, "num_quantiles": 99}


def regression_ckpt(folder, release: str = "v2", seed: int = 0):
    """A random official regression checkpoint (v2 switches by default) named as the released file."""
    name = "tabicl-regressor-v2-20260212" if release == "v2" else f"regressor-{release}"
    return official_ckpt(Path(folder), name, config={**TINY, **SWITCHES[release], **REGRESSION}, seed=seed)[1]


def _data(seed=0, n=90, F=6, loc=50.0, scale=10.0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(n, F))
    y = loc + scale * (X[:, 0] - 0.5 * X[:, 1] ** 2 + 0.3 * rng.normal(size=n))
    return X, y


def _close(a, b, rel=1e-5):
    """Max |a - b| within ``rel`` of the largest |b| (float32 rounding of values ~50)."""
    return np.abs(a - b).max() <= rel * max(1.0, np.abs(b).max())


@pytest.mark.parametrize("release", ["v1", "v2"])
@pytest.mark.parametrize("kv_cache", [False, True])
def test_predictions_match_the_official_regressor(tmp_path, release, kv_cache):
    path = regression_ckpt(tmp_path, release)
    X, y = _data()
    kw = dict(n_estimators=4, random_state=3, kv_cache=kv_cache, batch_size=3)
    ref = OfficialRegressor(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw).fit(X[:60], y[:60])
    ours = TabICLRegressor(checkpoint=path, device="cpu", **kw).fit(X[:60], y[:60])
    assert (ours.context_nbytes_ > 0) == kv_cache
    alphas = [0.0005, 0.05, 0.5, 0.93, 0.9995]  # both tails and the interpolated part
    for output, extra in (("mean", {}), ("median", {}), ("quantiles", {}), ("quantiles", {"alphas": alphas}),
                          ("raw_quantiles", {})):
        p_ref = ref.predict(X[60:], output_type=output, **extra)
        p = ours.predict(X[60:], output_type=output, **extra)
        assert p.shape == p_ref.shape and _close(p, p_ref), (output, extra)
    both = ours.predict(X[60:], output_type=["mean", "median"])
    assert set(both) == {"mean", "median"} and _close(both["mean"], ref.predict(X[60:]))
    assert np.abs(ref.predict(X[60:]) - y[60:].mean()).max() > 0.1  # not a constant at the train mean


def test_a_reused_context_equals_running_the_train_rows_again(tmp_path):
    path = regression_ckpt(tmp_path)
    X, y = _data(1)
    kw = dict(checkpoint=path, device="cpu", n_estimators=3, random_state=0)
    cached = TabICLRegressor(kv_cache=True, **kw).fit(X[:60], y[:60])
    fresh = TabICLRegressor(**kw).fit(X[:60], y[:60])
    for part in (slice(60, 90), slice(60, 64), slice(70, 90)):
        assert np.abs(cached.predict(X[part]) - fresh.predict(X[part])).max() < 1e-4
    cached.fit(X[30:], y[30:] * 2)  # refit on other rows and targets: a new context
    assert np.abs(cached.predict(X[:30]) - TabICLRegressor(**kw).fit(X[30:], y[30:] * 2).predict(X[:30])).max() < 1e-4


def test_outputs_are_in_the_targets_units(tmp_path):
    """The model sees the standardized target: shifting and scaling y moves every output the same way."""
    path = regression_ckpt(tmp_path)
    X, y = _data(2, loc=0.0, scale=1.0)
    kw = dict(checkpoint=path, device="cpu", n_estimators=2)
    base = TabICLRegressor(**kw).fit(X[:60], y[:60]).predict(X[60:], output_type=["mean", "median", "quantiles"])
    moved = TabICLRegressor(**kw).fit(X[:60], 1000 + 25 * y[:60]).predict(X[60:], output_type=["mean", "median", "quantiles"])
    for k in base:
        assert np.abs(moved[k] - (1000 + 25 * base[k])).max() < 1e-3, k
    assert (np.diff(moved["quantiles"], axis=1) >= -1e-4).all()  # quantiles increase with the level


def test_quantile_distribution_matches_the_official_one():
    g = torch.Generator().manual_seed(0)
    for Q in (999, 99, 8):
        q = torch.randn(3, 5, Q, generator=g).cumsum(-1) * 0.1 + torch.randn(3, 5, Q, generator=g) * 0.05  # crossings
        ref, ours = QuantileToDistribution(num_quantiles=Q)(q), QuantileDistribution(q)
        alphas = torch.tensor([1e-7, 1e-4, 0.001, 0.01, 0.1, 0.3333, 0.5, 0.9, 0.999, 0.9995, 1 - 1e-7])
        assert torch.equal(ours.quantiles, ref.quantiles)
        assert torch.allclose(ours.mean, ref.quantiles.mean(-1), atol=1e-6)
        assert torch.allclose(ours.variance, ref.quantiles.var(-1), atol=1e-6)
        assert torch.allclose(ours.icdf(alphas), ref.icdf(alphas), atol=1e-5, rtol=0)


def test_refusals(tmp_path):
    path = regression_ckpt(tmp_path)
    X, y = _data(3)
    est = TabICLRegressor(checkpoint=path, device="cpu", n_estimators=1)
    for bad_y, words in ((np.where(np.arange(90) == 5, np.nan, y), "NaN"), (np.array(["a"] * 90, dtype=object), "numbers"),
                         (y[:50], "rows")):
        with pytest.raises(ValueError, match=words):
            est.fit(X, bad_y)
    est.fit(X[:60], y[:60])
    with pytest.raises(ValueError, match="output_type"):
        est.predict(X[60:], output_type="variance")
    with pytest.raises(ValueError, match="alphas"):
        est.predict(X[60:], output_type="quantiles", alphas=[0.5, 1.0])
    _, cls_path = official_ckpt(tmp_path, "v2")
    with pytest.raises(ValueError, match="classification checkpoint: use tabular.TabICLClassifier"):
        TabICLRegressor(checkpoint=cls_path, device="cpu").fit(X, y)
    with pytest.raises(ValueError, match="regression checkpoint: use tabular.TabICLRegressor"):
        TabICLClassifier(checkpoint=path, official=True, device="cpu").fit(X, y > 50)
    with pytest.raises(ValueError, match="n_estimators"):
        TabICLRegressor(checkpoint=path, n_estimators=0).fit(X, y)


# --- scikit-learn's estimator checks ---------------------------------------------------------------------------

def _checks_ckpt() -> Path:
    """The random checkpoint of the estimator checks, written at collection (parametrize_with_checks needs the
    estimator then) under a fixed name, so that test ids are the same in every run and worker."""
    path = Path(tempfile.gettempdir()) / "longctx_tabicl_regressor_checks" / "tabicl-regressor-v2-20260212.ckpt"
    if not path.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            made = regression_ckpt(tmp)
            path.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(made, path.with_suffix(".part"))
            path.with_suffix(".part").replace(path)
    return path


# Random weights predict no better than the mean: the check that asks for a fit score above 0.5 cannot pass.
_EXPECTED_FAILS = {"check_regressors_train": "random weights: the fit score is not above 0.5"}


@parametrize_with_checks([TabICLRegressor(checkpoint=str(_checks_ckpt()), n_estimators=1, device="cpu")],
                         expected_failed_checks=lambda est: _EXPECTED_FAILS)
def test_sklearn_contract(estimator, check):
    check(estimator)


def test_convert_keeps_a_regression_checkpoint(tmp_path):
    from tabular.convert import main as convert_main

    path = regression_ckpt(tmp_path)
    out = tmp_path / "conv" / "reg.safetensors"
    assert convert_main([str(path), str(out)]) == 0
    assert "TabICLRegressor" in out.with_suffix(".md").read_text()
    X, y = _data(4)
    kw = dict(device="cpu", n_estimators=2)
    a = TabICLRegressor(checkpoint=path, **kw).fit(X[:60], y[:60]).predict(X[60:])
    b = TabICLRegressor(checkpoint=out, **kw).fit(X[:60], y[:60]).predict(X[60:])
    assert np.abs(a - b).max() < 1e-4
