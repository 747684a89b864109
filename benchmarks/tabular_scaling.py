"""TabICL predict time and peak memory as the number of train rows grows.

For each (train rows, features) case a fresh process builds a synthetic 2-class table (NumPy float32: a random
linear rule plus noise), fits :class:`tabular.TabICLClassifier` (``n_estimators`` members, ``memory_budget_mb``)
and predicts ``--test-rows`` test rows twice: the first call includes the train-side pass, the second hits the
train-side cache (as far as it fits half the budget). Recorded per case: fit, first and repeated predict time
(wall and CPU seconds of the process), the process's peak resident set (``VmHWM``, everything included: Python,
torch, the table, the fitted estimator), the growth of that peak during the two predictions
(``benchmarks.common.PeakRSS``), and the bytes and number of the kept train contexts (and how many the cache had
no room for). A case that times out or runs out of memory is recorded as an error, not dropped; results are
rewritten after every case. The slope of peak memory against train rows (least squares over the completed cases
of one feature count, with its R²) is reported in MB per 1K rows.

    python -m benchmarks.tabular_scaling --quick          # 1K and 10K rows, 20 features
    python -m benchmarks.tabular_scaling                  # 1K, 10K, 100K, 500K rows x 20, 100 features
    python -m benchmarks.tabular_scaling --prior          # tables/s of the pretraining prior
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import PeakRSS, _status_kb, env_info, format_table, read_parts, run_isolated, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_scaling.json"


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


class _ProgressLog:
    """Appends one JSON line per logged estimator step (wall / CPU seconds since start, RSS, peak RSS) to a file,
    so a case that is stopped early still tells how far it got and how its memory grew."""

    def __init__(self, path: Path) -> None:
        import logging

        self.path, self.phase = Path(path), "fit"
        self.w0, self.c0 = time.perf_counter(), time.process_time()
        self.path.write_text("")
        log = self

        class _Handler(logging.Handler):
            def emit(self, record) -> None:
                log.write(record.getMessage())

        self.logger = logging.getLogger("tabular.estimator")  # one DEBUG line per predicted view (or member batch)
        self.handler, self.level = _Handler(level=logging.DEBUG), self.logger.level
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.DEBUG)

    def close(self) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)

    def write(self, msg: str) -> None:
        rec = {"phase": self.phase, "wall_s": time.perf_counter() - self.w0, "cpu_s": time.process_time() - self.c0,
               "rss_mb": (_status_kb("VmRSS") or 0) / 1024, "hwm_mb": (_status_kb("VmHWM") or 0) / 1024, "msg": msg}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")


def _case(rows: int, features: int, n_estimators: int, threads: int, memory_mb: float, test_rows: int = 1000,
          checkpoint=None, progress: Path | None = None, context: str = "global") -> dict:
    import torch

    from tabular import TabICLClassifier

    torch.set_num_threads(threads)
    plog = _ProgressLog(progress) if progress else None
    rng = np.random.default_rng(0)
    X = rng.standard_normal(size=(rows + test_rows, features), dtype=np.float32)
    w = rng.normal(size=features).astype(np.float32)
    y = (X @ w + 0.5 * rng.standard_normal(len(X), dtype=np.float32) > 0).astype(int)
    # feature_reduction=None: the model reads every column (a projection would measure a narrower table).
    clf = TabICLClassifier(n_estimators=n_estimators, memory_budget_mb=memory_mb, device="cpu", checkpoint=checkpoint,
                           feature_reduction=None, context=context, verbose=plog is not None)
    try:
        _, fit_s, fit_cpu = _timed(lambda: clf.fit(X[:rows], y[:rows]))
        peak = PeakRSS()
        peak.start()
        if plog:
            plog.phase = "first predict"
            plog.write("fit done")
        proba, first, first_cpu = _timed(lambda: clf.predict_proba(X[rows:]))
        not_kept = clf._cache.skipped  # contexts of the first call the cache had no room for
        if plog:
            plog.phase = "repeat predict"
        _, second, second_cpu = _timed(lambda: clf.predict_proba(X[rows:]))
    finally:
        if plog:
            plog.close()
    hwm = _status_kb("VmHWM")
    acc = float((proba.argmax(1) == y[rows:]).mean())
    n_ctx = sum(1 for _ in _contexts(clf._tree))
    return {"status": "ok", "rows": rows, "features": features, "test_rows": test_rows,
            "fit_s": fit_s, "fit_cpu_s": fit_cpu, "predict_s": first, "predict_cpu_s": first_cpu,
            "repeat_predict_s": second, "repeat_predict_cpu_s": second_cpu,
            "peak_rss_mb": (hwm or 0) / 1024 if peak.method.startswith("VmHWM") else None,
            "predict_peak_growth_mb": peak.peak_mb(), "peak_method": peak.method,
            "table_mb": X.nbytes / 2**20, "cache_mb": clf._cache.nbytes / 2**20, "cached_contexts": n_ctx,
            "contexts_not_kept": not_kept,
            "folds": len(clf._folds(clf._y_train)), "accuracy": acc}


def _contexts(node):
    """Kept train contexts of a fitted estimator's class tree."""
    if node is None:
        return
    yield from node.cache.values()
    for child in node.children:
        yield from _contexts(child)


