"""Reference returns for normalized scores: ``100 * (R - R_random) / (R_expert - R_random)``.

Two sets of constants:

* ``"d4rl"`` (:data:`D4RL_REFERENCES`): D4RL's constants (``REF_MIN_SCORE`` / ``REF_MAX_SCORE`` of the ``-v2``
  MuJoCo tasks: random-policy and expert returns). The gymnasium ``-v5`` tasks used here have the same rewards and
  1000-step limit as the ``-v2`` ones up to small fixes, so these make scores comparable with published D4RL
  numbers; they are the default while this project's results are reported with them.
* ``"v5"``: measured here on the ``-v5`` tasks themselves and stored in ``rl/weights/references_v5.json``:
  the mean undiscounted return of the uniform random policy, and of an expert behaviour snapshot (its stochastic
  actions, as the datasets use them), each over ``--episodes`` episodes on fresh environment seeds::

      python -m rl.references --env Hopper-v5 --episodes 100 --policy rl/weights/behaviour_hopper.safetensors

  ``--snapshot`` names the expert snapshot (default: the card's ``expert``). A rerun replaces that environment's
  entry; the file records the policy file's SHA-256, the snapshot, seeds and every episode's return.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import statistics
import time
from pathlib import Path

from core.infra.cli import capped_int, nonempty_path_obj, run_cli
from core.infra.guard import check_output
from rl.envs import SUPPORTED_ENVS, env_family

logger = logging.getLogger(__name__)

__all__ = ["D4RL_REFERENCES", "V5_PATH", "normalized_score", "reference_returns", "episode_returns", "measure_references",
           "build_parser", "main"]

# family -> (random return, expert return), from D4RL (infos.py, REF_MIN_SCORE / REF_MAX_SCORE).
D4RL_REFERENCES: dict[str, tuple[float, float]] = {
    "hopper": (-20.272305, 3234.3),
    "halfcheetah": (-280.178953, 12135.0),
    "walker2d": (1.629008, 4592.3),
}

V5_PATH = Path(__file__).resolve().parent / "weights" / "references_v5.json"
SOURCES = ("d4rl", "v5")


def _load_v5(path: Path | None = None) -> dict:
    path = V5_PATH if path is None else Path(path)
    return json.loads(path.read_text()) if path.exists() else {}


def reference_returns(env_id: str, source: str = "d4rl") -> tuple[float, float]:
    """(random, expert) reference returns of ``env_id`` from ``source`` (``"d4rl"`` or ``"v5"``, see module docs)."""
    if source not in SOURCES:
        raise ValueError(f"unknown reference source {source!r}; accepted: {list(SOURCES)}")
    if source == "d4rl":
        return D4RL_REFERENCES[env_family(env_id)]
    entry = _load_v5().get(env_id)
    if entry is None or entry.get("expert") is None:
        raise ValueError(f"no measured -v5 references for {env_id} in {V5_PATH.name}; measure them with "
                         f"`python -m rl.references --env {env_id} --episodes 100`")
    return entry["random"]["mean_return"], entry["expert"]["mean_return"]


def normalized_score(env_id: str, ret, source: str = "d4rl"):
    """Normalized score (0 = random policy, 100 = expert); works on floats and numpy arrays."""
    lo, hi = reference_returns(env_id, source)
    return 100.0 * (ret - lo) / (hi - lo)


def episode_returns(env_id: str, actor, episodes: int, seed: int, *, progress: bool = False) -> list[float]:
    """Undiscounted returns of ``episodes`` full episodes (env seeds ``seed, seed+1, ...``): uniform random actions
    when ``actor`` is None, else the actor's stochastic actions (one generator seeded with ``seed``)."""
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from rl.envs import make_env

    if episodes <= 0:
        raise ValueError(f"episodes must be positive, got {episodes}")
    env = make_env(env_id)
    env.action_space.seed(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in tqdm(range(episodes), disable=not progress, desc=f"{env_id} {'random' if actor is None else 'expert'}"):
        obs, _ = env.reset(seed=seed + i)
        total, done = 0.0, False
        while not done:
            if actor is None:
                a = env.action_space.sample().astype(np.float32)
            else:
                with torch.no_grad():
                    a = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None], deterministic=False, generator=gen)[0].numpy()
            obs, r, term, trunc, _ = env.step(a)
            total += float(r)
            done = term or trunc
        out.append(total)
    env.close()
    return out


