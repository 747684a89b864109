"""rl.train --preset: ``reference`` trains the released routed layer (rl.release), ``project`` this project's.

The reference preset must build the release's routing (and reproduce its forward pass on the committed fixture),
train without a gradient to the capacity predictor, refuse in one line a setting it cannot take, be recorded
with the run, and never resume or share outputs with a run of the other preset (rl.train and benchmarks.rl_bench).
"""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch

from core.routing import RoutedBlock
from rl.data import save_dataset
from rl.models import DecisionMixer, DMConfig
from rl.release import REFERENCE_ROUTING, load_release_state_dict, preset_overrides, reference_config
from rl.train import SegmentSampler, Trainer, TrainConfig, build_parser, main, train
from tests.test_rl_train import _hopper_like

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIX = Path(__file__).parent / "fixtures" / "rl"
TINY = dict(context=6, embed_dim=32, num_heads=2, num_layers=2, dropout=0.0, routed_layers=(1,))
COMMON = dict(algo="dm", seed=0, batch_size=4, log_every=1, eval_episodes=0, checkpoint_every=1, warmup_steps=1)


@pytest.fixture
def dataset(tmp_path):
    return save_dataset(tmp_path / "d.npz", _hopper_like(np.random.default_rng(0)))


def test_cli_parses_the_preset():
    base = ["--algo", "dm", "--dataset", "d.npz", "--steps", "1", "--out", "o"]
    assert build_parser().parse_args(base).preset == "project"
    assert build_parser().parse_args(base + ["--preset", "reference"]).preset == "reference"
    with pytest.raises(SystemExit):
        build_parser().parse_args(base + ["--preset", "release"])


@pytest.mark.parametrize("extra, message", [
    (["--train-selection", "prefix"], "no causal prefix form"),
    (["--probe-tokens", "4"], "probe_tokens=0"),
    (["--capacity", "0.3"], "capacity=0.5"),
])
def test_cli_refuses_what_the_reference_preset_cannot_take(tmp_path, dataset, capsys, extra, message):
    from core.infra.cli import run_cli

    argv = ["--algo", "dm", "--dataset", str(dataset), "--steps", "1", "--out", str(tmp_path / "o"), "--eval-episodes",
            "0", "--context", "6", "--embed-dim", "32", "--layers", "2", "--routed-layers", "1",
            "--preset", "reference"]
    assert run_cli(main, argv + extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0] and "preset 'project'" in err[0]
    assert not (tmp_path / "o").exists()  # refused before any work
    assert run_cli(main, ["--algo", "dt"] + argv[2:]) == 2
    assert "--algo dm only" in capsys.readouterr().err


@pytest.mark.parametrize("preset", ["project", "reference"])
def test_cli_trains_under_the_preset_it_is_given(tmp_path, dataset, preset):
    from core.infra.cli import run_cli

    argv = ["--algo", "dm", "--dataset", str(dataset), "--steps", "1", "--out", str(tmp_path / "o"), "--eval-episodes",
            "0", "--context", "6", "--embed-dim", "32", "--layers", "2", "--routed-layers", "1", "--batch-size", "4"]
    assert run_cli(main, argv + ["--preset", preset]) == 0
    info = json.loads((tmp_path / "o" / "config.json").read_text())
    assert info["preset"] == preset and info["model"]["capacity_gradient"] == (preset == "project")


def test_preset_overrides_keep_the_shape_and_set_the_release_routing():
    shape = dict(context=6, embed_dim=32, num_heads=2, num_layers=4, routed_layers=(1, 3))
    assert preset_overrides("project", shape, embed_dim=32) == shape
    ref = DMConfig(state_dim=3, act_dim=2, **preset_overrides("reference", shape, embed_dim=32))
    want = reference_config(state_dim=3, act_dim=2, **shape)
    assert {k: getattr(ref, k) for k in REFERENCE_ROUTING} == {k: getattr(want, k) for k in REFERENCE_ROUTING}
    assert (ref.context, ref.embed_dim, ref.num_layers, ref.routed_layers) == (6, 32, 4, (1, 3))
    assert ref.aux_hidden == 16 and not ref.capacity_gradient and ref.strict_threshold
    with pytest.raises(ValueError, match="preset must be one of"):
        preset_overrides("release", shape, embed_dim=32)


def test_reference_preset_reproduces_the_release_fixture():
    """The model rl.train builds under --preset reference, given the release's weights, computes its forward."""
    from safetensors.torch import load_file

    meta = json.loads((FIX / "dm_cases.json").read_text())
    cases = load_file(str(FIX / "dm_cases.safetensors"))
    c = meta["config"]
    shape = dict(context=c["K"], embed_dim=c["hidden"], num_layers=c["n_layer"], num_heads=c["n_head"],
                 dropout=0.0, max_ep_len=c["max_ep_len"], return_scale=1.0, routed_layers=tuple(meta["routed_layers"]))
    cfg = DMConfig(state_dim=c["state_dim"], act_dim=c["act_dim"],
                   **preset_overrides("reference", shape, embed_dim=c["hidden"]))
    model = load_release_state_dict(DecisionMixer(cfg), load_file(str(FIX / "dm_release_weights.safetensors")))
    model.train()
    pred, infos = model(cases["states"], cases["actions"], cases["returns_to_go"], cases["timesteps"])
    assert (pred - cases["train.action_preds"]).abs().max() < 1e-5
    for j, info in enumerate(infos):
        assert torch.equal(info.mask, cases[f"train.layer{j}.selected"].bool())


