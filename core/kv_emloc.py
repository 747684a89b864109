"""EMLoC's training-free compression of many demonstrations: chunk by chunk, each layer pruned to the smallest
keep ratio whose output distribution at the chunk's answer tokens stays within a Jensen–Shannon bound
(policy ``"emloc"`` of :mod:`core.kv_compress`; :func:`emloc_compress` over many demonstrations)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from core.attention import attention
from core.decoder import Decoder, KVCache
from core.kv_cache import LayerKV
from core.kv_observe import Indices, Observation, _need, _pool, _topk_slots, importance, observe

logger = logging.getLogger(__name__)

__all__ = ["js_divergence", "replay_logits", "EMLoCConfig", "ChunkReport", "policy_emloc", "policy_emloc_suffix",
           "suffix_observe", "Chunk", "chunk_demonstrations", "EMLoCResult", "emloc_compress"]


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
    layers_kv = [(l.k, l.v) for l in cache.layers]

    def js_of(chunk_keep) -> float:
        logits = replay_logits(model, layers_kv, _emloc_hide(cache, obs, chunk_keep), obs.query_embeds, obs.query_pos)
        js = js_divergence(obs.logits, logits)
        return float(js.mean() if cfg.js_reduce == "mean" else js.max())

    imps = [importance(obs.attentions[i][..., -n:], cache.layers[i].k.shape[1]) for i in range(L)]  # answers -> chunk
    return _search(cache, n, imps, answer, js_of, cfg, report)


def _search(cache: KVCache, n: int, imps: list[torch.Tensor], keep: torch.Tensor, js_of, cfg: EMLoCConfig,
            report: ChunkReport | None) -> Indices:
    """Layer by layer from the top: the smallest ratio of ``cfg.ratios`` whose ``js_of(chunk_keep)`` is at most
    ``cfg.delta`` (top-k per KV head of the pooled importance ``imps[l]`` ``(B, H_kv, n)``, ``keep`` ranked
    first), else the layer whole. Returns the indices for :meth:`KVCache.select` (slots before the chunk kept)."""
    L = cache.num_layers
    n_keep = int(keep.sum())
    chunk_keep: list[torch.Tensor | None] = [None] * L
    ratios, js_log, kept = [1.0] * L, [0.0] * L, [n] * L
    current = 0.0
    for i in reversed(range(L)):
        layer = cache.layers[i]
        imp = _pool(imps[i], cfg.smooth_kernel, "avg")
        score = imp.masked_fill(keep.to(imp.device)[None, None], float("inf"))
        vis = layer.visible()[..., -n:]
        for r in cfg.ratios:
            k = max(n_keep, math.ceil(r * n))
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
        report.num_tokens, report.num_answer = n, n_keep
        report.ratios, report.js, report.kept = ratios, js_log, kept
    return _with_prior(cache, n, chunk_keep)


def _with_prior(cache: KVCache, n: int, chunk_keep: list[torch.Tensor | None]) -> Indices:
    out: Indices = []
    for layer, keep in zip(cache.layers, chunk_keep):
        if keep is None:
            out.append(None)
            continue
        B, H, S = layer.k.shape[:3]
        prior = torch.arange(S - n, device=keep.device)[None, None].expand(B, H, -1)
        out.append(torch.cat([prior, keep + (S - n)], dim=-1))
    return out


def _expand(cache: KVCache, N: int) -> KVCache:
    """The cache repeated over a batch of ``N`` (views)."""
    return KVCache(layers=[LayerKV(l.k.expand(N, -1, -1, -1), l.v.expand(N, -1, -1, -1), l.pos.expand(N, -1),
                                   None if l.mask is None else l.mask.expand(N, -1, -1)) for l in cache.layers],
                   next_pos=cache.next_pos.expand(N))


@torch.no_grad()
def suffix_observe(model: Decoder, cache: KVCache, suffix_embeds: torch.Tensor, suffix_answer: torch.Tensor,
                   *, probes: bool = False):
    """Each row of ``suffix_embeds`` ``(N, S_s, dim)`` encoded on its own after ``cache`` (B = 1), at the positions
    after it; returns ``(logits (N, Q, vocab) at the answer positions, attentions per layer (N, H_q, Q, S_l + S_s)
    or None)``."""
    N, S_s, _ = suffix_embeds.shape
    qi = torch.as_tensor(suffix_answer).bool().reshape(-1).nonzero()[:, 0]
    pos = (cache.next_pos[:1].to(suffix_embeds.device) + torch.arange(S_s, device=suffix_embeds.device))[None].expand(N, -1)
    out = model(inputs_embeds=suffix_embeds, position_ids=pos, cache=_expand(cache, N), use_cache=False,
                attn_queries=qi if probes else None, logits_index=qi)
    return out.logits, out.attentions


def policy_emloc_suffix(cache: KVCache, n: int, *, model: Decoder, suffix_embeds: torch.Tensor,
                        suffix_answer: torch.Tensor, keep_mask: torch.Tensor, config: EMLoCConfig | None = None,
                        report: ChunkReport | None = None) -> Indices:
    """EMLoC with the reference's observers: the chunk (the last ``n`` slots of ``cache``) is scored by each of its
    demonstrations re-encoded as a suffix after it (``suffix_embeds`` rows, observers at ``suffix_answer``), whose
    attention to the chunk is normalised over the chunk and suffix keys (the earlier memory left out); the JS bound
    is measured on the suffixes' answer outputs. ``keep_mask`` (bool ``(n,)``) names the always-kept tokens."""
    cfg = config or EMLoCConfig()
    keep_mask = torch.as_tensor(keep_mask).bool().reshape(-1).cpu()
    if keep_mask.numel() != n:
        raise ValueError(f"keep_mask has {keep_mask.numel()} entries for {n} chunk tokens")
    base, atts = suffix_observe(model, cache, suffix_embeds, suffix_answer, probes=True)
    imps = []
    for layer, a in zip(cache.layers, atts):
        S = len(layer)
        part = a[..., S - n :].float()
        chunk = part[..., :n] / part.sum(-1, keepdim=True).clamp_min(1e-30)  # (N, H_q, Q, n)
        Nb, Hq, Q, _ = chunk.shape
        imps.append(importance(chunk.permute(1, 0, 2, 3).reshape(1, Hq, Nb * Q, n), layer.k.shape[1]))

    def js_of(chunk_keep) -> float:
        logits, _ = suffix_observe(model, cache.select(_with_prior(cache, n, chunk_keep)), suffix_embeds, suffix_answer)
        js = js_divergence(base, logits)
        return float(js.mean() if cfg.js_reduce == "mean" else js.max())

    return _search(cache, n, imps, keep_mask, js_of, cfg, report)


