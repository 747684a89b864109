"""TabICL against classical baselines on real classification tables, in one run.

Datasets: the classification tables that ship with scikit-learn (iris, wine, breast cancer, digits). Each is
split ``--repeats`` times with stratified shuffles (``--test-size`` held out); every model sees the same splits.
Metrics per split: accuracy, one-vs-rest ROC-AUC (macro), log-loss, fit + predict wall time; the table shows
means over splits. Baselines: LogisticRegression (standardized), RandomForest, HistGradientBoosting, kNN.

    python -m benchmarks.tabular_bench            # all datasets, 5 splits
    python -m benchmarks.tabular_bench --quick    # 2 splits, smaller ensembles

Results: ``benchmarks/results/tabular_bench.json`` and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import env_info, format_table, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_bench.json"


def datasets() -> dict:
    from sklearn import datasets as ds

    return {
        "iris": ds.load_iris(return_X_y=True),
        "wine": ds.load_wine(return_X_y=True),
        "breast_cancer": ds.load_breast_cancer(return_X_y=True),
        "digits": ds.load_digits(return_X_y=True),
    }


def models(n_estimators: int, checkpoint, seed: int) -> dict:
    from sklearn.ensemble import HistGradientBoostingClassifier, RandomForestClassifier
    from sklearn.linear_model import LogisticRegression
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from tabular import TabICLClassifier

    return {
        "TabICL": lambda: TabICLClassifier(n_estimators=n_estimators, checkpoint=checkpoint, random_state=seed),
        "LogisticRegression": lambda: make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000)),
        "RandomForest": lambda: RandomForestClassifier(n_estimators=300, random_state=seed, n_jobs=1),
        "HistGradientBoosting": lambda: HistGradientBoostingClassifier(random_state=seed),
        "kNN": lambda: make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=15)),
    }


def score(y_true, proba, classes) -> dict:
    from sklearn.metrics import accuracy_score, log_loss, roc_auc_score

    proba = np.clip(proba, 1e-12, 1.0)
    proba = proba / proba.sum(1, keepdims=True)
    pred = classes[np.argmax(proba, 1)]
    out = {"accuracy": float(accuracy_score(y_true, pred)), "log_loss": float(log_loss(y_true, proba, labels=classes))}
    if len(classes) == 2:
        out["roc_auc"] = float(roc_auc_score(y_true, proba[:, 1]))
    else:
        out["roc_auc"] = float(roc_auc_score(y_true, proba, multi_class="ovr", labels=classes))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="stratified splits per dataset")
    p.add_argument("--test-size", type=float, default=0.3, help="held-out share of each split")
    p.add_argument("--n-estimators", type=int, default=8, help="TabICL ensemble members")
    p.add_argument("--checkpoint", default=None, help="TabICL checkpoint (default: the shipped one)")
    p.add_argument("--datasets", nargs="*", default=None, help="subset of dataset names")
    p.add_argument("--quick", action="store_true", help="2 splits and 4 members")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    import torch
    from sklearn.model_selection import StratifiedShuffleSplit

    torch.set_num_threads(args.threads)
    if args.quick:
        args.repeats, args.n_estimators = min(args.repeats, 2), min(args.n_estimators, 4)
    data = datasets()
    names = args.datasets or list(data)
    unknown = [n for n in names if n not in data]
    if unknown:
        raise SystemExit(f"unknown dataset(s) {unknown}; choose from {list(data)}")
    rows = []
    for name in names:
        X, y = data[name]
        splitter = StratifiedShuffleSplit(n_splits=args.repeats, test_size=args.test_size, random_state=0)
        per_model: dict[str, list] = {}
        for split, (tr, te) in enumerate(splitter.split(X, y)):
            for mname, make in models(args.n_estimators, args.checkpoint, split).items():
                t0 = time.perf_counter()
                clf = make().fit(X[tr], y[tr])
                proba = clf.predict_proba(X[te])
                elapsed = time.perf_counter() - t0
                rec = {**score(y[te], proba, clf.classes_), "fit_predict_s": elapsed}
                per_model.setdefault(mname, []).append(rec)
                print(f"{name} split {split} {mname}: acc {rec['accuracy']:.3f} ({elapsed:.1f} s)", file=sys.stderr)
        for mname, recs in per_model.items():
            rows.append({
                "dataset": name, "rows": int(len(X)), "features": int(X.shape[1]), "classes": int(len(np.unique(y))),
                "model": mname, "splits": len(recs),
                **{k: float(np.mean([r[k] for r in recs])) for k in ("accuracy", "roc_auc", "log_loss", "fit_predict_s")},
                "accuracy_std": float(np.std([r["accuracy"] for r in recs])),
            })
    # Mean accuracy across datasets per model.
    summary = {}
    for mname in {r["model"] for r in rows}:
        summary[mname] = float(np.mean([r["accuracy"] for r in rows if r["model"] == mname]))
    result = {"env": env_info(), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "rows": rows, "mean_accuracy": summary}
    write_json_atomic(args.out, result)
    print(format_table(rows, ["dataset", "model", "accuracy", "roc_auc", "log_loss", "fit_predict_s"]))
    print()
    print(format_table([{"model": k, "mean_accuracy": v} for k, v in sorted(summary.items(), key=lambda kv: -kv[1])],
                       ["model", "mean_accuracy"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
