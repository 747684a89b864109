"""Memory-bounded exact attention in pure PyTorch: online softmax over query and key chunks.

The ``chunked`` backend of :func:`core.attention.attention`. It never materialises the ``(S_q, S_k)`` score
matrix: for each block of ``q_chunk_size`` queries it walks the keys ``k_chunk_size`` at a time, keeping the
running row maximum ``m``, the running denominator ``l`` and the unnormalised output (FlashAttention's
online softmax). Peak extra memory is one score block, ``B · H_q · q_chunk · k_chunk`` floats, plus
``O(S · D)`` for inputs, outputs and gradients, so any sequence length runs on a CPU.

Autograd recomputes the scores chunk by chunk (FlashAttention-2 backward): the forward saves only
``q, k, v, out`` and the row log-sum-exp ``L``; the backward rebuilds ``P = exp(S - L)`` block by block and
uses ``dS = P ∘ (dP - rowsum(dO ∘ O))``, so training memory is bounded the same way.

Layout and mask semantics are those of :mod:`core.attention`. Grouped-query heads are handled without
repeating keys/values: the ``G = H_q / H_kv`` query heads sharing a key/value head are stacked along the
row axis of one matmul. Key chunks that causality hides from every query of a block are skipped.
Computation runs in ``float32`` (or ``float64`` for double inputs); the output is cast back to ``q``'s dtype.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

__all__ = ["chunked_attention", "DEFAULT_Q_CHUNK", "DEFAULT_K_CHUNK", "MAX_BLOCK_ELEMENTS"]

#: Default number of keys per chunk.
DEFAULT_K_CHUNK = 1024
#: Default (largest) number of queries per chunk; lowered for large ``B · H_q`` (see ``MAX_BLOCK_ELEMENTS``).
DEFAULT_Q_CHUNK = 1024
#: With the default query chunk, one score block holds at most this many elements (64 MiB in fp32).
MAX_BLOCK_ELEMENTS = 1 << 24


def default_q_chunk(batch_heads: int, k_chunk: int) -> int:
    """Query rows per chunk so that one ``(B·H_q, q_chunk, k_chunk)`` block fits ``MAX_BLOCK_ELEMENTS``."""
    return int(max(16, min(DEFAULT_Q_CHUNK, MAX_BLOCK_ELEMENTS // max(1, batch_heads * k_chunk))))


def _bias_4d(bias: torch.Tensor) -> torch.Tensor:
    """View a bias broadcastable to ``(B, H, S_q, S_k)`` as a 4-d tensor (leading size-1 dims added)."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    return bias


