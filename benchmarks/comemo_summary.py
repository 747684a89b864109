"""Pool CoMemo benchmark runs over training seeds, with paired bootstrap intervals for the issue's checks.

``python -m benchmarks.comemo_summary s11.json s12.json s13.json --out benchmarks/results/comemo_seeds.json``

Each input is a ``benchmarks.comemo_bench`` JSON of one training seed (inputs with the same ``--train-args``,
e.g. one benchmark run per variant, are merged into one seed; a variant twice in one seed is refused),
evaluated on the same evaluation stream
(same ``--eval-seed``, ``--per-count``, image counts and ``--image-grid``; checked), so sample ``i`` at count
``n`` is the same prompt for every variant and seed, and differences are paired by sample. For every variant
and image count: exact-match and digit-only accuracy by third of needle positions (first / middle / last),
pooled over seeds, and the per-seed values. For every variant against ``lvlm-1d`` (the context-only
baseline): the difference per third with a 95% interval from a two-level bootstrap (seeds with replacement,
then samples within each drawn seed with replacement, the same draw for both variants). The issue's targets
are read at the longest count: comemo's middle-third gain >= +0.10 and both end gaps >= -0.02; and, over the
counts beyond the trained image count, lvlm-dhr >= lvlm-1d.

``--merge-only`` writes the inputs' merged benchmark JSON (one seed, the variants of all inputs, the targets of
``benchmarks.comemo_bench`` recomputed) instead of the summary, for runs benchmarked one variant at a time.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from benchmarks.common import format_table, write_json_atomic

logger = logging.getLogger(__name__)

__all__ = ["load_runs", "merge_runs", "summarise", "plot_summary", "build_parser", "main"]

BASELINE = "lvlm-1d"
THIRDS = ("first", "middle", "last")
_SAME = ("eval_seed", "per_count", "images", "image_grid", "max_images")


def load_runs(paths: list[Path]) -> list[dict]:
    """The benchmark JSONs, checked to share one evaluation stream and to carry per-sample records."""
    runs = []
    for p in paths:
        data = json.loads(Path(p).read_text())
        for v, res in data.get("variants", {}).items():
            if "needle_records" not in res:
                raise SystemExit(f"{p}: variant {v} has no needle_records (rerun the benchmark with this version)")
        runs.append(data)
    if not runs:
        raise SystemExit("give at least one benchmark JSON")
    runs, paths = merge_runs(runs, list(paths))
    ref = {k: runs[0]["args"].get(k, "1x1" if k == "image_grid" else None) for k in _SAME}
    for p, r in zip(paths[1:], runs[1:]):
        got = {k: r["args"].get(k, "1x1" if k == "image_grid" else None) for k in _SAME}
        if got != ref:
            raise SystemExit(f"{p}: evaluated with {got}, but {paths[0]} with {ref}: not the same evaluation stream")
    return runs


def merge_runs(runs: list[dict], paths: list) -> tuple[list[dict], list]:
    """Inputs trained with the same ``--train-args`` (one seed, benchmarked one variant at a time) merged into one
    benchmark JSON each, in order of first appearance; returns the merged runs and a path naming each."""
    groups: dict[str, dict] = {}
    names: dict[str, object] = {}
    for p, r in zip(paths, runs):
        key = str(r.get("args", {}).get("train_args"))
        if key not in groups:
            groups[key] = {**r, "args": dict(r.get("args", {})), "variants": dict(r["variants"])}
            names[key] = p
            continue
        g = groups[key]
        ref = {k: g["args"].get(k) for k in _SAME}
        got = {k: r["args"].get(k) for k in _SAME}
        if got != ref:
            raise SystemExit(f"{p}: evaluated with {got}, but {names[key]} with {ref}: not the same evaluation stream")
        for v, res in r["variants"].items():
            if v in g["variants"]:
                raise SystemExit(f"{p}: variant {v} of training seed {key!r} is also in {names[key]}")
            g["variants"][v] = res
        g["args"]["variants"] = list(g["variants"])
        g["args"]["variant_args"] = sorted(set(g["args"].get("variant_args") or []) | set(r["args"].get("variant_args") or []))
    return list(groups.values()), list(names.values())


def _third(pos: int, n: int) -> int:
    return min(2, pos * 3 // n)


def _arrays(runs: list[dict], variant: str, n: str):
    """Per seed: (thirds, full, digit) int arrays of the variant's records at count ``n``."""
    out = []
    for r in runs:
        rec = np.asarray(r["variants"][variant]["needle_records"][n])
        out.append((np.array([_third(int(p), int(n)) for p in rec[:, 0]]), rec[:, 1], rec[:, 2]))
    return out


