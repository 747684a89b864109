"""One attention entry point with explicit backends.

Layout everywhere is ``(B, H, S, D)``: batch, heads, sequence, head dim. Queries may have a different
length from keys/values, and key/value heads may be fewer than query heads (grouped-query attention):
``H_q`` must be a multiple of ``H_kv``; query head ``h`` reads key/value head ``h // (H_q // H_kv)``.

Mask semantics:
    causal: query ``i`` sees key ``j`` iff ``j <= i + (S_k - S_q)`` (bottom-right aligned, as in
        FlashAttention), so a query block appended after a cached prefix sees the whole prefix.
    key_padding_mask: bool ``(B, S_k)``, ``True`` marks a *padded* key that no query may attend to
        (the convention of ``torch.nn.MultiheadAttention``).
    attn_bias: float tensor broadcastable to ``(B, H_q, S_q, S_k)``, added to the scaled scores.
    window: a sliding window around query ``i``'s position ``p = i + (S_k - S_q)``: with ``causal``, key ``j`` is
        seen iff ``p - window < j <= p`` (its ``window`` latest keys, itself included; Mistral's and transformers'
        ``sliding_window``); without, iff ``|p - j| < window`` (a bidirectional window: transformers'
        bidirectional ``sliding_window`` ``w`` is ``window = w + 1``).
    softcap: scores become ``softcap · tanh(scores / softcap)`` after scaling, before bias and masks (Gemma 2's
        attention logit soft-capping). ``sdpa`` refuses it.
    sinks: attention sinks (GPT-OSS): one extra logit per row in the softmax denominator whose value is zero,
        ``(H_q,)`` (one per head) or a tensor broadcastable to ``(B, H_q, S_q)``; it receives a gradient. Not
        scaled, capped or masked. ``sdpa`` refuses it.
    segment_ids: int ``(B, S_k)``: key ``j``'s segment; a query sees keys of its own segment only (packed
        sequences, chunked attention). ``q_segment_ids`` ``(B, S_q)`` gives the queries' segments, by default
        those of their positions, ``segment_ids[:, S_k - S_q:]``. ``triton`` refuses them.
    group_ids: int ``(B, S_k)``, with ``causal``: a query also sees the later keys of its own group (id ``>= 0``;
        ``-1``: none) — bidirectional blocks inside causal attention (image tokens, transformers'
        ``block_sequence_ids``); windows and segments still apply. ``q_group_ids`` as ``q_segment_ids``.
        ``triton`` refuses them.

A query row whose keys are all masked returns zeros (not NaN) in every backend.

Backends (the ``BACKENDS`` table, registered explicitly):
    reference: plain math in float32 (float64 for double inputs), the ground truth.
    sdpa: ``torch.nn.functional.scaled_dot_product_attention``; masks become one mask of their broadcast
        shape (a causal mask with ``S_q ≠ S_k``: ``S_q · S_k``). On CUDA its fused kernels (flash,
        memory-efficient) never build the scores; elsewhere (math) the scores take ``B · H · S_q · S_k``.
    chunked: online softmax over query and key chunks (:mod:`core.attention_chunked`), exact, memory
        ``O(S · chunk)`` in forward and backward (scores are recomputed in backward); any length on a CPU.
        Chunk sizes per call: ``q_chunk_size`` / ``k_chunk_size``. On CPU each block runs PyTorch's fused
        attention kernel; elsewhere (or for ``D_v ≠ D``) plain PyTorch block math.
    triton: the fused kernel ``kernels.flash_attention`` (imported on first use), CUDA tensors only; windows
        (both kinds), soft caps and sinks included, no bias or segment ids.

The ``auto`` rule (:func:`choose_backend`, as a plain function of its facts :func:`auto_rule`), in order:
    0. a soft cap or sinks (which ``sdpa`` cannot apply): ``triton`` where step 1's conditions hold at any query
       length, else ``reference`` when the dense scores fit the memory budget, else ``chunked``.
    1. CUDA tensors, float16/bfloat16, head dims of q and v in 16..128, no ``attn_bias`` or segment ids, Triton
       installed, and more than ``DECODE_MAX_QUERIES`` queries -> ``triton``; if the kernel still declines the
       input (``ValueError``: a limit, a tile that does not fit the GPU), the rule goes on without it.
    2. CUDA tensors that SDPA runs with a fused kernel (flash or memory-efficient: never the score matrix,
       memory ``O(S)``; :func:`sdpa_fused`) and whose masks, as ``sdpa`` builds them, fit the memory budget
       (:func:`sdpa_mask_bytes`) -> ``sdpa``. This takes decode-sized queries (SDPA's kernels split the keys
       across the GPU, where the Triton kernel would run one program per (batch, head)), fp32, and biases.
    3. the dense score matrix, ``B · H_q · S_q · S_k · 4`` bytes, fits the memory budget -> ``sdpa``; except on a
       CPU when ``sdpa`` would have to build a per-query mask (causal, window, segments) together with padding or
       a bias, for at least ``CPU_MASKED_CHUNKED_MIN_PAIRS`` query-key pairs -> ``chunked``, which skips the
       hidden blocks and runs the fused kernel's own causal mode (measured 1.2-2.8x faster from 512² pairs).
    4. eligible for step 1 but decode-sized (neither step 2 nor 3 applied) -> ``triton``.
    5. otherwise -> ``chunked``.
    The budget is ``DEFAULT_MEMORY_BUDGET`` (512 MiB) unless the call passes ``memory_budget=`` (bytes).
There is no process-wide switch: choose per call (``backend=``) or per module attribute. The rule's code is in
:mod:`core.attention_dispatch`.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from core.attention_chunked import chunked_attention
from core.attention_inputs import AttentionInputs, prepare_inputs
from core.attention_dispatch import (  # the auto rule, re-exported: core.attention stays the one import
    CPU_MASKED_CHUNKED_MIN_PAIRS,
    DECODE_MAX_QUERIES,
    DEFAULT_MEMORY_BUDGET,
    _check_budget,
    _sdpa_causal,
    auto_rule,
    choose_backend,
    dense_score_bytes,
    dispatch_facts,
    sdpa_fused,
    sdpa_mask_bytes,
    triton_installed,
)

logger = logging.getLogger(__name__)

__all__ = [
    "attention",
    "BACKENDS",
    "AttentionInputs",
    "choose_backend",
    "prepare_inputs",
    "dense_score_bytes",
    "sdpa_mask_bytes",
    "sdpa_fused",
    "dispatch_facts",
    "auto_rule",
    "DEFAULT_MEMORY_BUDGET",
    "DECODE_MAX_QUERIES",
    "CPU_MASKED_CHUNKED_MIN_PAIRS",
]

def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, Hkv, S, D) -> (B, Hkv * groups, S, D) by repeating each head ``groups`` times."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def causal_keep(sq: int, sk: int, device: torch.device | None = None, q_offset: int = 0, k_offset: int = 0) -> torch.Tensor:
    """Bool ``(sq, sk)``: True where query ``q_offset + i`` may see key ``k_offset + j`` (bottom-right aligned)."""
    qi = torch.arange(q_offset, q_offset + sq, device=device)[:, None]
    kj = torch.arange(k_offset, k_offset + sk, device=device)[None, :]
    return kj <= qi  # caller passes offsets already shifted by (S_k - S_q)


def _mask_keep(a: AttentionInputs, causal: bool | None = None) -> torch.Tensor | None:
    """Bool keep mask of the causal / group / window / segment / padding masks, broadcastable to ``(B, 1, S_q, S_k)``
    (None: none). ``causal`` overrides ``a.causal`` (``sdpa`` drops it for one query, which sees every key anyway)."""
    Sq, Sk = a.q.shape[2], a.k.shape[2]
    causal = a.causal if causal is None else causal
    keep = None
    qi = torch.arange(Sk - Sq, Sk, device=a.q.device)[:, None]
    kj = torch.arange(Sk, device=a.q.device)[None, :]
    if causal:
        keep = (kj <= qi)[None, None]
        if a.group_ids is not None:  # the later keys of the query's own group too
            same = (a.q_group_ids[:, :, None] == a.group_ids[:, None, :]) & (a.q_group_ids[:, :, None] >= 0)
            keep = keep | same[:, None]
    if a.window is not None:
        win = kj > qi - a.window
        if not causal:
            win = win & (kj < qi + a.window)
        keep = win[None, None] if keep is None else keep & win
    if a.segment_ids is not None:
        same = (a.q_segment_ids[:, :, None] == a.segment_ids[:, None, :])[:, None]  # (B, 1, Sq, Sk)
        keep = same if keep is None else keep & same
    if a.key_padding_mask is not None:
        kp = ~a.key_padding_mask[:, None, None, :]
        keep = kp if keep is None else keep & kp
    return keep


def _reference(a: AttentionInputs) -> torch.Tensor:
    """Plain fp32 math (fp64 for double inputs): the ground truth every other backend is tested against."""
    out_dtype = a.q.dtype
    cdtype = torch.promote_types(out_dtype, torch.float32)
    q = a.q.to(cdtype)
    k = _expand_kv(a.k.to(cdtype), a.groups)
    v = _expand_kv(a.v.to(cdtype), a.groups)
    Sq, Sk = q.shape[2], k.shape[2]
    if Sk == 0:  # no keys: every query reads nothing, zeros (as the other backends give)
        return torch.zeros(*q.shape[:3], v.shape[-1], dtype=out_dtype, device=q.device)
    scores_BHQK = torch.matmul(q, k.transpose(-1, -2)) * a.scale
    if a.softcap is not None:
        scores_BHQK = torch.tanh(scores_BHQK / a.softcap) * a.softcap
    if a.attn_bias is not None:
        scores_BHQK = scores_BHQK + a.attn_bias.to(cdtype)
    keep = _mask_keep(a)
    if keep is None:
        keep = torch.ones(1, 1, Sq, Sk, dtype=torch.bool, device=q.device)
    scores_BHQK = scores_BHQK.masked_fill(~keep, float("-inf"))
    row_max = scores_BHQK.amax(dim=-1, keepdim=True)
    sink = None
    if a.sinks is not None:  # one more logit per row, value zero
        sink = a.sinks.to(cdtype).unsqueeze(-1)  # (B|1, Hq|1, Sq|1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    p = torch.exp(scores_BHQK - row_max)
    denom = p.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    out = torch.matmul(p, v) / torch.where(denom > 0, denom, torch.ones_like(denom))
    return out.to(out_dtype)


def _sdpa_call(q, k, v, mask, *, is_causal: bool, scale: float, groups: int, per_query_mask: bool, cuda_rules: bool):
    """SDPA with GQA heads mapped so that a fused CUDA kernel can run (``cuda_rules``; elsewhere ``enable_gqa``).

    Only SDPA's flash kernel (fp16/bf16, no mask, equal head dims) maps GQA heads itself; for the
    memory-efficient one (masks, fp32) the heads must match, or SDPA falls back to math and the O(S²) scores.
    Without a per-query mask (no causal mask: decode, or not causal), the group folds into the query axis,
    ``(B, H_kv·G, S_q, D) -> (B, H_kv, G·S_q, D)``: no copy of K/V. Otherwise K/V are expanded (memory O(S)).
    """
    flash_ok = mask is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[3] == v.shape[3]
    if groups == 1 or not cuda_rules or flash_ok:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=groups > 1)  # fmt: skip
    B, Hq, Sq, _ = q.shape
    Hkv = k.shape[1]
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))  # (B|1, Hq|1, Sq|1, Sk)
    one_row = mask is None or (mask.shape[2] == 1 and (mask.shape[1] == 1 or Sq == 1))
    if not per_query_mask and not is_causal and one_row:
        q_fold = q.reshape(B, Hkv, groups * Sq, q.shape[3])  # (B, Hkv, G·Sq, D): head hk·G + g -> rows g·Sq + i
        if mask is not None and mask.shape[1] != 1:  # per-head rows (B|1, Hq, 1, Sk), S_q = 1
            mask = mask.reshape(mask.shape[0], Hkv, groups, mask.shape[-1])  # (B|1, Hkv, G·1, Sk)
        out = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=mask, scale=scale)
        return out.reshape(B, Hq, Sq, v.shape[3])  # (B, Hkv, G·Sq, Dv) -> (B, Hq, Sq, Dv)
    k, v = _expand_kv(k, groups), _expand_kv(v, groups)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)


def _sdpa(a: AttentionInputs) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with our mask semantics."""
    if a.softcap is not None or a.sinks is not None:
        what = "a softcap" if a.softcap is not None else "attention sinks"
        raise ValueError(f"backend 'sdpa' cannot apply {what}; use 'chunked', 'reference' or 'auto'")
    q, k, v = a.q, a.k, a.v
    Sq, Sk = q.shape[2], k.shape[2]
    causal = _sdpa_causal(a) or (a.causal and a.window is not None)  # one query sees every earlier key anyway
    mask = None
    row_has_key = None
    simple = not (a.key_padding_mask is not None or a.attn_bias is not None or a.window is not None
                  or a.segment_ids is not None or a.group_ids is not None)  # fmt: skip
    if causal and simple and Sq == Sk:
        is_causal = True
    else:
        is_causal = False
        keep = _mask_keep(a, causal=causal)
        if keep is not None:
            # Rows that see no key: let them see everything, then zero them, so that neither the output
            # nor the gradients carry SDPA's NaN for an all -inf row.
            row_has_key = keep.any(dim=-1, keepdim=True)  # (B|1, 1, Sq, 1)
            if bool(row_has_key.all()):
                row_has_key = None
            else:
                keep = keep | ~row_has_key
        if a.attn_bias is not None:
            mask = a.attn_bias.to(q.dtype)
            if keep is not None:
                mask = mask.masked_fill(~keep, float("-inf"))
        elif keep is not None:
            mask = keep
    out = _sdpa_call(q, k, v, mask, is_causal=is_causal, scale=a.scale, groups=a.groups,
                     per_query_mask=causal or a.window is not None or a.segment_ids is not None
                     or a.group_ids is not None,
                     cuda_rules=q.is_cuda)  # fmt: skip
    if row_has_key is not None:
        out = torch.where(row_has_key, out, 0.0)
    if a.attn_bias is not None:
        # A bias that is -inf over a whole row makes SDPA return NaN there; our contract is zeros.
        out = torch.nan_to_num(out, nan=0.0)
    return out


