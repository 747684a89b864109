"""The steps of ``benchmarks.gpu_check`` that run in their own process (numerics, int64, dispatch).

Each step is a function ``step(record)`` that fills ``record["cases"]`` (a list of dicts) and calls
``record.save()`` after every case, so a step killed at its time box leaves every finished case on disk.
``python -m benchmarks.gpu_check --child STEP --part FILE`` runs one of them (the parent does that).

Tolerance of a low-precision check (as in ``tests/_kernel_utils.py``): the kernel's max abs error against
fp32 math must stay within 3x the error of the same math done by PyTorch in the low-precision dtype, + 1e-3.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import Any

from benchmarks.common import write_json_atomic

logger = logging.getLogger(__name__)

INT32_SPAN = 2**31
DTYPES = {"fp16": "float16", "bf16": "bfloat16"}

#: Step 3 shapes, name -> (B, H_q, H_kv, S_q, S_k, padded): every length odd, so the tiles' EVEN_M / EVEN_N
#: flags agree across shapes and the cases share compiled kernels. "padded row": batch entry 0 fully padded.
NUMERICS_SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "odd S": (2, 4, 4, 1023, 1023, False),
    "S_q < S_k": (2, 4, 4, 333, 1537, False),
    "S_q > S_k": (2, 4, 4, 1537, 333, False),  # causal: the first 1204 rows see no key
    "S_q = 1": (4, 8, 8, 1, 1537, False),
    "GQA 8:1": (2, 8, 1, 1023, 1023, False),
    "padded row": (2, 4, 4, 1023, 1023, True),
}
#: ``--dry-run`` (the CPU under ``TRITON_INTERPRET=1``, fp16 and D = 64 only): the same code on tiny shapes.
DRY_SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "odd S": (2, 2, 2, 37, 37, False),
    "S_q < S_k": (2, 2, 2, 13, 45, False),
    "S_q > S_k": (2, 2, 2, 45, 13, False),
    "S_q = 1": (2, 2, 2, 1, 45, False),
    "GQA 8:1": (1, 8, 1, 37, 37, False),
    "padded row": (2, 2, 2, 37, 37, True),
}
#: Step 3, the kernel's extras on a GQA 4:1 causal-or-not shape: name -> (window, softcap, sinks).
EXTRA_CASES: dict[str, tuple[int | None, float | None, bool]] = {
    "window 255": (255, None, False),
    "softcap 20": (None, 20.0, False),
    "sinks": (None, None, True),
    "window 127 + softcap 30 + sinks": (127, 30.0, True),
}
EXTRA_SHAPE, DRY_EXTRA_SHAPE = (2, 8, 2, 1023, 1023), (1, 4, 2, 45, 45)
#: Step 4: B*H*S*D = 9 * 2**28 elements (4.5 GiB per bf16 tensor); batch 256 is the first whose base offset
#: passes 2**31, batch 287 the last. Causal, so the forward costs half of 4*B*H*S*S*D FLOPs.
INT64_SHAPE = (288, 32, 2048, 128)
INT64_BATCHES = (0, 256, 287)


class PartRecord(dict):
    """A step's result dict that writes itself (atomically) to its part file."""

    def __init__(self, path: Path) -> None:
        super().__init__(cases=[])
        self.path = path

    def save(self) -> None:
        write_json_atomic(self.path, dict(self))


# ---------------------------------------------------------------------------------------------- helpers


def _compare(row: dict[str, Any], got, ref, peer, *, names=("out", "dq", "dk", "dv")) -> dict[str, Any]:
    """Fill ``row`` with each tensor's error against the fp32 reference, its tolerance and NaN checks."""
    ok = True
    for name, g, r, p in zip(names, got, ref, peer):
        finite = bool(g.isfinite().all())
        err = (g.float() - r.float()).abs().max().item() if g.numel() else 0.0
        tol = 3 * (p.float() - r.float()).abs().max().item() + 1e-3 if g.numel() else 1e-3
        row[f"err_{name}"], row[f"tol_{name}"] = err, tol
        if not finite:
            row.setdefault("nan_in", []).append(name)
        ok = ok and finite and math.isfinite(err) and err <= tol
    row["ok"] = ok
    return row


