"""``"longctx"`` against transformers' ``sdpa`` and ``eager`` on a real architecture: prefill time and peak memory.

The model is a random Qwen2 (``transformers.Qwen2ForCausalLM``) of tiny width and enough depth that attention
dominates at long context: hidden 64, one 64-dim attention head and one key/value head, 4 layers, vocabulary 256,
fp32, eval mode, weights seeded identically in every case. One forward over the prompt with ``use_cache=True``
(a prefill) per timed call.

Cases (each in a fresh subprocess, :func:`benchmarks.common.run_isolated`):
    causal: one sequence of ``S`` tokens, no attention mask (transformers' ``sdpa`` then runs PyTorch's fused
        causal kernel without a mask: its best case).
    padded: a batch of two, the second left-padded by ``S / 8`` tokens (an ``attention_mask`` with zeros, so
        transformers builds an explicit ``(B, 1, S, S)`` mask for ``sdpa`` and ``eager``; ``longctx`` keeps
        the ``(B, S)`` key padding).

Measured per case: median wall time of ``--repeats`` timed prefills after one warm-up
(``benchmarks.common.time_call``; 3 by default, also past 5 s), every time kept, and
the peak resident-memory growth during it (``benchmarks.common.PeakRSS``: the ``VmHWM`` high-water mark reset
after the model and inputs exist). A case that does not finish inside ``--memory-limit-gb`` (an address-space
limit set in the subprocess: the allocation fails) or ``--timeout`` is recorded with its reason; ``eager`` is
not started where its score and mask tensors alone (``B · H · S²`` elements, three times: mask, scores,
softmax) exceed the limit (on CUDA: the GPU's memory). The last position's logits of every finished case are
compared with ``longctx``'s (max abs difference), so a fast wrong answer cannot pass.

Ratios are ``longctx / peer`` for time and memory (below 1: ``longctx`` is faster / leaner), within one thread count.
Threads: ``--threads 1,2`` runs every case at each count (``torch.set_num_threads`` and ``OMP_NUM_THREADS`` in the
case's process). The machine may be shared: each row records the 1-minute load average (``os.getloadavg``) before
and after its process, and ``--max-load L`` waits (up to ``--load-wait-s``) before each case until the load is
below ``L``; a row whose load rose above it is marked ``loaded`` (rerun those).
FLOPs of attention per layer: ``4 · B · H · S² · D / 2`` (causal: half the score matrix).

Usage:
    python -m benchmarks.hf_attention                       # S = 4K, 16K, 32K on CPU
    python -m benchmarks.hf_attention --sizes 4K --quick
    python -m benchmarks.hf_attention --sizes 4K,32K --cases padded --threads 1,2 --max-load 1.5
    python -m benchmarks.hf_attention --device cuda --dtype bfloat16 --sizes 32K,128K   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import (
    PeakRSS,
    env_info,
    format_table,
    parse_size,
    portable_args,
    run_isolated,
    time_call,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "hf_attention.json"
IMPLS = ("longctx", "sdpa", "eager")
CASES = ("causal", "padded")
MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=1,
             num_key_value_heads=1, max_position_embeddings=1 << 18, rope_theta=10000.0)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.hf_attention",
                                description="Prefill time and peak memory: longctx vs transformers' sdpa and eager.")
    p.add_argument("--sizes", default="4K,16K,32K", help="comma-separated prompt lengths (default 4K,16K,32K)")
    p.add_argument("--cases", default=",".join(CASES), help=f"subset of {CASES}")
    p.add_argument("--impls", default=",".join(IMPLS), help=f"subset of {IMPLS}")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=_thread_list, default=[2], help="torch intra-op threads on CPU, a comma-separated "
                   "list runs each (default 2)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed prefills per case after one warm-up (median; 3)")
    p.add_argument("--interleave", action="store_true", help="also time the implementations in alternation in one "
                   "process per case (the fairer ratio on a shared machine; memory still from the isolated runs)")
    p.add_argument("--max-load", type=float, default=None, help="wait before each case until the 1-minute load "
                   "average is below this (default: do not wait)")
    p.add_argument("--load-wait-s", type=float, default=600.0, help="longest wait for --max-load per case (600 s)")
    p.add_argument("--memory-limit-gb", type=float, default=20.0, help="address-space cap per case on CPU (GiB)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per case (default 1800)")
    p.add_argument("--quick", action="store_true", help="one timed run per case")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="result JSON (written atomically)")
    p.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    return p


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return n


def _thread_list(text: str) -> list[int]:
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"threads must be positive ints separated by commas, got {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"threads must be positive ints separated by commas, got {text!r}")
    return counts


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _wait_for_load(max_load: float | None, wait_s: float) -> float | None:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``wait_s``); returns the last load."""
    load = _load()
    deadline = time.monotonic() + wait_s
    while max_load is not None and load is not None and load >= max_load and time.monotonic() < deadline:
        time.sleep(10)
        load = _load()
    return load


