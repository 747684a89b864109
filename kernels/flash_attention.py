"""FlashAttention-2 style Triton kernels: forward, backward, autograd wrapper.

``flash_attention(q, k, v, *, causal, key_padding_mask, attn_bias, scale)`` has the signature and the
semantics of ``core.attention.attention`` (layout ``(B, H, S, D)``):

* queries and keys may have different lengths; ``causal`` is bottom-right aligned: query ``i`` sees key
  ``j`` iff ``j <= i + (S_k - S_q)``;
* ``key_padding_mask`` is bool ``(B, S_k)``, ``True`` marks a padded key;
* grouped-query attention: query head ``h`` reads key/value head ``h // (H_q // H_kv)``; K/V are never
  repeated in memory, the kernels map head indices;
* a query row that sees no key returns zeros (and gets zero gradients).

Forward: one program per (query block, batch*head); online softmax in base 2 (scores pre-multiplied by
``scale * log2(e)``); with ``causal`` the key loop stops at the diagonal, and only the blocks that cross the
diagonal pay for the causal mask. The per-row log-sum-exp (base 2) is saved for the backward.

Backward (no atomics): a preprocess kernel computes ``delta = rowsum(dO * O)``; one kernel per key block
accumulates dK and dV over every query block (and over the query heads of its group, for GQA); one
kernel per query block accumulates dQ over the key blocks.

Also: sliding windows (causal, or bidirectional without ``causal``: key blocks outside every row's window are
skipped, every visited block is masked), logit soft-capping ``cap · tanh(s / cap)`` (forward; backward through
``1 - tanh²``), attention sinks (the sink starts each row's online softmax as its first term, so the saved
log-sum-exp includes it and the backward kernels are unchanged; the sinks' gradient ``-P_sink · rowsum(dO ∘ O)``
is computed on the host from the log-sum-exp and ``delta``).

Limits: CUDA tensors (or CPU tensors when Triton runs in interpreter mode: ``TRITON_INTERPRET=1`` set
before triton is imported, for the whole process); fp16, bf16, fp32 (fp32 dots use IEEE precision, not TF32); head dims
16..128 (padded to a power of two inside the kernel); no ``attn_bias`` (``core`` falls back to another
backend when a bias is given).
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from kernels.flash_attention_bwd import _attn_bwd_dkdv, _attn_bwd_dq
from kernels.tiles import _attn_bwd_preprocess, _finish_rows, _load_tile, _store_tile

logger = logging.getLogger(__name__)

__all__ = ["flash_attention", "is_interpreted", "tile_span", "MIN_HEAD_DIM", "MAX_HEAD_DIM", "SUPPORTED_DTYPES"]

LOG2E = 1.4426950408889634
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 128
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _empty(shape: tuple[int, ...], *, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Allocate a kernel output (uninitialised: every element must be written by a kernel).

    Tests replace this function with one that fills NaN, so an element a kernel forgets to write shows.
    """
    return torch.empty(shape, device=like.device, dtype=dtype or like.dtype)