def _fwd_bwd(fn, q, k, v, do):
    """Output and (dq, dk, dv) of ``fn`` on fresh leaves with the values of q, k, v."""
    import torch

    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, do.to(out.dtype))
    return [out.detach(), *grads]


def _math(q, k, v, *, causal, kpm=None, keep=None, upcast: bool, **extra):
    from benchmarks.attention_gpu import _math_attention

    return _math_attention(q, k, v, causal=causal, kpm=kpm, keep=keep, upcast=upcast, **extra)


def _tiles(d: int, dtype) -> dict[str, Any]:
    import kernels.flash_attention as fa

    return {"fwd": fa._fwd_config(d, dtype), "bwd": fa._bwd_config(d, dtype)}


# ---------------------------------------------------------------------------------------------- step 3


def numerics_cases(shard: int = 0, n_shards: int = 1) -> list[tuple[str, int, bool, str]]:
    """(dtype, D, causal, case) of step 3, split over ``n_shards`` processes by (dtype, D) first."""
    cases = [
        (dn, d, causal, name)
        for dn in DTYPES for d in (64, 128) for causal in (False, True)
        for name in [*NUMERICS_SHAPES, "block-sparse", *EXTRA_CASES]
    ]  # fmt: skip
    groups = sorted({(c[0], c[1]) for c in cases})
    mine = {g for i, g in enumerate(groups) if i % n_shards == shard}
    return [c for c in cases if (c[0], c[1]) in mine]


def step_numerics(record: PartRecord, *, shard: int = 0, n_shards: int = 1, dry: bool = False) -> None:
    """Step 3: the kernels at their production tiles against fp32 math, forward and backward, NaN checks.
    ``dry``: tiny shapes, fp16 and D = 64 only, on the CPU (Triton's interpreter): a check of this code."""
    import torch

    from kernels.block_sparse import block_sparse_attention
    from kernels.flash_attention import flash_attention, is_interpreted

    record["interpreted"] = is_interpreted()
    device, shapes = ("cpu", DRY_SHAPES) if dry else ("cuda", NUMERICS_SHAPES)
    torch.manual_seed(shard)
    cases = numerics_cases(shard, n_shards)
    if dry:  # every shape once, whatever the shard
        cases = [c for c in numerics_cases() if c[0] == "fp16" and c[1] == 64]
    for dname, d, causal, name in cases:
        dtype = getattr(torch, DTYPES[dname])
        row: dict[str, Any] = {"dtype": dname, "D": d, "causal": causal, "case": name, "tiles": _tiles(d, dtype)}
        t0 = time.perf_counter()
        try:
            if name in EXTRA_CASES:  # window (bidirectional when not causal), soft cap, sinks
                window, softcap, with_sinks = EXTRA_CASES[name]
                if dry:
                    window = window and 7
                B, Hq, Hkv, Sq, Sk = DRY_EXTRA_SHAPE if dry else EXTRA_SHAPE
                q = torch.randn(B, Hq, Sq, d, device=device, dtype=dtype) * (3 if softcap else 1)
                k, v = (torch.randn(B, Hkv, Sk, d, device=device, dtype=dtype) for _ in range(2))
                do = torch.randn(B, Hq, Sq, d, device=device, dtype=dtype)
                sinks = torch.randn(Hq, device=device) * 2 if with_sinks else None
                extra = dict(window=window, softcap=softcap, sinks=sinks)
                row["shape"] = f"{B}x{Hq}/{Hkv}x{Sq}x{Sk}"
                got = _fwd_bwd(lambda a, b, c: flash_attention(a, b, c, causal=causal, **extra), q, k, v, do)
                ref = _fwd_bwd(lambda a, b, c: _math(a, b, c, causal=causal, upcast=True, **extra), q, k, v, do)
                peer = _fwd_bwd(lambda a, b, c: _math(a, b, c, causal=causal, upcast=False, **extra), q, k, v, do)
                _compare(row, got, ref, peer)
                row["seconds"] = round(time.perf_counter() - t0, 2)
                record["cases"].append(row)
                record.save()
                continue
            if name == "block-sparse":
                B, Hq, Hkv, S, bs, kb = (1, 2, 1, 50, 16, 2) if dry else (2, 8, 2, 1000, 64, 4)
                q = torch.randn(B, Hq, S, d, device=device, dtype=dtype)
                k, v = (torch.randn(B, Hkv, S, d, device=device, dtype=dtype) for _ in range(2))
                nq = math.ceil(S / bs)
                idx = torch.rand(B, Hq, nq, nq, device=device).topk(kb, dim=-1).indices.sort(dim=-1).values
                blocks = torch.zeros(B, Hq, nq, nq, dtype=torch.bool, device=device).scatter_(-1, idx, True)
                keep = blocks.repeat_interleave(bs, 2).repeat_interleave(bs, 3)[:, :, :S, :S]
                do = torch.randn(B, Hq, S, d, device=device, dtype=dtype)
                row["shape"] = f"{B}x{Hq}/{Hkv}x{S}x{S} block {bs}, {kb} of {nq} blocks"

                def kernel(a, b, c):
                    return block_sparse_attention(a, b, c, idx, block_size=bs, causal=causal)

                kpm = None
            else:
                B, Hq, Hkv, Sq, Sk, pad = shapes[name]
                q = torch.randn(B, Hq, Sq, d, device=device, dtype=dtype)
                k, v = (torch.randn(B, Hkv, Sk, d, device=device, dtype=dtype) for _ in range(2))
                do = torch.randn(B, Hq, Sq, d, device=device, dtype=dtype)
                kpm = None
                if pad:
                    kpm = torch.rand(B, Sk, device=device) < 0.2
                    kpm[0] = True
                keep = None
                row["shape"] = f"{B}x{Hq}/{Hkv}x{Sq}x{Sk}"

                def kernel(a, b, c):
                    return flash_attention(a, b, c, causal=causal, key_padding_mask=kpm)

            got = _fwd_bwd(kernel, q, k, v, do)
            ref = _fwd_bwd(lambda a, b, c: _math(a, b, c, causal=causal, kpm=kpm, keep=keep, upcast=True), q, k, v, do)
            peer = _fwd_bwd(lambda a, b, c: _math(a, b, c, causal=causal, kpm=kpm, keep=keep, upcast=False), q, k, v, do)
            _compare(row, got, ref, peer)
            if kpm is not None:  # the fully padded batch entry: zeros, and zero gradients for its queries
                row["padded_row_zero"] = bool((got[0][0] == 0).all() and (got[1][0] == 0).all())
                row["ok"] = row["ok"] and row["padded_row_zero"]
        except Exception as e:  # a failing case is a result; the next case still runs
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        row["seconds"] = round(time.perf_counter() - t0, 2)
        record["cases"].append(row)
        record.save()


