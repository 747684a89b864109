"""GPU benchmark of the Triton attention kernels against SDPA's flash backend and ``flex_attention``.

Run on a CUDA machine (exits 0 with a message where there is none)::

    python -m benchmarks.attention_gpu                  # full sweep, JSON to benchmarks/results/attention_gpu.json
    python -m benchmarks.attention_gpu --quick          # S in {1K, 4K}, a few minutes
    python -m benchmarks.attention_gpu --short          # the targets only (benchmarks.gpu_check step 5)

``--short``: bf16, D = 128, S in {4K, 16K, 64K}, causal and not; block-sparse at 10 % density (blocks of 64
and 128) at 16K and 64K; no correctness checks (gpu_check runs them); Triton and SDPA-flash are timed on
every row first, FlexAttention (a compile per shape) in a last pass, so a time box cuts flex, not targets.
Targets (``targets`` in the JSON): Triton forward >= 0.8x SDPA-flash and backward >= 0.7x (bf16, D = 128,
S >= 4K; backward time = forward+backward - forward), block-sparse at 10 % >= 5x the faster dense at 64K.

Order of work: correctness checks first (Triton dense and block-sparse against fp32 SDPA math, outputs and
gradients, odd lengths, GQA, padding); then timing.

FLOP formula (matmul FLOPs only, the FlashAttention convention):
    forward          = 4 · B · H · S_q · S_k · D      (QKᵀ and PV, 2 FLOPs per multiply-add)
                       × 0.5 with ``causal`` (S_q = S_k)
    forward+backward = 3.5 × forward                  (backward = 2.5 × forward: 5 matmuls vs 2)
    block-sparse     = the same with S_k replaced by the selected keys: 4 · B · H · Σ_blocks(bq · bk) · D
TFLOP/s = FLOPs / median time. Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed).
Sizes keep B·S = ``--tokens`` (default 16K) and H·D = 2048, so every row moves the same data.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import env_info, format_table, parse_size, write_json_atomic

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "attention_gpu.json"
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", nargs="+", default=["1K", "2K", "4K", "8K", "16K", "32K"], help="sequence lengths (1K = 1024)")
    p.add_argument("--head-dims", nargs="+", type=int, default=[64, 128], help="head dims")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp16", "bf16"], help="dtypes")
    p.add_argument("--tokens", default="16K", help="B · S kept constant (B = max(1, tokens // S))")
    p.add_argument("--hidden", type=int, default=2048, help="H · D kept constant (H = hidden // D)")
    p.add_argument("--no-flex", action="store_true", help="skip the compiled flex_attention peer")
    p.add_argument("--sparse-seq-lens", nargs="+", default=["4K", "16K", "32K"], help="lengths of the block-sparse rows")
    p.add_argument("--block-size", nargs="+", type=int, default=[64], help="block size(s) of the block-sparse rows")
    p.add_argument("--densities", nargs="+", type=float, default=[0.10, 0.25], help="fractions of key blocks selected")
    p.add_argument("--tune", action="store_true",
                   help="first time a few forward/backward tile configs per (dtype, D) at S=4K and use the fastest "
                        "(reported in the JSON; without it the kernels' built-in configs are measured)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="S in {1K, 4K}, sparse S = 4K: a smoke run")
    p.add_argument("--short", action="store_true", help="the targets only, in minutes (module docs)")
    p.add_argument("--skip-checks", action="store_true", help="no correctness checks before the timings")
    p.add_argument("--out", type=Path, default=RESULTS, help="JSON output path (written atomically)")
    return p


# ---------------------------------------------------------------------------------------------- FLOPs


def attention_flops(B: int, H: int, sq: int, sk: int, d: int, *, causal: bool, mode: str) -> float:
    """Matmul FLOPs of dense attention (module docs)."""
    fwd = 4.0 * B * H * sq * sk * d * (0.5 if causal else 1.0)
    return fwd if mode == "fwd" else 3.5 * fwd


def block_sparse_flops(block_index, *, block_size: int, sq: int, sk: int, d: int, mode: str) -> float:
    """Matmul FLOPs of the selected (query block, key block) tiles, short last blocks counted exactly."""
    import torch

    nq = block_index.shape[2]
    q_rows = torch.full((nq,), block_size, dtype=torch.float64)
    q_rows[-1] = sq - (nq - 1) * block_size
    nk = math.ceil(sk / block_size)
    k_rows = torch.full((nk + 1,), block_size, dtype=torch.float64)
    k_rows[nk - 1] = sk - (nk - 1) * block_size
    k_rows[nk] = 0.0  # the -1 slots
    ids = torch.where(block_index < 0, nk, block_index).cpu()
    pairs = (q_rows.view(1, 1, nq, 1) * k_rows[ids]).sum().item()
    fwd = 4.0 * pairs * d
    return fwd if mode == "fwd" else 3.5 * fwd


# ---------------------------------------------------------------------------------------------- runners


def _bench_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _sdpa_flash(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class _Flex:
    """Compiled ``flex_attention`` with a causal block mask built once per length."""

    def __init__(self) -> None:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per shape, no eager fallback
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 1024)
        self._create_block_mask = create_block_mask
        self._fn = torch.compile(flex_attention, dynamic=False)
        self._masks: dict[tuple[int, int], Any] = {}

    def __call__(self, q, k, v, causal):
        mask = None
        if causal:
            sq, sk = q.shape[2], k.shape[2]
            if (sq, sk) not in self._masks:
                off = sk - sq

                def causal_mod(b, h, qi, kj):
                    return kj <= qi + off

                self._masks[(sq, sk)] = self._create_block_mask(causal_mod, None, None, sq, sk, device=q.device)
            mask = self._masks[(sq, sk)]
        return self._fn(q, k, v, block_mask=mask)


def _timed(name: str, fn, q, k, v, causal: bool, mode: str) -> float | str:
    """Median ms of ``fn`` (forward, or forward+backward), ``"oom"`` or ``"error: ..."``."""
    import torch

    try:
        if mode == "fwd":
            with torch.no_grad():
                return _bench_ms(lambda: fn(q, k, v, causal))
        qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
        do = torch.randn_like(q)

        def step():
            qg.grad = kg.grad = vg.grad = None
            fn(qg, kg, vg, causal).backward(do)

        return _bench_ms(step)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return "oom"
    except Exception as e:  # a peer that does not support a shape must not end the sweep
        logger.warning("%s failed: %s", name, e)
        return f"error: {type(e).__name__}: {str(e)[:120]}"


# ---------------------------------------------------------------------------------------------- correctness


def _math_attention(q, k, v, *, causal: bool, kpm=None, keep=None, upcast: bool, window=None, softcap=None,
                    sinks=None):
    """Plain attention math (GQA expanded, bottom-right causal, padding, extra keep mask; empty rows -> 0), with
    ``core.attention``'s window, soft cap and sinks (``(H_q,)``: one more value-zero softmax column per row).

    ``upcast=True``: fp32, the reference; ``False``: in the inputs' dtype, PyTorch's own rounding error.
    """
    import torch

    g = q.shape[1] // k.shape[1]
    dt = torch.float32 if upcast else q.dtype
    qf, kf, vf = q.to(dt), k.to(dt).repeat_interleave(g, 1), v.to(dt).repeat_interleave(g, 1)
    sq, sk = q.shape[2], k.shape[2]
    allow = torch.ones(1, 1, sq, sk, dtype=torch.bool, device=q.device)
    pos = torch.arange(sq, device=q.device)[:, None] + sk - sq
    kj = torch.arange(sk, device=q.device)
    if causal:
        allow = allow & (kj <= pos)
    if window is not None:
        allow = allow & (kj > pos - window) & (True if causal else (kj < pos + window))
    if kpm is not None:
        allow = allow & ~kpm[:, None, None, :]
    if keep is not None:
        allow = allow & keep
    s = (qf @ kf.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allow, float("-inf"))
    if sinks is not None:
        col = sinks.to(dt).view(1, -1, 1, 1).expand(s.shape[0], s.shape[1], sq, 1)
        return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1] @ vf
    p = torch.softmax(s, dim=-1)
    p = torch.where(allow.any(-1, keepdim=True), p, torch.zeros_like(p))
    return p @ vf


def correctness_checks(dtypes: list[str]) -> list[dict[str, Any]]:
    """Triton dense and block-sparse against fp32 math, outputs and gradients.

    Tolerance per tensor: 3x the error of the same math done in the low-precision dtype, plus 1e-3.
    """
    import torch

    from kernels.block_sparse import block_sparse_attention
    from kernels.flash_attention import flash_attention

    def compare(row, got, grads, ref_fn, peer_fn, inputs, do):
        ref = ref_fn(*inputs)
        g_ref = torch.autograd.grad(ref, inputs, do.float())
        peer = peer_fn(*inputs)
        g_peer = torch.autograd.grad(peer, inputs, do)
        ok = True
        for name, a, r, p in zip(("out", "dq", "dk", "dv"), (got, *grads), (ref, *g_ref), (peer, *g_peer)):
            err = (a.float() - r).abs().max().item()
            tol = 3 * (p.float() - r).abs().max().item() + 1e-3
            row[f"err_{name}"], row[f"tol_{name}"] = err, tol
            ok = ok and math.isfinite(err) and err <= tol
        row["ok"] = ok
        return row

    rows = []
    torch.manual_seed(0)
    cases = [  # B, Hq, Hkv, Sq, Sk, D, causal, pad
        (2, 8, 2, 1023, 1023, 128, True, True),
        (1, 4, 4, 513, 2000, 64, False, False),
        (2, 4, 1, 1500, 333, 96, True, False),  # Sq > Sk causal: leading rows see no key
    ]
    for dname in dtypes:
        dtype = getattr(torch, DTYPES[dname])
        for B, Hq, Hkv, Sq, Sk, D, causal, pad in cases:
            q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, requires_grad=True)
            k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, requires_grad=True)
            v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, requires_grad=True)
            kpm = (torch.rand(B, Sk, device="cuda") < 0.2) if pad else None
            do = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
            got = flash_attention(q, k, v, causal=causal, key_padding_mask=kpm)
            grads = torch.autograd.grad(got, (q, k, v), do)
            row = {"kernel": "flash", "dtype": dname, "shape": f"{B}x{Hq}/{Hkv}x{Sq}x{Sk}x{D}", "causal": causal, "pad": pad}
            rows.append(compare(
                row, got, grads,
                lambda a, b, c: _math_attention(a, b, c, causal=causal, kpm=kpm, upcast=True),
                lambda a, b, c: _math_attention(a, b, c, causal=causal, kpm=kpm, upcast=False),
                (q, k, v), do,
            ))  # fmt: skip
        # Block-sparse: a random subset of key blocks == masked dense math.
        B, Hq, Hkv, S, D, bs = 2, 8, 2, 1000, 64, 64
        nq = math.ceil(S / bs)
        q = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(B, Hkv, S, D, device="cuda", dtype=dtype, requires_grad=True)
        idx = torch.rand(B, Hq, nq, nq, device="cuda").topk(4, dim=-1).indices.sort(dim=-1).values
        blocks = torch.zeros(B, Hq, nq, nq, dtype=torch.bool, device="cuda").scatter_(-1, idx, True)
        keep = blocks.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :S, :S]
        do = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype)
        got = block_sparse_attention(q, k, v, idx, block_size=bs, causal=True)
        grads = torch.autograd.grad(got, (q, k, v), do)
        row = {"kernel": "block_sparse", "dtype": dname, "shape": f"{B}x{Hq}/{Hkv}x{S}x{S}x{D} bs{bs} k4", "causal": True}
        rows.append(compare(
            row, got, grads,
            lambda a, b, c: _math_attention(a, b, c, causal=True, keep=keep, upcast=True),
            lambda a, b, c: _math_attention(a, b, c, causal=True, keep=keep, upcast=False),
            (q, k, v), do,
        ))  # fmt: skip
    return rows


# ---------------------------------------------------------------------------------------------- tuning

FWD_CANDIDATES = [  # BLOCK_M, BLOCK_N, num_warps, num_stages
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 3),
    (64, 64, 4, 3), (128, 64, 4, 4), (128, 128, 8, 2), (64, 32, 4, 4),
]  # fmt: skip
BWD_CANDIDATES = [  # dK/dV BLOCK_M, BLOCK_N; dQ BLOCK_M, BLOCK_N; num_warps, num_stages
    (64, 64, 64, 64, 4, 3), (32, 64, 64, 32, 4, 2), (32, 64, 64, 32, 4, 3), (32, 128, 128, 32, 4, 3),
    (64, 128, 128, 64, 8, 3), (32, 128, 128, 32, 8, 2),
]  # fmt: skip


def tune_tiles(dtypes: list[str], head_dims: list[int], *, seq: int, tokens: int, hidden: int) -> list[dict[str, Any]]:
    """Time candidate tile configs (causal forward; causal forward+backward) and install the fastest.

    The kernels pick tiles with plain functions of (head dim, dtype); this replaces those functions in
    this process only, with a table of the winners (which the JSON records, to be copied into the kernel).
    """
    import torch

    import kernels.flash_attention as fa

    default_fwd, default_bwd = fa._fwd_config, fa._bwd_config
    best: dict[tuple[str, int, torch.dtype], dict[str, int]] = {}
    report = []
    for dname in dtypes:
        dtype = getattr(torch, DTYPES[dname])
        for d in head_dims:
            B, H = max(1, tokens // seq), max(1, hidden // d)
            q, k, v = (torch.randn(B, H, seq, d, device="cuda", dtype=dtype) for _ in range(3))
            for kind, cands in (("fwd", FWD_CANDIDATES), ("bwd", BWD_CANDIDATES)):
                times, configs = {}, {}
                for cand in cands:
                    *tiles, w, st = cand
                    names = ("BLOCK_M", "BLOCK_N") if kind == "fwd" else ("BLOCK_M", "BLOCK_N", "DQ_BLOCK_M", "DQ_BLOCK_N")
                    cfg = {**dict(zip(names, tiles)), "num_warps": w, "num_stages": st}
                    fa._fwd_config = (lambda d_, dt_, cfg=cfg: cfg) if kind == "fwd" else default_fwd
                    fa._bwd_config = (lambda d_, dt_, cfg=cfg: cfg) if kind == "bwd" else default_bwd
                    mode = "fwd" if kind == "fwd" else "fwd+bwd"
                    ms = _timed("triton", lambda a, b, c, cz: fa.flash_attention(a, b, c, causal=cz), q, k, v, True, mode)
                    times[cand] = ms
                    configs[cand] = cfg
                ok = {c: t for c, t in times.items() if isinstance(t, float)}
                fa._fwd_config, fa._bwd_config = default_fwd, default_bwd
                if not ok:
                    continue
                win = min(ok, key=ok.get)
                best[(kind, d, dtype)] = configs[win]
                report.append({"kind": kind, "dtype": dname, "D": d, "S": seq, "best": best[(kind, d, dtype)],
                               "best_ms": ok[win], "all_ms": {str(c): t for c, t in times.items()}})  # fmt: skip
            del q, k, v

    def pick(kind, default):
        def config(d, dtype):
            return best.get((kind, d, dtype)) or default(d, dtype)

        return config

    fa._fwd_config = pick("fwd", default_fwd)
    fa._bwd_config = pick("bwd", default_bwd)
    return report


# ---------------------------------------------------------------------------------------------- main


def _tflops(flops: float, ms: float | str) -> float | None:
    return flops / (ms * 1e-3) / 1e12 if isinstance(ms, float) else None


SHORT = {"dtypes": ["bf16"], "head_dims": [128], "seq_lens": ["4K", "16K", "64K"], "sparse_seq_lens": ["16K", "64K"],
         "densities": [0.10], "block_size": [64, 128], "skip_checks": True}  # fmt: skip


def dense_rows(args, seq_lens: list[int], tokens: int, peers: dict, result: dict, *, rows=None) -> list[dict]:
    """Time ``peers`` on every dense case (adding their columns to ``rows`` when given); JSON after each row."""
    import torch
    from tqdm import tqdm

    cases = [
        (dn, d, s, c, m)
        for dn in args.dtypes for d in args.head_dims for s in seq_lens for c in (False, True) for m in ("fwd", "fwd+bwd")
    ]  # fmt: skip
    rows = rows if rows is not None else [{} for _ in cases]
    for row, (dname, d, s, causal, mode) in tqdm(list(zip(rows, cases)), desc=f"dense {'/'.join(peers)}", file=sys.stderr):
        dtype = getattr(torch, DTYPES[dname])
        B, H = max(1, tokens // s), max(1, args.hidden // d)
        q, k, v = (torch.randn(B, H, s, d, device="cuda", dtype=dtype) for _ in range(3))
        flops = attention_flops(B, H, s, s, d, causal=causal, mode=mode)
        row.update({"dtype": dname, "D": d, "S": s, "B": B, "H": H, "causal": causal, "mode": mode})
        for name, fn in peers.items():
            ms = _timed(name, fn, q, k, v, causal, mode)
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = _tflops(flops, ms)
        for peer in ("sdpa_flash", "flex"):
            if row.get("triton_tflops") and row.get(f"{peer}_tflops"):
                row[f"triton_vs_{peer}"] = row["triton_tflops"] / row[f"{peer}_tflops"]
        del q, k, v
        result["dense"] = [r for r in rows if r]
        write_json_atomic(args.out, result)  # partial results survive an interrupted sweep
    return rows


def sparse_rows(args, sparse_lens: list[int], tokens: int, peers: dict, dense: list[dict], result: dict) -> list[dict]:
    """Block-sparse (random index, selection not timed) against dense at fixed densities, non-causal."""
    import torch
    from tqdm import tqdm

    from kernels.block_sparse import block_sparse_attention

    cases = [
        (dn, d, s, bs, dens, m)
        for dn in args.dtypes for d in args.head_dims for s in sparse_lens for bs in args.block_size
        for dens in args.densities for m in ("fwd", "fwd+bwd")
    ]  # fmt: skip
    rows: list[dict[str, Any]] = []
    for dname, d, s, bs, density, mode in tqdm(cases, desc="block-sparse", file=sys.stderr):
        dtype = getattr(torch, DTYPES[dname])
        B, H = max(1, tokens // s), max(1, args.hidden // d)
        q, k, v = (torch.randn(B, H, s, d, device="cuda", dtype=dtype) for _ in range(3))
        nq = math.ceil(s / bs)
        kb = max(1, round(density * nq))
        idx = torch.rand(B, H, nq, nq, device="cuda").topk(kb, dim=-1).indices.sort(dim=-1).values
        row = {"dtype": dname, "D": d, "S": s, "B": B, "H": H, "block": bs, "density": density, "K": kb, "mode": mode}

        def sparse_fn(q_, k_, v_, c_, idx=idx, bs=bs):
            return block_sparse_attention(q_, k_, v_, idx, block_size=bs)

        ms = _timed("block_sparse", sparse_fn, q, k, v, False, mode)
        row["block_sparse_ms"] = ms
        row["block_sparse_tflops"] = _tflops(block_sparse_flops(idx, block_size=bs, sq=s, sk=s, d=d, mode=mode), ms)
        same = [r for r in dense if (r.get("dtype"), r.get("D"), r.get("S"), r.get("causal"), r.get("mode"), r.get("B"))
                == (dname, d, s, False, mode, B)]  # fmt: skip
        for name, dense_name in (("triton", "triton_dense"), ("sdpa_flash", "sdpa_flash_dense")):
            dense_ms = same[0].get(f"{name}_ms") if same else None
            if dense_ms is None:
                dense_ms = _timed(dense_name, peers[name], q, k, v, False, mode)
            row[f"{dense_name}_ms"] = dense_ms
            a, b = row["block_sparse_ms"], dense_ms
            row[f"speedup_vs_{dense_name}"] = b / a if isinstance(a, float) and isinstance(b, float) else None
        rows.append(row)
        del q, k, v
        result["block_sparse"] = rows
        write_json_atomic(args.out, result)
    return rows


def evaluate_targets(dense: list[dict], sparse: list[dict]) -> dict[str, Any]:
    """The issue's targets from the measured rows (module docs); ``None`` where a row is missing."""
    table: list[dict[str, Any]] = []
    fwd_ratios, bwd_ratios = [], []

    def key(x: dict[str, Any]) -> tuple:
        return tuple(x.get(k) for k in ("dtype", "D", "S", "B", "causal"))

    fwd_bwd = {key(x): x for x in dense if x.get("mode") == "fwd+bwd"}
    for r in dense:
        if r.get("dtype") != "bf16" or r.get("D") != 128 or r.get("S", 0) < 4096 or r.get("mode") != "fwd":
            continue
        both = [fwd_bwd[key(r)]] if key(r) in fwd_bwd else []
        line = {"S": r["S"], "causal": r["causal"], "triton fwd TFLOP/s": r.get("triton_tflops"),
                "sdpa fwd TFLOP/s": r.get("sdpa_flash_tflops"), "flex fwd TFLOP/s": r.get("flex_tflops"),
                "fwd ratio": r.get("triton_vs_sdpa_flash")}  # fmt: skip
        if r.get("triton_vs_sdpa_flash") is not None:
            fwd_ratios.append(r["triton_vs_sdpa_flash"])
        if both:
            fb = both[0]
            bwd = {p: fb.get(f"{p}_ms") - r.get(f"{p}_ms") for p in ("triton", "sdpa_flash")
                   if isinstance(fb.get(f"{p}_ms"), float) and isinstance(r.get(f"{p}_ms"), float)}  # fmt: skip
            flops_bwd = 2.5 * attention_flops(r["B"], r["H"], r["S"], r["S"], r["D"], causal=r["causal"], mode="fwd")
            line["triton bwd TFLOP/s"] = _tflops(flops_bwd, bwd["triton"]) if bwd.get("triton", 0) > 0 else None
            line["sdpa bwd TFLOP/s"] = _tflops(flops_bwd, bwd["sdpa_flash"]) if bwd.get("sdpa_flash", 0) > 0 else None
            if line["triton bwd TFLOP/s"] and line["sdpa bwd TFLOP/s"]:
                line["bwd ratio"] = line["triton bwd TFLOP/s"] / line["sdpa bwd TFLOP/s"]
                bwd_ratios.append(line["bwd ratio"])
        table.append(line)
    out: dict[str, Any] = {
        "fwd_min_ratio": min(fwd_ratios) if fwd_ratios else None,
        "bwd_min_ratio": min(bwd_ratios) if bwd_ratios else None,
    }
    out["fwd_met"] = out["fwd_min_ratio"] >= 0.8 if out["fwd_min_ratio"] is not None else None
    out["bwd_met"] = out["bwd_min_ratio"] >= 0.7 if out["bwd_min_ratio"] is not None else None
    longest = max((r["S"] for r in sparse), default=None)
    speedups = {}
    for r in sparse:
        if r["S"] == longest and abs(r["density"] - 0.10) < 1e-9 and r["mode"] == "fwd":
            dense_ms = [r.get(k) for k in ("triton_dense_ms", "sdpa_flash_dense_ms") if isinstance(r.get(k), float)]
            if dense_ms and isinstance(r.get("block_sparse_ms"), float):
                speedups[r["block"]] = min(dense_ms) / r["block_sparse_ms"]
    out["sparse_S"] = longest
    out["sparse_speedup_by_block"] = speedups
    out["sparse_best_speedup"] = max(speedups.values()) if speedups else None
    out["sparse_met"] = out["sparse_best_speedup"] >= 5 if out["sparse_best_speedup"] is not None and longest == 65536 else None
    out["table"] = table
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch

    if not torch.cuda.is_available():
        print("attention_gpu: no CUDA device available; nothing to benchmark (this script needs a GPU).")
        return 0
    if args.short:
        for key, value in SHORT.items():
            setattr(args, key, value)
    from kernels.flash_attention import flash_attention

    seq_lens = [parse_size(s) for s in (["1K", "4K"] if args.quick else args.seq_lens)]
    sparse_lens = [parse_size(s) for s in (["4K"] if args.quick else args.sparse_seq_lens)]
    tokens = parse_size(args.tokens)
    info = {**env_info(), "gpu": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    import triton

    info["triton"] = triton.__version__
    result: dict[str, Any] = {"env": info, "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"GPU: {info['gpu']}  torch {info['torch']}  triton {info['triton']}")
    all_ok = True
    if not args.skip_checks:
        print("\n## Correctness (max abs error vs fp32 math; tolerance = 3x the error of the same math done in")
        print("## the low-precision dtype, + 1e-3)")
        checks = correctness_checks(args.dtypes)
        result["correctness"] = checks
        check_cols = ["kernel", "dtype", "shape", "causal", "err_out", "tol_out", "err_dq", "err_dk", "err_dv", "ok"]
        print(format_table(checks, check_cols))
        write_json_atomic(args.out, result)
        all_ok = all(r["ok"] for r in checks)
        if not all_ok:
            print("WARNING: a correctness check failed; timings below are of a kernel that is wrong for those inputs.")

    if args.tune:
        print("\n## Tile tuning (causal, S = 4096, fastest of the candidates)")
        result["tuning"] = tune_tiles(args.dtypes, args.head_dims, seq=4096, tokens=tokens, hidden=args.hidden)
        print(format_table(result["tuning"], ["kind", "dtype", "D", "best", "best_ms"]))
        write_json_atomic(args.out, result)

    peers = {"triton": lambda q, k, v, c: flash_attention(q, k, v, causal=c), "sdpa_flash": _sdpa_flash}
    dense = dense_rows(args, seq_lens, tokens, peers, result)
    sparse = sparse_rows(args, sparse_lens, tokens, peers, dense, result)
    result["targets"] = evaluate_targets(dense, sparse)
    write_json_atomic(args.out, result)
    if not args.no_flex:  # last: a compile per shape; a time box that ends the run here loses only flex columns
        dense_rows(args, seq_lens, tokens, {"flex": _Flex()}, result, rows=dense)
        result["targets"] = evaluate_targets(dense, sparse)
        write_json_atomic(args.out, result)

    cols = ["dtype", "D", "S", "causal", "mode", "triton_tflops", "sdpa_flash_tflops", "flex_tflops",
            "triton_vs_sdpa_flash", "triton_vs_flex"]  # fmt: skip
    print("\n## Dense attention, TFLOP/s (B·S = %d, H·D = %d)" % (tokens, args.hidden))
    print(format_table(dense, [c for c in cols if not args.no_flex or "flex" not in c]))
    print("\n## Block-sparse (random index) vs dense, non-causal")
    print(format_table(sparse, ["dtype", "D", "S", "block", "density", "mode", "block_sparse_ms", "triton_dense_ms",
                                "sdpa_flash_dense_ms", "speedup_vs_triton_dense", "speedup_vs_sdpa_flash_dense",
                                "block_sparse_tflops"]))  # fmt: skip
    t = result["targets"]
    print("\n## Targets (bf16, D = 128, S >= 4K)")
    print(format_table(t["table"], list(t["table"][0]) if t["table"] else ["S"]))
    print(f"Triton fwd >= 0.80x SDPA-flash: min {t['fwd_min_ratio']} -> {t['fwd_met']}")
    print(f"Triton bwd >= 0.70x SDPA-flash: min {t['bwd_min_ratio']} -> {t['bwd_met']}")
    print(f"block-sparse 10% >= 5x dense at S={t['sparse_S']}: best {t['sparse_best_speedup']} -> {t['sparse_met']}")
    write_json_atomic(args.out, result)
    print(f"\nwrote {args.out}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
