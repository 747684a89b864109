"""TabICL predict time and peak memory as the number of train rows grows.

For each (train rows, features) case a fresh process builds a synthetic 2-class table (NumPy: a random linear
rule plus noise), fits :class:`tabular.TabICLClassifier` (``n_estimators`` members) and predicts 1,000 test rows.
Peak memory is the case's resident-set growth (``benchmarks.common.PeakRSS``); time is the wall time of the
first ``predict_proba`` (it includes the train-side pass; the train cache makes a second call cheaper, also
timed). A case that times out or runs out of memory is recorded as an error, not dropped. The slope of peak
memory against rows (least squares over the completed cases of one feature count) is reported in MB per 1K rows.

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

from benchmarks.common import PeakRSS, env_info, format_table, run_isolated, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_scaling.json"


def _case(rows: int, features: int, n_estimators: int, threads: int, memory_mb: float, checkpoint=None) -> dict:
    import torch

    from tabular import TabICLClassifier

    torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    X = rng.normal(size=(rows + 1000, features)).astype(np.float32)
    w = rng.normal(size=features)
    y = (X @ w + 0.5 * rng.normal(size=len(X)) > 0).astype(int)
    clf = TabICLClassifier(n_estimators=n_estimators, memory_budget_mb=memory_mb, device="cpu", checkpoint=checkpoint)
    clf.fit(X[:rows], y[:rows])
    peak = PeakRSS()
    peak.start()
    t0 = time.perf_counter()
    proba = clf.predict_proba(X[rows:])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    clf.predict_proba(X[rows:])
    second = time.perf_counter() - t0
    acc = float((proba.argmax(1) == y[rows:]).mean())
    return {"status": "ok", "rows": rows, "features": features, "predict_s": first, "repeat_predict_s": second,
            "peak_mb": peak.peak_mb(), "peak_method": peak.method, "accuracy": acc}


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_scaling", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", nargs="*", type=int, default=[1_000, 10_000, 100_000, 500_000], help="train rows")
    p.add_argument("--features", nargs="*", type=int, default=[20, 100], help="feature counts")
    p.add_argument("--n-estimators", type=int, default=4, help="ensemble members")
    p.add_argument("--memory-mb", type=float, default=4096, help="the estimator's memory budget")
    p.add_argument("--threads", type=int, default=2, help="torch threads per case")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per case")
    p.add_argument("--quick", action="store_true", help="1K and 10K rows, 20 features")
    p.add_argument("--checkpoint", default=None, help="TabICL checkpoint (default: the shipped one)")
    p.add_argument("--prior", action="store_true", help="only measure the prior's tables/s")
    p.add_argument("--case", nargs=2, type=int, metavar=("ROWS", "FEATURES"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS, help="results JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], args.case[1], args.n_estimators, args.threads, args.memory_mb, args.checkpoint)))
        return 0
    if args.prior:
        rows = prior_speed()
        write_json_atomic(args.out.with_name("tabular_prior_speed.json"), {"env": env_info(), "rows": rows})
        print(format_table(rows, ["family", "rows", "features", "tables_per_s"]))
        return 0
    if args.quick:
        args.rows, args.features = [1_000, 10_000], [20]
    results = []
    for f in args.features:
        for n in args.rows:
            cmd = [sys.executable, "-m", "benchmarks.tabular_scaling", "--case", str(n), str(f),
                   "--n-estimators", str(args.n_estimators), "--threads", str(args.threads),
                   "--memory-mb", str(args.memory_mb)] + (["--checkpoint", args.checkpoint] if args.checkpoint else [])
            res = run_isolated(cmd, timeout_s=args.timeout)
            res.setdefault("rows", n)
            res.setdefault("features", f)
            print(f"{n} rows x {f} features: {res}", file=sys.stderr)
            results.append(res)
    slopes = {}
    for f in args.features:
        ok = [r for r in results if r.get("status") == "ok" and r["features"] == f]
        if len(ok) >= 2:
            x = np.array([r["rows"] for r in ok], dtype=float) / 1000
            yv = np.array([r["peak_mb"] for r in ok])
            slopes[str(f)] = float(np.polyfit(x, yv, 1)[0])
    write_json_atomic(args.out, {"env": env_info(), "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                                 "cases": results, "peak_mb_per_1k_rows": slopes})
    print(format_table(results, ["rows", "features", "status", "predict_s", "repeat_predict_s", "peak_mb", "accuracy"]))
    print(f"peak memory slope (MB per 1K train rows): {slopes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