# ---------------------------------------------------------------------------------------------- step 4


def step_int64(record: PartRecord, *, dry: bool = False) -> None:
    """Step 4: dense and block-sparse kernels on tensors past 2**31 elements; batches 0, 256 (the first past
    2**31 in base offset) and the last checked against fp32 math, forward and backward. ``dry``: the same
    code on a tiny fp16 shape on the CPU (Triton's interpreter; nothing passes 2**31 there)."""
    import torch

    from kernels.block_sparse import block_sparse_attention
    from kernels.flash_attention import flash_attention

    device = "cpu" if dry else "cuda"
    B, H, S, D = (3, 2, 64, 16) if dry else INT64_SHAPE
    batches = (0, 1, 2) if dry else INT64_BATCHES
    dtype = torch.float16 if dry else torch.bfloat16
    record.update(shape=[B, H, S, D], numel=B * H * S * D, dtype=str(dtype).split(".")[-1], causal=True, dry=dry)
    record["last_batch_base_offset"] = (B - 1) * H * S * D
    torch.manual_seed(0)
    try:
        q, k, v, do = (torch.randn(B, H, S, D, device=device, dtype=dtype) for _ in range(4))
    except torch.cuda.OutOfMemoryError as e:
        record.update(ok=False, error=f"out of memory allocating 4 x {B * H * S * D * 2 / 2**30:.1f} GiB: {e}")
        record.save()
        return
    bs = 16 if dry else 128
    nq = S // bs
    # Each query block: its diagonal block and 3 random earlier ones (ids ascending, -1 where there are fewer).
    r = torch.rand(B, H, nq, nq, device=device).masked_fill(~torch.ones(nq, nq, dtype=torch.bool, device=device).tril(-1), -1)
    earlier = r.topk(3, dim=-1).indices
    earlier = torch.where(r.gather(-1, earlier) >= 0, earlier, nq)  # fewer than 3 earlier blocks: nq, then -1
    diag = torch.arange(nq, device=device).expand(B, H, nq)[..., None]
    idx = torch.cat([earlier, diag], -1).sort(dim=-1).values
    idx = torch.where(idx >= nq, -1, idx)

    def sparse(a, b, c):
        return block_sparse_attention(a, b, c, idx, block_size=bs, causal=True)

    def dense(a, b, c):
        return flash_attention(a, b, c, causal=True)

    for name, fn in (("flash", dense), ("block_sparse", sparse)):
        row: dict[str, Any] = {"kernel": name}
        t0 = time.perf_counter()
        try:
            if not dry:
                torch.cuda.reset_peak_memory_stats()
            leaves = [t.requires_grad_(True) for t in (q, k, v)]
            out = fn(*leaves)
            grads = torch.autograd.grad(out, leaves, do)
            if not dry:
                torch.cuda.synchronize()
                row["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            row["kernel_seconds"] = round(time.perf_counter() - t0, 2)
            row["batches"] = []
            for b in batches:
                sl = slice(b, b + 1)
                keep = None
                if name == "block_sparse":
                    from core.blocksparse import block_index_to_mask

                    keep = block_index_to_mask(idx[sl], block_size=bs, sq=S, sk=S)
                inputs = [t.detach()[sl] for t in (q, k, v)]
                ref = _fwd_bwd(lambda a, b_, c: _math(a, b_, c, causal=True, keep=keep, upcast=True), *inputs, do[sl])
                peer = _fwd_bwd(lambda a, b_, c: _math(a, b_, c, causal=True, keep=keep, upcast=False), *inputs, do[sl])
                got = [out.detach()[sl], *(g[sl] for g in grads)]
                row["batches"].append(_compare({"batch": b, "base_offset": b * H * S * D}, got, ref, peer))
            row["ok"] = all(x["ok"] for x in row["batches"])
            del out, grads
        except torch.cuda.OutOfMemoryError as e:
            row.update(ok=False, error=f"out of memory: {str(e)[:200]}")
        except Exception as e:
            row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
        for t in (q, k, v):
            t.requires_grad_(False)
        if not dry:
            torch.cuda.empty_cache()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        record["cases"].append(row)
        record.save()
    record["ok"] = all(c.get("ok") for c in record["cases"])
    record.save()


# ---------------------------------------------------------------------------------------------- step 6

#: Dispatch cases: name -> (shape kwargs, expected choice on CUDA with Triton installed).
DISPATCH_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "prefill bf16 causal 8K, D 128": (dict(B=1, Hq=32, Hkv=8, Sq=8192, Sk=8192, D=128, causal=True), "triton"),
    "decode S_q=1, 128K keys, GQA 4:1, padding": (
        dict(B=8, Hq=32, Hkv=8, Sq=1, Sk=131072, D=128, causal=True, pad=True), "sdpa"),
    "speculative decode S_q=16": (dict(B=8, Hq=32, Hkv=8, Sq=16, Sk=131072, D=128, causal=True), "sdpa"),
    "fp32 causal 64K, D 64": (dict(B=1, Hq=8, Hkv=8, Sq=65536, Sk=65536, D=64, causal=True, dtype="float32"), "sdpa"),
    "bf16 with a (1, H, 1, S_k) bias, 64K": (dict(B=1, Hq=8, Hkv=8, Sq=65536, Sk=65536, D=128, bias=True), "sdpa"),
    "bf16 D 256, 8K": (dict(B=1, Hq=8, Hkv=8, Sq=8192, Sk=8192, D=256, causal=True), "sdpa"),
    "fp32 chunked prefill 16K x 64K": (
        dict(B=1, Hq=8, Hkv=8, Sq=16384, Sk=65536, D=64, causal=True, dtype="float32"), "chunked"),
    "fp16 decode D 20, 1M keys (SDPA not fused)": (dict(B=64, Hq=32, Hkv=32, Sq=1, Sk=1 << 20, D=20, dtype="float16"),
                                                   "triton"),
    "bf16 sliding window 4K, 32K (Mistral)": (dict(B=1, Hq=32, Hkv=8, Sq=32768, Sk=32768, D=128, causal=True,
                                                   window=4096), "triton"),
    "bf16 soft cap 50, 8K (Gemma 2)": (dict(B=1, Hq=16, Hkv=8, Sq=8192, Sk=8192, D=128, causal=True, softcap=50.0),
                                       "triton"),
    "bf16 sinks, decode S_q=1 (GPT-OSS)": (dict(B=8, Hq=64, Hkv=8, Sq=1, Sk=65536, D=64, causal=True, sinks=True),
                                           "triton"),
    "fp32 soft cap (no Triton in fp32 auto)": (dict(B=1, Hq=8, Hkv=8, Sq=16384, Sk=16384, D=64, causal=True,
                                                    softcap=30.0, dtype="float32"), "chunked"),
}  # fmt: skip


