"""CPU attention benchmark: dense backends, block-sparse attention and FlexAttention, side by side.

Every case (one backend at one sequence length) runs in a fresh subprocess with the same seeded inputs
``q, k, v`` of shape ``(B, H, S, D)`` in float32, non-causal self-attention. For each case we record the
median wall time (fewer repetitions at large ``S``: a first call slower than 5 s is the only run) and the
peak resident-memory growth of the case (``benchmarks.common.PeakRSS``: the kernel's ``VmHWM`` high-water
mark reset after the inputs exist, so inputs are not counted).

Cases:
    sdpa, chunked, reference: ``core.attention.attention(..., backend=name)``. ``reference`` materialises
        the ``S × S`` scores and is skipped (with the reason recorded) when they would exceed
        ``--max-dense-gb``; ``chunked`` is skipped when ``core.attention.BACKENDS`` has no such entry.
    blocksparse-k{K}: ``core.blocksparse.select_blocks`` (Quest bound, top-K key blocks of ``--block-size``
        per query block, first and diagonal blocks always kept) then ``block_sparse_attention``; selection
        and attention are timed separately and together.
    blocksparse-{P}%: the same with ``K = round(P% · NK)`` blocks (``--density``), the ~10% target.
    blocksparse-b{N}-{P}%: the ~10% case with key/query blocks of ``N`` rows (``--extra-block-sizes``),
        ``K = round(P% · S/N)``; the dense rows it is compared with do not depend on the block size.
    flex-k{K} / flex-{P}%: ``torch.nn.attention.flex_attention`` compiled with ``torch.compile`` (eager
        flex ignores block sparsity and materialises the full scores) on a ``BlockMask.from_kv_blocks``
        built from the very same block index, so it computes the same attention; selection time excluded,
        compile time reported as ``first_call_s``.

Large sizes: above ``--dense-query-rows`` (default 4K) the dense backends run the first 4K queries against
all ``S`` keys and their time is scaled by ``S / 4K`` (non-causal dense cost is exactly linear in the number
of queries); such rows carry ``extrapolated_from_query_rows`` and a note, and their peak memory is that of
the sliced run. Block-sparse and flex always run the full ``S``. Use ``--dense-query-rows 0`` for full runs.

FLOPs (two matmuls, multiply-add = 2): dense ``4 · B · H · S_q · S_k · D``; block-sparse and flex
``4 · B · H · S_q · S_k · D · density`` where density is the selected fraction of (query block, key block)
pairs. Ratios are ``time(best dense backend at that S) / time(case)``: above 1 is faster than dense.

Usage:
    python -m benchmarks.attention_cpu                      # S = 1K, 4K, 16K, 64K
    python -m benchmarks.attention_cpu --sizes 1K,4K --quick
    python -m benchmarks.attention_cpu --sizes 64K --resume # add sizes to an existing JSON
    python -m benchmarks.attention_cpu --sizes 64K --resume --extra-block-sizes 128 --cases blocksparse-b128
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.common import (
    PeakRSS,
    env_info,
    format_table,
    parse_size,
    read_json,
    run_isolated,
    time_call,
    write_json_atomic,
)

logger = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "attention_cpu.json"
DENSE = ("sdpa", "chunked", "reference")


def dense_flops(B: int, H: int, S: int, D: int) -> float:
    """``4 · B · H · S_q · S_k · D``: QKᵀ and PV, 2 FLOPs per multiply-add (self-attention, S_q = S_k = S)."""
    return 4.0 * B * H * S * S * D


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.attention_cpu",
        description="Time and peak memory of CPU attention backends, block-sparse attention and FlexAttention.",
    )
    p.add_argument("--sizes", default="1K,4K,16K,64K", help="comma-separated sequence lengths (default 1K,4K,16K,64K)")
    p.add_argument("--quick", action="store_true", help="1K and 4K only (unless --sizes), 1 timed rep, no flex")
    p.add_argument("--heads", type=int, default=8, help="heads H (default 8)")
    p.add_argument("--dim", type=int, default=64, help="head dim D (default 64)")
    p.add_argument("--batch", type=int, default=1, help="batch B (default 1)")
    p.add_argument("--block-size", type=int, default=64, help="block-sparse block size (default 64)")
    p.add_argument("--topk", type=int, default=8, help="key blocks per query block (default 8)")
    p.add_argument("--density", type=float, default=0.10, help="second block-sparse case at this block fraction (default 0.10; 0 = off)")
    p.add_argument("--extra-block-sizes", default="",
                   help="comma-separated further block sizes for the --density case, run as blocksparse-b{N}-{P}%% "
                        "(e.g. 128; default none)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions at small sizes (default 3)")
    p.add_argument("--max-dense-gb", type=float, default=4.0, help="skip 'reference' when its S×S scores exceed this (default 4)")
    p.add_argument("--case-timeout", type=float, default=3600.0, help="seconds per case before it is recorded as failed")
    p.add_argument("--no-flex", action="store_true", help="skip the FlexAttention peer")
    p.add_argument("--flex-min-size", default="4K", help="run the FlexAttention peer from this S on (default 4K; compiles per size)")
    p.add_argument("--dense-query-rows", default="4K",
                   help="above this S, time dense backends on this many query rows (all keys) and scale the time by "
                        "S/rows, marked as extrapolated (default 4K; 0 = always the full S)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per case (default: torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time to report: wall, or process CPU time (with --threads 1: robust on a shared machine)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="JSON output (default benchmarks/results/attention_cpu.json)")
    p.add_argument("--resume", action="store_true", help="keep finished cases of the existing JSON (same H, D, B, block, k) and run the rest")
    p.add_argument("--cases", default=None,
                   help="comma-separated case-name prefixes to run (e.g. blocksparse,flex); with --resume they are re-run")
    p.add_argument("--print-only", action="store_true", help="print the table of the existing JSON and exit")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # internal: run one case, print JSON
    return p


# ------------------------------------------------------------------------------------------- one case


def _inputs(cfg: dict):
    import torch

    g = torch.Generator().manual_seed(cfg["seed"])
    shape = (cfg["batch"], cfg["heads"], cfg["S"], cfg["dim"])
    return tuple(torch.randn(shape, generator=g) for _ in range(3))


def _run_case(cfg: dict) -> dict:
    """Runs inside the child process: build inputs, reset the memory mark, time the case."""
    import torch

    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    q, k, v = _inputs(cfg)
    name, S, bs = cfg["case"], cfg["S"], cfg["block_size"]
    B, H, D = cfg["batch"], cfg["heads"], cfg["dim"]
    reps = cfg["reps"]
    clock = cfg.get("clock", "wall")
    mem = PeakRSS()
    result: dict = {"status": "ok"}
    with torch.no_grad():
        if name in DENSE:
            from core.attention import attention

            rows = cfg.get("query_rows") or S
            q_run = q[:, :, :rows].contiguous()  # (B, H, rows, D): all S keys, the first `rows` queries
            mem.start()
            t = time_call(lambda: attention(q_run, k, v, backend=name), reps=reps, clock=clock)
            result.update(t, density=1.0)
            if rows < S:  # non-causal dense cost is exactly linear in the number of query rows
                result.update(
                    measured_s=t["median_s"],
                    median_s=t["median_s"] * S / rows,
                    wall_s=t["wall_s"] * S / rows,
                    cpu_s=t["cpu_s"] * S / rows,
                    extrapolated_from_query_rows=rows,
                    reason=f"time = {rows} query rows x {S / rows:g}; peak at {rows} rows",
                )
        else:
            from core.blocksparse import block_density, block_sparse_attention, select_blocks

            nk = math.ceil(S / bs)
            topk = cfg["topk"]
            select = lambda: select_blocks(q, k, block_size=bs, topk=topk)  # noqa: E731
            if name.startswith("blocksparse"):
                mem.start()
                ts = time_call(select, reps=reps, clock=clock)
                idx = select()
                ta = time_call(lambda: block_sparse_attention(q, k, v, idx, block_size=bs), reps=reps, clock=clock)
                result.update(
                    median_s=ts["median_s"] + ta["median_s"],
                    wall_s=ts["wall_s"] + ta["wall_s"],
                    cpu_s=ts["cpu_s"] + ta["cpu_s"],
                    clock=clock,
                    select_s=ts["median_s"],
                    attend_s=ta["median_s"],
                    reps=min(ts["reps"], ta["reps"]),
                    first_call_s=ts["first_call_s"] + ta["first_call_s"],
                )
            else:  # flex
                from torch.nn.attention.flex_attention import BlockMask, flex_attention

                idx = select()
                mem.start()
                kv_num = (idx >= 0).sum(-1).to(torch.int32)  # (B, H, NQ)
                kv_ind = torch.nn.functional.pad(idx.clamp(min=0), (0, nk - idx.shape[-1])).to(torch.int32)
                block_mask = BlockMask.from_kv_blocks(kv_num, kv_ind.contiguous(), BLOCK_SIZE=bs, seq_lengths=(S, S))
                flex = torch.compile(flex_attention, dynamic=False)
                t = time_call(lambda: flex(q, k, v, block_mask=block_mask), reps=reps, slow_s=1e9, clock=clock)
                result.update(t)
                # Same attention as ours on the same index: record the agreement.
                if S <= 16384:
                    ours = block_sparse_attention(q, k, v, idx, block_size=bs)
                    result["max_abs_diff_vs_blocksparse"] = float((flex(q, k, v, block_mask=block_mask) - ours).abs().max())
            result["density"] = block_density(idx, nk)
            result["block_size"] = bs
            result["blocks_per_query_block"] = int(idx.shape[-1])
    result["peak_mb"] = mem.peak_mb()
    result["memory_method"] = mem.method
    result["gflops"] = dense_flops(B, H, S, D) * result["density"] / 1e9
    result["gflop_per_s"] = result["gflops"] / result["median_s"]
    return result


# ------------------------------------------------------------------------------------------- driver


def _cases(args, S: int) -> list[tuple[str, dict]]:
    """(case name, extra config) for one size, in run order."""
    nk = math.ceil(S / args.block_size)
    out: list[tuple[str, dict]] = [(n, {}) for n in DENSE]
    sparse = [(f"k{args.topk}", args.topk)]
    if args.density > 0:
        k_d = max(1, round(args.density * nk))
        if k_d != args.topk:
            sparse.append((f"{round(100 * args.density)}%", k_d))
    for tag, k in sparse:
        out.append((f"blocksparse-{tag}", {"topk": k}))
    if args.density > 0:
        for bs in _extra_block_sizes(args):
            k_b = max(1, round(args.density * math.ceil(S / bs)))
            out.append((f"blocksparse-b{bs}-{round(100 * args.density)}%", {"topk": k_b, "block_size": bs}))
    if not args.no_flex and S >= parse_size(args.flex_min_size):
        for tag, k in sparse:
            out.append((f"flex-{tag}", {"topk": k}))
    return out


def _extra_block_sizes(args) -> list[int]:
    """Block sizes of ``--extra-block-sizes`` other than ``--block-size``, in the given order."""
    sizes = []
    for text in args.extra_block_sizes.split(","):
        if not text.strip():
            continue
        try:
            bs = int(text)
        except ValueError:
            raise SystemExit(f"--extra-block-sizes takes positive ints, got {text.strip()!r}") from None
        if bs < 1:
            raise SystemExit(f"--extra-block-sizes takes positive ints, got {bs}")
        if bs != args.block_size and bs not in sizes:
            sizes.append(bs)
    return sizes


def _skip_reason(args, name: str, S: int) -> str | None:
    if name == "chunked":
        from core.attention import BACKENDS

        if "chunked" not in BACKENDS:
            return "core.attention.BACKENDS has no 'chunked' entry yet"
    if name == "reference":
        need = args.batch * args.heads * S * S * 4 * 3  # scores, exponentials, mask-filled copy (fp32)
        if need > args.max_dense_gb * 2**30:
            return f"dense S×S scores need ~{need / 2**30:.0f} GB > --max-dense-gb {args.max_dense_gb:g}"
    return None


def _summarise(results: list[dict]) -> list[dict]:
    """Add ``vs_best_dense`` (time ratio, >1 = faster) per size."""
    rows = []
    for S in sorted({r["S"] for r in results}):
        results = [{k: v for k, v in r.items() if k not in ("vs_best_dense", "best_dense")} for r in results]
        at = [r for r in results if r["S"] == S]
        dense_ok = [r for r in at if r["case"] in DENSE and r.get("status") == "ok"]
        best = min(dense_ok, key=lambda r: r["median_s"]) if dense_ok else None
        for r in at:
            row = dict(r)
            if best is not None and r.get("status") == "ok":
                row["vs_best_dense"] = best["median_s"] / r["median_s"]
                row["best_dense"] = best["case"]
            rows.append(row)
    return rows


def _print_table(rows: list[dict]) -> str:
    shown = []
    for r in rows:
        shown.append(
            {
                "S": r["S"],
                "case": r["case"],
                "time s": r.get("median_s"),
                "wall s": r.get("wall_s"),
                "select s": r.get("select_s"),
                "reps": r.get("reps"),
                "peak MB": r.get("peak_mb"),
                "block": r.get("block_size"),
                "density": r.get("density"),
                "GFLOP/s": r.get("gflop_per_s"),
                "x best dense": r.get("vs_best_dense"),
                "note": r.get("reason", ""),
            }
        )
    table = format_table(shown, list(shown[0].keys())) if shown else "(no results)"
    print(table, flush=True)
    return table


def _order(r: dict) -> tuple:
    kind = next((i for i, p in enumerate(("sdpa", "chunked", "reference", "blocksparse", "flex")) if r["case"].startswith(p)), 9)
    return (r["S"], kind, r["case"])


def _write(out_path: Path, args, base: dict, commands: list[str], results: list[dict]) -> list[dict]:
    """Summarise (ratios vs best dense) and write the JSON atomically; returns the summarised rows."""
    rows = _summarise(sorted(results, key=_order))
    write_json_atomic(out_path, {
        "benchmark": "attention_cpu",
        "commands": commands,
        "config": {**base, "topk": args.topk, "density": args.density, "extra_block_sizes": _extra_block_sizes(args)},
        "flop_formula": "dense 4*B*H*Sq*Sk*D; sparse: dense * density (selected block pairs / all block pairs)",
        "memory_method": "peak RSS growth per case in a fresh subprocess (VmHWM after clear_refs); see benchmarks/common.py",
        "env": env_info(),
        "results": rows,
    })
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.case is not None:  # child process
        print(json.dumps(_run_case(json.loads(args.case))), flush=True)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.print_only:
        old = read_json(args.out)
        if old is None:
            raise SystemExit(f"no results at {args.out}")
        _print_table(old["results"])
        return 0
    sizes_text = "1K,4K" if (args.quick and args.sizes == build_parser().get_default("sizes")) else args.sizes
    sizes = [parse_size(s) for s in sizes_text.split(",") if s.strip()]
    for name, val in (("--heads", args.heads), ("--dim", args.dim), ("--batch", args.batch), ("--block-size", args.block_size), ("--topk", args.topk)):
        if val < 1:
            raise SystemExit(f"{name} must be >= 1, got {val}")
    if any(S < 1 for S in sizes):
        raise SystemExit(f"sizes must be >= 1, got {sizes}")
    if args.quick:
        args.reps, args.no_flex = 1, True
    base = {
        "batch": args.batch, "heads": args.heads, "dim": args.dim, "block_size": args.block_size,
        "seed": 0, "threads": args.threads, "clock": args.clock, "dtype": "float32", "causal": False,
    }
    out_path = Path(args.out)
    results: list[dict] = []
    command = "python -m benchmarks.attention_cpu " + " ".join(argv if argv is not None else sys.argv[1:])
    commands = [command]
    if args.resume:
        old = read_json(out_path)
        if old and all(old.get("config", {}).get(k2) == base[k2] for k2 in ("batch", "heads", "dim", "block_size", "clock", "threads")):
            results = [r for r in old.get("results", []) if r.get("status") in ("ok", "skipped")]
            commands = old.get("commands", []) + commands
    prefixes = tuple(c.strip() for c in args.cases.split(",") if c.strip()) if args.cases else None
    done = {(r["S"], r["case"]) for r in results if prefixes is None or not r["case"].startswith(prefixes)}
    todo = [(S, name, extra) for S in sizes for name, extra in _cases(args, S)
            if (S, name) not in done and (prefixes is None or name.startswith(prefixes))]
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(todo, desc="attention_cpu", unit="case") if tqdm else todo
    for S, name, extra in bar:
        if tqdm:
            bar.set_postfix_str(f"S={S} {name}")
        rec = {"S": S, "case": name}
        reason = _skip_reason(args, name, S)
        if reason:
            rec.update(status="skipped", reason=reason)
        else:
            rows = parse_size(args.dense_query_rows)
            cfg = {**base, **extra, "S": S, "case": name, "topk": extra.get("topk", args.topk),
                   "reps": args.reps if S <= 4096 else 1,
                   "query_rows": rows if (name in DENSE and 0 < rows < S) else None}
            t0 = time.time()
            rec.update(run_isolated([sys.executable, "-m", "benchmarks.attention_cpu", "--case", json.dumps(cfg)],
                                    timeout_s=args.case_timeout))
            logger.info("S=%d %s: %s in %.0f s", S, name, rec.get("status"), time.time() - t0)
        results = [r for r in results if (r["S"], r["case"]) != (S, name)] + [rec]
        _write(out_path, args, base, commands, results)
    rows = _write(out_path, args, base, commands, results)
    _print_table(rows)
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
