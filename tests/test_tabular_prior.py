"""The synthetic table prior: shapes, dtypes, class counts, categorical codes, missing values."""

from __future__ import annotations

import pytest
import torch

from tabular.prior import PriorConfig, TablePrior


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


@pytest.mark.parametrize("n_features", [2, 17, 100])
def test_prior_shapes_types_and_classes(n_features):
    seed = int(torch.randint(0, 10_000, (1,)))
    prior = TablePrior(seed=seed)
    B, N, n_train = 6, 150, 90
    b = prior.sample(B, N, n_train, n_features=n_features)
    assert b.X.shape == (B, N, n_features) and b.X.dtype == torch.float32
    assert b.y.shape == (B, N) and b.y.dtype == torch.int64
    assert b.n_classes.shape == (B,) and b.is_categorical.shape == (B, n_features)
    assert b.n_train == n_train
    assert ((b.n_classes >= 2) & (b.n_classes <= 10)).all()
    for k in range(B):
        C = int(b.n_classes[k])
        assert int(b.y[k].min()) >= 0 and int(b.y[k].max()) < C
        # every class appears among the labelled rows
        assert set(b.y[k, :n_train].tolist()) == set(range(C))
    finite = b.X[~torch.isnan(b.X)]
    assert torch.isfinite(finite).all()


def test_prior_class_range_binary_share_and_features():
    prior = TablePrior(PriorConfig(max_classes=7, min_features=3, max_features=5, max_width=16), seed=1)
    counts = []
    for _ in range(6):
        b = prior.sample(16, 80, 50)
        assert 3 <= b.X.shape[2] <= 5
        counts += b.n_classes.tolist()
    assert max(counts) <= 7 and min(counts) == 2
    assert 0.25 < sum(c == 2 for c in counts) / len(counts) < 0.9  # about half binary (+ draws of 2 from 2..7)
    assert len(set(counts)) >= 4


def test_prior_categorical_and_missing():
    prior = TablePrior(PriorConfig(p_categorical=1.0, p_missing_table=1.0, max_missing=0.3), seed=2)
    b = prior.sample(4, 200, 120, n_features=6)
    assert b.is_categorical.all()
    X = b.X
    miss = torch.isnan(X)
    assert miss.any() and miss.float().mean() < 0.3
    codes = X[~miss]
    assert torch.equal(codes, codes.round()) and codes.min() >= 0 and codes.max() <= 9
    none = TablePrior(PriorConfig(p_categorical=0.0, p_missing_table=0.0), seed=3).sample(4, 200, 120, n_features=6)
    assert not none.is_categorical.any() and not torch.isnan(none.X).any()
    assert len(torch.unique(none.X[0, :, 0])) > 50  # continuous values stay continuous


def test_prior_tree_and_mlp_families_and_determinism():
    for p_tree in (0.0, 1.0):
        a = TablePrior(PriorConfig(p_tree=p_tree), seed=5).sample(3, 64, 40, n_features=4)
        b = TablePrior(PriorConfig(p_tree=p_tree), seed=5).sample(3, 64, 40, n_features=4)
        assert torch.equal(a.y, b.y) and torch.allclose(a.X.nan_to_num(7.0), b.X.nan_to_num(7.0))
    c = TablePrior(seed=6).sample(3, 64, 40, n_features=4)
    assert not torch.equal(a.X.nan_to_num(0), c.X.nan_to_num(0))


def test_prior_rejects_bad_sizes():
    prior = TablePrior(seed=0)
    with pytest.raises(ValueError, match="n_train"):
        prior.sample(2, 50, 50)
    with pytest.raises(ValueError, match="n_train"):
        prior.sample(2, 50, 5)
    with pytest.raises(ValueError, match="max_features"):
        PriorConfig(min_features=5, max_features=3)


def test_prior_factor_family_tables_and_config():
    cfg = PriorConfig(p_tree=0.0, p_factor=1.0, p_categorical=0.0, p_missing_table=0.0)
    a = TablePrior(cfg, seed=7).sample(16, 200, 120, n_features=10)
    b = TablePrior(cfg, seed=7).sample(16, 200, 120, n_features=10)
    assert torch.equal(a.y, b.y) and torch.equal(a.X, b.X)  # deterministic per seed
    assert a.X.shape == (16, 200, 10) and torch.isfinite(a.X).all()
    for k in range(16):
        assert set(a.y[k, :120].tolist()) == set(range(int(a.n_classes[k])))
    # 30% of the measurements are exponentiated: positive, right-skewed columns in most tables.
    z = (a.X - a.X.mean(1, keepdim=True)) / a.X.std(1, keepdim=True).clamp_min(1e-9)
    skewed = ((z**3).mean(1) > 1.5) & (a.X.min(1).values > 0)
    assert skewed.any(1).float().mean() > 0.5
    # Mixed batches: the family shares add up; too large a sum is refused.
    m = TablePrior(PriorConfig(p_tree=0.3, p_factor=0.3), seed=8).sample(12, 80, 50, n_features=5)
    assert m.X.shape == (12, 80, 5)
    with pytest.raises(ValueError, match="p_tree \\+ p_factor"):
        PriorConfig(p_tree=0.6, p_factor=0.5)
    with pytest.raises(ValueError, match="p_factor"):
        PriorConfig(p_factor=-0.1)
