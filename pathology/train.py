"""Train slide models with patient-level cross-validation on patch-feature HDF5 files.

``python -m pathology.train --features DIR --labels CSV --model querent|abmil|transmil|dense|mean
--task cls|survival [--folds 5 | --splits DIR] [--target label] [--patient-col patient_id] --out DIR``

Feature files may be this project's, TRIDENT's or CLAM's (``coords`` without attributes: the grid step is
inferred from the coordinates, or given with ``--patch-size-level0``). Labels may be integers or class
names. Writes into ``--out``:

- ``metrics_<model>_<target>.json``: per fold (AUC and balanced accuracy, or C-index; training summary
  with the per-epoch training/validation loss) and over folds (mean, std, min, max; pooled out-of-fold);
  the class names, model and training settings;
- ``oof_<model>_<target>.csv``: the out-of-fold prediction of every slide;
- ``curves_<model>_<target>.png``: training and validation loss per epoch of every fold;
- ``<model>_fold<k>.safetensors`` per fold and ``<model>_config.json`` (model settings, class names and the patch
  settings the feature files were made with: ``patch_mpp``, ``patch_size``, ``min_tissue``, ``encoder``,
  ``encoder_kwargs``, ``tissue``; ``pathology.predict --model DIR`` patches and encodes new slides with them).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

from core.infra.cli import (PartialFailure, UsageError, fraction, nonempty_path, nonnegative_float, nonnegative_int,
                            positive_float, positive_int, run_cli, worker_count)
from core.infra.device import add_device_options, resolve_device
from core.infra.guard import check_outputs
from pathology.mil import MODEL_NAMES
from pathology.querent import POOL_FROM, POS_ENCODINGS, QuerentConfig
from pathology.features import cohort_patch_settings
from pathology.training import TrainConfig, cross_validate, load_bags, read_splits, save_training_curves

logger = logging.getLogger(__name__)


def _rate(text: str) -> float:
    """A dropout rate: a number in [0, 1)."""
    value = fraction(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value:g}")
    return value


def recipe_for(n_bags: int) -> dict:
    """The default recipe for a cohort of ``n_bags`` slides: model size by cohort size, and the training settings
    of :class:`TrainConfig` (chosen on development cohorts of 60-300 bags, docs/experiments/pathology.md)."""
    d = TrainConfig()
    dim = 32 if n_bags < 400 else 64 if n_bags < 1500 else 128
    size = dict(dim=dim, depth=1 if n_bags < 400 else 2, heads=2 if dim == 32 else 4, pool_hidden=dim, dropout=0.1)
    return {**size, **{k: getattr(d, k) for k in ("lr", "weight_decay", "batch_slides", "max_patches", "feature_dropout",
                                                     "monitor", "smooth", "patience", "min_epochs", "epochs")}}


#: Bags of at least this many patches (the cohort's median) train Querent with :data:`LARGE_BAG_QUERENT`
LARGE_BAG = 2000
#: Querent's recipe for large bags, chosen on development cohorts of 120 bags × 2,000 patches (docs/experiments/
#: pathology.md): the first stage is ABMIL's training (the gate reads the patch embedding; no position code, no final
#: norm) ended by early stopping; its embedding and pooling are then kept and the layer and head train on top
LARGE_BAG_QUERENT = dict(pos_encoding="none", final_norm=False, pool_from="embed_gate", layers_from=80,
                         stage_end="early_stop", freeze_pooling=True)
#: Querent's recipe for smaller bags (the cohort-size curve's, 500 patches)
SMALL_BAG_QUERENT = dict(pos_encoding="sincos", final_norm=True, pool_from="tokens", layers_from=0, stage_end="fixed",
                         freeze_pooling=False)


def querent_recipe(median_patches: float) -> dict:
    """Querent's position code, final norm, pooling input and staged training for bags of ``median_patches``."""
    return dict(LARGE_BAG_QUERENT if median_patches >= LARGE_BAG else SMALL_BAG_QUERENT)


