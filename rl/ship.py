"""Copy a trained policy into ``rl/weights`` as ``NAME.safetensors`` + ``NAME.json`` (config + provenance) +
``NAME.md`` (the model card ``core.infra.model_card`` renders from them).

    python -m rl.ship --run runs/dm-hopper --name dm_hopper --command "python -m rl.train ..." [--eval-json FILE]

The card records the exact training command, the dataset's metadata, the steps trained, the training wall
time and the last training / evaluation records of ``metrics.jsonl`` (and an ``rl.evaluate --json`` result if
given). Before anything is written the run is checked: its files are there and readable, the policy builds from
``config.json``, its weights load strictly and one forward pass gives finite actions. The files are then written
together (staged, then renamed into place), so a refused or failed ship leaves the shipped files as they were.
A shipped file must stay under 20 MB. Errors: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from pathlib import Path

from core.infra.cli import nonempty_path, run_cli
from core.infra.guard import check_output, check_ship_run
from core.infra.ship import (Staging, check_finite, check_name, loading_check, read_json_file, read_jsonl_file,
                             require_files)
from rl.policies import WEIGHTS_DIR

logger = logging.getLogger(__name__)

__all__ = ["ship", "check_run", "build_parser", "main"]

MAX_BYTES = 20 * 1024 * 1024
RUN_FILES = ("config.json", "model.safetensors", "metrics.jsonl")
RUN_HOLDS = "an rl.train run folder holds config.json, model.safetensors and metrics.jsonl"


def check_run(run_dir: str | os.PathLike) -> tuple[dict, list[dict]]:
    """``(config.json, metrics.jsonl records)`` of a complete training run whose policy loads and runs.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file at fault: a missing file, a config without the
    algorithm, model or step, metrics records without ``kind``, weights over 20 MB, or weights that do not load
    strictly into the policy the config describes or give non-finite actions.
    """
    import torch

    from rl.evaluate import load_policy

    run = require_files(run_dir, RUN_FILES, flag="--run", holds=RUN_HOLDS)
    info = read_json_file(run / "config.json", flag="--run")
    missing = [k for k in ("algo", "model", "train", "step") if k not in info]
    if missing or not isinstance(info.get("train"), dict) or "log_every" not in info["train"]:
        raise ValueError(f"--run {run / 'config.json'}: not an rl.train config (needs algo, model, train.log_every "
                         f"and step; missing {', '.join(missing) or 'train.log_every'})")
    recs = read_jsonl_file(run / "metrics.jsonl", flag="--run")
    bad = [i for i, r in enumerate(recs, 1) if r.get("kind") not in ("train", "eval")
           or (r["kind"] == "train" and not isinstance(r.get("sec_per_1k_steps"), (int, float)))]
    if bad:
        raise ValueError(f"--run {run / 'metrics.jsonl'}: record {bad[0]} is not an rl.train record (kind 'train' "
                         "with sec_per_1k_steps, or kind 'eval')")
    weights = run / "model.safetensors"
    if weights.stat().st_size > MAX_BYTES:
        raise ValueError(f"--run {weights} is {weights.stat().st_size / 2**20:.1f} MB; shipped files must stay under "
                         "20 MB")
    with loading_check(weights, flag="--run", what=f"{info['algo']!r} policy as config.json describes"):
        model, _ = load_policy(run)  # builds from config.json, loads the weights strictly
        c = model.config
        T = c.context
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            pred, _ = model(torch.randn(1, T, c.state_dim, generator=gen),
                            torch.rand(1, T, c.act_dim, generator=gen) * 2 - 1,
                            torch.rand(1, T, 1, generator=gen) * c.return_scale, torch.arange(T)[None])
        check_finite("the policy's actions on a random segment", pred)
    return info, recs


def ship(run_dir: str | os.PathLike, name: str, *, command: str, eval_json: str | None = None, note: str = "",
         out_dir: str | os.PathLike = WEIGHTS_DIR) -> Path:
    """Check the run (:func:`check_run`) and the name, then write ``out_dir/NAME.safetensors``, ``NAME.json`` and
    (inside a ``weights/`` folder) the card ``NAME.md`` together; returns the weights' path."""
    check_name(name, flag="--name", example="dm_hopper")
    out = Path(out_dir)
    dst = out / f"{name}.safetensors"
    old = dst.with_suffix(".json")
    if old.is_file() and "algo" not in read_json_file(old, flag="--name"):
        raise ValueError(f"--name {name!r}: {old} is not a policy shipped by rl.ship (behaviour policies and "
                         "reference scores live there too); choose another name, e.g. 'dm_hopper'")
    evaluate_result = read_json_file(eval_json, flag="--eval-json") if eval_json else None
    info, recs = check_run(run_dir)
    run = Path(run_dir)
    train_recs = [r for r in recs if r["kind"] == "train"]
    card = dict(info)
    card["card"] = {
        "command": command,
        "note": note,
        "steps": info.get("step"),
        "train_wall_s_estimate": sum(r["sec_per_1k_steps"] * 1e-3 * info["train"]["log_every"] for r in train_recs),
        "last_train_metrics": train_recs[-1] if train_recs else None,
        "evaluations": [r for r in recs if r["kind"] == "eval"],
        "evaluate_result": evaluate_result,
    }
    with Staging(out) as stage:
        stage.copy(run / "model.safetensors", dst)
        stage.write_text(dst.with_suffix(".json"), json.dumps(card, indent=1))
        stage.write_card(dst)
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.ship", description="Ship a trained policy with its model card.")
    p.add_argument("--run", required=True, help="rl.train run folder (config.json, model.safetensors, metrics.jsonl)")
    p.add_argument("--name", required=True, help="file stem, e.g. dm_hopper (letters, digits, _, -, .)")
    p.add_argument("--command", required=True, help="the exact training command (recorded in the card)")
    p.add_argument("--eval-json", default=None, help="rl.evaluate --json output to include")
    p.add_argument("--note", default="", help="free text for the card (what the policy is good for)")
    p.add_argument("--out", type=nonempty_path, default=str(WEIGHTS_DIR), help="destination folder (default: rl/weights)")
    return p


def _main(argv) -> int:
    args = build_parser().parse_args(argv)
    check_ship_run(args.run, args.out)  # shipping replaces the destination's files: never ship from inside it
    check_output(args.out, inputs=[args.eval_json, args.run], ship="rl")  # rl's ship writes rl/weights, no other's
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(ship(args.run, args.name, command=args.command, eval_json=args.eval_json, note=args.note, out_dir=args.out))
    return 0


def main(argv=None) -> int:
    """Exit code 0, or 2 with one line on stderr for a bad input (``core.infra.cli.run_cli``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
