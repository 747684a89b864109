"""Block-sparse attention in Triton: each query block visits only its selected key blocks.

``block_sparse_attention(q, k, v, block_index, *, block_size, causal, key_padding_mask, scale)`` has the
signature (minus ``backend``) and the semantics of ``core.blocksparse.block_sparse_attention``: queries and
keys are cut into blocks of ``block_size`` rows (the last may be short); ``block_index`` is int64
``(B, H_q, NQ, K)`` with the key-block ids of each query block, ``-1`` for an unused slot, no duplicates.
Query ``i`` attends, with an exact softmax, to the keys of its query block's selected key blocks, further
restricted by ``causal`` (bottom-right aligned) and ``key_padding_mask`` (bool ``(B, S_k)``, True =
padded); a query that sees no key returns zeros. GQA: query head ``h`` reads kv head ``h // (H_q / H_kv)``.

Forward: one program per (query block, batch*head) runs the FlashAttention-2 online softmax over the
``K`` slots of its row of ``block_index`` (``-1`` slots are skipped), so work is ``O(S_q · K · block)``.

Backward: dQ by one program per query block over the same list. dK/dV without atomics: the host builds
the transposed index (for each (batch, kv head, key block), the ascending list of (query head in the
group, query block) pairs that selected it, ``-1`` padded; built with a ``(B, H_q, NQ, NK)`` bool table,
``O((S/block)²)`` memory, never ``O(S²)``), and one program per key block accumulates over that list.

Limits: those of ``kernels.flash_attention`` (CUDA or interpreter mode, fp16/bf16/fp32, head dims
16..128) and ``block_size`` in 1..128 (tiles are padded to a power of two ≥ 16 with masks, so block
sizes that are powers of two from 16 up waste no work).
"""

from __future__ import annotations

import logging
import math

import torch
import triton
import triton.language as tl

from kernels.flash_attention import (
    LOG2E,
    _block_d,
    _empty,
    _finish_rows,
    _load_tile,
    _precision,
    _store_tile,
    bwd_delta,
    check_device,
    check_tensors,
    compact_rows,
    is_interpreted,
    launch,
    padding_mask_u8,
)

logger = logging.getLogger(__name__)

__all__ = ["block_sparse_attention", "transpose_block_index", "MAX_BLOCK_SIZE"]

MAX_BLOCK_SIZE = 128


