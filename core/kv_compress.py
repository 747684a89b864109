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
        :func:`emloc_compress` runs it chunk by chunk over many demonstrations.

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
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from core.attention import attention
from core.decoder import Decoder, DecoderOutput, KVCache

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

Indices = list[torch.Tensor | None]


@dataclass(kw_only=True)
class Observation:
    """What a policy may read besides the cache, gathered by :func:`observe` during the prefill.

    Attributes:
        attentions: per layer ``(B, H_q, Q, S_l)`` attention probabilities of the probe queries over the layer's
            slots (the last ``num_new`` slots are the prefilled tokens).
        query_index: ``(Q,)`` indices of the probe queries among the prefilled tokens.
        num_new: number of tokens in the prefill (the last ``num_new`` slots of every layer).
        logits: ``(B, Q, vocab)`` the prefill's logits at the probe queries (EMLoC's unpruned reference).
        query_embeds: ``(B, Q, dim)`` the probe tokens' input embeddings (for :func:`replay_logits`).
        query_pos: ``(B, Q)`` the probe tokens' position ids.
        image_mask: bool ``(B, S)`` over the slots of an unpruned cache, True = image token (FastV).
    """

    attentions: list[torch.Tensor] | None = None
    query_index: torch.Tensor | None = None
    num_new: int | None = None
    logits: torch.Tensor | None = None
    query_embeds: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None


@torch.no_grad()
def observe(
    model: Decoder,
    input_ids: torch.Tensor | None = None,
    *,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache: KVCache | None = None,
    query_index: torch.Tensor | str | int = 8,
    image_mask: torch.Tensor | None = None,
) -> tuple[DecoderOutput, Observation]:
    """Prefill tokens (after ``cache``) and record the probes policies need.

    Args:
        model: the decoder.
        input_ids / inputs_embeds / position_ids / cache: as in :meth:`Decoder.forward`.
        query_index: which new tokens to probe: ``(Q,)`` indices, an int ``w`` (the last ``w`` tokens, the
            SnapKV observation window), or ``"all"`` (every token; H2O's accumulated attention; memory
            ``O(S^2)`` per layer).
        image_mask: bool ``(B, S)``, stored for FastV.

    Returns:
        ``(output, observation)``; ``output.cache`` is the cache to compress.
    """
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds")
    embeds = model.embed(input_ids) if inputs_embeds is None else inputs_embeds
    B, S, _ = embeds.shape
    if isinstance(query_index, str):
        if query_index != "all":
            raise ValueError(f"query_index must be indices, an int window or 'all', got {query_index!r}")
        qi = torch.arange(S)
    elif isinstance(query_index, int):
        if not 1 <= query_index <= S:
            raise ValueError(f"observation window ({query_index}) must lie in [1, S={S}]")
        qi = torch.arange(S - query_index, S)
    else:
        qi = torch.as_tensor(query_index).long().reshape(-1)
    qi = qi.to(embeds.device)
    out = model(inputs_embeds=embeds, position_ids=position_ids, cache=cache, attn_queries=qi, logits_index=qi)
    pos = out.cache.layers[0].pos[:, -S:]  # (B, S) positions of the new tokens
    obs = Observation(
        attentions=out.attentions, query_index=qi, num_new=S, logits=out.logits, query_embeds=embeds[:, qi],
        query_pos=pos[:, qi], image_mask=image_mask,
    )
    return out, obs


