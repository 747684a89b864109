"""Training recipes and a cohort-size curve for slide models on lab-sized cohorts (:mod:`benchmarks.pathology_cohort`).

Every unit of work is one (stage, cohort, recipe, model, seed): a cohort drawn from ``seed`` with the stage's
settings, cross-validated with :func:`pathology.training.cross_validate` (5 stratified folds, each fold's training
bags giving 20% to a validation split), one JSON line appended to ``--records`` with the pooled out-of-fold AUC,
balanced accuracy, the folds' best epochs and warnings, and every bag's out-of-fold probability. A rerun skips the
units already recorded (the key holds every setting the result depends on).

Stages:

- ``dev``: the development family (cohort seeds 100+, several bag sizes, strengths, decoys and label mixes) under
  the recipes of :data:`RECIPES`; used to choose the default recipe of ``pathology.train``.
- ``curve``: cohorts of ``--sizes`` bags on cohort seeds 0, 1, 2 (never used for a choice), every model with
  the chosen recipe (``auto``: ``pathology.train``'s defaults for the cohort's size).
- ``summary``: tables (pooled AUC, mean over seeds with a 95% t interval) as JSON at ``--out`` and a PNG of the curve.

    OMP_NUM_THREADS=1 python -m benchmarks.pathology_cohort_bench --stage dev
    OMP_NUM_THREADS=1 python -m benchmarks.pathology_cohort_bench --stage curve --sizes 60 120 300
    python -m benchmarks.pathology_cohort_bench --stage summary
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from core.infra.cli import positive_int, run_cli, thread_count
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)
RESULTS = Path(__file__).resolve().parent / "results"
RECORDS = RESULTS / "pathology_cohort_records.jsonl"
MODELS = ("mean", "abmil", "transmil", "dense", "querent")

#: Training recipes compared on the development cohorts. "old" is pathology.train's recipe before this change;
#: "auto" is its current default (:func:`pathology.train.recipe_for`); the rest change one thing of "auto".
RECIPES = {
    "old": dict(dim=128, depth=2, heads=4, pool_hidden=128, dropout=0.1, lr=1e-3, weight_decay=1e-2, batch_slides=1,
                max_patches=8192, feature_dropout=0.0, monitor="loss", smooth=1, patience=20, min_epochs=20,
                epochs=200),
    "auto": {},
    "auto_loss": dict(monitor="loss"),
    "auto_bs1": dict(batch_slides=1),
    "auto_allpatches": dict(max_patches=8192),
    "auto_wide": dict(dim=128, depth=2, heads=4, pool_hidden=128),
    "auto_nodrop": dict(feature_dropout=0.0, weight_decay=1e-2),
    "auto_lr3": dict(lr=3e-3),
    "auto_lr3_long": dict(lr=3e-3, min_epochs=30, patience=15),
    "auto_long": dict(min_epochs=30, patience=15),
    "auto_lr1e-3": dict(lr=1e-3),
    "auto_lr3e-4": dict(lr=3e-4),
    "auto_lm256": dict(landmarks=256),  # TransMIL: 256 Nyström landmarks (dim // 2 at TransMIL's width 512)
}

#: The development family: (name, bags, cohort settings). Cohort seeds 100, 101, ... (never the curve's 0-2).
DEV = (
    ("d0", 100, dict(bag_size=1000, strength=2.5, decoys=2, negatives="mixed")),
    ("d1", 100, dict(bag_size=2000, strength=2.5, decoys=2, negatives="mixed")),
    ("d2", 60, dict(bag_size=1000, strength=3.0, decoys=0, negatives="single")),
    ("d3", 200, dict(bag_size=1000, strength=2.0, decoys=3, negatives="mixed")),
    ("d4", 300, dict(bag_size=500, strength=2.5, decoys=1, negatives="mixed", site_patches=12)),
    ("d5", 120, dict(bag_size=1000, strength=4.0, decoys=1, negatives="single")),
    ("d6", 120, dict(bag_size=500, site_patches=10, strength=4.0, decoys=2, negatives="single")),  # the curve's shape
)
#: The curve's cohorts (besides their number of bags): the issue's shape, bag size shrunk for compute.
CURVE = dict(bag_size=500, site_patches=10, strength=4.0, decoys=2, negatives="single")
#: Querent's region side (patches) by bag size: 8 (the default) leaves a 500-patch bag (a 24 x 24 grid) 9 regions, all
#: inside every region's 3 x 3 neighbourhood (dense attention); 4 gives 36 regions, of which a query attends 17.
REGION_SIZE = {500: 4}


def recipe(name: str, n_bags: int) -> dict:
    """The full settings of a recipe for a cohort of ``n_bags`` (``auto``: pathology.train's defaults)."""
    from pathology.train import recipe_for

    base = recipe_for(n_bags)
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; accepted: {', '.join(RECIPES)}")
    return {**base, **RECIPES[name]}


def run_unit(stage: str, cohort: dict, n_bags: int, cseed: int, rname: str, model: str, *, epochs_cap: int | None,
             folds: int = 5) -> dict:
    import torch

    from benchmarks.pathology_cohort import CohortConfig, make_cohort
    from pathology.querent import QuerentConfig
    from pathology.training import TrainConfig, cross_validate

    r = recipe(rname, n_bags)
    bags = make_cohort(n_bags, cseed, CohortConfig(**cohort))
    mcfg = QuerentConfig(in_dim=int(bags[0].features.shape[1]), dim=r["dim"], depth=r["depth"], num_heads=r["heads"],
                         pool_hidden=r["pool_hidden"], dropout=r["dropout"], num_classes=2,
                         region_size=REGION_SIZE.get(cohort["bag_size"], 8), topk=8,
                         nystrom_landmarks=r.get("landmarks", 0))
    tc = TrainConfig(epochs=min(r["epochs"], epochs_cap or r["epochs"]), lr=r["lr"], weight_decay=r["weight_decay"],
                     batch_slides=r["batch_slides"], max_patches=r["max_patches"], feature_dropout=r["feature_dropout"],
                     monitor=r["monitor"], smooth=r["smooth"], patience=r["patience"], min_epochs=r["min_epochs"], seed=0)
    torch.manual_seed(0)
    c0 = time.process_time()
    res = cross_validate(model, mcfg, bags, tc, folds=folds)
    probs = {row["slide_id"]: row["prob_1"] for row in res["oof"]}
    ids = [b.slide_id for b in bags]
    return {"stage": stage, "cohort": cohort, "n_bags": n_bags, "cohort_seed": cseed, "recipe": rname, "settings": r,
            "epochs_cap": tc.epochs, "model": model, "pooled_auc": res["pooled"]["auc"],
            "pooled_bacc": res["pooled"]["balanced_accuracy"], "fold_auc": [f["auc"] for f in res["folds"]],
            "best_epochs": [f["best_epoch"] for f in res["folds"]], "epochs_run": [f["epochs_run"] for f in res["folds"]],
            "warnings": sum(len(f["warnings"]) for f in res["folds"]), "cpu_s": round(time.process_time() - c0, 1),
            "labels": [b.label for b in bags], "probs": [probs[i] for i in ids]}


def key_of(rec: dict) -> str:
    return json.dumps([rec["stage"], rec["cohort"], rec["n_bags"], rec["cohort_seed"], rec["recipe"], rec["settings"],
                       rec["model"], rec["epochs_cap"]], sort_keys=True)


def read_records(path: str | os.PathLike, key=None) -> dict[str, dict]:
    """The JSON-lines records of ``path`` by ``key(record)`` (default :func:`key_of`); unreadable lines and records
    without the key's fields (an interrupted write) are skipped."""
    out = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    out[(key or key_of)(rec)] = rec
                except (json.JSONDecodeError, KeyError):
                    continue
    return out


def append(path: str | os.PathLike, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def plan(stage: str, args) -> list[tuple]:
    units = []
    if stage == "dev":
        for name, n, coh in DEV:
            if args.cohorts and name not in args.cohorts:
                continue
            full = {**dataclasses.asdict(_cc()), **coh}
            for rname in args.recipes:
                for model in args.models:
                    units.append((full, n, 100 + DEV.index((name, n, coh)), rname, model))
    else:
        full = {**dataclasses.asdict(_cc()), **CURVE, **({"bag_size": args.bag_size} if args.bag_size else {})}
        for seed in args.seeds:
            for n in args.sizes:  # in the order given
                for model in args.models:
                    units.append((full, n, seed, "auto", model))
    return units


def _cc():
    from benchmarks.pathology_cohort import CohortConfig

    return CohortConfig()


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    a = np.array([v for v in values if v == v], dtype=np.float64)
    if len(a) < 2:
        return (float(a[0]),) * 3 if len(a) else (float("nan"),) * 3
    from scipy.stats import t

    h = float(t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a)))
    return float(a.mean()), float(a.mean() - h), float(a.mean() + h)


