"""rl.evaluate: batched rollouts equal one-by-one rollouts; shipped policies load; clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rl.evaluate import load_policy, rollout, shipped_policies


@pytest.fixture(scope="module")
def policy():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    names = shipped_policies()
    assert names, "no shipped policy in rl/weights"
    model, info = load_policy(next(iter(names.values())))
    yield model, info
    torch.set_num_threads(n)


def test_vectorized_rollout_matches_single_episodes(policy):
    model, info = policy
    seed = int(np.random.default_rng().integers(0, 10_000))
    batch = rollout(model, info["env"], target_return=1000.0, episodes=3, seed=seed, max_steps=25)
    assert batch.returns.shape == (3,) and (batch.lengths <= 25).all() and (batch.lengths >= 1).all()
    for i in range(3):
        one = rollout(model, info["env"], target_return=1000.0, episodes=1, seed=seed + i, max_steps=25)
        assert one.lengths[0] == batch.lengths[i]
        np.testing.assert_allclose(one.rewards[0], batch.rewards[i], rtol=1e-4, atol=1e-5)
    if batch.routed is not None:
        assert batch.routed.shape[0] == 3 and batch.routed.shape[2] == len(info["model"]["routed_layers"])


def test_load_policy_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trained policy"):
        load_policy(tmp_path)
    with pytest.raises(ValueError, match="episodes must be positive"):
        model, info = load_policy(next(iter(shipped_policies().values())))
        rollout(model, info["env"], target_return=1.0, episodes=0)



def test_load_policy_refuses_foreign_config_and_weights(tmp_path):
    import json
    import shutil

    import torch
    from safetensors.torch import save_file

    shipped = next(iter(shipped_policies().values()))
    run = tmp_path / "run"
    run.mkdir()
    info = json.loads(shipped.with_suffix(".json").read_text())
    shutil.copy(shipped, run / "model.safetensors")
    (run / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not JSON"):
        load_policy(run)
    bad = dict(info, model={k: v for k, v in info["model"].items() if k != "state_dim"})
    (run / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="is not a policy config"):
        load_policy(run)
    (run / "config.json").write_text(json.dumps(info))
    load_policy(run)  # the intact pair loads
    save_file({"weight": torch.zeros(3, 3)}, str(run / "model.safetensors"))
    with pytest.raises(ValueError, match="does not fit the model"):
        load_policy(run)

def test_rendering_then_loading_triton_does_not_crash(tmp_path):
    # Offscreen MuJoCo rendering (EGL / Mesa llvmpipe) loads the system LLVM; importing Triton after it used
    # to crash the process (a segfault in Triton's extension). rl.envs loads Triton first when it renders.
    import subprocess
    import sys

    code = (
        "from rl.envs import make_env\n"
        "env = make_env('Hopper-v5', render_mode='rgb_array'); env.reset(seed=0)\n"
        "assert env.render().shape == (240, 320, 3); env.close()\n"
        "import triton, torch\n"
        "torch.optim.Adam([torch.nn.Parameter(torch.zeros(2))])\n"
        "print('survived')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-800:])


def test_prefix_routing_when_acting(policy):
    """``routing="prefix"`` acts with causal prefix top-k: the routed flags it records are those of a forward pass
    with mode "prefix" on the same window; an unknown routing is refused."""
    model, info = policy
    res = rollout(model, info["env"], target_return=1000.0, episodes=2, seed=5, max_steps=6, routing="prefix")
    assert res.routed is not None and res.routed.shape[:3] == (2, 6, len(info["model"]["routed_layers"]))
    # first step: the window is (R_0, s_0, a_0 placeholder); the newest return/state flags come from that pass
    from rl.envs import make_env

    env = make_env(info["env"])
    obs, _ = env.reset(seed=5)
    env.close()
    S, A = model.config.state_dim, model.config.act_dim
    with torch.no_grad():
        _, infos = model(torch.as_tensor(obs, dtype=torch.float32).view(1, 1, S), torch.zeros(1, 1, A),
                         torch.full((1, 1, 1), 1000.0), torch.zeros(1, 1, dtype=torch.long), mode="prefix")
    want = np.stack([i.mask[0, :2].numpy() for i in infos])
    np.testing.assert_array_equal(res.routed[0, 0], want)
    with pytest.raises(ValueError, match="routing must be 'aux' or 'prefix'"):
        rollout(model, info["env"], target_return=1000.0, episodes=1, max_steps=2, routing="topk")
