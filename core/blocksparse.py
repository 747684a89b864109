"""Block-sparse attention: key-block summaries, upper-bound scores, top-k block selection, exact attention
inside the selected blocks.

Block format (shared with ``kernels.block_sparse``):
    Queries and keys are cut into blocks of ``block_size`` rows; the last block of each may be short.
    ``NQ = ceil(S_q / block_size)`` query blocks, ``NK = ceil(S_k / block_size)`` key blocks.
    ``block_index``: int64 ``(B, H_q, NQ, K)``, the key-block ids each query block attends to; ``-1``
    marks an unused slot; a valid id appears at most once per row. :func:`select_blocks` returns the valid
    ids in ascending order followed by the ``-1`` slots.

Mask semantics are those of :mod:`core.attention`: ``causal`` is bottom-right aligned (query ``i`` sees
key ``j`` iff ``j <= i + S_k - S_q``), ``key_padding_mask`` is bool ``(B, S_k)`` with ``True`` = padded,
and a query that sees no key returns zeros.

Selection (Quest-style): each key block is summarised by its per-dimension min and max over its
non-padded keys; for a query ``q`` the score ``Σ_i max(q_i·min_i, q_i·max_i)`` is an upper bound of
``q·k`` over every key of the block. A query block's score is the max of that bound over the block's
queries (tighter than a bound from the query block's own min/max box, and computed with two matmuls as
``q⁺·max + q⁻·min``). The top-k blocks by that score are kept, plus always-kept blocks (the first block,
the diagonal blocks that hold the query block's own positions); blocks that no query of the block may see
(causal) or that hold only padding are never selected.
"""

from __future__ import annotations

import logging
import math

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "block_summaries",
    "block_upper_bound",
    "query_block_upper_bound",
    "select_blocks",
    "block_sparse_attention",
    "topk_block_attention",
    "block_index_to_mask",
    "block_density",
    "validate_block_index",
    "BLOCK_SPARSE_BACKENDS",
]

#: Backends of :func:`block_sparse_attention`: ``torch`` (gather, any device) and ``triton`` (CUDA).
BLOCK_SPARSE_BACKENDS = ("auto", "torch", "triton")

# Working-set budget (bytes) of one query-block group in the PyTorch path: the gathered keys, values and
# scores of a group stay under it, so memory is O(S·K·block) split into bounded pieces.
_GROUP_BYTES = 64 * 2**20


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


# --------------------------------------------------------------------------------------------- attention


def validate_block_index(block_index: torch.Tensor, *, B: int, H: int, nq: int, nk: int) -> torch.Tensor:
    """Check a ``block_index`` against the block grid; ``ValueError`` says what is wrong.

    Returns the index as int64 on its device.
    """
    if not isinstance(block_index, torch.Tensor):
        raise ValueError(f"block_index must be a torch.Tensor, got {type(block_index).__name__}")
    if block_index.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"block_index must be an integer tensor (int64), got {block_index.dtype}")
    if block_index.dim() != 4 or tuple(block_index.shape[:3]) != (B, H, nq):
        raise ValueError(
            f"block_index must have shape (B, H_q, NQ, K) = ({B}, {H}, {nq}, K), got {tuple(block_index.shape)}"
        )
    idx = block_index.long()
    if idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -1 or hi >= nk:
            raise ValueError(f"block_index ids must lie in [-1, {nk - 1}] (NK = {nk} key blocks), got range [{lo}, {hi}]")
        s = idx.sort(dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]) & (s[..., 1:] >= 0)
        if bool(dup.any()):
            where = tuple(int(i) for i in dup.nonzero()[0][:3])
            raise ValueError(f"block_index has a duplicated key-block id in row (b, h, query block) = {where}")
    return idx


def block_density(block_index: torch.Tensor, nk: int) -> float:
    """Fraction of (query block, key block) pairs that are selected."""
    if block_index.numel() == 0 or nk == 0:
        return 0.0
    return float((block_index >= 0).sum()) / (block_index.shape[0] * block_index.shape[1] * block_index.shape[2] * nk)


