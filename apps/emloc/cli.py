"""The EMLoC command lines (their modules ``apps.emloc.compress`` / ``apps.emloc.predict`` only call these).

The entry points live here, not in ``apps/emloc/compress.py``, because that module's name is also the
package's ``compress`` function: importing the module in a process would otherwise shadow the function.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import torch

from apps.emloc.api import CompressedContext, compress
from apps.emloc.cli_common import load_host
from apps.emloc.io import IMAGE_SUFFIXES, read_demos, read_image
from core.infra.cli import (InputTally, UsageError, capped_int, nonempty_path_obj, open_fraction, positive_float,
                            positive_int)
from core.infra.device import add_device_options, device_from_args
from core.kv_compress import POLICIES
from core.infra.fileio import check_writable
from core.infra.guard import check_output

logger = logging.getLogger(__name__)

__all__ = ["build_compress_parser", "compress_main", "build_predict_parser", "predict_main"]

COMPRESS_DOC = """Compress labelled demonstrations into a reusable memory file: ``python -m apps.emloc.compress``.

    python -m apps.emloc.compress --demos DIR_or_JSONL --out memory.safetensors [--model PATH]
        [--delta 0.005] [--ratios 0.1,0.2,0.5] [--chunk-demos 16] [--policy emloc | full | snapkv --keep 0.2 ...]

``DIR`` holds ``DIR/<label id>/<image>``; a JSONL file holds ``{"image": path, "label": id}`` lines (see
:mod:`apps.emloc.io`). The memory (safetensors) names the model and the settings; ``python -m
apps.emloc.predict`` answers queries with it.
"""

PREDICT_DOC = """Answer query images against a compressed memory: ``python -m apps.emloc.predict``.

    python -m apps.emloc.predict --memory memory.safetensors --images a.png b.png DIR ... [--model PATH]
    python -m apps.emloc.predict --memory OUT/memory.safetensors --model MODEL_DIR --images q.jpg ...

Prints one JSON line per image (``{"image", "label", "scores"}``: the label ids of the demonstrations and
their softmax probabilities). A memory made by another model than ``--model`` is refused. With a transformers
model folder as ``--model`` (the memory the recipe ``python -m apps.emloc.recipes.qwen2vl --save-memory`` writes),
the labels are the demonstrations' label texts and the scores the softmax over their log-probabilities.