def slope(rows: list[int], mb: list[float]) -> dict:
    """Least-squares line of ``mb`` against ``rows`` (in thousands): slope (MB per 1K rows), intercept, R²."""
    x = np.asarray(rows, dtype=float) / 1000
    yv = np.asarray(mb, dtype=float)
    k, c = np.polyfit(x, yv, 1)
    ss = float(((yv - yv.mean()) ** 2).sum())
    r2 = 1.0 - float(((yv - (k * x + c)) ** 2).sum()) / ss if ss > 0 else 1.0
    return {"mb_per_1k_rows": float(k), "intercept_mb": float(c), "r2": r2, "points": len(x)}


def prior_speed(seconds: float = 10.0, threads: int = 1) -> list[dict]:
    """Tables per second drawn by the pretraining prior (batch of 16, one thread), per table size and SCM family."""
    import torch

    from tabular.prior import PriorConfig, TablePrior

    torch.set_num_threads(threads)
    out = []
    for family, p_tree in (("mixed", 0.3), ("mlp", 0.0), ("tree", 1.0)):
        for rows in (256, 1024):
            prior = TablePrior(PriorConfig(p_tree=p_tree), seed=0)
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                prior.sample(16, rows, rows // 2)
                n += 16
            out.append({"family": family, "rows": rows, "features": "2-100", "tables_per_s": n / (time.perf_counter() - t0)})
    return out


def _fmt(v, nd=1):
    return "" if v is None else f"{v:,.{nd}f}"


def _kept(r: dict) -> str:
    """Kept train contexts of a case, out of those its predict built (count alone for older records)."""
    if "contexts_not_kept" not in r:
        return f"{r['cached_contexts']}"
    return f"{r['cached_contexts']} of {r['cached_contexts'] + r['contexts_not_kept']}"


def markdown(results: list[dict], slopes: dict, args) -> str:
    """The results as a Markdown table plus the slope lines."""
    lines = [
        f"TabICL scaling: {args.n_estimators} members, memory_budget_mb={args.memory_mb:g}, {args.test_rows:,} test rows, "
        f"{args.threads} torch thread(s); times in seconds (wall / CPU), memory in MB.",
        "",
        "| train rows | features | folds | fit (s) | first predict (s) | repeat predict (s) | contexts kept "
        "| peak RSS (MB) | peak growth in predict (MB) | train cache (MB) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r.get("status") != "ok":
            why = r.get("note") or r.get("reason", "error")
            pr = r.get("progress")
            if pr:
                last = pr["last"]
                why += (f"; got to {last['msg'].split(':')[0]} ({last['phase']}) in {last['wall_s']:,.0f} s wall / "
                        f"{last['cpu_s']:,.0f} s CPU")
            peak = f"{pr['peak_rss_mb']:,.0f} (so far)" if pr else ""
            lines.append(f"| {r['rows']:,} | {r['features']} | | {why} | | | | {peak} | | |")
            continue
        lines.append(
            f"| {r['rows']:,} | {r['features']} | {r['folds']} | {_fmt(r['fit_s'])} / {_fmt(r['fit_cpu_s'])} | {_fmt(r['predict_s'])} / "
            f"{_fmt(r['predict_cpu_s'])} | {_fmt(r['repeat_predict_s'])} / {_fmt(r['repeat_predict_cpu_s'])} | {_kept(r)} | "
            f"{_fmt(r['peak_rss_mb'], 0)} | {_fmt(r['predict_peak_growth_mb'], 0)} | {_fmt(r['cache_mb'], 0)} |"
        )
    lines.append("")
    for f, by in slopes.items():
        for what, s in by.items():
            lines.append(f"- {f} features, {what}: {s['mb_per_1k_rows']:.2f} MB per 1K train rows "
                         f"(intercept {s['intercept_mb']:.0f} MB, R² {s['r2']:.4f}, {s['points']} points)")
    return "\n".join(lines) + "\n"


def _slopes(results: list[dict], features: list[int]) -> dict:
    """Per feature count: slopes of peak RSS and of its growth in predict, over all completed cases, over
    the multi-fold ones (train rows above ``max_context``: contexts at their full size, only their number grows)
    and, when some case's cache filled up, over the cases whose contexts were all kept (past that point the
    cache stops at half of ``memory_budget_mb`` and only the recomputed contexts' working memory remains)."""
    out = {}
    for f in features:
        ok = [r for r in results if r.get("status") == "ok" and r["features"] == f]
        by = {}
        kept = [r for r in ok if r.get("contexts_not_kept") == 0]
        for tag, sel in (("all", ok), ("multi-fold", [r for r in ok if r.get("folds", 1) > 1]),
                         ("all contexts kept", kept if len(kept) < len(ok) else [])):
            if len(sel) >= 2:
                by[f"peak_rss ({tag})"] = slope([r["rows"] for r in sel], [r["peak_rss_mb"] for r in sel])
                by[f"predict_peak_growth ({tag})"] = slope([r["rows"] for r in sel], [r["predict_peak_growth_mb"] for r in sel])
        if by:
            out[str(f)] = by
    return out


def _merge(args) -> int:
    """One result file (and Markdown table) from the cases of several runs; a later file's case replaces an
    earlier one of the same (rows, features)."""
    runs = read_parts(args.merge)
    cases: dict[tuple, dict] = {}
    for run in runs:
        for c in run["cases"]:
            cases[(c["features"], c["rows"])] = {**c, "run_started_utc": run["env"].get("time_utc")}
    results = [cases[k] for k in sorted(cases)]
    features = sorted({c["features"] for c in results})
    first = runs[0]["args"]
    for k in ("n_estimators", "memory_mb", "test_rows", "threads"):
        if any(r["args"].get(k) != first.get(k) for r in runs):
            raise ValueError(f"runs to merge differ in {k}: {[r['args'].get(k) for r in runs]}")
    slopes = _slopes(results, features)
    envs = [r["env"] for r in runs]
    write_json_atomic(args.out, {"env": envs[0], "envs": envs, "args": {**first, "rows": sorted({c["rows"] for c in results}),
                                 "features": features, "merged_from": [Path(p).name for p in args.merge]},
                                 "cases": results, "peak_mb_per_1k_rows": slopes})
    ns = argparse.Namespace(**{**vars(args), **{k: first[k] for k in ("n_estimators", "memory_mb", "test_rows", "threads")}})
    md = markdown(results, slopes, ns)
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", type=int, default=[1_000, 10_000, 100_000, 500_000], help="train rows")
    p.add_argument("--features", nargs="*", type=int, default=[20, 100], help="feature counts")
    p.add_argument("--n-estimators", type=int, default=4, help="ensemble members")
    p.add_argument("--memory-mb", type=float, default=4096, help="the estimator's memory budget (memory_budget_mb)")
    p.add_argument("--test-rows", type=int, default=1000, help="test rows predicted per case")
    p.add_argument("--threads", type=int, default=1, help="torch threads per case")
    p.add_argument("--timeout", type=float, default=2400, help="seconds per case")
    p.add_argument("--quick", action="store_true", help="1K and 10K rows, 20 features")
    p.add_argument("--checkpoint", default=None, help="TabICL checkpoint (default: the shipped one)")
    p.add_argument("--context", choices=("global", "local"), default="global",
                   help="the estimator's context: global (what the recorded results measured: cached contexts of "
                        "stratified folds) or local (the estimator's default since the development-suite choice)")
    p.add_argument("--prior", action="store_true", help="only measure the prior's tables/s")
    p.add_argument("--case", nargs=2, type=int, metavar=("ROWS", "FEATURES"), help=argparse.SUPPRESS)
    p.add_argument("--progress", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--merge", nargs="+", type=Path, default=None, metavar="JSON",
                   help="combine the cases of result files written by separate runs (e.g. run in parallel) into --out")
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON (a Markdown table is written beside it)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], args.case[1], args.n_estimators, args.threads, args.memory_mb,
                               args.test_rows, args.checkpoint, args.progress, args.context)))
        return 0
    if args.prior:
        rows = prior_speed()
        write_json_atomic(args.out.with_name("tabular_prior_speed.json"), {"env": env_info(), "rows": rows})
        print(format_table(rows, ["family", "rows", "features", "tables_per_s"]))
        return 0
    if args.merge:
        return _merge(args)
    if args.quick:
        args.rows, args.features = [1_000, 10_000], [20]
    env = env_info()
    arg_rec = {k: (v.name if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if arg_rec["checkpoint"]:
        arg_rec["checkpoint"] = Path(arg_rec["checkpoint"]).name
    results = []
    for f in args.features:
        for n in args.rows:
            cmd = [sys.executable, "-m", "benchmarks.tabular_scaling", "--case", str(n), str(f),
                   "--n-estimators", str(args.n_estimators), "--threads", str(args.threads),
                   "--memory-mb", str(args.memory_mb), "--test-rows", str(args.test_rows), "--context", args.context]
            cmd += ["--checkpoint", args.checkpoint] if args.checkpoint else []
            prog = args.out.with_name(f"{args.out.stem}.progress_{n}x{f}.jsonl")
            res = run_isolated(cmd + ["--progress", str(prog)], timeout_s=args.timeout)
            if res.get("status") != "ok" and prog.exists():  # how far the stopped case got
                steps = [json.loads(line) for line in prog.read_text().splitlines() if line.strip()]
                if steps:
                    res["progress"] = {"steps_logged": len(steps), "last": steps[-1],
                                       "peak_rss_mb": max(st["hwm_mb"] for st in steps)}
            prog.unlink(missing_ok=True)
            res.setdefault("rows", n)
            res.setdefault("features", f)
            print(f"{n} rows x {f} features: {res}", file=sys.stderr, flush=True)
            results.append(res)
            slopes = _slopes(results, args.features)
            write_json_atomic(args.out, {"env": env, "args": arg_rec, "cases": results, "peak_mb_per_1k_rows": slopes})
            md = args.out.with_suffix(".md")
            tmp = md.with_name(md.name + ".tmp")
            tmp.write_text(markdown(results, slopes, args))
            tmp.replace(md)
    print(markdown(results, _slopes(results, args.features), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
