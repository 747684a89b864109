"""N-way many-shot image classification with EMLoC on a transformers VLM (the paper's protocol, Qwen2-VL first).

    python -m apps.emloc.recipes.qwen2vl --model DIR --data DATA --out OUT [--n-way 5] [--demos 200]
        [--queries 10] [--policy emloc] [--delta 0.005] [--chunk-demos 4] [--compare full,snapkv,h2o]

``--model``: a local model folder (``save_pretrained`` output or a downloaded snapshot: config, weights,
processor with its chat template), loaded with ``core.hf.load`` (nothing is downloaded).

``--data``, either
  * a folder of class subfolders, ``DATA/<class name>/<image>`` (the folder name is the label text; ``_`` reads
    as a space), or
  * a CSV file with a header and the columns ``image`` (a path, relative to the CSV) and ``label`` (the label
    text), and optionally ``split`` (``train`` rows are the demonstration pool, any other value the query pool).

Protocol: ``--n-way`` classes are drawn (seeded; 0 = every class); without a ``split`` column the last
``--queries`` images of each class (in a seeded shuffle) are queries and the rest the demonstration pool. ``--demos``
demonstrations are drawn at random from the pool of the chosen classes, in random order, formatted with the model's
chat template (user: image + ``--prompt``; assistant: the label), and compressed once with ``--policy``; every
query is then answered by scoring each class's label text after the query (the highest log-probability wins;
the reference generates free text and matches it, which needs no candidate list but a longer decode). Images are
resized to ``--image-size`` (default 224x224, the reference's 50,176 pixels). ``--compare`` runs other policies on
the same demonstrations and queries: budgeted ones at the main policy's kept fraction.

Writes ``OUT/results.json`` (accuracy, kept fraction, keep per layer, seconds per policy, the settings) and prints
one JSON line per policy; ``--save-memory`` also writes ``OUT/memory.safetensors`` for the main policy.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import random
import time
from pathlib import Path

from core.infra.cli import (UsageError, nonempty_path_obj, nonnegative_int, positive_float, positive_int, run_cli,
                            seed_int)
from core.infra.guard import check_outputs
from core.infra.device import add_device_options, device_from_args

logger = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


def _policies() -> list[str]:
    from core.kv_compress import POLICIES

    return sorted(POLICIES)


def read_data(path: Path) -> tuple[dict[str, list[Path]], dict[str, list[Path]] | None]:
    """``(images per label, query images per label or None)`` from a class-folder tree or a CSV (module docs)."""
    if path.is_dir():
        pool: dict[str, list[Path]] = {}
        for sub in sorted(p for p in path.iterdir() if p.is_dir()):
            imgs = sorted(q for q in sub.iterdir() if q.is_file() and q.suffix.lower() in IMAGE_SUFFIXES)
            if imgs:
                pool[sub.name.replace("_", " ")] = imgs
        if len(pool) < 2:
            raise UsageError(f"--data {path}: expected DATA/<class name>/<image> with at least 2 classes of images "
                             f"({', '.join(IMAGE_SUFFIXES)}), found {len(pool)}")
        return pool, None
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such folder or CSV file")
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except (UnicodeDecodeError, csv.Error) as err:
        raise UsageError(f"--data {path} is not a readable CSV file: {err}") from None
    if not rows or not {"image", "label"} <= set(rows[0]):
        raise UsageError(f"--data {path}: a CSV needs a header with the columns image,label (optional: split)")
    train: dict[str, list[Path]] = {}
    test: dict[str, list[Path]] = {}
    has_split = "split" in rows[0]
    for n, r in enumerate(rows, 2):
        if not r.get("image") or not (r.get("label") or "").strip():
            raise UsageError(f"--data {path}:{n}: a row needs an image path and a label text")
        dest = train if not has_split or r["split"].strip() == "train" else test
        dest.setdefault(r["label"].strip(), []).append(path.parent / r["image"])
    if len(train) < 2:
        raise UsageError(f"--data {path}: at least 2 labels needed in the demonstration pool, found {len(train)}")
    return train, (test if has_split else None)


def build_parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog="python -m apps.emloc.recipes.qwen2vl", description=doc[0],
                                epilog="\n\n".join(doc[1:]), formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="local model folder (config, weights, processor)")
    p.add_argument("--data", required=True, type=Path, help="DATA/<class name>/<image> folder or a CSV (image,label[,split])")
    p.add_argument("--out", required=True, type=nonempty_path_obj, help="folder for results.json (and memory.safetensors)")
    p.add_argument("--n-way", type=nonnegative_int, default=0, help="classes per episode (0: all)")
    p.add_argument("--demos", type=positive_int, default=200, help="demonstrations drawn from the pool")
    p.add_argument("--queries", type=positive_int, default=10, help="query images per class (without a split column)")
    p.add_argument("--policy", choices=_policies(), default="emloc", help="compression policy (default emloc)")
    p.add_argument("--keep", type=positive_float, default=None, help="kept fraction for a budgeted --policy, in (0, 1]")
    p.add_argument("--preset", choices=("default", "reference"), default="default",
                   help="EMLoC's numerics: default, or the reference implementation's (bf16 importance and JS, +100 on "
                        "the answer spans)")
    p.add_argument("--delta", type=positive_float, default=0.005,
                   help="EMLoC's JS bound per chunk in nats (the paper's 0.005; on the shipped toy host it keeps 29-62%%)")
    p.add_argument("--chunk-demos", type=positive_int, default=4, help="demonstrations per chunk (the reference: 4; 20 on ImageNet)")
    p.add_argument("--compare", default="", help=f"comma list of other policies on the same episode (of {', '.join(_policies())})")
    p.add_argument("--prompt", default="What is in the image?", help="the question of every demonstration and query")
    p.add_argument("--image-size", default="224,224", help="W,H every image is resized to")
    p.add_argument("--seed", type=seed_int, default=0)
    add_device_options(p)
    p.add_argument("--save-memory", action="store_true", help="also write OUT/memory.safetensors (the main policy)")
    return p


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.split(","))
    except ValueError:
        raise UsageError(f"--image-size must be W,H (two positive ints), got {text!r}") from None
    if w < 28 or h < 28:
        raise UsageError(f"--image-size must be at least 28,28 (one merged patch), got {text!r}")
    return w, h


def episode(train, test, n_way: int, demos: int, queries: int, seed: int):
    """``(demos [(path, label)], queries [(path, label)], classes)`` of one seeded episode."""
    rng = random.Random(seed)
    classes = sorted(train)
    if n_way:
        if n_way > len(classes):
            raise UsageError(f"--n-way {n_way} exceeds the {len(classes)} classes in --data")
        classes = sorted(rng.sample(classes, n_way))
    pool, qs = [], []
    for c in classes:
        imgs = list(train[c])
        rng.shuffle(imgs)
        if test is None:
            if len(imgs) <= queries:
                raise UsageError(f"class {c!r} has {len(imgs)} images: more than --queries {queries} needed")
            qs += [(p, c) for p in imgs[-queries:]]
            imgs = imgs[:-queries]
        else:
            qs += [(p, c) for p in (test or {}).get(c, [])]
        pool += [(p, c) for p in imgs]
    if not qs:
        raise UsageError("no query images for the chosen classes (rows whose split is not 'train')")
    if demos > len(pool):
        raise UsageError(f"--demos {demos} exceeds the {len(pool)} images in the demonstration pool")
    return rng.sample(pool, demos), qs, classes


def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    device, dtype = device_from_args(args)  # a missing GPU: one line, exit 2, before any work
    from core.infra.fileio import check_writable, write_json_atomic

    check_outputs([("--out", args.out)], inputs=[args.model, args.data])
    check_writable(args.out, what="--out", folder=True)
    size = _size(args.image_size)
    compare = [c for c in args.compare.split(",") if c]
    bad = [c for c in compare if c not in _policies()]
    if bad:
        raise UsageError(f"--compare: unknown policies {bad}; choose from {', '.join(_policies())}")
    if args.policy not in ("emloc", "full") and args.keep is None:
        raise UsageError(f"--policy {args.policy} needs --keep, the fraction of tokens kept, in (0, 1]")
    if args.keep is not None and args.keep > 1:
        raise UsageError(f"--keep must lie in (0, 1], got {args.keep}")
    train, test = read_data(args.data)
    demos, queries, classes = episode(train, test, args.n_way, args.demos, args.queries, args.seed)
    from apps.emloc.hf import compress_hf
    from core.hf import load

    model, processor = load(args.model, dtype=dtype, device=device)
    if processor is None:
        raise UsageError(f"--model {args.model} has no processor (a chat template and an image processor are needed)")
    results, main_fraction = [], None
    for policy in [args.policy, *compare]:
        keep = args.keep if policy == args.policy else (main_fraction if args.policy != "full" else args.keep)
        if policy not in ("emloc", "full") and keep is None:
            raise UsageError(f"--compare {policy} needs a kept fraction: give --keep, or a compressing --policy")
        t = time.perf_counter()
        ctx = compress_hf(model, demos, processor=processor, prompt=args.prompt, delta=args.delta,
                          chunk_demos=args.chunk_demos, policy=policy, keep=keep, seed=args.seed, image_size=size,
                          preset=args.preset, progress_bar=True)
        seconds = time.perf_counter() - t
        if policy == args.policy:
            main_fraction = round(ctx.keep_fraction(), 4)
            if args.save_memory:
                ctx.save(args.out / "memory.safetensors")
        correct = 0
        for path, label in tqdm(queries, desc=policy, unit="query"):
            correct += ctx.predict(path, classes) == label
        row = {"policy": policy, "keep": keep, "accuracy": correct / len(queries), "kept_fraction": round(ctx.keep_fraction(), 4),
               "keep_per_layer": [round(r, 4) for r in ctx.keep_ratios()], "compress_seconds": round(seconds, 3),
               "tokens": ctx.num_tokens}
        results.append(row)
        print(json.dumps(row), flush=True)
    write_json_atomic(args.out / "results.json", {
        "model": str(args.model), "data": str(args.data), "classes": classes, "demos": len(demos), "queries": len(queries),
        "chance": 1 / len(classes), "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
