"""Inputs of the CoMemo model: image loading and checks, tiling, token sequences and position ids.

:func:`build_batch` turns examples ``(images, question, answer)`` into a :class:`Batch`: the tiles of every
image, the decoder's token ids with image slots (context path), the position ids of the variant, the memory
(all image tokens, memory path) with its position ids, the padding masks and the labels (answer tokens).

Sequence of one example (context variants): ``<s>``, then for each ``<image>`` of the prompt that image's
tokens (tiles row-major then thumbnail, ``T*T`` tokens each; ``cfg.image_labels`` puts the text label
``image K`` before or after image K), then the question, then the answer and ``</s>``. The flamingo variant keeps the ``<image>`` token as a marker instead.

Positions: ``lvlm-1d`` and ``flamingo`` count every sequence token (0, 1, 2, ...); ``lvlm-dhr`` and
``comemo`` give an image's tokens RoPE-DHR ids starting at the current position (``T*T`` ids per image) and
continue after them. Memory keys take the same RoPE-DHR ids (``comemo``) or their marker's position
(``flamingo``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from apps.comemo.model import CoMemoConfig, normalise_tiles
from apps.comemo.tiling import tile_image
from apps.comemo.tokenizer import CoMemoTokenizer
from core.infra.fileio import open_image
from core.rope import rope_dhr_position_ids

__all__ = ["Batch", "Example", "load_image", "build_batch"]

Example = tuple  # (images: list, question: str, answer: str | None[, label_start: int]) (label_start: first image label)


@dataclass
class Batch:
    """One padded batch (``B`` examples, ``S`` tokens, ``M`` memory tokens, ``N`` tiles).

    Attributes:
        tiles: ``(N, 3, tile, tile)`` normalised tiles of every image of the batch, image by image.
        input_ids: ``(B, S)`` int64; image slots hold ``<img_ctx>``, padding ``<pad>``.
        image_slot: ``(B, S)`` int64 index of the image token (flat over the batch) at each slot, -1 for text.
        position_ids: ``(B, S)`` int64 RoPE positions.
        padding_mask: ``(B, S)`` bool, True = padded.
        labels: ``(B, S)`` int64 target token at each position (-100 = no loss); the loss compares the
            logits at ``t`` with ``labels[t + 1]``.
        memory_index: ``(B, M)`` int64 image-token index of each memory slot, -1 = padded (None: no memory).
        memory_position_ids: ``(B, M)`` int64 RoPE positions of the memory keys.
        prompt_lengths: tokens before the answer, per example.
        image_spans: per example, ``(start, end)`` sequence slots of each image (context path) or of its
            marker (flamingo).
    """

    tiles: torch.Tensor
    input_ids: torch.Tensor
    image_slot: torch.Tensor
    position_ids: torch.Tensor
    padding_mask: torch.Tensor
    labels: torch.Tensor
    memory_index: torch.Tensor | None
    memory_position_ids: torch.Tensor | None
    prompt_lengths: list[int]
    image_spans: list[list[tuple[int, int]]]

    def to(self, device) -> Batch:
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return Batch(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


def load_image(image, *, max_pixels: int, index: int = 0) -> np.ndarray:
    """A path, PIL image or array -> RGB uint8 ``(H, W, 3)``; clear errors for bad or oversized input."""
    what = f"image {index}"
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        what = f"image {index} ({path})"
        if not path.is_file():
            raise FileNotFoundError(f"{what}: no such file")
        if path.stat().st_size == 0:
            raise ValueError(f"{what}: the file is empty")
        with open_image(path, what=f"image {index} as PNG, JPEG or another format Pillow reads",
                        max_pixels=max_pixels) as im:
            image = im.convert("RGB")
    if isinstance(image, Image.Image):
        _check_pixels(image.width, image.height, max_pixels, what)
        return np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        arr = image
        if arr.ndim == 2:
            arr = np.repeat(arr[..., None], 3, axis=-1)
        if arr.ndim != 3 or arr.shape[-1] not in (3, 4) or arr.shape[0] == 0 or arr.shape[1] == 0:
            raise ValueError(f"{what}: an array must be (H, W), (H, W, 3) or (H, W, 4), got shape {image.shape}")
        _check_pixels(arr.shape[1], arr.shape[0], max_pixels, what)
        if arr.dtype != np.uint8:
            if not np.issubdtype(arr.dtype, np.floating) or not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 1:
                raise ValueError(f"{what}: arrays must be uint8, or float in [0, 1]; got {arr.dtype}")
            arr = (arr * 255).round().astype(np.uint8)
        return np.ascontiguousarray(arr[..., :3])
    raise ValueError(f"{what}: expected a file path, PIL image or numpy array, got {type(image).__name__}")


def _check_pixels(w: int, h: int, max_pixels: int, what: str) -> None:
    if w * h > max_pixels:
        raise ValueError(f"{what} has {w}x{h} = {w * h} pixels, above the limit of {max_pixels} (max_pixels)")


def build_batch(examples: list[Example], tok: CoMemoTokenizer, cfg: CoMemoConfig, *, label_prompt: bool = False) -> Batch:
    """Tile, tokenise and lay out ``examples`` for ``cfg.variant`` (see module docs).

    Args:
        examples: ``(images, question, answer)`` triples; ``answer=None`` for a prompt to continue; an optional
            fourth item numbers the image labels from there (``cfg.image_labels``; default 1).
        tok: the tokenizer.
        cfg: model config (variant, tiling, limits).
        label_prompt: also put the prompt's text tokens in the labels (text-only language-model stage).
    """
    v = cfg.vision
    T2 = v.tokens_per_side ** 2
    all_tiles: list[np.ndarray] = []
    seqs = []
    n_img_tokens = 0
    for e, (images, question, answer, *rest) in enumerate(examples):
        label_start = rest[0] if rest else 1
        if len(images) > cfg.max_images:
            raise ValueError(f"example {e} has {len(images)} images; the model takes at most {cfg.max_images} (max_images)")
        prompt, ans = tok.encode_example(len(images), question, answer, image_labels=cfg.image_labels,
                                         label_start=label_start)
        ids, slots, pos, labels, spans, mem_idx, mem_pos = [], [], [], [], [], [], []
        p = 0
        k = 0
        for t in prompt:
            if t != tok.image_id:
                ids.append(t), slots.append(-1), pos.append(p)
                labels.append(t if label_prompt and t != tok.bos_id else -100)
                p += 1
                continue
            img = load_image(images[k], max_pixels=cfg.max_pixels, index=k)
            lay = tile_image(img, v.tile, min_tiles=cfg.min_tiles, max_tiles=cfg.max_tiles)
            tiles = lay.tiles + ([lay.thumbnail] if lay.thumbnail is not None else [])
            all_tiles.extend(tiles)
            n_tok = len(tiles) * T2
            index = list(range(n_img_tokens, n_img_tokens + n_tok))
            n_img_tokens += n_tok
            if cfg.uses_dhr or cfg.variant == "flamingo":
                tile_ids, thumb_ids = rope_dhr_position_ids(lay.grid, v.tokens_per_side, v.tokens_per_side, start=p)
                dhr = thumb_ids.tolist() if lay.thumbnail is None else tile_ids.flatten().tolist() + thumb_ids.tolist()
            if cfg.uses_context:
                img_pos = dhr if cfg.uses_dhr else list(range(p, p + n_tok))
                spans.append((len(ids), len(ids) + n_tok))
                ids += [tok.img_ctx_id] * n_tok
                slots += index
                pos += img_pos
                labels += [-100] * n_tok
                if cfg.uses_memory:
                    mem_idx += index
                    mem_pos += img_pos
                p += T2 if cfg.uses_dhr else n_tok
            else:  # flamingo: the marker stays in the text; memory keys sit at the marker's position
                spans.append((len(ids), len(ids) + 1))
                ids.append(t), slots.append(-1), pos.append(p), labels.append(-100)
                mem_idx += index
                mem_pos += [p] * n_tok
                p += 1
            k += 1
        prompt_len = len(ids)
        for t in ans:
            ids.append(t), slots.append(-1), pos.append(p), labels.append(t)
            p += 1
        if len(ids) > cfg.max_context:
            raise ValueError(
                f"example {e} needs {len(ids)} tokens (images and text); the context holds {cfg.max_context} (max_context)"
            )
        seqs.append((ids, slots, pos, labels, mem_idx, mem_pos, prompt_len, spans))
    B = len(seqs)
    if B == 0:
        raise ValueError("build_batch needs at least one example")
    S = max(len(s[0]) for s in seqs)
    M = max(len(s[4]) for s in seqs)
    input_ids = torch.full((B, S), tok.pad_id, dtype=torch.long)
    image_slot = torch.full((B, S), -1, dtype=torch.long)
    position_ids = torch.zeros((B, S), dtype=torch.long)
    padding_mask = torch.ones((B, S), dtype=torch.bool)
    labels = torch.full((B, S), -100, dtype=torch.long)
    memory_index = torch.full((B, M), -1, dtype=torch.long) if cfg.uses_memory else None
    memory_pos = torch.zeros((B, M), dtype=torch.long) if cfg.uses_memory else None
    for b, (ids, slots, pos, lab, mi, mp, _, _) in enumerate(seqs):
        n = len(ids)
        input_ids[b, :n] = torch.tensor(ids)
        image_slot[b, :n] = torch.tensor(slots)
        position_ids[b, :n] = torch.tensor(pos)
        padding_mask[b, :n] = False
        labels[b, :n] = torch.tensor(lab)
        if memory_index is not None and mi:
            memory_index[b, :len(mi)] = torch.tensor(mi)
            memory_pos[b, :len(mp)] = torch.tensor(mp)
    if all_tiles:
        tiles = normalise_tiles(torch.from_numpy(np.stack(all_tiles)))
    else:
        tiles = torch.zeros(0, 3, v.tile, v.tile)
    return Batch(tiles=tiles, input_ids=input_ids, image_slot=image_slot, position_ids=position_ids,
                 padding_mask=padding_mask, labels=labels, memory_index=memory_index, memory_position_ids=memory_pos,
                 prompt_lengths=[s[6] for s in seqs], image_spans=[s[7] for s in seqs])
