"""Where TabICL falls behind on large tables: accuracy against the number of training rows, and the context length.

A diagnosis on the development suite (or the report suite), never on the reserved tables. For each table and split
(the stratified 80/20 splits of ``benchmarks.tabular_bench``: the test rows are the same at every size), the
training split is subsampled, stratified and nested (the 512-row subset is part of the 1,024-row one), to each
``--sizes`` value, and every model is fitted on it and scored on the full test split. Two readings:

* If TabICL's gap to gradient boosting opens only as the training rows grow past the pretraining tables' size
  (the shipped medium model saw at most 320 rows), the model does not use long contexts; if the gap is there at
  256 rows already, it is the function class (what the prior taught), not the length.
* TabICL variants (``--variant NAME=JSON`` of ``TabICLClassifier`` parameters, e.g. ``ctx1024={"max_context":
  1024}``: train sets above 1,024 rows are then split into stratified folds that act as separate contexts whose
  probabilities are averaged; ``{"checkpoint": PATH}`` for other weights, fingerprinted by the file's content) run
  at the full size only, unless ``--variant-sizes all``.

Resumable: one JSON record per (table, split, size, model) in ``--records`` (JSON lines; a record is reused only
when its settings fingerprint matches), results in ``--out`` (.json, .md, and a .png of the curves).

    python -m benchmarks.tabular_learning_curve --tables diamonds mlc_churn --sizes 256,1024,4096,all --splits 2 \\
        --variant ctx1024='{"max_context": 1024}' --out runs/curve.json
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import env_info, portable_args, write_json_atomic

logger = logging.getLogger(__name__)

#: Bumped when the way a record is computed changes.
RECORD_VERSION = 1
DEFAULT_MODELS = ("TabICL", "HistGradientBoosting", "LogisticRegression")


def parse_sizes(text: str) -> list[int | None]:
    """``"256,1024,all"`` -> ``[256, 1024, None]`` (``None``: the whole training split)."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part in ("all", "full"):
            out.append(None)
            continue
        try:
            n = int(part)
        except ValueError:
            raise SystemExit(f"--sizes takes comma-separated row counts or 'all', got {part!r}") from None
        if n < 8:
            raise SystemExit(f"--sizes: each size must be at least 8 rows, got {n}")
        out.append(n)
    if not out:
        raise SystemExit("--sizes is empty")
    return out


def parse_variant(text: str) -> tuple[str, dict]:
    """``NAME=JSON`` -> ``(NAME, dict)``."""
    name, sep, js = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--variant takes NAME=JSON (e.g. ctx1024='{{\"max_context\": 1024}}'), got {text!r}")
    try:
        kw = json.loads(js)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--variant {name}: not valid JSON ({e}): {js!r}") from None
    if not isinstance(kw, dict):
        raise SystemExit(f"--variant {name}: the JSON must be an object of TabICLClassifier parameters, got {js!r}")
    return name, kw


def nested_subsets(y_train: np.ndarray, sizes: list[int | None], seed: int) -> dict[int | None, np.ndarray]:
    """Positions into the training split for each size: stratified and nested (each smaller subset lies inside the
    larger ones). Every class keeps at least one row while the size allows (then the rarest classes go first).

    The rows are ranked once: within each class in a random order, classes interleaved in proportion to their
    frequency (a row's key is its within-class rank divided by the class size); the first ``n`` of that order
    are the subset of size ``n``."""
    rng = np.random.default_rng(seed)
    n = len(y_train)
    key = np.empty(n)
    first = np.zeros(n, dtype=bool)
    for c in np.unique(y_train):
        perm = rng.permutation(np.flatnonzero(y_train == c))
        # (rank + U) / count: each class spread evenly over [0, 1), ties between classes broken at random; the
        # class's first row (rank 0) goes up front so that a small subset still holds every class
        key[perm] = (np.arange(len(perm)) + rng.random(len(perm))) / len(perm)
        first[perm[0]] = True
    order = np.lexsort((key, ~first))
    return {s: np.sort(order if s is None or s >= n else order[:s]) for s in sizes}


