"""Slide-level accuracy of every slide model on the three synthetic tasks, k-fold cross-validated.

Pipeline: ``pathology.synthetic`` slides -> ``pathology.batch`` (tissue, 128-px patches at 1 µm/px, default
encoder) -> ``pathology.training.cross_validate`` for each model on
(a) ``lesion`` (local), (b) ``longrange`` (two far-apart pattern sites: AB vs AA or BB), (c) survival.
Reports AUC / balanced accuracy (classification) or C-index (survival), mean ± std over folds.
Slides and features are cached in ``--work`` (resumable).

    python -m benchmarks.pathology_accuracy --quick     # 24 slides, 5 folds, 15 epochs
    python -m benchmarks.pathology_accuracy             # 60 slides, 5 folds, 30 epochs

Parts of a run can go to separate processes and be merged afterwards (same ``--work``): ``--prep-only``
makes the slides and features once; ``--skip-prep --tasks longrange --models dense --out A.json`` runs one
part on them; ``--merge A.json B.json ... --out ALL.json`` joins the parts' rows into one file and table.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import env_info, format_table, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "pathology_accuracy.json"
MODELS = ("querent", "dense", "transmil", "abmil", "mean")
TASKS = (("lesion", "cls"), ("longrange", "cls"), ("survival", "survival"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_accuracy", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "longctx_pathology_accuracy"))
    p.add_argument("--n", type=int, default=None, help="slides (default 24 quick / 60 full)")
    p.add_argument("--size", type=int, default=4096, help="slide side in level-0 pixels")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=None, help="default 15 quick / 30 full")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--tasks", default=",".join(t for t, _ in TASKS), help="comma-separated subset of the tasks")
    p.add_argument("--prep-only", action="store_true", help="make the slides and features, train nothing")
    p.add_argument("--skip-prep", action="store_true", help="use the slides and features already in --work")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="join the rows of these result files into --out")
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.merge:
        return _merge(args.merge, args.out)
    tasks = [t for t in TASKS if t[0] in args.tasks.split(",")]
    if not tasks and not args.prep_only:
        raise SystemExit(f"--tasks {args.tasks!r}: choose from {[t for t, _ in TASKS]}")

    import torch

    from pathology.batch import BatchConfig, run_batch
    from pathology.querent import QuerentConfig
    from pathology.synthetic import generate_dataset
    from pathology.training import TrainConfig, cross_validate, load_bags

    torch.set_num_threads(args.threads)
    n = args.n or (24 if args.quick else 60)
    epochs = args.epochs or (15 if args.quick else 30)
    slides = os.path.join(args.work, "slides")
    t0 = time.perf_counter()
    bags_dir = os.path.join(args.work, "bags")
    if not args.skip_prep:
        generate_dataset(slides, n=n, seed=args.seed, size=args.size, mpp=0.5, progress=True)
        run_batch(BatchConfig(slides=slides, out=bags_dir, mpp=1.0, patch_size=128, skip_errors=True, device="cpu"))
    prep_s = time.perf_counter() - t0
    if args.prep_only:
        return 0
    feats = os.path.join(bags_dir, "features", "default")
    labels = os.path.join(slides, "labels.csv")
    rows = []
    for target, task in tasks:
        bags = load_bags(feats, labels, task=task, target=target)
        if len(bags) != n:
            raise SystemExit(f"{target}: {len(bags)} of {n} slides have features in {feats}; rerun without --skip-prep")
        # Folds are stratified (on the event for survival); a small run can have fewer censored slides than
        # folds, so cap the fold count there and record it in the row rather than stopping the whole run.
        strat = [b.event if task == "survival" else b.label for b in bags]
        folds = max(2, min(args.folds, min(strat.count(v) for v in set(strat))))
        if folds != args.folds:
            print(f"{target}: {folds} folds instead of {args.folds} (smallest stratum has {folds} slides)", flush=True)
        for name in args.models.split(","):
            cfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=64, depth=2, num_heads=4, region_size=4,
                                topk=4, dropout=0.1, num_classes=2, task=task)
            tcfg = TrainConfig(epochs=epochs, lr=1e-3, batch_slides=4, seed=args.seed)
            t1 = time.perf_counter()
            res = cross_validate(name, cfg, bags, tcfg, folds=folds)
            row = {"task": target, "model": name, "folds": folds, "seconds": round(time.perf_counter() - t1, 1)}
            for k, v in res["summary"].items():
                row[k] = f"{v['mean']:.3f} ± {v['std']:.3f}"
                row[k + "_mean"] = v["mean"]
            rows.append(row)
            print(row, flush=True)
    write_json_atomic(args.out, {"env": env_info(), "n_slides": n, "size": args.size, "folds": args.folds,
                                 "epochs": epochs, "prep_seconds": round(prep_s, 1), "rows": rows})
    print(format_table(rows, ["task", "model", "folds", "auc", "balanced_accuracy", "c_index", "seconds"]))
    return 0


def _merge(paths: list[str], out: str) -> int:
    """Join the rows of several result files of one setting (slides, size, epochs) into ``out``."""
    from benchmarks.common import read_parts

    parts = read_parts(paths)
    keys = ("n_slides", "size", "folds", "epochs")
    if len({tuple(d.get(k) for k in keys) for d in parts}) != 1:
        raise SystemExit(f"the files differ in {keys}: " + "; ".join(f"{p}: {[d.get(k) for k in keys]}" for p, d in zip(paths, parts)))
    order = {t: i for i, (t, _) in enumerate(TASKS)}
    rows = sorted((r for d in parts for r in d["rows"]), key=lambda r: (order.get(r["task"], 99), MODELS.index(r["model"])
                                                                        if r["model"] in MODELS else 99))
    merged = {k: parts[0][k] for k in keys}
    merged.update(env=[d["env"] for d in parts], prep_seconds=parts[0].get("prep_seconds"), merged_from=[os.path.basename(p) for p in paths],
                  rows=rows)
    write_json_atomic(out, merged)
    print(format_table(rows, ["task", "model", "folds", "auc", "balanced_accuracy", "c_index", "seconds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
