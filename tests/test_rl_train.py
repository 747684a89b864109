"""rl.train: loss goes down on a tiny dataset, resume equals an uninterrupted run, bad datasets stop early."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rl.data import OfflineDataset, save_dataset
from rl.train import SegmentSampler, Trainer, TrainConfig, train

TINY = dict(context=6, embed_dim=32, num_heads=2, num_layers=2, dropout=0.1)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def _hopper_like(rng, n=400, episodes=5):
    """Actions are a fixed function of the state, so a policy can learn them."""
    obs = rng.normal(size=(n, 11)).astype(np.float32)
    W = rng.normal(size=(11, 3)).astype(np.float32)
    act = np.tanh(obs @ W * 0.5).astype(np.float32)
    terminals = np.zeros(n, bool)
    terminals[np.sort(rng.choice(np.arange(10, n - 1), episodes - 1, replace=False))] = True
    timeouts = np.zeros(n, bool)
    timeouts[-1] = True
    return OfflineDataset(observations=obs, actions=act, rewards=rng.uniform(0, 3, n).astype(np.float32),
                          terminals=terminals, timeouts=timeouts, metadata={"env": "Hopper-v5", "quality": "synthetic"})


@pytest.mark.parametrize("algo", ["dm", "dt"])
def test_a_few_steps_reduce_the_loss(algo):
    from rl.models import DMConfig, DTConfig, build_model

    rng = np.random.default_rng()
    ds = _hopper_like(rng)
    cfg_cls = DMConfig if algo == "dm" else DTConfig
    extra = {"routed_layers": (1,)} if algo == "dm" else {}
    model = build_model(algo, cfg_cls(state_dim=11, act_dim=3, **dict(TINY, dropout=0.0), **extra))
    model.set_state_normalization(ds.observations.mean(0), ds.observations.std(0))
    tr = Trainer(model, TrainConfig(algo=algo, lr=3e-3, warmup_steps=1, grad_clip=1.0), SegmentSampler(ds, 6, seed=1))
    fixed = SegmentSampler(ds, 6, seed=2).sample(64)
    with torch.no_grad():
        model.train()
        before = tr.loss(fixed)[1]["action_mse"]
    for _ in range(40):
        m = tr.train_step(tr.sampler.sample(32))
    with torch.no_grad():
        after = tr.loss(fixed)[1]["action_mse"]
    assert after < 0.6 * before
    if algo == "dm":
        assert 0.0 < m["routed_fraction"] <= 1.0 and "aux_loss" in m


@pytest.mark.parametrize("algo", ["dm", "dt"])
def test_resume_equals_uninterrupted(tmp_path, algo):
    rng = np.random.default_rng()
    path = save_dataset(tmp_path / "d.npz", _hopper_like(rng))
    seed = int(rng.integers(0, 1000))
    overrides = dict(TINY, routed_layers=(1,)) if algo == "dm" else TINY
    common = dict(algo=algo, seed=seed, batch_size=8, log_every=2, eval_episodes=0, checkpoint_every=3, warmup_steps=2)
    train(TrainConfig(steps=6, **common), path, tmp_path / "full", model_overrides=overrides, progress=False)
    train(TrainConfig(steps=3, **common), path, tmp_path / "split", model_overrides=overrides, progress=False)
    mid = load_file(str(tmp_path / "split" / "model.safetensors"))
    train(TrainConfig(steps=6, **common), path, tmp_path / "split", model_overrides=overrides, resume=True,
          progress=False)
    a = load_file(str(tmp_path / "full" / "model.safetensors"))
    b = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    assert any(not torch.equal(mid[k], b[k]) for k in a)  # training did continue
    la = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in la] == [r["step"] for r in lb] == [2, 4, 6]
    assert [r["loss"] for r in la] == pytest.approx([r["loss"] for r in lb], rel=1e-6)
    with pytest.raises(ValueError, match="--resume"):
        train(TrainConfig(steps=6, **common), path, tmp_path / "full", model_overrides=overrides, progress=False)


def test_bad_dataset_stops_before_training(tmp_path):
    rng = np.random.default_rng()
    ds = _hopper_like(rng)
    wrong = OfflineDataset(observations=rng.normal(size=(len(ds), 17)).astype(np.float32), actions=ds.actions,
                           rewards=ds.rewards, terminals=ds.terminals, timeouts=ds.timeouts,
                           metadata={"env": "Hopper-v5"})
    path = save_dataset(tmp_path / "w.npz", wrong)
    with pytest.raises(ValueError, match="observations have dim 17"):
        train(TrainConfig(steps=2), path, tmp_path / "out", model_overrides=TINY, progress=False)
    assert not (tmp_path / "out").exists()
    unknown = save_dataset(tmp_path / "u.npz", OfflineDataset(**ds.arrays(), metadata={"env": "Pong-v5"}))
    with pytest.raises(ValueError, match="names env 'Pong-v5'"):
        train(TrainConfig(steps=2), unknown, tmp_path / "out2", model_overrides=TINY, progress=False)
    np.savez(tmp_path / "nan.npz", **dict(ds.arrays(), rewards=np.full(len(ds), np.nan, np.float32)))
    with pytest.raises(ValueError, match="rewards contains"):
        train(TrainConfig(steps=2), tmp_path / "nan.npz", tmp_path / "out3", model_overrides=TINY, progress=False)


def test_benchmark_run_resumes_and_reports_the_whole_run(tmp_path):
    """rl_bench's runs checkpoint every 1,000 steps (or at the end), so a long benchmark spans several sittings:
    a rerun resumes the run, and the case reports the training records of the whole run, not only its tail."""
    from argparse import Namespace

    from benchmarks.rl_bench import _run_ours

    rng = np.random.default_rng(0)
    path = save_dataset(tmp_path / "d.npz", _hopper_like(rng))
    args = Namespace(context=6, segment_anchor="start", embed_dim=16, heads=1, dm_layers=2, dt_layers=2, routed_layers="1",
                     capacity_cost=None, steps=4, batch_size=8, lr=1e-3, warmup=1, eval_episodes=1)
    first = _run_ours("dm", path, 0, args, tmp_path / "work")
    args.steps = 8  # the same run, continued
    second = _run_ours("dm", path, 0, args, tmp_path / "work")
    (run,) = (tmp_path / "work").iterdir()
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 6, 8]  # log_every follows each part's step count
    assert second["routed_fraction"] == pytest.approx(np.mean([r["routed_fraction"] for r in recs[-2:]]))
    assert first["routed_fraction"] == pytest.approx(np.mean([r["routed_fraction"] for r in recs[2:4]]))
    assert np.isfinite(second["score"]) and second["cpu_sec_per_1k_steps"] > 0
    # A finished run is not retrained; its case is rebuilt from the log (nothing new was trained this time).
    third = _run_ours("dm", path, 0, args, tmp_path / "work")
    assert third["routed_fraction"] == pytest.approx(second["routed_fraction"])
    assert third["cpu_sec_per_1k_steps"] == pytest.approx(second["cpu_sec_per_1k_steps"])


@pytest.mark.parametrize("anchor", ["start", "end"])
def test_segment_anchor_sets_which_steps_every_segment_covers(anchor):
    """DT's sampling ("start") covers step t in min(t+1, K) segments; "end" covers it in min(K, L-t)."""
    rng = np.random.default_rng()
    n, K = 40, 6
    obs = np.arange(n, dtype=np.float32)[:, None].repeat(11, 1)
    ds = OfflineDataset(observations=obs, actions=np.zeros((n, 3), np.float32), rewards=np.ones(n, np.float32),
                        terminals=np.eye(1, n, n - 1, dtype=bool)[0], timeouts=np.zeros(n, bool),
                        metadata={"env": "Hopper-v5", "quality": "synthetic"})
    b = SegmentSampler(ds, K, seed=int(rng.integers(1000)), anchor=anchor).sample(4000)
    ts, valid = b["timesteps"].numpy(), b["valid"].numpy()
    lengths = valid.sum(1)
    assert (lengths >= 1).all() and (lengths <= K).all()
    for row, v, n_valid in zip(ts, valid, lengths):  # valid positions first, consecutive steps
        assert v[:n_valid].all() and not v[n_valid:].any()
        assert np.array_equal(row[:n_valid], np.arange(row[0], row[0] + n_valid))
    # observations follow the timesteps (the state equals its step index here)
    np.testing.assert_array_equal(b["states"][..., 0].numpy()[valid], ts[valid].astype(np.float32))
    counts = np.bincount(ts[valid], minlength=n) / 4000
    expected = np.array([min(t + 1, K) if anchor == "start" else min(K, n - t) for t in range(n)]) / n
    np.testing.assert_allclose(counts, expected, atol=0.03)
    with pytest.raises(ValueError, match="anchor must be 'start' or 'end'"):
        SegmentSampler(ds, K, seed=0, anchor="middle")


