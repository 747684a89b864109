"""Evaluate an NCAL checkpoint: ``python -m apps.ncal.evaluate --checkpoint DIR --data PATH``.

``--checkpoint`` is a folder written by ``apps.ncal.train`` or a shipped model name (``tmwpl``, ``pmtd``);
``--data`` a labelled JSONL (TMWPL or PMTD layout) or a shipped name (its test split). Prints accuracy,
macro-F1, per-class recall and F1, head/medium/tail recall (bins of the checkpoint's train set), NC1/NC2 of the
features, and the confusion matrix; ``--out FILE`` writes them as JSON (atomically). ``--out`` is checked before
the evaluation; a bad line of ``--data`` is named and nothing is evaluated (metrics over part of a test set would
not be that test set's).
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Sequence
from pathlib import Path

from core.infra.cli import PartialFailure, add_run_options, configure_run, positive_int, run_cli
from core.infra.device import add_device_options, device_from_args
from core.infra.guard import check_output

logger = logging.getLogger(__name__)

#: the files of a checkpoint folder the evaluation reads (never an output)
CHECKPOINT_FILES = ("ncal.json", "model.safetensors", "tokenizer.json")

__all__ = ["build_parser", "main", "evaluate_checkpoint", "format_report"]


def evaluate_checkpoint(checkpoint: str, data: str, *, batch_size: int = 64, base_model: str | None = None,
                        progress: bool = False, device=None, dtype=None) -> dict:
    """Metrics of a checkpoint on a labelled file or shipped test split (see module docs)."""
    from apps.ncal.data import DATASETS, load_split, read_jsonl
    from apps.ncal.estimator import resolve_checkpoint
    from apps.ncal.metrics import classification_metrics, collapse_metrics
    from apps.ncal.model import infer, load_checkpoint, predicted_labels

    ckpt = load_checkpoint(resolve_checkpoint(checkpoint), base_model=base_model, device=device, dtype=dtype)
    classes = tuple(ckpt.classes)
    context = ckpt.meta.get("context", "past")
    if str(data).lower() in DATASETS:
        examples, ds_classes = load_split(data, "test", context=context)
        if tuple(ds_classes) != classes:
            raise ValueError(f"dataset {data!r} has classes {list(ds_classes)}, the checkpoint {list(classes)}")
    else:
        examples = read_jsonl(data, classes=classes, context=context)
    probs, feats = infer(ckpt.model, ckpt.tokenizer, [e.text for e in examples], batch_size=batch_size,
                         progress=progress)
    idx = {c: k for k, c in enumerate(classes)}
    y = [idx[e.label] for e in examples]
    m = classification_metrics(y, predicted_labels(probs), list(classes), ckpt.meta.get("bins"))
    if len(set(y)) >= 2:
        m["collapse"] = collapse_metrics(feats, y, len(classes))
    m["classes"] = list(classes)
    m["data"] = str(data)
    return m


def format_report(m: dict) -> str:
    """Plain-text report: headline metrics, per-class recall/F1, confusion matrix."""
    lines = [f"n={m['n']}  accuracy={m['accuracy']:.4f}  macro-F1={m['macro_f1']:.4f}"]
    bins = [f"{b} recall={m[f'recall_{b}']:.4f}" for b in ("head", "medium", "tail") if m.get(f"recall_{b}") is not None]
    if bins:
        lines.append("  ".join(bins))
    if "collapse" in m:
        lines.append(f"NC1={m['collapse']['nc1']:.3f}  NC2={m['collapse']['nc2']:.3f}")
    lines.append("class        recall   F1")
    for c in m["classes"]:
        lines.append(f"{c:<12} {m['recall'][c]:.3f}    {m['f1'][c]:.3f}")
    lines.append("confusion (rows true, columns predicted, in class order above):")
    for c, row in zip(m["classes"], m["confusion"]):
        lines.append(f"{c:<12} " + " ".join(f"{v:4d}" for v in row))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="checkpoint folder or shipped name (tmwpl, pmtd)")
    p.add_argument("--base-model", default=None, metavar="DIR",
                   help="an adapter's base model folder, when not where its ncal.json says (it was moved)")
    p.add_argument("--data", required=True, help="labelled JSONL or shipped name (its test split)")
    p.add_argument("--out", default=None, help="write the metrics as JSON here")
    p.add_argument("--batch-size", type=positive_int, default=64)
    p.add_argument("--no-progress", action="store_true", help="no progress bar over the batches")
    add_device_options(p)
    add_run_options(p, threads=False)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device, dtype = device_from_args(args)  # a missing GPU is one line before any work
    configure_run(args)
    from core.infra.fileio import check_writable, write_json_atomic

    if args.out is not None:
        from apps.ncal.estimator import resolve_checkpoint

        check_output(args.out, inputs=[args.data, args.checkpoint])  # before the checkpoint is even read
        ckpt = resolve_checkpoint(args.checkpoint)
        check_output(args.out, inputs=[ckpt, *(Path(ckpt) / f for f in CHECKPOINT_FILES)])
        check_writable(args.out, what="--out")  # before the evaluation it would record
    m = evaluate_checkpoint(args.checkpoint, args.data, batch_size=args.batch_size, base_model=args.base_model,
                            progress=not args.no_progress, device=device, dtype=dtype)
    print(format_report(m))  # the CLI's output
    if not all(math.isfinite(m[k]) for k in ("accuracy", "macro_f1")):
        raise PartialFailure(f"the metrics are not finite (accuracy {m['accuracy']}, macro-F1 {m['macro_f1']})")
    if args.out is not None:
        write_json_atomic(args.out, m)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