def _chunked(a: AttentionInputs) -> torch.Tensor:
    """Online softmax over query/key chunks with recompute in backward (see :mod:`core.attention_chunked`)."""
    return chunked_attention(
        a.q,
        a.k,
        a.v,
        causal=a.causal,
        key_padding_mask=a.key_padding_mask,
        attn_bias=a.attn_bias,
        scale=a.scale,
        q_chunk_size=a.q_chunk_size,
        k_chunk_size=a.k_chunk_size,
        window=a.window,
        softcap=a.softcap,
        sinks=a.sinks,
        q_segment_ids=a.q_segment_ids,
        segment_ids=a.segment_ids,
        q_group_ids=a.q_group_ids,
        group_ids=a.group_ids,
    )


def _triton(a: AttentionInputs) -> torch.Tensor:
    """The fused Triton kernel; CUDA tensors only."""
    if a.segment_ids is not None or a.group_ids is not None:
        what = "segment ids" if a.segment_ids is not None else "group ids"
        raise ValueError(f"backend 'triton' has no {what}; use 'chunked', 'sdpa' or 'auto'")
    if a.q.device.type != "cuda":
        raise ValueError(
            f"backend 'triton' needs CUDA tensors, got {a.q.device.type} tensors; use 'chunked', 'sdpa' or 'auto'"
        )
    if not triton_installed():
        raise ValueError("backend 'triton' needs the triton package (pip install triton); use 'sdpa' or 'auto'")
    return triton_kernel_call(a)


