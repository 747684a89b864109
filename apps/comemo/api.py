"""The Python face of CoMemo: ``CoMemo.load(path).answer(images, question)``."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from apps.comemo.infer import generate_answer
from apps.comemo.model import CoMemoModel
from apps.comemo.tokenizer import CoMemoTokenizer

logger = logging.getLogger(__name__)

__all__ = ["CoMemo", "DEFAULT_WEIGHTS"]

#: The shipped default (the ``comemo`` variant; ``tokenizer.json`` beside it; card ``comemo.md``; made by
#: ``python -m apps.comemo.ship``).
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "comemo.safetensors"


class CoMemo:
    """A trained CoMemo model with its tokenizer.

    Args:
        model: the network.
        tokenizer: its tokenizer.
    """

    def __init__(self, model: CoMemoModel, tokenizer: CoMemoTokenizer) -> None:
        if tokenizer.vocab_size != model.cfg.vocab_size:
            raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the model expects {model.cfg.vocab_size}")
        self.model = model.eval()
        self.tokenizer = tokenizer

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, device: str | torch.device = "cpu") -> CoMemo:
        """Weights ``path`` (a ``model.safetensors`` with ``tokenizer.json`` beside it, or a run folder holding
        both); without ``path`` the shipped default."""
        if path is None:
            path = DEFAULT_WEIGHTS
            if not path.is_file():
                raise FileNotFoundError(
                    f"the shipped CoMemo weights are missing ({path}); restore them from the repository, or train "
                    "a model with `python -m apps.comemo.train` and pass its model.safetensors"
                )
        path = Path(path)
        if path.is_dir():
            path = path / "model.safetensors"
        tok_path = path.with_name("tokenizer.json") if path.name == "model.safetensors" else path.with_suffix(".tokenizer.json")
        if not tok_path.is_file():
            tok_path = path.parent / "tokenizer.json"
        model = CoMemoModel.load(path, device=device)
        return cls(model, CoMemoTokenizer.load(tok_path))

    @staticmethod
    def from_hf(path: str | os.PathLike, **kwargs):
        """A local InternVL-family model folder (transformers ``InternVLForConditionalGeneration``: a plain InternVL
        model, a stage folder of the recipe, or a released CoMemo checkpoint converted by ``python -m
        apps.comemo.convert``) with the CoMemo memory path: :func:`apps.comemo.hf.from_hf` (``every``, ``queries``,
        ``positions``, ``reference``, ``dtype``, ``device``, ``attn``; CUDA and bf16 when present, the ``longctx``
        attention). Returns an :class:`apps.comemo.hf.HFCoMemo`: ``.answer(images, question)``."""
        from apps.comemo.hf import from_hf

        return from_hf(path, **kwargs)

    @property
    def variant(self) -> str:
        return self.model.cfg.variant

    def answer(self, images, question: str, *, max_new_tokens: int = 64) -> str:
        """Greedy answer to ``question`` about ``images`` (file paths, PIL images or uint8/[0, 1] arrays)."""
        if not isinstance(question, str) or not question.strip():
            raise ValueError("question must be a non-empty string")
        if not isinstance(images, (list, tuple)):
            images = [images]
        return generate_answer(self.model, self.tokenizer, list(images), question, max_new_tokens=max_new_tokens)["answer"]
