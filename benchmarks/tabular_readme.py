"""The per-table and aggregate tables of the tabular experiment log (``docs/experiments/tabular.md``, where the
README's former results tables now live) from ``benchmarks.tabular_bench`` result JSONs, so that every number there
is one a command wrote (nothing is typed by hand).

- ``per-table``: one row per table of a result JSON: size, majority rate, TabICL, HistGradientBoosting,
  LogisticRegression, the best peer among every model of that JSON that finished the table (all its splits; ties: the model
  listed first), and
  whether TabICL is at or above each of the two target peers. ``†``: a model predicted a single class in at least
  one split.
- ``aggregate``: the JSON's aggregates (over its complete tables), one row per model, sorted by mean rank.

    python -m benchmarks.tabular_readme per-table benchmarks/results/tabular_bench_reserved.json
    python -m benchmarks.tabular_readme aggregate benchmarks/results/tabular_bench_reserved_all11.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.common import read_json

MODEL = "TabICL"
TARGET_PEERS = ("HistGradientBoosting", "LogisticRegression")


def _load(path: Path) -> dict:
    data = read_json(path)
    if not data or "per_table" not in data or "aggregates" not in data:
        raise SystemExit(f"error: {path} is not a benchmarks.tabular_bench result JSON (needs 'per_table' and "
                         f"'aggregates')")
    return data


def _cell(row: dict | None) -> str:
    if row is None:
        return "–"
    return f"{row['accuracy']:.3f}" + ("†" if row.get("single_class_splits") else "")


def per_table(data: dict) -> str:
    """Markdown: TabICL against the target peers and the best peer, table by table (every table of ``data``)."""
    splits = int(data["args"]["splits"])
    rows: dict[str, dict[str, dict]] = {}
    for r in data["per_table"]:
        if int(r.get("splits", 0)) == splits:  # finished every split
            rows.setdefault(r["table"], {})[r["model"]] = r
    head = ["table", "rows", "features", "classes", "majority", MODEL, *TARGET_PEERS, "best peer",
            *(f"{MODEL} ≥ {'HGB' if p == 'HistGradientBoosting' else 'LR'}" for p in TARGET_PEERS)]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in data["tables"]:
        got = rows.get(t["name"], {})
        peers = [(m, got[m]) for m in data["models"] if m != MODEL and m in got]  # ties: the earlier model
        best = max(peers, key=lambda kv: kv[1]["accuracy"]) if peers else None
        mine = got.get(MODEL)

        def at_least(peer: str) -> str:
            if mine is None or peer not in got:
                return "–"
            return "yes" if mine["accuracy"] >= got[peer]["accuracy"] else "**no**"

        out.append("| " + " | ".join([
            t["name"], f"{t['rows']:,}", str(t["features"]), str(t["classes"]),
            f"{t.get('test_majority_rate', t['majority_rate']):.3f}",
            _cell(mine), *(_cell(got.get(p)) for p in TARGET_PEERS),
            f"{best[0]} {_cell(best[1])}" if best else "–",
            *(at_least(p) for p in TARGET_PEERS)]) + " |")
    return "\n".join(out)


def aggregate(data: dict) -> str:
    """Markdown: one row per model of ``data``'s aggregates (its complete tables), sorted by mean rank."""
    head = ["model", "mean accuracy", "balanced acc.", "ROC-AUC", "log-loss", "mean rank", "normalized acc.",
            "single-class tables"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, a in sorted(data["aggregates"].items(), key=lambda kv: kv[1]["mean_rank"]):
        out.append("| " + " | ".join([
            f"**{name}**" if name == MODEL else name, f"{a['mean_accuracy']:.3f}",
            f"{a['mean_balanced_accuracy']:.3f}", f"{a['mean_roc_auc']:.3f}", f"{a['mean_log_loss']:.3f}",
            f"{a['mean_rank']:.2f}", f"{a['normalized_accuracy']:.3f}", str(len(a["single_class_tables"]))]) + " |")
    tables = data.get("complete_tables", [])
    out.append(f"\n({len(tables)} table{'s' if len(tables) != 1 else ''}: {', '.join(f'`{t}`' for t in tables)})")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("per-table", "aggregate"))
    p.add_argument("result", type=Path, help="a benchmarks.tabular_bench result JSON")
    args = p.parse_args(argv)
    data = _load(args.result)
    print(per_table(data) if args.kind == "per-table" else aggregate(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