@triton.jit
def _bs_fwd(
    Q, K, V, O, LSE, KPM, IDX,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_ob, s_oh, s_os, s_od,
    s_pb,
    s_ib, s_ih, s_iq, s_ik,
    H, GROUPS, Sq, Sk, BS, NSLOT, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # 64-bit base offsets: b * stride_b + h * stride_h reaches B*H*S*D elements, past 2**31 at long contexts.
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row_base = pid_bh.to(tl.int64) * Sq  # this (batch, head)'s first row in LSE / DELTA (B*H*S_q of them)
    hk = h // GROUPS
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m0 = pid_q * BS
    offs_m = m0 + offs_r
    q_end = tl.minimum(Sq, m0 + BS)  # rows of this query block: [m0, q_end)
    q = _load_tile(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd,
                   offs_m, q_end, offs_d, D, BLOCK_D, EVEN_M)  # fmt: skip
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    idx_base = IDX + b * s_ib + h * s_ih + pid_q * s_iq
    m_i = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK], dtype=tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    causal_off = Sk - Sq
    last_visible = q_end - 1 + causal_off  # the largest key any row of this block may see (causal)
    for s in range(NSLOT):
        j = tl.load(idx_base + s * s_ik)
        n0 = j * BS
        run = j >= 0
        if CAUSAL:
            run = run & (n0 <= last_visible)
        if run:
            offs_n = n0 + offs_r
            k_end = tl.minimum(Sk, n0 + BS)
            col_ok = offs_n[:, None] < k_end
            k = tl.load(k_base + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd, mask=col_ok & dmask_k, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd, mask=col_ok & dmask_v, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            if not EVEN_N:
                qk = tl.where(offs_n[None, :] < k_end, qk, float("-inf"))
            if CAUSAL:
                qk = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_off, qk, float("-inf"))
            if HAS_PAD:
                pad = tl.load(KPM + b * s_pb + offs_n, mask=offs_n < k_end, other=1)
                qk = tl.where(pad[None, :] == 0, qk, float("-inf"))
            # Online softmax step (as in kernels.flash_attention._fwd_inner).
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_safe[:, None])
            alpha = tl.math.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
            m_i = m_new
    out, lse = _finish_rows(acc, l_i, m_i)
    _store_tile(O + b * s_ob + h * s_oh + offs_m[:, None] * s_os + offs_dv[None, :] * s_od,
                out.to(O.dtype.element_ty), offs_m, q_end, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    if EVEN_M:
        tl.store(LSE + row_base + offs_m, lse)
    else:
        tl.store(LSE + row_base + offs_m, lse, mask=offs_m < q_end)


@triton.jit
def _bs_bwd_dq(
    Q, K, V, DO, LSE, DELTA, KPM, IDX, DQ,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dob, s_doh, s_dos, s_dod,
    s_dqb, s_dqh, s_dqs, s_dqd,
    s_pb,
    s_ib, s_ih, s_iq, s_ik,
    H, GROUPS, Sq, Sk, BS, NSLOT, qk_scale, sm_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    # 64-bit base offsets: b * stride_b + h * stride_h reaches B*H*S*D elements, past 2**31 at long contexts.
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    row_base = pid_bh.to(tl.int64) * Sq  # this (batch, head)'s first row in LSE / DELTA (B*H*S_q of them)
    hk = h // GROUPS
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m0 = pid_q * BS
    offs_m = m0 + offs_r
    q_end = tl.minimum(Sq, m0 + BS)
    q = _load_tile(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd,
                   offs_m, q_end, offs_d, D, BLOCK_D, EVEN_M)  # fmt: skip
    do = _load_tile(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dos + offs_dv[None, :] * s_dod,
                    offs_m, q_end, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    if EVEN_M:
        lse = tl.load(LSE + row_base + offs_m)
        delta = tl.load(DELTA + row_base + offs_m)
    else:
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < q_end, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < q_end, other=0.0)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    idx_base = IDX + b * s_ib + h * s_ih + pid_q * s_iq
    dq = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    causal_off = Sk - Sq
    last_visible = q_end - 1 + causal_off
    for s in range(NSLOT):
        j = tl.load(idx_base + s * s_ik)
        n0 = j * BS
        run = j >= 0
        if CAUSAL:
            run = run & (n0 <= last_visible)
        if run:
            offs_n = n0 + offs_r
            k_end = tl.minimum(Sk, n0 + BS)
            col_ok = offs_n[:, None] < k_end
            k = tl.load(k_base + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd, mask=col_ok & dmask_k, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd, mask=col_ok & dmask_v, other=0.0)
            qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
            p = tl.math.exp2(qk - lse[:, None])
            if not EVEN_N:
                p = tl.where(offs_n[None, :] < k_end, p, 0.0)
            if CAUSAL:
                p = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_off, p, 0.0)
            if HAS_PAD:
                pad = tl.load(KPM + b * s_pb + offs_n, mask=offs_n < k_end, other=1)
                p = tl.where(pad[None, :] == 0, p, 0.0)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * sm_scale
    _store_tile(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :] * s_dqd,
                dq.to(DQ.dtype.element_ty), offs_m, q_end, offs_d, D, BLOCK_D, EVEN_M)  # fmt: skip


