"""Slide-model cost as the number of patches grows: Querent vs dense attention, TransMIL, ABMIL.

Each (model, N, mode) case runs in a fresh process (``benchmarks.common.run_isolated``) on a bag of N
random D=512 features laid on a square patch grid. ``forward``: one eval-mode forward without autograd;
``train``: forward + backward + AdamW step. Peak memory is the case's resident-set growth
(``PeakRSS``; on CUDA, ``torch.cuda.max_memory_allocated``). A case that times out or runs out of memory
is recorded as an error, not dropped. Ratios are dense / Querent at the same N.

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
import sys
import time
from pathlib import Path

from benchmarks.common import PeakRSS, env_info, format_table, parse_size, run_isolated, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "pathology_efficiency.json"
MODELS = ("querent", "dense", "transmil", "abmil")


def _case(model_name: str, n: int, mode: str, device: str, threads: int, region_score: str = "max") -> dict:
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
    model = build_model(model_name, cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cuda = device.startswith("cuda")

    def step():
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
    peak.start()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else peak.peak_mb()
    times = [first]
    if first < 5.0:  # small cases: median of a few more runs
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    times.sort()
    return {"status": "ok", "model": model_name, "n": n, "mode": mode, "seconds": times[len(times) // 2],
            "first_s": first, "peak_mb": peak_mb, "peak_method": "cuda max_memory_allocated" if cuda else peak.method,
            "device": device, "threads": threads, "region_score": region_score}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_efficiency", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="N = 1K, 4K, 16K only")
    p.add_argument("--sizes", default=None, help="comma-separated N values, e.g. 1K,4K,64K")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default="forward,train")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--region-score", default="max", choices=("max", "mean"), help="Querent region scoring")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per case")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--case", nargs=3, metavar=("MODEL", "N", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.case[2], args.device, args.threads,
                               args.region_score)))
        return 0
    env = env_info()  # machine state when the run starts
    sizes = [parse_size(s) for s in (args.sizes or ("1K,4K,16K" if args.quick else "1K,4K,16K,64K,100K")).split(",")]
    rows = []
    for mode in args.modes.split(","):
        for n in sizes:
            for m in args.models.split(","):
                r = run_isolated([sys.executable, "-m", "benchmarks.pathology_efficiency", "--case", m, str(n), mode,
                                  "--device", args.device, "--threads", str(args.threads),
                                  "--region-score", args.region_score], timeout_s=args.timeout)
                r.update(model=m, n=n, mode=mode)
                rows.append(r)
                print(f"{mode:7s} N={n:6d} {m:9s} " + (f"{r['seconds']:.3f}s peak {r['peak_mb']:.0f} MB"
                      if r.get("status") == "ok" else r.get("reason", "error")), flush=True)
    for r in rows:
        if r.get("status") != "ok" or r["model"] != "querent":
            continue
        d = next((x for x in rows if x["model"] == "dense" and x["n"] == r["n"] and x["mode"] == r["mode"]), None)
        if d and d.get("status") == "ok":
            r["dense_over_querent_time"] = d["seconds"] / r["seconds"]
            r["dense_over_querent_memory"] = d["peak_mb"] / max(r["peak_mb"], 1e-9)
    write_json_atomic(args.out, {"env": env, "config": {"in_dim": 512, "dim": 256, "depth": 2, "heads": 4,
                                                               "region_size": 8, "topk": 8, "region_score": args.region_score},
                                 "rows": rows})
    print(format_table(rows, ["mode", "n", "model", "status", "seconds", "peak_mb", "dense_over_querent_time",
                              "dense_over_querent_memory"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
