"""rl.tune (held-out split, choice of capacity_cost_weight) and rl.policies' choice of the medium snapshot."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rl.data import OfflineDataset
from rl.policies import export_run
from rl.train import TrainConfig
from rl.tune import run_weight, split_trajectories_dataset, summarize


def _dataset(rng, lengths):
    n = int(sum(lengths))
    ends = np.cumsum(lengths) - 1
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    kind = rng.random(len(lengths)) < 0.5
    terminals[ends[kind]] = True
    timeouts[ends[~kind]] = True
    return OfflineDataset(
        observations=rng.normal(size=(n, 11)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(n, 3)).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32), terminals=terminals, timeouts=timeouts,
        metadata={"env": "Hopper-v5", "quality": "synthetic", "seed": 0})


def test_split_keeps_whole_trajectories():
    rng = np.random.default_rng()
    lengths = rng.integers(3, 30, size=int(rng.integers(5, 15)))
    ds = _dataset(rng, lengths)
    train, val = split_trajectories_dataset(ds, 0.3, seed=int(rng.integers(1000)))
    assert len(train) + len(val) == len(ds)
    key = lambda t: t.observations[0].tobytes()  # noqa: E731
    orig = {key(t): t for t in ds.trajectories()}
    got = train.trajectories() + val.trajectories()
    assert sorted(key(t) for t in got) == sorted(orig)
    for t in got:
        o = orig[key(t)]
        np.testing.assert_array_equal(t.actions, o.actions)
        assert t.terminal == o.terminal
    assert not {key(t) for t in train.trajectories()} & {key(t) for t in val.trajectories()}
    with pytest.raises(ValueError, match="val_fraction"):
        split_trajectories_dataset(ds, 1.0, seed=0)


def test_summary_skips_collapsed_capacity():
    rng = np.random.default_rng()
    mses = rng.uniform(0.1, 1.0, size=4)
    routed = [0.5, 0.12, 0.3, 0.1]
    res = [{"capacity_cost_weight": w, "val_action_mse": float(m), "val_routed_fraction": r,
            "train_action_mse_last_quarter": float(m), "train_routed_fraction_last_quarter": r}
           for w, m, r in zip([0.0, 0.001, 0.003, 0.01], mses, routed)]
    res[1]["val_action_mse"] = res[3]["val_action_mse"] = 0.01  # best loss but collapsed to the floor
    s = summarize(res, min_capacity=0.1, margin=0.05)
    ok = [0, 2]
    assert s["chosen_capacity_cost_weight"] == res[min(ok, key=lambda i: mses[i])]["capacity_cost_weight"]
    assert summarize([res[1], res[3]], 0.1, 0.05)["chosen_capacity_cost_weight"] is None


def test_run_weight_reports_validation_metrics():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rng = np.random.default_rng()
        train, val = split_trajectories_dataset(_dataset(rng, [40] * 6), 0.34, seed=0)
        cfg = TrainConfig(algo="dm", steps=4, batch_size=4, warmup_steps=1, eval_episodes=0, checkpoint_every=4)
        r = run_weight(0.003, train, val, cfg=cfg, overrides={"context": 4, "embed_dim": 16, "num_layers": 2,
                                                              "routed_layers": (1,)}, val_batches=2)
    finally:
        torch.set_num_threads(n)
    assert r["model"]["capacity_cost_weight"] == 0.003
    assert np.isfinite(r["val_action_mse"]) and r["val_action_mse"] > 0
    assert 0.0 < r["val_routed_fraction"] <= 1.0 and 0.0 < r["train_routed_fraction_last_quarter"] <= 1.0
    # the train/eval gap: evaluation's auxiliary selection against the training selection (top-k by default)
    assert r["gap_action_mse"] == pytest.approx(r["val_action_mse"] - r["val_action_mse_topk"])
    assert r["gap_routed_fraction"] == pytest.approx(r["val_routed_fraction"] - r["val_routed_fraction_topk"])
    assert 0.0 <= r["val_routed_fraction_prefix"] <= 1.0 and np.isfinite(r["val_action_mse_prefix"])
    assert 0.0 <= r["val_aux_agreement"] <= 1.0


def test_medium_is_searched_over_all_snapshots(tmp_path):
    """The best snapshot can come early (SAC returns are not monotone): medium may come after it."""
    from safetensors.torch import save_file

    rng = np.random.default_rng()
    means = [100.0, 900.0, 310.0, 600.0, 480.0]
    means = [m + float(rng.uniform(-5, 5)) for m in means]
    snaps = [{"name": f"step{i:07d}", "step": i, "returns": [m], "mean_return": m} for i, m in enumerate(means)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "snapshots.json").write_text(json.dumps({"env": "Hopper-v5", "config": {}, "snapshots": snaps}))
    save_file({"step0000000.w": torch.zeros(2)}, str(run / "snapshots.safetensors"))
    path = export_run(run, "Hopper-v5", tmp_path / "w", command="test")
    q = json.loads(path.with_suffix(".json").read_text())["qualities"]
    assert q["expert"] == "step0000001"
    assert q["medium"] == "step0000002"  # closest to 900/3, after the best one
    assert q["medium-replay"] == ["step0000000", "step0000001", "step0000002"]
