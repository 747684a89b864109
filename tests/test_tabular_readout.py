"""The in-context logistic readout (tabular.readout) and a model that uses it (config icl_logistic)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.linear_model import LogisticRegression

from tabular.model import TabICL, TabICLConfig, tabicl_tiny
from tabular.prior import PriorConfig, TablePrior
from tabular.readout import logistic_readout, logistic_scores


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _table(seed=0, n=160, F=5):
    g = torch.Generator().manual_seed(seed)
    Z = torch.randn(2, n, F, generator=g)
    w = torch.randn(F, generator=g)
    y = torch.stack([(Z[0] @ w + 0.7 * torch.randn(n, generator=g) > 0).long(),  # binary, noisy linear
                     torch.randint(0, 3, (n,), generator=g)])  # three classes
    return Z, y


def test_readout_is_penalised_logistic_regression_with_leave_one_out_logits():
    Z, y = _table()
    n = Z.shape[1]
    alphas = (0.01, 0.1)
    W, loo = logistic_readout(Z, y, alphas, 10)
    W7, loo7 = logistic_readout(Z, y, alphas, 10, chunk=7)  # rows in chunks: the same fit
    torch.testing.assert_close(W7, W, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loo7, loo, rtol=1e-5, atol=1e-6)
    assert W.shape == (2, 6, 2 * 10) and loo.shape == (2, n, 2 * 10)
    for b in range(2):
        for a, alpha in enumerate(alphas):
            Zb = Z[b].double().numpy()  # float64: scikit-learn fits float32 input in float32
            for c in range(int(y[b].max()) + 1):  # one-vs-rest, penalty alpha*n*|w|^2/2 = |w|^2/(2C)
                t = (y[b] == c).numpy()
                ref = LogisticRegression(C=1 / (alpha * n), tol=1e-10, max_iter=10_000).fit(Zb, t)
                col = a * 10 + c
                np.testing.assert_allclose(W[b, :-1, col].numpy(), ref.coef_[0], atol=1e-4)
                np.testing.assert_allclose(W[b, -1, col].item(), ref.intercept_[0], atol=1e-4)
                for i in (0, 41):  # refit without row i: the approximate leave-one-out logit is close to it
                    keep = np.arange(n) != i
                    ri = LogisticRegression(C=1 / (alpha * n), tol=1e-10, max_iter=10_000).fit(Zb[keep], t[keep])
                    exact = ri.decision_function(Zb[i : i + 1])[0]
                    assert abs(loo[b, i, col].item() - exact) < 0.01 + 0.01 * abs(exact)
                    fitted = logistic_scores(Z[b : b + 1, i : i + 1], W[b : b + 1])[0, 0, col].item()
                    # leaving a row out moves its logit away from its own label
                    assert (loo[b, i, col].item() - fitted) * (1 if t[i] else -1) < 0
    # classes no train row has: zero weights and features
    assert W[0, :, 2:10].abs().max() == 0 and loo[0, :, 2:10].abs().max() == 0
    assert W[1, :, 3:10].abs().max() == 0 and loo[1, :, 3:10].abs().max() == 0


def test_readout_converges_and_clips_on_separable_data():
    g = torch.Generator().manual_seed(1)
    Z = torch.randn(1, 120, 4, generator=g)
    y = (Z[..., 0] > 0).long()  # separable: only the penalty bounds the weights
    W8, loo8 = logistic_readout(Z, y, (0.001,), 10)
    W30, _ = logistic_readout(Z, y, (0.001,), 10, iters=30)
    torch.testing.assert_close(W8, W30, rtol=1e-4, atol=1e-5)
    assert loo8.abs().max() <= 8.0 and logistic_scores(Z * 100, W8).abs().max() == 8.0
    assert ((logistic_scores(Z, W8)[0, :, 1] > 0).long() == y[0]).all()
    with pytest.raises(ValueError, match="Z_train"):
        logistic_readout(Z, y[:, :5], (0.1,), 10)


def _logistic_model(seed=0):
    torch.manual_seed(seed)
    m = TabICL(TabICLConfig(**{**tabicl_tiny().to_dict(), "icl_logistic": [0.01, 0.1]})).eval()
    with torch.no_grad():
        m.icl.logit_proj.weight.normal_(0, 0.5)  # a readout that matters
    return m


def test_model_without_its_readout_logits_is_refused():
    m = _logistic_model()
    b = TablePrior(PriorConfig(max_width=16), seed=3).sample(1, 40, 25, n_features=3)
    with pytest.raises(ValueError, match="pass its logits"):  # the model contract is in test_tabular_model.py
        m.icl(m.encode_rows(b.X, 25), b.y[:, :25])


def test_gradients_reach_the_projection_but_not_through_the_readout():
    m = _logistic_model().train()
    b = TablePrior(PriorConfig(max_width=16), seed=4).sample(2, 50, 30, n_features=3)
    X = b.X.clone().requires_grad_(True)
    m(X, b.y[:, :30]).sum().backward()
    assert m.icl.logit_proj.weight.grad.abs().sum() > 0
    from tabular.model import standardize_columns

    Z = standardize_columns(X, 30, m.config.clip_value)
    assert Z.requires_grad and not m._readout_logits(Z, b.y[:, :30]).requires_grad  # a closed-form fit: no graph through Newton's steps
    assert X.grad is not None and X.grad.abs().sum() > 0  # the cells still get gradients through the row embedding
