"""Block selection for :mod:`core.blocksparse`: key-block summaries (per-dimension min, max, mean over the
non-padded keys), the Quest upper bound of ``q·k`` per block and per query block, and top-k selection with the
always-kept first and diagonal blocks. The block format and mask semantics are those of :mod:`core.blocksparse`.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

__all__ = ["block_summaries", "block_upper_bound", "query_block_upper_bound", "select_blocks"]


def _check_block_size(block_size: int) -> int:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return block_size


def _check_4d(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have layout (B, H, S, D), got shape {tuple(t.shape)}")


def _check_padding(key_padding_mask: torch.Tensor | None, B: int, Sk: int, device) -> torch.Tensor | None:
    if key_padding_mask is None:
        return None
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
        raise ValueError(f"key_padding_mask must be a bool tensor (True = padded), got {got}")
    if tuple(key_padding_mask.shape) != (B, Sk):
        raise ValueError(f"key_padding_mask must have shape (B, S_k) = ({B}, {Sk}), got {tuple(key_padding_mask.shape)}")
    return key_padding_mask.to(device)


def _pad_to_blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """(B, H, S, D) -> (B, H, N, block_size, D), zero-padding the short last block."""
    B, H, S, D = x.shape
    n = math.ceil(S / block_size)
    if n * block_size != S:
        x = torch.nn.functional.pad(x, (0, 0, 0, n * block_size - S))
    return x.view(B, H, n, block_size, D)  # (B, H, N, bs, D)


# --------------------------------------------------------------------------------------------- summaries


def block_summaries(
    k: torch.Tensor, block_size: int, *, key_padding_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-block, per-dimension min, max and mean of the keys.

    Args:
        k: keys ``(B, H, S_k, D)``.
        block_size: rows per key block; the last block may be short (its missing rows are ignored).
        key_padding_mask: optional bool ``(B, S_k)``, ``True`` = padded key, excluded from the summaries.

    Returns:
        ``(kmin, kmax, kmean)``, each ``(B, H, NK, D)`` in fp32. A block with no valid key has
        ``kmin = +inf``, ``kmax = -inf`` and ``kmean = 0``, so its upper bound is ``-inf``.
    """
    _check_4d("k", k)
    _check_block_size(block_size)
    B, H, Sk, D = k.shape
    kpm = _check_padding(key_padding_mask, B, Sk, k.device)
    nk = math.ceil(Sk / block_size)
    kb = _pad_to_blocks(k.detach().float(), block_size)  # (B, H, NK, bs, D)
    if kpm is None and nk * block_size == Sk:  # every row of every block is a valid key
        return kb.amin(dim=3), kb.amax(dim=3), kb.mean(dim=3)
    valid_BS = torch.ones(B, Sk, dtype=torch.bool, device=k.device) if kpm is None else ~kpm
    valid_BS = torch.nn.functional.pad(valid_BS, (0, nk * block_size - Sk), value=False)
    valid = valid_BS.view(B, 1, nk, block_size, 1)  # (B, 1, NK, bs, 1)
    inf = torch.tensor(float("inf"), device=k.device)
    kmin = torch.where(valid, kb, inf).amin(dim=3)
    kmax = torch.where(valid, kb, -inf).amax(dim=3)
    count = valid.sum(dim=3).clamp(min=1)  # (B, 1, NK, 1)
    kmean = torch.where(valid, kb, 0.0).sum(dim=3) / count
    return kmin, kmax, kmean