@triton.jit
def _bs_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, KPM, TIDX, DK, DV_,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dob, s_doh, s_dos, s_dod,
    s_dkb, s_dkh, s_dks, s_dkd,
    s_dvb, s_dvh, s_dvs, s_dvd,
    s_pb,
    s_tb, s_th, s_tn, s_tk,
    H, GROUPS, Sq, Sk, BS, NQ, NSLOT, qk_scale, sm_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One program per (key block, batch * kv head), over the (query head, query block) pairs of TIDX."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = H // GROUPS
    b = (pid_bh // HKV).to(tl.int64)  # 64-bit base offsets (see the forward kernel)
    hk = (pid_bh % HKV).to(tl.int64)
    offs_r = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n0 = pid_n * BS
    offs_n = n0 + offs_r
    k_end = tl.minimum(Sk, n0 + BS)
    k = _load_tile(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd,
                   offs_n, k_end, offs_d, D, BLOCK_D, EVEN_N)  # fmt: skip
    v = _load_tile(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd,
                   offs_n, k_end, offs_dv, DV, BLOCK_DV, EVEN_N)  # fmt: skip
    dk = tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32)
    keep_n = offs_n < k_end
    if HAS_PAD:
        keep_n = keep_n & (tl.load(KPM + b * s_pb + offs_n, mask=offs_n < k_end, other=1) == 0)
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    causal_off = Sk - Sq
    t_base = TIDX + b * s_tb + hk * s_th + pid_n * s_tn
    for s in range(NSLOT):
        c = tl.load(t_base + s * s_tk)
        if c >= 0:
            g = c // NQ
            m0 = (c % NQ) * BS
            h = hk * GROUPS + g
            offs_m = m0 + offs_r
            q_end = tl.minimum(Sq, m0 + BS)
            row_ok = offs_m[:, None] < q_end
            q = tl.load(Q + b * s_qb + h * s_qh + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd,
                        mask=row_ok & dmask_k, other=0.0)  # fmt: skip
            do = tl.load(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dos + offs_dv[None, :] * s_dod,
                         mask=row_ok & dmask_v, other=0.0)  # fmt: skip
            row_base = (b * H + h) * Sq
            if EVEN_M:
                lse = tl.load(LSE + row_base + offs_m)
                delta = tl.load(DELTA + row_base + offs_m)
            else:
                lse = tl.load(LSE + row_base + offs_m, mask=offs_m < q_end, other=float("inf"))
                delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < q_end, other=0.0)
            qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale  # (keys, queries)
            p_t = tl.math.exp2(qk_t - lse[None, :])
            p_t = tl.where(keep_n[:, None], p_t, 0.0)
            if CAUSAL:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    dk = dk * sm_scale
    _store_tile(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dks + offs_d[None, :] * s_dkd,
                dk.to(DK.dtype.element_ty), offs_n, k_end, offs_d, D, BLOCK_D, EVEN_N)  # fmt: skip
    _store_tile(DV_ + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvs + offs_dv[None, :] * s_dvd,
                dv.to(DV_.dtype.element_ty), offs_n, k_end, offs_dv, DV, BLOCK_DV, EVEN_N)  # fmt: skip


# ----------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------


def _check_block_index(block_index: torch.Tensor, B: int, H: int, nq: int, nk: int) -> torch.Tensor:
    """Validate ``block_index`` (shape, range, no duplicate ids) and return it as contiguous int32."""
    if not isinstance(block_index, torch.Tensor) or block_index.dtype.is_floating_point or block_index.dtype == torch.bool:
        got = block_index.dtype if isinstance(block_index, torch.Tensor) else type(block_index).__name__
        raise ValueError(f"block_index must be an integer tensor (int64), got {got}")
    if block_index.dim() != 4 or tuple(block_index.shape[:3]) != (B, H, nq):
        raise ValueError(f"block_index must have shape (B, H_q, NQ, K) = ({B}, {H}, {nq}, K), got {tuple(block_index.shape)}")
    idx = block_index.long()
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= nk:
            raise ValueError(f"block_index ids must lie in [-1, {nk - 1}] (NK = {nk} key blocks), got range [{lo}, {hi}]")
        s = idx.sort(dim=-1).values
        if bool(((s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)).any()):
            raise ValueError("block_index has a duplicated key-block id in a row; each id may appear once")
    return idx.to(torch.int32).contiguous()


