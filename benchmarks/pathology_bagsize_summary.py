"""Tables of :mod:`benchmarks.pathology_bagsize`'s records: pooled out-of-fold AUC per (stage, bags, patches per bag,
variant, model), mean over cohort seeds with a 95% t interval, differences to mean pooling and to ABMIL paired by
cohort seed, and the fold diagnostics averaged over folds and seeds."""

from __future__ import annotations

import json
import os

import numpy as np

#: Fold diagnostics averaged in the summary (see :func:`benchmarks.pathology_bagsize.fold_diagnostics`).
DIAGNOSTICS = ("train_auc", "strong_mass", "strong_uniform", "recall", "share", "recall_step", "share_step",
               "planted_seen_step", "separation_embed", "separation_tokens")


def _paired(rs: list[dict], peers: list[dict]) -> tuple[float, float, float, int] | None:
    from benchmarks.pathology_cohort_bench import t_interval

    base = {r["cohort_seed"]: r["pooled_auc"] for r in peers}
    diffs = [r["pooled_auc"] - base[r["cohort_seed"]] for r in rs if r["cohort_seed"] in base]
    return (*t_interval(diffs), len(diffs)) if diffs else None


def summary(records: dict[str, dict], out: str) -> dict:
    """The summary table (also written as JSON to ``out``, atomically)."""
    from benchmarks.pathology_cohort_bench import t_interval

    groups: dict[tuple, list[dict]] = {}
    for r in records.values():
        if r["stage"] == "memo":
            continue
        groups.setdefault((r["stage"], r["n_bags"], r["bag_size"], r["variant"], r["model"], r["folds"]), []).append(r)
    table: dict = {}
    for (stage, n, size, variant, model, folds), rs in sorted(groups.items()):
        rs = sorted(rs, key=lambda r: r["cohort_seed"])
        mean, lo, hi = t_interval([r["pooled_auc"] for r in rs])
        row = {"auc": round(mean, 4), "lo": round(lo, 4), "hi": round(hi, 4), "seeds": [r["cohort_seed"] for r in rs],
               "per_seed": [round(r["pooled_auc"], 3) for r in rs], "cpu_s": round(sum(r["cpu_s"] for r in rs)),
               "best_epochs": [b for r in rs for b in r["best_epochs"]]}
        for d in DIAGNOSTICS:
            vals = [f.get(d) for r in rs for f in r["diagnostics"] if f and f.get(d) is not None]
            if vals:
                row[d] = round(float(np.nanmean(vals)), 4)
        for peer in ("mean", "abmil"):
            if peer == model:
                continue
            prs = groups.get((stage, n, size, variant, peer, folds)) or groups.get((stage, n, size, "auto", peer, folds))
            d = _paired(rs, prs or [])
            if d:
                row[f"minus_{peer}"] = [round(v, 4) for v in d[:3]] + [d[3]]
        table[f"{stage}/n{n}/bag{size}/{variant}/{model}/f{folds}"] = row
    for r in records.values():
        if r["stage"] == "memo":
            table[f"memo/n{r['n_bags']}/bag{r['bag_size']}/s{r['cohort_seed']}/{r['variant']}/{r['model']}"] = {
                k: r[k] for k in ("train_auc", "test_auc", "best_epoch", "cpu_s")} | {
                "train_loss": [round(h["train_loss"], 4) for h in r["history"]],
                "val_auc": [None if h["val_auc"] is None else round(h["val_auc"], 3) for h in r["history"]]}
    with open(out + ".tmp", "w") as f:
        json.dump(table, f, indent=1)
    os.replace(out + ".tmp", out)
    return table


def plot(table: dict, path: str, variants: dict[tuple[str, int], str] | None = None) -> str | None:
    """The report stage's curve: pooled out-of-fold AUC (seed mean, 95% t interval) against patches per bag, one
    panel per cohort size, one line per model. ``variants`` maps (model, patches per bag) to the variant that is the
    model's recipe there (default ``auto``). Written atomically as PNG to ``path``; None when nothing was reported."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from benchmarks.pathology_bagsize import MODELS
    from benchmarks.pathology_cohort_bench import auc_axes

    rows: dict[int, dict[str, list]] = {}
    for key, row in table.items():
        stage, n, size, variant, model, _ = key.split("/")
        n, size = int(n[1:]), int(size[3:])
        if stage != "report" or (variants or {}).get((model, size), "auto") != variant:
            continue
        rows.setdefault(n, {}).setdefault(model, []).append((size, row))
    if not rows:
        return None
    fig, axes = plt.subplots(1, len(rows), figsize=(5.2 * len(rows), 4.0), dpi=110, squeeze=False)
    for ax, n in zip(axes[0], sorted(rows)):
        sizes = sorted({s for pts in rows[n].values() for s, _ in pts})
        for j, m in enumerate(MODELS):
            pts = sorted(rows[n].get(m, []), key=lambda t: t[0])
            if not pts:
                continue
            x = np.array([s for s, _ in pts], float) * (1 + 0.03 * (j - 2))
            y = np.array([r["auc"] for _, r in pts])
            err = np.array([[r["auc"] - r["lo"] for _, r in pts], [r["hi"] - r["auc"] for _, r in pts]])
            seeds = min(len(r["seeds"]) for _, r in pts)
            ax.errorbar(x, y, yerr=np.nan_to_num(err), marker="o", ms=4, capsize=3, lw=1.2, label=f"{m} ({seeds}+ seeds)")
        auc_axes(ax, sizes, "patches per bag (3-fold CV)", f"{n} bags, report cohorts", legend_size=7)
    fig.tight_layout()
    fig.savefig(path + ".tmp", format="png")
    plt.close(fig)
    os.replace(path + ".tmp", path)
    return path
