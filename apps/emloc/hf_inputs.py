"""Demonstrations and queries for a transformers vision-language model, in the model's own chat format.

A demonstration is an image and its label text. It becomes one user turn (the image, then ``prompt``) and one
assistant turn (the label), rendered with the processor's chat template; the label text's tokens are the
demonstration's **answer tokens**. Turns are rendered one after another, as a conversation grows: the first
demonstration carries the template's header (a default system prompt, where the template adds one), every later
piece is what its two turns add to the conversation, and a query is a user turn with the generation prompt
(``<|im_start|>assistant`` for Qwen2-VL) after the demonstrations. A template that does not render turns
incrementally (its output for two turns does not begin with its output for the first) is refused.

Images: a path (read with Pillow), a ``PIL.Image``, or an ``(H, W, 3)`` uint8 array; converted to RGB. All
demonstrations must share one size, unless ``image_size=(width, height)`` is given (every image, queries too, is
then resized to it); queries must have the demonstrations' size.

Token ids come from the processor (text before the label, with the image expanded to its placeholder tokens) and
the tokenizer (the label, and the rest of the assistant turn), each piece tokenized on its own; spaces right before
the label belong to the label's piece (byte-level BPE merges a leading space into the word).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PROMPT", "Piece", "load_image", "demo_pieces", "suffix_pieces", "query_piece", "answer_ids", "embed", "positions",
           "language_model"]

#: The question of every demonstration and query unless another is given.
DEFAULT_PROMPT = "What is in the image?"


@dataclass
class Piece:
    """One tokenized demonstration or query.

    Attributes:
        input_ids: ``(S,)`` token ids.
        answer: bool ``(S,)``, True = a label token (empty for a query).
        observe: bool ``(S,)``, True = the answer span, as the reference marks it: the token before the label (it
            predicts the label's first token), every label token and the first token after the label (the
            template's end of turn, ``<|im_end|>`` for Qwen2-VL). EMLoC always keeps these tokens, and the JS bound
            protects the outputs at these positions.
        image: bool ``(S,)``, True = an image placeholder token.
        mm: the processor's image inputs for this piece (``pixel_values``, ``image_grid_thw``, ...).
        label: the label text ('' for a query).
    """

    input_ids: torch.Tensor
    answer: torch.Tensor
    observe: torch.Tensor
    image: torch.Tensor
    mm: dict = field(default_factory=dict)
    label: str = ""


def load_image(x, what: str, image_size: tuple[int, int] | None = None):
    """``x`` (path, PIL image or ``(H, W, 3)`` uint8 array) as an RGB ``PIL.Image``, resized to ``image_size``
    (width, height) when given. ValueError / FileNotFoundError naming ``what`` when it cannot be read."""
    from PIL import Image

    if isinstance(x, (str, Path)):
        from core.infra.fileio import open_image

        with open_image(x, what=f"an image for {what} (PNG, JPEG, ...)") as im:
            img = im.convert("RGB")
    elif isinstance(x, Image.Image):
        img = x.convert("RGB")
    elif isinstance(x, (np.ndarray, torch.Tensor)):
        arr = np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x)
        if arr.ndim != 3 or arr.shape[2] != 3 or arr.dtype != np.uint8:
            raise ValueError(f"{what}: an image array must be (H, W, 3) uint8, got {arr.shape} {arr.dtype}")
        img = Image.fromarray(arr)
    else:
        raise ValueError(f"{what}: an image must be a path, a PIL image or an (H, W, 3) uint8 array, got {type(x).__name__}")
    if image_size is not None and img.size != tuple(image_size):
        img = img.resize(tuple(image_size), Image.BILINEAR)
    return img


def _render(processor, messages: list[dict], generation: bool = False) -> str:
    if getattr(processor, "chat_template", None) is None and getattr(getattr(processor, "tokenizer", None), "chat_template", None) is None:
        raise ValueError(f"{type(processor).__name__} has no chat template; EMLoC formats demonstrations with the model's own template")
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)


def _turns(prompt: str, label: str | None) -> list[dict]:
    user = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": prompt}]}
    if label is None:
        return [user]
    return [user, {"role": "assistant", "content": [{"type": "text", "text": label}]}]


def _tokenizer(processor):
    return getattr(processor, "tokenizer", processor)


def _encode(processor, text: str, image) -> tuple[torch.Tensor, dict]:
    """Token ids ``(S,)`` and image inputs of ``text`` (with one image placeholder) through the processor."""
    enc = processor(text=[text], images=[image], return_tensors="pt", add_special_tokens=False)
    ids = enc["input_ids"][0]
    mm = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask") and isinstance(v, torch.Tensor)}
    return ids, mm


def _text_ids(processor, text: str) -> torch.Tensor:
    if not text:
        return torch.zeros(0, dtype=torch.long)
    return torch.as_tensor(_tokenizer(processor)(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


def _image_token_id(model, processor) -> int:
    tid = getattr(model.config, "image_token_id", None)
    if tid is None:
        tid = getattr(model.config, "image_token_index", None)
    if tid is None:
        tid = getattr(processor, "image_token_id", None)
    if tid is None:
        raise ValueError(f"{type(model).__name__} names no image token id (config.image_token_id)")
    return int(tid)


def demo_pieces(model, processor, images: list, labels: list[str], prompt: str = DEFAULT_PROMPT) -> list[Piece]:
    """Tokenize demonstrations (already loaded images, label texts) in the model's chat format (see module docs)."""
    head = _render(processor, _turns(prompt, labels[0]))
    img_id = _image_token_id(model, processor)
    pieces = []
    for i, (img, label) in enumerate(zip(images, labels)):
        if not isinstance(label, str) or not label.strip():
            raise ValueError(f"demonstration {i} has no label text (got {label!r}); a label is the answer the model learns from")
        if i == 0:
            text = head
        else:
            both = _render(processor, _turns(prompt, labels[0]) + _turns(prompt, label))
            if not both.startswith(head):
                raise ValueError("the chat template does not render turns one after another (two demonstrations do not "
                                 "begin with the first); EMLoC needs an incremental template")
            text = both[len(head):]
        at = text.rfind(label)
        if at < 0:
            raise ValueError(f"demonstration {i}: the chat template dropped the label text {label!r}")
        before, after = text[:at], text[at + len(label):]
        lead = len(before) - len(before.rstrip(" "))  # "ASSISTANT: cat": the space goes with the label, as BPE merges it
        before, label_text = before[: len(before) - lead], before[len(before) - lead:] + label
        ids_b, mm = _encode(processor, before, img)
        ids_l, ids_a = _text_ids(processor, label_text), _text_ids(processor, after)
        if ids_l.numel() == 0:
            raise ValueError(f"demonstration {i}: the label {label!r} has no tokens")
        ids = torch.cat([ids_b, ids_l, ids_a])
        mm = {k: (torch.cat([v, v.new_zeros(1, ids.numel() - v.shape[1])], dim=1) if v.dim() == 2 and v.shape[:2] == (1, ids_b.numel())
                  else v) for k, v in mm.items()}  # per-token inputs (mm_token_type_ids): the label and after are text
        S, nb, nl = ids.numel(), ids_b.numel(), ids_l.numel()
        answer = torch.zeros(S, dtype=torch.bool)
        answer[nb : nb + nl] = True
        observe = answer.clone()
        observe[nb - 1] = True
        if ids_a.numel():
            observe[nb + nl] = True  # the end of the turn after the label
        pieces.append(Piece(input_ids=ids, answer=answer, observe=observe, image=ids == img_id, mm=mm, label=label))
    return pieces


def suffix_pieces(model, processor, images: list, labels: list[str], prompt: str = DEFAULT_PROMPT) -> list[Piece]:
    """Each demonstration on its own as it follows other turns: without the template's header (the reference
    re-encodes every demonstration of a chunk this way, the first one too, to observe the chunk)."""
    out = []
    for img, label in zip(images, labels):
        out.append(demo_pieces(model, processor, [img, img], [label, label], prompt)[1])
    return out


def query_piece(model, processor, image, first_label: str, prompt: str = DEFAULT_PROMPT) -> Piece:
    """A query: a user turn with the image and ``prompt``, then the generation prompt, as it follows demonstrations
    (``first_label`` re-renders the first demonstration so that the template's header can be cut off)."""
    head = _render(processor, _turns(prompt, first_label))
    full = _render(processor, _turns(prompt, first_label) + _turns(prompt, None), generation=True)
    if not full.startswith(head):
        raise ValueError("the chat template does not render turns one after another; EMLoC needs an incremental template")
    ids, mm = _encode(processor, full[len(head):], image)
    S = ids.numel()
    none = torch.zeros(S, dtype=torch.bool)
    return Piece(input_ids=ids, answer=none, observe=none, image=ids == _image_token_id(model, processor), mm=mm)


def answer_ids(processor, prompt: str, label: str) -> torch.Tensor:
    """The tokens that follow a query's generation prompt when the answer is ``label``: the label as the template
    continues it (a leading space included, where the template puts one) and the first token after it (e.g.
    ``<|im_end|>``, so that a label that is a prefix of another does not win for free)."""
    gen = _render(processor, _turns(prompt, None), generation=True)
    full = _render(processor, _turns(prompt, label))
    if not full.startswith(gen):  # a template whose generation prompt is not the start of the answer turn
        rest = full[full.rfind(label):]
    else:
        rest = full[len(gen):]
    end = rest.find(label) + len(label)
    return torch.cat([_text_ids(processor, rest[:end]), _text_ids(processor, rest[end:])[:1]])


# --- model side ----------------------------------------------------------------------------------------------------


def language_model(model) -> torch.nn.Module:
    """The module that owns the decoder layers (it receives ``inputs_embeds``)."""
    from core.hf.insert import decoder_layers

    stack = decoder_layers(model)
    for m in model.modules():
        if getattr(m, "layers", None) is stack:
            return m
    raise ValueError(f"found no language model owning the decoder layers of {type(model).__name__}")


class _Stop(Exception):
    pass


@torch.no_grad()
def embed(model, piece_or_ids, mm: dict | None = None) -> torch.Tensor:
    """``(1, S, D)``: the input embeddings the language model receives for a piece (image features merged in),
    captured on the way in and the forward stopped there (the vision tower runs once per piece)."""
    ids = piece_or_ids.input_ids if isinstance(piece_or_ids, Piece) else piece_or_ids
    mm = piece_or_ids.mm if isinstance(piece_or_ids, Piece) else (mm or {})
    dev = next(model.parameters()).device
    lm = language_model(model)
    got = {}

    def hook(_m, args, kwargs):
        got["embeds"] = kwargs.get("inputs_embeds")
        got["ids"] = kwargs.get("input_ids", args[0] if args else None)
        raise _Stop

    handle = lm.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        model(input_ids=ids[None].to(dev), **{k: v.to(dev) for k, v in mm.items()}, use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    if got.get("embeds") is None:
        if got.get("ids") is None:
            raise ValueError(f"could not capture the input embeddings of {type(model).__name__}")
        return model.get_input_embeddings()(got["ids"])
    return got["embeds"]


def positions(model, piece: Piece) -> torch.Tensor:
    """The piece's own position ids starting at 0: M-RoPE ``(3, 1, S)`` for the Qwen2-VL family, else ``(1, S)``."""
    from core.hf.positions import mrope_position_ids

    ids = piece.input_ids[None]
    owner = model if hasattr(model, "get_rope_index") else getattr(model, "model", None)
    if owner is not None and hasattr(owner, "get_rope_index"):
        mm = {k: piece.mm[k] for k in ("image_grid_thw", "mm_token_type_ids") if k in piece.mm}
        pos, _ = mrope_position_ids(model, ids, **mm)
        return pos
    return torch.arange(ids.shape[1])[None]