def _boot_diff(a_runs, b_runs, part: int, col: int, *, reps: int, rng: np.random.Generator) -> list[float] | None:
    """95% two-level bootstrap interval of mean(a) - mean(b) on third ``part`` (col 1: full, 2: digit); None when
    the third holds no sample."""
    S = len(a_runs)
    diffs = []
    per_seed = [(a[col][a[0] == part], b[col][b[0] == part]) for a, b in zip(a_runs, b_runs)]
    for _ in range(reps):
        tot, cnt = 0.0, 0
        for s in rng.integers(0, S, S):
            a, b = per_seed[s]
            if len(a) == 0:
                continue
            idx = rng.integers(0, len(a), len(a))
            tot += float((a[idx] - b[idx]).sum())
            cnt += len(a)
        if cnt:
            diffs.append(tot / cnt)
    if not diffs:  # no needle in this third at this count (e.g. the last third of 2 images)
        return None
    lo, hi = np.percentile(diffs, [2.5, 97.5])
    return [float(lo), float(hi)]


def _mean(x: np.ndarray) -> float | None:
    return float(x.mean()) if len(x) else None


def summarise(runs: list[dict], *, reps: int = 2000, seed: int = 0) -> dict:
    """Pooled accuracies, paired differences against lvlm-1d with intervals, and the targets."""
    rng = np.random.default_rng(seed)
    variants = [v for v in runs[0]["variants"] if all(v in r["variants"] for r in runs)]
    counts = list(runs[0]["variants"][variants[0]]["needle_records"]) if variants else []
    max_images = int(runs[0]["args"]["max_images"])
    out: dict = {"seeds": [r["args"]["train_args"] for r in runs], "n_seeds": len(runs), "max_images": max_images,
                 "variants": {}, "vs_baseline": {}}
    for v in variants:
        res: dict = {}
        for n in counts:
            arrs = _arrays(runs, v, n)
            t = np.concatenate([a[0] for a in arrs])
            full = np.concatenate([a[1] for a in arrs])
            dig = np.concatenate([a[2] for a in arrs])
            res[n] = {"full": float(full.mean()), "digit": float(dig.mean()),
                      "full_by_third": [_mean(full[t == i]) for i in range(3)],
                      "digit_by_third": [_mean(dig[t == i]) for i in range(3)],
                      "full_per_seed": [float(a[1].mean()) for a in arrs],
                      "samples_by_third": [int((t == i).sum()) for i in range(3)]}
        out["variants"][v] = res
    if BASELINE in variants:
        for v in variants:
            if v == BASELINE:
                continue
            cmp: dict = {}
            for n in counts:
                a_runs, b_runs = _arrays(runs, v, n), _arrays(runs, BASELINE, n)
                cell = {}
                for col, name in ((1, "full"), (2, "digit")):
                    va, vb = out["variants"][v][n][f"{name}_by_third"], out["variants"][BASELINE][n][f"{name}_by_third"]
                    cell[name] = [{"diff": None if va[i] is None else va[i] - vb[i], "ci95": _boot_diff(a_runs, b_runs, i, col, reps=reps, rng=rng)}
                                  for i in range(3)]
                cmp[n] = cell
            out["vs_baseline"][v] = cmp
    longest = max(counts, key=int) if counts else None
    targets: dict = {"longest": None if longest is None else int(longest)}
    co = out["vs_baseline"].get("comemo")
    if co is not None and longest is not None:
        for name in ("full", "digit"):
            mid, first, last = co[longest][name][1], co[longest][name][0], co[longest][name][2]
            targets[f"comemo_{name}"] = {
                "middle_gain": mid, "middle_met": mid["diff"] is not None and mid["diff"] >= 0.10,
                "end_gaps": [first, last],
                "ends_met": all(e["diff"] >= -0.02 for e in (first, last) if e["diff"] is not None),
            }
    dhr = out["vs_baseline"].get("lvlm-dhr")
    beyond = [n for n in counts if int(n) > max_images]
    if dhr is not None and beyond:
        a = np.mean([out["variants"]["lvlm-dhr"][n]["full"] for n in beyond])
        b = np.mean([out["variants"][BASELINE][n]["full"] for n in beyond])
        targets["dhr_beyond_training"] = {"counts": [int(n) for n in beyond], "lvlm-dhr": float(a), "lvlm-1d": float(b),
                                          "met": bool(a >= b)}
    out["targets"] = targets
    return out


