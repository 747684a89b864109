"""rl.sac -> rl.policies -> rl.generate: snapshots, export with a card, deterministic policy datasets."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rl.generate import generate
from rl.policies import export_run, load_behaviour
from rl.sac import SACConfig, train_sac


@pytest.fixture(scope="module")
def behaviour(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sac")
    cfg = SACConfig(env="Hopper-v5", steps=150, start_steps=90, snapshot_every=50, checkpoint_every=150,
                    eval_episodes=1, batch_size=32, actor_hidden=16, critic_hidden=32)
    meta = train_sac(cfg, root / "run", progress=False)
    path = export_run(root / "run", "Hopper-v5", root / "weights", command="test")
    yield meta, path
    torch.set_num_threads(n)


def test_snapshots_and_card(behaviour):
    meta, path = behaviour
    assert [s["step"] for s in meta["snapshots"]] == [50, 100, 150]
    card = json.loads(path.with_suffix(".json").read_text())
    means = [s["mean_return"] for s in card["snapshots"]]
    assert card["qualities"]["expert"] == card["snapshots"][int(np.argmax(means))]["name"]
    replay = card["qualities"]["medium-replay"]
    assert replay[-1] == card["qualities"]["medium"] and replay[0] == "step0000050"
    b = load_behaviour("Hopper-v5", path)
    actor = b.actor(card["qualities"]["expert"])
    a = actor.act(torch.randn(5, 11), deterministic=True)
    assert a.shape == (5, 3) and a.abs().max() <= 1.0
    with pytest.raises(ValueError, match="unknown snapshot"):
        b.actor("step9")
    with pytest.raises(ValueError, match="not 'Walker2d-v5'"):
        load_behaviour("Walker2d-v5", path)


@pytest.mark.parametrize("quality", ["medium", "medium-replay", "medium-expert"])
def test_policy_datasets_are_deterministic(behaviour, quality):
    _, path = behaviour
    a = generate("Hopper-v5", quality, 90, 5, policy_path=path)
    b = generate("Hopper-v5", quality, 90, 5, policy_path=path)
    np.testing.assert_array_equal(a.actions, b.actions)
    np.testing.assert_array_equal(a.observations, b.observations)
    assert len(a) == 90 and a.metadata["quality"] == quality
    assert sum(n for _, n in a.metadata["policy"]["segments"]) == 90


def test_sac_resume_continues_from_checkpoint(behaviour, tmp_path):
    """Training to 240 steps after a checkpoint at 120 keeps the snapshots written before the stop."""
    cfg = SACConfig(env="Hopper-v5", steps=120, start_steps=60, snapshot_every=60, checkpoint_every=60,
                    eval_episodes=1, batch_size=16, actor_hidden=8, critic_hidden=16)
    train_sac(cfg, tmp_path, progress=False)
    cfg2 = SACConfig(env="Hopper-v5", steps=180, start_steps=60, snapshot_every=60, checkpoint_every=60,
                     eval_episodes=1, batch_size=16, actor_hidden=8, critic_hidden=16)
    meta = train_sac(cfg2, tmp_path, progress=False)
    assert [s["step"] for s in meta["snapshots"]] == [60, 120, 180]


def test_export_under_another_name(behaviour, tmp_path):
    meta, path = behaviour
    run = path.parent.parent / "run"
    other = export_run(run, "Hopper-v5", tmp_path, command="test", name="behaviour_hopper_long")
    assert other.name == "behaviour_hopper_long.safetensors" and other.with_suffix(".json").exists()
    assert load_behaviour("Hopper-v5", other).snapshot_names == load_behaviour("Hopper-v5", path).snapshot_names
    with pytest.raises(ValueError, match="bare file stem"):
        export_run(run, "Hopper-v5", tmp_path, name="a/b")