def _expand_heads(x: torch.Tensor, hq: int, name: str) -> torch.Tensor:
    """Repeat kv-head summaries (B, Hkv, ...) to the query heads (B, Hq, ...)."""
    hkv = x.shape[1]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"key/value heads ({hkv}) of {name} must divide query heads ({hq})")
    return x if hkv == hq else x.repeat_interleave(hq // hkv, dim=1)


def block_upper_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest upper bound of ``q·k`` over each key block, per query.

    ``bound[b, h, s, n] = Σ_i max(q_i · kmin_i, q_i · kmax_i)`` ≥ ``q·k`` for every key ``k`` of block
    ``n`` (unscaled dot product). Computed as ``q⁺ · kmax + q⁻ · kmin`` with ``q⁺ = max(q, 0)``,
    ``q⁻ = min(q, 0)``.

    Args:
        q: queries ``(B, H_q, S_q, D)``.
        kmin, kmax: ``(B, H_kv, NK, D)`` from :func:`block_summaries`; ``H_kv`` divides ``H_q``.

    Returns:
        fp32 ``(B, H_q, S_q, NK)``; ``-inf`` for blocks without valid keys.
    """
    _check_4d("q", q)
    _check_4d("kmin", kmin)
    _check_4d("kmax", kmax)
    if kmin.shape != kmax.shape:
        raise ValueError(f"kmin {tuple(kmin.shape)} and kmax {tuple(kmax.shape)} must have the same shape")
    if kmin.shape[0] != q.shape[0] or kmin.shape[3] != q.shape[3]:
        raise ValueError(f"summaries {tuple(kmin.shape)} do not match queries {tuple(q.shape)} on batch or head dim")
    hq = q.shape[1]
    kmin = _expand_heads(kmin.float(), hq, "kmin")
    kmax = _expand_heads(kmax.float(), hq, "kmax")
    empty = torch.isinf(kmax).all(dim=-1)  # (B, Hq, NK): no valid key
    any_empty = bool(empty.any())
    if any_empty:
        kmin = torch.where(empty[..., None], 0.0, kmin)
        kmax = torch.where(empty[..., None], 0.0, kmax)
    qf = q.detach().float()
    # Σ_i max(q_i·min_i, q_i·max_i) = q⁺·max + q⁻·min, as one matmul over the concatenated dims.
    q_pm = torch.cat([qf.clamp(min=0), qf.clamp(max=0)], dim=-1)  # (B, Hq, Sq, 2D)
    k_pm = torch.cat([kmax, kmin], dim=-1)  # (B, Hq, NK, 2D)
    bound = q_pm @ k_pm.transpose(-1, -2)  # (B, Hq, Sq, NK)
    return bound.masked_fill(empty[:, :, None, :], float("-inf")) if any_empty else bound


def query_block_upper_bound(
    q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, block_size: int, *, chunk_blocks: int | None = None
) -> torch.Tensor:
    """Upper bound of every score between a query block and a key block.

    The max over the query block's queries of :func:`block_upper_bound`, computed ``chunk_blocks`` query
    blocks at a time so memory stays ``O(chunk · block_size · NK)``.

    Returns:
        fp32 ``(B, H_q, NQ, NK)``.
    """
    _check_4d("q", q)
    _check_block_size(block_size)
    B, Hq, Sq, D = q.shape
    nq = math.ceil(Sq / block_size)
    nk = kmin.shape[2]
    if chunk_blocks is None:  # keep the per-chunk (B, Hq, rows, NK) bound near 32 MB
        chunk_blocks = max(1, (8 * 2**20) // max(1, B * Hq * block_size * nk))
    out = torch.empty(B, Hq, nq, nk, dtype=torch.float32, device=q.device)
    for c0 in range(0, nq, chunk_blocks):
        c1 = min(nq, c0 + chunk_blocks)
        rows = q[:, :, c0 * block_size : min(Sq, c1 * block_size)]
        bound = block_upper_bound(rows, kmin, kmax)  # (B, Hq, rows, NK)
        n_rows = bound.shape[2]
        pad = (c1 - c0) * block_size - n_rows
        if pad:
            bound = torch.nn.functional.pad(bound, (0, 0, 0, pad), value=float("-inf"))
        out[:, :, c0:c1] = bound.view(B, Hq, c1 - c0, block_size, nk).amax(dim=3)
    return out


# --------------------------------------------------------------------------------------------- selection


def _block_ranges(sq: int, sk: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Aligned key positions of each query block: first and last query shifted by ``S_k - S_q``."""
    nq = math.ceil(sq / block_size)
    starts = torch.arange(nq, device=device) * block_size
    ends = torch.clamp(starts + block_size, max=sq) - 1
    off = sk - sq
    return starts + off, ends + off  # (NQ,), (NQ,)


def _visible_blocks(sq: int, sk: int, block_size: int, causal: bool, device) -> torch.Tensor:
    """Bool ``(NQ, NK)``: some query of the query block may see some key of the key block (causal only)."""
    nq, nk = math.ceil(sq / block_size), math.ceil(sk / block_size)
    if not causal:
        return torch.ones(nq, nk, dtype=torch.bool, device=device)
    _, last = _block_ranges(sq, sk, block_size, device)
    kstart = torch.arange(nk, device=device) * block_size
    return kstart[None, :] <= last[:, None]


def _forced_blocks(sq: int, sk: int, block_size: int, keep_first: bool, keep_diagonal: bool, device) -> torch.Tensor:
    """Bool ``(NQ, NK)`` of always-kept blocks (before the visibility filter)."""
    nq, nk = math.ceil(sq / block_size), math.ceil(sk / block_size)
    forced = torch.zeros(nq, nk, dtype=torch.bool, device=device)
    if keep_first and nk > 0:
        forced[:, 0] = True
    if keep_diagonal and nk > 0:
        first, last = _block_ranges(sq, sk, block_size, device)
        kstart = torch.arange(nk, device=device) * block_size
        kend = torch.clamp(kstart + block_size, max=sk) - 1
        # Key blocks that overlap the query block's own (aligned) positions [first, last].
        forced |= (kstart[None, :] <= last[:, None]) & (kend[None, :] >= first[:, None])
    return forced


def select_blocks(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    causal: bool = False,
    keep_first: bool = True,
    keep_diagonal: bool = True,
    key_padding_mask: torch.Tensor | None = None,
    score: str = "bound",
) -> torch.Tensor:
    """Top-k key blocks per query block, with always-kept blocks.

    Args:
        q: queries ``(B, H_q, S_q, D)``.
        k: keys ``(B, H_kv, S_k, D)``; ``H_kv`` divides ``H_q``.
        block_size: rows per query block and per key block.
        topk: number of key blocks per query block, always-kept blocks included; when the always-kept
            blocks of a query block outnumber ``topk`` they are all kept (``K`` grows to fit them).
        causal: bottom-right aligned causal mask; blocks no query of the block may see are never chosen.
        keep_first: always keep key block 0 (attention sink), when visible.
        keep_diagonal: always keep the key blocks that hold the query block's own aligned positions
            (``i + S_k - S_q``), when visible.
        key_padding_mask: bool ``(B, S_k)``, ``True`` = padded; blocks of only padding are never chosen.
        score: ``"bound"`` (Quest upper bound, see module docs) or ``"mean"`` (``q · mean(K_block)``,
            MoBA-style, max over the block's queries).

    Returns:
        int64 ``(B, H_q, NQ, K)``: valid ids ascending, then ``-1`` slots.
    """
    _check_4d("q", q)
    _check_4d("k", k)
    _check_block_size(block_size)
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    if score not in ("bound", "mean"):
        raise ValueError(f"score must be 'bound' or 'mean', got {score!r}")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"k {tuple(k.shape)} does not match q {tuple(q.shape)} on batch or head dim")
    Sk = k.shape[2]
    nq, nk = math.ceil(Sq / block_size), math.ceil(Sk / block_size)
    if nq == 0 or nk == 0:
        return torch.full((B, Hq, nq, 0), -1, dtype=torch.long, device=q.device)
    kmin, kmax, kmean = block_summaries(k, block_size, key_padding_mask=key_padding_mask)
    if score == "bound":
        scores = query_block_upper_bound(q, kmin, kmax, block_size)  # (B, Hq, NQ, NK)
    else:
        empty = torch.isinf(kmax).all(dim=-1)  # (B, Hkv, NK)
        scores = query_block_upper_bound(q, kmean, kmean, block_size)
        scores = scores.masked_fill(_expand_heads(empty, Hq, "k")[:, :, None, :], float("-inf"))
    has_key = ~torch.isinf(kmax).all(dim=-1)  # (B, Hkv, NK)
    has_key = _expand_heads(has_key, Hq, "k")[:, :, None, :]  # (B, Hq, 1, NK)
    allowed = _visible_blocks(Sq, Sk, block_size, causal, q.device)[None, None] & has_key  # (B, Hq, NQ, NK)
    forced = _forced_blocks(Sq, Sk, block_size, keep_first, keep_diagonal, q.device)[None, None] & allowed
    scores = scores.masked_fill(forced, float("inf")).masked_fill(~allowed, float("-inf"))
    n_slots = min(nk, max(topk, int(forced.sum(dim=-1).max().item()) if forced.numel() else 0))
    top = scores.topk(n_slots, dim=-1)
    idx = torch.where(torch.isneginf(top.values), torch.full_like(top.indices, -1), top.indices)
    # Ascending valid ids, then -1: sort with -1 mapped past the last id.
    idx = torch.where(idx < 0, nk, idx).sort(dim=-1).values
    return torch.where(idx >= nk, -1, idx)