def _fingerprint(obj: Any) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Records:
    """JSON-lines record file, appended one record at a time (each line flushed; a torn last line is skipped)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.by_key: dict[tuple, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.by_key[(r["table"], r["split"], r["size"], r["model"], r["settings"])] = r

    def get(self, table, split, size, model, settings) -> dict | None:
        return self.by_key.get((table, split, size, model, settings))

    def put(self, rec: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        self.by_key[(rec["table"], rec["split"], rec["size"], rec["model"], rec["settings"])] = rec


def summarise(records: list[dict], tables: list[str], models: list[str], reference: str) -> dict:
    """Mean accuracy per (table, model, size label) over the splits present, and each model's mean gap to
    ``reference`` per size label over the tables where both have every split the other has."""
    cell: dict[tuple[str, str, str], list[float]] = {}
    for r in records:
        cell.setdefault((r["table"], r["model"], r["size_label"]), []).append(r["accuracy"])
    means = {k: float(np.mean(v)) for k, v in cell.items()}
    labels = sorted({k[2] for k in cell}, key=_label_order)
    gaps = {}
    for m in models:
        if m == reference:
            continue
        for lab in labels:
            d = [means[(t, m, lab)] - means[(t, reference, lab)] for t in tables
                 if (t, m, lab) in means and (t, reference, lab) in means
                 and len(cell[(t, m, lab)]) == len(cell[(t, reference, lab)])]
            if d:
                gaps[f"{m}|{lab}"] = {"model": m, "size": lab, "mean_gap": float(np.mean(d)), "tables": len(d)}
    return {"means": [{"table": t, "model": m, "size": s, "accuracy": v, "splits": len(cell[(t, m, s)])}
                      for (t, m, s), v in sorted(means.items())],
            "gaps_to_reference": list(gaps.values()), "reference": reference, "size_labels": labels}


def _label_order(label: str):
    return (1, 0) if label == "all" else (0, int(label))


def _markdown(summary: dict, tables: list[str], models: list[str], args) -> str:
    labels = summary["size_labels"]
    acc = {(m["table"], m["model"], m["size"]): m for m in summary["means"]}
    lines = [f"# TabICL learning curves: suite `{args.suite}`", "",
             f"{args.splits} stratified 80/20 split(s) per table (the splits of `benchmarks.tabular_bench`); the "
             "training split subsampled (stratified, nested) to each size; accuracy on the full test split, mean "
             "over splits. `all` = the whole training split (its row count per table is in the JSON).", ""]
    for t in tables:
        lines += [f"## {t}", "", "| model | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
        for m in models:
            row = [f"{acc[(t, m, lab)]['accuracy']:.3f}" if (t, m, lab) in acc else "–" for lab in labels]
            lines.append(f"| {m} | " + " | ".join(row) + " |")
        lines.append("")
    lines += [f"## Mean accuracy minus {summary['reference']} per size (tables where both finished)", "",
              "| model | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    gap = {(g["model"], g["size"]): g for g in summary["gaps_to_reference"]}
    for m in models:
        if m == summary["reference"]:
            continue
        row = [f"{gap[(m, lab)]['mean_gap']:+.3f} ({gap[(m, lab)]['tables']})" if (m, lab) in gap else "–"
               for lab in labels]
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _plot(summary: dict, tables: list[str], models: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(tables)
    cols = min(4, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    full = summary.get("full_rows", {})
    for ax, t in zip(axes.ravel(), tables):
        for m in models:
            pts = [(full.get(t) if r["size"] == "all" else int(r["size"]), r["accuracy"])
                   for r in summary["means"] if r["table"] == t and r["model"] == m]
            pts = sorted(p for p in pts if p[0] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", ms=3, label=m)
        ax.set_xscale("log", base=2)
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("training rows", fontsize=8)
        ax.set_ylabel("test accuracy", fontsize=8)
        ax.axvline(320, color="grey", lw=0.6, ls=":")
        ax.tick_params(labelsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    axes.ravel()[0].legend(fontsize=6)
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_learning_curve",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", choices=("dev", "report"), default="dev",
                   help="which tables (the reserved suite is kept out of every diagnosis)")
    p.add_argument("--tables", nargs="+", required=True, help="table names of the suite")
    p.add_argument("--sizes", default="256,512,1024,2048,4096,all", help="training rows per fit, 'all' = whole split")
    p.add_argument("--splits", type=int, default=2, help="splits per table (split i uses seed i)")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_MODELS), help="models of benchmarks.tabular_peers")
    p.add_argument("--variant", action="append", default=[], type=parse_variant, metavar="NAME=JSON",
                   help="a TabICL variant: TabICLClassifier parameters as JSON (repeatable)")
    p.add_argument("--variant-sizes", choices=("all", "full"), default="full",
                   help="variants at every size ('all') or only at the full training split ('full')")
    p.add_argument("--reference", default="HistGradientBoosting", help="the model the gaps are measured against")
    p.add_argument("--test-size", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--out", type=Path, required=True, help="results JSON (also .md and .png beside it)")
    p.add_argument("--records", type=Path, default=None, help="JSON-lines records (default: OUT with .records.jsonl)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tqdm import tqdm

    from benchmarks.tabular_bench import run_one, split_indices
    from benchmarks.tabular_peers import model_factories, model_settings
    from benchmarks.tabular_suites import TableUnavailable, load_table, suite

    sizes = parse_sizes(args.sizes)
    if args.splits < 1:
        raise SystemExit(f"--splits must be at least 1, got {args.splits}")
    specs = {s.name: s for s in suite(args.suite)}
    unknown = [t for t in args.tables if t not in specs]
    if unknown:
        raise SystemExit(f"unknown table(s) {unknown} in suite {args.suite!r}; choose from {sorted(specs)}")
    tune = {"n_configs": 10, "folds": 3}
    base = model_factories(**tune)
    bad = [m for m in args.models if m not in base]
    if bad:
        raise SystemExit(f"unknown model(s) {bad}; choose from {list(base)}")
    variants = dict(args.variant)
    clash = [v for v in variants if v in base]
    if clash:
        raise SystemExit(f"--variant names {clash} clash with model names; use another name")
    factories = {m: base[m] for m in args.models}
    settings = {m: model_settings(m, **tune, tabicl_n_estimators=None, checkpoint=None, finetune_steps=0)
                for m in args.models}
    for name, kw in variants.items():
        kw = dict(kw)
        ckpt = kw.pop("checkpoint", None)  # weights: fingerprinted by file content, not by path
        if ckpt is not None and not Path(ckpt).is_file():
            raise SystemExit(f"--variant {name}: checkpoint {ckpt!r} is not a file")
        factories[name] = model_factories(**tune, checkpoint=ckpt, tabicl_kwargs=kw or None)["TabICL"]
        settings[name] = model_settings("TabICL", **tune, tabicl_n_estimators=None, checkpoint=ckpt,
                                        finetune_steps=0, tabicl_kwargs=kw or None)
    models = [*args.models, *variants]
    records = Records(args.records or args.out.with_suffix(".records.jsonl"))

    import torch

    torch.set_num_threads(args.threads)
    done: list[dict] = []
    failures: list[dict] = []
    full_rows: dict[str, int] = {}
    jobs = sum(len(sizes) * len(args.models) + (len(sizes) if args.variant_sizes == "all" else 1) * len(variants)
               for _ in args.tables) * args.splits
    bar = tqdm(total=jobs, desc="learning curve", file=sys.stderr)
    for t in args.tables:
        try:
            table = load_table(specs[t])
        except TableUnavailable as e:
            failures.append({"table": t, "error": f"unavailable: {e}"})
            continue
        X, y = table.X, table.y
        classes = np.unique(y)
        for split in range(args.splits):
            tr, te = split_indices(y, split, args.test_size)
            full_rows[t] = len(tr)
            subsets = nested_subsets(y[tr], sizes, seed=1000 + split)
            for size in sizes:
                sub = tr[subsets[size]]
                if size is not None and size >= len(tr) and None in sizes:
                    continue  # the whole split, measured once under 'all'
                label = "all" if size is None or size >= len(tr) else str(size)
                for m in models:
                    if m in variants and args.variant_sizes == "full" and label != "all":
                        continue
                    fp = _fingerprint({"version": RECORD_VERSION, "data": table.record["fingerprint"],
                                       "split": split, "size": label, "test_size": args.test_size, **settings[m]})
                    rec = records.get(t, split, label, m, fp)
                    if rec is None:
                        try:
                            res = run_one(factories[m], X, y, sub, te, classes)
                        except Exception as e:  # record and go on
                            failures.append({"table": t, "split": split, "size": label, "model": m,
                                             "error": f"{type(e).__name__}: {e}"})
                            logger.warning("%s split %d size %s %s failed: %s", t, split, label, m, e)
                            bar.update()
                            continue
                        rec = {"table": t, "split": split, "size": label, "rows": int(len(sub)), "model": m,
                               "settings": fp, **res,
                               "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
                        records.put(rec)
                        bar.set_postfix_str(f"{t} {label} {m} acc {rec['accuracy']:.3f}")
                    done.append({**rec, "size_label": label})
                    bar.update()
    bar.close()
    summary = summarise(done, list(args.tables), models, args.reference)
    summary["full_rows"] = full_rows
    result = {"env": env_info(), "args": portable_args(args), "models": models, "settings": settings,
              "variants": variants, "summary": summary, "failures": failures}
    write_json_atomic(args.out, result)
    md = _markdown(summary, list(args.tables), models, args)
    tmp = args.out.with_suffix(".md.tmp")
    tmp.write_text(md)
    tmp.replace(args.out.with_suffix(".md"))
    try:
        _plot(summary, list(args.tables), models, args.out.with_suffix(".png"))
    except Exception as e:  # a missing plotting library must not lose the numbers
        logger.warning("plot not written: %s", e)
    print(md)
    if failures:
        print(f"{len(failures)} failure(s) recorded in {args.out.name}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