def tables(summary: dict) -> str:
    """Markdown: accuracy by count (pooled), then differences against lvlm-1d by third at every count."""
    rows = []
    for v, res in summary["variants"].items():
        rows.append({"variant": v, **{f"@{n}": f"{r['full']:.2f} ({r['digit']:.2f})" for n, r in res.items()}})
    text = format_table(rows, list(rows[0])) if rows else ""
    drows = []
    for v, cmp in summary["vs_baseline"].items():
        for n, cell in cmp.items():
            for name in ("full", "digit"):
                drows.append({"variant - lvlm-1d": v, "images": n, "answer": name,
                              **{t: "–" if c["ci95"] is None else f"{c['diff']:+.2f} [{c['ci95'][0]:+.2f}, {c['ci95'][1]:+.2f}]"
                                 for t, c in zip(THIRDS, cell[name])}})
    if drows:
        text += "\n\n" + format_table(drows, list(drows[0]))
    return text


def plot_summary(summary: dict, path: Path) -> Path:
    """PNG: each variant minus lvlm-1d by number of images, one line per third of needle positions with its 95%
    interval shaded; left the full answer, right the digit alone (retrieval)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from core.infra.fileio import atomic_path

    rows = list(summary["vs_baseline"].items())
    if not rows:
        raise ValueError("no variant to compare with lvlm-1d")
    fig, axes = plt.subplots(len(rows), 2, figsize=(9, 2.6 * len(rows)), squeeze=False, sharey=True)
    for (variant, cmp), row in zip(rows, axes):
        counts = sorted(cmp, key=int)
        xs = [int(n) for n in counts]
        for ax, name in zip(row, ("full", "digit")):
            for i, third in enumerate(THIRDS):
                have = [(x, cmp[n][name][i]) for x, n in zip(xs, counts) if cmp[n][name][i]["ci95"] is not None]
                ax.plot([x for x, _ in have], [c["diff"] for _, c in have], marker="o", color=f"C{i}", label=f"{third} third")
                ax.fill_between([x for x, _ in have], [c["ci95"][0] for _, c in have], [c["ci95"][1] for _, c in have],
                                color=f"C{i}", alpha=0.15)
            ax.axhline(0.0, color="k", lw=0.8)
            ax.axhline(0.10, color="grey", lw=0.8, ls="--")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.set_title(f"{variant} - lvlm-1d: {'exact match' if name == 'full' else 'digit only'}", fontsize=9)
        row[0].set_ylabel("accuracy difference")
    axes[0][0].legend(fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel(f"images (trained on <= {summary.get('max_images', '?')}); {summary['n_seeds']} seeds")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=80, format="png")
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.comemo_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("runs", type=Path, nargs="+", help="comemo_bench JSONs, one per training seed")
    p.add_argument("--out", type=Path, required=True, help="summary JSON")
    p.add_argument("--reps", type=int, default=2000, help="bootstrap replicates")
    p.add_argument("--plot", type=Path, help="also write a PNG of the differences against lvlm-1d with intervals (with --merge-only: the "
                        "benchmark's needle and attention curves)")
    p.add_argument("--merge-only", action="store_true",
                   help="write the merged benchmark JSON of one training seed (inputs benchmarked one variant at a "
                        "time) to --out instead of the summary")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runs = load_runs(args.runs)
    if args.merge_only:
        from benchmarks.comemo_bench import issue_targets, majority_baseline

        if len(runs) != 1:
            raise SystemExit(f"--merge-only: the inputs hold {len(runs)} training seeds (different --train-args); "
                             "give the runs of one seed")
        merged = runs[0]
        merged["targets"] = issue_targets(merged["variants"], max_images=int(merged["args"]["max_images"]))
        if "majority_baseline" not in merged:  # inputs written before the benchmark recorded it (tile 32: the default)
            from apps.comemo.train import parse_grid

            a = merged["args"]
            merged["majority_baseline"] = majority_baseline(
                images=a["images"], tasks=a.get("tasks", ["needle"]), per_count=a["per_count"], seed=a["eval_seed"],
                image_grid=parse_grid(a.get("image_grid", "1x1")))
        merged["inputs"] = [str(p) for p in args.runs]
        write_json_atomic(args.out, merged)
        if args.plot is not None and any(v.get("needle_accuracy_by_decile") for v in merged["variants"].values()):
            from benchmarks.comemo_bench import plot_needle_curves

            plot_needle_curves(merged, args.plot)
        logger.info("merged %d inputs (variants %s) into %s", len(args.runs), list(merged["variants"]), args.out)
        return 0
    summary = summarise(runs, reps=args.reps)
    summary["inputs"] = [str(p) for p in args.runs]
    write_json_atomic(args.out, summary)
    print(tables(summary))
    if args.plot is not None and summary["vs_baseline"]:
        plot_summary(summary, args.plot)
    logger.info("targets: %s", json.dumps(summary["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
