"""Classify texts: ``python -m apps.ncal.predict --checkpoint tmwpl --text "..."``.

``--checkpoint`` is a shipped model name (``tmwpl``, ``pmtd``) or a folder written by ``apps.ncal.train``.
For a dialogue turn give its speaker and, optionally, the previous turn (``--speaker teacher --previous "..."
--previous-speaker student``), as the PMTD model was trained. Prints each class's probability, highest first
(``--json`` for JSON). The demo calls the same :func:`classify`.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from functools import lru_cache

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "classify", "cached_checkpoint"]


@lru_cache(maxsize=4)
def cached_checkpoint(name_or_path: str):
    """Load (once per process) a checkpoint by shipped name or folder."""
    from apps.ncal.estimator import resolve_checkpoint
    from apps.ncal.model import load_checkpoint

    return load_checkpoint(resolve_checkpoint(name_or_path))


def classify(checkpoint: str, texts: list[str]) -> list[dict[str, float]]:
    """``[{class: probability}, ...]`` per text (classes in the checkpoint's order). Texts are validated
    (:func:`apps.ncal.data.check_texts`)."""
    from apps.ncal.data import check_texts
    from apps.ncal.model import infer

    ckpt = cached_checkpoint(str(checkpoint))
    probs, _ = infer(ckpt.model, ckpt.tokenizer, check_texts(texts))
    return [{c: float(p) for c, p in zip(ckpt.classes, row)} for row in probs.tolist()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.ncal.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="shipped name (tmwpl, pmtd) or checkpoint folder")
    p.add_argument("--text", required=True, action="append", help="text to classify (repeat for several)")
    p.add_argument("--speaker", default=None, choices=("teacher", "student"), help="speaker of a dialogue turn")
    p.add_argument("--previous", default=None, help="the previous dialogue turn (PMTD context)")
    p.add_argument("--previous-speaker", default=None, choices=("teacher", "student"))
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--log-level", default="WARNING")
    return p


def main(argv: Sequence[str] | None = None) -> list[dict[str, float]]:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from apps.ncal.data import check_texts, format_turn

    texts = check_texts(args.text)
    if args.speaker or args.previous:
        texts = [format_turn(t, speaker=args.speaker, previous=args.previous, previous_speaker=args.previous_speaker)
                 for t in texts]
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
