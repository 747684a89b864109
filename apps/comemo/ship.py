"""Ship a trained CoMemo run as the default: ``apps/comemo/weights/comemo.safetensors`` + ``tokenizer.json`` +
``comemo.json`` (provenance) + ``comemo.md`` (the model card ``core.infra.model_card`` renders from it) +
``comemo_golden.json``.

    python -m apps.comemo.ship --run runs/comemo_bench/comemo --bench benchmarks/results/comemo_bench.json \\
        --command "python -m apps.comemo.vision_pretrain ... && python -m benchmarks.comemo_bench ..."

The provenance comes from the run: its final weights, ``last.pt``'s training arguments and wall time, the last
validation of ``metrics.jsonl``, and (``--bench``) the run's held-out accuracy from the CoMemo benchmark's JSON
(the evaluation stream there is not the training stream). The golden file holds the shipped model's logits on
the answer tokens of fixed samples (teacher forcing) and its greedy answers to them;
``tests/test_comemo_ship.py`` checks both.

Before anything is written the run is checked (:func:`check_run`): its files are there, ``last.pt`` is a training
state of the weights' variant, the model loads strictly with its tokenizer and gives finite logits on a small
sample. The files are then written together (staged, then renamed into place), so a refused or failed ship leaves
the shipped files as they were. Errors: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from apps.comemo.api import DEFAULT_WEIGHTS, CoMemo
from core.infra.cli import run_cli
from core.infra.guard import check_output, check_ship_run
from core.infra.ship import (Staging, check_finite, check_weights_path, loading_check, read_json_file,
                             read_jsonl_file, require_files)

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "GOLDEN_SAMPLES", "golden_outputs", "check_run", "ship", "main"]

GOLDEN_PATH = DEFAULT_WEIGHTS.with_name("comemo_golden.json")
TOKENIZER_PATH = DEFAULT_WEIGHTS.with_name("tokenizer.json")
#: fixed samples of the needle task (apps.comemo.synthetic.make_sample arguments), one short and one long
GOLDEN_SAMPLES = ({"task": "needle", "n_images": 4, "seed": 90_000_001, "needle": 2},
                  {"task": "needle", "n_images": 8, "seed": 90_000_002, "needle": 5})

CARD_TEXT = {
    "intended_use": "The default model of apps.comemo: answers `which image shows a digit and what digit is it ?` "
    "about a sequence of small synthetic images (the needle task), in the demo, the predict CLI and the Python "
    "API; a worked, inspectable example of the comemo variant (context path with RoPE-DHR positions plus a "
    "gated cross-attention memory path).",
    "out_of_scope": "Natural images, free-form questions, the count / describe / detail tasks (not trained), more "
    "than 8 images for the full answer (the image number it names is wrong beyond the trained count), any decision "
    "about people. It is a 1.5M-parameter model trained on one CPU core.",
    "tags": ["vision-language", "multi-image", "cross-attention", "rope-dhr", "comemo", "synthetic-data"],
    "datasets": ["procedural shapes and colours (apps.comemo.synthetic)", "scikit-learn load_digits"],
    "pipeline_tag": "image-text-to-text",
}


@torch.no_grad()
def golden_outputs(model: CoMemo) -> dict:
    """Teacher-forced logits on the answer tokens and the greedy answer of each golden sample."""
    from apps.comemo.batch import build_batch
    from apps.comemo.infer import generate_answer
    from apps.comemo.synthetic import make_sample

    out = []
    for spec in GOLDEN_SAMPLES:
        s = make_sample(spec["task"], spec["n_images"], spec["seed"], tile=model.model.cfg.vision.tile,
                        needle=spec["needle"])
        batch = build_batch([(s.images, s.question, s.answer)], model.tokenizer, model.model.cfg)
        logits = model.model(batch).logits[0]
        at = (batch.labels[0, 1:] != -100).nonzero().flatten()  # logits at t predict labels[t + 1]
        gen = generate_answer(model.model, model.tokenizer, s.images, s.question, max_new_tokens=32)
        out.append({**spec, "question": s.question, "answer": s.answer, "greedy_answer": gen["answer"],
                    "answer_logits": [[round(x, 5) for x in row] for row in logits[at].tolist()], "answer_targets": batch.labels[0, at + 1].tolist()})
    return {"samples": out}


RUN_FILES = ("model.safetensors", "tokenizer.json", "last.pt", "metrics.jsonl")
RUN_HOLDS = "an apps.comemo.train run folder holds model.safetensors, tokenizer.json, last.pt and metrics.jsonl"


def _last_val(records: list[dict]) -> dict:
    last = {}
    for rec in records:
        if "val_loss" in rec:
            last = rec
    return last


def _bench_metrics(bench: Path, variant: str, run: Path) -> dict:
    """The run's held-out accuracy from a CoMemo benchmark JSON (it must have evaluated this run's folder)."""
    data = read_json_file(bench, flag="--bench")
    a = data.get("args")
    need = ("runs", "eval_seed", "per_count", "max_images")
    if not isinstance(a, dict) or any(k not in a for k in need):
        raise ValueError(f"--bench {bench}: not a benchmarks.comemo_bench result (needs args with {', '.join(need)})")
    res = data.get("variants", {}).get(variant)
    if not isinstance(res, dict) or not isinstance(res.get("accuracy"), dict):
        raise ValueError(f"--bench {bench}: no results for variant {variant!r}")
    runs = Path(a["runs"])
    if (runs / variant).resolve() != run.resolve():
        raise ValueError(f"--bench {bench} evaluated {runs / variant}, not {run}")
    return {
        "evaluation": f"benchmarks/comemo_bench.py: greedy exact match on the evaluation stream (seed {a['eval_seed']}, "
        f"{a['per_count']} samples per image count, needle positions spread evenly; the training stream is another "
        f"seed); trained on 1-{a['max_images']} images",
        "needle_exact_match_by_images": res["accuracy"].get("needle"),
        "needle_digit_right_by_third_first_middle_last": res.get("needle_digit_accuracy_by_third"),
        "seconds_per_answer_one_thread": res.get("seconds_per_answer"),
    }


def check_run(run: Path) -> tuple[CoMemo, dict, list[dict]]:
    """``(model with tokenizer, last.pt state, metrics.jsonl records)`` of a complete training run whose model
    loads and runs.

    Raises ``FileNotFoundError`` / ``ValueError`` naming the file at fault: a missing file, a ``last.pt`` that is
    not a training state (``args`` with ``variant``, ``step``, ``wall_time``) or is of another variant than the
    weights, a bad ``metrics.jsonl``, or weights that are not a CoMemo model (format, strict keys, the tokenizer's
    vocabulary) or give non-finite logits on a small sample.
    """
    from apps.comemo.batch import build_batch
    from apps.comemo.synthetic import make_sample

    run = require_files(run, RUN_FILES, flag="--run", holds=RUN_HOLDS)
    with loading_check(run / "last.pt", flag="--run", what="training state"):
        state = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    if not (isinstance(state, dict) and isinstance(state.get("args"), dict) and "variant" in state["args"]
            and isinstance(state.get("step"), int) and isinstance(state.get("wall_time"), (int, float))):
        raise ValueError(f"--run {run / 'last.pt'}: not an apps.comemo.train state (a dict with args.variant, step "
                         "and wall_time)")
    records = read_jsonl_file(run / "metrics.jsonl", flag="--run")
    src = run / "model.safetensors"
    with loading_check(src, flag="--run", what="CoMemo model with tokenizer.json"):
        model = CoMemo.load(src)  # format and config from the header, strict keys, tokenizer.json beside it
        s = make_sample("needle", 2, GOLDEN_SAMPLES[0]["seed"], tile=model.model.cfg.vision.tile, needle=1)
        with torch.no_grad():
            batch = build_batch([(s.images, s.question, s.answer)], model.tokenizer, model.model.cfg)
            logits = model.model(batch).logits
        check_finite("the model's logits on a small sample", logits)
    if state["args"]["variant"] != model.variant:
        raise ValueError(f"--run {run}: last.pt trained variant {state['args']['variant']!r} but model.safetensors "
                         f"is variant {model.variant!r}; the files come from different runs")
    return model, state, records


def ship(run: Path, *, command: str, bench: Path | None = None, dest: Path = DEFAULT_WEIGHTS) -> Path:
    """Check the run (:func:`check_run`), ``bench`` and ``dest``, then write ``dest`` (a copy of
    ``run/model.safetensors``), the tokenizer, the provenance, the golden file and (inside a ``weights/`` folder)
    the card beside it, all together."""
    dest = check_weights_path(dest, flag="--dest", example="apps/comemo/weights/comemo.safetensors")
    run = Path(run)
    src = run / "model.safetensors"
    shipped, state, records = check_run(run)
    args = state["args"]
    train_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()
                  if k not in ("out", "resume", "max_minutes", "no_progress", "device")}
    variant = args["variant"]
    val = _last_val(records)
    metrics = {"validation": "32 fixed samples of the training task mix from a held-out seed, watched during training "
               "(not used to pick the checkpoint: the shipped weights are the last step)",
               "val_loss": val.get("val_loss"), "val_token_acc": val.get("val_token_acc")}
    if bench is not None:
        metrics.update(_bench_metrics(bench, variant, run))
    n_params = sum(p.numel() for p in shipped.model.parameters())
    record = {
        "name": f"longctx CoMemo ({variant}, default)",
        "what_it_is": f"A {n_params:,}-parameter vision-language model (apps.comemo, variant {variant}): a small ViT "
        "(pretrained here on tile classification), pixel shuffle and an MLP projector feed image tokens into a "
        "4-layer causal decoder (context path, RoPE-DHR positions) and, through tanh-gated cross-attention blocks, "
        "into its text tokens (memory path). The BPE tokenizer (tokenizer.json) was trained here.",
        "command": command,
        "data": "Samples drawn on the fly (apps.comemo.synthetic, training stream seed "
        f"{train_args.get('seed')}): {train_args.get('min_images')}-{train_args.get('max_images')} images of 32x32 "
        "procedural shapes, one of which shows a scikit-learn load_digits digit; tasks "
        f"{train_args.get('tasks')}; a text label `image K` after each image.",
        "model_config": json.loads(shipped.model.cfg.to_json()),
        "train_config": train_args,
        "steps": int(state["step"]),
        "wall_time_s": round(float(state["wall_time"]), 1),
        "held_out_metrics": metrics,
        "notes": "Wall time of the last stage on one thread of a shared 2-core machine; the ViT's pretraining (stage "
        "-1) is part of the command. Beyond 8 images the answer's image number is wrong although the digit is "
        "mostly read (see apps/comemo/README.md).",
        "model_card": CARD_TEXT,
    }
    golden = golden_outputs(shipped)
    for g in golden["samples"]:
        check_finite("the model's golden logits", torch.tensor(g["answer_logits"]))
    with Staging(dest.parent) as stage:
        stage.copy(src, dest)
        stage.copy(run / "tokenizer.json", dest.with_name("tokenizer.json"))
        stage.write_json(dest.with_suffix(".json"), record)
        stage.write_json(dest.with_name("comemo_golden.json"), {**golden, "command": "python -m apps.comemo.ship ..."})
        card = stage.write_card(dest)
    logger.info("shipped %s (%s, %d steps) to %s (card %s)", src, variant, record["steps"], dest, card)
    return dest


def _main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="training run folder (model.safetensors, tokenizer.json, last.pt, metrics.jsonl)")
    p.add_argument("--command", required=True, help="the commands that made the run, recorded in the card")
    p.add_argument("--bench", type=Path, help="a comemo_bench JSON that evaluated this run (its held-out accuracy goes into the card)")
    p.add_argument("--dest", type=Path, default=DEFAULT_WEIGHTS,
                   help="the weights file to write (default: the shipped model); the other files go beside it")
    args = p.parse_args(argv)
    check_output(args.dest, inputs=[args.bench], ship="apps.comemo")  # CoMemo's ship writes CoMemo's weights only
    if Path(args.run).resolve() == Path(args.dest).resolve().parent:  # its files sit beside the shipped ones
        check_ship_run(args.run, Path(args.dest).parent)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ship(args.run, command=args.command, bench=args.bench, dest=args.dest)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit code 0, or 2 with one line on stderr for a bad input (``core.infra.cli.run_cli``)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