An image that cannot be read (missing, corrupt, a folder without images) is named on stderr and the others are
still answered; the exit code is then 1 (2 when no image could be read).
"""

ACCEPTED_IMAGES = f"image files ({', '.join(IMAGE_SUFFIXES)}; .npy: a 2-D array) or folders of them"


def _ratios(text: str) -> tuple[float, ...]:
    """Comma-separated keep ratios, each in (0, 1)."""
    try:
        return tuple(open_fraction(x) for x in text.split(","))
    except argparse.ArgumentTypeError as err:
        raise argparse.ArgumentTypeError(f"keep ratios are comma-separated numbers in (0, 1): {err}") from None


def build_compress_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.emloc.compress", description=COMPRESS_DOC.split("\n\n")[0], epilog=COMPRESS_DOC.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--demos", required=True, type=Path, help="DIR/<label id>/<image> folder or JSONL file")
    p.add_argument("--out", required=True, type=nonempty_path_obj, help="memory file to write (.safetensors)")
    p.add_argument("--model", type=Path, default=None, help="host weights (default: the shipped host)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="emloc",
                   help="emloc (default), full, or a budgeted baseline kept at --keep of the tokens")
    p.add_argument("--keep", type=open_fraction, default=None,
                   help="budgeted policies: fraction of tokens kept per layer and KV head, in (0, 1)")
    p.add_argument("--protect-answers", action="store_true",
                   help="budgeted policies keep every demo's label token first (what EMLoC always keeps)")
    p.add_argument("--delta", type=positive_float, default=0.005,
                   help="EMLoC's JS-divergence bound per chunk (nats), > 0; the published 0.005 keeps 29-62%% of the "
                        "cache on the shipped host (16-512 demos), 0.1 keeps 21-28%%")
    p.add_argument("--ratios", type=_ratios, default=(0.1, 0.2, 0.5),
                   help="keep ratios tried per layer, comma-separated")
    p.add_argument("--chunk-demos", type=capped_int(4096, why="demonstrations encoded together"), default=16,
                   help="demonstrations per chunk")
    p.add_argument("--always-keep", choices=("label", "answer", "both"), default="label",
                   help="tokens EMLoC never prunes: each demo's label token (default), its answer position, or both")
    return p


def compress_main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_compress_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.model is not None and is_transformers_folder(args.model):
        raise UsageError(
            f"--model {args.model} is a transformers model folder; this command compresses for the host model. For a "
            f"vision-language model run `python -m apps.emloc.recipes.qwen2vl --model {args.model} --data DATA --out OUT "
            f"--save-memory` (it writes OUT/memory.safetensors), then `python -m apps.emloc.predict --memory "
            f"OUT/memory.safetensors --model {args.model} --images ...`")
    check_output(args.out, inputs=[args.demos, args.model])  # never the shipped host, never an input
    check_writable(args.out, what="--out")  # before the compression it would record
    if args.policy not in ("emloc", "full") and args.keep is None:
        raise UsageError(f"--policy {args.policy} needs --keep, the fraction of tokens kept, in (0, 1)")
    model = load_host(args.model)
    images, labels, _ = read_demos(args.demos, model.config.image_size)
    bar = tqdm(desc="compress", unit="chunk")

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    ctx = compress(model, (images, labels), delta=args.delta, ratios=args.ratios, chunk_demos=args.chunk_demos,
                   always_keep=args.always_keep, progress=progress, policy=args.policy, keep=args.keep,
                   protect_answers=args.protect_answers)
    bar.close()
    ctx.save(args.out)
    print(json.dumps({"memory": str(args.out), "demos": ctx.num_demos, "tokens": ctx.num_tokens,
                      "kept_fraction": round(ctx.keep_fraction(), 4), "keep_per_layer": [round(r, 4) for r in ctx.keep_ratios()]}))
    return 0


def build_predict_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m apps.emloc.predict", description=PREDICT_DOC.split("\n\n")[0], epilog=PREDICT_DOC.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", required=True, type=Path, help="memory file from python -m apps.emloc.compress")
    p.add_argument("--images", required=True, nargs="+", help="image files or folders of images")
    p.add_argument("--model", type=Path, default=None,
                   help="host weights (default: the shipped host), or the transformers model folder that made the memory")
    p.add_argument("--batch-size", type=positive_int, default=64)
    add_device_options(p)
    return p


def is_transformers_folder(path: Path) -> bool:
    """A folder with a ``config.json`` (what ``save_pretrained`` writes)."""
    return Path(path).is_dir() and (Path(path) / "config.json").is_file()


def _memory_kind(path: Path) -> str:
    """``"hf"`` for a memory a transformers model made (``HFContext.save``), else ``"host"``."""
    from core.hf.cache import FORMAT
    from core.infra.fileio import open_safetensors

    with open_safetensors(path, what="an EMLoC memory file (.safetensors) written by python -m apps.emloc.compress "
                                     "or apps.emloc.recipes.qwen2vl") as f:
        return "hf" if (f.metadata() or {}).get("format") == FORMAT else "host"


def _predict_hf(args, paths: list[Path], tally: InputTally) -> int:
    """Answer with a memory made by a transformers VLM (``HFContext``): label texts scored by the model."""
    from apps.emloc.hf import HFContext
    from apps.emloc.hf_inputs import load_image
    from core.hf import load

    model, processor = load(args.model, dtype=args.dtype_, device=args.device_)
    if processor is None:
        raise UsageError(f"--model {args.model} has no processor (a chat template and an image processor are needed)")
    ctx = HFContext.load(args.memory, model, processor)
    for p in tqdm_iter(paths):
        try:
            load_image(p, "query")  # unreadable files are reported before the model runs
            scores = torch.softmax(ctx.label_scores(p).float(), dim=-1)
        except (ValueError, OSError) as err:  # a bad image is reported; the others are still answered
            tally.fail(p, err, accepted=ACCEPTED_IMAGES)
            continue
        print(json.dumps({"image": str(p), "label": ctx.labels[int(scores.argmax())],
                          "scores": {l: round(float(v), 4) for l, v in zip(ctx.labels, scores)}}), flush=True)
        tally.ok()
    return tally.finish()


def tqdm_iter(items):
    from tqdm import tqdm

    return tqdm(items, desc="predict", unit="image")


def _expand(args_images: list[str], tally: InputTally) -> list[Path]:
    """The image files named by ``--images`` (folders listed, sorted); a folder without images is reported."""
    paths = []
    for p in map(Path, args_images):
        if p.is_dir():
            found = sorted(q for q in p.iterdir() if q.is_file() and q.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                tally.fail(p, "a folder with no images", accepted=ACCEPTED_IMAGES)
            paths.extend(found)
        else:
            paths.append(p)
    return paths


def predict_main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_predict_parser().parse_args(argv)
    args.device_, args.dtype_ = device_from_args(args)  # a missing GPU is one line before any work
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    kind = _memory_kind(args.memory)
    hf_model = args.model is not None and is_transformers_folder(args.model)
    if kind == "hf" and not hf_model:
        raise UsageError(f"{args.memory} was made by a transformers model; pass that model's folder as --model DIR")
    if kind == "host" and hf_model:
        raise UsageError(f"{args.memory} is a host memory, not one made by the transformers model {args.model}; "
                         "drop --model DIR (or pass the host weights that made it)")
    if hf_model:
        tally = InputTally("image")
        return _predict_hf(args, _expand(args.images, tally), tally)
    model = load_host(args.model)
    ctx = CompressedContext.load(args.memory, model)
    tally = InputTally("image")
    paths = _expand(args.images, tally)
    for s in tqdm(range(0, len(paths), args.batch_size), desc="predict", unit="batch"):
        part, imgs = [], []
        for p in paths[s : s + args.batch_size]:
            try:
                imgs.append(read_image(p, model.config.image_size))
            except Exception as err:  # noqa: BLE001 - a bad image is reported; the others are still answered
                tally.fail(p, err, accepted=ACCEPTED_IMAGES)
                continue
            part.append(p)
        if not part:
            continue
        probs = torch.softmax(ctx.logits(torch.stack(imgs)).float(), dim=-1)
        for p, pr in zip(part, probs):
            print(json.dumps({"image": str(p), "label": int(ctx.label_ids[pr.argmax()]),
                              "scores": {str(int(l)): round(float(v), 4) for l, v in zip(ctx.label_ids, pr)}}),
                  flush=True)
            tally.ok()
    return tally.finish()
