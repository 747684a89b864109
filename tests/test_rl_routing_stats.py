"""rl.routing_stats: per-token-type routed fractions count valid tokens only and add up to the layer's k."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rl.models import DecisionMixer, DecisionTransformer, DMConfig, DTConfig
from rl.routing_stats import TOKEN_TYPES, main, routing_fractions


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def _batch(rng, B, T, S=11, A=3, valid_len=None):
    valid = torch.ones(B, T, dtype=torch.bool)
    if valid_len is not None:
        for b, n in enumerate(valid_len):
            valid[b, n:] = False
    return {"states": torch.from_numpy(rng.normal(size=(B, T, S)).astype(np.float32)),
            "actions": torch.from_numpy(rng.uniform(-1, 1, size=(B, T, A)).astype(np.float32)),
            "returns": torch.from_numpy(rng.uniform(0, 3, size=(B, T, 1)).astype(np.float32)),
            "timesteps": torch.arange(T).expand(B, T).clone(), "valid": valid}


def test_topk_fractions_add_up_to_the_fixed_capacity_on_valid_tokens():
    rng = np.random.default_rng()
    torch.manual_seed(int(rng.integers(1 << 31)))
    T = 6
    model = DecisionMixer(DMConfig(state_dim=11, act_dim=3, context=T, embed_dim=32, num_heads=2, num_layers=3,
                                   routed_layers=(0, 2), capacity=0.5, learn_capacity=False, dropout=0.0))
    # half the rows right-padded after 4 of 6 timesteps: 12 valid tokens there, k = 6; 18 and k = 9 elsewhere
    batch = _batch(rng, 8, T, valid_len=[6, 4] * 4)
    fr = routing_fractions(model, batch)
    assert set(fr) == {"topk", "prefix", "aux"} and all(len(v) == 2 for v in fr.values())
    for layer in fr["topk"]:
        assert set(layer) == set(TOKEN_TYPES) and all(0.0 <= x <= 1.0 for x in layer.values())
        # every type has the same number of valid tokens, so the mean over types is kept / valid = 0.5 exactly;
        # counting padded positions would give (4*9 + 4*6) / (8*18) = 0.42
        assert np.mean(list(layer.values())) == pytest.approx(0.5, abs=1e-6)
    # the fractions are those of the layer masks themselves
    _, infos = model(batch["states"], batch["actions"], batch["returns"], batch["timesteps"],
                     valid_BT=batch["valid"], mode="aux")
    v = batch["valid"].repeat_interleave(3, 1)
    for info, layer in zip(infos, fr["aux"]):
        assert layer["state"] == pytest.approx(float((info.mask & v)[:, 1::3].sum() / v[:, 1::3].sum()))


def test_errors_for_a_plain_dt_and_unknown_modes():
    dt = DecisionTransformer(DTConfig(state_dim=11, act_dim=3, context=4, embed_dim=16, num_layers=1))
    with pytest.raises(ValueError, match="no routed layers"):
        routing_fractions(dt, _batch(np.random.default_rng(), 2, 4))
    dm = DecisionMixer(DMConfig(state_dim=11, act_dim=3, context=4, embed_dim=16, num_heads=1, num_layers=2,
                                routed_layers=(1,)))
    with pytest.raises(ValueError, match="accepted: 'topk', 'prefix', 'aux'"):
        routing_fractions(dm, _batch(np.random.default_rng(), 2, 4), modes=("soft",))


def test_cli_on_a_trained_checkpoint(tmp_path, capsys):
    from rl.data import save_dataset
    from rl.train import TrainConfig, train
    from tests.test_rl_train import TINY, _hopper_like

    rng = np.random.default_rng()
    path = save_dataset(tmp_path / "d.npz", _hopper_like(rng))
    train(TrainConfig(algo="dm", steps=2, seed=0, batch_size=4, log_every=1, eval_episodes=0, warmup_steps=1),
          path, tmp_path / "run", model_overrides=dict(TINY, routed_layers=(1,)), progress=False)
    assert main(["--checkpoint", str(tmp_path / "run"), "--dataset", str(path), "--segments", "16",
                 "--json", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "topk   layer 1:" in out and "prefix layer 1:" in out and "aux    layer 1:" in out
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["routed_layers"] == [1] and set(d["fractions"]["topk"][0]) == set(TOKEN_TYPES)
    with pytest.raises(SystemExit) as e:  # refused when parsed: argparse's usage error
        main(["--checkpoint", str(tmp_path / "run"), "--dataset", str(path), "--segments", "0"])
    assert e.value.code == 2
