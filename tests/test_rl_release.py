"""Decision Mixer against the released code (tests/fixtures/rl: numbers from ruthless-man/Decision-Mixer's DM/DM.py).

The reference preset (``rl.release.reference_config``) loaded with the release's weights must reproduce the
release's forward pass: action predictions, router scores, auxiliary logits within 1e-5, the same selected tokens
per routed layer, the same capacities ``k`` and auxiliary loss. Each fix of this project is one field; each test
below flips one field of the preset and checks the change it is meant to make, and nothing else.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from core.routing import RoutedBlock, RoutingConfig
from rl.models import DecisionMixer
from rl.release import load_release_state_dict, reference_config

FIX = Path(__file__).parent / "fixtures" / "rl"
pytestmark = pytest.mark.usefixtures("one_torch_thread")
TOL = 1e-5


@pytest.fixture(scope="module")
def release():
    from safetensors.torch import load_file

    meta = json.loads((FIX / "dm_cases.json").read_text())
    return meta, load_file(str(FIX / "dm_release_weights.safetensors")), load_file(str(FIX / "dm_cases.safetensors"))


def _model(release, **fixes) -> DecisionMixer:
    meta, weights, _ = release
    c = meta["config"]
    cfg = reference_config(state_dim=c["state_dim"], act_dim=c["act_dim"], context=c["K"], embed_dim=c["hidden"],
                           num_layers=c["n_layer"], num_heads=c["n_head"], dropout=0.0, max_ep_len=c["max_ep_len"],
                           return_scale=1.0, **fixes)
    return load_release_state_dict(DecisionMixer(cfg), weights)


def _run(model, cases, mode, T=None):
    model.train(mode == "train")
    T = T or cases["states"].shape[1]
    return model(cases["states"][:, :T], cases["actions"][:, :T], cases["returns_to_go"][:, :T],
                 cases["timesteps"][:, :T])


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_reference_preset_reproduces_the_release(release, mode):
    meta, _, cases = release
    model = _model(release)
    pred, infos = _run(model, cases, mode)
    assert meta["routed_layers"] == list(model.config.routed_layers) == [1, 3]
    assert len(infos) == 2
    assert (pred - cases[f"{mode}.action_preds"]).abs().max() < TOL
    S = meta["seq_len"]
    for j, info in enumerate(infos):
        key = f"{mode}.layer{j}"
        assert (info.scores - cases[f"{key}.router_scores"]).abs().max() < TOL
        logits = cases[f"{key}.aux_logits"]  # the release's two classes -> one logit l1 - l0
        assert (info.aux_logits - (logits[..., 1] - logits[..., 0])).abs().max() < TOL
        assert torch.equal(info.mask, cases[f"{key}.selected"].bool()), key
        if mode == "train":
            k = torch.floor(info.capacity * S).long()  # the capacity the release cast with .long()
            assert torch.equal(k, cases[f"{key}.k"]), key
            assert abs(float(info.aux_loss.detach()) - float(cases[f"{key}.aux_loss"])) < TOL
    # the fixture exercises the cases the fixes are about: strict '>' kept k - 1 tokens; a sample routed none
    train_sel = [cases[f"train.layer{j}.selected"].sum(-1) for j in range(2)]
    assert all(torch.equal(s, cases[f"train.layer{j}.k"] - 1) for j, s in enumerate(train_sel))
    assert (cases["eval.layer1.selected"].sum(-1) == 0).any()


def test_fix_exact_k_keeps_the_kth_token(release):
    _, _, cases = release
    ref_pred, ref = _run(_model(release), cases, "train")
    pred, fixed = _run(_model(release, strict_threshold=False), cases, "train")
    # layer 0 sees the same input: the fix adds exactly the token with the k-th highest score
    k = cases["train.layer0.k"]
    assert torch.equal(fixed[0].mask.sum(-1), k)
    added = fixed[0].mask & ~ref[0].mask
    assert torch.equal(added.sum(-1), torch.ones_like(k)) and not (ref[0].mask & ~fixed[0].mask).any()
    kth = torch.sort(ref[0].scores, -1, descending=True).values.gather(-1, (k - 1)[:, None])
    assert torch.equal(ref[0].scores[added], kth.squeeze(-1))
    assert (pred - ref_pred).abs().max() > 1e-3


def test_fix_capacity_gradient_keeps_the_forward_and_trains_the_predictor(release):
    _, _, cases = release
    grads = {}
    for flag in (False, True):
        model = _model(release, capacity_gradient=flag)
        pred, infos = _run(model, cases, "train")
        pred.square().sum().backward()
        grads[flag] = pred.detach(), [model.blocks[i].capacity_predictor.net[0].weight.grad for i in (1, 3)]
    assert torch.equal(grads[False][0], grads[True][0])  # straight-through: the same forward values
    assert all(g is None or g.abs().max() == 0 for g in grads[False][1])  # the release's .long(): no gradient
    assert all(g is not None and g.abs().max() > 0 for g in grads[True][1])


def test_fix_capacity_from_the_mean_token_runs_any_length(release):
    _, _, cases = release
    with pytest.raises(ValueError, match="built for 12 tokens, got a sequence of 9"):
        _run(_model(release), cases, "train", T=3)  # the release wires the capacity input to 3 K tokens
    model = DecisionMixer(reference_config(state_dim=3, act_dim=2, context=4, embed_dim=16, num_layers=4,
                                           num_heads=2, dropout=0.0, max_ep_len=50, capacity_input="mean"))
    assert model.blocks[1].capacity_predictor.net[0].in_features == 16
    pred, infos = _run(model, cases, "train", T=3)
    assert pred.shape == (4, 3, 2) and infos[0].mask.shape == (4, 9)


def test_fix_round_capacity(release):
    _, _, cases = release
    _, ref = _run(_model(release), cases, "train")
    _, fixed = _run(_model(release, capacity_rounding="round"), cases, "train")
    c = ref[0].capacity * 12
    assert torch.equal(fixed[0].mask.sum(-1), torch.round(c).long() - 1)  # strict threshold still on
    assert torch.equal(ref[0].mask.sum(-1), torch.floor(c).long() - 1)
    assert not torch.equal(torch.round(c), torch.floor(c))  # the fixture has fractions >= .5


class _Affine(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):  # per-token (trivially causal)
        return x + self.lin(x)


@pytest.mark.parametrize("update", ["scaled_block", "gated_residual"])
def test_routed_update_forms(update):
    torch.manual_seed(0)
    cfg = RoutingConfig.reference(dim=8, seq_len=10, update=update)
    m = RoutedBlock(_Affine(8), cfg).train()
    x = torch.randn(3, 10, 8)
    y, info = m(x)
    s, sel = info.scores[..., None], info.mask[..., None]
    f = m.block(x)
    want = s * f if update == "scaled_block" else x + torch.sigmoid(s) * (f - x)
    assert torch.allclose(torch.where(sel, y, x), torch.where(sel, want, x), atol=1e-6)
    assert torch.equal(y[~info.mask], x[~info.mask])
    assert info.mask.any() and (~info.mask).any()


def test_aux_activation_and_widths_follow_the_release(release):
    model = _model(release)
    aux = model.blocks[1].aux.net
    assert isinstance(aux[1], nn.SiLU) and aux[0].out_features == 8  # D // 2
    assert model.blocks[1].capacity_predictor.net[0].out_features == 512
    assert isinstance(model.blocks[1].capacity_predictor.net[1], nn.LeakyReLU)
    assert isinstance(_model(release, aux_activation="gelu").blocks[1].aux.net[1], nn.GELU)


def test_load_names_missing_and_left_over_keys(release):
    _, weights, _ = release
    model = DecisionMixer(reference_config(state_dim=3, act_dim=2, context=4, embed_dim=16, num_layers=4,
                                           num_heads=2, max_ep_len=50))
    short = {k: v for k, v in weights.items() if k != "transformer.h.3.block.ln_2.bias"}
    with pytest.raises(ValueError, match="transformer.h.3.block.ln_2.bias"):
        load_release_state_dict(model, short)
    with pytest.raises(ValueError, match="no place in the model: \\['extra.weight'\\]"):
        load_release_state_dict(model, {**weights, "extra.weight": torch.zeros(1)})
    other = DecisionMixer(reference_config(state_dim=3, act_dim=2, context=4, embed_dim=16, num_layers=4,
                                           num_heads=2, max_ep_len=50, routed_layers=(1,)))
    with pytest.raises(ValueError, match="routes layers \\[1, 3\\], the model \\[1\\]"):
        load_release_state_dict(other, weights)


def test_reference_config_validation():
    with pytest.raises(ValueError, match="capacity_input='flatten' has no causal form"):
        RoutingConfig.reference(dim=8, seq_len=6, train_selection="prefix")
    with pytest.raises(ValueError, match="capacity_rounding must be one of"):
        RoutingConfig.reference(dim=8, seq_len=6, capacity_rounding="ceil")
    with pytest.raises(ValueError, match="needs seq_len > 0"):
        RoutingConfig(dim=8, capacity_input="flatten")
    with pytest.raises(ValueError, match="routed_update must be one of"):
        reference_config(state_dim=3, act_dim=2, routed_update="scaled")