def summary(records: dict[str, dict], out: str) -> dict:
    recs = list(records.values())
    table: dict = {"dev": {}, "curve": {}}
    for r in recs:
        if r["stage"] == "dev":
            c = r["cohort"]
            name = f"n{r['n_bags']}_bag{c['bag_size']}_s{c['strength']}_dec{c['decoys']}_{c['negatives']}"
            table["dev"].setdefault(name, {}).setdefault(r["recipe"], {})[r["model"]] = {
                "auc": round(r["pooled_auc"], 3), "bacc": round(r["pooled_bacc"], 3), "best_epochs": r["best_epochs"],
                "warnings": r["warnings"], "cpu_s": r["cpu_s"]}
    groups: dict = {}
    for r in recs:
        if r["stage"] == "curve":
            groups.setdefault((r["n_bags"], r["model"]), []).append(r)
    for (n, m), rs in sorted(groups.items()):
        mean, lo, hi = t_interval([r["pooled_auc"] for r in rs])
        bm, _, _ = t_interval([r["pooled_bacc"] for r in rs])
        table["curve"].setdefault(str(n), {})[m] = {"auc": mean, "lo": lo, "hi": hi, "seeds": sorted(r["cohort_seed"] for r in rs),
                                                    "per_seed": [round(r["pooled_auc"], 3) for r in sorted(rs, key=lambda r: r["cohort_seed"])],
                                                    "bacc": bm, "warnings": sum(r["warnings"] for r in rs),
                                                    "first_candidate_best": sum(b == r["settings"]["smooth"] for r in rs
                                                                                for b in r["best_epochs"]),
                                                    "cpu_s": round(sum(r["cpu_s"] for r in rs))}
        # paired with mean pooling on the same cohorts: this model's AUC minus mean pooling's
        base = {r["cohort_seed"]: r["pooled_auc"] for r in groups.get((n, "mean"), [])}
        diffs = [r["pooled_auc"] - base[r["cohort_seed"]] for r in rs if r["cohort_seed"] in base]
        if m != "mean" and diffs:
            d, dlo, dhi = t_interval(diffs)
            table["curve"][str(n)][m].update(minus_mean=d, minus_mean_lo=dlo, minus_mean_hi=dhi)
        # the second comparison: Querent minus ABMIL on the same cohorts
        abmil = {r["cohort_seed"]: r["pooled_auc"] for r in groups.get((n, "abmil"), [])}
        diffs = [r["pooled_auc"] - abmil[r["cohort_seed"]] for r in rs if r["cohort_seed"] in abmil]
        if m == "querent" and diffs:
            d, dlo, dhi = t_interval(diffs)
            table["curve"][str(n)][m].update(minus_abmil=d, minus_abmil_lo=dlo, minus_abmil_hi=dhi)
    tmp = out + ".tmp"
    with open(tmp, "w") as f:
        json.dump(table, f, indent=1)
    os.replace(tmp, out)
    if table["curve"]:
        _plot(table["curve"], os.path.splitext(out)[0] + ".png")
    return table


