"""Procedural multi-image tasks for CoMemo: shapes, colours, positions and handwritten digits.

Every sample is drawn from its own seed, so a dataset is deterministic and sample ``i`` can be made alone
(training draws samples on the fly from ``(seed, index)``). Images are RGB uint8 arrays; a single image is
``tile x tile`` pixels; the detail task draws a wide or tall image of ``rows x cols`` tiles. Digits are
scikit-learn's ``load_digits`` (8x8 handwritten digits, shipped with scikit-learn), upscaled 2x and
composited in white.

Tasks:
    ``needle``: N images with one coloured shape each, except one (the needle, at position ``needle``)
        which shows a digit. Q: ``which image shows a digit and what digit is it ?`` A: ``image K shows D``.
    ``detail``: one wide or tall image (grid 1x2, 2x1, 1x3, 3x1, 2x3 or 3x2 tiles) with shapes, and a digit
        in one tile. Q: ``what digit is in the picture and where ?`` A: ``D in row R column C``.
    ``count``: N images with 1-3 shapes each. Q (half the samples): ``how many COLOUR shapes are there ?``
        A: the number; or ``which image has more shapes , image I or image J ?`` A: ``image K``.
    ``describe``: N images with one shape each. Q: ``describe every image .`` A:
        ``image 1 COLOUR SHAPE POSITION . image 2 ... .`` (a long answer).

CLI: ``python -m apps.comemo.synthetic --out DIR`` writes ``DIR/<split>.jsonl`` (one sample per line: task,
image file names, question, answer, needle) and the PNGs under ``DIR/images/``.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import random
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

from core.infra.cli import capped_int, nonempty_path_obj, run_cli
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = ["TASKS", "COLOURS", "SHAPES", "POSITIONS", "Sample", "make_sample", "sample_seed", "corpus_texts",
           "build_parser", "main"]

TASKS = ("needle", "detail", "count", "describe")
COLOURS = {"red": (230, 40, 40), "green": (40, 200, 60), "blue": (50, 90, 240), "yellow": (240, 220, 40),
           "purple": (170, 60, 220), "orange": (250, 140, 20)}
SHAPES = ("circle", "square", "triangle")
POSITIONS = ("top left", "top right", "bottom left", "bottom right")
DETAIL_GRIDS = ((1, 2), (2, 1), (1, 3), (3, 1), (2, 3), (3, 2))
NUMBERS = tuple(str(i) for i in range(0, 200))


@dataclass
class Sample:
    """One example: images (uint8 ``(H, W, 3)``), question, answer, and where the needle is."""

    task: str
    images: list[np.ndarray]
    question: str
    answer: str
    needle: int | None = None  # 0-based index of the image the answer depends on (needle task)
    meta: dict = field(default_factory=dict)


@functools.lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)  # (1797, 8, 8) in [0, 1], (1797,)


def sample_seed(seed: int, index: int) -> int:
    """Seed of sample ``index`` of the stream ``seed`` (independent of how many samples came before)."""
    return (int(seed) * 1_000_003 + int(index) * 7919 + 12345) % (2**63)


def _background(rng: np.random.Generator, h: int, w: int) -> Image.Image:
    base = rng.integers(10, 50)
    arr = np.clip(base + rng.normal(0, 6, (h, w, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(arr)


def _quadrant_box(pos: str, x0: int, y0: int, tile: int, rng: random.Random) -> tuple[int, int, int, int]:
    half = tile // 2
    size = max(4, int(half * rng.uniform(0.6, 0.85)))
    qx = x0 + (half if "right" in pos else 0)
    qy = y0 + (half if "bottom" in pos else 0)
    ox = rng.randint(0, half - size)
    oy = rng.randint(0, half - size)
    return qx + ox, qy + oy, qx + ox + size - 1, qy + oy + size - 1  # PIL boxes include their right/bottom edge


def _draw_shape(draw: ImageDraw.ImageDraw, shape: str, colour: str, box: tuple[int, int, int, int]) -> None:
    fill = COLOURS[colour]
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    else:
        l, t, r, b = box
        draw.polygon([((l + r) / 2, t), (l, b), (r, b)], fill=fill)


def _paste_digit(img: Image.Image, digit_img: np.ndarray, x0: int, y0: int, size: int) -> None:
    glyph = Image.fromarray((digit_img * 255).astype(np.uint8)).resize((size, size), Image.BILINEAR)
    alpha = np.asarray(glyph, dtype=np.float32)[..., None] / 255.0
    arr = np.asarray(img, dtype=np.float32)
    patch = arr[y0:y0 + size, x0:x0 + size]
    arr[y0:y0 + size, x0:x0 + size] = patch * (1 - alpha) + 255.0 * alpha
    img.paste(Image.fromarray(arr.astype(np.uint8)))


def _digit(rng: random.Random, digit: int | None = None) -> tuple[int, np.ndarray]:
    images, targets = _digits()
    if digit is None:
        digit = rng.randrange(10)
    idx = np.flatnonzero(targets == digit)
    return digit, images[int(idx[rng.randrange(len(idx))])]


def _shape_image(rng: random.Random, nrng: np.random.Generator, tile: int, n_shapes: int = 1):
    """A ``tile x tile`` image with ``n_shapes`` shapes in distinct quadrants; returns (array, [(colour, shape, pos)])."""
    img = _background(nrng, tile, tile)
    draw = ImageDraw.Draw(img)
    objs = []
    for pos in rng.sample(POSITIONS, n_shapes):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        _draw_shape(draw, shape, colour, _quadrant_box(pos, 0, 0, tile, rng))
        objs.append((colour, shape, pos))
    return np.asarray(img), objs


def _tiled_shapes(rng, nrng, tile: int, grid: tuple[int, int]) -> np.ndarray:
    """A ``rows*tile x cols*tile`` image: one shape image per tile, row-major."""
    rows, cols = grid
    return np.concatenate([np.concatenate([_shape_image(rng, nrng, tile)[0] for _ in range(cols)], axis=1)
                           for _ in range(rows)], axis=0)


def _needle(rng, nrng, n_images, tile, needle, grid=(1, 1)):
    if needle is None:
        needle = rng.randrange(n_images)
    if not 0 <= needle < n_images:
        raise ValueError(f"needle position must be in [0, {n_images}), got {needle}")
    if tuple(grid) != (1, 1):  # high-resolution needles: every image is rows x cols tiles, the digit in one tile
        rows, cols = grid
        images = [_tiled_shapes(rng, nrng, tile, grid) for _ in range(n_images)]
        img = images[needle].copy()
        target = rng.randrange(rows * cols)
        r, c = divmod(target, cols)
        cell = _background(nrng, tile, tile)
        digit, glyph = _digit(rng)
        size = tile * 3 // 4
        _paste_digit(cell, glyph, rng.randint(0, tile - size), rng.randint(0, tile - size), size)
        img[r * tile:(r + 1) * tile, c * tile:(c + 1) * tile] = np.asarray(cell)
        images[needle] = img
        return Sample("needle", images, "which image shows a digit and what digit is it ?",
                      f"image {needle + 1} shows {digit}", needle=needle,
                      meta={"digit": digit, "grid": [rows, cols], "tile": target})
    images = [_shape_image(rng, nrng, tile)[0] for _ in range(n_images)]
    img = _background(nrng, tile, tile)
    digit, glyph = _digit(rng)
    size = tile * 3 // 4
    _paste_digit(img, glyph, rng.randint(0, tile - size), rng.randint(0, tile - size), size)
    images[needle] = np.asarray(img)
    return Sample("needle", images, "which image shows a digit and what digit is it ?",
                  f"image {needle + 1} shows {digit}", needle=needle, meta={"digit": digit})


def _detail(rng, nrng, tile, grid=None):
    rows, cols = grid if grid is not None else rng.choice(DETAIL_GRIDS)
    img = _background(nrng, rows * tile, cols * tile)
    draw = ImageDraw.Draw(img)
    target = rng.randrange(rows * cols)
    for t in range(rows * cols):
        if t != target:
            r, c = divmod(t, cols)
            _draw_shape(draw, rng.choice(SHAPES), rng.choice(list(COLOURS)),
                        _quadrant_box(rng.choice(POSITIONS), c * tile, r * tile, tile, rng))
    r, c = divmod(target, cols)
    digit, glyph = _digit(rng)
    size = tile // 2
    _paste_digit(img, glyph, c * tile + rng.randint(0, tile - size), r * tile + rng.randint(0, tile - size), size)
    return Sample("detail", [np.asarray(img)], "what digit is in the picture and where ?",
                  f"{digit} in row {r + 1} column {c + 1}", needle=None, meta={"grid": [rows, cols], "tile": target})


def _count(rng, nrng, n_images, tile):
    drawn = [_shape_image(rng, nrng, tile, rng.randint(1, 3)) for _ in range(n_images)]
    images = [a for a, _ in drawn]
    if n_images >= 2 and rng.random() < 0.5:
        counts = [len(o) for _, o in drawn]
        pairs = [(i, j) for i in range(n_images) for j in range(i + 1, n_images) if counts[i] != counts[j]]
        if pairs:
            i, j = rng.choice(pairs)
            k = i if counts[i] > counts[j] else j
            return Sample("count", images, f"which image has more shapes , image {i + 1} or image {j + 1} ?",
                          f"image {k + 1}", meta={"kind": "compare"})
    colour = rng.choice(list(COLOURS))
    n = sum(1 for _, objs in drawn for (col, _, _) in objs if col == colour)
    return Sample("count", images, f"how many {colour} shapes are there ?", str(n), meta={"kind": "count"})


def _describe(rng, nrng, n_images, tile):
    drawn = [_shape_image(rng, nrng, tile) for _ in range(n_images)]
    parts = [f"image {i + 1} {c} {s} {p} ." for i, (_, [(c, s, p)]) in enumerate(drawn)]
    return Sample("describe", [a for a, _ in drawn], "describe every image .", " ".join(parts))


def make_sample(task: str, n_images: int, seed: int, *, tile: int = 32, needle: int | None = None,
                grid: tuple[int, int] | None = None, image_grid: tuple[int, int] = (1, 1)) -> Sample:
    """One sample of ``task`` with ``n_images`` images (the detail task always has one), from ``seed``.

    Args:
        task: one of :data:`TASKS`.
        n_images: images in the sample (>= 1).
        seed: the sample's seed (see :func:`sample_seed`).
        tile: side of one image (one tile) in pixels, >= 16.
        needle: needle position for the needle task (default: drawn).
        grid: tile grid of the detail task (default: drawn from ``DETAIL_GRIDS``).
        image_grid: ``(rows, cols)`` tiles of every image of the needle task (high-resolution needles: each
            image is ``rows*tile x cols*tile``, the digit in one of its tiles); ``(1, 1)`` (default) keeps
            one-tile images and the original samples.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; choose one of {list(TASKS)}")
    if not (isinstance(n_images, int) and n_images >= 1):
        raise ValueError(f"n_images must be a positive int, got {n_images!r}")
    if not (isinstance(tile, int) and tile >= 16):
        raise ValueError(f"tile must be an int >= 16, got {tile!r}")
    try:
        image_grid = (int(image_grid[0]), int(image_grid[1]))
    except (TypeError, ValueError, IndexError):
        raise ValueError(f"image_grid must be a pair (rows, cols) of ints, got {image_grid!r}") from None
    if min(image_grid) < 1:
        raise ValueError(f"image_grid must have positive entries, got {image_grid!r}")
    if image_grid != (1, 1) and task != "needle":
        raise ValueError(f"image_grid applies to the needle task only, got task {task!r}")
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    if task == "needle":
        return _needle(rng, nrng, n_images, tile, needle, image_grid)
    if task == "detail":
        return _detail(rng, nrng, tile, grid)
    if task == "count":
        return _count(rng, nrng, n_images, tile)
    return _describe(rng, nrng, n_images, tile)