def transpose_block_index(block_index: torch.Tensor, *, nk: int, groups: int) -> torch.Tensor:
    """For each (batch, kv head, key block), the (query head in group, query block) pairs that selected it.

    Args:
        block_index: ``(B, H_q, NQ, K)`` ids in ``[-1, nk)``, no duplicates per row.
        nk: number of key blocks.
        groups: query heads per kv head.

    Returns:
        int32 ``(B, H_kv, NK, K_t)``: ascending codes ``g * NQ + query_block`` (``g`` the query head's rank
        in its group), ``-1`` padded; ``K_t`` is the largest number of selections of one key block.
    """
    B, Hq, nq, _ = block_index.shape
    hkv = Hq // groups
    sel = torch.zeros(B, Hq, nq, nk + 1, dtype=torch.bool, device=block_index.device)
    sel.scatter_(-1, torch.where(block_index < 0, nk, block_index).long(), True)
    sel_t = sel[..., :nk].reshape(B, hkv, groups * nq, nk).transpose(2, 3)  # (B, Hkv, NK, G*NQ)
    kt = int(sel_t.sum(dim=-1).max()) if sel_t.numel() else 0
    if kt == 0:
        return torch.full((B, hkv, nk, 0), -1, dtype=torch.int32, device=block_index.device)
    n_codes = groups * nq
    codes = torch.arange(n_codes, device=block_index.device, dtype=torch.int32)
    keyed = torch.where(sel_t, codes, n_codes)  # unselected pairs sort last
    first = keyed.topk(kt, dim=-1, largest=False, sorted=True).values
    return torch.where(first >= n_codes, -1, first).to(torch.int32).contiguous()


def _tile(block_size: int) -> int:
    return max(16, triton.next_power_of_2(block_size))


def _launch_opts(block: int, d: int) -> dict[str, int]:
    if is_interpreted():
        return {"num_warps": 1, "num_stages": 1}
    big = block * d >= 128 * 128
    return {"num_warps": 8 if big else 4, "num_stages": 1 if big else 2}


def _common(q, k, v, kpm_u8, block_size: int, causal: bool) -> dict:
    Sq, Sk = q.shape[2], k.shape[2]
    block = _tile(block_size)
    even = block == block_size
    return dict(
        D=q.shape[3], DV=v.shape[3], BLOCK_D=_block_d(q.shape[3]), BLOCK_DV=_block_d(v.shape[3]), BLOCK=block,
        CAUSAL=bool(causal), HAS_PAD=kpm_u8 is not None,
        EVEN_M=even and Sq % block_size == 0, EVEN_N=even and Sk % block_size == 0,
        PRECISION=_precision(q.dtype), **_launch_opts(block, max(q.shape[3], v.shape[3])),
    )  # fmt: skip


