"""EMLoC against the KV-compression baselines on held-out many-shot image classification.

For every number of demonstrations ``K`` (``--demos``), seed (``--seeds``) and episode (``--episodes``; classes
and label mappings never seen in meta-training, :func:`apps.emloc.data.make_episode` with ``split="eval"``):

* full context: accuracy on ``--queries`` query images, prefill time, KV-cache size;
* EMLoC at ``--delta``: accuracy, fraction of cache entries kept, per-layer keep ratio and JS divergence
  (mean over chunks), compression time;
* every budgeted policy of :data:`core.kv_compress.POLICIES` at each keep fraction of ``--keep`` and at
  EMLoC's own fraction in that episode (equal budget).

Memory is the KV-cache size: kept (layer, KV head, token) entries × 2 (K and V) × head_dim × 4 bytes
(fp32); "demos in fixed memory" divides the full cache of ``--memory-demos`` demonstrations by a policy's
bytes per demonstration (its kept fraction), i.e. it is derived from the measured fractions, not run.
Times are wall-clock on this machine and only comparable within one run (ratios to the full prefill).

Peak prefill memory (``--peak-memory``): for every ``K`` of ``--memory-grid`` and the policies full, EMLoC,
SnapKV, H2O and StreamingLLM (the budgeted ones at ``--memory-keep``), one episode is compressed in a fresh
process and its peak resident-set growth measured (:class:`benchmarks.common.PeakRSS`, from after the host
and the demonstrations exist to the end of compression); "demos within fixed memory (measured)" is the
largest ``K`` of the grid whose peak stays within the full context's peak at ``--memory-demos``.

Rows are appended to ``--out``'s ``.rows.jsonl`` as they finish, each naming the host (weights fingerprint)
and the settings that shape it; a rerun skips rows already there (resumable) and refuses a rows file made
with another host or other settings unless ``--overwrite`` starts it afresh. The summary (mean and std over seeds of the per-seed mean over episodes) is written to ``--out``
atomically and printed as a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import torch

from apps.emloc.api import compress
from apps.emloc.data import EpisodeConfig, make_episode
from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost
from benchmarks.common import PeakRSS, portable_args, run_isolated
from core.infra.cli import nonnegative_int, open_fraction, positive_float, positive_int, run_cli
from core.infra.fileio import write_json_atomic
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

BASELINES = ("random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv")


def _acc(ctx, ep) -> float:
    return float((ctx.predict(ep.query_images) == ep.query_labels).float().mean())


def _cache_bytes(ctx) -> int:
    hd = ctx.model.config.dim // ctx.model.config.num_heads
    return int(sum(float(c.sum()) for c in ctx.cache.kept_counts()) * 2 * hd * 4)


def run_episode(model: EMLoCHost, K: int, seed: int, e: int, args, run_id: dict) -> list[dict]:
    """All rows of one episode (each tagged with ``run_id``, see :func:`run_key`)."""
    ep = make_episode(seed * 100_003 + e + 7_000_000, num_demos=K, num_queries=args.queries, split="eval",
                      config=EpisodeConfig(n_way=args.n_way))
    demos = (ep.demo_images, ep.demo_labels)
    base = {"K": K, "seed": seed, "episode": e, "run": run_id}
    rows = []
    t = time.perf_counter()
    full = compress(model, demos, policy="full")
    t_full = time.perf_counter() - t
    full_acc = _acc(full, ep)
    rows.append({**base, "policy": "full", "keep": 1.0, "fraction": 1.0, "acc": full_acc, "seconds": t_full,
                 "cache_bytes": _cache_bytes(full)})
    t = time.perf_counter()
    em = compress(model, demos, policy="emloc", delta=args.delta, chunk_demos=args.chunk_demos, always_keep=args.always_keep)
    t_em = time.perf_counter() - t
    L = model.config.depth
    js = [statistics.fmean(r.js[i] for r in em.reports) for i in range(L)]
    ratios = [statistics.fmean(r.ratios[i] for r in em.reports) for i in range(L)]
    f_em = em.keep_fraction()
    rows.append({**base, "policy": "emloc", "keep": None, "fraction": f_em, "acc": _acc(em, ep), "seconds": t_em,
                 "cache_bytes": _cache_bytes(em), "js_per_layer": js, "ratio_per_layer": ratios,
                 "keep_per_layer": em.keep_ratios(), "full_acc": full_acc})
    for policy in args.baselines:
        for keep in [*args.keep, round(f_em, 4)]:
            try:
                t = time.perf_counter()
                ctx = compress(model, demos, policy=policy, keep=keep, seed=seed * 1000 + e)
                dt = time.perf_counter() - t
            except ValueError as err:  # e.g. fastv below the text tokens, a zero budget
                rows.append({**base, "policy": policy, "keep": keep, "error": str(err)})
                continue
            rows.append({**base, "policy": policy, "keep": keep, "equal_to_emloc": keep == round(f_em, 4),
                         "fraction": ctx.keep_fraction(), "acc": _acc(ctx, ep), "seconds": dt,
                         "cache_bytes": _cache_bytes(ctx)})
    return rows


ROW_SETTINGS = ("n_way", "queries", "delta", "chunk_demos", "always_keep", "keep", "baselines")


def run_key(fingerprint: str, args) -> dict:
    """What a row depends on besides (K, seed, episode): the host's fingerprint and the row-shaping settings."""
    return {"host": fingerprint, **{k: getattr(args, k) for k in ROW_SETTINGS}}


