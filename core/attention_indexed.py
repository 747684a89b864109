"""Attention over selected keys: each query attends only to the keys (or key blocks) an index lists for it.

The per-query sparse attention of DeepSeek-V3.2-style "lightning indexers" (``indices``: top-k key indices per
query) and MiniMax-M3's block selection (``block_indices``: top-k key *blocks* per query and key/value head), served
exactly and in memory ``O(S_q · K · D)`` (``K`` selected keys per query), never ``O(S_q · S_k)``: for a chunk of
queries the selected keys and values are gathered, scored and combined; the selection meets the usual masks of
:mod:`core.attention` (causal bottom-right aligned, window, key padding, segment ids) and optional attention sinks.

Layout ``(B, H, S, D)``; the index is ``(B, H_i, S_q, K)`` with ``H_i`` 1 (shared by every head) or ``H_kv`` (one
selection per key/value head, shared by its query heads); entries ``< 0`` are unused slots; a key listed twice counts once.
Gradients flow through the gathers (plain autograd: the saved chunks take ``O(S_q · K)``).
"""

from __future__ import annotations

import math

import torch

__all__ = ["indexed_attention", "blocks_to_keys"]


def blocks_to_keys(block_indices: torch.Tensor, block_size: int, kv_length: int) -> torch.Tensor:
    """Key-block ids ``(..., K)`` (``-1`` unused) -> key indices ``(..., K · block_size)`` (``-1`` unused or past
    ``kv_length``)."""
    if block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size}")
    keys = block_indices.long().unsqueeze(-1) * block_size + torch.arange(block_size, device=block_indices.device)
    keys = keys.flatten(-2)
    bad = (block_indices.long() < 0).repeat_interleave(block_size, dim=-1) | (keys >= kv_length)
    return keys.masked_fill(bad, -1)


def _dedupe(idx: torch.Tensor) -> torch.Tensor:
    """Sorted indices with repeats (and negatives) as ``-1``."""
    idx = idx.sort(dim=-1).values
    repeat = torch.zeros_like(idx, dtype=torch.bool)
    repeat[..., 1:] = idx[..., 1:] == idx[..., :-1]
    return idx.masked_fill(repeat | (idx < 0), -1)


def indexed_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    key_padding_mask: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    q_chunk_size: int = 256,
) -> torch.Tensor:
    """Exact softmax attention of each query over the keys its index row lists (module docs).

    Args:
        q: ``(B, H_q, S_q, D)``; k: ``(B, H_kv, S_k, D)``; v: ``(B, H_kv, S_k, D_v)``.
        indices: int ``(B, H_i, S_q, K)`` key indices (``H_i`` 1 or ``H_kv``), ``-1`` = unused.
        causal, window, key_padding_mask: as in :func:`core.attention.attention` (query ``i`` at key position
            ``i + S_k - S_q``).
        q_segment_ids, segment_ids: int ``(B, S_q)`` / ``(B, S_k)``: a query sees keys of its own segment only.
        sinks: sink logits broadcastable to ``(B, H_q, S_q)`` (3-d), or None.
        softcap: scores become ``softcap · tanh(scores / softcap)``.
        scale: score scale, default ``1/sqrt(D)``.
        q_chunk_size: queries per chunk (memory ``B · H_q · q_chunk · K``).

    Returns:
        ``(B, H_q, S_q, D_v)`` in ``q.dtype``; rows that see no key are zeros (or only the sink: zeros too).
    """
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    G = Hq // Hkv
    if indices.dim() != 4 or indices.shape[0] != B or indices.shape[2] != Sq or indices.shape[1] not in (1, Hkv):
        raise ValueError(
            f"indices must be (B, H_i, S_q, K) with H_i in (1, {Hkv}), B = {B}, S_q = {Sq}; got "
            f"{tuple(indices.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"indices must be an integer tensor, got {indices.dtype}")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cd = torch.promote_types(q.dtype, torch.float32)
    idx_all = indices.long().to(q.device)
    idx_all = _dedupe(idx_all.masked_fill(idx_all >= Sk, -1))
    k_flat = k.to(cd).reshape(B * Hkv * Sk, D)
    v_flat = v.to(cd).reshape(B * Hkv * Sk, Dv)
    base = (torch.arange(B, device=q.device)[:, None] * Hkv + torch.arange(Hkv, device=q.device)) * Sk  # (B, Hkv)
    outs = []
    for i0 in range(0, Sq, q_chunk_size):
        i1 = min(i0 + q_chunk_size, Sq)
        n = i1 - i0
        idx = idx_all[:, :, i0:i1]  # (B, Hi, n, K)
        kv_idx = idx.expand(B, Hkv, n, idx.shape[-1])  # per key/value head gathers
        valid = kv_idx >= 0  # (B, Hkv, n, K)
        flat = kv_idx.clamp(min=0) + base[:, :, None, None]
        k_sel, v_sel = k_flat[flat], v_flat[flat]  # (B, Hkv, n, K, D), (B, Hkv, n, K, Dv)
        q_rows = q[:, :, i0:i1].to(cd).reshape(B, Hkv, G, n, D)
        s = torch.einsum("bhgnd,bhnkd->bhgnk", q_rows, k_sel) * scale  # (B, Hkv, G, n, K)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        keep = _keep(valid, kv_idx, i0, i1, Sq, Sk, causal, window, key_padding_mask, q_segment_ids, segment_ids)
        s = s.masked_fill(~keep.unsqueeze(2), float("-inf"))  # keep: (B, Hkv, n, K), shared by the group
        if sinks is not None:
            sink = sinks.to(cd).expand(B, Hq, Sq)[:, :, i0:i1].reshape(B, Hkv, G, n, 1)
            s = torch.cat([s, sink], dim=-1)
        row_max = s.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        p = torch.exp(s - row_max)
        denom = p.sum(dim=-1, keepdim=True)
        p = p / torch.where(denom > 0, denom, 1.0)
        if sinks is not None:
            p = p[..., :-1]
        outs.append(torch.einsum("bhgnk,bhnkv->bhgnv", p, v_sel).reshape(B, Hq, n, Dv))
    return torch.cat(outs, dim=2).to(q.dtype) if outs else q.new_zeros(B, Hq, 0, Dv)


def _keep(valid, kv_idx, i0, i1, Sq, Sk, causal, window, key_padding_mask, q_seg, k_seg):
    """Bool ``(B, H_kv, n, K)``: which gathered keys each query of ``[i0, i1)`` may see."""
    B, Hkv, n, K = kv_idx.shape
    keep = valid
    pos = torch.arange(i0, i1, device=kv_idx.device).view(1, 1, n, 1) + (Sk - Sq)
    if causal:
        keep = keep & (kv_idx <= pos)
    if window is not None:
        keep = keep & (kv_idx > pos - window)
        if not causal:
            keep = keep & (kv_idx < pos + window)
    safe = kv_idx.clamp(min=0).reshape(B, Hkv * n * K)
    if key_padding_mask is not None:
        keep = keep & ~key_padding_mask.to(kv_idx.device).gather(1, safe).view(B, Hkv, n, K)
    if q_seg is not None:
        ks = k_seg.to(kv_idx.device).gather(1, safe).view(B, Hkv, n, K)
        keep = keep & (ks == q_seg.to(kv_idx.device)[:, None, i0:i1, None])
    return keep

