"""Memory-bounded exact attention in pure PyTorch: online softmax over query and key chunks.

The ``chunked`` backend of :func:`core.attention.attention`. It never materialises the ``(S_q, S_k)`` score
matrix: for each block of ``q_chunk_size`` queries it walks the keys ``k_chunk_size`` at a time, keeping the
running row maximum ``m``, the running denominator ``l`` and the unnormalised output (FlashAttention's
online softmax). Peak extra memory is one score block, ``B · H_q · q_chunk · k_chunk`` floats, plus
``O(S · D)`` for inputs, outputs and gradients, so any sequence length runs on a CPU.

Autograd recomputes the scores chunk by chunk (FlashAttention-2 backward): the forward saves only
``q, k, v, out`` and the row log-sum-exp ``L``; the backward rebuilds ``P = exp(S - L)`` block by block and
uses ``dS = P ∘ (dP - rowsum(dO ∘ O))``, so training memory is bounded the same way.

Layout and mask semantics are those of :mod:`core.attention`; the block geometry (which key chunks a query chunk
sees, the masks of a block) is :class:`core.attention_blocks.Blocks`. Grouped-query heads are handled without
repeating keys/values: the ``G = H_q / H_kv`` query heads sharing a key/value head are stacked along the row axis
of one matmul. Key chunks that causality, the window or the segment ids hide from every query of a block are
skipped. Computation runs in ``float32`` (or ``float64`` for double inputs); the output is cast back to ``q``'s
dtype.

Attention sinks (GPT-OSS): one extra logit ``s`` per row in the softmax denominator whose value is zero. With the
row's log-sum-exp over the keys ``L_k``, the output is scaled by ``exp(L_k - L)``, ``L = log(e^{L_k} + e^s)``, and
``L`` is saved: the backward above is then exact unchanged (the sink's value is zero), and the sink's gradient is
``-Σ_rows exp(s - L) · rowsum(dO ∘ O)``.

Two block engines, same chunking and results:
    fused (CPU tensors with ``D_v = D``, the default there): PyTorch's fused CPU attention kernel on whole inputs
        or on blocks (:mod:`core.attention_fused`).
    plain (every other case, and the bias gradient): scores ``q kᵀ`` per block, running max and denominator,
        ``exp`` in place, FlashAttention-2 backward as above.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from core.attention_blocks import Blocks as _Blocks
from core.attention_blocks import bias_4d as _bias_4d
from core.attention_fused import (
    backward_blocks,
    backward_whole,
    forward_blocks,
    forward_whole,
    fused_block_ops,
    whole_call_fits,
)

__all__ = [
    "chunked_attention",
    "default_chunks",
    "default_q_chunk",
    "fused_block_ops",
    "DEFAULT_Q_CHUNK",
    "DEFAULT_K_CHUNK",
    "MAX_BLOCK_ELEMENTS",
]

#: Default number of keys per chunk.
DEFAULT_K_CHUNK = 1024
#: Default (largest) number of queries per chunk; lowered for large ``B · H_q`` (see ``MAX_BLOCK_ELEMENTS``).
DEFAULT_Q_CHUNK = 1024
#: With the default query chunk, one score block holds at most this many elements (64 MiB in fp32).
MAX_BLOCK_ELEMENTS = 1 << 24


def default_chunks(batch_heads: int) -> int:
    """Square chunk size (power of two, 64..1024) whose ``(B·H_q, c, c)`` score block fits ``MAX_BLOCK_ELEMENTS``;
    equal query and key chunks keep causal diagonal blocks aligned."""
    c = DEFAULT_K_CHUNK
    while c > 64 and batch_heads * c * c > MAX_BLOCK_ELEMENTS:
        c //= 2
    return c


def default_q_chunk(batch_heads: int, k_chunk: int) -> int:
    """Query rows per chunk so that one ``(B·H_q, q_chunk, k_chunk)`` block fits ``MAX_BLOCK_ELEMENTS``."""
    return int(max(16, min(DEFAULT_Q_CHUNK, MAX_BLOCK_ELEMENTS // max(1, batch_heads * k_chunk))))


def _forward(blocks: _Blocks, q, k, v) -> tuple[torch.Tensor, torch.Tensor]:
    """Output ``(B, H_q, S_q, D_v)`` in ``q.dtype`` and row log-sum-exp ``(B, H_q, S_q)`` (``+inf`` where a
    row sees no key, so that ``exp(s - L) = 0`` there in the backward)."""
    bl = blocks
    B, Hkv, G = bl.B, bl.Hkv, bl.G
    out = torch.empty(B, bl.Hq, bl.Sq, bl.Dv, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, bl.Hq, bl.Sq, dtype=bl.cdtype, device=q.device)
    out5 = out.view(B, Hkv, G, bl.Sq, bl.Dv)
    lse5 = lse.view(B, Hkv, G, bl.Sq)
    neg_inf = float("-inf")
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1, bl.scale)  # (B, Hkv, G*n, D)
        row_max = torch.full((B, Hkv, G * n, 1), neg_inf, dtype=bl.cdtype, device=q.device)
        denom = torch.zeros((B, Hkv, G * n, 1), dtype=bl.cdtype, device=q.device)
        acc = torch.zeros((B, Hkv, G * n, bl.Dv), dtype=bl.cdtype, device=q.device)
        for j0, j1 in bl.k_ranges(i0, i1):
            s = bl.scores(q_rows, i0, i1, j0, j1)  # (B, Hkv, G*n, m)
            new_max = torch.maximum(row_max, s.amax(dim=-1, keepdim=True))
            # A row with no visible key so far keeps max -inf; shift by 0 there so exp() gives 0, not NaN.
            shift = torch.where(new_max == neg_inf, 0.0, new_max)
            p = s.sub_(shift).exp_()  # in place: s is not needed any more
            correction = torch.exp(row_max - shift)  # (B, Hkv, G*n, 1)
            denom.mul_(correction).add_(p.sum(dim=-1, keepdim=True))
            acc.mul_(correction)
            acc.view(B * Hkv, G * n, bl.Dv).baddbmm_(
                p.view(B * Hkv, G * n, j1 - j0), v[:, :, j0:j1].to(bl.cdtype).reshape(B * Hkv, j1 - j0, bl.Dv)
            )
            row_max = new_max
        seen = denom > 0
        o = torch.where(seen, acc / torch.where(seen, denom, 1.0), 0.0)  # fully masked rows -> 0
        out5[:, :, :, i0:i1] = o.view(B, Hkv, G, n, bl.Dv).to(q.dtype)
        row_lse = torch.where(seen, row_max + torch.log(torch.where(seen, denom, 1.0)), float("inf"))
        lse5[:, :, :, i0:i1] = row_lse.view(B, Hkv, G, n)
    return out, lse


def _backward(blocks: _Blocks, q, k, v, out, lse, dout, need_dbias: bool):
    """Gradients ``dq, dk, dv`` (and ``d bias`` in the bias's broadcast shape) by block recomputation."""
    bl = blocks
    B, Hkv, G = bl.B, bl.Hkv, bl.G
    cd = bl.cdtype
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=cd, device=q.device)
    dv = torch.zeros(v.shape, dtype=cd, device=q.device)
    dbias4 = torch.zeros(bl.bias4.shape, dtype=cd, device=q.device) if need_dbias else None
    dq5 = dq.view(B, Hkv, G, bl.Sq, bl.D)
    for i0, i1 in bl.q_ranges():
        n = i1 - i0
        q_rows = bl.rows(q, i0, i1, bl.scale)  # (B, Hkv, G*n, D), scaled
        do_rows = bl.rows(dout, i0, i1)  # (B, Hkv, G*n, Dv)
        o_rows = bl.rows(out, i0, i1)
        delta = (do_rows * o_rows).sum(dim=-1, keepdim=True)  # rowsum(dO ∘ O): (B, Hkv, G*n, 1)
        lse_rows = lse[:, :, i0:i1].reshape(B, Hkv, G * n, 1)
        dq_rows = torch.zeros_like(q_rows)
        for j0, j1 in bl.k_ranges(i0, i1):
            m = j1 - j0
            k_cols = k[:, :, j0:j1].to(cd)  # (B, Hkv, m, D)
            v_cols = v[:, :, j0:j1].to(cd)  # (B, Hkv, m, Dv)
            s, dtanh = bl.scores(q_rows, i0, i1, j0, j1, want_dtanh=True)
            p = s.sub_(lse_rows).exp_()  # (B, Hkv, G*n, m)
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), do_rows)  # sums over the G heads
            dp = torch.matmul(do_rows, v_cols.transpose(-1, -2))  # (B, Hkv, G*n, m)
            ds = dp.sub_(delta).mul_(p)  # dS = P ∘ (dP − Δ)
            del p
            if dbias4 is not None:
                _accumulate_bias_grad(bl, dbias4, ds.view(B, Hkv, G, n, m), i0, i1, j0, j1)
            if dtanh is not None:  # through the soft cap: d(c·tanh(x/c))/dx = 1 - tanh²
                ds.mul_(dtanh)
            dq_rows += torch.matmul(ds, k_cols)
            dk[:, :, j0:j1] += torch.matmul(ds.transpose(-1, -2), q_rows)  # q_rows carries the scale
        dq5[:, :, :, i0:i1] = (dq_rows * bl.scale).view(B, Hkv, G, n, bl.D).to(q.dtype)
    return dq, dk.to(k.dtype), dv.to(v.dtype), dbias4


