"""``"longctx"`` as a transformers attention implementation: every attention call runs on :func:`core.attention`.

Two functions are registered under one name:

* a **mask function** (transformers' ``AttentionMaskInterface``, :mod:`core.hf.masks`). transformers hands it the
  mask *pattern* (a composed ``mask_function``) and sizes; it returns a :class:`LongctxMask` that keeps the pattern
  compact: causal or not, sliding windows (causal and bidirectional), the ``(B, S_k)`` key padding, segment ids
  (packed sequences, Llama 4's chunked attention) and a static cache's offsets. A pattern it does not recognise
  (image-token overlays) is built densely with transformers' own ``sdpa_mask`` (exact, ``O(S_q · S_k)`` memory;
  logged once per pattern).
* an **attention function** (``AttentionInterface``), called by every attention layer with ``(B, H, S, D)``
  tensors. It maps the mask onto :func:`core.attention.attention` (``backend="auto"``: ``chunked`` on a CPU
  when the scores would not fit, Triton/SDPA on CUDA), with GQA, scaling, windows, soft-capping, attention sinks
  (``s_aux`` / ``sinks``: GPT-OSS and the models that copy it), sparse key selections (``indices``: top-k keys per
  query, DeepSeek-V3.2's indexer; ``block_indices``: top-k key blocks per query and key/value head, MiniMax-M3;
  :mod:`core.attention_indexed`), and returns ``(B, S, H, D)``; with ``output_attentions`` it also returns the
  attention probabilities, recomputed densely for that call only. What it cannot serve falls back *for that call
  only*, with a warning once per reason that names it: dropout in training to transformers' ``sdpa``; a keyword
  argument it does not know to the model's own ``eager_attention_forward`` (refused with an error where the
  modeling file has none, never dropped).

Per-head hidden keys (a pruned cache whose heads keep different tokens, :mod:`core.hf.cache`) arrive as an
attribute of the key tensor the cache returns and become an additive ``-inf`` bias per key/value head; the
fallbacks receive them as part of a dense mask, so no path ignores them.
"""

from __future__ import annotations

import logging
import sys

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from core.attention import attention, causal_keep
from core.attention_indexed import blocks_to_keys, indexed_attention
from core.hf import probes
from core.hf.masks import _WARNED, LongctxMask, Pattern, dense_mask, longctx_mask, recognise, warn_once

logger = logging.getLogger(__name__)

__all__ = ["ATTN_NAME", "LongctxMask", "Pattern", "longctx_attention", "longctx_mask", "recognise", "register",
           "is_registered", "HIDDEN_ATTR", "OPTIONS_ATTR", "set_attention_options", "dense_mask"]  # fmt: skip

#: The name models are loaded with: ``attn_implementation="longctx"``.
ATTN_NAME = "longctx"
#: Attribute of an attention module: ``core.attention.attention`` options for its calls (``backend``,
#: ``memory_budget``, ``q_chunk_size``, ``k_chunk_size``); see :func:`set_attention_options`.
OPTIONS_ATTR = "longctx_options"
#: Attribute of a key tensor returned by a pruned cache layer: bool ``(B, H_kv, S_k)``, True = hidden from that head.
HIDDEN_ATTR = "_longctx_hidden"
_warn_once = warn_once
assert _WARNED is not None  # re-exported: tests clear it to see the one-time warnings again


# --- the attention function -----------------------------------------------------------------------------------


#: Keyword arguments the attention function serves (the rest of the pattern comes through the mask).
_SERVED = frozenset({"softcap", "is_causal", "position_bias", "output_attentions", "s_aux", "sinks", "indices",
                     "block_indices"})  # fmt: skip