def _dense_bytes(batch: int, S: int) -> int:
    return batch * MODEL["num_attention_heads"] * S * S * 4


def _setup(spec: dict):
    """The model (implementation ``spec["impl"]``), the inputs and a prefill function for one case."""
    import torch
    from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    from core.hf import register

    register()
    torch.manual_seed(0)
    cfg = Qwen2Config(**MODEL)
    model = Qwen2ForCausalLM(cfg).to(device=device, dtype=dtype).eval()
    model.set_attn_implementation(spec["impl"])
    S, batch = spec["S"], (1 if spec["case"] == "causal" else 2)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, MODEL["vocab_size"], (batch, S), generator=g).to(device)
    kwargs = {}
    if spec["case"] == "padded":
        mask = torch.ones(batch, S, dtype=torch.long)
        mask[1, : S // 8] = 0
        kwargs["attention_mask"] = mask.to(device)

    def prefill():
        with torch.no_grad():
            return model(input_ids=ids, past_key_values=DynamicCache(config=cfg), use_cache=True, **kwargs).logits

    return model, prefill, device, S, batch


def run_interleaved(spec: dict) -> dict:
    """Every implementation of ``spec["impls"]`` on one model in this process, timed in alternation (one warm-up
    each, then ``repeats`` rounds, the order reversed every other round): load changes on a shared machine hit
    every implementation alike, so the ratio of the medians is the fairer one. No memory is measured here."""
    import torch

    model, prefill, device, S, batch = _setup({**spec, "impl": spec["impls"][0]})
    times: dict[str, list[float]] = {impl: [] for impl in spec["impls"]}
    for impl in spec["impls"]:
        model.set_attn_implementation(impl)
        prefill()
    for r in range(spec["repeats"]):
        for impl in spec["impls"] if r % 2 == 0 else spec["impls"][::-1]:
            model.set_attn_implementation(impl)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            prefill()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[impl].append(time.perf_counter() - t0)
    return {"interleaved": {impl: {"median_s": statistics.median(t), "times_s": t} for impl, t in times.items()},
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def run_case(spec: dict) -> dict:
    """One (impl, case, S) in this process; returns the measurement."""
    import torch

    if spec.get("impls"):
        return run_interleaved(spec)
    model, prefill, device, S, batch = _setup(spec)
    out = {"impl": spec["impl"], "case": spec["case"], "S": S, "batch": batch}
    peak = PeakRSS() if device.type == "cpu" else None
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        peak.start()
    try:
        timing = time_call(prefill, reps=1 if spec["quick"] else spec.get("repeats", 3), warmup=1,
                           slow_s=float("inf"))
        if device.type == "cuda":
            torch.cuda.synchronize()
    except (RuntimeError, MemoryError) as err:  # an allocation past the cap
        return {**out, "status": "skipped", "reason": f"did not fit: {str(err).splitlines()[0][:160]}"}
    if device.type == "cuda":
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        out["peak_mb"], out["peak_method"] = peak.peak_mb(), peak.method
    last = prefill()[:, -1].float().cpu()
    return {**out, "status": "ok", "median_s": timing["median_s"], "times_s": timing["times_s"],
            "torch_threads": torch.get_num_threads(), "last_logits": last.tolist()}  # fmt: skip


def _limit_memory(gb: float) -> None:
    cap = int(gb * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.case:
        spec = json.loads(args.case)
        if spec["device"] == "cpu" and spec.get("memory_limit_gb"):
            _limit_memory(spec["memory_limit_gb"])
        print(json.dumps(run_case(spec)))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError as err:
        print(f"error: --sizes: {err}", file=sys.stderr)
        return 2
    cases = [c for c in args.cases.split(",") if c]
    impls = [i for i in args.impls.split(",") if i]
    bad = [c for c in cases if c not in CASES] + [i for i in impls if i not in IMPLS]
    if bad:
        print(f"error: unknown case or implementation {bad}; accepted: {CASES} and {IMPLS}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        cap_bytes, cap_name = args.memory_limit_gb * 2**30, "cap"
    else:
        import torch

        cap_bytes, cap_name = torch.cuda.get_device_properties(0).total_memory, "of GPU memory"
    rows = []
    for S in sizes:
        for threads in args.threads:
            for case in cases:
                rows += _run_group(args, S, threads, case, impls, cap_bytes, cap_name)
    for r in rows:
        r.pop("last_logits", None)
    result = {"benchmark": "hf_attention", "args": portable_args(args), "model": MODEL, "device": args.device,
              "dtype": args.dtype, "threads": args.threads, "repeats": args.repeats, "max_load": args.max_load,
              "memory_limit_gb": args.memory_limit_gb, "env": env_info(), "rows": rows}  # fmt: skip
    write_json_atomic(args.out, result)
    cols = ["S", "threads", "case", "impl", "status", "median_s", "peak_mb", "time_ratio_longctx_over_this",
            "memory_ratio_longctx_over_this", "max_abs_diff_vs_longctx", "load_before", "load_after",
            "interleaved_time_ratio_longctx_over_this", "reason"]  # fmt: skip
    print(format_table(rows, cols))
    print(f"wrote {args.out}")
    return 0


def _run_group(args, S: int, threads: int, case: str, impls: list[str], cap_bytes: float, cap_name: str) -> list[dict]:
    """Every implementation on one (S, threads, case), each in its own process; ratios against ``longctx``."""
    group = []
    for impl in impls:
        batch = 1 if case == "causal" else 2
        base = {"impl": impl, "case": case, "S": S, "batch": batch, "threads": threads}
        spec = {"impl": impl, "case": case, "S": S, "device": args.device, "dtype": args.dtype, "threads": threads,
                "quick": args.quick, "repeats": args.repeats, "memory_limit_gb": args.memory_limit_gb}  # fmt: skip
        need = 3 * _dense_bytes(batch, S) * (1 if args.dtype == "float32" else 0.5)
        if impl == "eager" and need > cap_bytes:
            res = {**base, "status": "skipped", "reason": f"its mask, scores and softmax take {need / 2**30:.0f} GiB, "
                                                          f"over the {cap_bytes / 2**30:.0f} GiB {cap_name}"}  # fmt: skip
        else:
            load_before = _wait_for_load(args.max_load, args.load_wait_s)
            logger.info("S=%d threads=%d %s %s (load %s) ...", S, threads, case, impl, load_before)
            res = run_isolated([sys.executable, "-m", "benchmarks.hf_attention", "--case", json.dumps(spec)],
                               timeout_s=args.timeout, env={"OMP_NUM_THREADS": str(threads)})  # fmt: skip
            res = {**base, **res, "load_before": load_before, "load_after": _load()}
            if args.max_load is not None and max(res["load_before"] or 0, res["load_after"] or 0) >= args.max_load:
                res["loaded"] = True
        logger.info("  %s", {k: v for k, v in res.items() if k not in ("last_logits", "times_s")})
        group.append(res)
    ran = [r["impl"] for r in group if r.get("status") == "ok"]
    if args.interleave and "longctx" in ran and len(ran) > 1:
        spec = {"impls": ran, "case": case, "S": S, "device": args.device, "dtype": args.dtype, "threads": threads,
                "repeats": args.repeats, "memory_limit_gb": args.memory_limit_gb}  # fmt: skip
        load_before = _wait_for_load(args.max_load, args.load_wait_s)
        logger.info("S=%d threads=%d %s interleaved %s (load %s) ...", S, threads, case, ran, load_before)
        inter = run_isolated([sys.executable, "-m", "benchmarks.hf_attention", "--case", json.dumps(spec)],
                             timeout_s=args.timeout, env={"OMP_NUM_THREADS": str(threads)})  # fmt: skip
        for r in group:
            got = inter.get("interleaved", {}).get(r["impl"])
            if got is not None:
                r.update(interleaved_median_s=got["median_s"], interleaved_times_s=got["times_s"],
                         interleaved_load=[load_before, _load()])  # fmt: skip
        ours_i = inter.get("interleaved", {}).get("longctx")
        for r in group:
            if ours_i is not None and "interleaved_median_s" in r:
                r["interleaved_time_ratio_longctx_over_this"] = ours_i["median_s"] / r["interleaved_median_s"]
        logger.info("  interleaved: %s", {k: v["median_s"] for k, v in inter.get("interleaved", {}).items()})
    ours = next((r for r in group if r["impl"] == "longctx" and r.get("status") == "ok"), None)
    for r in group:
        if ours is not None and r.get("status") == "ok":
            import torch

            r["max_abs_diff_vs_longctx"] = float(
                (torch.tensor(r["last_logits"]) - torch.tensor(ours["last_logits"])).abs().max())
            r["time_ratio_longctx_over_this"] = ours["median_s"] / r["median_s"]
            r["memory_ratio_longctx_over_this"] = ours["peak_mb"] / max(r["peak_mb"], 1e-9)
    return group


if __name__ == "__main__":
    sys.exit(main())
