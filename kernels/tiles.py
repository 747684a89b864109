"""Triton device helpers shared by the attention kernels (``kernels.flash_attention``, its backward
``kernels.flash_attention_bwd`` and ``kernels.block_sparse``): masked tile loads and stores, the final
normalisation of an online softmax, and the backward's ``delta = rowsum(dO ∘ O)`` kernel."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_load_tile", "_store_tile", "_finish_rows", "_attn_bwd_preprocess"]

# ----------------------------------------------------------------------------------------------------
# Shared device helpers (also used by kernels.block_sparse)
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptrs, offs_r, n_r, offs_c, N_C: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_R: tl.constexpr):
    """Load a (rows, BLOCK_C) tile; rows ``>= n_r`` and columns ``>= N_C`` read as 0."""
    if EVEN_R:
        if N_C == BLOCK_C:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_c[None, :] < N_C, other=0.0)
    else:
        if N_C == BLOCK_C:
            x = tl.load(ptrs, mask=offs_r[:, None] < n_r, other=0.0)
        else:
            x = tl.load(ptrs, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < N_C), other=0.0)
    return x


@triton.jit
def _store_tile(ptrs, x, offs_r, n_r, offs_c, N_C: tl.constexpr, BLOCK_C: tl.constexpr, EVEN_R: tl.constexpr):
    """Store a (rows, BLOCK_C) tile, skipping rows ``>= n_r`` and columns ``>= N_C``."""
    if EVEN_R:
        if N_C == BLOCK_C:
            tl.store(ptrs, x)
        else:
            tl.store(ptrs, x, mask=offs_c[None, :] < N_C)
    else:
        if N_C == BLOCK_C:
            tl.store(ptrs, x, mask=offs_r[:, None] < n_r)
        else:
            tl.store(ptrs, x, mask=(offs_r[:, None] < n_r) & (offs_c[None, :] < N_C))


@triton.jit
def _finish_rows(acc, l_i, m_i):
    """Normalise the accumulator; log-sum-exp (base 2) is +inf for rows that saw no key."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(seen, m_i + tl.math.log2(l_safe), float("inf"))
    return out, lse


@triton.jit
def _attn_bwd_preprocess(
    O, DO, DELTA,
    s_ob, s_oh, s_os, s_od,
    s_dob, s_doh, s_dos, s_dod,
    H, Sq,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, EVEN_M: tl.constexpr,
):  # fmt: skip
    """delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (fp32)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # 64-bit base offsets: b * stride_b + h * stride_h reaches B*H*S*D elements, past 2**31 at long contexts.
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row_base = pid_bh.to(tl.int64) * Sq  # this (batch, head)'s first row in LSE / DELTA (B*H*S_q of them)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_tile(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_dv[None, :] * s_od,
                   offs_m, Sq, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    do = _load_tile(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dos + offs_dv[None, :] * s_dod,
                    offs_m, Sq, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if EVEN_M:
        tl.store(DELTA + row_base + offs_m, delta)
    else:
        tl.store(DELTA + row_base + offs_m, delta, mask=offs_m < Sq)
