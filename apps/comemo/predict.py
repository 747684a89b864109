"""Answer a question about images: ``python -m apps.comemo.predict --images a.png b.png --question "..."``.

The images form one prompt, so the answer needs every one of them: each image that cannot be read is named on
stderr (all of them, not only the first) and nothing is answered (exit code 2).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from core.infra.cli import InputTally, positive_int, run_cli

__all__ = ["build_parser", "main"]

ACCEPTED_IMAGES = "image files Pillow reads (.png, .jpg, ...), at most the model's pixel limit each"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, nargs="+", required=True, help="image files, in prompt order")
    p.add_argument("--question", required=True, help="the question")
    p.add_argument("--weights", type=Path, help="model.safetensors (tokenizer.json beside it) or a run folder; default: shipped")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="longest answer in tokens")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from apps.comemo.api import CoMemo
    from apps.comemo.batch import load_image

    model = CoMemo.load(args.weights)
    tally = InputTally("image")
    images = []
    for i, path in enumerate(args.images):
        try:
            images.append(load_image(str(path), max_pixels=model.model.cfg.max_pixels, index=i))
        except Exception as err:  # noqa: BLE001 - every bad image is named before the prompt is refused
            tally.fail(path, err, accepted=ACCEPTED_IMAGES)
        else:
            tally.ok()
    if tally.failed:  # one prompt: without all its images there is no answer
        return tally.finish(all_or_nothing=True)
    print(model.answer(images, args.question, max_new_tokens=args.max_new_tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
