"""Block-sparse attention: key-block summaries, upper-bound scores, top-k block selection
(:mod:`core.blocksparse_select`), exact attention inside the selected blocks.

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

from core.blocksparse_select import (  # selection, re-exported: core.blocksparse stays the one import
    _check_4d,
    _check_block_size,
    _check_padding,
    _pad_to_blocks,
    block_summaries,
    block_upper_bound,
    query_block_upper_bound,
    select_blocks,
)

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
