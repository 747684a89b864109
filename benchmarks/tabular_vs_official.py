"""TabICL here against the official ``tabicl`` package: the same architecture and weights, wall time and peak memory.

Both packages run the same randomly initialised official model (``--arch v1``: the published v1 sizes, 27M
parameters; ``--arch small``: the v1 switches at embedding 32, for sizes the published one cannot reach on a small
CPU; ``--arch lean``: one block per stage, for 100K+ rows, where both packages' time goes into the quadratic ICL
attention), saved once as an official ``.ckpt`` and loaded by each package. Each (rows, package) case runs in its own
subprocess, so its peak resident memory (``ru_maxrss``) is its own; the JSON records it with the memory before the
forward pass, the wall time of the forward pass alone (no loading) and both ratios (here / official). Fp32 for both
(the official package's CPU default is bfloat16 autocast; ``use_amp=False`` is set), ``--threads`` torch threads
for both. Here: ``TabICL.predict_once`` (bounded-memory one-shot path); official: ``TabICL.forward`` in eval mode
with its automatic batching. Train rows = ``rows``, test rows = ``--test-rows``, 100 features, 2 classes by
default. Resumable: finished cases in ``--out`` are kept when the settings match.

    python -m benchmarks.tabular_vs_official --arch v1 --rows 1000,2000,5000,10000 --out benchmarks/results/tabular_vs_official.json
    python -m benchmarks.tabular_vs_official --parity --out benchmarks/results/tabular_vs_official_parity.json
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

from core.infra.cli import UsageError, positive_int, run_cli, thread_count
from core.infra.guard import check_outputs

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {
    "v1": dict(max_classes=10, embed_dim=128, col_num_blocks=3, col_nhead=4, col_num_inds=128, row_num_blocks=3,
               row_nhead=8, row_num_cls=4, icl_num_blocks=12, icl_nhead=4, ff_factor=2),
    "small": dict(max_classes=10, embed_dim=32, col_num_blocks=3, col_nhead=4, col_num_inds=32, row_num_blocks=3,
                  row_nhead=4, row_num_cls=4, icl_num_blocks=4, icl_nhead=4, ff_factor=2),
    "lean": dict(max_classes=10, embed_dim=32, col_num_blocks=1, col_nhead=4, col_num_inds=32, row_num_blocks=1,
                 row_nhead=4, row_num_cls=4, icl_num_blocks=1, icl_nhead=4, ff_factor=2),
}
V1_SWITCHES = dict(col_affine=True, col_feature_group=False, col_target_aware=False, col_ssmax=False, icl_ssmax=False,
                   row_rope_interleaved=True)
PACKAGES = ("official", "here")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def make_checkpoint(arch: str, path: Path, seed: int = 0) -> None:
    import torch
    from tabicl._model.tabicl import TabICL as Official

    torch.manual_seed(seed)
    cfg = {**ARCHS[arch], **V1_SWITCHES, "zero_init": False}
    torch.save({"config": cfg, "state_dict": Official(**cfg).state_dict()}, path)


def run_case(package: str, ckpt: str, rows: int, features: int, test_rows: int, classes: int, threads: int,
             device: str, chunk: int, budget_mb: float) -> dict:
    """One measurement in this process (call it in a fresh subprocess)."""
    import torch

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(rows)
    X = torch.randn(1, rows + test_rows, features, generator=g)
    y = torch.randint(0, classes, (1, rows), generator=g)
    y[0, :classes] = torch.arange(classes)
    if package == "official":
        from tabicl._model.inference_config import InferenceConfig
        from tabicl._model.tabicl import TabICL as Official

        ck = torch.load(ckpt, map_location="cpu", weights_only=True)
        model = Official(**ck["config"])
        model.load_state_dict(ck["state_dict"])
        model = model.to(device).eval()
        ic = InferenceConfig(COL_CONFIG={"use_amp": False, "device": device},
                             ROW_CONFIG={"use_amp": False, "device": device},
                             ICL_CONFIG={"use_amp": False, "device": device})
        fn = lambda: model(X.to(device), y.to(device), return_logits=True, inference_config=ic)  # noqa: E731
    else:
        from tabular.weights_io import load_model

        model = load_model(ckpt, device=device)
        fn = lambda: model.predict_once(X[:, :rows].to(device), y.to(device), X[:, rows:].to(device),  # noqa: E731
                                        chunk=chunk, memory_budget_mb=budget_mb)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = _rss_mb()
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    rec = {"package": package, "rows": rows, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
           "rss_before_mb": round(before, 1),
           "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "logits_sum": float(out[..., :classes].double().sum())}
    if device.startswith("cuda"):
        rec["peak_cuda_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return rec


V2_SWITCHES = dict(col_affine=False, col_feature_group="same", col_feature_group_size=3, col_target_aware=True,
                   col_ssmax="qassmax-mlp-elementwise", icl_ssmax="qassmax-mlp-elementwise", row_rope_interleaved=False)
PARITY = {  # release -> (official config, file name); v2 at the official class's defaults (its published sizes)
    "v1": ({**ARCHS["v1"], **V1_SWITCHES, "zero_init": False}, "tabicl-classifier-v1-20250208.ckpt"),
    "v1.1": ({**ARCHS["v1"], **V1_SWITCHES, "zero_init": False}, "tabicl-classifier-v1.1-20250506.ckpt"),
    "v2": ({"max_classes": 10, **V2_SWITCHES, "zero_init": False}, "tabicl-classifier-v2-20260212.ckpt"),
}


def parity_tables(seed: int = 0) -> dict:
    """The end-to-end tables: numeric, categorical with missing values, ten classes, 120 features."""
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(seed)
    n = 400
    num = pd.DataFrame(rng.normal(size=(n, 8)))
    cat = pd.DataFrame({"a": rng.normal(size=n), "c": rng.choice(list("xyzw"), size=n), "e": rng.exponential(size=n),
                        "k": rng.choice(["lo", "mid", "hi"], size=n)})
    cat.loc[rng.random(n) < 0.15, "a"] = np.nan
    cat.loc[rng.random(n) < 0.1, "c"] = None
    many = pd.DataFrame(rng.normal(size=(n, 6)))
    wide = pd.DataFrame(rng.normal(size=(n, 120)))
    return {"numeric": (num, (num[0] + num[1] ** 2 > 1).astype(int).to_numpy()),
            "categorical_missing": (cat, np.where((cat["c"] == "x") | (cat["e"] > 1.5), "yes", "no")),
            "ten_classes": (many, np.digitize(many[0] + 0.5 * many[1], np.quantile(many[0], np.linspace(0.1, 0.9, 9)))),
            "wide_120": (wide, (wide[0] - wide[7] > 0).astype(int).to_numpy())}


def run_parity(out: Path, threads: int) -> dict:
    """Logits of each release's architecture (random weights) and predict_proba on the parity tables, here against
    the official package, fp32 both."""
    import numpy as np
    import torch
    from tabicl import TabICLClassifier as OfficialClassifier
    from tabicl._model.inference_config import InferenceConfig
    from tabicl._model.tabicl import TabICL as Official

    from tabular import TabICLClassifier
    from tabular.weights_io import load_model

    torch.set_num_threads(threads)
    fp32 = InferenceConfig(COL_CONFIG={"use_amp": False}, ROW_CONFIG={"use_amp": False}, ICL_CONFIG={"use_amp": False})
    old = json.loads(out.read_text()) if out.is_file() else {}
    result = old if old.get("threads") == threads else {"threads": threads, "releases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for release, (cfg, name) in PARITY.items():
            if release in result["releases"]:
                continue
            torch.manual_seed(0)
            model = Official(**cfg).eval()
            path = Path(tmp) / name
            torch.save({"config": cfg, "state_dict": model.state_dict()}, path)
            ours = load_model(path)
            g = torch.Generator().manual_seed(1)
            X, y = torch.randn(2, 640, 20, generator=g), torch.randint(0, 10, (2, 512), generator=g)
            y[:, :10] = torch.arange(10)
            with torch.no_grad():
                ref = model(X, y, return_logits=True, inference_config=fp32)
                got = ours(X, y)[..., : ref.shape[-1]]
                once = ours.predict_once(X[:, :512], y, X[:, 512:], chunk=100, memory_budget_mb=1.0)[..., : ref.shape[-1]]
            rec = {"file": name, "version": ours.card["version"], "parameters": sum(p.numel() for p in ours.parameters()),
                   "logits_max_abs_diff": float((got - ref).abs().max()),
                   "logits_max_abs_diff_streamed": float((once - ref).abs().max()),
                   "logits_max_abs": float(ref.abs().max()),
                   "argmax_equal": bool(torch.equal(got.argmax(-1), ref.argmax(-1))), "tables": {}}
            for tname, (Xt, yt) in parity_tables().items():
                kw = dict(n_estimators=8, random_state=42)
                off = OfficialClassifier(model_path=path, allow_auto_download=False, device="cpu", use_amp=False, **kw)
                p_ref = off.fit(Xt[:300], yt[:300]).predict_proba(Xt[300:])
                p = TabICLClassifier(checkpoint=path, official=True, device="cpu", **kw).fit(Xt[:300], yt[:300]).predict_proba(Xt[300:])
                rec["tables"][tname] = {"proba_max_abs_diff": float(np.abs(p - p_ref).max()),
                                        "argmax_equal": bool(np.array_equal(p.argmax(1), p_ref.argmax(1))),
                                        "classes": int(p.shape[1])}
            result["releases"][release] = rec
            print(json.dumps({release: rec}), flush=True)
            _write(out, result)
    _write(out, result)
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_vs_official", description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="v1")
    p.add_argument("--rows", default="1000,2000,5000,10000", help="comma-separated train-row counts")
    p.add_argument("--features", type=positive_int, default=100)
    p.add_argument("--test-rows", type=positive_int, default=1000)
    p.add_argument("--classes", type=positive_int, default=2)
    p.add_argument("--threads", type=thread_count, default=1, help="torch threads for both packages")
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk", type=positive_int, default=2048, help="rows per chunk here")
    p.add_argument("--budget-mb", type=positive_int, default=2048, help="memory_budget_mb here")
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="runs per (rows, package), alternating the packages; the ratios use the fastest run of each")
    p.add_argument("--timeout", type=positive_int, default=3600, help="seconds per case; a case past it is recorded")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "tabular_vs_official.json")
    p.add_argument("--parity", action="store_true", help="instead: logits and predict_proba parity per release (--out)")
    p.add_argument("--case", choices=PACKAGES, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    return p


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise UsageError(f"--rows must be comma-separated positive ints, got {args.rows!r}") from None
    if not rows or min(rows) < 2 * args.classes:
        raise UsageError(f"--rows must be ints of at least 2 x --classes ({2 * args.classes}), got {args.rows!r}")
    if args.classes > ARCHS[args.arch]["max_classes"]:
        raise UsageError(f"--classes must be at most {ARCHS[args.arch]['max_classes']}, got {args.classes}")
    if args.parity:
        run_parity(args.out, args.threads)
        return 0
    if args.case:
        rec = run_case(args.case, args.ckpt, rows[0], args.features, args.test_rows, args.classes, args.threads,
                       args.device, args.chunk, args.budget_mb)
        print("RESULT " + json.dumps(rec))
        return 0
    settings = {k: v for k, v in vars(args).items() if k not in ("rows", "out", "case", "ckpt", "timeout", "repeats")}
    settings = {k: str(v) for k, v in settings.items()}
    old = json.loads(args.out.read_text()) if args.out.is_file() else {}
    result = old if old.get("settings") == settings else {"settings": settings, "cases": []}
    done = [(c["rows"], c["package"]) for c in result["cases"]]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / f"random_{args.arch}.ckpt"
        make_checkpoint(args.arch, ckpt)
        for n, rep, pkg in ((n, r, p) for n in rows for r in range(args.repeats) for p in (PACKAGES if r % 2 == 0 else PACKAGES[::-1])):
            if done.count((n, pkg)) > rep:
                continue
            cmd = [sys.executable, "-m", "benchmarks.tabular_vs_official", "--case", pkg, "--ckpt", str(ckpt),
                   "--rows", str(n), *sum(([f"--{k.replace('_', '-')}", str(getattr(args, k))] for k in
                                           ("arch", "features", "test_rows", "classes", "threads", "device",
                                            "chunk", "budget_mb")), [])]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                rec = json.loads(line[-1][7:]) if line else {
                    "package": pkg, "rows": n, "error": (p.stderr.strip().splitlines() or ["no output"])[-1][:300],
                    "returncode": p.returncode}
            except subprocess.TimeoutExpired:
                rec = {"package": pkg, "rows": n, "error": f"timeout after {args.timeout} s"}
            result["cases"].append(rec)
            print(json.dumps(rec), flush=True)
            result["ratios"] = ratios(result["cases"])
            _write(args.out, result)
    result["ratios"] = ratios(result["cases"])
    _write(args.out, result)
    return 0


def ratios(cases: list[dict]) -> list[dict]:
    """Per row count: here / official for wall time and CPU time (fastest run of each: on a shared machine the CPU
    time of a one-thread process is the steadier of the two) and peak RSS (largest run of each; CUDA peak when
    measured)."""
    out = []
    for n in sorted({c["rows"] for c in cases}):
        a, b = (_best([c for c in cases if c["rows"] == n and c["package"] == p]) for p in ("here", "official"))
        row = {"rows": n, "runs": sum(c["rows"] == n for c in cases)}
        if a and b and "wall_s" in a and "wall_s" in b:
            row["time_ratio"] = round(a["wall_s"] / b["wall_s"], 3)
            row["cpu_time_ratio"] = round(a["cpu_s"] / b["cpu_s"], 3)
            row["here_cpu_s"], row["official_cpu_s"] = a["cpu_s"], b["cpu_s"]
            row["here_peak_rss_mb"], row["official_peak_rss_mb"] = a["peak_rss_mb"], b["peak_rss_mb"]
            row["peak_rss_ratio"] = round(a["peak_rss_mb"] / b["peak_rss_mb"], 3)
            row["peak_rss_above_start_ratio"] = round((a["peak_rss_mb"] - a["rss_before_mb"])
                                                      / max(1.0, b["peak_rss_mb"] - b["rss_before_mb"]), 3)
            if "peak_cuda_mb" in a and "peak_cuda_mb" in b:
                row["peak_cuda_ratio"] = round(a["peak_cuda_mb"] / b["peak_cuda_mb"], 3)
            row["logits_sum_diff"] = abs(a["logits_sum"] - b["logits_sum"])
        out.append(row)
    return out


def _best(runs: list[dict]) -> dict | None:
    """The fastest wall time and the largest peaks of finished runs (None if none finished)."""
    ok = [c for c in runs if "wall_s" in c]
    if not ok:
        return None
    best = dict(min(ok, key=lambda c: c["wall_s"]))
    best["cpu_s"] = min(c["cpu_s"] for c in ok)
    for k in ("peak_rss_mb", "peak_cuda_mb"):
        if k in best:
            best[k] = max(c[k] for c in ok)
    best["rss_before_mb"] = min(c["rss_before_mb"] for c in ok)
    return best


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
