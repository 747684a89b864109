"""Explicit position ids through prefill and decode, Qwen2-VL's 3-D M-RoPE ids included.

After a cache is pruned, its length no longer says where the next token sits; transformers would then number new
tokens from the cache length. These helpers pass ``position_ids`` (and a matching all-ones ``attention_mask``, so
that gaps in the ids are never read as packed sequences) on every call:

* :func:`mrope_position_ids` — a Qwen2-VL-family model's own 3-D ids ``(3, B, S)`` for a multimodal prompt, and
  the next text position per row (``max + 1``).
* :func:`prefill` — a forward over a prompt (optionally after a cache) at given positions.
* :func:`greedy_decode` — greedy tokens with the cache, each step at the next explicit position.

Text tokens carry the same id on all three M-RoPE axes, so decode positions are ``(B, 1)``: Qwen2-VL expands 2-D
ids to its three axes itself.
"""

from __future__ import annotations

import torch

__all__ = ["mrope_position_ids", "prefill", "greedy_decode", "next_positions"]


def _rope_index_owner(model):
    for obj in (model, getattr(model, "model", None)):
        if obj is not None and hasattr(obj, "get_rope_index"):
            return obj
    raise ValueError(f"{type(model).__name__} has no get_rope_index (not an M-RoPE model); use 1-D position ids")


def next_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """The next free text position per row, ``(B,)``: ``max + 1`` over every axis and token of ``position_ids``
    (``(B, S)`` or ``(3, B, S)``)."""
    if position_ids.dim() == 3:
        return position_ids.amax(dim=(0, 2)) + 1
    return position_ids.amax(dim=1) + 1


def mrope_position_ids(
    model,
    input_ids: torch.Tensor,
    *,
    mm_token_type_ids: torch.Tensor | None = None,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own M-RoPE ids ``(3, B, S)`` for a prompt, and the next text position ``(B,)``.

    Takes what the model's processor returns (``input_ids``, ``mm_token_type_ids``, ``image_grid_thw``, ...).
    """
    owner = _rope_index_owner(model)
    if mm_token_type_ids is None:
        mm_token_type_ids = torch.zeros_like(input_ids, dtype=torch.int)
        cfg = getattr(model, "config", None)
        for attr, value in (("image_token_id", 1), ("video_token_id", 2)):
            tok = getattr(cfg, attr, None)
            if tok is not None:
                mm_token_type_ids[input_ids == tok] = value
    pos, _ = owner.get_rope_index(input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw,
                                  video_grid_thw=video_grid_thw, attention_mask=attention_mask)  # fmt: skip
    if attention_mask is not None:
        pos = pos.masked_fill(~attention_mask.bool()[None], 0)
    return pos, next_positions(pos if attention_mask is None else pos.masked_fill(~attention_mask.bool()[None], -1))


def _cache_len(cache) -> int:
    return 0 if cache is None else int(cache.get_seq_length())


def prefill(
    model,
    *,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    cache=None,
    attention_mask: torch.Tensor | None = None,
    **inputs,
):
    """One forward with the cache at explicit positions; returns the model output (``.logits``,
    ``.past_key_values``).

    Args:
        input_ids / inputs_embeds: the new tokens ``(B, S)`` / ``(B, S, D)``.
        position_ids: ``(B, S)`` or ``(3, B, S)``; None: the model's default numbering.
        cache: a cache to continue after (it grows in place), or None for a fresh one.
        attention_mask: ``(B, cache length + S)``, 1 = real token; default all ones (gaps in ``position_ids``
            are then never read as packed sequences).
        inputs: other model inputs (``pixel_values``, ``image_grid_thw``, ...).
    """
    ref = input_ids if input_ids is not None else inputs_embeds
    B, S = ref.shape[:2]
    if attention_mask is None:
        attention_mask = torch.ones(B, _cache_len(cache) + S, dtype=torch.long, device=ref.device)
    if cache is None:
        from transformers import DynamicCache

        cache = DynamicCache(config=model.config)
    return model(input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids, past_key_values=cache,
                 attention_mask=attention_mask, use_cache=True, **inputs)  # fmt: skip


@torch.no_grad()
def greedy_decode(
    model,
    cache,
    first_token: torch.Tensor,
    next_position: torch.Tensor,
    steps: int,
    *,
    attention_mask: torch.Tensor | None = None,
    stop_token_ids: list[int] | None = None,
) -> torch.Tensor:
    """Greedy tokens ``(B, steps)`` after ``first_token`` ``(B,)``, which sits at ``next_position`` ``(B,)``; each
    later token takes the next position. ``attention_mask`` ``(B, cache length)`` marks padded cache entries
    (default: none). Rows that emitted a stop token keep emitting it."""
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    tok = first_token.view(-1, 1)
    pos = next_position.view(-1, 1).to(tok.device)
    B = tok.shape[0]
    mask = attention_mask
    if mask is None:
        mask = torch.ones(B, _cache_len(cache), dtype=torch.long, device=tok.device)
    done = torch.zeros(B, dtype=torch.bool, device=tok.device)
    out = []
    for _ in range(steps):
        mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=mask.device)], dim=1)
        logits = model(input_ids=tok, position_ids=pos, past_key_values=cache, attention_mask=mask,
                       use_cache=True).logits[:, -1]  # fmt: skip
        nxt = logits.argmax(-1)
        if stop_token_ids:
            nxt = torch.where(done, tok.view(-1), nxt)
            done = done | torch.isin(nxt, torch.tensor(stop_token_ids, device=nxt.device))
        out.append(nxt)
        tok, pos = nxt.view(-1, 1), pos + 1
    return torch.stack(out, dim=1) if out else torch.zeros(B, 0, dtype=torch.long, device=tok.device)