def importance(attn_BHQS: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Attention received per slot and KV head: ``(B, H_q, Q, S) -> (B, H_kv, S)``, summed over the probe
    queries and the query heads that share each KV head."""
    B, Hq, Q, S = attn_BHQS.shape
    return attn_BHQS.float().sum(2).reshape(B, num_kv_heads, Hq // num_kv_heads, S).sum(2)


def _pool(score_BHS: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """Pool scores over neighbouring slots (odd ``kernel``, same length); ``kernel <= 1`` is the identity."""
    if kernel <= 1:
        return score_BHS
    B, H, S = score_BHS.shape
    x = score_BHS.reshape(B * H, 1, S)
    if mode == "max":
        y = F.max_pool1d(x, kernel, stride=1, padding=kernel // 2)
    elif mode == "avg":
        y = F.avg_pool1d(x, kernel, stride=1, padding=kernel // 2, count_include_pad=False)
    else:
        raise ValueError(f"pooling must be 'max' or 'avg', got {mode!r}")
    return y[..., :S].reshape(B, H, S)


def _topk_slots(score_BHS: torch.Tensor, visible_BHS: torch.Tensor, k: int) -> torch.Tensor:
    """``(B, H_kv, min(k, S))`` slot indices with the highest scores, hidden slots last (sorted by slot)."""
    k = min(k, score_BHS.shape[-1])
    s = score_BHS.float().masked_fill(~visible_BHS, float("-inf"))
    return torch.topk(s, k, dim=-1).indices.sort(dim=-1).values


def _check_budget(budget) -> int:
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget must be a positive int (slots kept per layer and KV head), got {budget!r}")
    return budget


def _need(obs: Observation | None, what: str, policy: str):
    value = None if obs is None else getattr(obs, what)
    if value is None:
        raise ValueError(f"policy {policy!r} needs Observation.{what} (run core.kv_compress.observe on the prefill)")
    return value


def _per_layer(cache: KVCache, budget: int, score_fn: Callable[[int, torch.Tensor], torch.Tensor]) -> Indices:
    """Top-``budget`` slots per head from ``score_fn(layer, visible_BHS) -> (B, H|1, S)``; None when it all fits."""
    out: Indices = []
    for i, layer in enumerate(cache.layers):
        vis = layer.visible()
        if int(vis.sum(-1).max()) <= budget:
            out.append(None)
            continue
        score = score_fn(i, vis).expand_as(vis)
        out.append(_topk_slots(score, vis, budget))
    return out


def _slot_rank(layer_len: int, device) -> torch.Tensor:
    return torch.arange(layer_len, device=device, dtype=torch.float32)


def policy_full(cache: KVCache, budget: int | None = None, obs: Observation | None = None) -> Indices:
    """Keep every slot."""
    return [None] * cache.num_layers


def policy_random(cache: KVCache, budget: int, obs: Observation | None = None, *, generator: torch.Generator | None = None) -> Indices:
    """``budget`` uniformly random slots per layer and batch item, shared by the heads."""
    budget = _check_budget(budget)

    def score(i, vis):
        r = torch.rand(vis.shape[0], 1, vis.shape[2], generator=generator, device=generator.device if generator else "cpu")
        return r.to(vis.device)

    return _per_layer(cache, budget, score)


def policy_streaming(cache: KVCache, budget: int, obs: Observation | None = None, *, num_sinks: int = 4) -> Indices:
    """The first ``num_sinks`` slots (attention sinks) plus the most recent ``budget - num_sinks`` slots."""
    budget = _check_budget(budget)
    if not 0 <= num_sinks <= budget:
        raise ValueError(f"num_sinks ({num_sinks}) must lie in [0, budget={budget}]")

    def score(i, vis):
        S = vis.shape[-1]
        rank = _slot_rank(S, vis.device)
        return torch.where(rank < num_sinks, rank + 2 * S, rank)[None, None]  # sinks first, then recency

    return _per_layer(cache, budget, score)


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

    return _per_layer(cache, budget, score)


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
    return _per_layer(cache, budget, lambda i, vis: _snap_scores(atts[i], vis, w, kernel_size, pooling))


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
        out.append(_topk_slots(_snap_scores(atts[i], vis, w, kernel_size, pooling), vis, b))
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
    score = torch.where(image, rank, rank.amax() + 1.0)[:, None, :]
    out: Indices = [None] * k_layer
    for layer in cache.layers[k_layer:]:
        vis = layer.visible()
        out.append(None if int(vis.sum(-1).max()) <= budget else _topk_slots(score.expand_as(vis), vis, budget))
    return out


def js_divergence(logits_p: torch.Tensor, logits_q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence (nats, in ``[0, ln 2]``) between the softmax distributions of two logit
    tensors ``(..., vocab)``; returns ``(...)``."""
    lp = torch.log_softmax(logits_p.double(), dim=-1)
    lq = torch.log_softmax(logits_q.double(), dim=-1)
    lm = torch.logaddexp(lp, lq) - math.log(2.0)
    kl_pm = (lp.exp() * (lp - lm)).sum(-1)
    kl_qm = (lq.exp() * (lq - lm)).sum(-1)
    return (0.5 * (kl_pm + kl_qm)).clamp_min(0.0).float()


@torch.no_grad()
def replay_logits(
    model: Decoder,
    layers_kv: list[tuple[torch.Tensor, torch.Tensor]],
    hide: list[torch.Tensor],
    query_embeds: torch.Tensor,
    query_pos: torch.Tensor,
) -> torch.Tensor:
    """Recompute the outputs of tokens whose keys/values are already in a cache, against chosen slots.

    Each layer's queries are recomputed from the replayed hidden states and attend to the layer's stored
    keys/values where ``hide`` is False; keys/values themselves are not recomputed (as for a later query
    reading a pruned cache). Without pruning, ``hide`` = "after the token" reproduces the prefill exactly.

    Args:
        model: the decoder that built the cache (cross-attention memory is not replayed).
        layers_kv: per layer ``(k, v)``, each ``(B, H_kv, S_l, head_dim)``.
        hide: per layer bool ``(B, H_kv, Q, S_l)``, True = slot hidden from that query.
        query_embeds: ``(B, Q, dim)`` input embeddings of the replayed tokens.
        query_pos: ``(B, Q)`` their position ids.

    Returns:
        ``(B, Q, vocab)`` logits.
    """
    cos, sin = model.rope(query_pos.to(query_embeds.device), dtype=query_embeds.dtype)
    x = query_embeds
    for (k, v), h_BHQS, block in zip(layers_kv, hide, model.layers):
        attn = block.attn
        q = attn.project_q(block.norm1(x), rope=(cos, sin))  # (B, H_q, Q, hd)
        G = q.shape[1] // k.shape[1]
        bias = torch.zeros(h_BHQS.shape, dtype=q.dtype, device=q.device).masked_fill(h_BHQS, float("-inf"))
        out = attention(q, k, v, attn_bias=bias.repeat_interleave(G, dim=1), backend=attn.backend, **attn.attention_options)
        x = x + attn.merge(out)
        x = x + block.mlp(block.norm2(x))
    return model.lm_head(model.norm(x))


@dataclass(kw_only=True)
class EMLoCConfig:
    """EMLoC's layer-wise pruning settings."""

    ratios: tuple[float, ...] = (0.1, 0.2, 0.5)  # keep ratios tried per layer, smallest accepted first
    delta: float = 0.005  # JS-divergence bound (nats) at the answer tokens, per chunk
    smooth_kernel: int = 5  # average-pooling width over neighbouring tokens for the importance (1 = none)
    js_reduce: str = "mean"  # how answer tokens' (and batch items') JS values combine: "mean" or "max"

    def __post_init__(self) -> None:
        if not self.ratios or any(not 0.0 < r < 1.0 for r in self.ratios):
            raise ValueError(f"ratios must be a non-empty tuple of numbers in (0, 1), got {self.ratios!r}")
        self.ratios = tuple(sorted(float(r) for r in self.ratios))
        if not self.delta >= 0:
            raise ValueError(f"delta must be >= 0, got {self.delta}")
        if not (isinstance(self.smooth_kernel, int) and self.smooth_kernel >= 1 and self.smooth_kernel % 2 == 1):
            raise ValueError(f"smooth_kernel must be an odd positive int, got {self.smooth_kernel!r}")
        if self.js_reduce not in ("mean", "max"):
            raise ValueError(f"js_reduce must be 'mean' or 'max', got {self.js_reduce!r}")


@dataclass
class ChunkReport:
    """What EMLoC did to one chunk.

    Attributes:
        num_tokens: tokens in the chunk; num_answer: its answer tokens.
        ratios: per layer the accepted keep ratio (1.0 = layer kept whole).
        js: per layer the JS divergence at the answer tokens of the configuration in force after that layer's
            decision (layers above already pruned); every value is at most ``delta``.
        kept: per layer the chunk tokens kept per KV head.
    """

    num_tokens: int
    num_answer: int
    ratios: list[float] = field(default_factory=list)
    js: list[float] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)