PROBE_SETTINGS = ("n_way", "delta", "chunk_demos", "always_keep", "memory_keep")


def probe_key(fingerprint: str, args) -> dict:
    """What a memory probe depends on: the host and the compression settings."""
    return {"host": fingerprint, **{k: getattr(args, k) for k in PROBE_SETTINGS}}


def probe_memory(model: EMLoCHost, K: int, policy: str, args) -> dict:
    """Peak RSS growth and wall time of compressing one K-demo episode with ``policy`` (run in a fresh process)."""
    ep = make_episode(7_000_000, num_demos=K, num_queries=1, split="eval", config=EpisodeConfig(n_way=args.n_way))
    demos = (ep.demo_images, ep.demo_labels)
    opts = {"delta": args.delta, "chunk_demos": args.chunk_demos, "always_keep": args.always_keep} if policy == "emloc" else {}
    if policy not in ("emloc", "full"):
        opts["keep"] = args.memory_keep
    torch.set_num_threads(1)
    warm = make_episode(7_000_001, num_demos=min(K, 2 * args.chunk_demos), num_queries=1, split="eval",
                        config=EpisodeConfig(n_way=args.n_way))
    compress(model, (warm.demo_images, warm.demo_labels), policy=policy, **opts)  # first-call costs (lazy imports, kernels) stay out of the peak
    peak = PeakRSS()
    peak.start()
    t = time.perf_counter()
    ctx = compress(model, demos, policy=policy, **opts)
    seconds = time.perf_counter() - t
    return {"K": K, "policy": policy, "peak_mb": peak.peak_mb(), "method": peak.method, "seconds": seconds,
            "fraction": ctx.keep_fraction(), "cache_mb": _cache_bytes(ctx) / 2**20}


MEMORY_POLICIES = ("full", "emloc", "snapkv", "h2o", "streaming")


def run_memory(args, settings: dict) -> dict:
    """Every (K, policy) of the memory grid in its own process; the measured demos-within-memory table."""
    import sys

    from tqdm import tqdm

    rows = []
    for K in tqdm(args.memory_grid, desc="peak memory"):
        for policy in MEMORY_POLICIES:
            argv = [sys.executable, "-m", "benchmarks.emloc_bench", "--model", str(args.model), "--probe", f"{K}:{policy}",
                    "--n-way", str(args.n_way), "--delta", str(args.delta), "--chunk-demos", str(args.chunk_demos),
                    "--always-keep", args.always_keep, "--memory-keep", str(args.memory_keep)]
            r = run_isolated(argv, timeout_s=1800, env={"OMP_NUM_THREADS": "1"})
            rows.append({"K": K, "policy": policy, **r})
    return memory_table(rows, args, settings)


