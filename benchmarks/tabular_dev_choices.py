"""TabICL's default choices compared on the development suite only, and the choice each comparison makes.

A choice (the readout, the temperature, the ensemble) is a set of named variants, each a run of
``benchmarks.tabular_bench --suite dev --models TabICL ...`` with that variant's settings (its results JSON). Only
development-suite results are accepted: a report or reserved run is refused, so no choice can look at them.

Per table (the tables where every variant finished every split): each variant's mean accuracy, balanced accuracy,
ROC-AUC, log-loss, single-class splits, wall and CPU seconds, and the peers' accuracy from the same runs for context.
Aggregates per variant: the mean of each metric, the mean rank among the variants (by accuracy, 1 = best, ties
averaged), and against the reference variant (``--reference``, the current default): tables won / lost / tied on
accuracy, the mean paired accuracy difference with a 95% bootstrap interval over tables (seed 0, 10,000 draws)
and a two-sided sign test.

The rule: the chosen variant is the one with the highest mean accuracy over those tables; on an exact tie the
``--prefer`` variant (the simpler or cheaper one) is chosen. The choice is written under its name into the
results JSON (other choices already there are kept), with each variant's settings (TabICL's weights identity,
its parameters), so that a test can check the estimator's default against it.

    python -m benchmarks.tabular_dev_choices --choice readout \\
        --variant readout=benchmarks/results/tabular_bench_dev_tabicl.json \\
        --variant plain=benchmarks/results/tabular_bench_dev_plain.json --reference readout --prefer plain

Results: ``benchmarks/results/tabular_dev_choices.json`` (and a Markdown table per choice beside it, ``.md``).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import env_info, format_table, portable_args, read_json, write_json_atomic

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_dev_choices.json"
METRICS = ("accuracy", "balanced_accuracy", "roc_auc", "log_loss")
#: Peers whose accuracy is listed beside the variants (when the variants' runs hold them).
CONTEXT_PEERS = ("HistGradientBoosting", "LogisticRegression", "RandomForest")


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test p-value of ``wins`` against ``losses`` (ties left out); 1.0 when both are 0."""
    n = wins + losses
    if n == 0:
        return 1.0
    k = min(wins, losses)
    p = sum(math.comb(n, i) for i in range(k + 1)) / 2.0 ** n
    return float(min(1.0, 2 * p))


