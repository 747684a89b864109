"""Peak memory of EMLoC and of every baseline against the full-context prefill, on a random model at
Qwen2-VL-2B's published shapes (28 layers, hidden 1536, 12 query / 2 key-value heads of 128, vocabulary 151,936,
the 32-block vision tower), on CPU, with K demonstrations of 448x448 images (256 image tokens each).

    python -m benchmarks.emloc_memory --demos 16,64 --out benchmarks/results/emloc_memory.json

Each case (policy, K) runs in a fresh process (``--worker``): the model is built (bf16, as the reference runs it;
the library's random initialisation), the demonstrations made, the peak mark reset, then ``compress_hf`` runs.
Recorded: ``rss_before_mb`` (weights and inputs), ``peak_mb`` (the growth above that at the peak: VmHWM after
clear_refs, see benchmarks/common.py), the time, the kept fraction and the size of the cache the policy returns.
Cases already in ``--parts`` are skipped (resumable; a case made with other settings is rerun).

Targets (issue): EMLoC's total peak <= 1.5 x the full prefill's; no baseline's growth above the full prefill's
growth + its own kept cache + one layer's working set, where one layer's working set is
``S * (3 * intermediate + 4 * hidden) * bytes`` (one decoder layer's MLP and attention activations in the model's
dtype) ``+ 256 * S * H_q * 4`` (one block of 256 scored query rows in fp32), ``S`` the demonstrations' tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import PeakRSS, env_info, format_table, portable_args, read_json, run_isolated, write_json_atomic

POLICIES = ("full", "emloc", "random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv")
LABELS = ("tabby cat", "red fox", "sea otter", "snow owl", "grey wolf")


def _settings(a) -> dict:
    return {"image_side": a.image_side, "chunk_demos": a.chunk_demos, "delta": a.delta, "dtype": a.dtype,
            "preset": a.preset, "window": a.window, "shape": a.shape}  # fmt: skip


def worker(a) -> dict:
    import torch

    from apps.emloc.hf import compress_hf
    from tools.reference.emloc import tiny
    from transformers import Qwen2VLForConditionalGeneration

    torch.set_num_threads(1)
    torch.manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[a.dtype]
    cfg = tiny.build_config(tiny.QWEN2VL_2B if a.shape == "2b" else tiny.TINY)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = Qwen2VLForConditionalGeneration(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    proc = tiny.build_processor(a.image_side)
    demos = [(img, LABELS[i % len(LABELS)]) for i, img in enumerate(tiny.images(a.k, seed=0, side=a.image_side))]
    keep = None if a.policy in ("full", "emloc") else a.keep
    mem = PeakRSS()
    mem.start()
    t0 = time.perf_counter()
    ctx = compress_hf(model, demos, processor=proc, policy=a.policy, keep=keep, delta=a.delta,
                      chunk_demos=a.chunk_demos, preset=a.preset, window=a.window, progress_bar=True)  # fmt: skip
    wall = time.perf_counter() - t0
    peak = mem.peak_mb()
    cache_mb = sum(l.keys.numel() * l.keys.element_size() * 2 for l in ctx.cache.layers) / 2**20
    t = cfg.text_config
    S = ctx.num_tokens
    bytes_ = torch.tensor([], dtype=dtype).element_size()
    layer_ws = (S * (3 * t.intermediate_size + 4 * t.hidden_size) * bytes_ + 256 * S * t.num_attention_heads * 4) / 2**20
    full_cache = S * t.num_hidden_layers * 2 * t.num_key_value_heads * (t.hidden_size // t.num_attention_heads)
    return {"status": "ok", "policy": a.policy, "demos": a.k, "tokens": S, "keep": keep,
            "rss_before_mb": mem.base_kb / 1024, "peak_mb": peak, "total_peak_mb": mem.base_kb / 1024 + peak,
            "memory_method": mem.method, "wall_s": wall, "kept_fraction": ctx.keep_fraction(), "cache_mb": cache_mb,
            "full_cache_mb": full_cache * bytes_ / 2**20, "layer_working_set_mb": layer_ws,
            "weights_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20,
            "settings": _settings(a)}  # fmt: skip


def summarise(cases: list[dict]) -> list[dict]:
    rows = []
    for k in sorted({c["demos"] for c in cases}):
        by = {c["policy"]: c for c in cases if c["demos"] == k and c.get("status") == "ok"}
        full = by.get("full")
        for pol in POLICIES:
            c = by.get(pol)
            if c is None:
                continue
            row = {"demos": k, "policy": pol, "tokens": c["tokens"], "kept": c["kept_fraction"],
                   "total peak MB": c["total_peak_mb"], "growth MB": c["peak_mb"], "cache MB": c["cache_mb"],
                   "s": c["wall_s"]}  # fmt: skip
            if full is not None:
                row["x full peak"] = c["total_peak_mb"] / full["total_peak_mb"]
                row["growth x full"] = c["peak_mb"] / full["peak_mb"]
                allowed = full["peak_mb"] + c["cache_mb"] + c["layer_working_set_mb"]
                row["growth allowed MB"] = allowed
                if pol == "emloc":
                    row["target"] = "met" if row["x full peak"] <= 1.5 else "not met"
                elif pol != "full":
                    row["target"] = "met" if c["peak_mb"] <= allowed else "not met"
            rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demos", default="16,64", help="comma-separated numbers of demonstrations")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--keep", type=float, default=None, help="budgeted policies' kept fraction (default: EMLoC's)")
    p.add_argument("--delta", type=float, default=0.005, help="EMLoC's JS bound")
    p.add_argument("--preset", default="default")
    p.add_argument("--chunk-demos", type=int, default=4)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--image-side", type=int, default=448)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--shape", default="2b", choices=["2b", "tiny"], help="Qwen2-VL-2B's shapes, or the tiny test model")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/emloc_memory.json"))
    p.add_argument("--parts", type=Path, default=None, help="per-case results (default: OUT without .json)/")
    p.add_argument("--timeout", type=float, default=4 * 3600)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--k", type=int, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        print(json.dumps(worker(a)))
        return 0
    from core.infra.guard import check_outputs

    parts = a.parts or a.out.with_suffix("")
    check_outputs([("--out", a.out), ("--parts", parts)])
    parts.mkdir(parents=True, exist_ok=True)
    cases = []
    for k in [int(x) for x in a.demos.split(",")]:
        keep = a.keep
        for pol in a.policies.split(","):
            if pol not in POLICIES:
                p.error(f"unknown policy {pol!r}; choose from {POLICIES}")
            path = parts / f"{pol}_{k}.json"
            done = read_json(path)
            want = _settings(a)
            if pol not in ("full", "emloc"):
                if keep is None:
                    em = read_json(parts / f"emloc_{k}.json")
                    keep = round(em["kept_fraction"], 4) if em and em.get("status") == "ok" else 0.25
                want["keep"] = keep
            if done and done.get("status") == "ok" and {**done["settings"], **({"keep": done["keep"]} if pol not in (
                    "full", "emloc") else {})} == want:  # fmt: skip
                cases.append(done)
                continue
            argv_w = [sys.executable, "-m", "benchmarks.emloc_memory", "--worker", "--policy", pol, "--k", str(k),
                      "--delta", str(a.delta), "--preset", a.preset, "--chunk-demos", str(a.chunk_demos),
                      "--window", str(a.window), "--image-side", str(a.image_side), "--dtype", a.dtype,
                      "--shape", a.shape]  # fmt: skip
            if pol not in ("full", "emloc"):
                argv_w += ["--keep", str(keep)]
            print(f"running {pol} with {k} demonstrations ...", file=sys.stderr, flush=True)
            res = run_isolated(argv_w, timeout_s=a.timeout, env={"OMP_NUM_THREADS": "1"})
            res.setdefault("policy", pol)
            res.setdefault("demos", k)
            res["settings"] = {**want}
            res["settings"].pop("keep", None)
            write_json_atomic(path, res)
            cases.append(res)
            print(json.dumps({k2: res.get(k2) for k2 in ("policy", "demos", "status", "total_peak_mb", "peak_mb",
                                                          "wall_s", "reason")}), file=sys.stderr, flush=True)  # fmt: skip
    rows = summarise(cases)
    cols = ["demos", "policy", "tokens", "kept", "total peak MB", "x full peak", "growth MB", "growth x full",
            "growth allowed MB",
            "cache MB", "s", "target"]  # fmt: skip
    print(format_table(rows, cols))
    write_json_atomic(a.out, {"benchmark": "emloc_memory", "args": portable_args(a), "env": env_info(),
                              "model": "random Qwen2-VL-2B shapes (tools/reference/emloc/tiny.py QWEN2VL_2B)",
                              "cases": cases, "rows": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
