"""core.collapse: simplex ETF, TC loss with a feature bank, ETF classifier + dot regression, NC1/NC2."""

from __future__ import annotations

import itertools

import pytest
import torch

from core.collapse import (
    ETFClassifier,
    FeatureBank,
    cap_norm,
    class_mean_cosines,
    dot_regression_loss,
    etf_gram,
    nc1,
    nc2,
    simplex_etf,
    tc_loss,
)


@pytest.mark.parametrize("K,D", [(2, 1), (3, 2), (7, 6), (7, 160), (8, 33)])
def test_simplex_etf_geometry(K, D):
    W = simplex_etf(K, D, generator=torch.Generator().manual_seed(K * D))
    assert W.shape == (K, D)
    torch.testing.assert_close(W @ W.T, etf_gram(K), atol=1e-5, rtol=0)
    # rows sum to zero (centred), so the frame is tight
    torch.testing.assert_close(W.sum(0), torch.zeros(D), atol=1e-5, rtol=0)


def test_simplex_etf_refuses_too_few_dims():
    with pytest.raises(ValueError, match="at least num_classes - 1"):
        simplex_etf(7, 5)
    with pytest.raises(ValueError, match="at least 2"):
        simplex_etf(1, 5)


def _tc_brute(h, y, K, bank_h=None, bank_y=None):
    h = cap_norm(h)
    vals = []
    for i, j in itertools.combinations(range(len(y)), 2):
        if y[i] != y[j]:
            vals.append((h[i] @ h[j] + 1 / (K - 1)) ** 2)
    if bank_h is not None:
        b = cap_norm(bank_h)
        for i in range(len(y)):
            for j in range(len(bank_y)):
                if y[i] != bank_y[j]:
                    vals.append((h[i] @ b[j] + 1 / (K - 1)) ** 2)
    return torch.stack(vals).mean()


def test_tc_loss_matches_brute_force_with_and_without_bank():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(9, 5, generator=g) * 2
    h[0] *= 0.1  # one short feature: its norm is not raised to 1
    y = torch.randint(0, 4, (9,), generator=g)
    torch.testing.assert_close(tc_loss(h, y, 4), _tc_brute(h, y, 4))
    bh, by = torch.randn(6, 5, generator=g), torch.randint(0, 4, (6,), generator=g)
    torch.testing.assert_close(tc_loss(h, y, 4, bank_h_MD=bh, bank_y_M=by), _tc_brute(h, y, 4, bh, by))


def test_tc_loss_zero_at_etf_and_positive_elsewhere():
    W = simplex_etf(5, 12, generator=torch.Generator().manual_seed(1))
    y = torch.arange(5)
    assert float(tc_loss(W * 3, y, 5)) < 1e-10  # capped back onto the ETF
    h = torch.randn(5, 12, generator=torch.Generator().manual_seed(2))
    assert float(tc_loss(h, y, 5)) > 1e-3


def test_tc_loss_no_pairs_is_zero_but_attached():
    h = torch.randn(4, 3, requires_grad=True)
    loss = tc_loss(h, torch.zeros(4, dtype=torch.long), 3)
    assert loss.item() == 0.0
    loss.backward()
    assert h.grad is not None


def test_tc_gradient_does_not_flow_into_bank():
    h = torch.randn(3, 4, requires_grad=True)
    bank = torch.randn(5, 4, requires_grad=True)
    tc_loss(h, torch.tensor([0, 1, 2]), 3, bank_h_MD=bank, bank_y_M=torch.tensor([0, 1, 2, 0, 1])).backward()
    assert bank.grad is None and h.grad.abs().sum() > 0


