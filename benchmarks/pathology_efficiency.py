"""Slide-model cost as the number of patches grows: Querent vs dense attention (two ways), TransMIL, ABMIL.

Dense peers: ``dense`` runs exact attention through ``core.attention`` (on CPU the O(N)-memory ``chunked``
backend once the score matrix passes 512 MiB); ``dense-eager`` runs PyTorch's SDPA restricted to its MATH
kernel, which materialises the (heads, N, N) scores. ``--mem-limit-gb G`` lets a case allocate at most G GiB
beyond what it maps at its start; an allocation past that fails in the case's process and is recorded as
``oom`` (with the size it tried), and the model's larger sizes are then skipped.

Each (model, N, mode) case runs in a fresh process (``benchmarks.common.run_isolated``) on a bag of N
random D=512 features laid on a square patch grid. ``forward``: one eval-mode forward without autograd;
``train``: forward + backward + AdamW step. Peak memory is the case's growth of anonymous resident
memory (:class:`AnonPeak`, sampled every 5 ms; the file-page-inclusive ``VmHWM`` growth is recorded too as
``peak_hwm_mb``, but under memory pressure it under-reads; on CUDA, ``torch.cuda.max_memory_allocated``). Time is recorded on two clocks: wall
seconds and CPU seconds of the case's process (``cpu_s``; with one thread this is what the case takes on
an idle core, so it is robust to other jobs sharing the machine). Ratios are dense / Querent at the same N
on CPU seconds (``--clock wall`` for wall seconds).

A case that runs out of memory or crashes is recorded as an error, not dropped. A case that needs more
than ``--cpu-limit`` CPU seconds (or ``--timeout`` wall seconds) is stopped and recorded as timed out, with what it had reached when it was stopped (``cpu_s_at_timeout``, ``peak_mb_at_timeout``, read
from a progress file the case rewrites every second): lower bounds of its time and memory, from which the
table gives lower bounds of the ratios (``≥``). Once a model times out, its larger sizes in that mode,
and its training step at that size and above, are recorded as skipped, not run. Results are written after
every case; ``--resume`` keeps the finished cases of an earlier run with the same settings.

Attention FLOPs per layer (self-attention part only, multiply-adds ×2):
dense ``4·N²·dim``; Querent ``4·N·(M + topk)·R²·dim`` with ``M ≤ 9`` neighbour regions, plus the region
scores: ``--region-score max`` ``4·N·(N/R²)·head_dim·H`` (every query against every region's min/max),
``--region-score mean`` ``4·(N/R²)²·head_dim·H`` (one mean query per region).

    python -m benchmarks.pathology_efficiency --quick      # N = 1K, 4K, 16K
    python -m benchmarks.pathology_efficiency              # N = 1K, 4K, 16K, 64K, 100K
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.common import (PeakRSS, env_info, format_table, parse_size, read_json, read_parts, run_isolated,
                               write_json_atomic)

RESULTS = Path(__file__).resolve().parent / "results" / "pathology_efficiency.json"
MODELS = ("querent", "dense", "dense-eager", "transmil", "abmil")
#: Exact dense attention as most MIL code runs it: PyTorch's SDPA restricted to its MATH kernel, which
#: materialises the (heads, N, N) score and probability matrices. ``dense`` is the same model through
#: ``core.attention`` (``auto``), which on CPU switches to the O(N)-memory ``chunked`` backend.
EAGER = "dense-eager"
TABLE_COLUMNS = ["mode", "n", "model", "status", "seconds", "cpu_s", "peak_mb", "dense_over_querent_time",
                 "dense_over_querent_memory", "eager_over_querent_time", "eager_over_querent_memory", "ratio_note"]


def _status_kb(field: str) -> float:
    """A kB field of ``/proc/self/status`` (``RssAnon``, ``VmSize``, ...); NaN where the kernel lacks it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1])
    return float("nan")


def _anon_mb() -> float:
    """Anonymous resident memory of this process (MB): RSS without file pages, which the kernel may evict."""
    return _status_kb("RssAnon") / 1024


class AnonPeak:
    """Peak growth of anonymous resident memory, sampled every ``period_s`` by a daemon thread.

    ``VmHWM`` (:class:`benchmarks.common.PeakRSS`) counts file-backed pages too (the mapped torch
    libraries); under memory pressure the kernel evicts some of them during a long case, which hides
    part of the case's own growth. Anonymous memory cannot be evicted without swap, so its growth is the
    case's allocations; sampling can miss a spike shorter than the period.
    """

    method = "RssAnon growth, sampled every 5 ms"

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.base = _anon_mb()
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak = max(self.peak, _anon_mb() - self.base)

    def start(self) -> AnonPeak:
        self.base = _anon_mb()
        self.peak = 0.0
        self._thread.start()
        return self

    def peak_mb(self) -> float:
        return max(self.peak, _anon_mb() - self.base)

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_mb()


