"""The ``fused`` engine of the ``chunked`` backend on CPU: PyTorch's fused CPU attention kernel (the one behind
``scaled_dot_product_attention``), which returns the output and the row log-sum-exp, called on whole inputs or
on blocks whose results are merged by their log-sum-exp.

Two modes, same results:
    whole (causal and/or key padding only, no bias, window, segments or cap, no chunk sizes given): one kernel
        call over every (batch, head, query block): the kernel splits the work over batch × heads × query
        blocks across the threads itself, skips what causality hides, and takes the key padding as a
        broadcast ``(B, 1, 1, S_k)`` mask (never ``S_q · S_k``). Queries after a cached prefix (``S_q < S_k``)
        take two calls, the prefix keys (seen by every query) and the causal square, merged by log-sum-exp.
    blocks (everything else): the kernel on each ``(query chunk, key chunk)`` block of
        :class:`core.attention_blocks.Blocks` with the block's mask as an additive block; causal blocks whose
        diagonal starts at their top-left corner use the kernel's own causal mode.

Backward: the fused backward kernel on the same calls, given the *global* output and log-sum-exp of the rows,
which yields exact partial gradients.
"""

from __future__ import annotations

import functools

import torch

from core.attention_blocks import Blocks, kv_per_head, per_head

__all__ = ["fused_block_ops", "whole_call_fits", "forward_whole", "backward_whole", "forward_blocks",
           "backward_blocks", "WHOLE_GQA_MAX_BYTES"]  # fmt: skip

#: With grouped-query heads and ``causal``, the whole-call mode repeats K and V per query head (the kernel's
#: causal mode is per head); it does so up to this many bytes of repeated K and V, else it runs blocks.
WHOLE_GQA_MAX_BYTES = 256 * 2**20


@functools.lru_cache(maxsize=1)
def fused_block_ops():
    """PyTorch's fused CPU attention forward/backward ops (they return/take the row log-sum-exp), or None.

    They are ATen internals behind ``scaled_dot_product_attention`` on CPU; when a PyTorch build lacks them
    the chunked backend uses its plain block math instead.
    """
    try:
        aten = torch.ops.aten
        fwd = aten._scaled_dot_product_flash_attention_for_cpu
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
        return fwd, bwd
    except (AttributeError, RuntimeError):
        return None


# --- whole calls -------------------------------------------------------------------------------------------------


def whole_call_fits(bl: Blocks) -> bool:
    """Whether the inputs take the whole-call mode (module docs)."""
    plain = bl.bias4 is None and bl.window is None and bl.qseg is None and bl.softcap is None and bl.Dv == bl.D
    if not plain or bl.Sq == 0 or bl.Sk == 0 or (bl.causal and bl.Sq > bl.Sk):
        return False
    repeated = 2 * bl.B * bl.Hq * bl.Sk * bl.D * torch.empty((), dtype=bl.cdtype).element_size()
    return bl.G == 1 or not bl.causal or repeated <= WHOLE_GQA_MAX_BYTES


def _pad_mask(bl: Blocks, j0: int, j1: int) -> torch.Tensor | None:
    """Key padding of keys ``[j0, j1)`` as an additive ``(B, 1, 1, m)`` block (None: no padding)."""
    if bl.kpm is None:
        return None
    m = torch.zeros(bl.B, 1, 1, j1 - j0, dtype=bl.cdtype, device=bl.device)
    return m.masked_fill_(bl.kpm[:, j0:j1].view(bl.B, 1, 1, -1), float("-inf"))


def _empty_rows(bl: Blocks, j0: int, j1: int, causal: bool) -> torch.Tensor | None:
    """Bool ``(B, 1, S_q)``: rows that see no unpadded key among ``[j0, j1)`` (causal: key ``j0 + i`` last)."""
    if bl.kpm is None:
        return None
    real = ~bl.kpm[:, j0:j1]  # (B, m)
    if causal:
        return (real.cumsum(dim=1)[:, : bl.Sq] == 0)[:, None, :]
    return (~real.any(dim=1))[:, None, None].expand(bl.B, 1, bl.Sq)


def _merge(o1, l1, o2, l2):
    """Two partial results over disjoint keys, merged by log-sum-exp (``-inf``: the part sees no key)."""
    L = torch.logaddexp(l1, l2)
    finite = torch.isfinite(L)
    L0 = torch.where(finite, L, 0.0)
    w1 = torch.where(finite, torch.exp(l1 - L0), 0.0).unsqueeze(-1)
    w2 = torch.where(finite, torch.exp(l2 - L0), 0.0).unsqueeze(-1)
    return o1 * w1 + o2 * w2, L


