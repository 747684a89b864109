"""rl.data / rl.generate: format round trip, validation errors, trajectories, return-to-go, d3rlpy conversion."""

from __future__ import annotations

import numpy as np
import pytest

from rl.data import (OfflineDataset, check_env_compat, load_dataset, returns_to_go, save_dataset,
                     split_trajectories, to_mdp_dataset)


def _random_dataset(rng, n=300, obs_dim=11, act_dim=3, episodes=4, env="Hopper-v5"):
    # the last (timed-out) episode gets at least 2 steps: d3rlpy drops a 1-step episode that ends in a timeout (it
    # holds no transition), which made the episode-count comparison below fail about one run in a hundred
    ends = np.sort(rng.choice(np.arange(5, n - 2), size=episodes - 1, replace=False))
    terminals = np.zeros(n, bool)
    timeouts = np.zeros(n, bool)
    terminals[ends] = True
    timeouts[-1] = True
    return OfflineDataset(
        observations=rng.normal(size=(n, obs_dim)).astype(np.float32),
        actions=rng.uniform(-1, 1, size=(n, act_dim)).astype(np.float32),
        rewards=rng.normal(size=n).astype(np.float32), terminals=terminals, timeouts=timeouts,
        metadata={"env": env, "quality": "synthetic", "seed": 0},
    )


def _write_npz(path, **arrays):
    np.savez(path, **arrays)
    return path


def test_round_trip_keeps_arrays_and_metadata(tmp_path):
    rng = np.random.default_rng()
    ds = _random_dataset(rng)
    path = save_dataset(tmp_path / "d.npz", ds)
    back = load_dataset(path)
    for k, v in ds.arrays().items():
        np.testing.assert_array_equal(back.arrays()[k], v)
    assert back.metadata["env"] == "Hopper-v5" and back.metadata["format_version"] == 1
    trajs = back.trajectories()
    assert len(trajs) == 4
    assert sum(t.length for t in trajs) == len(ds)
    assert [t.terminal for t in trajs] == [True, True, True, False]
    # float32 sums in another order: the error scales with the sum of |rewards|, not with the (possibly ~0) total
    np.testing.assert_allclose(sum(t.ret for t in trajs), ds.rewards.sum(), rtol=1e-5,
                               atol=1e-5 * float(np.abs(ds.rewards).sum()))


def test_returns_to_go_matches_brute_force():
    r = np.random.default_rng().normal(size=17).astype(np.float32)
    rtg = returns_to_go(r)
    np.testing.assert_allclose(rtg, [r[t:].sum() for t in range(17)], rtol=1e-5, atol=1e-5)
    g = returns_to_go(r, gamma=0.9)
    np.testing.assert_allclose(g[3], sum(0.9 ** i * r[3 + i] for i in range(14)), rtol=1e-5)


def test_to_mdp_dataset_has_same_episodes():
    ds = _random_dataset(np.random.default_rng())
    mdp = to_mdp_dataset(ds)
    assert len(mdp.episodes) == len(split_trajectories(ds))
    assert sum(ep.transition_count for ep in mdp.episodes) >= len(ds) - len(mdp.episodes)
    np.testing.assert_allclose(mdp.episodes[0].rewards[:, 0], split_trajectories(ds)[0].rewards)


def test_missing_file_and_missing_keys(tmp_path):
    with pytest.raises(FileNotFoundError, match="rl.generate"):
        load_dataset(tmp_path / "nope.npz")
    ds = _random_dataset(np.random.default_rng())
    arrays = ds.arrays()
    arrays.pop("timeouts")
    with pytest.raises(ValueError, match=r"missing keys \['timeouts'\]"):
        load_dataset(_write_npz(tmp_path / "m.npz", **arrays))


def test_wrong_shapes_are_rejected(tmp_path):
    a = _random_dataset(np.random.default_rng()).arrays()
    bad = dict(a, rewards=a["rewards"][:-3])
    with pytest.raises(ValueError, match="rewards has shape"):
        load_dataset(_write_npz(tmp_path / "s.npz", **bad))
    bad = dict(a, observations=a["observations"][:, None])
    with pytest.raises(ValueError, match="must be 2-D"):
        load_dataset(_write_npz(tmp_path / "s2.npz", **bad))


def test_nan_is_rejected_with_its_position(tmp_path):
    a = _random_dataset(np.random.default_rng()).arrays()
    obs = a["observations"].copy()
    i = int(np.random.default_rng().integers(0, len(obs)))
    obs[i, 2] = np.nan
    with pytest.raises(ValueError, match=f"observations contains 1 NaN/inf values \\(first at transition {i}\\)"):
        load_dataset(_write_npz(tmp_path / "n.npz", **dict(a, observations=obs)))


def test_unterminated_last_episode_is_rejected():
    ds = _random_dataset(np.random.default_rng())
    a = ds.arrays()
    a["timeouts"] = a["timeouts"].copy()
    a["timeouts"][-1] = False
    with pytest.raises(ValueError, match="last transition ends no episode"):
        OfflineDataset(**a)


def test_env_mismatch_is_rejected():
    import gymnasium as gym

    hopper = gym.make("Hopper-v5")
    walker_like = _random_dataset(np.random.default_rng(), obs_dim=17, act_dim=6, env="Walker2d-v5")
    with pytest.raises(ValueError, match="dim 17 but Hopper-v5 observations have shape \\(11,\\)"):
        check_env_compat(walker_like, hopper.observation_space, hopper.action_space, env_id="Hopper-v5")
    ok = _random_dataset(np.random.default_rng())
    check_env_compat(ok, hopper.observation_space, hopper.action_space, env_id="Hopper-v5")
    ok.actions[5, 1] = 3.0
    with pytest.raises(ValueError, match="action bounds"):
        check_env_compat(ok, hopper.observation_space, hopper.action_space, env_id="Hopper-v5")


def test_generate_random_is_deterministic_and_valid(tmp_path):
    from rl.generate import generate

    seed = int(np.random.default_rng().integers(0, 1000))
    a = generate("Hopper-v5", "random", 150, seed)
    b = generate("Hopper-v5", "random", 150, seed)
    for k in a.arrays():
        np.testing.assert_array_equal(a.arrays()[k], b.arrays()[k])
    assert len(a) == 150 and (a.timeouts[-1] or a.terminals[-1])  # cut (timeout) unless it fell right then
    assert a.metadata["env"] == "Hopper-v5" and a.metadata["seed"] == seed
    ends = int((a.terminals | a.timeouts).sum())  # the cut last episode has no complete return
    assert len(a.metadata["episode_returns"]) in (ends - 1, ends)
    c = generate("Hopper-v5", "random", 150, seed + 1)
    assert not np.array_equal(a.actions, c.actions)


def test_generate_rejects_bad_arguments():
    from rl.generate import generate

    with pytest.raises(ValueError, match="unknown quality"):
        generate("Hopper-v5", "great", 10, 0)
    with pytest.raises(ValueError, match="unknown env"):
        generate("Ant-v5", "random", 10, 0)
