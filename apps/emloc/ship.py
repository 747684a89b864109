"""Ship a meta-trained host as the default: ``apps/emloc/weights/host.safetensors`` + ``host.json`` (provenance)
+ ``host.md`` (the model card ``core.infra.model_card`` renders from it) + ``host_golden.json``.

    python -m apps.emloc.ship --run training/emloc_host --command "python -m apps.emloc.train ..."

The provenance comes from the run: its final weights, ``last.pt``'s training arguments, and ``metrics.jsonl``
(the last evaluation on the run's fixed held-out episodes, and its wall time when the run logged it). The
golden file holds the shipped host's logits on a fixed held-out episode, with the full context and with EMLoC
at δ = 0.005, and EMLoC's keep ratios there; ``tests/test_emloc_app.py`` checks them.

Before anything is written the run is checked (:func:`check_run`): its files are there, ``last.pt`` is a training
state, the host loads strictly and gives finite logits on a small episode. The files are then written together
(staged, then renamed into place), so a refused or failed ship leaves the shipped files as they were. Errors: one
line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost
from core.infra.cli import run_cli
from core.infra.guard import check_output, check_ship_run
from core.infra.ship import (Staging, check_finite, check_weights_path, loading_check, read_jsonl_file,
                             require_files)

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "golden_outputs", "check_run", "ship", "main"]

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


RUN_FILES = ("model.safetensors", "last.pt", "metrics.jsonl")
RUN_HOLDS = "an apps.emloc.train run folder holds model.safetensors, last.pt and metrics.jsonl"


def _last_eval(records: list[dict]) -> tuple[dict, float | None]:
    evals, elapsed = {}, None
    for rec in records:
        elapsed = rec.get("elapsed_s", elapsed)
        if any(k.startswith("eval_") for k in rec):
            evals = rec
    return evals, elapsed


def check_run(run: Path) -> tuple[EMLoCHost, dict, list[dict]]:
    """``(host, last.pt state, metrics.jsonl records)`` of a complete training run whose host loads and runs.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file at fault: a missing file, a ``last.pt`` that is
    not a training state (``args``, ``step``), a bad ``metrics.jsonl``, or weights that are not an EMLoC host
    (format, strict keys) or give non-finite logits on a small held-out episode.
    """
    from apps.emloc.api import compress
    from apps.emloc.data import EpisodeConfig, make_episode

    run = require_files(run, RUN_FILES, flag="--run", holds=RUN_HOLDS)
    with loading_check(run / "last.pt", flag="--run", what="training state"):
        state = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    if not (isinstance(state, dict) and isinstance(state.get("args"), dict) and isinstance(state.get("step"), int)):
        raise ValueError(f"--run {run / 'last.pt'}: not an apps.emloc.train state (a dict with args and step)")
    records = read_jsonl_file(run / "metrics.jsonl", flag="--run")
    src = run / "model.safetensors"
    with loading_check(src, flag="--run", what="EMLoC host"):
        model = EMLoCHost.load(src)  # format and config from the header, strict keys
        ep = make_episode(GOLDEN_EPISODE["seed"], num_demos=4, num_queries=2, split="eval",
                          config=EpisodeConfig(n_way=2))
        logits = compress(model, (ep.demo_images, ep.demo_labels), policy="full").logits(ep.query_images)
        check_finite("the host's logits on a small held-out episode", logits)
    return model, state, records


def ship(run: Path, *, command: str, wall_time_note: str | None = None, dest: Path = DEFAULT_WEIGHTS) -> Path:
    """Check the run (:func:`check_run`) and ``dest``, then write ``dest`` (a copy of ``run/model.safetensors``),
    its provenance, golden file and (inside a ``weights/`` folder) card beside it, all together."""
    dest = check_weights_path(dest, flag="--dest", example="apps/emloc/weights/host.safetensors")
    run = Path(run)
    src = run / "model.safetensors"
    shipped, state, records = check_run(run)
    train_args = {k: v for k, v in state["args"].items() if k not in ("out", "resume", "max_minutes")}
    evals, elapsed = _last_eval(records)
    golden = golden_outputs(shipped)
    check_finite("the host's golden logits", torch.tensor(golden["full_logits"]), torch.tensor(golden["emloc_logits"]))
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
    with Staging(dest.parent) as stage:
        stage.copy(src, dest)
        stage.write_json(dest.with_suffix(".json"), record)
        stage.write_json(dest.with_name("host_golden.json"), {**golden, "command": "python -m apps.emloc.ship ..."})
        card = stage.write_card(dest)
    logger.info("shipped %s (%d steps) to %s (card %s)", src, record["steps"], dest, card)
    return dest


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m apps.emloc.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="training run folder (model.safetensors, last.pt, metrics.jsonl)")
    p.add_argument("--command", required=True, help="the training command, recorded in the card")
    p.add_argument("--wall-time", default=None, help="wall time note when the run did not log elapsed_s")
    p.add_argument("--dest", type=Path, default=DEFAULT_WEIGHTS,
                   help="the weights file to write (default: the shipped host); the other files go beside it")
    args = p.parse_args(argv)
    check_output(args.dest, ship="apps.emloc")  # EMLoC's ship writes EMLoC's weights, no other package's
    if Path(args.run).resolve() == Path(args.dest).resolve().parent:  # its files sit beside the shipped ones
        check_ship_run(args.run, Path(args.dest).parent)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ship(args.run, command=args.command, wall_time_note=args.wall_time, dest=args.dest)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit code 0, or 2 with one line on stderr for a bad input (``core.infra.cli.run_cli``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