def _accumulate_bias_grad(bl: _Blocks, dbias4: torch.Tensor, ds5: torch.Tensor, i0, i1, j0, j1) -> None:
    """Add a block's ``dS`` (``(B, H_kv, G, n, m)``) into the bias gradient, summed over broadcast dims."""
    bB, bH, bQ, bK = dbias4.shape
    g = ds5.flatten(1, 2)  # (B, Hq, n, m)
    dims = [d for d, size in enumerate((bB, bH, bQ, bK)) if size == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    rows = slice(i0, i1) if bQ != 1 else slice(0, 1)
    cols = slice(j0, j1) if bK != 1 else slice(0, 1)
    dbias4[:, :, rows, cols] += g


def _apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold sink logits ``(B|1, H_q|1, S_q|1)`` into an output and its row log-sum-exp (``+inf``: no key seen):
    the output scaled by ``exp(L_k - L)``, and ``L = log(e^{L_k} + e^s)``."""
    lk = lse.masked_fill(lse == float("inf"), float("-inf"))  # log of the keys' total weight (-inf: none)
    L = torch.logaddexp(lk, sinks.to(lse.dtype))
    weight = torch.exp(lk - L).unsqueeze(-1)  # (B, H_q, S_q, 1), 0 on rows that see no key
    return (out.to(lse.dtype) * weight).to(out.dtype), L


def _sink_grad(sinks: torch.Tensor, out, lse, dout) -> torch.Tensor:
    """``d sinks = -Σ exp(s - L) · rowsum(dO ∘ O)``, summed over the dims ``sinks`` broadcasts along."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(dim=-1)  # (B, H_q, S_q)
    g = -torch.exp(sinks.to(lse.dtype) - lse) * delta
    dims = [d for d in range(3) if sinks.shape[d] == 1 and g.shape[d] != 1]
    if dims:
        g = g.sum(dim=dims, keepdim=True)
    return g.to(sinks.dtype)


class _ChunkedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, key_padding_mask, sinks, q_seg, k_seg, q_grp, k_grp, options):
        blocks = _blocks(q, k, v, attn_bias, key_padding_mask, (q_seg, k_seg, q_grp, k_grp), options)
        ops = _ops_for(q, v, options["fused"], options["softcap"])
        if ops is None:
            out, lse = _forward(blocks, q, k, v)
        elif options["whole"] and whole_call_fits(blocks):
            out, lse = forward_whole(blocks, q, k, v, ops)
        else:
            out, lse = forward_blocks(blocks, q, k, v, ops)
        if sinks is not None:
            out, lse = _apply_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, key_padding_mask, sinks, q_seg, k_seg, q_grp, k_grp)
        ctx.options = options
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, attn_bias, key_padding_mask, sinks, q_seg, k_seg, q_grp, k_grp = ctx.saved_tensors
        options = ctx.options
        blocks = _blocks(q, k, v, attn_bias, key_padding_mask, (q_seg, k_seg, q_grp, k_grp), options)
        need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        ops = None if need_dbias else _ops_for(q, v, options["fused"], options["softcap"])  # no bias gradient there
        dbias = dsinks = None
        dout = dout.contiguous()
        if ops is None:
            dq, dk, dv, dbias4 = _backward(blocks, q, k, v, out, lse, dout, need_dbias)
            dbias = dbias4.reshape(attn_bias.shape).to(attn_bias.dtype) if dbias4 is not None else None
        elif options["whole"] and whole_call_fits(blocks):
            dq, dk, dv = backward_whole(blocks, q, k, v, out, lse, dout, ops)
        else:
            dq, dk, dv = backward_blocks(blocks, q, k, v, out, lse, dout, ops)
        if sinks is not None and ctx.needs_input_grad[5]:
            dsinks = _sink_grad(sinks, out, lse, dout)
        return dq, dk, dv, dbias, None, dsinks, None, None, None, None, None


