"""Generate an offline dataset by running a behaviour policy in a MuJoCo environment.

    python -m rl.generate --env Hopper-v5 --quality medium --steps 100000 --seed 0 --out data/hopper-medium.npz

``--out`` ending in ``.hdf5``/``.h5`` writes a D4RL-style HDF5 file instead (:mod:`rl.formats`).

Qualities: ``random`` (uniform actions), ``medium`` / ``expert`` (stochastic actions of the shipped SAC snapshot,
see :mod:`rl.policies`), ``medium-replay`` (the snapshots up to medium, equal shares of the steps, in training
order, like a replay buffer), ``medium-expert`` (half medium, half expert). The output is deterministic given
(env, quality, steps, seed, policy file): environment seeds ``seed, seed+1, ...`` per episode, one torch
generator seeded with ``seed`` for the actions, one thread. The episode running when ``steps`` is reached is
cut and marked as a timeout.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import numpy as np
import torch

from core.infra.cli import memory_capped_int, nonempty_path, run_cli
from core.infra.guard import check_outputs
from rl.data import OfflineDataset, check_save_path, save_dataset
from rl.envs import SUPPORTED_ENVS, make_env

logger = logging.getLogger(__name__)

__all__ = ["QUALITIES", "generate", "build_parser", "main"]

QUALITIES = ("random", "medium", "expert", "medium-replay", "medium-expert")
#: memory of one collected transition while collecting (numpy rows in Python lists, then the stacked arrays)
BYTES_PER_TRANSITION = 600


def _plan(quality: str, steps: int, behaviour) -> list[tuple[str | None, int]]:
    """(snapshot name or None for random, number of steps) segments."""
    if quality == "random":
        return [(None, steps)]
    if quality in ("medium", "expert"):
        return [(behaviour.quality_snapshots(quality)[0], steps)]
    if quality == "medium-expert":
        half = steps // 2
        return [(behaviour.quality_snapshots("medium")[0], half), (behaviour.quality_snapshots("expert")[0], steps - half)]
    names = behaviour.quality_snapshots("medium-replay")
    share = [steps // len(names) + (1 if i < steps % len(names) else 0) for i in range(len(names))]
    return [(n, s) for n, s in zip(names, share) if s > 0]


def generate(env_id: str, quality: str, steps: int, seed: int, *, policy_path=None, progress: bool = False) -> OfflineDataset:
    """Run the behaviour policy for ``steps`` transitions and return the dataset (see module docstring)."""
    from tqdm.auto import tqdm

    if env_id not in SUPPORTED_ENVS:
        raise ValueError(f"unknown env {env_id!r}; supported: {list(SUPPORTED_ENVS)}")
    if quality not in QUALITIES:
        raise ValueError(f"unknown quality {quality!r}; accepted: {list(QUALITIES)}")
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    behaviour = None
    if quality != "random":
        from rl.policies import load_behaviour

        behaviour = load_behaviour(env_id, policy_path)
    plan = _plan(quality, steps, behaviour)
    env = make_env(env_id)
    env.action_space.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    obs_l, act_l, rew_l, term_l, tout_l, returns = [], [], [], [], [], []
    episode = 0
    bar = tqdm(total=steps, disable=not progress, desc=f"{env_id} {quality}")
    t0 = time.time()
    for name, n in plan:
        actor = behaviour.actor(name) if name is not None else None
        done_here = 0
        obs, _ = env.reset(seed=seed + episode)
        ep_ret = 0.0
        while done_here < n:
            if actor is None:
                a = env.action_space.sample().astype(np.float32)
            else:
                a = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=False, generator=gen)[0].numpy()
            nobs, r, term, trunc, _ = env.step(a)
            done_here += 1
            cut = done_here == n and not (term or trunc)
            obs_l.append(obs.astype(np.float32)); act_l.append(a.astype(np.float32)); rew_l.append(float(r))
            term_l.append(bool(term)); tout_l.append(bool(trunc or cut))
            ep_ret += float(r)
            obs = nobs
            bar.update(1)
            if term or trunc or cut:
                if term or trunc:
                    returns.append(ep_ret)
                episode += 1
                if done_here < n:
                    obs, _ = env.reset(seed=seed + episode)
                ep_ret = 0.0
    bar.close()
    env.close()
    meta = {
        "env": env_id, "quality": quality, "seed": seed, "steps": steps,
        "policy": "uniform random" if behaviour is None else {
            "file": Path(policy_path).name if policy_path else f"behaviour_{env_id.split('-')[0].lower()}.safetensors",
            "segments": plan},
        "episode_returns": returns, "num_complete_episodes": len(returns),
        "mean_return": float(np.mean(returns)) if returns else None,
        "generation_wall_s": time.time() - t0,
    }
    return OfflineDataset(
        observations=np.stack(obs_l), actions=np.stack(act_l), rewards=np.asarray(rew_l, np.float32),
        terminals=np.asarray(term_l), timeouts=np.asarray(tout_l), metadata=meta,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--env", required=True, choices=SUPPORTED_ENVS)
    p.add_argument("--quality", required=True, choices=QUALITIES)
    p.add_argument("--steps", type=memory_capped_int(BYTES_PER_TRANSITION, what="a collected transition"), required=True,
                   help="transitions to collect (capped so that the dataset fits in half of this machine's memory)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=nonempty_path, required=True,
                   help="output file, written atomically: .npz, or .hdf5/.h5 (D4RL layout)")
    p.add_argument("--policy", default=None, help="behaviour .safetensors (default: the shipped one for --env)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.policy])
    try:  # before any step is collected: an unwritable name is refused in one line
        check_save_path(args.out)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if args.policy is not None and args.quality == "random":
        raise SystemExit("--policy is not used with --quality random (its actions are uniform); leave it out")
    if args.policy is not None and not Path(args.policy).is_file():
        raise FileNotFoundError(f"--policy {args.policy!r} is not a file; give a behaviour .safetensors")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    ds = generate(args.env, args.quality, args.steps, args.seed, policy_path=args.policy, progress=True)
    path = save_dataset(args.out, ds)
    logger.info("wrote %s: %d transitions, %d complete episodes, mean return %s", path, len(ds),
                ds.metadata["num_complete_episodes"], ds.metadata["mean_return"])


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