#: Served keyword arguments that transformers' ``sdpa`` cannot take (the dropout fallback goes to eager with them).
_NOT_SDPA = ("softcap", "position_bias", "s_aux", "sinks", "indices", "block_indices")
#: Keyword arguments models pass that do not change the attention (positions are already in q and k; the varlen
#: and window arguments are for flash kernels, whose pattern the mask already holds; ``deterministic`` asks a
#: flash kernel for a deterministic backward, which the core's kernels are).
_INFORMATIONAL = frozenset({"position_ids", "use_cache", "cache_position", "sliding_window", "cu_seq_lens_q",
                            "cu_seq_lens_k", "max_length_q", "max_length_k", "output_hidden_states", "return_dict",
                            "layer_idx", "image_sizes", "past_key_values", "past_key_value", "logits_to_keep",
                            "deterministic"})  # fmt: skip


def _fallback_reason(module, query, dropout: float, kwargs: dict) -> str | None:
    if dropout and dropout > 0 and module.training:
        return "dropout"
    unknown = sorted(
        k for k, v in kwargs.items()
        if v is not None and k not in _SERVED and k not in _INFORMATIONAL
        and not (isinstance(v, bool) and k.startswith(("output_", "return_", "use_")))  # flags for the outputs
    )  # fmt: skip
    if unknown:  # never drop an argument that may change the answer
        return f"argument {unknown[0]!r}"
    if kwargs.get("block_indices") is not None and _block_size(module) is None:
        return "argument 'block_indices' (no indexer.block_size on the module)"
    return None


def _block_size(module) -> int | None:
    """The key-block size of a module's block selection (MiniMax-M3: ``module.indexer.block_size``)."""
    size = getattr(getattr(module, "indexer", None), "block_size", None)
    return size if isinstance(size, int) and size >= 1 else None


def _implicit_causal(module, query: torch.Tensor, kwargs: dict) -> bool:
    """Whether a call without a mask is causal, as transformers' ``sdpa`` decides it: ``is_causal`` from the call,
    else from the module (default True), and more than one query. Such a mask is top-left aligned (keys past
    ``S_q`` are seen by no query)."""
    is_causal = kwargs.get("is_causal")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    return bool(is_causal) and query.shape[2] > 1


def _as_dense_for_fallback(attention_mask, query, key, module, kwargs) -> torch.Tensor | None:
    """The model's mask as a dense bool keep mask (or its own float mask) for transformers' functions: a
    :class:`LongctxMask` expanded, an implicit causal mask built, per-head hidden keys folded in."""
    if isinstance(attention_mask, LongctxMask):
        mask = attention_mask.to_bool(query.shape[0], query.device)
    else:
        mask = attention_mask
    if mask is None and _implicit_causal(module, query, kwargs):
        mask = causal_keep(query.shape[2], key.shape[2], query.device)[None, None]  # top-left, as sdpa's is_causal
    hidden = getattr(key, HIDDEN_ATTR, None)
    if hidden is not None:
        G = query.shape[1] // key.shape[1]
        keep_h = ~hidden.repeat_interleave(G, dim=1)[:, :, None, :]  # (B, Hq, 1, Sk)
        if mask is None:
            mask = keep_h
        elif mask.dtype == torch.bool:
            mask = mask & keep_h
        else:
            mask = mask.masked_fill(~keep_h, torch.finfo(mask.dtype).min)
    return mask