def _emloc_hide(cache: KVCache, obs: Observation, chunk_keep: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """Per layer ``(B, H_kv, Q, S_l)``: hidden slots for the answer queries, given kept chunk slots per layer."""
    n, qi = obs.num_new, obs.query_index
    out = []
    for layer, keep in zip(cache.layers, chunk_keep):
        B, H, S = layer.k.shape[:3]
        start = S - n
        vis = layer.visible()  # (B, H, S)
        if keep is not None:
            chunk_vis = torch.zeros(B, H, n, dtype=torch.bool, device=vis.device).scatter_(2, keep, True)
            vis = torch.cat([vis[..., :start], vis[..., start:] & chunk_vis], dim=-1)
        after = torch.arange(S, device=vis.device)[None, :] > (start + qi.to(vis.device))[:, None]  # (Q, S)
        out.append(~vis[:, :, None, :] | after[None, None])
    return out


def policy_emloc(
    cache: KVCache,
    budget: None = None,
    obs: Observation | None = None,
    *,
    model: Decoder,
    config: EMLoCConfig | None = None,
    report: ChunkReport | None = None,
    keep_mask: torch.Tensor | None = None,
) -> Indices:
    """EMLoC on the last prefilled chunk (see module docs); ``obs`` from :func:`observe` with the chunk's
    answer tokens as ``query_index``. Slots before the chunk are kept as they are. ``report`` (optional) is
    filled with the per-layer decisions. ``keep_mask`` (bool ``(n,)``, optional) names the chunk tokens that are
    always kept; default: the answer tokens."""
    if budget is not None:
        raise ValueError(f"emloc has no token budget (its bound is EMLoCConfig.delta); pass budget=None, got {budget!r}")
    cfg = config or EMLoCConfig()
    for what in ("attentions", "query_index", "num_new", "logits", "query_embeds", "query_pos"):
        _need(obs, what, "emloc")
    n, qi = obs.num_new, obs.query_index.cpu()
    L = cache.num_layers
    answer = torch.zeros(n, dtype=torch.bool)
    answer[qi] = True
    if keep_mask is not None:
        keep_mask = torch.as_tensor(keep_mask).bool().reshape(-1).cpu()
        if keep_mask.numel() != n:
            raise ValueError(f"keep_mask has {keep_mask.numel()} entries for {n} chunk tokens")
        answer = keep_mask
    n_ans = int(answer.sum())
    layers_kv = [(l.k, l.v) for l in cache.layers]

    def js_of(chunk_keep) -> float:
        logits = replay_logits(model, layers_kv, _emloc_hide(cache, obs, chunk_keep), obs.query_embeds, obs.query_pos)
        js = js_divergence(obs.logits, logits)
        return float(js.mean() if cfg.js_reduce == "mean" else js.max())

    chunk_keep: list[torch.Tensor | None] = [None] * L
    ratios, js_log, kept = [1.0] * L, [0.0] * L, [n] * L
    current = 0.0
    for i in reversed(range(L)):
        layer = cache.layers[i]
        H = layer.k.shape[1]
        imp = importance(obs.attentions[i][..., -n:], H)  # (B, H_kv, n) attention the answers give chunk tokens
        imp = _pool(imp, cfg.smooth_kernel, "avg")
        score = imp.masked_fill(answer.to(imp.device)[None, None], float("inf"))
        vis = layer.visible()[..., -n:]
        for r in cfg.ratios:
            k = max(n_ans, math.ceil(r * n))
            if k >= n:
                break
            cand = _topk_slots(score, vis, k)  # (B, H_kv, k) chunk-relative
            trial = list(chunk_keep)
            trial[i] = cand
            js = js_of(trial)
            if js <= cfg.delta:
                chunk_keep, ratios[i], kept[i], current = trial, r, k, js
                break
        js_log[i] = current
    if report is not None:
        report.num_tokens, report.num_answer = n, n_ans
        report.ratios, report.js, report.kept = ratios, js_log, kept
    out: Indices = []
    for layer, keep in zip(cache.layers, chunk_keep):
        if keep is None:
            out.append(None)
            continue
        B, H, S = layer.k.shape[:3]
        prior = torch.arange(S - n, device=keep.device)[None, None].expand(B, H, -1)
        out.append(torch.cat([prior, keep + (S - n)], dim=-1))
    return out


#: The registry: name -> ``policy(cache, budget, obs, **options) -> indices per layer``.
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


@dataclass(kw_only=True)
class Chunk:
    """One chunk of demonstrations for :func:`emloc_compress`.

    Attributes:
        input_ids: ``(B, S)`` token ids, or inputs_embeds ``(B, S, dim)`` (e.g. with image embeddings).
        answer_mask: bool ``(S,)``, True = answer token (its attention scores importance, its output distribution
            is what the JS bound protects, and it is always kept).
        position_ids: optional ``(S,)``/``(B, S)`` positions; default continues after the memory.
        keep_mask: optional bool ``(S,)``: the tokens always kept, when they are not the answer tokens (e.g. a host
            whose label token follows the position that predicts it).
    """

    input_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None
    answer_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None


def chunk_demonstrations(demos: list[tuple[torch.Tensor, torch.Tensor]], per_chunk: int) -> list[Chunk]:
    """Concatenate demonstrations ``(ids (S_i,), answer_mask (S_i,))`` into chunks of ``per_chunk`` demos (B = 1)."""
    if not (isinstance(per_chunk, int) and per_chunk >= 1):
        raise ValueError(f"per_chunk must be a positive int, got {per_chunk!r}")
    chunks = []
    for s in range(0, len(demos), per_chunk):
        part = demos[s : s + per_chunk]
        ids = torch.cat([torch.as_tensor(d[0]).long().reshape(-1) for d in part])[None]
        ans = torch.cat([torch.as_tensor(d[1]).bool().reshape(-1) for d in part])
        chunks.append(Chunk(input_ids=ids, answer_mask=ans))
    return chunks


@dataclass
class EMLoCResult:
    """The compressed prefix (reuse it for every query, or ``cache.save``) and one report per chunk."""

    cache: KVCache
    reports: list[ChunkReport]


@torch.no_grad()
def emloc_compress(
    model: Decoder,
    chunks: list[Chunk],
    *,
    cache: KVCache | None = None,
    config: EMLoCConfig | None = None,
    progress: Callable[[int, ChunkReport], None] | None = None,
) -> EMLoCResult:
    """EMLoC over many demonstrations: prefill each chunk after the compressed memory so far (positions
    continue; kept tokens keep their positions), then prune its tokens with :func:`policy_emloc`.

    Args:
        model: the decoder.
        chunks: demonstration chunks (see :class:`Chunk`, :func:`chunk_demonstrations`); each needs at least
            one answer token.
        cache: an optional prefix (e.g. a system prompt) kept as it is.
        config: pruning settings.
        progress: called after each chunk with its index and report.
    """
    cfg = config or EMLoCConfig()
    reports = []
    for c, chunk in enumerate(chunks):
        ans = torch.as_tensor(chunk.answer_mask).bool().reshape(-1)
        if not bool(ans.any()):
            raise ValueError(f"chunk {c} has no answer tokens (answer_mask is all False)")
        qi = ans.nonzero()[:, 0]
        out, obs = observe(
            model, chunk.input_ids, inputs_embeds=chunk.inputs_embeds, position_ids=chunk.position_ids, cache=cache,
            query_index=qi,
        )
        if obs.num_new != ans.numel():
            raise ValueError(f"chunk {c}: answer_mask has {ans.numel()} entries for {obs.num_new} tokens")
        report = ChunkReport(num_tokens=obs.num_new, num_answer=int(ans.sum()))
        cache = compress(out.cache, "emloc", None, obs, model=model, config=cfg, report=report, keep_mask=chunk.keep_mask)
        reports.append(report)
        logger.debug("emloc chunk %d: ratios %s, js %s", c, report.ratios, report.js)
        if progress is not None:
            progress(c, report)
    if cache is None:
        raise ValueError("emloc_compress needs at least one chunk or a cache")
    return EMLoCResult(cache=cache, reports=reports)
