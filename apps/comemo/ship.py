"""Ship a trained CoMemo run as the default: ``apps/comemo/weights/comemo.safetensors`` + ``tokenizer.json`` +
``comemo.json`` (provenance, rendered into the model card ``comemo.md`` by ``python -m core.infra.model_card``) +
``comemo_golden.json``.

    python -m apps.comemo.ship --run runs/comemo_bench/comemo --bench benchmarks/results/comemo_bench.json \\
        --command "python -m apps.comemo.vision_pretrain ... && python -m benchmarks.comemo_bench ..."

The provenance comes from the run: its final weights, ``last.pt``'s training arguments and wall time, the last
validation of ``metrics.jsonl``, and (``--bench``) the run's held-out accuracy from the CoMemo benchmark's JSON
(the evaluation stream there is not the training stream). The golden file holds the shipped model's logits on
the answer tokens of fixed samples (teacher forcing) and its greedy answers to them;
``tests/test_comemo_ship.py`` checks both.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
from pathlib import Path

import torch

from apps.comemo.api import DEFAULT_WEIGHTS, CoMemo
from core.infra.fileio import atomic_path, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["GOLDEN_PATH", "GOLDEN_SAMPLES", "golden_outputs", "ship", "main"]

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


def _last_val(metrics: Path) -> dict:
    last = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "val_loss" in rec:
                last = rec
    return last


def _bench_metrics(bench: Path, variant: str, run: Path) -> dict:
    """The run's held-out accuracy from a CoMemo benchmark JSON (it must have evaluated this run's folder)."""
    data = json.loads(bench.read_text())
    res = data.get("variants", {}).get(variant)
    if res is None:
        raise SystemExit(f"{bench}: no results for variant {variant!r}")
    runs = Path(data["args"]["runs"])
    if (runs / variant).resolve() != run.resolve():
        raise SystemExit(f"{bench} evaluated {runs / variant}, not {run}")
    a = data["args"]
    return {
        "evaluation": f"benchmarks/comemo_bench.py: greedy exact match on the evaluation stream (seed {a['eval_seed']}, "
        f"{a['per_count']} samples per image count, needle positions spread evenly; the training stream is another "
        f"seed); trained on 1-{a['max_images']} images",
        "needle_exact_match_by_images": res["accuracy"].get("needle"),
        "needle_digit_right_by_third_first_middle_last": res.get("needle_digit_accuracy_by_third"),
        "seconds_per_answer_one_thread": res.get("seconds_per_answer"),
    }


def ship(run: Path, *, command: str, bench: Path | None = None, dest: Path = DEFAULT_WEIGHTS) -> Path:
    """Copy ``run``'s weights and tokenizer beside ``dest`` and write the provenance and golden files."""
    src = run / "model.safetensors"
    state = torch.load(run / "last.pt", map_location="cpu", weights_only=False)
    args = state["args"]
    train_args = {k: (str(v) if isinstance(v, Path) else v) for k, v in args.items()
                  if k not in ("out", "resume", "max_minutes", "no_progress", "device")}
    variant = args["variant"]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(dest) as tmp:
        shutil.copyfile(src, tmp)
    with atomic_path(dest.with_name("tokenizer.json")) as tmp:
        shutil.copyfile(run / "tokenizer.json", tmp)
    shipped = CoMemo.load(dest)
    val = _last_val(run / "metrics.jsonl")
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
    write_json_atomic(dest.with_suffix(".json"), record)
    write_json_atomic(dest.with_name("comemo_golden.json"), {**golden_outputs(shipped), "command": "python -m apps.comemo.ship ..."})
    logger.info("shipped %s (%s, %d steps) to %s; now run python -m core.infra.model_card", src, variant, record["steps"], dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.ship", description=__doc__.split("\n\n")[0])
    p.add_argument("--run", type=Path, required=True, help="training run folder (model.safetensors, tokenizer.json, last.pt, metrics.jsonl)")
    p.add_argument("--command", required=True, help="the commands that made the run, recorded in the card")
    p.add_argument("--bench", type=Path, help="a comemo_bench JSON that evaluated this run (its held-out accuracy goes into the card)")
    p.add_argument("--dest", type=Path, default=DEFAULT_WEIGHTS)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    ship(args.run, command=args.command, bench=args.bench, dest=args.dest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