def auc_axes(ax, sizes: list[int], xlabel: str, title: str, legend_size: int = 8) -> None:
    """A pooled-AUC axis against a log-scaled size (ticks at ``sizes``), chance marked."""
    ax.set_xscale("log")
    ax.set_xticks(sizes)
    ax.set_xticklabels([str(s) for s in sizes])
    ax.minorticks_off()
    ax.set_ylim(0.3, 1.05)
    ax.axhline(0.5, color="grey", lw=0.6, ls=":")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("pooled OOF AUC (seed mean, 95% t interval)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=legend_size)


def _plot(curve: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    sizes = sorted(int(n) for n in curve)
    for j, m in enumerate(MODELS):
        pts = [(n, curve[str(n)][m]) for n in sizes if m in curve[str(n)]]
        if not pts:
            continue
        x = np.array([n for n, _ in pts], float) * (1 + 0.02 * (j - 2))
        y = np.array([v["auc"] for _, v in pts])
        err = np.array([[v["auc"] - v["lo"] for _, v in pts], [v["hi"] - v["auc"] for _, v in pts]])
        ax.errorbar(x, y, yerr=err, marker="o", ms=4, capsize=3, lw=1.2, label=m)
    auc_axes(ax, sizes, "bags in the cohort (5-fold CV)", "planted co-occurrence label: AUC against cohort size")
    fig.tight_layout()
    fig.savefig(path + ".tmp", format="png")
    plt.close(fig)
    os.replace(path + ".tmp", path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_cohort_bench", description=__doc__.split("\n")[0])
    p.add_argument("--stage", choices=("dev", "curve", "summary"), required=True)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--recipes", nargs="+", choices=list(RECIPES), default=["old", "auto"])
    p.add_argument("--cohorts", nargs="+", choices=[d[0] for d in DEV], default=None, help="dev cohorts (default: all)")
    p.add_argument("--sizes", nargs="+", type=positive_int, default=[60, 120, 300])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--bag-size", type=positive_int, default=None, help="curve: patches per bag (default 1000)")
    p.add_argument("--epochs-cap", type=positive_int, default=None, help="at most this many epochs (any recipe)")
    p.add_argument("--records", default=str(RECORDS))
    p.add_argument("--out", default=str(RESULTS / "pathology_cohort.json"))
    p.add_argument("--threads", type=thread_count, default=1)
    args = p.parse_args(argv)
    check_outputs([("--out", args.out), ("--records", args.records)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.stage == "summary":
        t = summary(read_records(args.records), args.out)
        print(json.dumps(t, indent=1)[:20000])
        return 0
    import torch

    torch.set_num_threads(args.threads)
    done = read_records(args.records)
    for coh, n, seed, rname, model in plan(args.stage, args):
        probe = {"stage": args.stage, "cohort": coh, "n_bags": n, "cohort_seed": seed, "recipe": rname,
                 "settings": recipe(rname, n), "model": model,
                 "epochs_cap": min(recipe(rname, n)["epochs"], args.epochs_cap or 10**9)}
        if key_of(probe) in done or key_of(probe) in read_records(args.records):  # another process may have run it
            continue
        rec = run_unit(args.stage, coh, n, seed, rname, model, epochs_cap=args.epochs_cap)
        append(args.records, rec)
        done[key_of(rec)] = rec
        logger.info("%s n=%d seed=%d %s %s: pooled AUC %.3f bacc %.3f best epochs %s cpu %.0fs", args.stage, n, seed,
                    rname, model, rec["pooled_auc"], rec["pooled_bacc"], rec["best_epochs"], rec["cpu_s"])
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
