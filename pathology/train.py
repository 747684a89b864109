"""Train slide models with k-fold cross-validation on patch-feature HDF5 files.

``python -m pathology.train --features DIR --labels CSV --model querent|abmil|transmil|dense|mean
--task cls|survival --folds 5 [--target lesion] --out DIR``

Writes ``<out>/metrics_<model>_<target>.json`` (per fold and mean/std: AUC and balanced accuracy, or
C-index) and one ``safetensors`` model per fold plus its config JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from collections.abc import Sequence

import torch

from pathology.mil import MODEL_NAMES
from pathology.querent import QuerentConfig
from pathology.training import TrainConfig, cross_validate, load_bags

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.train", description=__doc__.split("\n")[0])
    p.add_argument("--features", required=True, help="folder of <slide_id>.h5 files with coords and features")
    p.add_argument("--labels", required=True, help="CSV with a slide_id column and label columns")
    p.add_argument("--model", choices=MODEL_NAMES, default="querent")
    p.add_argument("--task", choices=("cls", "survival"), default="cls")
    p.add_argument("--target", default="label", help="label column for --task cls (default 'label')")
    p.add_argument("--time-col", default="time", help="survival time column")
    p.add_argument("--event-col", default="event", help="survival event column (1 = observed)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch-slides", type=int, default=1, help="slides per step (survival: at least 8)")
    p.add_argument("--max-patches", type=int, default=8192, help="patches sampled per slide per step (0 = all)")
    p.add_argument("--dim", type=int, default=128, help="model width")
    p.add_argument("--depth", type=int, default=2, help="layers (Querent and dense)")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--region-size", type=int, default=8, help="Querent region side in patches")
    p.add_argument("--topk", type=int, default=8, help="Querent regions chosen per query region")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", required=True, help="output folder for metrics and models")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    bags = load_bags(args.features, args.labels, task=args.task, target=args.target, time_col=args.time_col,
                     event_col=args.event_col)
    n_classes = 1 if args.task == "survival" else max(2, max(b.label for b in bags) + 1)
    mcfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=args.dim, depth=args.depth, num_heads=args.heads,
                         region_size=args.region_size, topk=args.topk, dropout=args.dropout, num_classes=n_classes,
                         task=args.task)
    tcfg = TrainConfig(epochs=args.epochs, lr=args.lr, batch_slides=args.batch_slides,
                       max_patches=args.max_patches or None, seed=args.seed, device=args.device)
    os.makedirs(args.out, exist_ok=True)
    res = cross_validate(args.model, mcfg, bags, tcfg, folds=args.folds, progress=not args.no_progress,
                         save_dir=args.out)
    res["model_config"] = dataclasses.asdict(mcfg)
    res["train_config"] = dataclasses.asdict(tcfg)
    res["target"] = args.target if args.task == "cls" else "survival"
    tag = res["target"]
    path = os.path.join(args.out, f"metrics_{args.model}_{tag}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=2)
    os.replace(path + ".tmp", path)
    with open(os.path.join(args.out, f"{args.model}_config.json.tmp"), "w") as f:
        json.dump(dataclasses.asdict(mcfg), f, indent=2)
    os.replace(os.path.join(args.out, f"{args.model}_config.json.tmp"), os.path.join(args.out, f"{args.model}_config.json"))
    logger.info("%s %s: %s -> %s", args.model, tag, res["summary"], path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
