"""NCAL benchmark: both datasets × losses × seeds on the official test splits, plus the TF-IDF peer.

``python -m benchmarks.ncal_bench --datasets tmwpl pmtd --losses ce tc cb la focal etf --seeds 0 1 2 3 4``

Each (dataset, loss, seed) run trains :mod:`apps.ncal.train` (default encoder: the character transformer
pretrained here by MLM) into ``--runs/<dataset>_<loss>_<seed>`` (resumable) and writes one record
``--out/runs/<dataset>_<loss>_<seed>.json`` (test accuracy, macro-F1, per-class and per-bin recall, NC1/NC2,
train wall time); a run whose record exists is skipped, so the command can be rerun until everything is done.
Runs go seed by seed, loss by loss, dataset by dataset (``--losses`` order first), so a partial benchmark holds
complete seeds of the first losses.

The classical peer: character 1–3-gram TF-IDF + logistic regression (scikit-learn), with and without
``class_weight="balanced"``; deterministic, one record per dataset.

The summary (``--out/summary.json`` and ``summary.md``) has mean ± std (sample std over seeds) of accuracy,
macro-F1 and head/medium/tail recall per dataset and loss, and the paired comparison of ``tc`` against ``ce``
over the seeds both have: mean difference of macro-F1 with a 95% Student-t interval. The published numbers
(Qwen2.5-7B + LoRA, from the NCAL paper) sit beside ours; their setting differs (a 7B LLM fine-tuned with LoRA,
its published code uses all three dialogue turns for PMTD; ours: a ~1.6M-parameter character transformer
pretrained on these train texts only, PMTD without the next turn).
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import env_info, portable_args, read_json, write_json_atomic
from core.infra.cli import add_run_options, configure_run

logger = logging.getLogger(__name__)

__all__ = ["build_parser", "main", "tfidf_peer", "tfidf_predict", "summarize", "paired_t"]

PUBLISHED = {  # NCAL paper, Qwen2.5-7B + LoRA (accuracy, macro-F1 in %), REFERENCES.md → NCAL
    "tmwpl": {"ce": (61.14, 60.59), "tc": (74.86, 75.58)},
    "pmtd": {"ce": (65.94, 61.46), "tc": (70.31, 67.43)},
}


def tfidf_predict(train_texts: Sequence[str], train_y: Sequence[int], test_texts: Sequence[str], *,
                  balanced: bool) -> list[int]:
    """The classical peer: character 1–3-gram TF-IDF (min_df 2, sublinear tf) + ``LogisticRegression(C=10)``,
    ``class_weight="balanced"`` when ``balanced``; fitted on the train texts, returns the test predictions."""
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression

    vec = TfidfVectorizer(analyzer="char", ngram_range=(1, 3), sublinear_tf=True, min_df=2)
    X = vec.fit_transform(list(train_texts))
    clf = LogisticRegression(C=10.0, max_iter=2000, class_weight="balanced" if balanced else None)
    clf.fit(X, list(train_y))
    return clf.predict(vec.transform(list(test_texts))).tolist()


def tfidf_peer(dataset: str, *, balanced: bool, context: str = "past") -> dict:
    """:func:`tfidf_predict` on the shipped train split, scored on its test split."""
    from apps.ncal.data import load_split, longtail_bins
    from apps.ncal.metrics import classification_metrics

    tr, classes = load_split(dataset, "train", context=context)
    te, _ = load_split(dataset, "test", context=context)
    idx = {c: k for k, c in enumerate(classes)}
    t0 = time.time()
    pred = tfidf_predict([e.text for e in tr], [idx[e.label] for e in tr], [e.text for e in te], balanced=balanced)
    m = classification_metrics([idx[e.label] for e in te], pred, list(classes),
                               longtail_bins([e.label for e in tr], classes))
    m["wall_s"] = round(time.time() - t0, 1)
    return m


def paired_t(diffs: list[float]) -> tuple[float, float, float] | None:
    """(mean, low, high) of a 95% Student-t interval of the mean of paired differences; None under 2 pairs."""
    n = len(diffs)
    if n < 2:
        return None
    from scipy import stats

    mean = statistics.fmean(diffs)
    half = stats.t.ppf(0.975, n - 1) * statistics.stdev(diffs) / math.sqrt(n)
    return mean, mean - half, mean + half


def _mean_std(vals: list[float]) -> tuple[float, float]:
    return statistics.fmean(vals), (statistics.stdev(vals) if len(vals) > 1 else 0.0)


def summarize(records: list[dict]) -> dict:
    """Per (dataset, method, epochs): n seeds, mean ± std of the metrics; tc − ce paired differences.

    Runs trained for different numbers of epochs are separate rows and are never paired (records without
    ``epochs``, such as the TF-IDF peer's, form their own group)."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["dataset"], r["method"], r.get("epochs") or 0), []).append(r)
    rows = []
    for (ds, method, epochs), rs in sorted(groups.items()):
        row = {"dataset": ds, "method": method, "epochs": epochs or None, "seeds": len(rs),
               "seed_list": sorted(r["seed"] for r in rs)}
        for k in ("accuracy", "macro_f1", "recall_head", "recall_medium", "recall_tail", "nc_nc1", "nc_nc2", "wall_s"):
            vals = [r[k] for r in rs if r.get(k) is not None]
            if vals:
                m, s = _mean_std(vals)
                row[k], row[k + "_std"] = m, s
        rows.append(row)
    paired = {}
    for ds in sorted({r["dataset"] for r in records}):
        by = {(r["method"], r["seed"], r.get("epochs") or 0): r for r in records if r["dataset"] == ds}
        pairs = sorted((s, e) for (m, s, e) in by if m == "tc" and ("ce", s, e) in by)
        seeds = [s for s, _ in pairs]
        diffs = [100 * (by[("tc", s, e)]["macro_f1"] - by[("ce", s, e)]["macro_f1"]) for s, e in pairs]
        ci = paired_t(diffs)
        paired[ds] = {"seeds": seeds, "diff_macro_f1_points": diffs,
                      "mean": ci[0] if ci else (diffs[0] if diffs else None),
                      "ci95": [ci[1], ci[2]] if ci else None}
    return {"rows": rows, "paired_tc_minus_ce": paired}


def _pm(row: dict, k: str) -> str:
    if k not in row:
        return "–"
    return f"{100 * row[k]:.1f} ± {100 * row[k + '_std']:.1f}" if row["seeds"] > 1 else f"{100 * row[k]:.1f}"


def summary_markdown(summary: dict) -> str:
    lines = ["| dataset | method | epochs | seeds | accuracy | macro-F1 | head recall | medium recall | tail recall | test NC1 | test NC2 | train s/run |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["rows"]:
        nc1 = f"{r['nc_nc1']:.2f}" if "nc_nc1" in r else "–"
        nc2 = f"{r['nc_nc2']:.2f}" if "nc_nc2" in r else "–"
        wall = f"{r['wall_s']:.0f}" if "wall_s" in r else "–"
        ep = r["epochs"] if r.get("epochs") else "–"
        lines.append(f"| {r['dataset']} | {r['method']} | {ep} | {r['seeds']} | {_pm(r, 'accuracy')} | {_pm(r, 'macro_f1')} | "
                     f"{_pm(r, 'recall_head')} | {_pm(r, 'recall_medium')} | {_pm(r, 'recall_tail')} | {nc1} | {nc2} | {wall} |")
    for ds, pub in PUBLISHED.items():
        for m, (acc, f1) in pub.items():
            lines.append(f"| {ds} | published {m} (Qwen2.5-7B + LoRA) | – | – | {acc:.2f} | {f1:.2f} | – | – | – | – | – | – |")
    lines.append("")
    lines.append("Paired tc − ce, macro-F1 points (95% t interval over seeds):")
    for ds, p in summary["paired_tc_minus_ce"].items():
        if p["mean"] is None:
            lines.append(f"- {ds}: no seed with both")
        elif p["ci95"] is None:
            lines.append(f"- {ds}: {p['mean']:+.2f} (one seed, no interval)")
        else:
            lines.append(f"- {ds}: {p['mean']:+.2f} [{p['ci95'][0]:+.2f}, {p['ci95'][1]:+.2f}] over seeds {p['seeds']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ncal_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--datasets", nargs="+", default=["tmwpl", "pmtd"])
    p.add_argument("--losses", nargs="*", default=["ce", "tc", "cb", "la", "focal", "etf"])
    p.add_argument("--seeds", nargs="*", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--epochs", type=int, default=3, help="training epochs of every run (the published table: 3)")
    p.add_argument("--encoder", default="default", help="as apps.ncal.train --encoder")
    p.add_argument("--runs", default="runs/ncal_bench", help="run folders (checkpoints)")
    p.add_argument("--out", default="benchmarks/results/ncal", help="records and summary")
    p.add_argument("--context", default="past", choices=("past", "window", "none"),
                   help="PMTD context; records of a non-default context carry it in their method name (e.g. ce@window)")
    p.add_argument("--no-peer", action="store_true", help="skip the TF-IDF peer")
    p.add_argument("--summary-only", action="store_true", help="only rebuild the summary from the records")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new run after this many minutes")
    add_run_options(p)
    return p


def main(argv: Sequence[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    configure_run(args)
    out = Path(args.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    suffix = "" if args.context == "past" else f"@{args.context}"
    if not args.summary_only:
        if not args.no_peer:
            for ds in args.datasets:
                for balanced in (False, True):
                    name = f"tfidf_lr{'_balanced' if balanced else ''}" + suffix
                    rec_path = out / "runs" / f"{ds}_{name}.json"
                    if rec_path.exists():
                        continue
                    m = tfidf_peer(ds, balanced=balanced, context=args.context)
                    write_json_atomic(rec_path, {"dataset": ds, "method": name, "seed": 0, **m})
                    logger.info("%s %s: macro-F1 %.4f", ds, name, m["macro_f1"])
        from apps.ncal.train import TrainConfig, train

        for seed in args.seeds:
            for loss in args.losses:
                for ds in args.datasets:
                    rec_path = out / "runs" / f"{ds}_{loss}{suffix}_{seed}.json"
                    if rec_path.exists():
                        continue
                    if args.max_minutes is not None and time.time() - t_start > args.max_minutes * 60:
                        logger.info("time limit reached; stopping before %s", rec_path.name)
                        break
                    cfg = TrainConfig(dataset=ds, loss=loss, seed=seed, epochs=args.epochs, encoder=args.encoder,
                                      context=args.context, out=str(Path(args.runs) / f"{ds}_{loss}{suffix}_{seed}"))
                    meta = train(cfg)
                    t = meta["test"]
                    rec = {"dataset": ds, "method": loss + suffix, "seed": seed, "context": args.context, "epochs": args.epochs, "encoder": args.encoder,
                           "wall_s": meta["train_wall_s"], **{k: v for k, v in t.items()}}
                    write_json_atomic(rec_path, rec)
                    logger.info("%s %s seed %d: accuracy %.4f macro-F1 %.4f", ds, loss, seed, t["accuracy"], t["macro_f1"])
    records = [read_json(p) for p in sorted((out / "runs").glob("*.json"))]
    summary = summarize(records)
    summary["args"] = portable_args(args)
    summary["env"] = env_info()
    write_json_atomic(out / "summary.json", summary)
    md = summary_markdown(summary)
    (out / "summary.md").write_text(md + "\n", encoding="utf-8")
    print(md)  # the CLI's table
    return summary


if __name__ == "__main__":
    main()
