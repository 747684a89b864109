"""Answer a question about images: ``python -m apps.comemo.predict --images a.png b.png --question "..."``."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.predict", description=__doc__)
    p.add_argument("--images", type=Path, nargs="+", required=True, help="image files, in prompt order")
    p.add_argument("--question", required=True, help="the question")
    p.add_argument("--weights", type=Path, help="model.safetensors (tokenizer.json beside it) or a run folder; default: shipped")
    p.add_argument("--max-new-tokens", type=int, default=64, help="longest answer in tokens")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from apps.comemo.api import CoMemo

    try:
        model = CoMemo.load(args.weights)
        text = model.answer([str(p) for p in args.images], args.question, max_new_tokens=args.max_new_tokens)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