def bootstrap_mean(diff: np.ndarray, draws: int = 10_000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the mean of ``diff`` (one value per table)."""
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), size=(draws, len(diff)))
    means = diff[idx].mean(1)
    return float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def compare(variants: dict[str, dict], *, reference: str, prefer: str, splits: int, model: str = "TabICL") -> dict:
    """Compare the variants (name -> a ``tabular_bench`` results dict of the dev suite) as the module docs say.

    Raises:
        ValueError: a run is not of the dev suite, lacks ``model``, or ``reference`` / ``prefer`` is not a variant.
    """
    from scipy.stats import rankdata

    for name in (reference, prefer):
        if name not in variants:
            raise ValueError(f"{name!r} is not a variant; variants: {list(variants)}")
    means: dict[str, dict[str, dict]] = {}
    peers: dict[str, dict[str, float]] = {}
    for name, res in variants.items():
        if res.get("suite") != "dev":
            raise ValueError(f"variant {name!r} is a run of suite {res.get('suite')!r}: choices are made on 'dev' only")
        rows = {r["table"]: r for r in res["per_table"] if r["model"] == model and r["splits"] == splits}
        if not rows:
            raise ValueError(f"variant {name!r} has no {model} table with {splits} splits")
        means[name] = rows
        for r in res["per_table"]:
            if r["model"] in CONTEXT_PEERS and r["splits"] == splits:
                peers.setdefault(r["table"], {})[r["model"]] = r["accuracy"]
    names = list(variants)
    tables = sorted(set.intersection(*(set(m) for m in means.values())))
    if not tables:
        raise ValueError("no table where every variant finished every split")
    acc = np.array([[means[v][t]["accuracy"] for v in names] for t in tables])  # (tables, variants)
    ranks = np.vstack([rankdata(-row, method="average") for row in acc])
    agg = {}
    for j, v in enumerate(names):
        a = {f"mean_{k}": float(np.mean([means[v][t][k] for t in tables])) for k in METRICS}
        a["mean_rank"] = float(ranks[:, j].mean())
        a["mean_seconds"] = float(np.mean([means[v][t]["seconds"] for t in tables]))
        a["mean_cpu_seconds"] = float(np.mean([means[v][t].get("cpu_seconds", np.nan) for t in tables]))
        a["single_class_tables"] = [t for t in tables if means[v][t]["single_class_splits"]]
        if v != reference:
            d = acc[:, j] - acc[:, names.index(reference)]
            wins, losses = int(np.sum(d > 1e-12)), int(np.sum(d < -1e-12))
            lo, hi = bootstrap_mean(d)
            a["vs_reference"] = {"wins": wins, "losses": losses, "ties": len(d) - wins - losses,
                                 "mean_difference": float(d.mean()), "ci95": [lo, hi],
                                 "sign_test_p": sign_test(wins, losses)}
        agg[v] = a
    best = max(names, key=lambda v: (round(agg[v]["mean_accuracy"], 12), v == prefer))
    per = [{"table": t, **{f"{v}_{k}": means[v][t][k] for v in names for k in METRICS},
            **{f"{v}_single_class_splits": means[v][t]["single_class_splits"] for v in names},
            **{f"{v}_seconds": means[v][t]["seconds"] for v in names},
            **{f"{v}_cpu_seconds": means[v][t].get("cpu_seconds") for v in names},
            **{p: peers.get(t, {}).get(p) for p in CONTEXT_PEERS}} for t in tables]
    peer_means = {p: float(np.mean([peers[t][p] for t in tables])) for p in CONTEXT_PEERS
                  if all(p in peers.get(t, {}) for t in tables)}
    return {"variants": names, "reference": reference, "prefer": prefer, "splits": splits, "tables": tables,
            "aggregates": agg, "peer_mean_accuracy": peer_means, "per_table": per, "chosen": best,
            "rule": f"highest mean accuracy over the {len(tables)} dev tables where every variant finished "
                    f"{splits} splits; an exact tie goes to {prefer!r}",
            "settings": {v: variants[v]["settings"].get(model) for v in names}}


def markdown(name: str, c: dict) -> str:
    """A Markdown section for one choice: aggregates, then accuracy per table."""
    lines = [f"## Choice `{name}` (development suite, {len(c['tables'])} tables, {c['splits']} splits)", "",
             f"Rule: {c['rule']}. **Chosen: {c['chosen']}**; reference (current default): {c['reference']}.", ""]
    rows = []
    for v in c["variants"]:
        a = c["aggregates"][v]
        vs = a.get("vs_reference")
        rows.append({"variant": v, **{k: a[f"mean_{k}"] for k in METRICS}, "mean_rank": a["mean_rank"],
                     "mean_cpu_seconds": a["mean_cpu_seconds"], "single_class_tables": len(a["single_class_tables"]),
                     "won/lost/tied vs ref": "" if vs is None else f"{vs['wins']}/{vs['losses']}/{vs['ties']}",
                     "mean diff [95% CI]": "" if vs is None else
                     f"{vs['mean_difference']:+.4f} [{vs['ci95'][0]:+.4f}, {vs['ci95'][1]:+.4f}]",
                     "sign p": None if vs is None else vs["sign_test_p"]})
    lines += [format_table(rows, list(rows[0])), ""]
    if c["peer_mean_accuracy"]:
        lines += ["Peers' mean accuracy on the same tables: " + ", ".join(
            f"{p} {m:.4f}" for p, m in c["peer_mean_accuracy"].items()), ""]
    head = ["table", *(f"{v}_accuracy" for v in c["variants"]), *CONTEXT_PEERS]
    lines += [format_table(c["per_table"], head), ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_dev_choices", description=__doc__.split("\n\n")[0])
    p.add_argument("--choice", required=True, help="name of the choice (e.g. readout, n_estimators)")
    p.add_argument("--variant", action="append", required=True, metavar="NAME=RESULTS_JSON",
                   help="a variant and its tabular_bench results JSON (dev suite); give two or more")
    p.add_argument("--reference", required=True, help="the variant that is the current default")
    p.add_argument("--prefer", default=None, help="the variant chosen on an exact tie (default: the reference)")
    p.add_argument("--splits", type=int, default=3, help="splits a table must have finished to count")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (choices already in it are kept)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    variants: dict[str, Any] = {}
    for spec in args.variant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--variant must be NAME=RESULTS_JSON, got {spec!r}")
        res = read_json(path)
        if res is None:
            raise SystemExit(f"results file not found: {path}")
        variants[name] = res
    if len(variants) < 2:
        raise SystemExit(f"give at least two --variant, got {list(variants)}")
    try:
        c = compare(variants, reference=args.reference, prefer=args.prefer or args.reference, splits=args.splits)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    c["sources"] = {s.partition("=")[0]: s.partition("=")[2] for s in args.variant}
    out = read_json(args.out) or {}
    choices = {**out.get("choices", {}), args.choice: {**c, "env": env_info(), "args": portable_args(args)}}
    write_json_atomic(args.out, {"suite": "dev", "choices": choices})
    md = "# TabICL choices on the development suite\n\n" + "\n".join(markdown(k, v) for k, v in choices.items())
    tmp = args.out.with_suffix(".md.tmp")
    tmp.write_text(md)
    tmp.replace(args.out.with_suffix(".md"))
    print(markdown(args.choice, c))
    return 0


if __name__ == "__main__":
    sys.exit(main())
