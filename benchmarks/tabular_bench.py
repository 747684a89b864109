"""TabICL against its peers on a suite of real classification tables, measured as the field does.

Suites (``benchmarks/tabular_suites.py``): ``dev`` (39 tables on which every modelling choice is made), ``report``
(the twelve tables reported in the README) and ``reserved`` (kept for an independent evaluation: no choice is made
on them). Each table is split ``--splits`` times into stratified 80/20 train/test parts (split ``i`` uses seed
``i``, so split 0 is the same whatever ``--splits`` is); every model sees the same splits.

Models (``benchmarks/tabular_peers.py``): TabICL with its shipped defaults; LightGBM, XGBoost and CatBoost with
their defaults and with a small tuning budget (the same for each: 10 random configurations chosen by 3-fold CV on
the training split only); HistGradientBoosting, RandomForest, LogisticRegression, kNN.

Metrics per (table, split, model): accuracy, balanced accuracy, one-vs-rest ROC-AUC (macro), log-loss, fit+predict
time; whether the model predicted a single class on the test split. Beside them: the majority-class rate of the test
split (predicting the training split's majority class). Aggregates over the tables where every compared model
finished every split: mean of each metric, mean rank (rank 1 = highest mean accuracy on a table, ties share the
average rank) and normalized accuracy (per table, (acc - min) / (max - min) over the models compared; 1 for all
when they tie).

Resumable: one record per (table, split, model), in ``<records>/<model>.json`` (written atomically after each
record). A record is reused only when its settings fingerprint (data content, split, test size, row cap, the
model's library version, seed, tuning budget or TabICL weights) equals this run's; otherwise it is recomputed.

    python -m benchmarks.tabular_bench --suite report --splits 3
    python -m benchmarks.tabular_bench --suite dev --splits 3 --models LightGBM XGBoost
    python -m benchmarks.tabular_bench --suite dev --report-only       # aggregate the records found, fit nothing
    python -m benchmarks.tabular_bench --suite reserved --describe     # table sizes only, no model is fitted
    python -m benchmarks.tabular_bench --suite report --merge-records runs/part2_records --report-only  # join runs

Results: ``benchmarks/results/tabular_bench_<suite>.json`` and ``.md`` (aggregates, per-table accuracy, flags,
the target lines for TabICL) and the records folder ``benchmarks/results/tabular_bench_<suite>_records/``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import env_info, format_table, portable_args, read_json, write_json_atomic

logger = logging.getLogger(__name__)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
METRICS = ("accuracy", "balanced_accuracy", "roc_auc", "log_loss")
#: Bumped when the way a record is computed changes, so that old records are never reused.
RECORD_VERSION = 1


def datasets() -> dict:
    """Report-suite table name -> zero-argument loader returning ``(X DataFrame, y array)`` (cleaned as in
    :func:`benchmarks.tabular_suites.load_table`); kept for the scripts that reuse these tables."""
    from benchmarks.tabular_suites import load_table, suite

    def loader(spec):
        def load():
            t = load_table(spec)
            return t.X, t.y
        return load

    return {spec.name: loader(spec) for spec in suite("report")}


# ---------------------------------------------------------------------------------------------- scoring


def score(y_true, proba, classes) -> dict[str, Any]:
    """Metrics of one test split. ``proba`` (rows x classes) follows ``classes``; every class must be a column."""
    from sklearn.metrics import accuracy_score, balanced_accuracy_score, log_loss, roc_auc_score

    proba = np.clip(np.asarray(proba, dtype=np.float64), 1e-12, 1.0)
    proba = proba / proba.sum(1, keepdims=True)
    pred = np.asarray(classes)[np.argmax(proba, 1)]
    out = {"accuracy": float(accuracy_score(y_true, pred)),
           "balanced_accuracy": float(balanced_accuracy_score(y_true, pred)),
           "log_loss": float(log_loss(y_true, proba, labels=classes)),
           "single_class": bool(len(np.unique(pred)) == 1)}
    if len(classes) == 2:
        out["roc_auc"] = float(roc_auc_score(y_true == classes[1], proba[:, 1]))
    else:
        out["roc_auc"] = float(roc_auc_score(y_true, proba, multi_class="ovr", average="macro", labels=classes))
    return out


def _aligned(clf, proba, classes) -> np.ndarray:
    """``proba`` with one column per entry of ``classes`` (a class the model never returned gets 0)."""
    full = np.zeros((proba.shape[0], len(classes)))
    where = {c: i for i, c in enumerate(classes)}
    for j, c in enumerate(np.asarray(clf.classes_).astype(str)):
        if c not in where:
            raise ValueError(f"model returned class {c!r} that is not among the table's {list(classes)}")
        full[:, where[c]] = proba[:, j]
    return full


# -------------------------------------------------------------------------------------------- aggregates


def per_table(records: list[dict]) -> dict[tuple[str, str], dict]:
    """(table, model) -> mean of each metric over its splits, ``splits``, ``single_class_splits``, ``seconds`` (wall)
    and ``cpu_seconds`` (the process's CPU time: the better guide on a shared machine)."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in records:
        groups.setdefault((r["table"], r["model"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {**{m: float(np.mean([r[m] for r in rs])) for m in METRICS},
                    "accuracy_std": float(np.std([r["accuracy"] for r in rs])),
                    "splits": len(rs), "single_class_splits": int(sum(r["single_class"] for r in rs)),
                    "seconds": float(np.mean([r["seconds"] for r in rs])),
                    "cpu_seconds": float(np.mean([r.get("cpu_seconds", np.nan) for r in rs]))}
    return out


def aggregate(means: dict[tuple[str, str], dict], models: list[str], tables: list[str]) -> dict[str, dict]:
    """Per model, over ``tables`` (each must have every model): mean of each metric, ``mean_rank`` (by mean
    accuracy, 1 = best, ties averaged) and ``normalized_accuracy`` (per table (acc - min) / (max - min) over
    ``models``; 1 when all tie), then averaged over the tables."""
    from scipy.stats import rankdata

    if not tables:
        return {}
    acc = np.array([[means[t, m]["accuracy"] for m in models] for t in tables])  # (tables, models)
    ranks = np.vstack([rankdata(-row, method="average") for row in acc])
    lo, hi = acc.min(1, keepdims=True), acc.max(1, keepdims=True)
    span = np.where(hi > lo, hi - lo, 1.0)
    norm = np.where(hi > lo, (acc - lo) / span, 1.0)
    out = {}
    for j, m in enumerate(models):
        out[m] = {**{f"mean_{k}": float(np.mean([means[t, m][k] for t in tables])) for k in METRICS},
                  "mean_rank": float(ranks[:, j].mean()), "normalized_accuracy": float(norm[:, j].mean()),
                  "tables": len(tables),
                  "single_class_tables": [t for t in tables if means[t, m]["single_class_splits"]]}
    return out


def targets(means: dict, tables: list[str], model: str = "TabICL") -> dict:
    """The issue's target for ``model``: mean accuracy >= HistGradientBoosting's and >= LogisticRegression's over
    ``tables``, and no table where it predicts a single class (in any split) while a peer does better."""
    peers = ("HistGradientBoosting", "LogisticRegression")
    have = [t for t in tables if (t, model) in means and all((t, p) in means for p in peers)]
    if not have:
        return {"lines": [], "met": None}
    mean = {m: float(np.mean([means[t, m]["accuracy"] for t in have])) for m in (model, *peers)}
    others = sorted({m for (_, m) in means} - {model})
    single_worse = []
    for t in have:
        if means[t, model]["single_class_splits"]:
            best_peer = max((means[t, m]["accuracy"], m) for m in others if (t, m) in means)
            if best_peer[0] > means[t, model]["accuracy"] + 1e-9:  # equal means of split accuracies can differ by rounding
                single_worse.append({"table": t, "model_accuracy": means[t, model]["accuracy"],
                                     "best_peer": best_peer[1], "peer_accuracy": best_peer[0]})
    per = {t: {"model": means[t, model]["accuracy"], **{p: means[t, p]["accuracy"] for p in peers}} for t in have}
    met = {"mean_vs_hgb": mean[model] >= mean["HistGradientBoosting"],
           "mean_vs_lr": mean[model] >= mean["LogisticRegression"], "no_single_class_loss": not single_worse}
    lines = [f"{model} mean accuracy over {len(have)} tables: {mean[model]:.3f}; HistGradientBoosting "
             f"{mean['HistGradientBoosting']:.3f} -> {'met' if met['mean_vs_hgb'] else 'NOT met'}; "
             f"LogisticRegression {mean['LogisticRegression']:.3f} -> {'met' if met['mean_vs_lr'] else 'NOT met'}",
             f"{model} predicts a single class on a table where a peer does better: "
             + (", ".join(f"{s['table']} ({s['model_accuracy']:.3f} vs {s['best_peer']} {s['peer_accuracy']:.3f})"
                          for s in single_worse) if single_worse else "none")]
    return {"model": model, "tables": have, "mean_accuracy": mean, "per_table": per,
            "single_class_where_peer_better": single_worse, "met": met, "lines": lines}


# ------------------------------------------------------------------------------------------------ records


def _fingerprint(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RecordStore:
    """One JSON file per model under ``folder``: ``{"records": {"<table>|<split>": record}}``, rewritten
    atomically after each new record. A record counts only when its ``settings`` fingerprint matches."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._cache: dict[str, dict] = {}

    def _path(self, model: str) -> Path:
        return self.folder / f"{model}.json"

    def _load(self, model: str) -> dict:
        if model not in self._cache:
            self._cache[model] = (read_json(self._path(model)) or {}).get("records", {})
        return self._cache[model]

    def get(self, model: str, table: str, split: int, settings: str) -> dict | None:
        rec = self._load(model).get(f"{table}|{split}")
        return rec if rec is not None and rec.get("settings") == settings else None

    def merge_from(self, folder: Path) -> int:
        """Copy the records of another records folder (a run in parallel with its own ``--records``) that this
        store lacks (same model, table and split); returns how many were added. Records here are kept."""
        added = 0
        for path in sorted(Path(folder).glob("*.json")):
            theirs = (read_json(path) or {}).get("records", {})
            for rec in theirs.values():
                if f"{rec['table']}|{rec['split']}" not in self._load(rec["model"]):
                    self.put(rec)
                    added += 1
        return added

    def put(self, rec: dict) -> None:
        recs = self._load(rec["model"])
        recs[f"{rec['table']}|{rec['split']}"] = rec
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self._path(rec["model"]), {"model": rec["model"], "records": dict(sorted(recs.items()))})


def split_indices(y: np.ndarray, split: int, test_size: float) -> tuple[np.ndarray, np.ndarray]:
    """Stratified train/test indices of split ``split`` (seed ``split``: independent of how many splits run)."""
    from sklearn.model_selection import train_test_split

    return train_test_split(np.arange(len(y)), test_size=test_size, stratify=y, random_state=split)


def run_one(make, X, y, tr, te, classes) -> dict:
    """Fit on the train rows, score on the test rows; adds ``seconds`` (wall) and ``cpu_seconds``."""
    w0, c0 = time.perf_counter(), time.process_time()
    clf = make().fit(X.iloc[tr].reset_index(drop=True), y[tr])
    proba = _aligned(clf, np.asarray(clf.predict_proba(X.iloc[te].reset_index(drop=True))), classes)
    out = {**score(y[te], proba, classes), "seconds": time.perf_counter() - w0,
           "cpu_seconds": time.process_time() - c0}
    if hasattr(clf, "best_params_"):
        out["best_params"] = clf.best_params_
        out["cv_accuracy"] = clf.cv_accuracy_
    return out


# ---------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from benchmarks.tabular_suites import MAX_ROWS, MIN_CLASS_ROWS, SUITES

    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=SUITES, default="report", help="which tables (see benchmarks.tabular_suites)")
    p.add_argument("--tables", nargs="+", default=None, help="a subset of the suite's table names, run in this order")
    p.add_argument("--models", nargs="+", default=None,
                   help="models to run and compare (default: TabICL and every peer)")
    p.add_argument("--splits", type=int, default=3, help="stratified train/test splits per table")
    p.add_argument("--test-size", type=float, default=0.2, help="held-out share of each split")
    p.add_argument("--max-rows", type=int, default=MAX_ROWS, help="stratified row cap per table")
    p.add_argument("--min-class-rows", type=int, default=MIN_CLASS_ROWS, help="classes with fewer rows are removed")
    p.add_argument("--tune-configs", type=int, default=10, help="random configurations per tuned GBDT")
    p.add_argument("--tune-folds", type=int, default=3, help="inner CV folds (training split only)")
    p.add_argument("--n-estimators", type=int, default=None, help="TabICL ensemble members (default: its own)")
    p.add_argument("--checkpoint", default=None, help="TabICL checkpoint (default: the shipped one)")
    p.add_argument("--tabicl-kwargs", type=json.loads, default=None, metavar="JSON",
                   help='further TabICLClassifier parameters, e.g. \'{"softmax_temperature": 1.0}\' (recorded)')
    p.add_argument("--finetune-steps", type=int, default=0,
                   help="also run TabICL-ft: TabICL fine-tuned for this many steps on each split's train rows")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, default=None, help="results JSON (default results/tabular_bench_<suite>.json)")
    p.add_argument("--records", type=Path, default=None, help="records folder (default: <out stem>_records)")
    p.add_argument("--merge-records", type=Path, nargs="+", default=(), metavar="FOLDER",
                   help="first copy in the records of these folders (runs made in parallel) that --records lacks")
    p.add_argument("--report-only", action="store_true", help="aggregate the matching records found; fit nothing")
    p.add_argument("--describe", action="store_true", help="write the suite's table records only; fit nothing")
    return p


def _markdown(suite_name: str, tables: list[dict], agg: dict, means: dict, models: list[str], complete: list[str],
              target: dict, args) -> str:
    lines = [f"# Tabular benchmark: suite `{suite_name}`", "",
             f"{args.splits} stratified {1 - args.test_size:.0%}/{args.test_size:.0%} splits per table; "
             f"row cap {args.max_rows}; "
             + (f"tuned GBDTs: {args.tune_configs} random configurations, {args.tune_folds}-fold CV on the training "
                "split; " if any(m.endswith("-tuned") for m in models) else "")
             + f"aggregates over the {len(complete)} tables where every model below finished every split.", ""]
    if agg:
        rows = sorted(({"model": m, **agg[m]} for m in models), key=lambda r: r["mean_rank"])
        for r in rows:
            r["single_class_tables"] = len(r["single_class_tables"])
        lines += [format_table(rows, ["model", "mean_accuracy", "mean_balanced_accuracy", "mean_roc_auc",
                                      "mean_log_loss", "mean_rank", "normalized_accuracy", "tables",
                                      "single_class_tables"]), ""]
    lines += ["Mean accuracy per table († = a single class predicted in at least one split; – = not finished).", ""]
    head = ["table", "rows", "features", "classes", "majority", *models]
    rows = []
    for t in tables:
        row = {"table": t["name"], "rows": t["rows"], "features": t["features"], "classes": t["classes"],
               "majority": t.get("test_majority_rate", t["majority_rate"])}
        for m in models:
            v = means.get((t["name"], m))
            row[m] = None if v is None else f"{v['accuracy']:.3f}" + ("†" if v["single_class_splits"] else "")
        rows.append(row)
    lines += [format_table(rows, head), ""]
    lines += target.get("lines", [])
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    from benchmarks.tabular_peers import PEERS, model_factories, model_settings
    from benchmarks.tabular_suites import TableUnavailable, load_table, suite

    if args.splits < 1:
        raise SystemExit(f"--splits must be at least 1, got {args.splits}")
    if not 0 < args.test_size < 1:
        raise SystemExit(f"--test-size must be in (0, 1), got {args.test_size}")
    specs = suite(args.suite)
    if args.tables:
        unknown = sorted(set(args.tables) - {s.name for s in specs})
        if unknown:
            raise SystemExit(f"unknown table(s) {unknown} in suite {args.suite!r}; choose from {[s.name for s in specs]}")
        by_name = {s.name: s for s in specs}
        specs = tuple(by_name[n] for n in dict.fromkeys(args.tables))  # in the order given
    out = args.out or RESULTS_DIR / f"tabular_bench_{args.suite}.json"
    records_dir = args.records or out.with_name(out.stem + "_records")
    tune = {"n_configs": args.tune_configs, "folds": args.tune_folds}
    if args.tabicl_kwargs is not None and not isinstance(args.tabicl_kwargs, dict):
        raise SystemExit(f"--tabicl-kwargs must be a JSON object, got {args.tabicl_kwargs!r}")
    factories = model_factories(**tune, tabicl_n_estimators=args.n_estimators, checkpoint=args.checkpoint,
                                finetune_steps=args.finetune_steps, tabicl_kwargs=args.tabicl_kwargs)
    models = list(args.models or ["TabICL", *PEERS])
    unknown = [m for m in models if m not in factories]
    if unknown:
        raise SystemExit(f"unknown model(s) {unknown}; choose from {list(factories)}")
    if args.describe:
        tables, failures = [], []
        for spec in specs:
            try:
                tables.append(load_table(spec, max_rows=args.max_rows, min_class_rows=args.min_class_rows).record)
            except TableUnavailable as e:
                failures.append({"table": spec.name, "error": str(e)})
        write_json_atomic(out.with_name(f"tabular_suite_{args.suite}.json"),
                          {"suite": args.suite, "tables": tables, "unavailable": failures})
        print(format_table(tables, ["name", "source", "rows", "features", "numeric", "categorical", "classes",
                                    "majority_rate", "missing_share"]))
        return 0

    import torch

    torch.set_num_threads(args.threads)
    settings = {m: model_settings(m, **tune, tabicl_n_estimators=args.n_estimators, checkpoint=args.checkpoint,
                                  finetune_steps=args.finetune_steps, tabicl_kwargs=args.tabicl_kwargs)
                for m in models}
    store = RecordStore(records_dir)
    for folder in args.merge_records:
        logger.warning("merged %d record(s) from %s", store.merge_from(folder), folder)
    tables, records, failures = [], [], []
    bar = tqdm(total=len(specs) * args.splits * len(models), desc=f"tabular_bench {args.suite}", file=sys.stderr)
    for spec in specs:
        try:
            table = load_table(spec, max_rows=args.max_rows, min_class_rows=args.min_class_rows)
        except TableUnavailable as e:
            failures.append({"table": spec.name, "model": None, "error": f"unavailable: {e}"})
            bar.update(args.splits * len(models))
            continue
        X, y, rec = table.X, table.y, dict(table.record)
        classes = np.unique(y)
        majority = []
        for split in range(args.splits):
            tr, te = split_indices(y, split, args.test_size)
            top = classes[np.argmax([np.sum(y[tr] == c) for c in classes])]
            majority.append(float(np.mean(y[te] == top)))
            common = {"version": RECORD_VERSION, "data": rec["fingerprint"], "split": split,
                      "test_size": args.test_size, "max_rows": args.max_rows, "min_class_rows": args.min_class_rows}
            for m in models:
                fp = _fingerprint({**common, **settings[m]})
                done = store.get(m, spec.name, split, fp)
                if done is None and not args.report_only:
                    try:
                        res = run_one(factories[m], X, y, tr, te, classes)
                    except Exception as e:  # record the failure, keep the other models and tables
                        failures.append({"table": spec.name, "model": m, "split": split,
                                         "error": f"{type(e).__name__}: {e}"})
                        logger.warning("%s split %d %s failed: %s", spec.name, split, m, e)
                        bar.update()
                        continue
                    done = {"table": spec.name, "split": split, "model": m, "settings": fp, **res,
                            "test_majority_rate": majority[-1], "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                          time.gmtime())}
                    store.put(done)
                    bar.set_postfix_str(f"{spec.name} {m} acc {done['accuracy']:.3f}")
                if done is not None:
                    records.append(done)
                bar.update()
        rec["test_majority_rate"] = float(np.mean(majority))
        tables.append(rec)
    bar.close()

    means = per_table(records)
    complete = [t["name"] for t in tables
                if all(means.get((t["name"], m), {}).get("splits") == args.splits for m in models)]
    agg = aggregate(means, models, complete)
    target = targets(means, complete) if "TabICL" in models else {"lines": []}
    result = {"env": env_info(), "args": portable_args(args), "suite": args.suite, "models": models,
              "settings": settings, "tables": tables, "complete_tables": complete, "aggregates": agg,
              "per_table": [{"table": t, "model": m, **v} for (t, m), v in sorted(means.items())],
              "targets": target, "failures": failures}
    write_json_atomic(out, result)
    md = _markdown(args.suite, tables, agg, means, models, complete, target, args)
    tmp = out.with_suffix(".md.tmp")
    tmp.write_text(md)
    tmp.replace(out.with_suffix(".md"))
    print(md)
    if failures:
        print(f"{len(failures)} failure(s) recorded in {out.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
