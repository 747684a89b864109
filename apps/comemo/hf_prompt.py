"""Prompts for CoMemo on a transformers InternVL folder: one builder for answering and for training.

:func:`build_inputs` turns images and a question (and, for training, an answer) into the model's inputs the way the
folder itself says: its chat template (a converted release carries the release's conversation template, see
:mod:`apps.comemo.release`), its processor's tiling and normalisation, and the tile grid of every image, derived
with the processor's own grid rule so that RoPE-DHR ids match the crops. ``HFCoMemo.answer``/``HFCoMemo.prompt``
and the recipe (:mod:`apps.comemo.recipes.internvl`) all call it, so training sees the prompt inference builds.

Question text: ``<image>`` marks where each image goes (as in the release's ``chat``); without any, one
``<image>\\n`` per image is put before the question.

A folder without a processor (a tokenizer only) is tiled with :mod:`apps.comemo.tiling` (InternVL's rule) and
normalised with its ``preprocessor_config.json`` mean/std (ImageNet's without one); each image becomes
``<img>`` + its image tokens + ``</img>`` (the markers when the tokenizer has them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["Inputs", "build_inputs", "as_pil", "stop_token_ids", "IMAGE_PLACEHOLDER", "IMAGENET_MEAN", "IMAGENET_STD"]

IMAGE_PLACEHOLDER = "<image>"
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class Inputs:
    """One sample for :class:`apps.comemo.hf.HFCoMemo`.

    Attributes:
        input_ids: ``(1, S)`` prompt ids (and the answer's, when one was given).
        pixel_values: ``(views, 3, H, W)`` every image's tiles then its thumbnail, images in prompt order.
        image_grids: ``[[(rows, cols), ...]]`` of each image.
        labels: ``(1, S)`` the answer's ids and -100 elsewhere (None without an answer).
        text: the prompt text before the image tokens were expanded.
    """

    input_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grids: list[list[tuple[int, int]]]
    labels: torch.Tensor | None
    text: str


def as_pil(image):
    """A path, PIL image or ``(H, W[, 3])`` uint8 / [0, 1] float array as an RGB PIL image."""
    from PIL import Image

    if isinstance(image, (str, Path)):
        with Image.open(image) as im:
            return im.convert("RGB")
    if isinstance(image, np.ndarray):
        arr = image
        if arr.dtype != np.uint8:
            arr = (np.clip(arr, 0.0, 1.0) * 255).round().astype(np.uint8)
        return Image.fromarray(arr).convert("RGB")
    if hasattr(image, "convert"):
        return image.convert("RGB")
    raise ValueError(f"an image must be a path, a PIL image or an array, got {type(image).__name__}")


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _chat_template(processor):
    tok = _tokenizer(processor)
    return getattr(tok, "chat_template", None) or getattr(processor, "chat_template", None)


def _place_images(question: str, n: int) -> str:
    k = question.count(IMAGE_PLACEHOLDER)
    if k == 0:
        return IMAGE_PLACEHOLDER + "\n" if n == 1 else (IMAGE_PLACEHOLDER + "\n") * n
    if k != n:
        raise ValueError(f"the question has {k} {IMAGE_PLACEHOLDER} placeholders for {n} images")
    return ""


def _texts(processor, question: str, answer: str | None) -> tuple[str, str | None]:
    """Prompt text (generation prompt included) and the completion (answer + end of turn) by the chat template."""
    tok = _tokenizer(processor)
    if _chat_template(processor) is None:
        return question, None if answer is None else answer + (tok.eos_token or "")
    user = [{"role": "user", "content": question}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    if answer is None:
        return prompt, None
    full = tok.apply_chat_template(user + [{"role": "assistant", "content": answer}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template does not render an answered conversation as prompt + completion")
    return prompt, full[len(prompt):]


def _grid_rule(image_processor):
    """The processor's grid choice ``(width, height) -> (rows, cols)`` (None without tiling)."""
    if not getattr(image_processor, "crop_to_patches", False):
        return None
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    size = image_processor.size
    th, tw = (size["height"], size["width"]) if isinstance(size, dict) else (size.height, size.width)
    lo, hi = image_processor.min_patches, image_processor.max_patches

    def rule(width: int, height: int) -> tuple[int, int]:
        cols, rows = get_optimal_tiled_canvas((height, width), (th, tw), lo, hi)
        return rows, cols

    return rule


def _views(grid) -> int:
    return grid[0] * grid[1] + (1 if grid[0] * grid[1] > 1 else 0)


def _with_processor(processor, wrapped, text: str, images: list) -> tuple[torch.Tensor, torch.Tensor, list]:
    # the processor expands its own image token (InternVL: <IMG_CONTEXT>) into <img> + tokens + </img>
    text = text.replace(IMAGE_PLACEHOLDER, processor.image_token)
    out = processor(text=[text], images=images or None, return_tensors="pt")
    rule = _grid_rule(processor.image_processor)
    grids = [rule(im.width, im.height) if rule else (1, 1) for im in images]
    pv = out.get("pixel_values")
    n_views = 0 if pv is None else pv.shape[0]
    if n_views != sum(_views(g) for g in grids):
        raise ValueError(f"the processor cut {n_views} views, the grids {grids} make {sum(_views(g) for g in grids)}")
    return out["input_ids"], pv, grids


def _norm_stats(folder: Path | None) -> tuple[tuple, tuple]:
    path = None if folder is None else Path(folder) / "preprocessor_config.json"
    if path is not None and path.is_file():
        cfg = json.loads(path.read_text())
        return tuple(cfg.get("image_mean", IMAGENET_MEAN)), tuple(cfg.get("image_std", IMAGENET_STD))
    return IMAGENET_MEAN, IMAGENET_STD


def _with_tokenizer(tok, wrapped, text: str, images: list, *, max_tiles: int, folder) -> tuple:
    from apps.comemo.tiling import tile_image

    size = wrapped.model.config.vision_config.image_size
    size = int(size[0] if isinstance(size, (list, tuple)) else size)
    T2 = wrapped.tokens_per_side ** 2
    vocab = tok.get_vocab()
    start, end = vocab.get("<img>"), vocab.get("</img>")
    mean, std = _norm_stats(folder)
    views, grids, ids = [], [], []
    parts = text.split(IMAGE_PLACEHOLDER)
    for k, part in enumerate(parts):
        ids += tok(part, add_special_tokens=(k == 0))["input_ids"] if part or k == 0 else []
        if k < len(images):
            lay = tile_image(images[k], size, min_tiles=1, max_tiles=max_tiles)
            grids.append(lay.grid)
            v = lay.tiles + ([lay.thumbnail] if lay.thumbnail is not None else [])
            views.extend(v)
            ids += ([start] if start is not None else []) + [wrapped.image_token_id] * (len(v) * T2)
            ids += [end] if end is not None else []
    pv = None
    if views:
        arr = np.stack(views).astype(np.float32) / 255.0  # (N, H, W, 3)
        arr = (arr - np.asarray(mean, dtype=np.float32)) / np.asarray(std, dtype=np.float32)
        pv = torch.from_numpy(arr).permute(0, 3, 1, 2).contiguous()
    return torch.tensor([ids]), pv, grids


def build_inputs(wrapped, images, question: str, *, answer: str | None = None, max_tiles: int = 12,
                 folder=None) -> Inputs:
    """The inputs of one sample (see module docs).

    Args:
        wrapped: an :class:`apps.comemo.hf.HFCoMemo` (its processor, image token and tokens per tile are used).
        images: paths, PIL images or arrays, in prompt order.
        question: the user's text (``<image>`` placeholders optional).
        answer: for training: the reply; ``labels`` then cover it and the end of the turn.
        max_tiles: most tiles per image on the tokenizer-only path (the processor's own setting otherwise).
        folder: the model folder (normalisation statistics on the tokenizer-only path).
    """
    if not isinstance(question, str) or not question.strip():
        raise ValueError("question must be a non-empty string")
    processor = wrapped.processor
    if processor is None:
        raise ValueError("this model folder has no tokenizer or processor; CoMemo needs one to build prompts")
    pil = [as_pil(im) for im in (images if isinstance(images, (list, tuple)) else [images])]
    question = _place_images(question, len(pil)) + question
    prompt, completion = _texts(processor, question, answer)
    tok = _tokenizer(processor)
    if hasattr(processor, "image_processor") and hasattr(processor, "image_seq_length"):
        if processor.image_seq_length != wrapped.tokens_per_side ** 2:
            raise ValueError(f"the processor expands an image tile to {processor.image_seq_length} tokens, the model "
                             f"reads {wrapped.tokens_per_side ** 2}")
        ids, pv, grids = _with_processor(processor, wrapped, prompt, pil)
    else:
        ids, pv, grids = _with_tokenizer(tok, wrapped, prompt, pil, max_tiles=max_tiles, folder=folder)
    labels = None
    if completion is not None:
        extra = torch.tensor([tok(completion, add_special_tokens=False)["input_ids"]], dtype=ids.dtype)
        labels = torch.cat([torch.full_like(ids, -100), extra], dim=1)
        ids = torch.cat([ids, extra], dim=1)
    return Inputs(input_ids=ids, pixel_values=pv, image_grids=[grids], labels=labels, text=prompt)


def stop_token_ids(wrapped) -> list[int]:
    """Ids that end an answer: the tokenizer's end token, ``<|im_end|>`` when it has one, the generation config's."""
    tok = _tokenizer(wrapped.processor)
    out = set()
    if getattr(tok, "eos_token_id", None) is not None:
        out.add(int(tok.eos_token_id))
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        out.add(int(im_end))
    gen = getattr(wrapped.model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    for e in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if e is not None:
            out.add(int(e))
    return sorted(out)
