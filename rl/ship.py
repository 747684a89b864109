"""Copy a trained policy into ``rl/weights`` as ``NAME.safetensors`` + ``NAME.json`` (config + model card).

    python -m rl.ship --run runs/dm-hopper --name dm_hopper --command "python -m rl.train ..." [--eval-json FILE]

The card records the exact training command, the dataset's metadata, the steps trained, the training wall
time and the last training / evaluation records of ``metrics.jsonl`` (and an ``rl.evaluate --json`` result if
given). Files are written atomically; a shipped file must stay under 20 MB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from rl.policies import WEIGHTS_DIR

__all__ = ["ship", "build_parser", "main"]

MAX_BYTES = 20 * 1024 * 1024


def ship(run_dir: str | os.PathLike, name: str, *, command: str, eval_json: str | None = None, note: str = "",
         out_dir: str | os.PathLike = WEIGHTS_DIR) -> Path:
    run = Path(run_dir)
    info = json.loads((run / "config.json").read_text())
    weights = run / "model.safetensors"
    if weights.stat().st_size > MAX_BYTES:
        raise ValueError(f"{weights} is {weights.stat().st_size / 2**20:.1f} MB; shipped files must stay under 20 MB")
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_recs = [r for r in recs if r["kind"] == "train"]
    card = dict(info)
    card["card"] = {
        "command": command,
        "note": note,
        "steps": info.get("step"),
        "train_wall_s_estimate": sum(r["sec_per_1k_steps"] * 1e-3 * info["train"]["log_every"] for r in train_recs),
        "last_train_metrics": train_recs[-1] if train_recs else None,
        "evaluations": [r for r in recs if r["kind"] == "eval"],
        "evaluate_result": json.loads(Path(eval_json).read_text()) if eval_json else None,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dst = out / f"{name}.safetensors"
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(weights, tmp)
    os.replace(tmp, dst)
    cj = dst.with_suffix(".json")
    tmp = cj.with_name(cj.name + ".tmp")
    tmp.write_text(json.dumps(card, indent=1))
    os.replace(tmp, cj)
    return dst


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rl.ship", description="Ship a trained policy with its model card.")
    p.add_argument("--run", required=True)
    p.add_argument("--name", required=True, help="file stem, e.g. dm_hopper")
    p.add_argument("--command", required=True, help="the exact training command (recorded in the card)")
    p.add_argument("--eval-json", default=None, help="rl.evaluate --json output to include")
    p.add_argument("--note", default="", help="free text for the card (what the policy is good for)")
    p.add_argument("--out", default=str(WEIGHTS_DIR))
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    print(ship(args.run, args.name, command=args.command, eval_json=args.eval_json, note=args.note,
               out_dir=args.out))


if __name__ == "__main__":
    main()