def _inputs(device, *, B, Hq, Hkv, Sq, Sk, D, causal=False, pad=False, bias=False, dtype="bfloat16", window=None,
            softcap=None, sinks=False):
    import torch

    from core.attention import prepare_inputs

    dt = getattr(torch, dtype)
    make = torch.empty if device == "meta" else torch.randn
    q = make(B, Hq, Sq, D, device=device, dtype=dt)
    k, v = (make(B, Hkv, Sk, D, device=device, dtype=dt) for _ in range(2))
    kpm = None
    if pad:
        kpm = torch.zeros(B, Sk, dtype=torch.bool, device=device)
        if device != "meta":
            kpm[:, -Sk // 4 :] = True
    attn_bias = make(1, Hq, 1, Sk, device=device, dtype=dt) if bias else None
    sink_logits = make(Hq, device=device) if sinks else None
    return prepare_inputs(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=attn_bias, window=window,
                          softcap=softcap, sinks=sink_logits)  # fmt: skip


def step_dispatch(record: PartRecord) -> None:
    """Step 6: what ``auto`` chooses for typical shapes on CUDA (its facts, from meta tensors: runs anywhere);
    on a GPU, whether SDPA really runs a fused kernel where the rule counts on one, and what ran; a forced
    fallback by the memory budget (anywhere) and by a Triton tile that cannot fit the GPU (CUDA only)."""
    import torch

    from core import attention as A

    record["triton_installed"] = A.triton_installed()
    on_gpu = torch.cuda.is_available()
    for name, (shape, expected) in DISPATCH_CASES.items():
        a = _inputs("meta", **shape)
        facts = A.dispatch_facts(a, device_type="cuda")
        choice = A.auto_rule(**facts)
        # Without Triton the expectations (written for it) do not apply: recorded, not checked.
        ok = choice == expected if record["triton_installed"] else True
        row = {"case": name, "choice_on_cuda": choice, "expected": expected, "ok": ok,
               "facts": {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in facts.items()}}  # fmt: skip
        if on_gpu and choice == "sdpa" and facts["sdpa_fused"]:
            row["sdpa_fused_confirmed"] = _sdpa_kernel_check(shape)
            row["ok"] = row["ok"] and row["sdpa_fused_confirmed"] is True
        record["cases"].append(row)
        record.save()
    record["fallbacks"] = []
    record["fallbacks"].append(_budget_fallback("cuda" if on_gpu else "cpu"))
    record.save()
    if on_gpu:
        record["fallbacks"].append(_tile_fallback())
        record["fallbacks"].append(_fp32_long_memory())
    else:
        record["fallbacks"].append({"case": "triton tile that does not fit the GPU", "status": "skipped",
                                    "reason": "needs a CUDA device"})  # fmt: skip
    record["ok"] = all(c["ok"] for c in record["cases"]) and all(
        f.get("ok", True) for f in record["fallbacks"] if f.get("status") != "skipped"
    )
    record.save()


class _Spy:
    """Records which backends ``attention`` ran (wraps the entries of ``BACKENDS``)."""

    def __init__(self) -> None:
        from core import attention as A

        self.calls: list[str] = []
        self.saved = dict(A.BACKENDS)
        for n, fn in self.saved.items():
            A.BACKENDS[n] = lambda a, n=n, fn=fn: self.calls.append(n) or fn(a)

    def restore(self) -> None:
        from core import attention as A

        A.BACKENDS.update(self.saved)


def _sdpa_kernel_check(shape: dict[str, Any]) -> bool | str:
    """Run ``sdpa`` on a small version of the case (same dtype, head dims, GQA, mask kinds) with SDPA limited
    to its flash and memory-efficient kernels: True when it runs, else the error SDPA gave."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from core.attention import BACKENDS

    sq = min(shape["Sq"], 512) if shape["Sq"] == shape["Sk"] else min(shape["Sq"], 256)  # keep S_q = S_k (is_causal)
    small = {**shape, "Sq": sq, "Sk": min(shape["Sk"], 512), "B": min(shape["B"], 2)}
    a = _inputs("cuda", **small)
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            BACKENDS["sdpa"](a)
        return True
    except RuntimeError as e:  # "No available kernel" (with PyTorch's reasons in the warnings)
        return f"{type(e).__name__}: {str(e)[:300]}"


def _budget_fallback(device: str) -> dict[str, Any]:
    """``memory_budget=0``: the dense-score rule cannot take sdpa; auto must run chunked, same result."""
    import torch

    from core.attention import attention

    torch.manual_seed(0)
    # fp32 and D = 20 keep Triton and SDPA's fused kernels out: the dense-score rule decides.
    q, k, v = (torch.randn(1, 2, 100, 20, device=device) for _ in range(3))
    spy = _Spy()
    try:
        out = attention(q, k, v, causal=True, memory_budget=0)
    finally:
        spy.restore()
    ref = attention(q, k, v, causal=True, backend="reference")
    err = (out - ref).abs().max().item()
    return {"case": "memory_budget=0 (fp32, D 20)", "ran": spy.calls, "err": err,
            "ok": spy.calls == ["chunked"] and err < 1e-4}  # fmt: skip


def _tile_fallback() -> dict[str, Any]:
    """Force a forward tile beyond the GPU's shared memory (K/V stages alone ~400 KB at D = 128): the launch
    raises, ``kernels.flash_attention.launch`` turns it into a ValueError, ``auto`` falls back to sdpa."""
    import torch

    import kernels.flash_attention as fa
    from core.attention import attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    real = fa._fwd_config
    fa._fwd_config = lambda d, dtype: {"BLOCK_M": 256, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4}
    spy = _Spy()
    row: dict[str, Any] = {"case": "triton forward tile 256x256, 4 stages (past shared memory): auto falls back"}
    try:
        out = attention(q, k, v, causal=True)
        ran = list(spy.calls)  # before the reference below adds its own call
        ref = attention(q.float(), k.float(), v.float(), causal=True, backend="reference")
        row.update(ran=ran, err=(out.float() - ref).abs().max().item())
        row["ok"] = ran == ["triton", "sdpa"] and row["err"] < 2e-2
    except Exception as e:
        row.update(ran=spy.calls, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        fa._fwd_config = real
        spy.restore()
    return row


def _fp32_long_memory() -> dict[str, Any]:
    """fp32, causal, S = 32K through ``auto``: sdpa's fused kernel must keep peak memory far below the 32 GiB
    of dense fp32 scores (the rule sends it there instead of to the chunked loop)."""
    import torch

    from core.attention import attention

    B, H, S, D = 1, 8, 32768, 64
    q, k, v = (torch.randn(B, H, S, D, device="cuda") for _ in range(3))
    spy = _Spy()
    row: dict[str, Any] = {"case": f"fp32 causal {B}x{H}x{S}x{D} via auto: memory"}
    try:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        attention(q, k, v, causal=True)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        dense = B * H * S * S * 4
        row.update(ran=spy.calls, seconds=round(time.perf_counter() - t0, 3), peak_mib=round(peak / 2**20, 1),
                   dense_scores_mib=dense // 2**20, ok=spy.calls == ["sdpa"] and peak < dense / 16)  # fmt: skip
    except Exception as e:
        row.update(ran=spy.calls, ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        spy.restore()
    return row


CHILD_STEPS = {"numerics": step_numerics, "int64": step_int64, "dispatch": step_dispatch}
