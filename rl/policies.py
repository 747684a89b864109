"""Shipped behaviour policies: SAC actor snapshots that regenerate the offline datasets.

``rl/weights/behaviour_<env>.safetensors`` holds actor snapshots (``<name>.<param>``) saved during one
``python -m rl.sac`` run; ``behaviour_<env>.json`` beside it is the card: the exact command, per snapshot the
training step and measured returns, and which snapshots the dataset qualities use:

    medium         the snapshot whose evaluated return is closest to 1/3 of the best one (D4RL's definition), searched
                   over all snapshots: SAC's returns are not monotone, the best one can come early
    expert         the best snapshot (highest mean evaluated return)
    medium-replay  every snapshot up to and including medium, in training order

Export a finished (or running) SAC run with ``python -m rl.policies --run RUN_DIR --env ENV``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

import numpy as np
import torch

from core.infra.cli import nonempty_path, run_cli
from core.infra.fileio import load_safetensors, set_file_mode
from core.infra.guard import check_output, check_ship_run
from rl.envs import env_family
from rl.sac import Actor

logger = logging.getLogger(__name__)

__all__ = ["WEIGHTS_DIR", "BehaviourSet", "load_behaviour", "export_run", "build_parser", "main"]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


class BehaviourSet:
    """Actor snapshots of one environment plus their card."""

    def __init__(self, card: dict, tensors: dict[str, torch.Tensor]):
        self.card = card
        self._tensors = tensors

    @property
    def snapshot_names(self) -> list[str]:
        return [s["name"] for s in self.card["snapshots"]]

    def actor(self, name: str) -> Actor:
        """The actor of snapshot ``name`` (eval mode)."""
        if name not in self.snapshot_names:
            raise ValueError(f"unknown snapshot {name!r}; available: {self.snapshot_names}")
        sd = {k[len(name) + 1:]: v for k, v in self._tensors.items() if k.startswith(name + ".")}
        obs_dim = sd["net.0.weight"].shape[1]
        hidden = sd["net.0.weight"].shape[0]
        act_dim = sd["head.weight"].shape[0] // 2
        scale, bias = sd["act_scale"].numpy(), sd["act_bias"].numpy()
        actor = Actor(obs_dim, act_dim, hidden, act_low=bias - scale, act_high=bias + scale)
        actor.load_state_dict(sd)
        return actor.eval()

    def quality_snapshots(self, quality: str) -> list[str]:
        q = self.card["qualities"]
        if quality == "medium-replay":
            return list(q["medium-replay"])
        if quality in ("medium", "expert"):
            return [q[quality]]
        raise ValueError(f"no snapshot list for quality {quality!r}")


def load_behaviour(env_id: str, path: str | os.PathLike | None = None) -> BehaviourSet:
    """Load ``behaviour_<env>.safetensors`` (+ card) from ``path`` or the shipped weights."""
    fam = env_family(env_id)
    st = Path(path) if path is not None else WEIGHTS_DIR / f"behaviour_{fam}.safetensors"
    card_path = st.with_suffix(".json")
    if not st.exists() or not card_path.exists():
        raise FileNotFoundError(
            f"no behaviour policies for {env_id}: {str(st)!r} (+ .json card) missing; train them with "
            f"`python -m rl.sac --env {env_id} --out RUN` and export with `python -m rl.policies --run RUN --env {env_id}`"
        )
    card = json.loads(card_path.read_text())
    if card.get("env") != env_id:
        raise ValueError(f"{str(card_path)!r} is for env {card.get('env')!r}, not {env_id!r}")
    return BehaviourSet(card, load_safetensors(st, what="behaviour policy snapshots exported by rl.policies"))


def export_run(run_dir: str | os.PathLike, env_id: str, out_dir: str | os.PathLike = WEIGHTS_DIR,
               command: str | None = None, name: str | None = None) -> Path:
    """Copy a SAC run's snapshots into ``out_dir`` with a card choosing the quality snapshots; the file is
    ``<name>.safetensors`` (default ``behaviour_<env family>``, the one :func:`load_behaviour` finds by itself)."""
    from safetensors.torch import save_file

    run_dir = Path(run_dir)
    meta = json.loads((run_dir / "snapshots.json").read_text())
    if meta["env"] != env_id:
        raise ValueError(f"run {str(run_dir)!r} trained env {meta['env']!r}, not {env_id!r}")
    snaps = meta["snapshots"]
    if not snaps:
        raise ValueError(f"run {str(run_dir)!r} has no snapshots yet")
    means = np.array([s["mean_return"] for s in snaps])
    best = int(means.argmax())
    target = means[best] / 3.0
    medium = int(np.abs(means - target).argmin())
    card = {
        "env": env_id,
        "algorithm": "SAC (rl/sac.py), stochastic tanh-Gaussian actor",
        "command": command or f"python -m rl.sac --env {env_id} --out RUN_DIR  (config below)",
        "config": meta["config"],
        "trained_steps": snaps[-1]["step"],
        # Wall seconds of training up to the last snapshot, summed over resumes; unknown (None) for a run that
        # was resumed before the sum was recorded.
        "train_wall_s": None if meta.get("wall_s_incomplete") or "wall_s_total" not in meta else snaps[-1].get("wall_s"),
        "snapshots": snaps,
        "qualities": {
            "medium": snaps[medium]["name"], "expert": snaps[best]["name"],
            "medium-replay": [s["name"] for s in snaps[: medium + 1]],
        },
        "quality_rule": "expert: highest mean return; medium: mean return closest to 1/3 of expert's, over all "
                        "snapshots; medium-replay: every snapshot up to and including medium, in training order",
        "note": "returns: undiscounted, deterministic actor, env seeds 10000+step+i; datasets use the stochastic actor"
                + ("" if "wall_s_total" in meta and not meta.get("wall_s_incomplete") else
                   "; train_wall_s unknown: the run was stopped and resumed before wall time was summed over "
                   "resumes, and each snapshot's wall_s counts only from the latest resume"),
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    fam = env_family(env_id)
    if name is not None and (not name or "/" in name or name.endswith(".safetensors")):
        raise ValueError(f"name must be a bare file stem such as 'behaviour_{fam}_long', got {name!r}")
    st = out_dir / f"{name or f'behaviour_{fam}'}.safetensors"
    tensors = load_safetensors(run_dir / "snapshots.safetensors", what="the actor snapshots written by rl.sac")
    tmp = st.with_name(st.name + ".tmp")
    save_file(tensors, str(tmp))
    set_file_mode(tmp)  # safetensors writes 0600: follow the user's umask
    os.replace(tmp, st)
    card_path = st.with_suffix(".json")
    tmp = card_path.with_name(card_path.name + ".tmp")
    tmp.write_text(json.dumps(card, indent=1))
    os.replace(tmp, card_path)
    return st


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.policies", description="Export SAC snapshots as shipped behaviour policies.")
    p.add_argument("--run", required=True, help="rl.sac run directory")
    p.add_argument("--env", required=True)
    p.add_argument("--out", type=nonempty_path, default=str(WEIGHTS_DIR))
    p.add_argument("--command", default=None, help="the exact training command, recorded in the card")
    p.add_argument("--name", default=None, help="file stem (default behaviour_<env family>: the default behaviour)")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    # it makes rl's shipped behaviour policies: rl/weights is its own destination; never the run it reads
    check_output(args.out, inputs=[args.run], ship="rl")
    check_ship_run(args.run, args.out)
    logging.basicConfig(level=logging.INFO)
    path = export_run(args.run, args.env, args.out, command=args.command, name=args.name)
    logging.getLogger(__name__).info("wrote %s", path)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
