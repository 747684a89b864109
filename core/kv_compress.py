"""KV-cache compression policies for any :class:`core.decoder.Decoder`, in one registry.

A policy reads a :class:`~core.decoder.KVCache`, a token ``budget`` and an :class:`Observation` (attention
probes and masks from the prefill that built the cache) and returns the slots to keep, one entry per layer,
in the form :meth:`KVCache.select <core.decoder.KVCache.select>` takes: None (keep the layer whole) or
int64 ``(B, H_kv, K)`` slot indices per KV head. :func:`compress` applies a policy by name.

Policies (``POLICIES``):
    full: keep everything (exactly the uncompressed cache).
    random: ``budget`` random slots per layer (seeded ``generator``), shared by the heads.
    streaming: attention sinks (the first ``num_sinks`` slots) + the most recent slots (StreamingLLM).
    h2o: heavy hitters by accumulated attention received (per KV head) + the most recent ``recent_ratio``
        of the budget (H2O). Observe every prompt token (``observe(..., query_index="all")``).
    snapkv: the observation window (the probed queries, which must be the last tokens of the prefill) is
        kept; the rest of the budget goes to the slots the window's queries vote for (attention summed over
        the window and the head group, pooled over neighbouring tokens with ``kernel_size``), per KV head.
    pyramidkv: SnapKV with per-layer budgets shrinking linearly upwards (lowest layer largest) whose sum is
        ``budget * depth``; the top layer gets ``max(window, budget // beta)``.
    fastv: layers below ``k_layer`` (2) whole; from ``k_layer`` on, every non-image slot plus the image slots
        with the highest attention at layer ``k_layer - 1``, ``budget`` slots in all (FastV).
    emloc: no token budget (pass ``budget=None``): prunes the slots of the last prefilled chunk layer by
        layer from the top, trying keep ratios ``ratios`` and accepting the smallest whose output
        distribution at the chunk's answer tokens stays within Jensen–Shannon divergence ``delta`` of the
        unpruned one (else the layer stays whole); answer tokens are always kept. Token importance is the
        attention the answer tokens give each slot, per KV head, smoothed over ``smooth_kernel`` tokens.
        :func:`emloc_compress` runs it chunk by chunk over many demonstrations; a chunk with ``suffix_embeds``
        is observed as the reference does it (:func:`core.kv_emloc.policy_emloc_suffix`: each demonstration
        re-encoded as a suffix after the chunk).

Always-kept tokens: ``Observation.protect`` (bool ``(B, S)``) makes every budgeted policy rank those slots first
(e.g. the demonstrations' answer tokens EMLoC always keeps), so a comparison at equal budget is about what each
policy adds; the rest of the budget goes by the policy's own ranking.

"Keeps exactly its budget": with a budgeted policy every KV head of every pruned layer sees
``min(budget_l, visible slots)`` slots afterwards (``KVCache.kept_counts``). Budgets count slots, and
policies choose among slots a head can still see. Pruned tokens keep their original RoPE position ids
(keys are stored rotated; ``LayerKV.pos`` travels with them), so continuations stay consistent.

Observation probes (``Observation.attentions``) are ``(B, H_q, Q, S_l)`` per layer, as returned by
``Decoder.forward(..., attn_queries=...)`` for the prefill that produced the cache: queries are ``Q`` of the
newly prefilled tokens, keys are all of the layer's slots.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

from core.decoder import KVCache

# The EMLoC policy and its driver live in core.kv_emloc, the observation in core.kv_observe; both are re-exported
# here, so ``core.kv_compress`` stays the one import for compression.
from core.kv_emloc import (
    Chunk,
    ChunkReport,
    EMLoCConfig,
    EMLoCResult,
    chunk_demonstrations,
    emloc_compress,
    js_divergence,
    policy_emloc,
    replay_logits,
)
from core.kv_observe import (
    Indices,
    Observation,
    _check_budget,
    _need,
    _per_layer,
    _pool,
    _protected,
    _slot_rank,
    _topk_slots,
    importance,
    observe,
)

logger = logging.getLogger(__name__)

__all__ = [
    "Observation",
    "observe",
    "POLICIES",
    "compress",
    "importance",
    "js_divergence",
    "replay_logits",
    "pyramid_budgets",
    "EMLoCConfig",
    "Chunk",
    "ChunkReport",
    "EMLoCResult",
    "chunk_demonstrations",
    "emloc_compress",
]


def policy_full(cache: KVCache, budget: int | None = None, obs: Observation | None = None) -> Indices:
    """Keep every slot."""
    return [None] * cache.num_layers


def policy_random(cache: KVCache, budget: int, obs: Observation | None = None, *, generator: torch.Generator | None = None) -> Indices:
    """``budget`` uniformly random slots per layer and batch item, shared by the heads."""
    budget = _check_budget(budget)

    def score(i, vis):
        r = torch.rand(vis.shape[0], 1, vis.shape[2], generator=generator, device=generator.device if generator else "cpu")
        return r.to(vis.device)

    return _per_layer(cache, budget, score, obs)


def policy_streaming(cache: KVCache, budget: int, obs: Observation | None = None, *, num_sinks: int = 4) -> Indices:
    """The first ``num_sinks`` slots (attention sinks) plus the most recent ``budget - num_sinks`` slots."""
    budget = _check_budget(budget)
    if not 0 <= num_sinks <= budget:
        raise ValueError(f"num_sinks ({num_sinks}) must lie in [0, budget={budget}]")

    def score(i, vis):
        S = vis.shape[-1]
        rank = _slot_rank(S, vis.device)
        return torch.where(rank < num_sinks, rank + 2 * S, rank)[None, None]  # sinks first, then recency

    return _per_layer(cache, budget, score, obs)


def policy_h2o(cache: KVCache, budget: int, obs: Observation | None = None, *, recent_ratio: float = 0.5) -> Indices:
    """Heavy hitters (accumulated attention received, per KV head) plus the most recent slots."""
    budget = _check_budget(budget)
    atts = _need(obs, "attentions", "h2o")
    if not 0.0 <= recent_ratio <= 1.0:
        raise ValueError(f"recent_ratio must lie in [0, 1], got {recent_ratio}")
    n_recent = int(round(recent_ratio * budget))

    def score(i, vis):
        S = vis.shape[-1]
        imp = importance(atts[i], vis.shape[1])
        big = imp.amax() + 1.0
        recent = _slot_rank(S, vis.device) >= S - n_recent
        return torch.where(recent[None, None], big + _slot_rank(S, vis.device)[None, None], imp)

    return _per_layer(cache, budget, score, obs)


def _snap_scores(atts: torch.Tensor, vis: torch.Tensor, window: int, kernel_size: int, pooling: str) -> torch.Tensor:
    """SnapKV votes: the window's attention, pooled; the window itself ranked first."""
    S = vis.shape[-1]
    imp = _pool(importance(atts, vis.shape[1]), kernel_size, pooling)
    in_window = _slot_rank(S, vis.device) >= S - window
    return torch.where(in_window[None, None], imp.amax() + 1.0, imp)


