"""EMLoC on a task that recency cannot solve, against controls that keep the same always-kept tokens.

Task "early-rare" (held-out classes of :mod:`apps.emloc.data`, ``--n-way`` classes, a random label mapping per
episode): ``--rare`` of the classes are *rare*: each has only ``--rare-demos`` demonstrations, all placed at random
among the first ``--early`` fraction of the ``K`` demonstrations; the other classes fill the rest. Queries are
drawn uniformly over all classes, so about ``rare / n_way`` of them need an early demonstration: a policy that
keeps only recent tokens cannot answer them.

Per episode (``K`` of ``--demos``, seed of ``--seeds``, ``--episodes`` each), all at **EMLoC's own kept fraction**
in that episode (equal budget; kept = (layer, KV head, token) entries over the full cache's):

* ``full``: the whole context; ``emloc`` at ``--delta`` (the toy host's label tokens always kept);
* ``answers``: the always-kept tokens alone (each demonstration's label token, 20% of the tokens; no search) —
  the trivial control;
* every budgeted policy twice: ``<policy>+answers`` (the label tokens kept first, the rest of the budget by the
  policy's own ranking: the comparison is about what each policy adds) and ``<policy>`` (its own ranking only).
  SnapKV and PyramidKV observe the last ``--window`` tokens (SnapKV's window, 32 by default): with no question at
  compression time, the last demonstrations stand in for it. FastV keeps its first two layers whole by design;
  it gets the same budget per pruned layer, so its total kept fraction is higher (reported).

``--dev`` runs EMLoC alone for every δ of ``--deltas`` (choose δ there); the reported run uses other seeds.
Differences are paired per episode with 95% bootstrap intervals over episodes (seeds pooled). Rows go to
``--out``'s ``.rows.jsonl`` as they finish (resumable; a rows file made with other settings is refused).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from apps.emloc.api import compress
from apps.emloc.data import Episode, EpisodeConfig, make_episode
from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost
from core.infra.cli import UsageError, fraction, nonnegative_int, positive_float, positive_int, run_cli
from core.infra.fileio import write_json_atomic
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

PEERS = ("streaming", "h2o", "snapkv", "pyramidkv", "random", "fastv")


def early_rare_episode(seed: int, K: int, Q: int, *, n_way: int, rare: int, rare_demos: int, early: float) -> tuple[Episode, torch.Tensor]:
    """An episode whose ``rare`` classes appear only early (module docs); also the rare label ids."""
    base = make_episode(seed, num_demos=n_way * K // (n_way - rare) + n_way * (rare_demos + 1), num_queries=Q, split="eval",
                        config=EpisodeConfig(n_way=n_way))
    g = torch.Generator().manual_seed(seed + 99)
    rare_ids = base.label_ids[:rare]
    is_rare = torch.isin(base.demo_labels, rare_ids)
    rare_idx = torch.cat([(base.demo_labels == r).nonzero()[:rare_demos, 0] for r in rare_ids])
    common_idx = (~is_rare).nonzero()[:, 0]
    n_early = max(int(early * K), len(rare_idx))
    n_common = K - len(rare_idx)
    if len(common_idx) < n_common:
        raise ValueError(f"not enough common demonstrations for K={K}")
    common_idx = common_idx[torch.randperm(len(common_idx), generator=g)[:n_common]]
    slots = torch.randperm(n_early, generator=g)[: len(rare_idx)]  # rare demos go to early slots
    order = torch.full((K,), -1, dtype=torch.long)
    order[slots] = rare_idx
    order[order < 0] = common_idx
    ep = Episode(demo_images=base.demo_images[order], demo_labels=base.demo_labels[order],
                 query_images=base.query_images, query_labels=base.query_labels, classes=base.classes,
                 label_ids=base.label_ids)
    return ep, rare_ids


def _acc(ctx, ep: Episode, rare_ids: torch.Tensor) -> tuple[float, float]:
    pred = ctx.predict(ep.query_images)
    ok = (pred == ep.query_labels).float()
    rare = torch.isin(ep.query_labels, rare_ids)
    return float(ok.mean()), float(ok[rare].mean()) if rare.any() else float("nan")


def run_episode(model: EMLoCHost, K: int, seed: int, e: int, args, deltas: list[float], run_id: dict) -> list[dict]:
    ep, rare_ids = early_rare_episode(seed * 100_003 + e + 9_000_000, K, args.queries, n_way=args.n_way, rare=args.rare,
                                      rare_demos=args.rare_demos, early=args.early)
    demos = (ep.demo_images, ep.demo_labels)
    base = {"K": K, "seed": seed, "episode": e, "run": run_id}
    rows = []

    def add(name: str, ctx, seconds: float, **extra):
        acc, acc_rare = _acc(ctx, ep, rare_ids)
        rows.append({**base, "policy": name, "fraction": ctx.keep_fraction(), "acc": acc, "acc_rare": acc_rare,
                     "seconds": seconds, **extra})

    t = time.perf_counter()
    add("full", compress(model, demos, policy="full"), time.perf_counter() - t)
    for d in deltas:
        t = time.perf_counter()
        em = compress(model, demos, policy="emloc", delta=d, chunk_demos=args.chunk_demos, observers=args.observers)
        add("emloc", em, time.perf_counter() - t, delta=d, keep_per_layer=em.keep_ratios())
    if args.dev:
        return rows
    f = round(rows[-1]["fraction"], 4)
    n_tok = K * model.config.tokens_per_demo
    t = time.perf_counter()
    add("answers", compress(model, demos, policy="random", keep=K / n_tok, protect_answers=True), time.perf_counter() - t)
    for policy in PEERS:
        for protect in (True, False):
            name = f"{policy}+answers" if protect else policy
            try:
                t = time.perf_counter()
                ctx = compress(model, demos, policy=policy, keep=f, window=args.window, seed=seed * 1000 + e,
                               protect_answers=protect)
                add(name, ctx, time.perf_counter() - t, keep=f)
            except ValueError as err:
                rows.append({**base, "policy": name, "keep": f, "error": str(err)})
    return rows


def paired(rows: list[dict], K: int, a: str, b: str, key: str = "acc", draws: int = 10_000) -> dict | None:
    """Mean per-episode difference a − b in points, 95% percentile bootstrap over episodes (seeds pooled)."""
    A = {(r["seed"], r["episode"]): r[key] for r in rows if r["K"] == K and r["policy"] == a and "error" not in r}
    B = {(r["seed"], r["episode"]): r[key] for r in rows if r["K"] == K and r["policy"] == b and "error" not in r}
    keys = sorted(A.keys() & B.keys())
    if not keys:
        return None
    d = 100 * np.array([A[k] - B[k] for k in keys])
    boots = d[np.random.default_rng(0).integers(0, len(d), size=(draws, len(d)))].mean(axis=1)
    return {"mean": float(d.mean()), "ci95": [float(np.percentile(boots, 2.5)), float(np.percentile(boots, 97.5))],
            "episodes": len(d)}


def summarize(rows: list[dict], args) -> dict:
    table = []
    for K in sorted({r["K"] for r in rows}):
        for name in dict.fromkeys((r["policy"], r.get("delta")) for r in rows if r["K"] == K and "error" not in r):
            rs = [r for r in rows if r["K"] == K and (r["policy"], r.get("delta")) == name and "error" not in r]
            seeds = sorted({r["seed"] for r in rs})
            per_seed = [statistics.fmean(r["acc"] for r in rs if r["seed"] == s) for s in seeds]
            table.append({"K": K, "policy": name[0], "delta": name[1], "episodes": len(rs),
                          "fraction": statistics.fmean(r["fraction"] for r in rs),
                          "acc": statistics.fmean(r["acc"] for r in rs),
                          "acc_std_over_seeds": statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0,
                          "acc_rare": statistics.fmean(r["acc_rare"] for r in rs if r["acc_rare"] == r["acc_rare"])})
    targets = []
    if not args.dev:
        for K in sorted({r["K"] for r in rows}):
            em = next((t for t in table if t["K"] == K and t["policy"] == "emloc"), None)
            if em is None:
                continue
            cmp = {b: paired(rows, K, "emloc", b) for b in ("full", "answers", "h2o+answers", "snapkv+answers", "h2o", "snapkv",
                                                            "streaming+answers", "streaming", "pyramidkv+answers", "fastv+answers")}
            above = [cmp[b] for b in ("answers", "h2o+answers", "snapkv+answers")]
            targets.append({
                "K": K, "emloc_fraction": em["fraction"], "emloc_acc": em["acc"], "paired": cmp,
                "target_le_25pct_kept": em["fraction"] <= 0.25,
                "target_le_1pt_below_full": cmp["full"] is not None and cmp["full"]["mean"] >= -1.0,
                "target_ge_5pts_above_answers_h2o_snapkv": all(c is not None and c["mean"] >= 5.0 for c in above),
            })
    return {"table": table, "targets": targets}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.emloc_recency", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [positive_int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--model", type=Path, default=DEFAULT_WEIGHTS, help="host weights (default: the shipped host)")
    p.add_argument("--demos", type=ints, default=[64, 128], help="numbers of demonstrations K, comma-separated")
    p.add_argument("--seeds", type=lambda s: [nonnegative_int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--episodes", type=positive_int, default=5)
    p.add_argument("--queries", type=positive_int, default=50)
    p.add_argument("--n-way", type=positive_int, default=5)
    p.add_argument("--rare", type=positive_int, default=3, help="rare classes per episode")
    p.add_argument("--rare-demos", type=positive_int, default=8, help="demonstrations of each rare class")
    p.add_argument("--early", type=fraction, default=0.25, help="rare demonstrations lie in this first fraction")
    p.add_argument("--delta", type=positive_float, default=0.1, help="EMLoC's JS bound (choose it with --dev)")
    p.add_argument("--deltas", default="0.005,0.01,0.02,0.05,0.1,0.2", help="with --dev: the δ sweep")
    p.add_argument("--dev", action="store_true", help="development sweep: EMLoC only, every δ of --deltas")
    p.add_argument("--chunk-demos", type=positive_int, default=16)
    p.add_argument("--observers", choices=("chunk", "suffix"), default="chunk",
                   help="EMLoC's observers: the chunk's own answers (causal; default) or each demo re-encoded after the chunk")
    p.add_argument("--window", type=positive_int, default=32, help="SnapKV/PyramidKV/FastV observation window")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/emloc_recency.json"))
    return p


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    from tqdm import tqdm

    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.model])
    if args.rare >= args.n_way:
        raise UsageError(f"--rare ({args.rare}) must be below --n-way ({args.n_way})")
    try:
        deltas = [positive_float(x) for x in args.deltas.split(",")] if args.dev else [args.delta]
    except argparse.ArgumentTypeError as err:
        raise UsageError(f"--deltas: {err}") from None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    model = EMLoCHost.load(args.model)
    run_id = {"host": model.fingerprint(), "deltas": deltas, **{k: getattr(args, k) for k in (
        "queries", "n_way", "rare", "rare_demos", "early", "chunk_demos", "window", "dev")}}
    if args.observers != "chunk":  # rows made before the option existed are chunk-observer rows
        run_id["observers"] = args.observers
    rows_path = args.out.with_suffix(".rows.jsonl")
    rows = [json.loads(l) for l in rows_path.read_text().splitlines() if l.strip()] if rows_path.exists() else []
    if any(r.get("run") != run_id for r in rows):
        raise UsageError(f"{rows_path} holds rows made with other settings; pass another --out")
    done = {(r["K"], r["seed"], r["episode"]) for r in rows}
    todo = [(K, s, e) for K in args.demos for s in args.seeds for e in range(args.episodes) if (K, s, e) not in done]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(rows_path, "a") as f:
        for K, s, e in tqdm(todo, desc="episodes"):
            new = run_episode(model, K, s, e, args, deltas, run_id)
            f.write("".join(json.dumps(r) + "\n" for r in new))
            f.flush()
            rows.extend(new)
    rows = [r for r in rows if r["K"] in args.demos and r["seed"] in args.seeds and r["episode"] < args.episodes]
    summary = summarize(rows, args)
    summary["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    write_json_atomic(args.out, summary)
    for t in summary["table"]:
        print(f"{t['K']:>4} {t['policy']:>18} {str(t['delta']):>6} kept {t['fraction']:.3f} acc {t['acc']:.3f}"
              f"±{t['acc_std_over_seeds']:.3f} rare {t['acc_rare']:.3f}")
    for t in summary["targets"]:
        print(json.dumps({k: v for k, v in t.items() if k != "paired"}),
              {b: (round(c["mean"], 1), [round(x, 1) for x in c["ci95"]]) for b, c in t["paired"].items() if c})
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
