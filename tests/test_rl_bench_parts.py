"""Pieces of the decisive DM-vs-DT experiment: random routing, held-out split and MSE, partial observation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.routing import RoutedBlock, RoutingConfig
from rl.data import OfflineDataset, holdout_split

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class _Id(torch.nn.Module):
    def forward(self, x):
        return x + 1.0


def _ds(rng, n=300, episodes=12, obs_dim=11):
    obs = rng.normal(size=(n, obs_dim)).astype(np.float32)
    act = np.tanh(rng.normal(size=(n, 3))).astype(np.float32)
    terminals = np.zeros(n, bool)
    terminals[np.sort(rng.choice(np.arange(5, n - 1), episodes - 1, replace=False))] = True
    timeouts = np.zeros(n, bool)
    timeouts[-1] = True
    return OfflineDataset(observations=obs, actions=act, rewards=rng.uniform(0, 3, n).astype(np.float32),
                          terminals=terminals, timeouts=timeouts, metadata={"env": "Hopper-v5"})


def test_random_selection_keeps_k_random_tokens_in_training_and_bernoulli_at_evaluation():
    cfg = RoutingConfig(dim=8, capacity=0.25, learn_capacity=False, random_selection=True)
    blk = RoutedBlock(_Id(), cfg)
    x = torch.randn(4, 40, 8)
    torch.manual_seed(0)
    _, a = blk(x, mode="topk")
    _, b = blk(x, mode="topk")
    assert (a.mask.sum(-1) == 10).all() and (b.mask.sum(-1) == 10).all()
    assert not torch.equal(a.mask, b.mask)  # not the router's choice: other tokens on another draw
    # the router's top-k would pick the same tokens every time
    ref = RoutedBlock(_Id(), RoutingConfig(dim=8, capacity=0.25, learn_capacity=False))
    ref.load_state_dict(blk.state_dict())
    _, c = ref(x, mode="topk")
    _, d = ref(x, mode="topk")
    assert torch.equal(c.mask, d.mask)
    blk.eval()
    torch.manual_seed(1)
    _, e = blk(torch.randn(50, 40, 8), mode="aux")
    assert abs(e.mask.float().mean().item() - 0.25) < 0.03
    assert float(e.aux_loss) == 0.0
    pad = torch.zeros(4, 40, dtype=torch.bool)
    pad[:, 30:] = True
    _, f = blk(x, mode="aux", key_padding_mask=pad)
    assert not f.mask[:, 30:].any()


def test_random_selection_needs_a_fixed_capacity():
    with pytest.raises(ValueError, match="learn_capacity=False"):
        RoutingConfig(dim=8, random_selection=True)
    from rl.models import DMConfig

    with pytest.raises(ValueError, match="learn_capacity"):
        DMConfig(state_dim=3, act_dim=2, random_routing=True)


def test_holdout_split_is_by_episode_seeded_and_recorded():
    ds = _ds(np.random.default_rng(0))
    tr, held, idx = holdout_split(ds, 0.25, seed=3)
    tr2, held2, idx2 = holdout_split(ds, 0.25, seed=3)
    _, _, idx3 = holdout_split(ds, 0.25, seed=4)
    assert idx == idx2 and idx != idx3 and len(idx) == 3
    trajs = ds.trajectories()
    assert len(tr.trajectories()) == len(trajs) - 3
    assert sum(t.length for t in held) + len(tr) == len(ds)
    assert tr.metadata["holdout"]["indices"] == idx and tr.metadata["holdout"]["seed"] == 3
    train_obs = {o.tobytes() for o in tr.observations}
    assert not any(o.tobytes() in train_obs for t in held for o in t.observations)
    for i, t in zip(idx, held):
        np.testing.assert_array_equal(t.actions, trajs[i].actions)
    with pytest.raises(ValueError, match="fraction"):
        holdout_split(ds, 1.0, seed=0)


@pytest.mark.parametrize("algo", ["dt", "dm"])
def test_heldout_action_mse_is_the_causal_eval_mode_error(algo):
    from rl.evaluate import heldout_action_mse
    from rl.models import DMConfig, DTConfig, build_model

    ds = _ds(np.random.default_rng(1), n=120, episodes=4)
    cls = DMConfig if algo == "dm" else DTConfig
    extra = {"num_layers": 2, "routed_layers": (1,)} if algo == "dm" else {"num_layers": 2}
    torch.manual_seed(0)
    model = build_model(algo, cls(state_dim=11, act_dim=3, context=7, embed_dim=16, **extra))
    trajs = ds.trajectories()
    got = heldout_action_mse(model, trajs, batch=3)
    assert not model.training
    # reference: every action predicted one at a time from its own segment's prefix, in eval mode
    from rl.data import returns_to_go

    err, n = 0.0, 0
    with torch.no_grad():
        for tr in trajs:
            rtg = returns_to_go(tr.rewards)
            for t in range(tr.length):
                s0 = (t // 7) * 7
                sl = slice(s0, t + 1)
                pred, _ = model(torch.from_numpy(tr.observations[None, sl]), torch.from_numpy(tr.actions[None, sl]),
                                torch.from_numpy(rtg[None, sl, None]), torch.arange(s0, t + 1)[None], mode="aux")
                err += float(((pred[0, -1] - torch.from_numpy(tr.actions[t])) ** 2).sum())
                n += 3
    assert got == pytest.approx(err / n, rel=1e-4)
    model.train()  # dropout on would change it: evaluation mode is what is measured
    assert heldout_action_mse(model, trajs) == pytest.approx(got, rel=1e-5)


def test_partial_observation_masks_velocities_in_data_and_env():
    from rl.envs import make_env
    from rl.partial import mask_dataset, mask_env, observation_mask, velocity_dims

    assert velocity_dims("Hopper-v5") == (5, 6, 7, 8, 9, 10)
    env = make_env("Hopper-v5")
    env.reset(seed=0)
    obs, *_ = env.step(env.action_space.sample())
    np.testing.assert_allclose(obs[5:], env.unwrapped.data.qvel, rtol=1e-6)  # 5..10 are the velocities
    env.close()
    ds = _ds(np.random.default_rng(2))
    po = mask_dataset(ds)
    assert (po.observations[:, 5:] == 0).all() and (po.observations[:, :5] == ds.observations[:, :5]).all()
    assert po.metadata["partial_observation"]["masked_dims"] == [5, 6, 7, 8, 9, 10]
    menv = mask_env(make_env("Hopper-v5"))
    o, _ = menv.reset(seed=0)
    o2, *_ = menv.step(menv.action_space.sample())
    assert (o[5:] == 0).all() and (o2[5:] == 0).all() and np.abs(o2[:5]).sum() > 0
    menv.close()
    m = observation_mask("Hopper-v5")
    x = np.ones((2, 11), np.float32)
    assert m(x)[:, 5:].sum() == 0 and x.sum() == 22  # a copy
    with pytest.raises(ValueError, match="no partially observed variant"):
        velocity_dims("Walker2d-v5")


def test_rollout_policy_sees_masked_observations():
    from rl.evaluate import rollout
    from rl.models import DTConfig, build_model
    from rl.partial import observation_mask

    model = build_model("dt", DTConfig(state_dim=11, act_dim=3, context=4, embed_dim=16, num_layers=1))
    seen = []
    orig = model.forward

    def spy(states, *a, **k):
        seen.append(states.clone())
        return orig(states, *a, **k)

    model.forward = spy
    res = rollout(model, "Hopper-v5", target_return=100.0, episodes=2, seed=0, max_steps=6,
                  obs_transform=observation_mask("Hopper-v5"))
    assert len(seen) == 6 and res.lengths.max() <= 6
    allstates = torch.cat([s.reshape(-1, 11) for s in seen])
    assert (allstates[:, 5:] == 0).all() and allstates[:, :5].abs().sum() > 0
    seen.clear()
    rollout(model, "Hopper-v5", target_return=100.0, episodes=1, seed=0, max_steps=3)
    assert seen[-1][0, :, 5:].abs().sum() > 0  # without the transform the velocities are there


def test_bootstrap_pairs_compare_dm_with_dt_its_controls_and_the_d3rlpy_peers():
    from benchmarks.rl_bench import _pairs

    pairs = _pairs(["dm", "dt", "dt-small", "dm-random", "dm-fixed", "d3rlpy-dt", "d3rlpy-iql"])
    assert {(a, "dt") for a in ("dm", "dt-small", "dm-random", "dm-fixed", "d3rlpy-dt", "d3rlpy-iql")} <= set(pairs)
    assert {("dm", c) for c in ("dm-random", "dm-fixed", "d3rlpy-dt", "d3rlpy-iql")} <= set(pairs)
    assert ("dm", "dt-small") not in pairs and len(pairs) == len(set(pairs))
    assert _pairs(["dt", "d3rlpy-dt"]) == [("d3rlpy-dt", "dt")]  # no DM: nothing to compare DM with