def test_tc_descent_reaches_etf():
    torch.manual_seed(0)
    h = torch.randn(6, 8, requires_grad=True)
    y = torch.arange(6)
    opt = torch.optim.Adam([h], lr=0.02)
    for _ in range(600):
        opt.zero_grad()
        loss = tc_loss(h, y, 6)
        loss.backward()
        opt.step()
    assert loss.item() < 1e-4
    hn = torch.nn.functional.normalize(h.detach(), dim=1)
    torch.testing.assert_close(hn @ hn.T, etf_gram(6), atol=1e-2, rtol=0)


def test_feature_bank_ring_buffer():
    bank = FeatureBank(5, 2)
    bank.push(torch.arange(6.0).view(3, 2), torch.tensor([0, 1, 2]))
    h, y = bank.get()
    assert h.shape == (3, 2) and y.tolist() == [0, 1, 2]
    bank.push(torch.arange(8.0).view(4, 2) + 100, torch.tensor([3, 4, 5, 6]))
    h, y = bank.get()
    assert h.shape == (5, 2)
    assert sorted(y.tolist()) == [2, 3, 4, 5, 6]  # the oldest two were overwritten
    assert int(bank.count) == 7
    # state is saved with the module
    b2 = FeatureBank(5, 2)
    b2.load_state_dict(bank.state_dict())
    torch.testing.assert_close(b2.get()[0], h)


def test_label_checks():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        tc_loss(torch.randn(2, 3), torch.tensor([0, 3]), 3)
    with pytest.raises(ValueError, match="labels must be"):
        nc1(torch.randn(4, 3), torch.tensor([0, 1]), 2)


def test_etf_classifier_and_dot_regression():
    clf = ETFClassifier(10, 4, scale=5.0)
    assert not any(p.requires_grad for p in clf.parameters())  # nothing to learn
    W = clf.W_KD
    y = torch.tensor([2, 0, 3])
    logits = clf(W[y] * 7)
    assert logits.argmax(1).tolist() == y.tolist()
    torch.testing.assert_close(logits.max(1).values, torch.full((3,), 5.0))
    assert float(dot_regression_loss(W[y] * 7, y, W)) < 1e-10
    h = torch.randn(3, 10)
    cos = (torch.nn.functional.normalize(h, dim=1) * W[y]).sum(1)
    torch.testing.assert_close(dot_regression_loss(h, y, W), (0.5 * (cos - 1) ** 2).mean())


def test_nc_metrics_collapsed_vs_random():
    g = torch.Generator().manual_seed(3)
    K, D = 5, 16
    W = simplex_etf(K, D, generator=g)
    y = torch.arange(K).repeat(20)
    tight = W[y] * 2 + 1.0 + 1e-3 * torch.randn(len(y), D, generator=g)  # a shared offset does not matter
    loose = torch.randn(len(y), D, generator=g)
    assert nc1(tight, y, K) < 1e-4 < nc1(loose, y, K)
    assert nc2(tight, y, K) < 1e-3
    assert nc2(loose, y, K) > 0.1
    cos = class_mean_cosines(tight, y, K)
    torch.testing.assert_close(cos, etf_gram(K, dtype=torch.float64), atol=1e-3, rtol=0)


def test_nc1_matches_formula():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(30, 3, generator=g, dtype=torch.float64)
    y = torch.arange(3).repeat(10)
    mu = torch.stack([h[y == k].mean(0) for k in range(3)])
    sw = sum(torch.outer(h[i] - mu[y[i]], h[i] - mu[y[i]]) for i in range(30)) / 30
    c = mu - mu.mean(0)
    sb = c.T @ c / 3
    expect = torch.trace(sw @ torch.linalg.pinv(sb)) / 3
    assert nc1(h, y, 3) == pytest.approx(float(expect), rel=1e-6)


def test_metrics_skip_absent_classes():
    W = simplex_etf(3, 4)
    y = torch.tensor([0, 0, 2, 2])
    h = W[y]
    assert nc2(h, y, 4) < 1e-6  # two present classes: antipodal means are the 2-class ETF
    assert torch.isnan(class_mean_cosines(h, y, 4)[1]).all()
