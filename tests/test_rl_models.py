"""rl.models: shapes, exact routing inside the model, causality at evaluation, capacity gradient."""

from __future__ import annotations

import pytest
import torch

from rl import DecisionMixer, DecisionTransformer, DMConfig, DTConfig


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def _inputs(B, T, S=11, A=3):
    return (torch.randn(B, T, S), torch.rand(B, T, A) * 2 - 1, torch.randn(B, T, 1) * 100,
            torch.randint(0, 900, (B, 1)) + torch.arange(T))


def _dm(**kw):
    base = dict(state_dim=11, act_dim=3, context=8, embed_dim=32, num_heads=2, num_layers=4, routed_layers=(1, 3),
                dropout=0.0)
    base.update(kw)
    return DecisionMixer(DMConfig(**base))


def test_shapes_and_any_context_length():
    m = _dm().eval()
    for T in (1, 5, 8, 13):
        pred, infos = m(*_inputs(2, T))
        assert pred.shape == (2, T, 3)
        assert len(infos) == 2 and infos[0].mask.shape == (2, 3 * T)
    dt = DecisionTransformer(DTConfig(state_dim=11, act_dim=3, embed_dim=48, num_heads=3, num_layers=2)).eval()
    pred, infos = dt(*_inputs(3, 6))
    assert pred.shape == (3, 6, 3) and infos == []
    assert pred.abs().max() <= 1.0


def test_topk_routes_exactly_k_valid_tokens_and_never_padding():
    m = _dm().train()
    s, a, r, t = _inputs(4, 8)
    valid = torch.ones(4, 8, dtype=torch.bool)
    valid[1, 5:] = False
    valid[3, 2:] = False
    _, infos = m(s, a, r, t, valid_BT=valid, mode="topk")
    n_valid = valid.sum(-1) * 3
    for info in infos:
        k = torch.round(info.capacity.detach() * n_valid).long().clamp(min=1)
        assert info.mask.sum(-1).tolist() == k.tolist()
        assert not (info.mask & ~valid.repeat_interleave(3, 1)).any()


def test_capacity_predictors_get_gradient_from_the_action_loss():
    m = _dm().train()
    s, a, r, t = _inputs(4, 8)
    pred, infos = m(s, a, r, t, mode="topk")
    ((pred - a) ** 2).mean().backward()
    for blk in (m.blocks[1], m.blocks[3]):
        g = sum(p.grad.abs().sum() for p in blk.capacity_predictor.parameters() if p.grad is not None)
        assert g > 0


@pytest.mark.parametrize("algo", ["dm", "dt"])
def test_evaluation_policy_is_causal(algo):
    """Changing later timesteps never changes earlier actions or routing decisions."""
    if algo == "dm":
        m = _dm()
        for blk in (m.blocks[1], m.blocks[3]):  # aux predictors select about half of the tokens
            torch.nn.init.normal_(blk.aux.net[2].weight, std=1.0)
            torch.nn.init.zeros_(blk.aux.net[2].bias)
    else:
        m = DecisionTransformer(DTConfig(state_dim=11, act_dim=3, embed_dim=32, num_heads=2, num_layers=2))
    m.eval()
    s, a, r, t = _inputs(3, 10)
    with torch.no_grad():
        p1, i1 = m(s, a, r, t)
        j = 4
        s2, a2, r2 = s.clone(), a.clone(), r.clone()
        s2[:, j + 1:] += torch.randn_like(s2[:, j + 1:])
        a2[:, j:] = torch.rand_like(a2[:, j:])  # a_j comes after s_j
        r2[:, j + 1:] *= -1
        p2, i2 = m(s2, a2, r2, t)
    torch.testing.assert_close(p1[:, : j + 1], p2[:, : j + 1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(p1[:, j + 1:], p2[:, j + 1:])
    for x, y in zip(i1, i2):
        assert x.mode == "aux"
        assert torch.equal(x.mask[:, : 3 * j + 2], y.mask[:, : 3 * j + 2])
        assert 0 < x.mask.sum() < x.mask.numel()


def test_config_validation():
    with pytest.raises(ValueError, match="routed_layers \\[6\\] out of range"):
        DMConfig(state_dim=3, act_dim=1, num_layers=6, routed_layers=(1, 6))
    with pytest.raises(ValueError, match="num_heads \\(3\\) must divide embed_dim \\(32\\)"):
        DTConfig(state_dim=3, act_dim=1, embed_dim=32, num_heads=3)
    with pytest.raises(ValueError, match="capacity"):
        DMConfig(state_dim=3, act_dim=1, capacity=0.05, min_capacity=0.1)


def test_prefix_training_selection_is_causal_and_topk_is_not():
    """In training, top-k over the whole segment lets later tokens (the action a state must predict among them)
    decide whether a state token is routed; ``train_selection="prefix"`` keeps every decision and prediction
    causal, and the trainer uses it."""
    from rl.train import Trainer, TrainConfig

    torch.manual_seed(11)
    s, a, r, t = _inputs(4, 8)
    j = 3
    s2, a2, r2 = s.clone(), a.clone(), r.clone()
    s2[:, j + 1:] += 3 * torch.randn_like(s2[:, j + 1:])
    a2[:, j:] = torch.rand_like(a2[:, j:]) * 2 - 1
    r2[:, j + 1:] *= -1
    leaked = False
    for selection in ("prefix", "topk"):
        torch.manual_seed(12)
        m = _dm(train_selection=selection).train()
        with torch.no_grad():
            for blk in (m.blocks[1], m.blocks[3]):  # capacity depends on the tokens seen
                torch.nn.init.normal_(blk.capacity_predictor.net[2].weight, std=1.0)
        p1, i1 = m(s, a, r, t)
        p2, i2 = m(s2, a2, r2, t)
        same = all(torch.equal(x.mask[:, : 3 * j + 2], y.mask[:, : 3 * j + 2]) for x, y in zip(i1, i2))
        if selection == "prefix":
            assert all(x.mode == "prefix" for x in i1)
            assert same
            torch.testing.assert_close(p1[:, : j + 1], p2[:, : j + 1], rtol=1e-5, atol=1e-5)
            batch = {"states": s, "actions": a, "returns": r, "timesteps": t, "valid": torch.ones(4, 8, dtype=torch.bool)}
            got = Trainer(m, TrainConfig(algo="dm"), sampler=None).loss(batch)[1]["action_mse"]
            with torch.no_grad():
                want = {mode: float(((m(s, a, r, t, mode=mode)[0] - a) ** 2).mean()) for mode in ("prefix", "topk")}
            assert got == pytest.approx(want["prefix"], rel=1e-5) and got != pytest.approx(want["topk"], rel=1e-5)
        else:
            leaked = not same
    assert leaked, "top-k over the segment should let later tokens change earlier routing"


def test_probe_tokens_and_train_selection_are_saved_and_legacy_configs_load():
    from rl.models import config_from_dict, config_to_dict

    cfg = DMConfig(state_dim=11, act_dim=3, probe_tokens=2, train_selection="prefix")
    back = config_from_dict("dm", config_to_dict(cfg))
    assert back.probe_tokens == 2 and back.train_selection == "prefix"
    legacy = config_to_dict(DMConfig(state_dim=11, act_dim=3))
    del legacy["probe_tokens"], legacy["train_selection"]
    old = config_from_dict("dm", legacy)  # saved before the options: one-sided gradient, top-k
    assert old.probe_tokens == 0 and old.train_selection == "topk"
    with pytest.raises(ValueError, match="train_selection"):
        DMConfig(state_dim=3, act_dim=1, train_selection="causal")
