"""Attention probabilities and hidden states of chosen decoder layers, on demand.

``with probe(model, layers=[0, 5], last_queries=32) as rec: model(...)`` records, for each forward call while
the block is open, the softmax attention probabilities of the last ``last_queries`` queries of each chosen layer
(``rec.attention[layer]``: list of fp32 ``(B, H_q, n, S_k)``) and the layer's output hidden states
(``rec.hidden[layer]``: list of ``(B, S, D)``). Probabilities are recomputed from the same ``q``, ``k``, masks,
bias and soft cap the ``"longctx"`` attention function used, for the selected queries only: ``O(n · S_k)`` memory
per layer, never the full score matrix.

``probe(model, layers=..., reduce=fn)`` stores nothing: each attention call of a chosen layer hands ``fn(layer,
query, key, pattern)`` the call's rotated ``(B, H_q, S_q, D)`` queries and ``(B, H_kv, S_k, D)`` keys and the mask
``pattern`` (the keyword arguments of :func:`attention_probabilities`), so a caller reduces as it goes (one layer,
one call at a time) and keeps only what it needs, e.g. :func:`received_attention`.

Off (no open probe) costs one truth test of a list per attention call and no hooks: forward hooks exist only
inside the ``with`` block.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["probe", "ProbeRecord", "active", "record", "attention_probabilities", "received_attention"]

_ACTIVE: list[ProbeRecord] = []


@dataclass
class ProbeRecord:
    """What an open :func:`probe` collected: per layer index, one entry per forward call."""

    last_queries: int | None
    reduce: object = None  # fn(layer, query, key, pattern) called instead of storing probabilities
    attention: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    hidden: dict[int, list[torch.Tensor]] = field(default_factory=lambda: defaultdict(list))
    _modules: dict[int, int] = field(default_factory=dict)  # id(attention module) -> layer index


def active() -> bool:
    """Whether any probe is open (the attention function's only cost when none is)."""
    return bool(_ACTIVE)


def attention_probabilities(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    key_padding: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: float | None,
    softcap: float | None,
    last_queries: int | None,
    sinks: torch.Tensor | None = None,
    q_segments: torch.Tensor | None = None,
    k_segments: torch.Tensor | None = None,
    keep: torch.Tensor | None = None,
    q_groups: torch.Tensor | None = None,
    k_groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``(B, H_q, n, S_k)`` softmax probabilities of the last ``n`` queries (all when None), with
    :mod:`core.attention`'s mask semantics (bottom-right causal, windows, padding, segment ids, attention sinks as
    one more value-zero column, an extra bool ``keep`` mask ``(B, 1|H_q, S_q, S_k)``, bidirectional groups inside causal
    attention; rows with no key are zeros)."""
    Sq, Sk = query.shape[2], key.shape[2]
    n = Sq if last_queries is None else min(Sq, last_queries)
    q = query[:, :, Sq - n :].float()
    G = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(G, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale if scale is not None else query.shape[-1] ** -0.5)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        b = bias.float()
        s = s + (b[..., Sq - n :, :] if b.shape[-2] != 1 else b)
    qi = torch.arange(Sk - n, Sk, device=s.device)[:, None]
    kj = torch.arange(Sk, device=s.device)[None, :]
    hide = kj > qi if causal else torch.zeros(n, Sk, dtype=torch.bool, device=s.device)
    if causal and q_groups is not None:  # later keys of the query's own group are seen
        qg = q_groups[:, Sq - n :, None]
        hide = (hide & ~((qg == k_groups[:, None, :]) & (qg >= 0)))[:, None]  # (B, 1, n, Sk)
    if window is not None:
        hide = hide | (kj <= qi - window)
        if not causal:
            hide = hide | (kj >= qi + window)
    s = s.masked_fill(hide, float("-inf"))
    if key_padding is not None:
        s = s.masked_fill(key_padding[:, None, None, :], float("-inf"))
    if q_segments is not None:
        s = s.masked_fill((q_segments[:, Sq - n :, None] != k_segments[:, None, :])[:, None], float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep[..., Sq - n :, :], float("-inf"))
    if sinks is not None:
        col = sinks.float().reshape((1, -1, 1) if sinks.dim() == 1 else sinks.shape[:3])
        col = col.expand(q.shape[0], q.shape[1], Sq)[:, :, Sq - n :, None]
        return torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1].nan_to_num(0.0)
    return torch.softmax(s, dim=-1).nan_to_num(0.0)


def record(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, **pattern) -> None:
    """Called by the attention function for every attention call while a probe is open."""
    for rec in _ACTIVE:
        layer = rec._modules.get(id(module))
        if layer is not None and rec.reduce is not None:
            with torch.no_grad():
                rec.reduce(layer, query.detach(), key.detach(), pattern)
        elif layer is not None:
            with torch.no_grad():
                probs = attention_probabilities(query.detach(), key.detach(), last_queries=rec.last_queries,
                                                **pattern)  # fmt: skip
            rec.attention[layer].append(probs)


def _attention_module(layer: torch.nn.Module) -> torch.nn.Module:
    """The self-attention submodule of a decoder layer (``self_attn`` in the Llama family)."""
    for name in ("self_attn", "attention", "attn"):
        sub = getattr(layer, name, None)
        if isinstance(sub, torch.nn.Module):
            return sub
    for sub in layer.modules():
        if sub is not layer and type(sub).__name__.endswith("Attention"):
            return sub
    raise ValueError(f"found no attention module in {type(layer).__name__}")


@contextmanager
def probe(model: torch.nn.Module, layers, *, last_queries: int | None = None, attention: bool = True,
          hidden: bool = True, reduce=None):  # fmt: skip
    """Record attention probabilities (needs ``attn_implementation="longctx"``) and/or hidden states of the chosen
    decoder layers while the block is open.

    Args:
        model: a transformers model (or any model :func:`core.hf.insert.decoder_layers` can read).
        layers: decoder layer indices (negative counts from the end).
        last_queries: record the probabilities of this many last queries of each call (None: all queries).
        attention, hidden: what to record.
        reduce: ``fn(layer, query, key, pattern)``, called for every attention call of a chosen layer instead of
            storing its probabilities (see module docs).

    Yields:
        :class:`ProbeRecord`.
    """
    from core.hf.insert import decoder_layers

    stack = decoder_layers(model)
    n = len(stack)
    idx = sorted({i % n for i in layers}) if layers is not None else list(range(n))
    for i in layers or []:
        if not -n <= i < n:
            raise ValueError(f"layer {i} out of range for a model with {n} decoder layers")
    if attention and getattr(getattr(model, "config", None), "_attn_implementation", None) not in (None, "longctx"):
        raise ValueError(
            f"attention probes need attn_implementation='longctx', the model runs "
            f"{model.config._attn_implementation!r}; load it with core.hf.load(..., attn='longctx')"
        )
    rec = ProbeRecord(last_queries=last_queries, reduce=reduce)
    handles = []
    if attention:
        rec._modules = {id(_attention_module(stack[i])): i for i in idx}
    if hidden:
        for i in idx:
            def hook(_m, _args, output, i=i):
                h = output[0] if isinstance(output, (tuple, list)) else output
                rec.hidden[i].append(h.detach())

            handles.append(stack[i].register_forward_hook(hook))
    if attention:
        _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        for h in handles:
            h.remove()
        if attention:
            _ACTIVE.remove(rec)


def received_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    rows: torch.Tensor | None = None,
    block: int = 256,
    **pattern,
) -> torch.Tensor:
    """Attention each key receives, summed over the chosen query rows: fp32 ``(B, H_q, S_k)``.

    The probabilities are those of :func:`attention_probabilities` (same masks), computed ``block`` query rows at
    a time, so memory is ``O(block · S_k)`` per head instead of the ``S_q × S_k`` matrix.

    Args:
        query: ``(B, H_q, S_q, D)``; key: ``(B, H_kv, S_k, D)``.
        rows: int indices of the query rows to sum over (None: all).
        block: query rows per step.
        pattern: ``causal``, ``window``, ``key_padding``, ``bias``, ``scale``, ``softcap`` as the attention used.
    """
    Sq, Sk = query.shape[2], key.shape[2]
    rows = torch.arange(Sq, device=query.device) if rows is None else rows.to(query.device)
    bias = pattern.pop("bias", None)
    causal, window = pattern.pop("causal", False), pattern.pop("window", None)
    G = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(G, dim=1)
    scale = pattern.pop("scale", None)
    scale = scale if scale is not None else query.shape[-1] ** -0.5
    softcap = pattern.pop("softcap", None)
    key_padding = pattern.pop("key_padding", None)
    total = torch.zeros(query.shape[0], query.shape[1], Sk, dtype=torch.float32, device=query.device)
    kj = torch.arange(Sk, device=query.device)[None, :]
    for start in range(0, rows.numel(), block):
        r = rows[start : start + block]
        s = torch.matmul(query[:, :, r].float(), k.transpose(-1, -2)) * scale  # (B, H_q, n, S_k)
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        if bias is not None:
            b = bias.float()
            s = s + (b[..., r, :] if b.shape[-2] != 1 else b)
        if causal:
            qi = (r + (Sk - Sq))[:, None]  # bottom-right aligned
            hide = kj > qi
            if window is not None:
                hide = hide | (kj <= qi - window)
            s = s.masked_fill(hide, float("-inf"))
        if key_padding is not None:
            s = s.masked_fill(key_padding[:, None, None, :], float("-inf"))
        total += torch.softmax(s, dim=-1).nan_to_num(0.0).sum(2)
        del s
    return total