# ----------------------------------------------------------------------------------------------------
# Dense forward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, kpm_base,
    s_ks, s_kd, s_vs, s_vd,
    offs_m, Sk, causal_off, qk_scale, lo, hi, window, cap_in, cap_out,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_N: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW_MASK: tl.constexpr, BIDIR_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    # Loop bodies are written inline: device-function calls are costly in interpreter mode.
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k_ptrs = k_base + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd
        v_ptrs = v_base + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd
        if EVEN_N:
            k = tl.load(k_ptrs, mask=dmask_k, other=0.0)
            v = tl.load(v_ptrs, mask=dmask_v, other=0.0)
        else:
            k = tl.load(k_ptrs, mask=(offs_n[:, None] < Sk) & dmask_k, other=0.0)
            v = tl.load(v_ptrs, mask=(offs_n[:, None] < Sk) & dmask_v, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_SOFTCAP:  # cap * tanh(score / cap) in base-2 units; tanh(x) = 1 - 2 / (exp(2x) + 1)
            qk = (1.0 - 2.0 / (tl.math.exp2(qk * cap_in * 2.8853900817779268) + 1.0)) * cap_out
        else:
            qk = qk * qk_scale
        if not EVEN_N:
            qk = tl.where(offs_n[None, :] < Sk, qk, float("-inf"))
        if CAUSAL_MASK:
            qk = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_off, qk, float("-inf"))
        if WINDOW_MASK:
            qk = tl.where(offs_n[None, :] > offs_m[:, None] + causal_off - window, qk, float("-inf"))
            if BIDIR_WINDOW:
                qk = tl.where(offs_n[None, :] < offs_m[:, None] + causal_off + window, qk, float("-inf"))
        if HAS_PAD:
            pad = tl.load(kpm_base + offs_n, mask=offs_n < Sk, other=1)
            qk = tl.where(pad[None, :] == 0, qk, float("-inf"))
        # Online softmax step; a row with every key masked so far keeps m = -inf: subtract 0 then (no NaN).
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(
    Q, K, V, O, LSE, KPM, SINK,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_ob, s_oh, s_os, s_od,
    s_pb,
    H, GROUPS, Sq, Sk, qk_scale, window, cap_in, cap_out,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # 64-bit base offsets: b * stride_b + h * stride_h reaches B*H*S*D elements, past 2**31 at long contexts.
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row_base = pid_bh.to(tl.int64) * Sq  # this (batch, head)'s first row in LSE / DELTA (B*H*S_q of them)
    hk = h // GROUPS
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_tile(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd,
                   offs_m, Sq, offs_d, D, BLOCK_D, EVEN_M)  # fmt: skip
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    kpm_base = KPM + b * s_pb
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINK:  # the sink: one more logit per row with value zero, the softmax's first term (base 2)
        m_i = tl.load(SINK + row_base + offs_m, mask=offs_m < Sq, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    causal_off = Sk - Sq
    if HAS_WINDOW:
        # Keys in [lo, hi) may be seen by some row of this block; every block gets the window (and causal) mask.
        if CAUSAL:
            hi = tl.maximum(tl.minimum(Sk, pid_m * BLOCK_M + BLOCK_M + causal_off), 0)
        else:
            hi = tl.maximum(tl.minimum(Sk, pid_m * BLOCK_M + BLOCK_M - 1 + causal_off + window), 0)
        lo = tl.minimum((tl.maximum(pid_m * BLOCK_M + causal_off - window + 1, 0) // BLOCK_N) * BLOCK_N, hi)
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, kpm_base, s_ks, s_kd, s_vs, s_vd,
                                   offs_m, Sk, causal_off, qk_scale, lo, hi, window, cap_in, cap_out,
                                   D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, HAS_PAD, EVEN_N, PRECISION,
                                   True, not CAUSAL, HAS_SOFTCAP)  # fmt: skip
    elif CAUSAL:
        # Keys < hi may be seen by some row of this block; keys < lo_diag by every row of it.
        hi = tl.maximum(tl.minimum(Sk, pid_m * BLOCK_M + BLOCK_M + causal_off), 0)
        lo_diag = tl.minimum((tl.maximum(pid_m * BLOCK_M + causal_off + 1, 0) // BLOCK_N) * BLOCK_N, hi)
        # Blocks entirely below the diagonal: no causal mask, and in bounds (lo_diag <= Sk, a block multiple).
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, kpm_base, s_ks, s_kd, s_vs, s_vd,
                                   offs_m, Sk, causal_off, qk_scale, 0, lo_diag, window, cap_in, cap_out,
                                   D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_PAD, True, PRECISION,
                                   False, False, HAS_SOFTCAP)  # fmt: skip
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, kpm_base, s_ks, s_kd, s_vs, s_vd,
                                   offs_m, Sk, causal_off, qk_scale, lo_diag, hi, window, cap_in, cap_out,
                                   D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, True, HAS_PAD, EVEN_N, PRECISION,
                                   False, False, HAS_SOFTCAP)  # fmt: skip
    else:
        acc, l_i, m_i = _fwd_inner(acc, l_i, m_i, q, k_base, v_base, kpm_base, s_ks, s_kd, s_vs, s_vd,
                                   offs_m, Sk, causal_off, qk_scale, 0, Sk, window, cap_in, cap_out,
                                   D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, HAS_PAD, EVEN_N, PRECISION,
                                   False, False, HAS_SOFTCAP)  # fmt: skip
    out, lse = _finish_rows(acc, l_i, m_i)
    _store_tile(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_dv[None, :] * s_od,
                out.to(O.dtype.element_ty), offs_m, Sq, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    if EVEN_M:
        tl.store(LSE + row_base + offs_m, lse)
    else:
        tl.store(LSE + row_base + offs_m, lse, mask=offs_m < Sq)


# ----------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------


def is_interpreted() -> bool:
    """True when this module's kernels were defined in Triton interpreter mode (``TRITON_INTERPRET=1``)."""
    return not isinstance(_attn_fwd, triton.runtime.JITFunction)


def _precision(dtype: torch.dtype) -> str:
    """Dot precision: IEEE for fp32 inputs (match the fp32 reference), tensor cores otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))


def _fwd_config(d: int, dtype: torch.dtype) -> dict[str, int]:
    """Forward tile sizes, a plain function of head dim and dtype (no autotuning)."""
    if is_interpreted():
        # Small, unequal tiles so the tests cross many block and diagonal boundaries.
        return {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if d <= 64:
        return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}


def _bwd_config(d: int, dtype: torch.dtype) -> dict[str, int]:
    """Backward tile sizes: dK/dV kernel ``BLOCK_N`` keys x ``BLOCK_M`` queries, dQ kernel ``DQ_BLOCK_M``
    queries x ``DQ_BLOCK_N`` keys (the row block of each kernel's dots is the larger one, so Hopper can use
    warp-group MMA), a plain function of head dim and dtype."""
    if is_interpreted():
        return {"BLOCK_M": 32, "BLOCK_N": 64, "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 32, "num_warps": 1, "num_stages": 1}
    if dtype == torch.float32:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    if d > 64:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    return {"BLOCK_M": 64, "BLOCK_N": 64, "DQ_BLOCK_M": 64, "DQ_BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_bias: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` naming what the kernels do not support (``core`` then falls back).

    The device is checked separately (:func:`check_device`), last.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor (B, H, S, D), got {getattr(t, 'shape', type(t).__name__)}")
    if attn_bias is not None:
        raise ValueError("attn_bias is not supported by the Triton attention kernels; use another backend")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported by the Triton kernels; supported: {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B or k.shape[:3] != v.shape[:3]:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if k.shape[3] != D:
        raise ValueError(f"q head dim ({D}) must equal k head dim ({k.shape[3]})")
    for name, d in (("head dim", D), ("value head dim", v.shape[3])):
        if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{name} {d} is outside the range supported by the Triton kernels ({MIN_HEAD_DIM}..{MAX_HEAD_DIM})")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key/value heads ({Hkv}) must divide query heads ({Hq})")


def check_device(q: torch.Tensor) -> None:
    """Raise ``ValueError`` unless the kernels can run on ``q``'s device (checked after everything else)."""
    if q.device.type != "cuda" and not is_interpreted():
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got device {q.device} "
            "(or set TRITON_INTERPRET=1 before triton is imported to run them on the CPU interpreter)"
        )


#: In-tile offsets (``row * stride_s + col * stride_d``) are int32; base offsets of a (batch, head) are int64.
INT32_MAX = 2**31 - 1
_ROW_SLACK = 256  # masked rows past S whose (unused) pointers are still computed: up to one tile


def tile_span(t: torch.Tensor) -> int:
    """Largest in-tile element offset the kernels compute for ``t`` ``(B, H, S, D)``: rows up to ``S`` plus one
    tile of masked rows, times the sequence stride, plus the head-dim extent."""
    return (t.shape[2] + _ROW_SLACK) * abs(t.stride(2)) + t.shape[3] * abs(t.stride(3))


def compact_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` itself when its in-tile offsets fit int32, else a contiguous copy (a ``(B, S, H, D)`` view's
    sequence stride is ``H*D``); ``ValueError`` when even the copy's ``S*D`` does not fit."""
    if tile_span(t) <= INT32_MAX:
        return t
    dense = t.contiguous()
    if tile_span(dense) > INT32_MAX:
        raise ValueError(
            f"{name} of shape {tuple(t.shape)}: one (batch, head) holds S*D = {t.shape[2] * t.shape[3]} elements, "
            f"more than the kernels' int32 in-tile offsets reach ({INT32_MAX}); use another backend"
        )
    logger.debug("%s %s with strides %s copied to contiguous: in-tile offsets past int32", name, tuple(t.shape), t.stride())
    return dense


def padding_mask_u8(key_padding_mask: torch.Tensor | None, b: int, sk: int, device: torch.device) -> torch.Tensor | None:
    """Validate a bool ``(B, S_k)`` padding mask (True = padded) and return it as contiguous uint8."""
    if key_padding_mask is None:
        return None
    if key_padding_mask.dtype != torch.bool:
        raise ValueError(f"key_padding_mask must be bool (True = padded), got {key_padding_mask.dtype}")
    if tuple(key_padding_mask.shape) != (b, sk):
        raise ValueError(f"key_padding_mask must have shape (B, S_k) = ({b}, {sk}), got {tuple(key_padding_mask.shape)}")
    return key_padding_mask.to(device=device, dtype=torch.uint8).contiguous()


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """Launch ``kernel[grid](*args, **kwargs)``; a tile configuration the GPU cannot hold (shared memory,
    registers) becomes a ``ValueError`` naming it, so that ``core`` falls back instead of crashing."""
    try:
        kernel[grid](*args, **kwargs)
    except triton.runtime.errors.OutOfResources as e:
        name = getattr(getattr(kernel, "fn", None), "__name__", "kernel")
        tiles = {k: v for k, v in kwargs.items() if k.startswith("BLOCK") or k.startswith("num_")}
        raise ValueError(f"Triton {name} with {tiles} does not fit this GPU: {e}") from e


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(t.stride())


def _extras(window: int | None, softcap: float | None, scale: float) -> dict:
    """Runtime arguments and constexprs of the window and the soft cap."""
    return dict(
        window=int(window or 0),
        cap_in=(scale / softcap) if softcap else 0.0,  # score / cap, from the raw dot
        cap_out=(softcap * LOG2E) if softcap else 0.0,  # cap, in base-2 units
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
    )


def _flash_forward(q, k, v, kpm_u8, causal: bool, scale: float, window=None, softcap=None, sinks=None):
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    o = _empty((B, Hq, Sq, Dv), like=q)
    lse = _empty((B, Hq, Sq), like=q, dtype=torch.float32)  # base-2 log-sum-exp of the scaled scores
    if o.numel() == 0:
        return o, lse
    cfg = _fwd_config(max(D, Dv), q.dtype)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    kpm = kpm_u8 if kpm_u8 is not None else q
    extra = _extras(window, softcap, scale)
    grid = (triton.cdiv(Sq, bm), B * Hq)
    launch(
        _attn_fwd, grid, q, k, v, o, lse, kpm, sinks if sinks is not None else lse,
        *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        kpm.stride(0) if kpm_u8 is not None else 0,
        Hq, Hq // Hkv, Sq, Sk, scale * LOG2E, extra.pop("window"), extra.pop("cap_in"), extra.pop("cap_out"),
        D=D, DV=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), BLOCK_M=bm, BLOCK_N=bn,
        CAUSAL=bool(causal), HAS_PAD=kpm_u8 is not None, EVEN_M=Sq % bm == 0, EVEN_N=Sk % bn == 0,
        PRECISION=_precision(q.dtype), HAS_SINK=sinks is not None, **extra,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return o, lse


def bwd_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """``rowsum(dO * O)`` in fp32, shape (B, H, S)."""
    B, H, S, Dv = o.shape
    delta = _empty((B, H, S), like=o, dtype=torch.float32)
    if delta.numel() == 0:
        return delta
    bm = 16 if is_interpreted() else 64
    launch(
        _attn_bwd_preprocess, (triton.cdiv(S, bm), B * H), o, do, delta, *_strides(o), *_strides(do), H, S,
        DV=Dv, BLOCK_DV=_block_d(Dv), BLOCK_M=bm, EVEN_M=S % bm == 0,
    )  # fmt: skip
    return delta


def _flash_backward(q, k, v, o, lse, do, kpm_u8, causal: bool, scale: float, window=None, softcap=None):
    """``dq, dk, dv`` and ``delta = rowsum(dO * O)`` (the sinks' gradient needs it)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    dq = _empty(q.shape, like=q)
    dk = _empty(k.shape, like=k)
    dv = _empty(v.shape, like=v)
    if Sq == 0 or Sk == 0 or B == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), torch.zeros(B, Hq, Sq, device=q.device)
    delta = bwd_delta(o, do)
    cfg = _bwd_config(max(D, Dv), q.dtype)
    kpm = kpm_u8 if kpm_u8 is not None else q
    s_pb = kpm.stride(0) if kpm_u8 is not None else 0
    extra = _extras(window, softcap, scale)
    runtime = (extra.pop("window"), extra.pop("cap_in"), extra.pop("cap_out"))

    def consts(bm: int, bn: int) -> dict:
        return dict(
            D=D, DV=Dv, BLOCK_D=_block_d(D), BLOCK_DV=_block_d(Dv), BLOCK_M=bm, BLOCK_N=bn,
            CAUSAL=bool(causal), HAS_PAD=kpm_u8 is not None, EVEN_M=Sq % bm == 0, EVEN_N=Sk % bn == 0,
            PRECISION=_precision(q.dtype), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **extra,
        )  # fmt: skip

    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    launch(
        _attn_bwd_dkdv, (triton.cdiv(Sk, bn), B * Hkv), q, k, v, do, lse, delta, kpm, dk, dv,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dk), *_strides(dv), s_pb,
        Hq, Hq // Hkv, Sq, Sk, scale * LOG2E, scale, *runtime, **consts(bm, bn),
    )  # fmt: skip
    bm, bn = cfg["DQ_BLOCK_M"], cfg["DQ_BLOCK_N"]
    launch(
        _attn_bwd_dq, (triton.cdiv(Sq, bm), B * Hq), q, k, v, do, lse, delta, kpm, dq,
        *_strides(q), *_strides(k), *_strides(v), *_strides(do), *_strides(dq), s_pb,
        Hq, Hq // Hkv, Sq, Sk, scale * LOG2E, scale, *runtime, **consts(bm, bn),
    )  # fmt: skip
    return dq, dk, dv, delta


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kpm_u8, causal, scale, window, softcap, sinks3):
        sinks = None
        if sinks3 is not None:  # one fp32 logit per (batch, head, query row), contiguous
            sinks = sinks3.float().expand(q.shape[0], q.shape[1], q.shape[2]).contiguous()
        o, lse = _flash_forward(q, k, v, kpm_u8, causal, scale, window, softcap, sinks)
        ctx.save_for_backward(q, k, v, o, lse, kpm_u8, sinks3)
        ctx.causal, ctx.scale, ctx.window, ctx.softcap = causal, scale, window, softcap
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, kpm_u8, sinks3 = ctx.saved_tensors
        do = compact_rows(do, "grad of the output")
        dq, dk, dv, delta = _flash_backward(q, k, v, o, lse, do, kpm_u8, ctx.causal, ctx.scale, ctx.window,
                                            ctx.softcap)  # fmt: skip
        dsinks = None
        if sinks3 is not None and ctx.needs_input_grad[8]:
            # d sink = -P_sink · rowsum(dO ∘ O), P_sink = 2^(sink·log2 e - lse₂); summed where sinks3 broadcasts
            g = -torch.exp2(sinks3.float() * LOG2E - lse) * delta
            dims = [d for d in range(3) if sinks3.shape[d] == 1 and g.shape[d] != 1]
            dsinks = (g.sum(dim=dims, keepdim=True) if dims else g).to(sinks3.dtype)
        return dq, dk, dv, None, None, None, None, None, dsinks


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    scale: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact softmax attention with the Triton FlashAttention-2 kernels (differentiable).

    Args:
        q: queries ``(B, H_q, S_q, D)``, fp16/bf16/fp32, CUDA (or CPU under ``TRITON_INTERPRET=1``).
        k: keys ``(B, H_kv, S_k, D)``; ``H_kv`` divides ``H_q`` (grouped-query attention).
        v: values ``(B, H_kv, S_k, D_v)``.
        causal: bottom-right aligned causal mask: query ``i`` sees key ``j`` iff ``j <= i + S_k - S_q``.
        key_padding_mask: bool ``(B, S_k)``, True = padded key (never attended to).
        attn_bias: must be None: additive biases are not supported here (raises ``ValueError``).
        scale: score scale, default ``1/sqrt(D)``.
        window: sliding window around query ``i``'s position ``p = i + S_k - S_q``: with ``causal`` keys
            ``p - window < j <= p``, without ``|p - j| < window`` (key blocks outside it are skipped).
        softcap: scores become ``softcap · tanh(scores / softcap)`` (forward and backward).
        sinks: attention-sink logits broadcastable to ``(B, H_q, S_q)`` (3-d; a ``(H_q,)`` tensor: one per head):
            one more value-zero logit per row in the softmax; receives a gradient.

    Returns:
        ``(B, H_q, S_q, D_v)`` in the dtype of ``q``; rows that see no key are zeros.

    Raises:
        ValueError: for ``attn_bias``, an unsupported dtype or head dim, non-CUDA tensors outside
            interpreter mode, or inconsistent shapes.
    """
    check_tensors(q, k, v, attn_bias)
    kpm_u8 = padding_mask_u8(key_padding_mask, q.shape[0], k.shape[2], q.device)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None:
        sinks = sinks.view(1, -1, 1) if sinks.dim() == 1 else sinks
        try:
            ok = sinks.dim() == 3 and torch.broadcast_shapes(sinks.shape, q.shape[:3]) == q.shape[:3]
        except RuntimeError:
            ok = False
        if not ok:
            raise ValueError(f"sinks of shape {tuple(sinks.shape)} do not broadcast to (B, H_q, S_q) = {tuple(q.shape[:3])}")
    check_device(q)
    q, k, v = (compact_rows(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[3])
    return _FlashAttention.apply(q, k, v, kpm_u8, bool(causal), float(scale), window,
                                 None if softcap is None else float(softcap), sinks)  # fmt: skip