def _group_attention(
    q_blocks: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    kvalid_flat: torch.Tensor | None,
    idx: torch.Tensor,
    row_base: torch.Tensor,
    q_pos: torch.Tensor,
    causal_off: int | None,
    scale: float,
    block_size: int,
    needs_mask: bool,
) -> torch.Tensor:
    """Attention of a group of query blocks over their gathered key blocks.

    q_blocks (B, Hq, G, bs, D); k_flat (B·Hkv·NK, bs·D) and v_flat (B·Hkv·NK, bs·Dv): key/value blocks, one
    row each; kvalid_flat (B·NK, bs) bool or None when every key is valid; idx (B, Hq, G, K) with -1 slots;
    row_base (B, Hq, 1, 1): row of block 0 of each query head's kv head in k_flat; q_pos (G, bs) query
    positions; needs_mask False when no key of any gathered block is masked. Returns (B, Hq, G, bs, Dv).
    """
    B, Hq, G, bs, D = q_blocks.shape
    K = idx.shape[-1]
    Dv = v_flat.shape[-1] // bs
    nk = kvalid_flat.shape[0] // B if kvalid_flat is not None else None
    slot_ok = idx >= 0  # (B, Hq, G, K)
    safe = idx.clamp(min=0)
    rows = (row_base + safe).reshape(-1)  # (B·Hq·G·K,)
    k_sel = k_flat.index_select(0, rows).view(B * Hq * G, 1, K * bs, D)  # (N, 1, K·bs, D)
    v_sel = v_flat.index_select(0, rows).view(B * Hq * G, 1, K * bs, Dv)
    q_sel = q_blocks.reshape(B * Hq * G, 1, bs, D)  # (N, 1, bs, D)
    if not needs_mask:  # every slot valid, no padding, no causal: plain attention over the gathered keys
        out = torch.nn.functional.scaled_dot_product_attention(q_sel, k_sel, v_sel, scale=scale)
        return out.view(B, Hq, G, bs, Dv)
    keep = slot_ok[..., None].expand(B, Hq, G, K, bs)
    if kvalid_flat is not None:
        b_rows = (torch.arange(B, device=idx.device).view(B, 1, 1, 1) * nk + safe).reshape(-1)
        keep = keep & kvalid_flat.index_select(0, b_rows).view(B, Hq, G, K, bs)
    keep = keep.reshape(B, Hq, G, 1, K * bs)
    if causal_off is not None:
        k_pos = (safe[..., None] * block_size + torch.arange(bs, device=idx.device)).reshape(B, Hq, G, 1, K * bs)
        keep = keep & (k_pos <= (q_pos + causal_off)[None, None, :, :, None])  # (B, Hq, G, bs, K·bs)
    any_key = keep.any(dim=-1, keepdim=True)  # (B, Hq, G, bs|1, 1)
    all_rows_see_a_key = bool(any_key.all())
    if not all_rows_see_a_key:
        # Rows that see no key attend to everything (finite: no NaN in forward or backward), zeroed below.
        keep = keep | ~any_key
    zero = torch.zeros((), dtype=q_blocks.dtype, device=idx.device)
    mask = torch.where(keep, zero, float("-inf")).reshape(B * Hq * G, 1, keep.shape[3], K * bs)
    out = torch.nn.functional.scaled_dot_product_attention(q_sel, k_sel, v_sel, attn_mask=mask, scale=scale)
    out = out.view(B, Hq, G, bs, Dv)
    return out if all_rows_see_a_key else torch.where(any_key, out, zero)


class _RecomputeGroup(torch.autograd.Function):
    """One query-block group whose activations are recomputed in backward (saves only its inputs).

    A small stand-in for ``torch.utils.checkpoint`` (whose first call pays a multi-second import): forward
    runs without a graph; backward re-runs the group with grad enabled and differentiates it.
    """

    @staticmethod
    def forward(ctx, q_blocks, k_flat, v_flat, *rest):
        ctx.save_for_backward(q_blocks, k_flat, v_flat)
        ctx.rest = rest
        with torch.no_grad():
            return _group_attention(q_blocks, k_flat, v_flat, *rest)

    @staticmethod
    def backward(ctx, grad_out):
        q_blocks, k_flat, v_flat = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q_blocks, k_flat, v_flat), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            out = _group_attention(*inputs, *ctx.rest)
        wanted = [t for t in inputs if t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, grad_out, allow_unused=True)) if wanted else iter(())
        return (*(next(grads) if t.requires_grad else None for t in inputs), *([None] * len(ctx.rest)))