#: The registry: name -> ``policy(cache, budget, obs, **options) -> indices per layer``.
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
        suffix_embeds: optional ``(N, S_s, dim)``: the chunk's demonstrations re-encoded one per row, each as a
            suffix after the chunk (the reference's observers, :func:`policy_emloc_suffix`); with
            ``suffix_answer`` (bool ``(S_s,)``, the observed positions in a row). None: the chunk's own answer
            tokens observe it causally (the default).
    """

    input_ids: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None
    answer_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    keep_mask: torch.Tensor | None = None
    suffix_embeds: torch.Tensor | None = None
    suffix_answer: torch.Tensor | None = None


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
        if chunk.suffix_embeds is not None:
            keep = ans if chunk.keep_mask is None else chunk.keep_mask
            cache = out.cache.select(policy_emloc_suffix(out.cache, obs.num_new, model=model, config=cfg, report=report,
                                                         suffix_embeds=chunk.suffix_embeds, keep_mask=keep,
                                                         suffix_answer=chunk.suffix_answer))
        else:
            cache = out.cache.select(policy_emloc(out.cache, None, obs, model=model, config=cfg, report=report,
                                                  keep_mask=chunk.keep_mask))
        reports.append(report)
        logger.debug("emloc chunk %d: ratios %s, js %s", c, report.ratios, report.js)
        if progress is not None:
            progress(c, report)
    if cache is None:
        raise ValueError("emloc_compress needs at least one chunk or a cache")
    return EMLoCResult(cache=cache, reports=reports)
