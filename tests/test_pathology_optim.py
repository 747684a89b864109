"""pathology.optim: Lookahead's update rule, TransMIL's RAdam + Lookahead, and TrainConfig's optimizer switch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pathology.optim import Lookahead, build_optimizer
from pathology.training import TrainConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sgd_run(steps: int, *, alpha: float, k: int, lookahead: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(5))
    target = torch.randn(5)
    inner = torch.optim.SGD([w], lr=0.1)
    opt = Lookahead(inner, alpha=alpha, k=k) if lookahead else inner
    if lookahead:
        opt.remember_start()
    seen = [w.detach().clone()]
    for _ in range(steps):
        opt.zero_grad()
        ((w - target) ** 2).sum().backward()
        opt.step()
        seen.append(w.detach().clone())
    return target, seen


def test_lookahead_moves_the_slow_weights_alpha_of_the_way_every_k_steps():
    k, alpha = 3, 0.5
    _, plain = _sgd_run(k, alpha=alpha, k=k, lookahead=False)
    _, la = _sgd_run(2 * k, alpha=alpha, k=k, lookahead=True)
    # the first k - 1 steps are the inner optimiser's own
    for i in range(k):
        torch.testing.assert_close(la[i], plain[i])
    # after step k: φ ← φ0 + α (θ_k − φ0) and the fast weights restart there
    torch.testing.assert_close(la[k], plain[0] + alpha * (plain[k] - plain[0]))
    # the next sync starts from that point: one more k-step inner run from la[k], then the same rule
    w = nn.Parameter(la[k].clone())
    target, _ = _sgd_run(0, alpha=alpha, k=k, lookahead=False)
    inner = torch.optim.SGD([w], lr=0.1)
    for _ in range(k):
        inner.zero_grad()
        ((w - target) ** 2).sum().backward()
        inner.step()
    torch.testing.assert_close(la[2 * k], la[k] + alpha * (w.detach() - la[k]))
    with pytest.raises(ValueError, match="alpha"):
        Lookahead(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), alpha=0.0)
    with pytest.raises(ValueError, match="k"):
        Lookahead(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), k=0)


def test_radam_lookahead_decays_matrices_only_and_trainconfig_checks_the_names():
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))
    opt = build_optimizer("radam_lookahead", model, lr=2e-4, weight_decay=1e-5)
    assert isinstance(opt, Lookahead) and isinstance(opt.base, torch.optim.RAdam)
    assert (opt.alpha, opt.k) == (0.5, 6)
    decay = {id(p): g["weight_decay"] for g in opt.param_groups for p in g["params"]}
    assert all(decay[id(p)] == (1e-5 if p.ndim == 2 else 0.0) for p in model.parameters())
    assert all(g["lr"] == 2e-4 and g["decoupled_weight_decay"] for g in opt.param_groups)
    assert isinstance(build_optimizer("adamw", model, lr=1e-3, weight_decay=0.05), torch.optim.AdamW)
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        build_optimizer("sgd", model, lr=1e-3, weight_decay=0.0)
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="adam")
    with pytest.raises(ValueError, match="schedule"):
        TrainConfig(schedule="step")


def test_train_model_uses_the_optimizer_and_a_constant_schedule(monkeypatch):
    import pathology.training as tr
    from tests.test_pathology_train import planted_cohort

    built = []
    real = tr.build_optimizer

    def spy(name, model, lr, weight_decay):
        built.append(name)
        return real(name, model, lr, weight_decay)

    monkeypatch.setattr(tr, "build_optimizer", spy)
    bags = planted_cohort(8, lo=40, hi=60, d=8)
    cfg = tr.QuerentConfig(in_dim=8, dim=8, depth=1, num_heads=1, pool_hidden=8, num_classes=2)
    _, info = tr.train_model("abmil", cfg, bags, TrainConfig(epochs=3, lr=1e-3, optimizer="radam_lookahead",
                                                             schedule="constant", batch_slides=4))
    assert built == ["radam_lookahead"]
    assert [h["lr"] for h in info["history"]] == [1e-3] * 3
    _, info = tr.train_model("abmil", cfg, bags, TrainConfig(epochs=3, lr=1e-3, batch_slides=4))
    assert built[-1] == "adamw" and info["history"][-1]["lr"] < 1e-3  # cosine decay
