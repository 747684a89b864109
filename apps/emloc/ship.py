"""Ship a meta-trained host as the default: ``apps/emloc/weights/host.safetensors`` + ``host.json`` (provenance,
rendered into the model card ``host.md`` by ``python -m core.infra.model_card``) + ``host_golden.json``.

    python -m apps.emloc.ship --run training/emloc_host --command "python -m apps.emloc.train ..."

The provenance comes from the run: its final weights, ``last.pt``'s training arguments, and ``metrics.jsonl``
(the last evaluation on the run's fixed held-out episodes, and its wall time when the run logged it). The
golden file holds the shipped host's logits on a fixed held-out episode, with the full context and with EMLoC
at δ = 0.005, and EMLoC's keep ratios there; ``tests/test_emloc_app.py`` checks them.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch

from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost
from core.infra.fileio import atomic_path, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "golden_outputs", "ship", "main"]

GOLDEN_PATH = DEFAULT_WEIGHTS.with_name("host_golden.json")
GOLDEN_EPISODE = {"seed": 80_000_001, "num_demos": 48, "num_queries": 8, "n_way": 5, "delta": 0.005}

CARD_TEXT = {
    "intended_use": "The default host of apps.emloc: many-shot in-context classification of 16x16 grayscale images "
    "whose labels are given only by demonstrations, and the model whose KV cache EMLoC and the baseline policies "
    "compress in the demo, the CLIs and the benchmark.",
    "out_of_scope": "Real images of any size or kind beyond 16x16 grayscale shapes and digits; more than 16 label "
    "ids; any decision about people. It is a stand-in host that makes the compression measurable on one CPU.",
    "tags": ["in-context-learning", "kv-cache-compression", "emloc", "synthetic-data"],
    "datasets": ["procedural shapes (apps.emloc.data)", "scikit-learn load_digits"],
}


@torch.no_grad()
def golden_outputs(model: EMLoCHost) -> dict:
    """Logits of the fixed golden episode's queries with the full context and with EMLoC, and EMLoC's keep ratios."""
    from apps.emloc.api import compress
    from apps.emloc.data import EpisodeConfig, make_episode

    g = GOLDEN_EPISODE
    ep = make_episode(g["seed"], num_demos=g["num_demos"], num_queries=g["num_queries"], split="eval",
                      config=EpisodeConfig(n_way=g["n_way"]))
    demos = (ep.demo_images, ep.demo_labels)
    full = compress(model, demos, policy="full")
    em = compress(model, demos, delta=g["delta"])
    return {"episode": g, "full_logits": full.logits(ep.query_images).tolist(),
            "emloc_logits": em.logits(ep.query_images).tolist(), "emloc_keep_ratios": em.keep_ratios(),
            "query_labels": ep.query_labels.tolist(),
            "label_ids": full.label_ids.tolist()}  # logits columns: these label ids, in this order


def _last_eval(metrics: Path) -> tuple[dict, float | None]:
    evals, elapsed = {}, None
    for line in metrics.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        elapsed = rec.get("elapsed_s", elapsed)
        if any(k.startswith("eval_") for k in rec):
            evals = rec
    return evals, elapsed


def ship(run: Path, *, command: str, wall_time_note: str | None = None, dest: Path = DEFAULT_WEIGHTS) -> Path:
    """Copy ``run/model.safetensors`` to ``dest`` and write its provenance and golden file beside it."""
    src = run / "model.safetensors"
    model = EMLoCHost.load(src)
    state = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    train_args = {k: v for k, v in state["args"].items() if k not in ("out", "resume", "max_minutes")}
    evals, elapsed = _last_eval(run / "metrics.jsonl")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
    shipped = EMLoCHost.load(dest)
    n_way = train_args.get("n_way", 5)
    record = {
        "name": "longctx EMLoC host (default)",
        "what_it_is": "A small causal decoder (core.decoder) over image-patch and label tokens, meta-trained here for "
        f"many-shot in-context image classification: every training episode draws {n_way} classes and a random "
        "mapping to label ids, so labels can only be read from the demonstrations.",
        "command": command,
        "data": "Episodes drawn on the fly (apps.emloc.data): procedural 16x16 shape classes with ids below 1,000,000 "
        "and scikit-learn load_digits digits 0-5 for training; held-out evaluation classes are procedural ids from "
        "1,000,000 and digits 6-9.",
        "model_config": json.loads(shipped.config.to_json()),
        "train_config": train_args,
        "steps": int(state["step"]),
        "wall_time_s": round(elapsed, 1) if elapsed is not None else (wall_time_note or None),
        "fingerprint": shipped.fingerprint(),
        "held_out_metrics": {
            "episodes": f"{train_args.get('eval_episodes')} fixed held-out {n_way}-way episodes of {train_args.get('demos')} "
            f"demonstrations (classes and mappings never seen in training); chance {1 / n_way:.2f}",
            "eval_loss": evals.get("eval_loss"),
            **{k.removeprefix("eval_"): v for k, v in evals.items() if k.startswith("eval_acc_shots_")},
        },
        "notes": "Accuracy by the number of demonstrations seen before the query position (acc_shots_a-b). The held-out "
        "episodes only watched the run; the shipped weights are its last step, not a picked checkpoint. The EMLoC "
        "benchmark (apps/emloc/README.md) uses other held-out episodes.",
        "model_card": CARD_TEXT,
    }
    write_json_atomic(dest.with_suffix(".json"), record)
    write_json_atomic(dest.with_name("host_golden.json"), {**golden_outputs(shipped), "command": "python -m apps.emloc.ship ..."})
    logger.info("shipped %s (%d steps) to %s; now run python -m core.infra.model_card", src, record["steps"], dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apps.emloc.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="training run folder (model.safetensors, last.pt, metrics.jsonl)")
    p.add_argument("--command", required=True, help="the training command, recorded in the card")
    p.add_argument("--wall-time", default=None, help="wall time note when the run did not log elapsed_s")
    p.add_argument("--dest", type=Path, default=DEFAULT_WEIGHTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ship(args.run, command=args.command, wall_time_note=args.wall_time, dest=args.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
