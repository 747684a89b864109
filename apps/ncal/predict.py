"""Classify texts or data rows: ``python -m apps.ncal.predict --checkpoint tmwpl --text "..."``.

``--checkpoint`` is a shipped model name (``tmwpl``, ``pmtd``) or a folder written by ``apps.ncal.train``.
``--text`` is a model input as it is; for a dialogue turn give its speaker and, optionally, the previous turn
(``--speaker teacher --previous "..." --previous-speaker student``), as the PMTD model was trained.
``--rows FILE.jsonl`` classifies the rows of a file in the layout of the model's training data (PMTD:
``dialog_content`` + ``dialog_history``; TMWPL: ``question``; ``class`` is optional and not used), each
formatted as training formatted it. Prints each class's probability, highest first (``--json`` for JSON, one
``{class: probability}`` per input). The demo calls the same :func:`classify`.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from functools import lru_cache

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "classify", "cached_checkpoint", "read_rows"]


@lru_cache(maxsize=4)
def cached_checkpoint(name_or_path: str):
    """Load (once per process) a checkpoint by shipped name or folder."""
    from apps.ncal.estimator import resolve_checkpoint
    from apps.ncal.model import load_checkpoint

    return load_checkpoint(resolve_checkpoint(name_or_path))


def classify(checkpoint: str, inputs) -> list[dict[str, float]]:
    """``[{class: probability}, ...]`` per input (classes in the checkpoint's order).

    ``inputs``: strings (model inputs, used as they are) and/or rows of the model's training layout as dicts (or a
    DataFrame), formatted as training formatted them (:func:`apps.ncal.inputs.model_inputs`, which validates them).
    """
    from apps.ncal.inputs import model_inputs, row_layout
    from apps.ncal.model import infer

    ckpt = cached_checkpoint(str(checkpoint))
    texts = model_inputs(inputs, layout=row_layout(ckpt.meta), context=ckpt.meta.get("context", "past"))
    probs, _ = infer(ckpt.model, ckpt.tokenizer, texts)
    return [{c: float(p) for c, p in zip(ckpt.classes, row)} for row in probs.tolist()]


def read_rows(checkpoint: str, path: str) -> list[str]:
    """The model inputs of a JSONL file of rows, formatted as the checkpoint's training data (errors name the line)."""
    from apps.ncal.data import read_jsonl
    from apps.ncal.inputs import accepted, row_layout

    meta = cached_checkpoint(str(checkpoint)).meta
    layout = row_layout(meta)
    if layout is None:
        raise ValueError(f"checkpoint {checkpoint!r} was fitted on texts and records no row layout; give --text "
                         f"(accepted: {accepted(layout)})")
    return [e.text for e in read_jsonl(path, require_label=False, context=meta.get("context", "past"), layout=layout)]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="shipped name (tmwpl, pmtd) or checkpoint folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", action="append", help="text to classify, used as it is (repeat for several)")
    src.add_argument("--rows", default=None, help="JSONL file of rows in the layout of the model's training data")
    p.add_argument("--speaker", default=None, choices=("teacher", "student"), help="speaker of a dialogue turn")
    p.add_argument("--previous", default=None, help="the previous dialogue turn (PMTD context)")
    p.add_argument("--previous-speaker", default=None, choices=("teacher", "student"))
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from apps.ncal.data import check_texts, format_turn

    if args.rows is not None:
        if args.speaker or args.previous or args.previous_speaker:
            parser.error("--speaker/--previous/--previous-speaker apply to --text; a row carries its own context")
        texts = read_rows(args.checkpoint, args.rows)
    else:
        texts = check_texts(args.text)
        if args.speaker or args.previous:
            texts = [format_turn(t, speaker=args.speaker, previous=args.previous,
                                 previous_speaker=args.previous_speaker) for t in texts]
    out = classify(args.checkpoint, texts)
    if args.json:
        print(json.dumps(out, ensure_ascii=False))
    else:
        for t, probs in zip(texts, out):
            print(t.replace("\n", " | "))
            for c, p in sorted(probs.items(), key=lambda kv: -kv[1]):
                print(f"  {c:<10} {p:.4f}")
    return out


if __name__ == "__main__":
    main()