def corpus_texts() -> list[str]:
    """Text covering every word the tasks can produce (for training the tokenizer)."""
    words = [*COLOURS, *SHAPES, *POSITIONS, "image", "shows", "digit", "in", "row", "column", "shapes", "more",
             "or", "how", "many", "are", "there", "which", "has", "and", "what", "is", "it", "the", "picture",
             "where", "describe", "every", "a", "?", ".", ","]
    texts = [" ".join(words)]
    texts += [" ".join(NUMBERS[i:i + 10]) for i in range(0, len(NUMBERS), 10)]
    for seed in range(200):
        for task in TASKS:
            s = make_sample(task, 1 + seed % 8, sample_seed(99, seed), tile=16)
            texts.append(s.question + " " + s.answer)
    return texts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.comemo.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=nonempty_path_obj, required=True, help="output folder")
    p.add_argument("--split", default="train", help="split name: the file DIR/<split>.jsonl")
    p.add_argument("--samples", type=capped_int(1_000_000, why="samples per task and image count (each a file)"),
                   default=200, help="samples per task and image count")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS, help="tasks to draw")
    p.add_argument("--images", type=capped_int(64, why="images of one sample"), nargs="+", default=[1, 2, 4, 8],
                   help="image counts (train on <= 8, test on 16, 32, 64)")
    p.add_argument("--tile", type=capped_int(1024, why="side of one image in pixels"), default=32,
                   help="side of one image / tile in pixels")
    p.add_argument("--seed", type=int, default=0, help="stream seed (use different seeds for train and test)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.samples < 1:
        raise SystemExit(f"--samples must be >= 1, got {args.samples}")
    if any(n < 1 for n in args.images):
        raise SystemExit(f"--images must be positive, got {args.images}")
    from tqdm import tqdm

    from core.infra.fileio import write_text_atomic

    img_dir = args.out / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    jobs = [(t, n) for t in args.tasks for n in ([1] if t == "detail" else args.images)]
    lines = []
    index = 0
    with tqdm(total=len(jobs) * args.samples, desc="synthetic", disable=args.no_progress) as bar:
        for task, n in jobs:
            for k in range(args.samples):
                needle = (k * n // args.samples) if task == "needle" else None  # every position, evenly
                s = make_sample(task, n, sample_seed(args.seed, index), tile=args.tile, needle=needle)
                names = []
                for j, arr in enumerate(s.images):
                    name = f"{args.split}_{index:07d}_{j:03d}.png"
                    Image.fromarray(arr).save(img_dir / name)
                    names.append(name)
                lines.append(json.dumps({"task": s.task, "images": names, "question": s.question, "answer": s.answer,
                                         "needle": s.needle, "meta": s.meta}))
                index += 1
                bar.update(1)
    write_text_atomic(args.out / f"{args.split}.jsonl", "".join(ln + "\n" for ln in lines))
    logger.info("wrote %d samples to %s", len(lines), args.out / f"{args.split}.jsonl")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
