"""TabICL model: shapes, test-row independence, train-only induction, cached inference, weights round trip."""

from __future__ import annotations

import pytest
import torch

from tabular.model import CONFIGS, TabICL, TabICLConfig, tabicl_base, tabicl_medium, tabicl_small, tabicl_tiny
from tabular.prior import PriorConfig, TablePrior
from tabular.weights_io import load_model, save_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def _batch(B=2, N=60, n_train=36, F=5, seed=None):
    seed = int(torch.randint(0, 10_000, (1,))) if seed is None else seed
    return TablePrior(PriorConfig(max_width=16), seed=seed).sample(B, N, n_train, n_features=F)


def test_output_shape_and_config_sizes():
    m = TabICL(tabicl_tiny())
    b = _batch()
    out = m(b.X, b.y[:, : b.n_train])
    assert out.shape == (2, 60 - 36, 10) and torch.isfinite(out).all()
    n_small = sum(p.numel() for p in TabICL(tabicl_small()).parameters())
    assert n_small * 4 < 20 * 2**20  # the shipped size fits the 20 MB limit in fp32
    n_medium = sum(p.numel() for p in TabICL(tabicl_medium()).parameters())
    assert n_small < n_medium and n_medium * 4 < 20 * 2**20  # the next size still ships under 20 MB
    assert tabicl_medium().icl_dim == 2 * tabicl_small().icl_dim and CONFIGS["medium"] is tabicl_medium
    assert tabicl_base().icl_dim == 512 and tabicl_base().icl_blocks == 12


def test_test_rows_are_independent_and_do_not_affect_train():
    torch.manual_seed(int(torch.randint(0, 1000, (1,))))
    m = TabICL(tabicl_tiny()).eval()
    b = _batch(B=1)
    n = b.n_train
    with torch.no_grad():
        base = m(b.X, b.y[:, :n])
        X2 = b.X.clone()
        X2[0, n + 5] = torch.randn(X2.shape[2]) * 3  # change one test row
        changed = m(X2, b.y[:, :n])
        X3 = b.X.clone()
        X3[0, 2] = torch.randn(X3.shape[2]) * 3  # change one train row
        changed_train = m(X3, b.y[:, :n])
    diff = (base - changed).abs().amax(-1)[0]
    assert diff[5] > 1e-4  # the changed row's prediction moves
    assert torch.all(diff[torch.arange(diff.numel()) != 5] < 1e-5)  # no other test row moves
    assert (base - changed_train).abs().amax() > 1e-4  # train rows are the context: they matter


def test_cached_context_matches_full_forward():
    m = TabICL(tabicl_tiny()).eval()
    b = _batch(B=3, N=80, n_train=50, F=4)
    with torch.no_grad():
        full = m(b.X, b.y[:, :50])
        ctx = m.build_context(b.X[:, :50], b.y[:, :50], chunk=7)
        cached = m.predict_logits(b.X[:, 50:], ctx, chunk=11)
    torch.testing.assert_close(cached, full, rtol=1e-4, atol=1e-5)
    assert ctx.nbytes() > 0


def test_labels_are_used():
    m = TabICL(tabicl_tiny()).eval()
    b = _batch(B=1)
    y = b.y[:, : b.n_train]
    with torch.no_grad():
        a = m(b.X, y)
        c = m(b.X, (y + 1) % 10)
    assert (a - c).abs().amax() > 1e-4


def test_weights_round_trip(tmp_path):
    m = TabICL(tabicl_tiny()).eval()
    path = tmp_path / "m.safetensors"
    save_model(m, path, extra={"note": "test"})
    m2 = load_model(path)
    b = _batch(B=1)
    with torch.no_grad():
        torch.testing.assert_close(m(b.X, b.y[:, : b.n_train]), m2(b.X, b.y[:, : b.n_train]))
    assert m2.config == m.config
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "missing.safetensors")
    (tmp_path / "x.bin").write_bytes(b"0")
    with pytest.raises(ValueError, match="suffix"):
        load_model(tmp_path / "x.bin")


def test_config_and_input_validation():
    with pytest.raises(ValueError, match="must divide embed_dim"):
        TabICLConfig(embed_dim=30, col_heads=4)
    with pytest.raises(ValueError, match="max_classes"):
        TabICLConfig(max_classes=1)
    m = TabICL(tabicl_tiny())
    b = _batch(B=1)
    with pytest.raises(ValueError, match="labels must lie"):
        m(b.X, torch.full((1, b.n_train), 10))
    with pytest.raises(ValueError, match="n_train"):
        m(b.X, torch.zeros(1, b.X.shape[1], dtype=torch.long))