def _hidden_bias(hidden: torch.Tensor, key: torch.Tensor, hq: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-head hidden keys of a pruned cache (bool ``(B, H_kv, S_k)``) as an additive bias ``(B, H_q, 1, S_k)``."""
    B, hkv, sk = hidden.shape
    if sk != key.shape[2] or hkv != key.shape[1]:
        raise ValueError(f"per-head mask {tuple(hidden.shape)} does not match keys {tuple(key.shape)}")
    bias = torch.zeros(B, hkv, sk, dtype=dtype, device=key.device).masked_fill_(hidden.to(key.device), float("-inf"))
    return bias.repeat_interleave(hq // hkv, dim=1)[:, :, None, :]  # (B, Hq, 1, Sk)


def _model_eager(module):
    """The ``eager_attention_forward`` of the module's own modeling file (it knows the model's extras: sinks, caps)."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _fallback(reason, module, query, key, value, attention_mask, scaling, dropout, kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = _as_dense_for_fallback(attention_mask, query, key, module, kwargs)
    rest = {k: v for k, v in kwargs.items() if k != "is_causal"}  # the mask now holds any causality
    if reason == "dropout" and all(rest.get(name) is None for name in _NOT_SDPA):
        _warn_once(reason, "longctx: dropout in training is not served by core.attention; these calls run "
                           "transformers' sdpa")  # fmt: skip
        if isinstance(mask, torch.Tensor) and mask.dtype != torch.bool:
            mask = mask.to(query.dtype)
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                      is_causal=False, **rest)  # fmt: skip
    _warn_once(reason, f"longctx: {reason} is not served by core.attention; these calls (only) run the model's "
                       "eager attention")  # fmt: skip
    if mask is not None and mask.dtype == torch.bool:  # eager functions take an additive float mask
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(
            ~mask, torch.finfo(query.dtype).min)  # fmt: skip
    if rest.get("position_bias") is not None:
        pb = rest.pop("position_bias").to(query.dtype)
        mask = pb if mask is None else mask + pb
    eager = _model_eager(module)
    if eager is not None:
        try:
            return eager(module, query, key, value, mask, scaling=scaling, dropout=dropout, **rest)
        except TypeError as err:  # an eager function of another signature: the generic one below
            logger.debug("model eager attention refused the call (%s); using the generic eager math", err)
    if reason.startswith("argument"):
        raise ValueError(
            f"longctx attention cannot serve the {reason} that {type(module).__name__} passes, and its modeling file "
            "has no eager attention to fall back to; load the model with attn_implementation='eager'"
        )
    return _eager(module, query, key, value, mask, scaling, dropout, rest.get("softcap"))


def _eager(module, query, key, value, mask, scaling, dropout, softcap):
    """transformers' eager math (with Gemma 2's soft cap) on a dense mask (None: no mask, as the caller built any
    causal one): the reference the fallbacks need when the model's file has no eager function."""
    G = query.shape[1] // key.shape[1]
    k = key.repeat_interleave(G, dim=1)
    v = value.repeat_interleave(G, dim=1)
    scores = torch.matmul(query, k.transpose(2, 3)) * (scaling if scaling is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device).masked_fill_(
                ~mask, torch.finfo(scores.dtype).min)  # fmt: skip
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, v)
    return out.transpose(1, 2).contiguous(), weights