def _torch_block_sparse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    block_size: int,
    causal: bool,
    key_padding_mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    B, Hq, Sq, D = q.shape
    Hkv, Sk, Dv = k.shape[1], k.shape[2], v.shape[3]
    nq, nk = math.ceil(Sq / block_size), math.ceil(Sk / block_size)
    out_dtype = q.dtype
    K = idx.shape[-1]
    if K == 0 or nk == 0 or Sq == 0:
        return torch.zeros(B, Hq, Sq, Dv, dtype=out_dtype, device=q.device) + 0 * q.sum() + 0 * v.sum()
    q_blocks = _pad_to_blocks(q, block_size)  # (B, Hq, NQ, bs, D)
    k_flat = _pad_to_blocks(k, block_size).reshape(B * Hkv * nk, block_size * D)  # one key block per row
    v_flat = _pad_to_blocks(v, block_size).reshape(B * Hkv * nk, block_size * Dv)
    kvalid = None
    if key_padding_mask is not None or nk * block_size != Sk:
        kvalid = torch.ones(B, Sk, dtype=torch.bool, device=q.device) if key_padding_mask is None else ~key_padding_mask
        kvalid = torch.nn.functional.pad(kvalid, (0, nk * block_size - Sk), value=False).view(B * nk, block_size)
    kv_head = torch.arange(Hq, device=q.device) // (Hq // Hkv)  # kv head read by each query head
    row_base = ((torch.arange(B, device=q.device)[:, None] * Hkv + kv_head[None, :]) * nk).view(B, Hq, 1, 1)
    q_pos = torch.arange(nq * block_size, device=q.device).view(nq, block_size)
    causal_off = (Sk - Sq) if causal else None
    # Query blocks per group: the gathered K/V, mask and scores of a group stay under _GROUP_BYTES.
    per_block = B * Hq * K * block_size * (D + Dv + 3 * block_size) * q.element_size()
    group = max(1, _GROUP_BYTES // max(1, per_block))
    needs_mask = causal or kvalid is not None or bool((idx < 0).any())
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    outs = []
    out = None if grad else torch.empty(B, Hq, nq, block_size, Dv, dtype=q.dtype, device=q.device)
    for g0 in range(0, nq, group):
        g1 = min(nq, g0 + group)
        args = (q_blocks[:, :, g0:g1], k_flat, v_flat, kvalid, idx[:, :, g0:g1], row_base, q_pos[g0:g1])
        rest = (causal_off, scale, block_size, needs_mask)
        if not grad:
            out[:, :, g0:g1] = _group_attention(*args, *rest)
        elif g1 - g0 < nq:
            # Recompute each group in backward: saved activations stay one group's worth.
            outs.append(_RecomputeGroup.apply(*args, *rest))
        else:
            outs.append(_group_attention(*args, *rest))
    if grad:
        out = torch.cat(outs, dim=2)  # (B, Hq, NQ, bs, Dv)
    out = out.reshape(B, Hq, nq * block_size, Dv)[:, :, :Sq]  # (B, Hq, Sq, Dv)
    return out.to(out_dtype)


def _triton_block_sparse():
    """The Triton kernel entry point, or ``None`` when it cannot be imported."""
    try:
        from kernels.block_sparse import block_sparse_attention as kernel
    except Exception as e:  # ImportError, or triton missing inside the module
        logger.debug("kernels.block_sparse unavailable: %s", e)
        return None
    return kernel


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
    backend: str = "auto",
) -> torch.Tensor:
    """Exact softmax attention restricted to the selected key blocks of each query block.

    Query ``i`` in query block ``n`` attends to the keys of the key blocks ``block_index[b, h, n]``
    (``-1`` slots ignored), further restricted by ``causal`` and ``key_padding_mask``; the softmax is
    normalised over exactly those keys. A query that sees no key returns zeros.

    Memory is ``O(S_q · K · block_size)``: the PyTorch path gathers the ``K`` selected key/value blocks of a
    group of query blocks at a time (never an ``S_q × S_k`` matrix); under autograd each group is
    recomputed in backward, so saved activations stay one group's worth.

    Args:
        q: queries ``(B, H_q, S_q, D)``.
        k: keys ``(B, H_kv, S_k, D)``; ``H_kv`` divides ``H_q`` (grouped-query attention).
        v: values ``(B, H_kv, S_k, D_v)``.
        block_index: int64 ``(B, H_q, NQ, K)`` key-block ids, ``-1`` = unused slot, no duplicates.
        block_size: rows per query block and per key block (last blocks may be short).
        causal: bottom-right aligned causal mask.
        key_padding_mask: bool ``(B, S_k)``, ``True`` = padded key.
        scale: score scale, default ``1/sqrt(D)``.
        backend: ``"auto"`` (Triton kernel on CUDA when importable, else PyTorch), ``"torch"`` or ``"triton"``.

    Returns:
        ``(B, H_q, S_q, D_v)`` in the dtype of ``q``.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_4d(name, t)
    _check_block_size(block_size)
    if backend not in BLOCK_SPARSE_BACKENDS:
        raise ValueError(f"unknown block-sparse backend {backend!r}; choose one of {list(BLOCK_SPARSE_BACKENDS)}")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise ValueError(f"q, k, v must share a floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or tuple(k.shape[:3]) != tuple(v.shape[:3]) or k.shape[3] != D:
        raise ValueError(f"shapes do not agree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    Hkv, Sk = k.shape[1], k.shape[2]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key/value heads ({Hkv}) must divide query heads ({Hq})")
    kpm = _check_padding(key_padding_mask, B, Sk, q.device)
    nq, nk = math.ceil(Sq / block_size), math.ceil(Sk / block_size)
    idx = validate_block_index(block_index.to(q.device), B=B, H=Hq, nq=nq, nk=nk)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if backend == "triton" or (backend == "auto" and q.is_cuda):
        kernel = _triton_block_sparse() if q.is_cuda else None
        if kernel is not None:
            try:
                return kernel(q, k, v, idx, block_size=block_size, causal=causal, key_padding_mask=kpm, scale=scale)
            except ValueError as e:
                if backend == "triton":
                    raise
                logger.debug("block-sparse Triton kernel declined (%s); using PyTorch", e)
        elif backend == "triton":
            raise ValueError(f"backend='triton' needs CUDA tensors and an importable kernels.block_sparse (got {q.device})")
    return _torch_block_sparse(q, k, v, idx, block_size=block_size, causal=causal, key_padding_mask=kpm, scale=scale)


def topk_block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    block_size: int,
    topk: int,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    scale: float | None = None,
    keep_first: bool = True,
    keep_diagonal: bool = True,
    score: str = "bound",
    backend: str = "auto",
    return_index: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """:func:`select_blocks` then :func:`block_sparse_attention`; returns the output (and the index)."""
    block_index = select_blocks(
        q,
        k,
        block_size=block_size,
        topk=topk,
        causal=causal,
        keep_first=keep_first,
        keep_diagonal=keep_diagonal,
        key_padding_mask=key_padding_mask,
        score=score,
    )
    out = block_sparse_attention(
        q, k, v, block_index, block_size=block_size, causal=causal, key_padding_mask=key_padding_mask, scale=scale,
        backend=backend,
    )
    return (out, block_index) if return_index else out


def block_index_to_mask(block_index: torch.Tensor, *, block_size: int, sq: int, sk: int) -> torch.Tensor:
    """Dense bool keep mask ``(B, H, S_q, S_k)`` of a block index (for tests and plots; ``O(S²)`` memory).

    ``True`` where the query's block selected the key's block. Causal and padding masks are not applied.
    """
    _check_block_size(block_size)
    if block_index.dim() != 4:
        raise ValueError(f"block_index must have shape (B, H, NQ, K), got {tuple(block_index.shape)}")
    B, H, nq, _ = block_index.shape
    nk = math.ceil(sk / block_size)
    idx = validate_block_index(block_index, B=B, H=H, nq=nq, nk=nk)
    if nq != math.ceil(sq / block_size):
        raise ValueError(f"block_index has {nq} query blocks but S_q = {sq} needs {math.ceil(sq / block_size)}")
    blocks = torch.zeros(B, H, nq, nk + 1, dtype=torch.bool, device=idx.device)
    blocks.scatter_(-1, torch.where(idx < 0, nk, idx), True)
    blocks = blocks[..., :nk]  # (B, H, NQ, NK)
    dense = blocks.repeat_interleave(block_size, dim=2).repeat_interleave(block_size, dim=3)
    return dense[:, :, :sq, :sk]