def measure_references(env_id: str, *, episodes: int, seed: int, policy: str | Path | None = None,
                       snapshot: str | None = None, progress: bool = False) -> dict:
    """The ``-v5`` entry of ``env_id``: random and expert returns (see module docs)."""
    from rl.policies import WEIGHTS_DIR, load_behaviour

    t0 = time.time()
    rnd = episode_returns(env_id, None, episodes, seed, progress=progress)
    path = Path(policy) if policy is not None else WEIGHTS_DIR / f"behaviour_{env_family(env_id)}.safetensors"
    behaviour = load_behaviour(env_id, path)
    name = snapshot or behaviour.quality_snapshots("expert")[0]
    if name not in behaviour.snapshot_names:
        raise ValueError(f"no snapshot {name!r} in {path.name}; it has {behaviour.snapshot_names}")
    exp = episode_returns(env_id, behaviour.actor(name), episodes, seed + 1_000_000, progress=progress)

    def stats(xs):
        return {"mean_return": statistics.fmean(xs), "std": statistics.stdev(xs) if len(xs) > 1 else 0.0,
                "episodes": len(xs), "returns": [round(x, 3) for x in xs]}

    return {
        "env": env_id,
        "random": {**stats(rnd), "policy": "uniform random actions", "env_seeds": [seed, seed + episodes - 1]},
        "expert": {**stats(exp), "policy_file": path.name, "policy_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
                   "snapshot": name, "actions": "stochastic", "env_seeds": [seed + 1_000_000, seed + 1_000_000 + episodes - 1],
                   "trained_steps": behaviour.card.get("trained_steps")},
        "d4rl_v2": dict(zip(("random", "expert"), D4RL_REFERENCES[env_family(env_id)])),
        "wall_s": round(time.time() - t0, 1),
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.references", description="Measure -v5 random and expert reference returns.")
    p.add_argument("--env", required=True, choices=SUPPORTED_ENVS)
    p.add_argument("--episodes", type=capped_int(100_000, why="episodes per policy"), default=100)
    p.add_argument("--seed", type=int, default=50_000, help="first environment seed (the expert's start 1,000,000 later)")
    p.add_argument("--policy", default=None, help="behaviour .safetensors with its .json card (default: the shipped one)")
    p.add_argument("--snapshot", default=None, help="expert snapshot name (default: the card's expert)")
    p.add_argument("--out", type=nonempty_path_obj, default=V5_PATH, help="JSON file of all environments' entries (merged)")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from core.infra.fileio import check_writable, write_json_atomic

    args = build_parser().parse_args(argv)
    # the reference scores ship in rl/weights (its default --out); the behaviour file it reads is never replaced
    check_output(args.out, inputs=[args.policy, args.policy and Path(args.policy).with_suffix(".json")], ship="rl")
    check_writable(args.out, what="--out")  # before the episodes whose returns it records
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    entry = measure_references(args.env, episodes=args.episodes, seed=args.seed, policy=args.policy,
                               snapshot=args.snapshot, progress=True)
    data = _load_v5(args.out)
    data[args.env] = entry
    write_json_atomic(args.out, data)
    logger.info("%s: random %.1f ± %.1f, expert %.1f ± %.1f (%s) -> %s", args.env, entry["random"]["mean_return"],
                entry["random"]["std"], entry["expert"]["mean_return"], entry["expert"]["std"], entry["expert"]["snapshot"], args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