def triton_kernel_call(a: AttentionInputs) -> torch.Tensor:
    """``kernels.flash_attention`` on validated inputs, every option passed through (no device checks here)."""
    kernel = importlib.import_module("kernels.flash_attention")
    return kernel.flash_attention(
        a.q, a.k, a.v, causal=a.causal, key_padding_mask=a.key_padding_mask, attn_bias=a.attn_bias, scale=a.scale,
        window=a.window, softcap=a.softcap, sinks=a.sinks,
    )  # fmt: skip


#: The backend table: name -> function of validated inputs. Registered explicitly, nothing discovered.
BACKENDS: dict[str, Callable[[AttentionInputs], torch.Tensor]] = {
    "reference": _reference,
    "sdpa": _sdpa,
    "chunked": _chunked,
    "triton": _triton,
}


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    scale: float | None = None,
    backend: str = "auto",
    memory_budget: int | None = None,
    q_chunk_size: int | None = None,
    k_chunk_size: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    q_group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention, ``softmax(q kᵀ · scale + bias) v``.

    Args:
        q: queries ``(B, H_q, S_q, D)``.
        k: keys ``(B, H_kv, S_k, D)``, ``H_kv`` divides ``H_q``.
        v: values ``(B, H_kv, S_k, D_v)``.
        causal: bottom-right aligned causal mask (see module docs).
        key_padding_mask: bool ``(B, S_k)``, True = padded key.
        attn_bias: additive float bias broadcastable to ``(B, H_q, S_q, S_k)``.
        scale: score scale, default ``1/sqrt(D)``.
        backend: ``"auto"`` or a name in ``BACKENDS``.
        memory_budget: ``auto`` only: bytes the dense fp32 score matrix may take for ``sdpa`` to be chosen
            (default ``DEFAULT_MEMORY_BUDGET``, 512 MiB).
        q_chunk_size: ``chunked`` only: queries per chunk (default up to 1024, fewer for large ``B · H_q``).
        k_chunk_size: ``chunked`` only: keys per chunk (default 1024).
        window: sliding window (module docs): with ``causal`` each query sees its ``window`` latest keys only;
            without, the keys within distance ``< window`` of its position on both sides.
        softcap: scores become ``softcap · tanh(scores / softcap)`` (not ``sdpa``).
        sinks: attention-sink logits, ``(H_q,)`` or broadcastable to ``(B, H_q, S_q)`` (not ``sdpa``).
        segment_ids: int ``(B, S_k)`` segment of each key; queries see their own segment only.
        q_segment_ids: int ``(B, S_q)`` segment of each query (default: ``segment_ids[:, S_k - S_q:]``).
        group_ids: int ``(B, S_k)`` (``-1``: none), with ``causal``: queries also see later keys of their group.
        q_group_ids: int ``(B, S_q)`` group of each query (default: ``group_ids[:, S_k - S_q:]``).

    Returns:
        ``(B, H_q, S_q, D_v)`` in the dtype of ``q``.
    """
    _check_budget(memory_budget)
    a = prepare_inputs(
        q,
        k,
        v,
        causal=causal,
        key_padding_mask=key_padding_mask,
        attn_bias=attn_bias,
        scale=scale,
        q_chunk_size=q_chunk_size,
        k_chunk_size=k_chunk_size,
        window=window,
        softcap=softcap,
        sinks=sinks,
        segment_ids=segment_ids,
        q_segment_ids=q_segment_ids,
        group_ids=group_ids,
        q_group_ids=q_group_ids,
    )
    if backend == "auto":
        name = choose_backend(a, memory_budget=memory_budget)
        if name == "triton":
            try:
                return BACKENDS["triton"](a)
            except ValueError as err:  # the kernel declined this input: the rule without Triton
                name = choose_backend(a, memory_budget=memory_budget, allow_triton=False)
                logger.debug("triton kernel declined the input (%s); using %s", err, name)
        return BACKENDS[name](a)
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {['auto', *BACKENDS]}")
    return BACKENDS[backend](a)