_PROJ = {"icl_ridge": "ridge_proj", "icl_logistic": "logit_proj"}


def _readout_model(readout="icl_ridge", seed=0):
    """A tiny model with a readout, its projection made non-zero so the readout matters."""
    torch.manual_seed(seed)
    m = TabICL(TabICLConfig(**{**tabicl_tiny().to_dict(), readout: [0.1, 1.0]})).eval()
    with torch.no_grad():
        getattr(m.icl, _PROJ[readout]).weight.normal_(0, 0.5)
    return m


@pytest.mark.parametrize("readout", ["icl_ridge", "icl_logistic"])
def test_readout_keeps_the_contract(readout):
    m = _readout_model(readout)
    assert getattr(m.config, readout) == (0.1, 1.0)  # a JSON list becomes a tuple
    b = _batch(B=2, N=70, n_train=45, F=4, seed=3)
    y = b.y[:, :45]
    with torch.no_grad():
        full = m(b.X, y)
        ctx = m.build_context(b.X[:, :45], y, chunk=8)
        torch.testing.assert_close(m.predict_logits(b.X[:, 45:], ctx, chunk=9), full, rtol=1e-4, atol=1e-5)
        X2 = b.X.clone()
        X2[0, 45 + 3] = torch.randn(4) * 3  # one test row changes: no other prediction moves
        diff = (m(X2, y) - full).abs().amax(-1)[0]
    assert diff[3] > 1e-4 and torch.all(diff[torch.arange(diff.numel()) != 3] < 1e-5)
    if readout == "icl_ridge":
        assert ctx.ridge_w.shape == (2, m.config.icl_dim, 2 * m.config.max_classes) and ctx.logit_w is None
    else:
        assert ctx.logit_w.shape == (2, 4 + 1, 2 * m.config.max_classes) and ctx.ridge_w is None
    assert ctx.nbytes() > 4 * (ctx.ridge_w if ctx.logit_w is None else ctx.logit_w).numel()
    # zero projection (as created): the same function as the model without the readout
    plain = TabICL(tabicl_tiny()).eval()
    fresh = TabICL(TabICLConfig(**{**tabicl_tiny().to_dict(), readout: [0.1]})).eval()
    missing, unexpected = fresh.load_state_dict(plain.state_dict(), strict=False)
    assert sorted(missing) == [f"icl.{_PROJ[readout]}.bias", f"icl.{_PROJ[readout]}.weight"] and not unexpected
    with torch.no_grad():
        torch.testing.assert_close(fresh(b.X, y), plain(b.X, y))
    with pytest.raises(ValueError, match=readout):
        TabICLConfig(**{readout: [0.0]})
    with pytest.raises(ValueError, match=readout):
        TabICLConfig(**{readout: "x"})


def test_ridge_readout_is_ridge_regression_with_exact_leave_one_out():
    m = _readout_model()
    g = torch.Generator().manual_seed(0)
    n, D = 30, m.config.icl_dim
    R = torch.randn(1, n, D, generator=g)
    y = torch.randint(0, 3, (1, n), generator=g)
    W, loo = m.icl.ridge_fit(R, y)
    W7, loo7 = m.icl.ridge_fit(R, y, chunk=7)  # rows in chunks: the same result
    torch.testing.assert_close(W7, W)
    torch.testing.assert_close(loo7, loo)
    C = m.config.max_classes
    for a, alpha in enumerate((0.1, 1.0)):
        Y = torch.nn.functional.one_hot(y[0], C).double()
        Yc = Y - Y.mean(0)
        Rd = R[0].double()
        ref = torch.linalg.solve(Rd.T @ Rd + alpha * n * torch.eye(D, dtype=torch.float64), Rd.T @ Yc)
        torch.testing.assert_close(W[0, :, a * C : (a + 1) * C].double(), ref, rtol=1e-4, atol=1e-6)
        for i in (0, 7, 29):  # refit without row i (same centring, as in the closed form) and predict it
            keep = torch.arange(n) != i
            Ri = Rd[keep]
            wi = torch.linalg.solve(Ri.T @ Ri + alpha * n * torch.eye(D, dtype=torch.float64), Ri.T @ Yc[keep])
            torch.testing.assert_close(loo[0, i, a * C : (a + 1) * C].double(), Rd[i] @ wi, rtol=1e-4, atol=1e-5)
