"""Backward kernels of ``kernels.flash_attention`` (no atomics): one program per (key block, batch x key/value
head) accumulates dK and dV over every query block of the group's query heads; one program per (query block,
batch x query head) accumulates dQ over the key blocks it sees. Both recompute ``P = 2^(s - lse)`` from the saved
base-2 log-sum-exp (attention sinks are already in it), with the same causal, window, padding and soft-cap
handling as the forward."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.tiles import _load_tile, _store_tile

__all__ = ["_attn_bwd_dkdv", "_attn_bwd_dq"]

# ----------------------------------------------------------------------------------------------------
# Dense backward
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, KPM, DK, DV_,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dob, s_doh, s_dos, s_dod,
    s_dkb, s_dkh, s_dks, s_dkd,
    s_dvb, s_dvh, s_dvs, s_dvd,
    s_pb,
    H, GROUPS, Sq, Sk, qk_scale, sm_scale, window, cap_in, cap_out,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per (key block, batch * kv head): dK, dV summed over the group's query heads."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    HKV = H // GROUPS
    b = (pid_bh // HKV).to(tl.int64)  # 64-bit base offsets (see the forward kernel)
    hk = (pid_bh % HKV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k = _load_tile(K + b * s_kb + hk * s_kh + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd,
                   offs_n, Sk, offs_d, D, BLOCK_D, EVEN_N)  # fmt: skip
    v = _load_tile(V + b * s_vb + hk * s_vh + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd,
                   offs_n, Sk, offs_dv, DV, BLOCK_DV, EVEN_N)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    if HAS_PAD:
        keep_n = tl.load(KPM + b * s_pb + offs_n, mask=offs_n < Sk, other=1) == 0
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    causal_off = Sk - Sq
    lo = 0
    hi = Sq
    if CAUSAL:
        # The first query that sees key n0 is n0 - causal_off.
        lo = (tl.maximum(pid_n * BLOCK_N - causal_off, 0) // BLOCK_M) * BLOCK_M
    if HAS_WINDOW:
        # Query m sees key n only if n > m + causal_off - window: m < n_last - causal_off + window.
        hi = tl.maximum(tl.minimum(Sq, pid_n * BLOCK_N + BLOCK_N - 1 - causal_off + window), 0)
        if not CAUSAL:  # and n < m + causal_off + window: m > n0 - causal_off - window
            lo = (tl.maximum(pid_n * BLOCK_N - causal_off - window + 1, 0) // BLOCK_M) * BLOCK_M
    for g in range(GROUPS):
        h = hk * GROUPS + g
        q_base = Q + b * s_qb + h * s_qh
        do_base = DO + b * s_dob + h * s_doh
        row_base = (b * H + h) * Sq
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + tl.arange(0, BLOCK_M)
            row_ok = offs_m[:, None] < Sq
            q = tl.load(q_base + offs_m[:, None] * s_qs + offs_d[None, :] * s_qd, mask=row_ok & dmask_k, other=0.0)
            do = tl.load(do_base + offs_m[:, None] * s_dos + offs_dv[None, :] * s_dod, mask=row_ok & dmask_v, other=0.0)
            if EVEN_M:
                lse = tl.load(LSE + row_base + offs_m)
                delta = tl.load(DELTA + row_base + offs_m)
            else:
                lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Sq, other=float("inf"))
                delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Sq, other=0.0)
            qk_t = tl.dot(k, tl.trans(q), input_precision=PRECISION)  # (N, M)
            if HAS_SOFTCAP:
                t_t = 1.0 - 2.0 / (tl.math.exp2(qk_t * cap_in * 2.8853900817779268) + 1.0)  # tanh(score / cap)
                qk_t = t_t * cap_out
            else:
                qk_t = qk_t * qk_scale
            p_t = tl.math.exp2(qk_t - lse[None, :])
            if CAUSAL:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + causal_off, p_t, 0.0)
            if HAS_WINDOW:
                p_t = tl.where(offs_n[:, None] > offs_m[None, :] + causal_off - window, p_t, 0.0)
                if not CAUSAL:
                    p_t = tl.where(offs_n[:, None] < offs_m[None, :] + causal_off + window, p_t, 0.0)
            if HAS_PAD:
                p_t = tl.where(keep_n[:, None], p_t, 0.0)
            dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (N, M)
            ds_t = p_t * (dp_t - delta[None, :])
            if HAS_SOFTCAP:  # through the cap: d(cap tanh(x / cap)) / dx = 1 - tanh²
                ds_t = ds_t * (1.0 - t_t * t_t)
            dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=PRECISION)
    dk = dk * sm_scale
    _store_tile(DK + b * s_dkb + hk * s_dkh + offs_n[:, None] * s_dks + offs_d[None, :] * s_dkd,
                dk.to(DK.dtype.element_ty), offs_n, Sk, offs_d, D, BLOCK_D, EVEN_N)  # fmt: skip
    _store_tile(DV_ + b * s_dvb + hk * s_dvh + offs_n[:, None] * s_dvs + offs_dv[None, :] * s_dvd,
                dv.to(DV_.dtype.element_ty), offs_n, Sk, offs_dv, DV, BLOCK_DV, EVEN_N)  # fmt: skip


@triton.jit
def _attn_bwd_dq(
    Q, K, V, DO, LSE, DELTA, KPM, DQ,
    s_qb, s_qh, s_qs, s_qd,
    s_kb, s_kh, s_ks, s_kd,
    s_vb, s_vh, s_vs, s_vd,
    s_dob, s_doh, s_dos, s_dod,
    s_dqb, s_dqh, s_dqs, s_dqd,
    s_pb,
    H, GROUPS, Sq, Sk, qk_scale, sm_scale, window, cap_in, cap_out,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One program per (query block, batch * query head): dQ over the key blocks it sees."""
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
    do = _load_tile(DO + b * s_dob + h * s_doh + offs_m[:, None] * s_dos + offs_dv[None, :] * s_dod,
                    offs_m, Sq, offs_dv, DV, BLOCK_DV, EVEN_M)  # fmt: skip
    if EVEN_M:
        lse = tl.load(LSE + row_base + offs_m)
        delta = tl.load(DELTA + row_base + offs_m)
    else:
        lse = tl.load(LSE + row_base + offs_m, mask=offs_m < Sq, other=float("inf"))
        delta = tl.load(DELTA + row_base + offs_m, mask=offs_m < Sq, other=0.0)
    k_base = K + b * s_kb + hk * s_kh
    v_base = V + b * s_vb + hk * s_vh
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    dmask_k = offs_d[None, :] < D
    dmask_v = offs_dv[None, :] < DV
    causal_off = Sk - Sq
    lo = 0
    hi = Sk
    if CAUSAL:
        hi = tl.maximum(tl.minimum(Sk, pid_m * BLOCK_M + BLOCK_M + causal_off), 0)
    if HAS_WINDOW:
        if not CAUSAL:
            hi = tl.maximum(tl.minimum(Sk, pid_m * BLOCK_M + BLOCK_M - 1 + causal_off + window), 0)
        lo = (tl.maximum(pid_m * BLOCK_M + causal_off - window + 1, 0) // BLOCK_N) * BLOCK_N
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n[:, None] < Sk
        k = tl.load(k_base + offs_n[:, None] * s_ks + offs_d[None, :] * s_kd, mask=col_ok & dmask_k, other=0.0)
        v = tl.load(v_base + offs_n[:, None] * s_vs + offs_dv[None, :] * s_vd, mask=col_ok & dmask_v, other=0.0)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        if HAS_SOFTCAP:
            t = 1.0 - 2.0 / (tl.math.exp2(qk * cap_in * 2.8853900817779268) + 1.0)  # tanh(score / cap)
            qk = t * cap_out
        else:
            qk = qk * qk_scale
        p = tl.math.exp2(qk - lse[:, None])
        if not EVEN_N:
            p = tl.where(offs_n[None, :] < Sk, p, 0.0)
        if CAUSAL:
            p = tl.where(offs_n[None, :] <= offs_m[:, None] + causal_off, p, 0.0)
        if HAS_WINDOW:
            p = tl.where(offs_n[None, :] > offs_m[:, None] + causal_off - window, p, 0.0)
            if not CAUSAL:
                p = tl.where(offs_n[None, :] < offs_m[:, None] + causal_off + window, p, 0.0)
        if HAS_PAD:
            pad = tl.load(KPM + b * s_pb + offs_n, mask=offs_n < Sk, other=1)
            p = tl.where(pad[None, :] == 0, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - t * t)
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    dq = dq * sm_scale
    _store_tile(DQ + b * s_dqb + h * s_dqh + offs_m[:, None] * s_dqs + offs_d[None, :] * s_dqd,
                dq.to(DQ.dtype.element_ty), offs_m, Sq, offs_d, D, BLOCK_D, EVEN_M)  # fmt: skip