def memory_table(rows: list[dict], args, settings: dict) -> dict:
    """The demos-within-memory table from the probe rows: budget = full context's peak at ``--memory-demos``."""
    ok = {(r["K"], r["policy"]): r for r in rows if "peak_mb" in r}
    budget = ok.get((args.memory_demos, "full"), {}).get("peak_mb")
    within = {}
    if budget is not None:
        for policy in MEMORY_POLICIES:
            fits = [K for (K, pol), r in ok.items() if pol == policy and r["peak_mb"] <= budget]
            within[policy] = max(fits) if fits else None
    return {"settings": settings, "rows": rows, "budget": {"K": args.memory_demos, "policy": "full", "peak_mb": budget},
            "max_demos_within_budget": within, "keep": args.memory_keep, "grid": sorted({r["K"] for r in rows})}


def _paired(rows: list[dict], K: int, a: tuple, b: tuple, draws: int = 10_000) -> dict | None:
    """Mean of the per-episode accuracy difference a − b (points) with a 95% percentile bootstrap interval over
    episodes (all seeds pooled; seed 0 of the resampler). ``a``/``b`` are (policy, equal-to-EMLoC-budget or None)."""
    import numpy as np

    def pick(pol, eq):
        return {(r["seed"], r["episode"]): r["acc"] for r in rows if r["K"] == K and r["policy"] == pol and "error" not in r
                and (eq is None or bool(r.get("equal_to_emloc")) == eq)}

    A, B = pick(*a), pick(*b)
    keys = sorted(A.keys() & B.keys())
    if not keys:
        return None
    d = 100 * np.array([A[k] - B[k] for k in keys])
    rng = np.random.default_rng(0)
    boots = d[rng.integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    return {"mean": float(d.mean()), "ci95": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))], "episodes": len(d)}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(rows: list[dict], args) -> dict:
    """Mean/std over seeds of per-seed episode means, per (K, policy, keep); EMLoC's equal-budget comparison."""
    groups: dict[tuple, dict[int, list[dict]]] = {}
    for r in rows:
        if "error" in r:
            continue
        key = (r["K"], r["policy"], "emloc-budget" if r.get("equal_to_emloc") else r["keep"])
        groups.setdefault(key, {}).setdefault(r["seed"], []).append(r)
    table = []
    for (K, policy, keep), by_seed in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], str(kv[0][2]))):
        per_seed = {s: {k: statistics.fmean(r[k] for r in rs) for k in ("acc", "fraction", "seconds", "cache_bytes")}
                    for s, rs in by_seed.items()}
        row = {"K": K, "policy": policy, "keep": keep, "seeds": len(per_seed), "episodes": sum(len(v) for v in by_seed.values())}
        for k in ("acc", "fraction", "seconds", "cache_bytes"):
            row[k], row[k + "_std"] = _mean_std([v[k] for v in per_seed.values()])
        if policy == "emloc":
            L = len(by_seed[next(iter(by_seed))][0]["js_per_layer"])
            for name in ("js_per_layer", "ratio_per_layer", "keep_per_layer"):
                row[name] = [statistics.fmean(r[name][i] for rs in by_seed.values() for r in rs) for i in range(L)]
        table.append(row)
    full = {(r["K"]): r for r in table if r["policy"] == "full"}
    verdicts = []
    for r in table:
        if r["policy"] != "emloc":
            continue
        K = r["K"]
        eq = {t["policy"]: t["acc"] for t in table if t["K"] == K and t["keep"] == "emloc-budget"}
        verdicts.append({
            "K": K, "chance": 1.0 / args.n_way, "emloc_fraction": r["fraction"], "emloc_acc": r["acc"], "full_acc": full[K]["acc"],
            "points_lost": 100 * (full[K]["acc"] - r["acc"]),
            "points_above_snapkv": 100 * (r["acc"] - eq["snapkv"]) if "snapkv" in eq else None,
            "points_above_h2o": 100 * (r["acc"] - eq["h2o"]) if "h2o" in eq else None,
            "paired_emloc_minus_full": _paired(rows, K, ("emloc", None), ("full", None)),
            "paired_emloc_minus_snapkv": _paired(rows, K, ("emloc", None), ("snapkv", True)),
            "paired_emloc_minus_h2o": _paired(rows, K, ("emloc", None), ("h2o", True)),
            "prefill_seconds_ratio_to_full": r["seconds"] / full[K]["seconds"],
            "target_keep_le_25pct_and_le_1pt_lost": r["fraction"] <= 0.25 and 100 * (full[K]["acc"] - r["acc"]) <= 1.0,
            # the comparison only means something when the host learns in context (full context above chance)
            "full_context_above_chance_by_10pts": full[K]["acc"] >= 1.0 / args.n_way + 0.10,
        })
    mem = []
    Km = args.memory_demos
    if Km in full:
        budget = full[Km]["cache_bytes"]
        per_demo_full = budget / Km
        for r in table:
            if r["K"] == Km and r["fraction"] > 0:
                mem.append({"policy": r["policy"], "keep": r["keep"], "fraction": r["fraction"],
                            "max_demos_in_memory": int(budget // (per_demo_full * r["fraction"]))})
    return {"table": table, "targets": verdicts, "demos_within_memory_of_full_at": {"K": Km, "rows": mem}}


def plot_curves(summaries: list[dict], path: Path) -> Path:
    """Accuracy against fraction of cache kept, one panel per K: every budgeted policy's curve over its keep
    fractions, the full context, and EMLoC at each summary's δ (with std over seeds as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = summaries[0]
    Ks = sorted({r["K"] for r in base["table"]})
    fig, axes = plt.subplots(1, len(Ks), figsize=(4.0 * len(Ks), 3.6), sharey=True, squeeze=False)
    colours = dict(zip(BASELINES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for ax, K in zip(axes[0], Ks):
        rows = [r for r in base["table"] if r["K"] == K]
        for policy in BASELINES:
            pts = sorted((r["fraction"], r["acc"], r["acc_std"]) for r in rows if r["policy"] == policy and r["keep"] != "emloc-budget")
            if pts:
                f, a, e = zip(*pts)
                ax.errorbar(f, a, yerr=e, marker="o", ms=3, lw=1, capsize=2, label=policy, color=colours[policy])
        full = next(r for r in rows if r["policy"] == "full")
        ax.axhline(full["acc"], color="k", lw=1, ls="--", label="full context")
        for s, mk in zip(summaries, "*Dsv"):
            em = [r for r in s["table"] if r["K"] == K and r["policy"] == "emloc"]
            if em:
                ax.errorbar([em[0]["fraction"]], [em[0]["acc"]], yerr=[em[0]["acc_std"]], marker=mk, ms=10, color="k",
                            ls="none", capsize=2, label=f"EMLoC δ={s['settings']['delta']:g}")
        ax.set_xscale("log")
        ax.set_xticks([0.05, 0.1, 0.25, 0.5, 1.0], ["5%", "10%", "25%", "50%", "100%"])
        ax.minorticks_off()
        ax.set_xlabel("fraction of cache entries kept")
        ax.set_title(f"{K} demonstrations")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"accuracy ({base['settings']['n_way']}-way, held-out classes)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _list(kind):
    """An argparse type: a comma-separated list of ``kind`` values."""
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",")]

    parse.__name__ = f"list of {kind.__name__}"
    return parse


def _baselines(text: str) -> list[str]:
    names = [x for x in text.split(",") if x]
    bad = [x for x in names if x not in BASELINES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown policies {bad}; choose from {','.join(BASELINES)}")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.emloc_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_WEIGHTS, help="host weights (EMLoCHost safetensors); default: the shipped host")
    p.add_argument("--demos", type=_list(positive_int), default=[16, 64, 256])
    p.add_argument("--keep", type=_list(open_fraction), default=[0.05, 0.1, 0.25, 0.5])
    p.add_argument("--seeds", type=_list(nonnegative_int), default=[0, 1])
    p.add_argument("--episodes", type=positive_int, default=5)
    p.add_argument("--baselines", type=_baselines, default=list(BASELINES),
                   help=f"comma list of budgeted policies to compare (default all: {','.join(BASELINES)}); '' for none")
    p.add_argument("--queries", type=positive_int, default=20)
    p.add_argument("--n-way", type=positive_int, default=5)
    p.add_argument("--delta", type=positive_float, default=0.005,
                   help="EMLoC's JS bound per chunk (nats); 0.005 keeps 29-62%% of the cache on the shipped host")
    p.add_argument("--chunk-demos", type=positive_int, default=16)
    p.add_argument("--always-keep", choices=("label", "answer", "both"), default="label", help="EMLoC's always-kept tokens (apps.emloc.compress)")
    p.add_argument("--memory-demos", type=positive_int, default=512, help="K whose full context (cache, peak prefill memory) is the fixed memory")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/emloc_bench.json"))
    p.add_argument("--overwrite", action="store_true", help="discard a rows file made with another host or settings")
    p.add_argument("--peak-memory", action="store_true", help="also measure peak prefill memory per K and policy (fresh processes)")
    p.add_argument("--memory-grid", type=_list(positive_int), default=[64, 128, 256, 512, 1024, 2048])
    p.add_argument("--memory-keep", type=open_fraction, default=0.25, help="keep fraction of the budgeted policies in the memory probe")
    p.add_argument("--skip-accuracy", action="store_true", help="only the peak-memory probe (with --peak-memory)")
    p.add_argument("--plot-from", type=Path, nargs="+", default=None,
                   help="only draw accuracy-vs-kept curves from these summaries (first: baselines; each adds its EMLoC point) to --plot")
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/emloc_bench_curves.png"))
    p.add_argument("--probe", default=None, help=argparse.SUPPRESS)  # K:policy, internal: one memory probe, JSON on stdout
    return p


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.model])
    if args.plot_from:
        print(plot_curves([json.loads(p.read_text()) for p in args.plot_from], args.plot))
        return 0
    model = EMLoCHost.load(args.model)
    fingerprint = model.fingerprint()
    if args.probe is not None:
        K, policy = args.probe.split(":")
        print(json.dumps(probe_memory(model, int(K), policy, args)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.skip_accuracy:
        if not args.peak_memory:
            raise SystemExit("--skip-accuracy needs --peak-memory")
        summary = json.loads(args.out.read_text()) if args.out.exists() else {}
        summary["peak_memory"] = run_memory(args, probe_key(fingerprint, args))
        write_json_atomic(args.out, summary)
        print(json.dumps(summary["peak_memory"]["max_demos_within_budget"]))
        return 0
    rows_path = args.out.with_suffix(".rows.jsonl")
    rows = [json.loads(l) for l in rows_path.read_text().splitlines() if l.strip()] if rows_path.exists() else []
    run_id = run_key(fingerprint, args)
    stale = [r for r in rows if r.get("run") != run_id]
    if stale:
        if not args.overwrite:
            theirs = stale[0].get("run") or "none recorded (an older file)"
            raise SystemExit(f"{rows_path} holds {len(stale)} rows made with another host or settings ({theirs}; this run: "
                             f"{run_id}); pass --overwrite to start it afresh, or another --out")
        logger.warning("--overwrite: discarding %d rows of %s", len(rows), rows_path)
        rows_path.unlink()
        rows = []
    done = {(r["K"], r["seed"], r["episode"]) for r in rows}
    todo = [(K, s, e) for K in args.demos for s in args.seeds for e in range(args.episodes) if (K, s, e) not in done]
    with open(rows_path, "a") as f:
        for K, s, e in tqdm(todo, desc="episodes"):
            new = run_episode(model, K, s, e, args, run_id)
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.flush()
            rows.extend(new)
    rows = [r for r in rows if r["K"] in args.demos and r["seed"] in args.seeds and r["episode"] < args.episodes]
    seen, unique = set(), []
    for r in rows:  # an episode finished by two overlapping runs counts once
        key = (r["K"], r["seed"], r["episode"], r["policy"], r.get("keep"), r.get("equal_to_emloc"))
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rows = unique
    summary = summarize(rows, args)
    summary["settings"] = portable_args(args)
    summary["host_fingerprint"] = fingerprint
    probe = probe_key(fingerprint, args)
    if args.peak_memory:
        summary["peak_memory"] = run_memory(args, probe)
    else:  # keep an earlier probe made with the same host and settings, its budget table recomputed for --memory-demos
        old = json.loads(args.out.read_text()) if args.out.exists() else {}
        if old.get("peak_memory", {}).get("settings") == probe:
            summary["peak_memory"] = memory_table(old["peak_memory"]["rows"], args, probe)
    write_json_atomic(args.out, summary)
    print(f"{'K':>4} {'policy':>10} {'keep':>13} {'kept':>6} {'acc':>13} {'sec':>8}")
    for r in summary["table"]:
        print(f"{r['K']:>4} {r['policy']:>10} {str(r['keep']):>13} {r['fraction']:6.3f} {r['acc']:6.3f}±{r['acc_std']:.3f} {r['seconds']:8.3f}")
    for v in summary["targets"]:
        print(json.dumps(v))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