def test_resume_refuses_another_segment_anchor(tmp_path):
    path = save_dataset(tmp_path / "d.npz", _hopper_like(np.random.default_rng()))
    common = dict(algo="dt", seed=0, batch_size=4, log_every=1, eval_episodes=0, checkpoint_every=1, warmup_steps=1)
    train(TrainConfig(steps=1, **common), path, tmp_path / "run", model_overrides=TINY, progress=False)
    with pytest.raises(ValueError, match="segment_anchor='start', not 'end'"):
        train(TrainConfig(steps=2, segment_anchor="end", **common), path, tmp_path / "run", model_overrides=TINY,
              resume=True, progress=False)


def test_resume_of_a_run_saved_before_the_routing_options(tmp_path):
    """A checkpoint whose model config predates probe_tokens/train_selection was trained with the one-sided
    gradient: it resumes with --probe-tokens 0, and the default (4) is refused naming the difference."""
    path = save_dataset(tmp_path / "d.npz", _hopper_like(np.random.default_rng()))
    common = dict(algo="dm", seed=0, batch_size=4, log_every=1, eval_episodes=0, checkpoint_every=2, warmup_steps=1)
    legacy = dict(TINY, routed_layers=(1,), probe_tokens=0)
    train(TrainConfig(steps=2, **common), path, tmp_path / "run", model_overrides=legacy, progress=False)
    st = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    del st["model_config"]["probe_tokens"], st["model_config"]["train_selection"]
    torch.save(st, tmp_path / "run" / "checkpoint.pt")
    with pytest.raises(ValueError, match=r"'probe_tokens': \(0, 4\)"):
        train(TrainConfig(steps=4, **common), path, tmp_path / "run", model_overrides=dict(legacy, probe_tokens=None),
              resume=True, progress=False)
    train(TrainConfig(steps=4, **common), path, tmp_path / "run", model_overrides=legacy, resume=True, progress=False)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["step"] == 4
