"""Peak memory of one TabICL fine-tuning step against the estimate the estimator plans with.

``TabICLClassifier(finetune_steps=N)`` sizes each step's table from ``memory_budget_mb`` with
:func:`tabular.finetune.row_bytes` (bytes per row of one view, forward activations kept for the backward pass
and their gradients). This measures what a step really holds: for each checkpoint and feature count a fresh
process loads the model and measures the growth of the process's peak resident set (``VmHWM`` after
``clear_refs``) over the first step of :func:`tabular.finetune.finetune` (optimizer state included; a later step
reuses the allocator's pools, so its growth understates what fine-tuning adds to a fitted estimator) on ``VIEWS``
views of ``--rows`` rows of a synthetic 2-class table (the loop's own draw: 70% context, 30% query rows).
Recorded: the growth in KB per row of one view, next to ``row_bytes``; at full-size steps the estimate should not
be below the measurement (on small steps fixed costs dominate; ``RESERVE_MB`` of the budget is kept for them).

    python -m benchmarks.tabular_finetune_memory                # shipped small and medium, 20 / 50 / 100 features
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.common import PeakRSS, env_info, format_table, run_isolated, write_json_atomic

RESULTS = Path(__file__).resolve().parent / "results" / "tabular_finetune_memory.json"
WEIGHTS = Path(__file__).resolve().parents[1] / "tabular" / "weights"


def _case(checkpoint: str, features: int, rows: int, threads: int) -> dict:
    import numpy as np
    import torch

    from tabular.finetune import VIEWS, finetune, row_bytes
    from tabular.weights_io import load_model

    torch.set_num_threads(threads)
    model = load_model(checkpoint)
    cfg = model.config
    X = np.random.default_rng(0).standard_normal((rows, features), dtype=np.float32)
    labels = (X[:, 0] > 0).astype(np.int64)

    def make_batch(order, yy, rng):  # VIEWS copies of the drawn rows, as the estimator stacks its views
        return (torch.from_numpy(np.stack([X[order]] * VIEWS)), torch.from_numpy(np.stack([yy] * VIEWS)))

    peak = PeakRSS()
    peak.start()
    c0 = time.process_time()
    # One step of the estimator's fine-tuning loop (stratified draw, AdamW, clipping), the first: what fine-tuning
    # adds to a fitted estimator's memory, optimizer state included.
    res = finetune(model, labels, np.arange(rows), make_batch, n_classes=2, steps=1, lr=1e-5, seed=0, max_rows=rows)
    grow = peak.peak_mb()
    measured = grow * 2**20 / (VIEWS * res.rows_per_step)
    est = row_bytes(cfg.embed_dim, features)
    return {"status": "ok", "checkpoint": Path(checkpoint).name, "embed_dim": cfg.embed_dim, "icl_dim": cfg.icl_dim,
            "icl_blocks": cfg.icl_blocks, "features": features, "rows": res.rows_per_step, "views": VIEWS,
            "step_cpu_s": time.process_time() - c0, "peak_growth_mb": grow, "peak_method": peak.method,
            "measured_kb_per_row": measured / 1024, "row_bytes_kb": est / 1024,
            "estimate_over_measured": est / measured if measured > 0 else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tabular_finetune_memory", description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoints", nargs="+", default=[str(WEIGHTS / "tabicl_small.safetensors"),
                                                        str(WEIGHTS / "tabicl_medium.safetensors")])
    p.add_argument("--features", nargs="+", type=int, default=[20, 50, 100])
    p.add_argument("--rows", type=int, default=1024, help="rows of each view's table (the step size at a wide budget)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--case", nargs=2, metavar=("CHECKPOINT", "FEATURES"), help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    if args.case:
        print(json.dumps(_case(args.case[0], int(args.case[1]), args.rows, args.threads)))
        return 0
    results, env = [], env_info()
    rec = {**vars(args), "out": args.out.name, "checkpoints": [Path(c).name for c in args.checkpoints]}
    for ck in args.checkpoints:
        for f in args.features:
            cmd = [sys.executable, "-m", "benchmarks.tabular_finetune_memory", "--case", ck, str(f),
                   "--rows", str(args.rows), "--threads", str(args.threads)]
            res = run_isolated(cmd, timeout_s=args.timeout)
            res.setdefault("checkpoint", Path(ck).name)
            res.setdefault("features", f)
            print(json.dumps(res), file=sys.stderr, flush=True)
            results.append(res)
            write_json_atomic(args.out, {"env": env, "args": rec, "cases": results})
    ok = [r for r in results if r.get("status") == "ok"]
    print(format_table(ok, ["checkpoint", "features", "rows", "peak_growth_mb", "measured_kb_per_row", "row_bytes_kb",
                            "estimate_over_measured", "step_cpu_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
