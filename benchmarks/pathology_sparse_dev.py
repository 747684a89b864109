"""Development probe for the sparse-regime Querent benchmark: can a model learn a label at all?

One train cohort and one validation cohort of :func:`benchmarks.pathology_sparse.make_cohort` bags (cohort seeds
100 and 200, never the benchmark's), each model trained with :func:`benchmarks.pathology_sparse.train_peer` for a
fixed number of epochs (no early stopping), its per-epoch train loss, validation loss and validation AUC appended
as one JSON line to ``--out``. Used to find a bag size, cohort size and training recipe under which the dense
model learns the ``spatial`` label before the 5-fold benchmark is spent on it.

    python -m benchmarks.pathology_sparse_dev --side 64 --radius 5 --near 12,16 --far-min 36 --bags 300 --epochs 12
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_sparse_dev", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="spatial", choices=("spatial", "cooccur"))
    p.add_argument("--side", type=int, default=64)
    p.add_argument("--radius", type=float, default=5.0)
    p.add_argument("--near", default="12,16")
    p.add_argument("--far-min", type=int, default=36)
    p.add_argument("--amplitude", type=float, default=3.0)
    p.add_argument("--pairs", type=int, default=1, help="spatial label: A–B site pairs per bag")
    p.add_argument("--bags", type=int, default=300, help="training bags (balanced)")
    p.add_argument("--val", type=int, default=100, help="validation bags (balanced)")
    p.add_argument("--models", default="dense,abmil")
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--region-size", type=int, default=8)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--pos-encoding", default="sincos", help="QuerentConfig.pos_encoding (sincos, rope2d, both, none)")
    p.add_argument("--rope-scale", type=float, default=0.25, help="QuerentConfig.rope_scale (rotary units per grid cell)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--epochs", type=int, default=12)
    p.add_argument("--batch-bags", type=int, default=1, help="bags per optimizer step (gradients averaged)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/pathology_sparse_dev.jsonl"))
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    from benchmarks.pathology_sparse import GridBagConfig, make_cohort, train_peer
    from pathology.querent import QuerentConfig

    a = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    cfg = GridBagConfig(side=a.side, radius=a.radius, near=tuple(int(x) for x in a.near.split(",")), far_min=a.far_min,
                        amplitude=a.amplitude, pairs=a.pairs)
    train, val = make_cohort(a.kind, a.bags, 100, cfg), make_cohort(a.kind, a.val, 200, cfg)
    mc = QuerentConfig(in_dim=cfg.in_dim, dim=a.dim, depth=a.depth, num_heads=a.heads, region_size=a.region_size, topk=a.topk,
                       dropout=a.dropout, num_classes=2, pool_hidden=a.dim, mlp_ratio=2.0, pos_encoding=a.pos_encoding,
                       rope_scale=a.rope_scale)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    for name in a.models.split(","):
        t = time.time()
        _, info = train_peer(name, mc, train, val, epochs=a.epochs, lr=a.lr, patience=a.epochs + 1, min_epochs=a.epochs, seed=0,
                              batch_bags=a.batch_bags)
        rec = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "model": name,
               "patches_per_bag": int(train[0].features.shape[0]), "wall_s": round(time.time() - t, 1), **info}
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        logger.info("%s: %s", name, [(h["epoch"], h["train_loss"], h["val_loss"], round(h["val_auc"], 3)) for h in info["history"]])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
