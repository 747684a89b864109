"""What KV-cache compression policies read besides the cache: attention probes of the prefill
(:class:`Observation`, :func:`observe`), token importance per KV head, and the slot-selection helpers the
policies of :mod:`core.kv_compress` and :mod:`core.kv_emloc` share."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from core.decoder import Decoder, DecoderOutput, KVCache

logger = logging.getLogger(__name__)

__all__ = ["Indices", "Observation", "observe", "importance"]


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
        protect: bool ``(B, S)`` over the slots of an unpruned cache, True = always kept: every budgeted policy
            ranks these slots first (e.g. the demonstrations' answer tokens, which EMLoC always keeps), and the rest
            of the budget goes by the policy's own ranking.
    """

    attentions: list[torch.Tensor] | None = None
    query_index: torch.Tensor | None = None
    num_new: int | None = None
    logits: torch.Tensor | None = None
    query_embeds: torch.Tensor | None = None
    query_pos: torch.Tensor | None = None
    image_mask: torch.Tensor | None = None
    protect: torch.Tensor | None = None


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


def _protected(score_BHS: torch.Tensor, obs: Observation | None) -> torch.Tensor:
    """``score`` with the slots of ``obs.protect`` (if any) ranked first."""
    protect = None if obs is None else obs.protect
    if protect is None:
        return score_BHS
    protect = torch.as_tensor(protect).bool().to(score_BHS.device)
    if protect.shape[-1] != score_BHS.shape[-1]:
        raise ValueError(f"Observation.protect covers {protect.shape[-1]} slots, the layer holds {score_BHS.shape[-1]} "
                         "(protect applies to an unpruned cache)")
    return score_BHS.float().masked_fill(protect.reshape(-1, 1, protect.shape[-1]), float("inf"))


def _per_layer(cache: KVCache, budget: int, score_fn: Callable[[int, torch.Tensor], torch.Tensor],
               obs: Observation | None = None) -> Indices:
    """Top-``budget`` slots per head from ``score_fn(layer, visible_BHS) -> (B, H|1, S)`` (``obs.protect`` first);
    None when it all fits."""
    out: Indices = []
    for i, layer in enumerate(cache.layers):
        vis = layer.visible()
        if int(vis.sum(-1).max()) <= budget:
            out.append(None)
            continue
        score = _protected(score_fn(i, vis).expand_as(vis), obs)
        out.append(_topk_slots(score, vis, budget))
    return out


def _slot_rank(layer_len: int, device) -> torch.Tensor:
    return torch.arange(layer_len, device=device, dtype=torch.float32)


