"""Answer a question about images: ``python -m apps.comemo.predict --images a.png b.png --question "..."``.

The model: the shipped default, ``--weights`` (a model trained by ``python -m apps.comemo.train``), or ``--model DIR``
(a transformers InternVL folder: a stage folder of ``python -m apps.comemo.recipes.internvl``, a released CoMemo
checkpoint converted by ``python -m apps.comemo.convert``, or a plain InternVL folder, which gets the memory path with
its gates at 0), run with ``--device``/``--dtype`` (auto: CUDA and bf16 when present).

The images form one prompt, so the answer needs every one of them: each image that cannot be read is named on
stderr (all of them, not only the first) and nothing is answered (exit code 2).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from core.infra.cli import InputTally, UsageError, positive_int, run_cli
from core.infra.device import add_device_options, resolve_device

__all__ = ["build_parser", "main"]

ACCEPTED_IMAGES = "image files Pillow reads (.png, .jpg, ...), at most the model's pixel limit each"
HF_MAX_PIXELS = 100_000_000  # with --model: the processor resizes every image to its tiles; this only stops absurd files


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.predict", description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=Path, nargs="+", required=True, help="image files, in prompt order")
    p.add_argument("--question", required=True, help="the question")
    p.add_argument("--weights", type=Path, help="model.safetensors (tokenizer.json beside it) or a run folder; default: shipped")
    p.add_argument("--model", type=Path, help="a transformers InternVL folder (recipe stage, converted release, InternVL)")
    p.add_argument("--reference", action="store_true",
                   help="with --model: the release's tile order and decode query positions (see apps/comemo/README.md)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="longest answer in tokens")
    add_device_options(p)
    return p


def _is_hf_folder(path: Path | None) -> bool:
    return path is not None and path.is_dir() and (path / "config.json").is_file()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    resolve_device(args.device)  # a missing GPU: one line, exit 2, before anything is read
    from apps.comemo.api import CoMemo
    from apps.comemo.batch import load_image

    if args.model is not None and args.weights is not None:
        raise UsageError("pass --model (a transformers folder) or --weights (a model of apps.comemo.train), not both")
    folder = args.model if args.model is not None else (args.weights if _is_hf_folder(args.weights) else None)
    if folder is not None:
        if not _is_hf_folder(folder):
            raise UsageError(f"--model {folder}: not a model folder (no config.json); pass a folder written by "
                             "apps.comemo.recipes.internvl or apps.comemo.convert, or an InternVL folder")
        model = CoMemo.from_hf(folder, device=args.device, dtype=args.dtype, reference=args.reference or None)
        max_pixels = HF_MAX_PIXELS
    else:
        model = CoMemo.load(args.weights, device=resolve_device(args.device))
        max_pixels = model.model.cfg.max_pixels
    tally = InputTally("image")
    images = []
    for i, path in enumerate(args.images):
        try:
            images.append(load_image(str(path), max_pixels=max_pixels, index=i))
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