def longctx_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """transformers' attention interface for ``"longctx"``: ``(B, H, S, D)`` in, ``((B, S_q, H, D_v), weights)`` out
    (``weights``: ``(B, H, S_q, S_k)`` probabilities with ``output_attentions``, else None).

    ``attention_mask`` is a :class:`LongctxMask` (decoders: our mask function made it), None (vision towers:
    ``is_causal`` from the call or the module decides, as in transformers' ``sdpa``), or a tensor a model built
    itself: bool (True = attend) or additive float, broadcastable to ``(B, H, S_q, S_k)``.
    """
    reason = _fallback_reason(module, query, dropout, kwargs)
    if reason is not None:
        return _fallback(reason, module, query, key, value, attention_mask, scaling, dropout, kwargs)
    Sq = query.shape[2]
    causal, window, key_padding, bias, q_seg, k_seg, q_grp, k_grp = False, None, None, None, None, None, None, None
    hidden = getattr(key, HIDDEN_ATTR, None)  # read before any slicing: a slice does not carry the attribute
    if isinstance(attention_mask, LongctxMask):
        m = attention_mask
        causal, window, q_seg, k_seg = m.causal, m.window, m.q_segments, m.k_segments
        q_grp, k_grp = m.q_groups, m.k_groups
        same_length = m.kv_length == key.shape[2]  # a per-layer pruned cache holds other lengths in other layers
        if not same_length and (m.key_padding is not None or k_seg is not None or k_grp is not None
                                or m.kv_used != m.kv_length):
            raise ValueError(
                f"this layer holds {key.shape[2]} keys, the mask was made for {m.kv_length} (a cache whose layers "
                "differ in length, e.g. pruned per layer): prune padded tokens out of the cache and pass an all-ones "
                "attention_mask"
            )
        key_padding = m.key_padding
        if same_length and m.kv_used < key.shape[2]:  # a static cache's unfilled tail: seen by no query
            used = m.kv_used
            key, value = key[:, :, :used], value[:, :, :used]
            key_padding = key_padding[:, :used] if key_padding is not None else None
            k_seg = k_seg[:, :used] if k_seg is not None else None
            k_grp = k_grp[:, :used] if k_grp is not None else None
    elif attention_mask is None:
        causal = _implicit_causal(module, query, kwargs)
        if causal and key.shape[2] > Sq:  # as transformers' sdpa: is_causal aligns top-left, extra keys unseen
            key, value = key[:, :, :Sq], value[:, :, :Sq]
    elif isinstance(attention_mask, torch.Tensor):
        mask = attention_mask
        if mask.dim() == 2:  # (B, S_k), True/1 = real token
            key_padding = ~mask.to(torch.bool)
        else:
            mask = mask[..., : key.shape[2]]
            bias = _bool_to_bias(mask, query.dtype) if mask.dtype == torch.bool else mask.to(query.dtype)
    else:
        raise ValueError(
            f"longctx attention got a mask of type {type(attention_mask).__name__}; it takes the masks its own mask "
            "function makes, None, or a bool/float tensor"
        )
    if hidden is not None:
        hidden_bias = _hidden_bias(hidden[:, :, : key.shape[2]], key, query.shape[1], query.dtype)
        bias = hidden_bias if bias is None else bias + hidden_bias
    position_bias = kwargs.get("position_bias")
    if position_bias is not None:  # an additive relative-position bias (T5-style), as transformers' sdpa adds it
        position_bias = position_bias[..., : key.shape[2]].to(query.dtype)
        bias = position_bias if bias is None else bias + position_bias
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux") if kwargs.get("s_aux") is not None else kwargs.get("sinks")
    selection = _selection(module, kwargs, key.shape[2])
    pattern = dict(causal=causal, window=window, key_padding=key_padding, sinks=sinks, q_segments=q_seg,
                   k_segments=k_seg, q_groups=q_grp, k_groups=k_grp)  # fmt: skip
    if selection is not None:
        if bias is not None or q_grp is not None:  # the selection meets a dense mask, a bias or groups: eager
            return _fallback("argument 'indices' with a dense mask", module, query, key, value, attention_mask,
                             scaling, dropout, kwargs)  # fmt: skip
        out = indexed_attention(query, key, value, selection, causal=causal, window=window,
                                key_padding_mask=key_padding, q_segment_ids=q_seg, segment_ids=k_seg, sinks=sinks,
                                softcap=softcap, scale=scaling)  # fmt: skip
    else:
        options = getattr(module, OPTIONS_ATTR, None) or {}
        out = attention(query, key, value, causal=causal, key_padding_mask=key_padding, attn_bias=bias, scale=scaling,
                        window=window, softcap=softcap, sinks=sinks, segment_ids=k_seg, q_segment_ids=q_seg,
                        group_ids=k_grp, q_group_ids=q_grp, **options)  # fmt: skip
    weights = None
    if kwargs.get("output_attentions") or probes.active():
        keep = None if selection is None else _selection_keep(selection, key.shape[2], query.shape[1])
        if probes.active():
            probes.record(module, query, key, bias=bias, scale=scaling, softcap=softcap, keep=keep, **pattern)
        if kwargs.get("output_attentions"):  # dense by request, for this call only
            weights = probes.attention_probabilities(query, key, bias=bias, scale=scaling, softcap=softcap, keep=keep,
                                                     last_queries=None, **pattern).to(query.dtype)  # fmt: skip
    return out.transpose(1, 2).contiguous(), weights


