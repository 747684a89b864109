"""Build the demo's default slide model: synthetic slides -> features (default encoder) -> Querent on the lesion task.

``python -m pathology.train_demo --work DIR [--n 32] [--size 3072] [--epochs 30]``

Stages are resumable (finished slides and feature files are kept). Writes
``pathology/weights/querent_lesion.safetensors`` with ``querent_lesion.json`` (config, patching
settings, class names, the exact command, data, wall time, held-out metrics) and copies two held-out
slides to ``pathology/samples/``. Like the default encoder, this model only knows the synthetic slides.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence

import numpy as np
import torch

from core.infra.cli import (capped_int, memory_capped_int, nonempty_path, open_fraction, positive_int, run_cli,
                            thread_count)
from core.infra.fileio import check_writable, set_file_mode
from core.infra.guard import check_output, check_outputs
from pathology.batch import BatchConfig, run_batch
from pathology.inference import DEFAULT_SLIDE_MODEL, SAMPLES_DIR
from pathology.querent import QuerentConfig
from pathology.synthetic import BYTES_PER_PIXEL, MAX_SIDE, MAX_SLIDES, TILE, generate_dataset
from pathology.training import TrainConfig, evaluate, load_bags, train_model

logger = logging.getLogger(__name__)

PATCH_MPP, PATCH_SIZE = 1.0, 128


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.train_demo", description=__doc__.split("\n")[0])
    p.add_argument("--work", type=nonempty_path, required=True, help="working folder for slides and features")
    p.add_argument("--n", type=capped_int(MAX_SLIDES, why="slides per call"), default=32,
                   help="synthetic slides (at least 3: 2 are held out)")
    p.add_argument("--size", type=memory_capped_int(BYTES_PER_PIXEL, power=2, what="rendering a slide", minimum=TILE,
                                                    limit=MAX_SIDE, limit_why="larger than whole-slide scans"),
                   default=3072, help="slide side in pixels (level 0, 0.5 µm/px)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--epochs", type=positive_int, default=30)
    p.add_argument("--test-fraction", type=open_fraction, default=0.25)
    p.add_argument("--threads", type=thread_count, default=1)
    p.add_argument("--out", type=nonempty_path, default=DEFAULT_SLIDE_MODEL, help="output safetensors path")
    p.add_argument("--samples", type=nonempty_path, default=SAMPLES_DIR, help="folder receiving two held-out sample slides")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # it makes the shipped demo model: pathology/weights is its own destination (the working folder never is)
    check_output(args.out, ship="pathology")
    check_outputs([("--work", args.work), ("--samples", args.samples)])
    check_writable(args.out, what="--out")
    check_writable(args.samples, what="--samples", folder=True)
    if args.n < 3:
        raise SystemExit(f"--n must be >= 3 (at least 2 slides are held out), got {args.n}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    slides = os.path.join(args.work, "slides")
    specs = generate_dataset(slides, n=args.n, seed=args.seed, size=args.size, mpp=0.5, progress=True)
    bags_dir = os.path.join(args.work, "bags")
    run_batch(BatchConfig(slides=slides, out=bags_dir, task="all", mpp=PATCH_MPP, patch_size=PATCH_SIZE,
                          skip_errors=True, progress=True, device="cpu"))
    bags = load_bags(os.path.join(bags_dir, "features", "default"), os.path.join(slides, "labels.csv"), target="lesion")
    rng = np.random.default_rng(args.seed)
    order = rng.permutation(len(bags))
    n_test = max(2, int(round(len(bags) * args.test_fraction)))
    test, train = [bags[i] for i in order[:n_test]], [bags[i] for i in order[n_test:]]
    cfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=64, depth=2, num_heads=4, region_size=4, topk=4,
                        dropout=0.1, num_classes=2)
    tcfg = TrainConfig(epochs=args.epochs, lr=1e-3, batch_slides=4, seed=args.seed)
    model, info = train_model("querent", cfg, train, tcfg, progress=True)
    metrics = evaluate(model, test, "cls")
    logger.info("held-out: %s", metrics)
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, args.out + ".tmp")
    set_file_mode(args.out + ".tmp")  # safetensors writes 0600: follow the user's umask
    os.replace(args.out + ".tmp", args.out)
    meta = {
        "name": "longctx querent_lesion (demo slide model)",
        "what_it_is": "A small Querent trained by this project on features of its own synthetic slides (default "
                      "stand-in patch encoder) to say whether lesion texture is present. A demonstration model: "
                      "it knows only the synthetic slides and says nothing about real tissue.",
        "command": "python -m pathology.train_demo " + " ".join(argv if argv is not None else sys.argv[1:]),
        "data": f"{len(bags)} synthetic slides (pathology.synthetic seed {args.seed}, {args.size} px at 0.5 um/px); "
                f"{len(train)} train / {len(test)} held out",
        "model_config": dataclasses.asdict(cfg),
        "train_config": dataclasses.asdict(tcfg),
        "patch_mpp": PATCH_MPP,
        "patch_size": PATCH_SIZE,
        "min_tissue": 0.25,
        "encoder": "default",
        "class_names": ["no lesion", "lesion"],
        "steps": info["steps"],
        "wall_time_s": round(time.perf_counter() - t_start, 1),
        "train_seconds": info["train_seconds"],
        "held_out_metrics": metrics,
        "held_out_slides": [b.slide_id for b in test],
    }
    meta_path = os.path.splitext(args.out)[0] + ".json"
    with open(meta_path + ".tmp", "w") as f:
        json.dump(meta, f, indent=2)
    os.replace(meta_path + ".tmp", meta_path)
    # Two held-out slides (one with lesion, one without if possible) become the bundled samples.
    os.makedirs(args.samples, exist_ok=True)
    lab = {s.name: s.lesion for s in specs}
    picks = []
    for want in (1, 0):
        for b in test:
            if lab[b.slide_id] == want and b.slide_id not in picks:
                picks.append(b.slide_id)
                break
    for sid in picks:
        dst = os.path.join(args.samples, f"sample_{'lesion' if lab[sid] else 'normal'}.tiff")
        shutil.copyfile(os.path.join(slides, sid + ".tiff"), dst + ".tmp")
        os.replace(dst + ".tmp", dst)
    logger.info("wrote %s, %s and samples %s", args.out, meta_path, picks)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