class _Blocks:
    """Shared geometry of forward and backward: chunk ranges, masks and bias slices.

    Score blocks have shape ``(B, H_kv, G · n_q, n_k)``; row ``g · n_q + r`` is query ``i0 + r`` of query
    head ``h_kv · G + g``. ``block5`` views them as ``(B, H_kv, G, n_q, n_k)`` for masks and bias.
    """

    def __init__(self, q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk):
        self.B, self.Hq, self.Sq, self.D = q.shape
        self.Hkv, self.Sk, self.Dv = k.shape[1], k.shape[2], v.shape[3]
        self.G = self.Hq // self.Hkv
        self.offset = self.Sk - self.Sq  # causal: query i sees key j iff j <= i + offset
        self.kpm = key_padding_mask
        self.bias4 = bias4
        self.scale = scale
        self.causal = causal
        self.qc = q_chunk
        self.kc = k_chunk
        self.cdtype = torch.promote_types(q.dtype, torch.float32)

    def q_ranges(self):
        for i0 in range(0, self.Sq, self.qc):
            yield i0, min(i0 + self.qc, self.Sq)

    def k_ranges(self, i0: int, i1: int):
        """Key chunks a query block ``[i0, i1)`` can see; chunks past the causal frontier are skipped."""
        end = self.Sk
        if self.causal:
            end = max(0, min(self.Sk, i1 + self.offset))  # last visible key of the last row is i1-1+offset
        for j0 in range(0, end, self.kc):
            yield j0, min(j0 + self.kc, end)

    def rows(self, x: torch.Tensor, i0: int, i1: int, scale: float | None = None) -> torch.Tensor:
        """``(B, H_q, S, E)`` slice ``[i0, i1)`` as ``(B, H_kv, G·n, E)`` in the compute dtype."""
        n = i1 - i0
        x = x[:, :, i0:i1]
        if scale is not None:
            x = x * scale
        return x.to(self.cdtype).reshape(self.B, self.Hkv, self.G * n, x.shape[-1])  # (B, Hkv, G*n, E)

    def scores(self, q_rows: torch.Tensor, k_cols: torch.Tensor, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """Scaled, biased, masked scores ``(B, H_kv, G·n_q, n_k)`` for queries ``[i0,i1)``, keys ``[j0,j1)``."""
        n, m = i1 - i0, j1 - j0
        s = torch.matmul(q_rows, k_cols.transpose(-1, -2))  # (B, Hkv, G*n, m); q_rows is pre-scaled
        s5 = s.view(self.B, self.Hkv, self.G, n, m)
        if self.bias4 is not None:
            s5.add_(self.bias_block(i0, i1, j0, j1))
        if self.causal and j1 - 1 > i0 + self.offset:  # some key of the chunk is after some query's frontier
            qi = torch.arange(i0 + self.offset, i1 + self.offset, device=s.device)[:, None]
            kj = torch.arange(j0, j1, device=s.device)[None, :]
            s5.masked_fill_(kj > qi, float("-inf"))
        if self.kpm is not None:
            s5.masked_fill_(self.kpm[:, j0:j1].view(self.B, 1, 1, 1, m), float("-inf"))
        return s

    def bias_block(self, i0: int, i1: int, j0: int, j1: int) -> torch.Tensor:
        """The bias slice for the block, 5-d ``(B|1, H_kv|1, G|1, n_q|1, n_k|1)``, never expanded."""
        b = self.bias4
        if b.shape[2] != 1:
            b = b[:, :, i0:i1]
        if b.shape[3] != 1:
            b = b[:, :, :, j0:j1]
        b = b.to(self.cdtype)
        if b.shape[1] == 1:
            return b.unsqueeze(1)  # (B|1, 1, 1, n|1, m|1)
        return b.unflatten(1, (self.Hkv, self.G))  # (B|1, Hkv, G, n|1, m|1)


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
            s = bl.scores(q_rows, k[:, :, j0:j1].to(bl.cdtype), i0, i1, j0, j1)  # (B, Hkv, G*n, m)
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
            p = bl.scores(q_rows, k_cols, i0, i1, j0, j1).sub_(lse_rows).exp_()  # (B, Hkv, G*n, m)
            dv[:, :, j0:j1] += torch.matmul(p.transpose(-1, -2), do_rows)  # sums over the G heads
            dp = torch.matmul(do_rows, v_cols.transpose(-1, -2))  # (B, Hkv, G*n, m)
            ds = dp.sub_(delta).mul_(p)  # dS = P ∘ (dP − Δ)
            del p
            if dbias4 is not None:
                _accumulate_bias_grad(bl, dbias4, ds.view(B, Hkv, G, n, m), i0, i1, j0, j1)
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


class _ChunkedAttentionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, key_padding_mask, causal, scale, q_chunk, k_chunk):
        bias4 = _bias_4d(attn_bias) if attn_bias is not None else None
        blocks = _Blocks(q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk)
        out, lse = _forward(blocks, q, k, v)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, key_padding_mask)
        ctx.options = (causal, scale, q_chunk, k_chunk)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, attn_bias, key_padding_mask = ctx.saved_tensors
        causal, scale, q_chunk, k_chunk = ctx.options
        bias4 = _bias_4d(attn_bias) if attn_bias is not None else None
        blocks = _Blocks(q, k, v, key_padding_mask, bias4, scale, causal, q_chunk, k_chunk)
        need_dbias = attn_bias is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dbias4 = _backward(blocks, q, k, v, out, lse, dout.contiguous(), need_dbias)
        dbias = dbias4.reshape(attn_bias.shape).to(attn_bias.dtype) if dbias4 is not None else None
        return dq, dk, dv, dbias, None, None, None, None, None


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
) -> torch.Tensor:
    """Exact attention on already validated inputs (see :func:`core.attention.prepare_inputs`).

    Args:
        q: ``(B, H_q, S_q, D)``; k: ``(B, H_kv, S_k, D)``; v: ``(B, H_kv, S_k, D_v)``.
        causal: bottom-right aligned causal mask.
        key_padding_mask: bool ``(B, S_k)``, True = padded key, or None.
        attn_bias: additive bias broadcastable to ``(B, H_q, S_q, S_k)``, sliced per block (never expanded);
            receives a gradient when it requires one.
        scale: score scale.
        q_chunk_size: queries per chunk; default ``default_q_chunk(B·H_q, k_chunk_size)`` (≤ 1024).
        k_chunk_size: keys per chunk; default 1024.

    Returns:
        ``(B, H_q, S_q, D_v)`` in ``q.dtype``; rows that see no key are zeros.
    """
    k_chunk = DEFAULT_K_CHUNK if k_chunk_size is None else int(k_chunk_size)
    q_chunk = default_q_chunk(q.shape[0] * q.shape[1], k_chunk) if q_chunk_size is None else int(q_chunk_size)
    if q_chunk < 1 or k_chunk < 1:
        raise ValueError(f"chunk sizes must be positive, got q_chunk_size={q_chunk}, k_chunk_size={k_chunk}")
    return _ChunkedAttentionFn.apply(q, k, v, attn_bias, key_padding_mask, causal, float(scale), q_chunk, k_chunk)