@pytest.mark.parametrize("preset", ["project", "reference"])
def test_capacity_predictor_gets_a_gradient_only_under_the_project_preset(preset):
    ds = _hopper_like(np.random.default_rng(1))
    torch.manual_seed(0)
    model = DecisionMixer(DMConfig(state_dim=11, act_dim=3, **preset_overrides(preset, TINY, embed_dim=32)))
    model.set_state_normalization(ds.observations.mean(0), ds.observations.std(0))
    tr = Trainer(model, TrainConfig(algo="dm", preset=preset, lr=1e-2, warmup_steps=1), SegmentSampler(ds, 6, seed=0))
    m = tr.train_step(tr.sampler.sample(16))  # one full step runs
    assert np.isfinite(m["loss"]) and 0.0 < m["routed_fraction"] <= 1.0
    loss, _ = tr.loss(tr.sampler.sample(16))
    tr.opt.zero_grad(set_to_none=True)
    loss.backward()
    grads = [p.grad for p in model.blocks[1].capacity_predictor.parameters()]
    got = any(g is not None and g.abs().max() > 0 for g in grads)
    assert got == (preset == "project")  # the release casts k with .long(): nothing reaches the predictor
    router = model.blocks[1].router.proj.weight.grad
    assert router is not None and router.abs().max() > 0  # the router learns under both


@pytest.mark.parametrize("preset", ["project", "reference"])
def test_a_training_run_under_each_preset_records_it(tmp_path, dataset, preset):
    train(TrainConfig(steps=2, preset=preset, **COMMON), dataset, tmp_path / "run", model_overrides=TINY,
          progress=False)
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert info["preset"] == info["train"]["preset"] == preset
    st = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert st["train_config"]["preset"] == preset
    from rl.evaluate import load_policy

    model, _ = load_policy(tmp_path / "run")
    block = next(b for b in model.blocks if isinstance(b, RoutedBlock))
    ref = preset == "reference"
    assert (block.config.capacity_gradient, block.config.strict_threshold) == (not ref, ref)
    assert block.config.capacity_input == ("flatten" if ref else "mean")
    assert block.config.update == ("scaled_block" if ref else "gated_residual")
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 2 and np.all(np.isfinite(losses))


def test_a_reference_run_refuses_to_act_with_prefix_selection(tmp_path, dataset, capsys):
    from core.infra.cli import run_cli
    from rl.evaluate import heldout_action_mse, load_policy, main as evaluate_main, rollout

    train(TrainConfig(steps=1, preset="reference", **COMMON), dataset, tmp_path / "run", model_overrides=TINY,
          progress=False)
    model, _ = load_policy(tmp_path / "run")
    with pytest.raises(ValueError, match="no causal prefix form"):
        rollout(model, "Hopper-v5", target_return=100.0, routing="prefix")
    with pytest.raises(ValueError, match="no causal prefix form"):
        heldout_action_mse(model, _hopper_like(np.random.default_rng(0)).trajectories(), routing="prefix")
    argv = ["--checkpoint", str(tmp_path / "run"), "--episodes", "1", "--routing", "prefix"]
    assert run_cli(evaluate_main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no causal prefix form" in err[0] and "use 'aux'" in err[0]


def test_a_run_of_one_preset_is_never_resumed_as_the_other(tmp_path, dataset):
    train(TrainConfig(steps=1, **COMMON), dataset, tmp_path / "run", model_overrides=TINY, progress=False)
    with pytest.raises(ValueError, match="preset 'project', not 'reference'"):
        train(TrainConfig(steps=2, preset="reference", **COMMON), dataset, tmp_path / "run", model_overrides=TINY,
              resume=True, progress=False)
    with pytest.raises(ValueError, match="already holds a run"):
        train(TrainConfig(steps=2, preset="reference", **COMMON), dataset, tmp_path / "run", model_overrides=TINY,
              progress=False)
    with pytest.raises(ValueError, match="applies to algo 'dm' only"):
        TrainConfig(algo="dt", preset="reference")


def test_benchmark_cases_of_the_two_presets_never_share_a_run(tmp_path, dataset):
    from benchmarks.rl_bench import _run_ours, build_parser as bench_parser, case_settings

    args = Namespace(context=6, segment_anchor="start", embed_dim=16, heads=1, dm_layers=2, dt_layers=2,
                     routed_layers="1", capacity_cost=None, steps=2, batch_size=4, lr=1e-3, warmup=1, eval_episodes=1)
    project = case_settings("dm", bench_parser().parse_args([]))
    assert "preset" not in project  # cases recorded before the option keep matching
    assert case_settings("dm", bench_parser().parse_args(["--preset", "reference"]))["preset"] == "reference"
    for preset in ("project", "reference"):
        _run_ours("dm", dataset, 0, Namespace(**vars(args), preset=preset), tmp_path / "work")
    runs = sorted((tmp_path / "work").iterdir())
    assert len(runs) == 2
    assert sorted(json.loads((r / "config.json").read_text())["preset"] for r in runs) == ["project", "reference"]


def test_preset_summary_pairs_the_seeds():
    from benchmarks.rl_preset import summarize

    def case(score, mse):
        return {"score": score, "heldout_mse": mse, "routed_fraction": 0.5, "cpu_sec_per_1k_steps": 100.0}

    cases = {"project": {s: case(10.0 + s, 0.1) for s in range(4)},
             "reference": {s: case(8.0 + s + (s % 2), 0.1 + 0.01 * s) for s in range(5)}}
    out = summarize(cases, bootstrap=200)
    d = out["reference - project"]["score"]
    assert d["seeds"] == [0, 1, 2, 3] and d["per_seed"] == [-2.0, -1.0, -2.0, -1.0]
    assert d["mean"] == pytest.approx(-1.5) and d["t_lo"] < -1.5 < d["t_hi"]
    assert out["presets"]["reference"]["score"]["n"] == 5
