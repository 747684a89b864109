"""What a CoMemo model looks at: attention mass per image on both paths, and the RoPE-DHR id map of an image.

- :func:`attention_per_image`: for the last prompt token (the one that produces the first answer token), the
  attention probability mass on each image, averaged over heads and over the layers of each path: the context
  path's self-attention to the image's tokens in the sequence (tiles and thumbnail), and the memory path's
  gated cross-attention to the image's memory keys (reported before the gate: the gate's tanh scales the
  update, not the distribution).
- :func:`dhr_id_map`: the RoPE-DHR position id of every token of an image laid out where the token lies in the
  high-resolution grid, and the thumbnail's ids: the picture of how tiles share the thumbnail's ids.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from apps.comemo.batch import build_batch
from apps.comemo.model import CoMemoModel
from apps.comemo.tiling import tile_image
from apps.comemo.tokenizer import CoMemoTokenizer
from core.rope import rope_dhr_position_ids

__all__ = ["attention_per_image", "dhr_id_map"]


@torch.no_grad()
def attention_per_image(model: CoMemoModel, tok: CoMemoTokenizer, images: list, question: str) -> dict:
    """Attention mass of the last prompt token on each image, per path.

    Returns:
        ``{"context": [mass per image] or None, "memory": [mass per image] or None}``; ``context`` is None for
        the memory-only variant (``flamingo``), ``memory`` for the context-only ones. Context masses sum to at
        most 1 (the rest goes to text); memory masses sum to 1 over the images.
    """
    batch = build_batch([(images, question, None)], tok, model.cfg)
    q = batch.input_ids.shape[1] - 1
    kw = model.decoder_inputs(batch)
    captured: list[tuple] = []
    hooks = []
    if model.cfg.uses_memory:
        for block in model.decoder.cross.values():
            hooks.append(block.register_forward_pre_hook(
                lambda mod, args, kwargs: captured.append((mod, args, kwargs)), with_kwargs=True))
    try:
        out = model.decoder(**kw, use_cache=False, attn_queries=torch.tensor([q]) if model.cfg.uses_context else None,
                            logits_index=torch.tensor([q]))
    finally:
        for h in hooks:
            h.remove()
    result: dict = {"context": None, "memory": None}
    if model.cfg.uses_context:
        probs = torch.stack([a[0, :, 0].float() for a in out.attentions])  # (layers, H, S)
        mass = probs.mean(dim=(0, 1))
        result["context"] = [float(mass[s:e].sum()) for s, e in batch.image_spans[0]]
    if captured:
        # memory slots of each image: the images' tokens in order, as build_batch lays them out
        owner = _memory_owner(batch, model)
        per_layer = []
        for block, (x_BSD, ctx_BND), kwargs in captured:
            attn = block.attn
            qh = attn.project_q(block.norm1(x_BSD), rope=kwargs.get("q_rope"))[:, :, q]  # (B, H, d)
            k, _ = attn.project_kv(block.context_norm(ctx_BND), rope=kwargs.get("k_rope"))  # (B, Hk, M, d)
            k = k.repeat_interleave(attn.num_heads // attn.num_kv_heads, dim=1)
            logits = torch.einsum("bhd,bhmd->bhm", qh, k) / math.sqrt(qh.shape[-1])
            pad = kwargs.get("context_padding_mask")
            if pad is not None:
                logits = logits.masked_fill(pad[:, None, :], float("-inf"))
            per_layer.append(torch.softmax(logits.float(), dim=-1)[0].mean(0))  # (M,)
        mass = torch.stack(per_layer).mean(0)
        result["memory"] = [float(mass[owner == i].sum()) for i in range(len(images))]
    return result


def _memory_owner(batch, model: CoMemoModel) -> torch.Tensor:
    """``(M,)`` index of the image each memory slot belongs to."""
    T2 = model.cfg.vision.tokens_per_side ** 2
    sizes = []  # image tokens per image, from the tiles each image produced
    for s, e in batch.image_spans[0]:
        sizes.append(e - s)
    if not model.cfg.uses_context:  # flamingo: spans are the markers; count tokens from the memory positions
        pos = batch.memory_position_ids[0]
        marker_pos = [int(batch.position_ids[0, s]) for s, _ in batch.image_spans[0]]
        return torch.tensor([marker_pos.index(int(p)) for p in pos])
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    assert owner.numel() == batch.memory_index.shape[1] and all(n % T2 == 0 for n in sizes)
    return owner


def dhr_id_map(image, tile: int, tokens_per_side: int, *, min_tiles: int = 1, max_tiles: int = 6) -> dict:
    """The RoPE-DHR ids of one image (ids start at 0).

    Returns:
        ``{"grid": (rows, cols), "tiles": (rows*T, cols*T) int array of each tile token's id where the token
        lies, "thumbnail": (T, T) int array of the thumbnail's ids}`` (``T`` = ``tokens_per_side``).
    """
    lay = tile_image(image, tile, min_tiles=min_tiles, max_tiles=max_tiles)
    rows, cols = lay.grid
    T = tokens_per_side
    tile_ids, thumb_ids = rope_dhr_position_ids(lay.grid, T, T, start=0)
    full = np.zeros((rows * T, cols * T), dtype=np.int64)
    for t in range(rows * cols):
        r, c = divmod(t, cols)  # tiles are row-major, as cropped
        full[r * T:(r + 1) * T, c * T:(c + 1) * T] = tile_ids[t].reshape(T, T).numpy()
    return {"grid": lay.grid, "tiles": full, "thumbnail": thumb_ids.reshape(T, T).numpy()}