def _bs_forward(q, k, v, idx32, kpm_u8, block_size: int, causal: bool, scale: float):
    B, Hq, Sq, _ = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    o = _empty((B, Hq, Sq, Dv), like=q)
    lse = _empty((B, Hq, Sq), like=q, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    kpm = kpm_u8 if kpm_u8 is not None else q
    nq = idx32.shape[2]
    launch(
        _bs_fwd, (nq, B * Hq), q, k, v, o, lse, kpm, idx32,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        kpm.stride(0) if kpm_u8 is not None else 0, *idx32.stride(),
        Hq, Hq // Hkv, Sq, Sk, block_size, idx32.shape[3], scale * LOG2E,
        **_common(q, k, v, kpm_u8, block_size, causal),
    )  # fmt: skip
    return o, lse


def _bs_backward(q, k, v, o, lse, do, idx32, kpm_u8, block_size: int, causal: bool, scale: float):
    B, Hq, Sq, _ = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    dq, dk, dv = _empty(q.shape, like=q), _empty(k.shape, like=k), _empty(v.shape, like=v)
    if B == 0 or Sq == 0 or Sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    nq, nk = idx32.shape[2], math.ceil(Sk / block_size)
    groups = Hq // Hkv
    delta = bwd_delta(o, do)
    tidx = transpose_block_index(idx32, nk=nk, groups=groups)
    kpm = kpm_u8 if kpm_u8 is not None else q
    s_pb = kpm.stride(0) if kpm_u8 is not None else 0
    common = _common(q, k, v, kpm_u8, block_size, causal)
    launch(
        _bs_bwd_dq, (nq, B * Hq), q, k, v, do, lse, delta, kpm, idx32, dq,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dq.stride(), s_pb, *idx32.stride(),
        Hq, groups, Sq, Sk, block_size, idx32.shape[3], scale * LOG2E, scale, **common,
    )  # fmt: skip
    launch(
        _bs_bwd_dkdv, (nk, B * Hkv), q, k, v, do, lse, delta, kpm, tidx, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(), s_pb, *tidx.stride(),
        Hq, groups, Sq, Sk, block_size, nq, tidx.shape[3], scale * LOG2E, scale, **common,
    )  # fmt: skip
    return dq, dk, dv


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, idx32, kpm_u8, block_size, causal, scale):
        o, lse = _bs_forward(q, k, v, idx32, kpm_u8, block_size, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse, idx32, kpm_u8)
        ctx.block_size, ctx.causal, ctx.scale = block_size, causal, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, idx32, kpm_u8 = ctx.saved_tensors
        do = compact_rows(do, "grad of the output")
        dq, dk, dv = _bs_backward(q, k, v, o, lse, do, idx32, kpm_u8, ctx.block_size, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None, None, None, None


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_index: torch.Tensor,
    *,
    block_size: int,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Exact softmax attention restricted to each query block's selected key blocks (differentiable).

    Args:
        q: queries ``(B, H_q, S_q, D)``, fp16/bf16/fp32, CUDA (or CPU under ``TRITON_INTERPRET=1``).
        k: keys ``(B, H_kv, S_k, D)``; ``H_kv`` divides ``H_q``.
        v: values ``(B, H_kv, S_k, D_v)``.
        block_index: int64 ``(B, H_q, NQ, K)``, ``NQ = ceil(S_q / block_size)``; key-block ids in
            ``[0, ceil(S_k / block_size))``, ``-1`` = unused slot, no duplicates in a row.
        block_size: rows per query block and per key block, 1..128.
        causal: bottom-right aligned causal mask (query ``i`` sees key ``j`` iff ``j <= i + S_k - S_q``).
        key_padding_mask: bool ``(B, S_k)``, True = padded key.
        scale: score scale, default ``1/sqrt(D)``.

    Returns:
        ``(B, H_q, S_q, D_v)`` in the dtype of ``q``; rows that see no key are zeros.

    Raises:
        ValueError: for what the kernel does not support (see ``kernels.flash_attention``), a block size
            outside 1..128, or a malformed ``block_index``.
    """
    check_tensors(q, k, v)
    if not isinstance(block_size, int) or isinstance(block_size, bool) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int in 1..{MAX_BLOCK_SIZE} for the Triton kernel, got {block_size!r}")
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    nq, nk = math.ceil(Sq / block_size), math.ceil(Sk / block_size)
    idx32 = _check_block_index(block_index.to(q.device), B, Hq, nq, nk)
    kpm_u8 = padding_mask_u8(key_padding_mask, B, Sk, q.device)
    check_device(q)
    q, k, v = (compact_rows(t, name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    return _BlockSparseAttention.apply(q, k, v, idx32, kpm_u8, block_size, bool(causal), float(scale))