def _selection(module, kwargs: dict, kv_length: int) -> torch.Tensor | None:
    """The sparse key selection of the call as key indices ``(B, H_i, S_q, K)`` (``-1`` unused), or None."""
    if kwargs.get("indices") is not None:  # (B, S_q, K) top-k keys per query, shared by every head
        idx = kwargs["indices"]
        return idx.unsqueeze(1) if idx.dim() == 3 else idx
    if kwargs.get("block_indices") is not None:  # (B, H_kv, S_q, K) top-k key blocks per query and kv head
        return blocks_to_keys(kwargs["block_indices"], _block_size(module), kv_length)
    return None


def _selection_keep(selection: torch.Tensor, kv_length: int, hq: int) -> torch.Tensor:
    """The selection as a dense bool ``(B, 1|H_q, S_q, S_k)`` keep mask (for the probabilities only)."""
    B, Hi, Sq, _ = selection.shape
    keep = torch.zeros(B, Hi, Sq, kv_length + 1, dtype=torch.bool, device=selection.device)
    keep.scatter_(-1, selection.long().masked_fill(selection < 0, kv_length), True)
    keep = keep[..., :kv_length]
    return keep if Hi == 1 else keep.repeat_interleave(hq // Hi, dim=1)


def _bool_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


# --- registration ---------------------------------------------------------------------------------------------


def register() -> str:
    """Add ``"longctx"`` to transformers' attention and mask interfaces (idempotent); returns the name.

    Then ``AutoModel...from_pretrained(path, attn_implementation="longctx", local_files_only=True)`` (or
    ``model.set_attn_implementation("longctx")``) runs every attention call of the model on :mod:`core.attention`.
    """
    AttentionInterface.register(ATTN_NAME, longctx_attention)
    AttentionMaskInterface.register(ATTN_NAME, longctx_mask)
    return ATTN_NAME


def is_registered() -> bool:
    """Whether :func:`register` has run in this process."""
    return ALL_ATTENTION_FUNCTIONS.get(ATTN_NAME) is longctx_attention and (
        ALL_MASK_ATTENTION_FUNCTIONS.get(ATTN_NAME) is longctx_mask
    )


_OPTION_NAMES = ("backend", "memory_budget", "q_chunk_size", "k_chunk_size")


def _check_option_values(options: dict) -> None:
    """Refuse, when set (not deep inside a later forward), a backend that is not registered or a size that is not a
    positive int."""
    from core.attention import BACKENDS

    backend = options.get("backend")
    if backend is not None and backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not an attention backend; accepted: auto, {', '.join(BACKENDS)}")
    for name in ("memory_budget", "q_chunk_size", "k_chunk_size"):
        v = options.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be a positive int (or None), got {v!r}")


def set_attention_options(model: torch.nn.Module, **options) -> int:
    """Per-module :func:`core.attention.attention` options for a model's ``"longctx"`` calls (no process-wide
    switch): ``backend`` (``"auto"``, ``"chunked"``, ``"sdpa"``, ``"reference"``, ``"triton"``), ``memory_budget``,
    ``q_chunk_size``, ``k_chunk_size``. Set on every submodule whose class name ends in ``Attention`` (the modules
    that call the attention interface); no options: back to the defaults. Returns how many modules were set."""
    bad = sorted(set(options) - set(_OPTION_NAMES))
    if bad:
        raise ValueError(f"unknown attention options {bad}; accepted: {list(_OPTION_NAMES)}")
    _check_option_values(options)
    n = 0
    for mod in model.modules():
        if type(mod).__name__.endswith("Attention"):
            setattr(mod, OPTIONS_ATTR, dict(options) if options else None)
            n += 1
    return n