def _blocks(q, k, v, attn_bias, key_padding_mask, ids, o) -> _Blocks:
    bias4 = _bias_4d(attn_bias) if attn_bias is not None else None
    return _Blocks(q, k, v, key_padding_mask, bias4, o["scale"], o["causal"], o["q_chunk"], o["k_chunk"], o["window"],
                   o["softcap"], *ids)  # fmt: skip


def _ops_for(q: torch.Tensor, v: torch.Tensor, fused: bool | None, softcap: float | None = None):
    """The fused CPU ops when allowed (``fused`` not False) and applicable (CPU tensors, value head dim equal
    to the query head dim, no soft cap: the kernel cannot apply one), else None."""
    if fused is False or q.device.type != "cpu" or v.shape[-1] != q.shape[-1]:
        return None
    if softcap is not None:
        if fused:
            raise ValueError("fused=True cannot apply a softcap (PyTorch's fused kernel has none); use fused=None")
        return None
    ops = fused_block_ops()
    if ops is None and fused:
        raise ValueError("fused=True needs PyTorch's fused CPU attention ops, which this PyTorch build lacks")
    return ops


def chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    scale: float,
    q_chunk_size: int | None = None,
    k_chunk_size: int | None = None,
    fused: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    q_group_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exact attention on already validated inputs (see :func:`core.attention.prepare_inputs`).

    Args:
        q: ``(B, H_q, S_q, D)``; k: ``(B, H_kv, S_k, D)``; v: ``(B, H_kv, S_k, D_v)``.
        causal: bottom-right aligned causal mask.
        key_padding_mask: bool ``(B, S_k)``, True = padded key, or None.
        attn_bias: additive bias broadcastable to ``(B, H_q, S_q, S_k)``, sliced per block (never expanded);
            receives a gradient when it requires one.
        scale: score scale.
        q_chunk_size: queries per chunk. Both sizes unset: ``default_chunks(B·H_q)`` for both (1024 unless
            ``B·H_q`` is large), and on CPU causal/padding-only inputs run as one fused kernel call
            (:mod:`core.attention_fused`); only ``k_chunk_size`` set: ``default_q_chunk(B·H_q, k_chunk_size)``.
        k_chunk_size: keys per chunk; 1024 when only ``q_chunk_size`` is set.
        fused: on CPU, compute with PyTorch's fused attention kernel (None: when available; False: plain PyTorch
            block math, the path used on other devices). The bias gradient always uses the plain block math.
        window: each query sees only keys within distance ``< window`` of its position (with ``causal``: its
            ``window`` latest keys, itself included); key chunks wholly outside every query's window are skipped.
        softcap: scores become ``softcap · tanh(scores / softcap)`` before bias and masks (Gemma 2); uses the
            plain block math.
        sinks: sink logits broadcastable to ``(B, H_q, S_q)`` (3-d), or None; receives a gradient.
        q_segment_ids: int ``(B, S_q)`` segment of each query, or None.
        segment_ids: int ``(B, S_k)`` segment of each key (with ``q_segment_ids``): a query sees keys of its
            own segment only.
        q_group_ids: int ``(B, S_q)`` group of each query (-1: none), or None.
        group_ids: int ``(B, S_k)`` group of each key (with ``q_group_ids`` and ``causal``): a query also sees the
            later keys of its own group.

    Returns:
        ``(B, H_q, S_q, D_v)`` in ``q.dtype``; rows that see no key are zeros.
    """
    batch_heads = q.shape[0] * q.shape[1]
    whole = q_chunk_size is None and k_chunk_size is None
    if whole:
        q_chunk = k_chunk = default_chunks(batch_heads)
    else:
        k_chunk = DEFAULT_K_CHUNK if k_chunk_size is None else int(k_chunk_size)
        q_chunk = default_q_chunk(batch_heads, k_chunk) if q_chunk_size is None else int(q_chunk_size)
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunk sizes must be positive, got q_chunk_size={q_chunk}, k_chunk_size={k_chunk}")
    if (q_segment_ids is None) != (segment_ids is None) or (q_group_ids is None) != (group_ids is None):
        raise ValueError("q_segment_ids and segment_ids (q_group_ids and group_ids) go together (both or neither)")
    if not causal:
        q_group_ids = group_ids = None
    options = dict(causal=causal, scale=float(scale), q_chunk=q_chunk, k_chunk=k_chunk, fused=fused, window=window,
                   softcap=softcap, whole=whole)  # fmt: skip
    return _ChunkedAttentionFn.apply(q, k, v, attn_bias, key_padding_mask, sinks, q_segment_ids, segment_ids,
                                     q_group_ids, group_ids, options)  # fmt: skip
