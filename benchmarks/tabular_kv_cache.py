"""A fitted context reused across predictions: TabICL here with ``kv_cache=True`` against refitting for every call and
against the official package with its ``kv_cache`` on, in one run.

The workload: one fit on ``--rows`` train rows (default 50,000), then ``--calls`` predict calls (default 20) of
``--test-rows`` rows each (default 1,000; a fresh random batch each call), through the official pipeline
(``TabICLClassifier(official=True)``, the official preprocessing and ensemble) on a randomly initialised official v2
checkpoint (``--arch``: ``lean`` by default, the v2 switches at embedding 32 with one block per stage and two ICL
blocks, because the published size needs hours per 50K-row context on a CPU; ``v2`` for the published sizes on a
GPU). Cases, each in its own process (so its peak resident memory is its own):

- ``here_kv``: ``kv_cache=True``: the train rows run once, at ``fit``; each call reads the stored contexts;
- ``here_refit``: ``kv_cache=False``, ``fit`` + ``predict_proba`` for every call (the train rows run every call);
- ``official_kv``: ``tabicl.TabICLClassifier(kv_cache=True)`` (fp32, ``use_amp=False``).

Recorded per case: fit seconds, the calls' seconds (total, mean, each), wall and CPU time of the whole workload, peak
RSS (``ru_maxrss``) and RSS before the workload, and the first call's probabilities (compared across cases: max abs
difference). Ratios: here_refit / here_kv and official_kv / here_kv for the whole workload (CPU time of the process,
the steadier measure on a shared machine, and wall time) and per call (wall); peak RSS here_kv / official_kv. Resumable: finished cases in ``--out`` are kept when the settings match.

    python -m benchmarks.tabular_kv_cache --out benchmarks/results/tabular_kv_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core.infra.cli import UsageError, positive_int, run_cli
from core.infra.fileio import write_json_atomic

ROOT = Path(__file__).resolve().parent.parent
V2_SWITCHES = dict(col_affine=False, col_feature_group="same", col_feature_group_size=3, col_target_aware=True,
                   col_ssmax="qassmax-mlp-elementwise", icl_ssmax="qassmax-mlp-elementwise", row_rope_interleaved=False)
ARCHS = {
    "lean": dict(max_classes=10, embed_dim=32, col_num_blocks=1, col_nhead=4, col_num_inds=32, row_num_blocks=1,
                 row_nhead=4, row_num_cls=4, icl_num_blocks=2, icl_nhead=4, ff_factor=2),
    "v2": dict(max_classes=10),  # the official class's defaults: the published v2 sizes
}
CASES = ("here_kv", "official_kv", "here_refit")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_checkpoint(arch: str, path: Path, seed: int = 0) -> None:
    import torch
    from tabicl._model.tabicl import TabICL as Official

    torch.manual_seed(seed)
    cfg = {**ARCHS[arch], **V2_SWITCHES, "zero_init": False}
    torch.save({"config": cfg, "state_dict": Official(**cfg).state_dict()}, path)


def tables(rows: int, test_rows: int, calls: int, features: int, classes: int, seed: int = 0):
    """Train rows and ``calls`` test batches of a synthetic table (a linear rule with noise over ``classes``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    w = rng.normal(size=(features, classes))

    def draw(n):
        X = rng.normal(size=(n, features)).astype(np.float32)
        return X, (X @ w + rng.normal(size=(n, classes))).argmax(1)

    X, y = draw(rows)
    return X, y, [draw(test_rows)[0] for _ in range(calls)]


def run_case(case: str, ckpt: str, args, probs_out: Path) -> dict:
    """One case in this process (start it in a fresh subprocess)."""
    import numpy as np
    import torch

    torch.set_num_threads(args.threads)
    X, y, tests = tables(args.rows, args.test_rows, args.calls, args.features, args.classes)
    kw = dict(n_estimators=args.n_estimators, random_state=42, batch_size=args.n_estimators)
    if case == "official_kv":
        from tabicl import TabICLClassifier as Official

        make = lambda: Official(model_path=ckpt, allow_auto_download=False, device=args.device, use_amp=False,  # noqa: E731
                                kv_cache=True, **kw)
    else:
        from tabular import TabICLClassifier

        make = lambda: TabICLClassifier(checkpoint=ckpt, official=True, device=args.device, dtype="float32",  # noqa: E731
                                        kv_cache=case == "here_kv", memory_budget_mb=args.budget_mb, **kw)
    before = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    fit_s, call_s, first = None, [], None
    est = None
    if case != "here_refit":
        est = make().fit(X, y)
        fit_s = time.perf_counter() - t0
    for Xt in tests:
        t = time.perf_counter()
        if case == "here_refit":
            est = make().fit(X, y)  # the train rows run again for this call
        p = est.predict_proba(Xt)
        call_s.append(time.perf_counter() - t)
        if first is None:
            first = p
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    np.save(probs_out, first)
    rec = {"case": case, "fit_s": None if fit_s is None else round(fit_s, 3), "calls": len(call_s),
           "calls_total_s": round(sum(call_s), 3), "call_mean_s": round(sum(call_s) / len(call_s), 3),
           "call_s": [round(c, 3) for c in call_s], "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
           "rss_before_mb": round(before, 1),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if hasattr(est, "context_nbytes_"):
        rec["context_mb"] = round(est.context_nbytes_ / 2**20, 1)
    return rec


def ratios(cases: dict) -> dict:
    """The workload's ratios (None where a case is missing)."""
    kv, refit, off = (cases.get(c) for c in CASES[0:1] + CASES[2:3] + CASES[1:2])
    out = {}
    if kv and refit:
        out["refit_over_kv_cpu"] = round(refit["cpu_s"] / kv["cpu_s"], 2)
        out["refit_over_kv_wall"] = round(refit["wall_s"] / kv["wall_s"], 2)
        out["refit_over_kv_per_call"] = round(refit["call_mean_s"] / kv["call_mean_s"], 2)
    if kv and off:
        out["official_kv_over_here_kv_cpu"] = round(off["cpu_s"] / kv["cpu_s"], 3)
        out["official_kv_over_here_kv_wall"] = round(off["wall_s"] / kv["wall_s"], 3)
        out["official_kv_over_here_kv_per_call"] = round(off["call_mean_s"] / kv["call_mean_s"], 3)
        out["official_kv_over_here_kv_fit"] = round(off["fit_s"] / kv["fit_s"], 3)
        out["here_kv_over_official_kv_peak_rss"] = round(kv["peak_rss_mb"] / off["peak_rss_mb"], 3)
        out["here_kv_over_official_kv_peak_rss_above_start"] = round(
            (kv["peak_rss_mb"] - kv["rss_before_mb"]) / max(1.0, off["peak_rss_mb"] - off["rss_before_mb"]), 3)
    if kv and refit:
        out["here_kv_over_refit_peak_rss"] = round(kv["peak_rss_mb"] / refit["peak_rss_mb"], 3)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_kv_cache", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--arch", choices=sorted(ARCHS), default="lean")
    p.add_argument("--rows", type=positive_int, default=50_000, help="train rows (one fit)")
    p.add_argument("--test-rows", type=positive_int, default=1000, help="rows per predict call")
    p.add_argument("--calls", type=positive_int, default=20, help="predict calls")
    p.add_argument("--features", type=positive_int, default=10)
    p.add_argument("--classes", type=positive_int, default=2)
    p.add_argument("--n-estimators", type=positive_int, default=2, help="ensemble members (one batch)")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads for every case")
    p.add_argument("--device", default="cpu")
    p.add_argument("--budget-mb", type=positive_int, default=2048, help="memory_budget_mb here (one-shot path)")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    p.add_argument("--timeout", type=positive_int, default=7200, help="seconds per case")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tabular_kv_cache.json")
    p.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--probs", type=Path, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args.ckpt, args, args.probs)), flush=True)
        return 0
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or any(c not in CASES for c in cases):
        raise UsageError(f"--cases must be a comma-separated subset of {','.join(CASES)}, got {args.cases!r}")
    if args.classes < 2 or args.classes > 10:
        raise UsageError(f"--classes must be 2 to 10, got {args.classes}")
    import numpy as np

    settings = {k: str(v) for k, v in vars(args).items() if k not in ("out", "case", "ckpt", "probs", "timeout", "cases")}
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result = old if old.get("settings") == settings else {"settings": settings, "cases": {}}
    result["command"] = "python -m benchmarks.tabular_kv_cache " + " ".join(argv if argv is not None else sys.argv[1:])
    import hashlib

    tag = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    probs_dir = Path(tempfile.gettempdir()) / "tabular_kv_cache_probs" / tag  # first-call probabilities, per settings
    probs_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / f"random_{args.arch}.ckpt"
        make_checkpoint(args.arch, ckpt)
        for case in cases:
            if case in result["cases"]:
                continue
            child = [sys.executable, "-m", "benchmarks.tabular_kv_cache", "--case", case, "--ckpt", str(ckpt),
                     "--probs", str(probs_dir / f"{case}.npy"),
                     *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                           ("arch", "rows", "test_rows", "calls", "features", "classes", "n_estimators", "threads",
                            "device", "budget_mb")), [])]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            try:
                p = subprocess.run(child, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                rec = json.loads(line[-1][7:]) if line else {
                    "case": case, "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300]}
            except subprocess.TimeoutExpired:
                rec = {"case": case, "error": f"timeout after {args.timeout} s"}
            result["cases"][case] = rec
            print(json.dumps({k: v for k, v in rec.items() if k != "call_s"}), flush=True)
            result["ratios"] = ratios({c: r for c, r in result["cases"].items() if "wall_s" in r})
            write_json_atomic(args.out, result)
    done = {c: np.load(probs_dir / f"{c}.npy") for c, r in result["cases"].items()
            if "wall_s" in r and (probs_dir / f"{c}.npy").is_file()}
    if "here_kv" in done:
        result["first_call_max_abs_diff_vs_here_kv"] = {c: float(np.abs(p - done["here_kv"]).max())
                                                       for c, p in done.items() if c != "here_kv"}
    result["ratios"] = ratios({c: r for c, r in result["cases"].items() if "wall_s" in r})
    write_json_atomic(args.out, result)
    print(json.dumps(result["ratios"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