def forward_whole(bl: Blocks, q, k, v, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, H_q, S_q, D_v)`` in ``q.dtype`` and row log-sum-exp ``(B, H_q, S_q)`` (``+inf`` on rows
    that see no key) by one kernel call (two after a cached prefix)."""
    fwd, _ = ops
    cd, B, Hq, Hkv, G, Sq, Sk = bl.cdtype, bl.B, bl.Hq, bl.Hkv, bl.G, bl.Sq, bl.Sk
    qc, kc, vc = q.to(cd), k.to(cd), v.to(cd)
    if not bl.causal:  # the G heads of a group fold into the query rows: no copy of K/V
        q_fold = qc.reshape(B, Hkv, G * Sq, bl.D)  # (B, Hkv, G*Sq, D)
        o, lse = fwd(q_fold, kc, vc, attn_mask=_pad_mask(bl, 0, Sk), scale=bl.scale)
        o, lse = o.reshape(B, Hq, Sq, bl.Dv), lse.reshape(B, Hq, Sq)
        empty = _empty_rows(bl, 0, Sk, causal=False)
    else:
        off = Sk - Sq
        ke, ve = kv_per_head(kc, G), kv_per_head(vc, G)  # (B, Hq, Sk, D): the kernel's causal mode is per head
        o, lse = fwd(qc, ke[:, :, off:], ve[:, :, off:], is_causal=True, attn_mask=_pad_mask(bl, off, Sk),
                     scale=bl.scale)  # fmt: skip
        empty = _empty_rows(bl, off, Sk, causal=True)
        if off > 0:  # the cached prefix: every query sees it
            lse = lse if empty is None else lse.masked_fill(empty, float("-inf"))
            o1, l1 = fwd(qc, ke[:, :, :off], ve[:, :, :off], attn_mask=_pad_mask(bl, 0, off), scale=bl.scale)
            e1 = _empty_rows(bl, 0, off, causal=False)
            l1 = l1 if e1 is None else l1.masked_fill(e1, float("-inf"))
            o, lse = _merge(o1, l1, o, lse)
            empty = ~torch.isfinite(lse)
    if empty is not None:  # the kernel reports L = 0 on a row that sees no key
        lse = lse.masked_fill(empty, float("inf"))
        o = o.masked_fill(empty.unsqueeze(-1), 0.0)
    return o.to(q.dtype), lse


def backward_whole(bl: Blocks, q, k, v, out, lse, dout, ops):
    """Gradients ``dq, dk, dv`` of :func:`forward_whole` by the fused backward kernel on the same calls."""
    _, bwd = ops
    cd, B, Hq, Hkv, G, Sq, Sk = bl.cdtype, bl.B, bl.Hq, bl.Hkv, bl.G, bl.Sq, bl.Sk
    qc, kc, vc, oc, doc = q.to(cd), k.to(cd), v.to(cd), out.to(cd), dout.to(cd)
    if not bl.causal:
        fold = lambda x: x.reshape(B, Hkv, G * Sq, x.shape[-1])  # noqa: E731
        dq, dk, dv = bwd(fold(doc), fold(qc), kc, vc, fold(oc), lse.reshape(B, Hkv, G * Sq), 0.0, False,
                         attn_mask=_pad_mask(bl, 0, Sk), scale=bl.scale)  # fmt: skip
        return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
    off = Sk - Sq
    ke, ve = kv_per_head(kc, G), kv_per_head(vc, G)
    dq, dk2, dv2 = bwd(doc, qc, ke[:, :, off:], ve[:, :, off:], oc, lse, 0.0, True, attn_mask=_pad_mask(bl, off, Sk),
                       scale=bl.scale)  # fmt: skip
    dks, dvs = [dk2], [dv2]
    if off > 0:
        dq1, dk1, dv1 = bwd(doc, qc, ke[:, :, :off], ve[:, :, :off], oc, lse, 0.0, False,
                            attn_mask=_pad_mask(bl, 0, off), scale=bl.scale)  # fmt: skip
        dq = dq + dq1
        dks, dvs = [dk1, dk2], [dv1, dv2]
    dk, dv = torch.cat(dks, dim=2), torch.cat(dvs, dim=2)  # (B, Hq, Sk, D)
    if G > 1:  # sum the repeated heads back onto their key/value head
        dk = dk.view(B, Hkv, G, Sk, bl.D).sum(dim=2)
        dv = dv.view(B, Hkv, G, Sk, bl.Dv).sum(dim=2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- blocks ------------------------------------------------------------------------------------------------------


def fused_block(bl: Blocks, fwd, q_rows, kc, vc, i0, i1, j0, j1):
    """One block by the fused forward kernel: output ``(B, H_kv, G·n, D_v)`` and its log-sum-exp
    ``(B, H_kv, G·n, 1)``, ``-inf`` on rows that see no key of the block."""
    n = i1 - i0
    k_b, v_b = kc[:, :, j0:j1], vc[:, :, j0:j1]
    if bl.aligned_diagonal(i0, i1, j0, j1):
        # is_causal is per head and top-left aligned: give the kernel (B, Hq, n, D) queries.
        o, lse = fwd(per_head(q_rows, bl.G, n), kv_per_head(k_b, bl.G), kv_per_head(v_b, bl.G),
                     is_causal=True, scale=bl.scale)  # fmt: skip
        return o.reshape(q_rows.shape[:3] + (bl.Dv,)), lse.reshape(q_rows.shape[:3] + (1,))
    mask = bl.additive_mask(i0, i1, j0, j1)
    o, lse = fwd(q_rows, k_b, v_b, attn_mask=mask, scale=bl.scale)
    lse = lse.unsqueeze(-1)
    if mask is not None:  # the kernel reports L = 0 for a row that sees no key of the block
        lse = lse.masked_fill(mask.amax(dim=-1, keepdim=True) == float("-inf"), float("-inf"))
    return o, lse


def forward_blocks(bl: Blocks, q, k, v, ops) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block by the fused kernel, blocks merged by their log-sum-exp: ``out = Σ_j exp(L_j - L) o_j`` with
    ``L = log Σ_j exp(L_j)``. Returns as :func:`forward_whole`."""
    fwd, _ = ops
    B, Hkv, G, cd = bl.B, bl.Hkv, bl.G, bl.cdtype
    out = torch.empty(B, bl.Hq, bl.Sq, bl.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, bl.Hq, bl.Sq, dtype=cd, device=q.device)
    out5 = out.view(B, Hkv, G, bl.Sq, bl.Dv)
    lse5 = lse.view(B, Hkv, G, bl.Sq)
    neg_inf = float("-inf")
    kc, vc = k.to(cd), v.to(cd)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1)  # (B, Hkv, G*n, D), unscaled: the kernel scales
        run_max = denom = acc = None
        for j0, j1 in bl.k_ranges(i0, i1):
            o_j, lse_j = fused_block(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1)  # (B,Hkv,G*n,Dv), (B,Hkv,G*n,1)
            if acc is None:  # first key block: nothing to merge with
                run_max, acc = lse_j, o_j
                denom = torch.ones_like(lse_j)
                continue
            new_max = torch.maximum(run_max, lse_j)
            shift = torch.where(new_max == neg_inf, 0.0, new_max)
            correction, weight = torch.exp(run_max - shift), torch.exp(lse_j - shift)
            denom.mul_(correction).add_(weight)
            acc.mul_(correction).add_(o_j.mul_(weight))
            run_max = new_max
        if acc is None:  # every key is hidden from this query block
            out5[:, :, :, i0:i1] = 0
            lse5[:, :, :, i0:i1] = float("inf")
            continue
        # Rows that saw no key carry run_max = -inf and acc = 0; first-block rows have denom 1 but maybe -inf.
        denom = torch.where(run_max == neg_inf, 0.0, denom)
        seen = denom > 0
        o = torch.where(seen, acc / torch.where(seen, denom, 1.0), 0.0)  # fully masked rows -> 0
        out5[:, :, :, i0:i1] = o.view(B, Hkv, G, n, bl.Dv).to(q.dtype)
        row_lse = torch.where(seen, run_max + torch.log(torch.where(seen, denom, 1.0)), float("inf"))
        lse5[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out, lse


def backward_blocks(bl: Blocks, q, k, v, out, lse, dout, ops):
    """Gradients ``dq, dk, dv`` (no bias gradient), each block by the fused backward kernel, given the global
    output and log-sum-exp of the rows (so each block yields exact partial gradients)."""
    _, bwd = ops
    B, Hkv, G, cd = bl.B, bl.Hkv, bl.G, bl.cdtype
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dq5 = dq.view(B, Hkv, G, bl.Sq, bl.D)
    kc, vc = k.to(cd), v.to(cd)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1)  # (B, Hkv, G*n, D)
        do_rows = bl.rows(dout, i0, i1)  # (B, Hkv, G*n, Dv)
        o_rows = bl.rows(out, i0, i1)
        lse_rows = lse[:, :, i0:i1].reshape(B, Hkv, G * n)  # +inf on rows that see no key: P = 0 there
        dq_rows = torch.zeros_like(q_rows)
        for j0, j1 in bl.k_ranges(i0, i1):
            k_b, v_b = kc[:, :, j0:j1], vc[:, :, j0:j1]
            if bl.aligned_diagonal(i0, i1, j0, j1):  # per-head layout for the kernel's own causal mask
                m = j1 - j0
                dq_j, dk_j, dv_j = bwd(
                    per_head(do_rows, G, n), per_head(q_rows, G, n), kv_per_head(k_b, G), kv_per_head(v_b, G),
                    per_head(o_rows, G, n), lse_rows.view(B, Hkv * G, n), 0.0, True, scale=bl.scale,
                )  # fmt: skip
                dq_j = dq_j.reshape(q_rows.shape)
                dk_j = dk_j.reshape(B, Hkv, G, m, bl.D).sum(dim=2)
                dv_j = dv_j.reshape(B, Hkv, G, m, bl.Dv).sum(dim=2)
            else:
                dq_j, dk_j, dv_j = bwd(
                    do_rows, q_rows, k_b, v_b, o_rows, lse_rows, 0.0, False,
                    attn_mask=bl.additive_mask(i0, i1, j0, j1), scale=bl.scale,
                )  # fmt: skip
            dq_rows += dq_j
            dk[:, :, j0:j1] += dk_j
            dv[:, :, j0:j1] += dv_j
        dq5[:, :, :, i0:i1] = dq_rows.view(B, Hkv, G, n, bl.D).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype)