def _shown(recipe: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in recipe.items() if k != "pos_encoding")


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m pathology.train", description=__doc__.split("\n")[0])
    p.add_argument("--features", required=True,
                   help="folder of <slide_id>.h5 files with coords and features (a CLAM folder with h5_files/ works)")
    p.add_argument("--labels", required=True, help="CSV with a slide_id column and label columns")
    p.add_argument("--model", choices=MODEL_NAMES, default="querent")
    p.add_argument("--task", choices=("cls", "survival"), default="cls")
    p.add_argument("--target", default="label", help="label column for --task cls (integers or class names)")
    p.add_argument("--time-col", default="time", help="survival time column")
    p.add_argument("--event-col", default="event", help="survival event column (1 = observed)")
    p.add_argument("--patient-col", default="patient_id",
                   help="column grouping a patient's slides into one fold (absent: each slide is its own patient)")
    p.add_argument("--folds", type=positive_int, default=5, help="cross-validation folds, >= 2 (ignored with --splits)")
    p.add_argument("--splits", default=None,
                   help="CLAM splits: a splits_<k>.csv file or a folder of them (columns train, val, test)")
    p.add_argument("--patch-size-level0", type=positive_float, default=None,
                   help="grid step in level-0 pixels for feature files without that attribute (default: inferred)")
    p.add_argument("--epochs", type=positive_int, default=d.epochs, help="most epochs (early stopping usually ends sooner)")
    p.add_argument("--lr", type=positive_float, default=d.lr)
    p.add_argument("--weight-decay", type=nonnegative_float, default=d.weight_decay)
    p.add_argument("--batch-slides", type=positive_int, default=d.batch_slides,
                   help="slides per step (survival: at least 8)")
    p.add_argument("--max-patches", type=nonnegative_int, default=d.max_patches,
                   help="patches sampled per slide per step (0 = all)")
    p.add_argument("--val-fraction", type=fraction, default=d.val_fraction,
                   help="share of each fold's training patients held out for early stopping, in [0, 1) (0 = none)")
    p.add_argument("--patience", type=positive_int, default=d.patience, help="epochs without a better validation loss")
    p.add_argument("--min-epochs", type=nonnegative_int, default=d.min_epochs, help="never stop before this epoch")
    p.add_argument("--monitor", choices=("auc", "loss"), default=d.monitor,
                   help="early stopping on the validation AUC (classification; ties: loss) or the validation loss")
    p.add_argument("--smooth", type=positive_int, default=d.smooth,
                   help="epochs averaged by the early-stopping score (1 = none)")
    p.add_argument("--feature-dropout", type=_rate, default=d.feature_dropout,
                   help="dropout on the input features while training, in [0, 1)")
    p.add_argument("--no-standardize", action="store_true", help="train on raw features (not z-scored)")
    p.add_argument("--class-weights", choices=("balanced", "none"), default="balanced",
                   help="cross-entropy class weights (balanced: inverse class frequency)")
    p.add_argument("--dim", type=positive_int, default=None,
                   help="model width (default by cohort size: 32 under 400 slides, 64 under 1,500, else 128)")
    p.add_argument("--depth", type=positive_int, default=None,
                   help="layers of Querent and dense (default: 1 under 400 slides, else 2)")
    p.add_argument("--heads", type=positive_int, default=None, help="attention heads (default: 2 at width 32, else 4)")
    p.add_argument("--region-size", type=positive_int, default=8, help="Querent region side in patches")
    p.add_argument("--topk", type=positive_int, default=8, help="Querent regions chosen per query region")
    p.add_argument("--dropout", type=fraction, default=0.1)
    p.add_argument("--pos-encoding", choices=POS_ENCODINGS, default=None,
                   help="Querent/dense positions: sine-cosine added to the input, 2-D RoPE in every layer, both, none "
                        f"(default: sincos; Querent on bags of >= {LARGE_BAG:,} patches: none)")
    p.add_argument("--final-norm", choices=("on", "off"), default=None,
                   help="Querent: LayerNorm on the tokens the pooling reads (off: pooled raw, as ABMIL pools)")
    p.add_argument("--pool-from", choices=POOL_FROM, default=None,
                   help="Querent: what the pooling reads (embed_gate: its gate reads the pre-layer embedding, the "
                        "pooled values are the layers' tokens; embed_values: the reverse)")
    p.add_argument("--layers-from", type=nonnegative_int, default=None,
                   help="Querent: train the depth-0 form (embedding, pooling, head) first, the layers held back for "
                        "this many epochs (0: the layers from the first step)")
    p.add_argument("--stage-end", choices=("fixed", "early_stop"), default=None,
                   help="with --layers-from: the first stage ends after exactly that many epochs (fixed), or by early "
                        "stopping (at most that many; its best weights kept, then up to --epochs more with the layers)")
    p.add_argument("--freeze-pooling", choices=("on", "off"), default=None,
                   help="with --layers-from: the embedding and the pooling keep what the first stage learnt. Defaults "
                        f"of these five: Querent on bags of >= {LARGE_BAG:,} patches (median) "
                        f"{_shown(LARGE_BAG_QUERENT)}, else {_shown(SMALL_BAG_QUERENT)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=worker_count, default=0, help="torch CPU threads (0 = torch default)")
    add_device_options(p, dtype=False)
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder for metrics and models")
    p.add_argument("--no-progress", action="store_true")
    return p


def _write_json(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(path + ".tmp", path)


def _write_csv(path: str, rows: list[dict]) -> None:
    cols = list(dict.fromkeys(k for r in rows for k in r))
    with open(path + ".tmp", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    os.replace(path + ".tmp", path)


def _staging(args: argparse.Namespace, median_patches: float) -> dict:
    """Querent's recipe for the cohort's bag size (:func:`querent_recipe`), with the options given overriding it."""
    base = querent_recipe(median_patches) if args.model == "querent" else dict(SMALL_BAG_QUERENT)
    given = dict(pos_encoding=args.pos_encoding, final_norm=None if args.final_norm is None else args.final_norm == "on",
                 pool_from=args.pool_from, layers_from=args.layers_from, stage_end=args.stage_end,
                 freeze_pooling=None if args.freeze_pooling is None else args.freeze_pooling == "on")
    return {**base, **{k: v for k, v in given.items() if v is not None}}


def _train_config(args: argparse.Namespace, device: str, st: dict) -> TrainConfig:
    return TrainConfig(epochs=args.epochs, lr=args.lr, weight_decay=args.weight_decay, batch_slides=args.batch_slides,
                       max_patches=args.max_patches or None, standardize=not args.no_standardize,
                       class_weights=args.class_weights == "balanced", val_fraction=args.val_fraction,
                       patience=args.patience, min_epochs=args.min_epochs, seed=args.seed, device=device,
                       monitor=args.monitor, smooth=args.smooth, feature_dropout=args.feature_dropout,
                       layers_from=st["layers_from"], stage_end=st["stage_end"], freeze_pooling=st["freeze_pooling"])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = str(resolve_device(args.device))  # a missing GPU is one line before any work
    check_outputs([("--out", args.out)], inputs=[args.features, args.labels, args.splits])
    if args.model != "querent" and (args.layers_from or args.freeze_pooling == "on"):
        raise UsageError(f"--layers-from and --freeze-pooling train Querent's layers in stages; --model {args.model} "
                         "has no such layers (accepted with --model querent)")
    if args.splits is None and args.folds < 2:
        raise SystemExit(f"--folds must be >= 2 (or give --splits), got {args.folds}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    bags = load_bags(args.features, args.labels, task=args.task, target=args.target, time_col=args.time_col,
                     event_col=args.event_col, patient_col=args.patient_col, patch_size_level0=args.patch_size_level0)
    try:
        patch = cohort_patch_settings(bags)  # before any training: mixed feature files are refused
    except ValueError as err:
        raise UsageError(str(err)) from err
    if not patch:
        logger.warning("the feature files do not store how their patches were made (not written by pathology.batch): "
                       "pathology.predict --model %s will assume pathology.batch's defaults", args.out)
    median = float(np.median([b.features.shape[0] for b in bags]))
    st = _staging(args, median)
    try:
        tcfg = _train_config(args, device, st)
    except ValueError as err:
        raise UsageError(str(err)) from err
    if args.model == "querent":
        logger.info("querent on bags of %.0f patches (median): %s (%s)", median, _shown(st) + f", pos_encoding="
                    f"{st['pos_encoding']}", "the large-bag recipe" if median >= LARGE_BAG else "the default recipe")
    n_classes = 1 if args.task == "survival" else max(2, max(b.label for b in bags) + 1)
    auto = recipe_for(len(bags))
    if args.model == "transmil" and len(bags) < 400:
        logger.warning("transmil on %d slides: on development cohorts of 60-300 slides it fitted the training slides "
                       "within a few epochs and ranked test slides at chance (AUC ~0.5; mean pooling 0.6-0.9) under "
                       "every learning rate tried; try --model abmil or querent", len(bags))
    dim = args.dim or auto["dim"]
    heads = args.heads or (auto["heads"] if args.dim is None else 4 if dim % 4 == 0 else 1)
    mcfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=dim, depth=args.depth or auto["depth"],
                         num_heads=heads, pool_hidden=min(dim, 128),
                         region_size=args.region_size, topk=args.topk, dropout=args.dropout, num_classes=n_classes,
                         task=args.task, pos_encoding=st["pos_encoding"], final_norm=st["final_norm"],
                         pool_from=st["pool_from"])
    splits = read_splits(args.splits) if args.splits else None
    os.makedirs(args.out, exist_ok=True)
    res = cross_validate(args.model, mcfg, bags, tcfg, folds=args.folds, progress=not args.no_progress,
                         save_dir=args.out, splits=splits)
    tag = args.target if args.task == "cls" else "survival"
    oof = res.pop("oof")
    res.update(model_config=dataclasses.asdict(mcfg), train_config=dataclasses.asdict(tcfg), target=tag,
               patch_settings=patch,
               splits=args.splits, n_slides=len(bags), n_patients=len({b.patient_id for b in bags}))
    base = f"{args.model}_{tag}"
    path = os.path.join(args.out, f"metrics_{base}.json")
    _write_json(path, res)
    _write_csv(os.path.join(args.out, f"oof_{base}.csv"), oof)
    save_training_curves(res["folds"], os.path.join(args.out, f"curves_{base}.png"),
                         title=f"{args.model} on {tag}: loss per epoch (dashed: validation; dotted: best epoch)")
    _write_json(os.path.join(args.out, f"{args.model}_config.json"),
                {**dataclasses.asdict(mcfg), "classes": res["classes"], **patch})
    nonfinite = [k for k, v in res["summary"].items() if not all(math.isfinite(x) for x in v.values())]
    if nonfinite:
        raise PartialFailure(f"the cross-validated {', '.join(nonfinite)} came out non-finite (written to {path}): "
                             "the model or the data gave NaN outputs")
    shown = {k: f"{v['mean']:.3f} ± {v['std']:.3f} (min {v['min']:.3f}, max {v['max']:.3f})"
             for k, v in res["summary"].items()}
    logger.info("%s %s: %s; pooled out-of-fold %s -> %s", args.model, tag, shown, res["pooled"], path)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
