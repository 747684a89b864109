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

Rows are appended to ``--out``'s ``.rows.jsonl`` as they finish; a rerun skips rows already there
(resumable). The summary (mean and std over seeds of the per-seed mean over episodes) is written to ``--out``
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
from apps.emloc.model import EMLoCHost
from benchmarks.common import portable_args
from core.fileio import write_json_atomic

logger = logging.getLogger(__name__)

BASELINES = ("random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv")


def _acc(ctx, ep) -> float:
    return float((ctx.predict(ep.query_images) == ep.query_labels).float().mean())


def _cache_bytes(ctx) -> int:
    hd = ctx.model.config.dim // ctx.model.config.num_heads
    return int(sum(float(c.sum()) for c in ctx.cache.kept_counts()) * 2 * hd * 4)


def run_episode(model: EMLoCHost, K: int, seed: int, e: int, args) -> list[dict]:
    """All rows of one episode."""
    ep = make_episode(seed * 100_003 + e + 7_000_000, num_demos=K, num_queries=args.queries, split="eval",
                      config=EpisodeConfig(n_way=args.n_way))
    demos = (ep.demo_images, ep.demo_labels)
    base = {"K": K, "seed": seed, "episode": e}
    rows = []
    t = time.perf_counter()
    full = compress(model, demos, policy="full")
    t_full = time.perf_counter() - t
    full_acc = _acc(full, ep)
    rows.append({**base, "policy": "full", "keep": 1.0, "fraction": 1.0, "acc": full_acc, "seconds": t_full,
                 "cache_bytes": _cache_bytes(full)})
    t = time.perf_counter()
    em = compress(model, demos, policy="emloc", delta=args.delta, chunk_demos=args.chunk_demos)
    t_em = time.perf_counter() - t
    L = model.config.depth
    js = [statistics.fmean(r.js[i] for r in em.reports) for i in range(L)]
    ratios = [statistics.fmean(r.ratios[i] for r in em.reports) for i in range(L)]
    f_em = em.keep_fraction()
    rows.append({**base, "policy": "emloc", "keep": None, "fraction": f_em, "acc": _acc(em, ep), "seconds": t_em,
                 "cache_bytes": _cache_bytes(em), "js_per_layer": js, "ratio_per_layer": ratios,
                 "keep_per_layer": em.keep_ratios(), "full_acc": full_acc})
    for policy in BASELINES:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.emloc_bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="host weights (EMLoCHost safetensors)")
    p.add_argument("--demos", type=lambda s: [int(x) for x in s.split(",")], default=[16, 64, 256])
    p.add_argument("--keep", type=lambda s: [float(x) for x in s.split(",")], default=[0.05, 0.1, 0.25, 0.5])
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1])
    p.add_argument("--episodes", type=int, default=5)
    p.add_argument("--queries", type=int, default=20)
    p.add_argument("--n-way", type=int, default=5)
    p.add_argument("--delta", type=float, default=0.005)
    p.add_argument("--chunk-demos", type=int, default=16)
    p.add_argument("--memory-demos", type=int, default=64, help="K whose full cache is the fixed memory")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/emloc_bench.json"))
    return p


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    model = EMLoCHost.load(args.model)
    rows_path = args.out.with_suffix(".rows.jsonl")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(l) for l in rows_path.read_text().splitlines() if l.strip()] if rows_path.exists() else []
    done = {(r["K"], r["seed"], r["episode"]) for r in rows}
    todo = [(K, s, e) for K in args.demos for s in args.seeds for e in range(args.episodes) if (K, s, e) not in done]
    with open(rows_path, "a") as f:
        for K, s, e in tqdm(todo, desc="episodes"):
            new = run_episode(model, K, s, e, args)
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
    write_json_atomic(args.out, summary)
    print(f"{'K':>4} {'policy':>10} {'keep':>13} {'kept':>6} {'acc':>13} {'sec':>8}")
    for r in summary["table"]:
        print(f"{r['K']:>4} {r['policy']:>10} {str(r['keep']):>13} {r['fraction']:6.3f} {r['acc']:6.3f}±{r['acc_std']:.3f} {r['seconds']:8.3f}")
    for v in summary["targets"]:
        print(json.dumps(v))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