def _progress_writer(path: str, peak: AnonPeak, wall0: float, cpu0: float) -> threading.Event:
    """Rewrite ``path`` every second with the case's CPU seconds, wall seconds and peak so far (daemon thread)."""
    stop = threading.Event()

    def loop():
        while not stop.wait(1.0):
            try:
                write_json_atomic(path, {"cpu_s": time.process_time() - cpu0, "wall_s": time.perf_counter() - wall0,
                                         "peak_mb": peak.peak_mb()})
            except OSError:
                return

    threading.Thread(target=loop, daemon=True).start()
    return stop


def _case(model_name: str, n: int, mode: str, device: str, threads: int, region_score: str = "max",
          progress_file: str | None = None, cpu_limit: float | None = None, mem_limit_gb: float | None = None) -> dict:
    import contextlib

    import torch

    from pathology.mil import build_model
    from pathology.querent import QuerentConfig

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    side = math.ceil(math.sqrt(n))
    idx = torch.arange(n)
    coords = torch.stack([idx % side, idx // side], 1) * 256  # (N, 2) level-0 grid of 256-px patches
    feats = torch.randn(n, 512, device=device)
    coords = coords.to(device)
    cfg = QuerentConfig(in_dim=512, dim=256, depth=2, num_heads=4, region_size=8, topk=8, dropout=0.0,
                        region_score=region_score)
    model = build_model("dense" if model_name == EAGER else model_name, cfg).to(device)
    kernel = contextlib.nullcontext
    if model_name == EAGER:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        for blk in model.layers:
            blk.backend = "sdpa"

        def kernel():
            return sdpa_kernel(SDPBackend.MATH)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.startswith("cuda")

    def step():
        with kernel():
            return _step()

    def _step():
        if mode == "forward":
            model.eval()
            with torch.no_grad():
                out = model(feats, coords, patch_size_level0=256)
        else:
            model.train()
            out = model(feats, coords, patch_size_level0=256)
            loss = torch.nn.functional.cross_entropy(out.logits, torch.zeros(1, dtype=torch.long, device=device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        if cuda:
            torch.cuda.synchronize()
        return out

    peak = PeakRSS()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    if cpu_limit:  # the kernel stops the case (SIGXCPU) once it has used cpu_limit CPU seconds from here
        import resource

        soft = int(math.ceil(time.process_time() + cpu_limit))
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
    peak.start()
    anon = None if cuda else AnonPeak().start()
    t0, c0 = time.perf_counter(), time.process_time()
    stop = _progress_writer(progress_file, anon, t0, c0) if progress_file and not cuda else None
    if mem_limit_gb and not cuda:
        # Address-space cap, set after the sampling threads have their stacks: an allocation beyond it fails
        # in this process with an error instead of waking the machine's OOM killer.
        import resource

        cap = int(_status_kb("VmSize")) * 1024 + int(mem_limit_gb * 2**30)  # the cap counts from what the process maps already
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        step()
    except (torch.OutOfMemoryError, RuntimeError) as e:  # CPU allocation failures are plain RuntimeErrors
        msg = str(e)
        if "alloc" not in msg.lower() and "memory" not in msg.lower():
            raise
        if stop is not None:
            stop.set()
        tried = re.search(r"allocate (\d+) bytes", msg)
        return {"status": "oom", "model": model_name, "n": n, "mode": mode,
                "reason": f"out of memory{f' under a {mem_limit_gb:g} GiB cap' if mem_limit_gb else ''}: "
                          + msg.splitlines()[0][:300],
                "failed_alloc_bytes": int(tried.group(1)) if tried else None,
                "cpu_s_at_oom": time.process_time() - c0, "peak_mb_at_oom": None if cuda else anon.stop(),
                "mem_limit_gb": mem_limit_gb, "device": device, "threads": threads}
    first, first_cpu = time.perf_counter() - t0, time.process_time() - c0
    if stop is not None:
        stop.set()
    hwm_mb = None if cuda else peak.peak_mb()
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else anon.stop()
    times, cpu_times = [first], [first_cpu]
    if first < 5.0:  # small cases: median of a few more runs
        for _ in range(3):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    times.sort()
    cpu_times.sort()
    return {"status": "ok", "model": model_name, "n": n, "mode": mode, "seconds": times[len(times) // 2],
            "cpu_s": cpu_times[len(cpu_times) // 2], "first_s": first, "peak_mb": peak_mb, "peak_hwm_mb": hwm_mb,
            "peak_method": "cuda max_memory_allocated" if cuda else AnonPeak.method,
            "device": device, "threads": threads, "region_score": region_score}


def _run_case(args, model: str, n: int, mode: str) -> dict:
    """One case in a fresh process; a timeout comes back with the progress the case had reached."""
    fd, progress = tempfile.mkstemp(prefix="pathology_efficiency_", suffix=".json")
    os.close(fd)
    os.unlink(progress)
    try:
        r = run_isolated([sys.executable, "-m", "benchmarks.pathology_efficiency", "--case", model, str(n), mode,
                          "--device", args.device, "--threads", str(args.threads), "--region-score", args.region_score,
                          "--progress-file", progress, "--cpu-limit", str(args.cpu_limit)]
                         + (["--mem-limit-gb", str(args.mem_limit_gb)] if args.mem_limit_gb else []), timeout_s=args.timeout)
        reason = str(r.get("reason", ""))
        if r.get("status") != "ok" and (reason.startswith("timed out") or reason.startswith("exit code -24")):
            r["status"] = "timeout"
            r["reason"] = (f"stopped at the CPU limit of {args.cpu_limit:.0f} s" if reason.startswith("exit code -24")
                           else reason)
            reached = read_json(progress) if os.path.exists(progress) else None
            if reached:
                r.update(cpu_s_at_timeout=reached["cpu_s"], wall_s_at_timeout=reached["wall_s"],
                         peak_mb_at_timeout=reached["peak_mb"])
    finally:
        if os.path.exists(progress):
            os.unlink(progress)
    r.update(model=model, n=n, mode=mode)
    return r


def _skip_reason(rows: list[dict], model: str, n: int, mode: str) -> str | None:
    """Why a case is not run: the same model already timed out or ran out of memory at a smaller size, or in
    forward at this size."""
    for r in rows:
        if r["model"] != model or r.get("status") not in ("timeout", "oom"):
            continue
        what = "timed out" if r["status"] == "timeout" else "ran out of memory"
        if r["mode"] == mode and r["n"] < n:
            return f"skipped: {model} {mode} {what} at N={r['n']}"
        if mode == "train" and r["mode"] == "forward" and r["n"] <= n:
            return f"skipped: {model} forward {what} at N={r['n']}"
    return None


def _ratios(rows: list[dict], clock: str) -> None:
    """Peer / Querent time and memory at each N and mode for both dense peers (``dense_over_querent_*`` and
    ``eager_over_querent_*``); lower bounds where the peer timed out or ran out of memory."""
    key = "cpu_s" if clock == "cpu" else "seconds"
    for r in rows:
        for k in list(r):
            if k.startswith(("dense_over_querent", "eager_over_querent", "ratio_note")):
                r.pop(k)
        if r.get("status") != "ok" or r["model"] != "querent":
            continue
        notes = []
        for peer, prefix in (("dense", "dense"), (EAGER, "eager")):
            d = next((x for x in rows if x["model"] == peer and x["n"] == r["n"] and x["mode"] == r["mode"]), None)
            if d is None:
                continue
            if d.get("status") == "ok":
                r[f"{prefix}_over_querent_time"] = d[key] / max(r[key], 1e-9)
                r[f"{prefix}_over_querent_memory"] = d["peak_mb"] / max(r["peak_mb"], 1e-9)
            elif d.get("status") == "timeout" and "cpu_s_at_timeout" in d:
                reached = d["cpu_s_at_timeout"] if clock == "cpu" else d["wall_s_at_timeout"]
                r[f"{prefix}_over_querent_time"] = reached / max(r[key], 1e-9)
                r[f"{prefix}_over_querent_memory"] = d["peak_mb_at_timeout"] / max(r["peak_mb"], 1e-9)
                notes.append(f"lower bounds: {peer} timed out")
            elif d.get("status") == "oom":
                # It needed at least what it held plus the allocation that failed; time is not comparable.
                need_mb = max(d.get("peak_mb_at_oom") or 0.0, (d.get("failed_alloc_bytes") or 0) / 2**20)
                if need_mb > 0:
                    r[f"{prefix}_over_querent_memory"] = need_mb / max(r["peak_mb"], 1e-9)
                    notes.append(f"lower bound: {peer} ran out of memory")
        if notes:
            r["ratio_note"] = "; ".join(notes)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_efficiency", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 1K, 4K, 16K only")
    p.add_argument("--sizes", default=None, help="comma-separated N values, e.g. 1K,4K,64K")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default="forward,train")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--region-score", default="max", choices=("max", "mean"), help="Querent region scoring")
    p.add_argument("--timeout", type=float, default=3600.0, help="wall seconds per case (safety net)")
    p.add_argument("--cpu-limit", type=float, default=600.0,
                   help="CPU seconds per case; a case that needs more is stopped and recorded as timed out")
    p.add_argument("--mem-limit-gb", type=float, default=None,
                   help="address space a case may add to what it maps at its start (GiB): a case that needs more fails with an out-of-memory row "
                        "instead of waking the machine's OOM killer")
    p.add_argument("--clock", default="cpu", choices=("cpu", "wall"), help="time used for the ratios")
    p.add_argument("--resume", action="store_true", help="keep finished cases of an earlier run in --out")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="join the rows of result files made with the same settings into --out (ratios recomputed)")
    p.add_argument("--case", nargs=3, metavar=("MODEL", "N", "MODE"), help=argparse.SUPPRESS)
    p.add_argument("--progress-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.case[2], args.device, args.threads,
                               args.region_score, args.progress_file, args.cpu_limit, args.mem_limit_gb)))
        return 0
    if args.merge:
        return _merge(args.merge, args.out, args.clock)
    env = env_info()  # machine state when the run starts
    sizes = [parse_size(s) for s in (args.sizes or ("1K,4K,16K" if args.quick else "1K,4K,16K,64K,100K")).split(",")]
    config = {"in_dim": 512, "dim": 256, "depth": 2, "heads": 4, "region_size": 8, "topk": 8,
              "region_score": args.region_score, "device": args.device, "threads": args.threads,
              "timeout_s": args.timeout, "cpu_limit_s": args.cpu_limit, "mem_limit_gb": args.mem_limit_gb,
              "clock": args.clock}
    rows: list[dict] = []
    if args.resume:
        old = read_json(args.out)
        if old and old.get("config") == config:
            rows = [r for r in old["rows"] if r.get("status") in ("ok", "timeout", "oom", "error")]
            env = old.get("env", env)

    def save():
        _ratios(rows, args.clock)
        write_json_atomic(args.out, {"env": env, "config": config, "rows": rows})

    for mode in args.modes.split(","):
        for n in sizes:
            for m in args.models.split(","):
                if any(r["model"] == m and r["n"] == n and r["mode"] == mode for r in rows):
                    continue
                why = _skip_reason(rows, m, n, mode)
                r = {"status": "skipped", "reason": why, "model": m, "n": n, "mode": mode} if why else _run_case(args, m, n, mode)
                rows.append(r)
                if r.get("status") == "ok":
                    msg = f"{r['seconds']:.3f}s wall {r['cpu_s']:.3f}s cpu peak {r['peak_mb']:.0f} MB"
                elif r.get("status") == "oom":
                    msg = r["reason"]
                elif r.get("status") == "timeout":
                    msg = (f"timed out; reached {r.get('cpu_s_at_timeout', float('nan')):.0f}s cpu, "
                           f"peak {r.get('peak_mb_at_timeout', float('nan')):.0f} MB")
                else:
                    msg = r.get("reason", "error")
                print(f"{mode:7s} N={n:6d} {m:9s} {msg}", flush=True)
                save()
    save()
    print(format_table(rows, TABLE_COLUMNS))
    return 0


def _merge(paths: list[str], out: str, clock: str) -> int:
    """Join result files of parts of one run (same settings, e.g. models or sizes run side by side)."""
    parts = read_parts(paths)
    # Parts may differ in their limits (recorded per part); the model settings must agree.
    configs = [{k: v for k, v in d["config"].items() if k not in ("clock", "cpu_limit_s", "timeout_s", "mem_limit_gb")} for d in parts]
    if any(c != configs[0] for c in configs):
        raise SystemExit(f"the files were made with different settings: {configs}")
    for d in parts:
        for r in d["rows"]:
            r.setdefault("cpu_limit_s", d["config"].get("cpu_limit_s"))
    order = {m: i for i, m in enumerate(MODELS)}
    rows = sorted((r for d in parts for r in d["rows"]), key=lambda r: (r["mode"] != "forward", r["n"], order.get(r["model"], 99)))
    _ratios(rows, clock)
    write_json_atomic(out, {"env": [d["env"] for d in parts], "config": {**parts[0]["config"], "clock": clock},
                            "merged_from": [os.path.basename(p) for p in paths], "rows": rows})
    print(format_table(rows, TABLE_COLUMNS))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