def _window(obs: Observation, policy: str) -> int:
    qi = _need(obs, "query_index", policy)
    n = _need(obs, "num_new", policy)
    w = qi.numel()
    if not torch.equal(qi.cpu(), torch.arange(n - w, n)):
        raise ValueError(f"policy {policy!r} needs the probed queries to be the last tokens of the prefill (a window), got {qi.tolist()}")
    return w


def policy_snapkv(
    cache: KVCache, budget: int, obs: Observation | None = None, *, kernel_size: int = 7, pooling: str = "max"
) -> Indices:
    """SnapKV: keep the observation window and the slots it votes for, per KV head."""
    budget = _check_budget(budget)
    atts = _need(obs, "attentions", "snapkv")
    w = _window(obs, "snapkv")
    if w > budget:
        raise ValueError(f"snapkv: the observation window ({w}) is larger than the budget ({budget})")
    return _per_layer(cache, budget, lambda i, vis: _snap_scores(atts[i], vis, w, kernel_size, pooling), obs)


def pyramid_budgets(budget: int, depth: int, *, floor: int, beta: int = 20) -> list[int]:
    """Per-layer budgets, largest at layer 0, decreasing linearly, summing to ``budget * depth``.

    The top layer gets ``b_min = max(floor, budget // beta)`` (at most ``budget``); layer 0 gets
    ``2 * budget - b_min``; rounding remainders go to the lowest layers.
    """
    b_min = min(budget, max(floor, budget // beta))
    b_max = 2 * budget - b_min
    if depth == 1:
        return [budget]
    raw = [b_max - (b_max - b_min) * i / (depth - 1) for i in range(depth)]
    out = [int(math.floor(r)) for r in raw]
    for i in range(budget * depth - sum(out)):
        out[i % depth] += 1
    return out


def policy_pyramidkv(
    cache: KVCache, budget: int, obs: Observation | None = None, *, beta: int = 20, kernel_size: int = 7, pooling: str = "max"
) -> Indices:
    """PyramidKV: SnapKV scoring with per-layer budgets from :func:`pyramid_budgets`."""
    budget = _check_budget(budget)
    atts = _need(obs, "attentions", "pyramidkv")
    w = _window(obs, "pyramidkv")
    if w > budget:
        raise ValueError(f"pyramidkv: the observation window ({w}) is larger than the budget ({budget})")
    budgets = pyramid_budgets(budget, cache.num_layers, floor=w, beta=beta)
    out: Indices = []
    for i, layer in enumerate(cache.layers):
        vis = layer.visible()
        b = budgets[i]
        if int(vis.sum(-1).max()) <= b:
            out.append(None)
            continue
        out.append(_topk_slots(_protected(_snap_scores(atts[i], vis, w, kernel_size, pooling), obs), vis, b))
    return out


def policy_fastv(cache: KVCache, budget: int, obs: Observation | None = None, *, k_layer: int = 2) -> Indices:
    """FastV: from layer ``k_layer`` on keep text slots and the most attended image slots (attention at layer
    ``k_layer - 1``, averaged over probe queries and heads, shared by the heads)."""
    budget = _check_budget(budget)
    atts = _need(obs, "attentions", "fastv")
    image = _need(obs, "image_mask", "fastv")
    if not 1 <= k_layer <= cache.num_layers:
        raise ValueError(f"k_layer must lie in [1, depth={cache.num_layers}], got {k_layer}")
    S = len(cache.layers[k_layer - 1])
    if any(len(l) != S for l in cache.layers) or tuple(image.shape) != (cache.batch_size, S):
        raise ValueError(f"fastv needs an unpruned cache and image_mask of shape (B, S) = ({cache.batch_size}, {S})")
    image = image.to(atts[0].device)
    n_text = int((~image).sum(-1).max())
    if n_text > budget:
        raise ValueError(f"fastv keeps every text token: budget ({budget}) is below the text tokens ({n_text})")
    rank = atts[k_layer - 1].float().mean(dim=(1, 2))  # (B, S) attention received per slot
    score = _protected(torch.where(image, rank, rank.amax() + 1.0)[:, None, :], obs)
    out: Indices = [None] * k_layer
    for layer in cache.layers[k_layer:]:
        vis = layer.visible()
        out.append(None if int(vis.sum(-1).max()) <= budget else _topk_slots(score.expand_as(vis), vis, budget))
    return out


POLICIES: dict[str, Callable[..., Indices]] = {
    "full": policy_full,
    "random": policy_random,
    "streaming": policy_streaming,
    "h2o": policy_h2o,
    "snapkv": policy_snapkv,
    "pyramidkv": policy_pyramidkv,
    "fastv": policy_fastv,
    "emloc": policy_emloc,
}


def compress(cache: KVCache, policy: str, budget: int | None, obs: Observation | None = None, **options) -> KVCache:
    """Apply a registered policy: ``cache.select(POLICIES[policy](cache, budget, obs, **options))``."""
    if policy not in POLICIES:
        raise ValueError(f"unknown KV compression policy {policy!r}; choose one of {sorted(POLICIES)}")
    return cache.select(POLICIES[policy](cache, budget, obs, **options))


