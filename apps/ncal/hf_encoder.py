"""Any local Hugging Face checkpoint as the NCAL text encoder (``--encoder hf:/path/to/model``), optionally with LoRA.

Loads with ``transformers.AutoModel`` / ``AutoTokenizer`` from a local folder only (``local_files_only``: nothing
is downloaded). The sentence feature is the last real token's final hidden state (decoder LLMs, as in the NCAL
paper) or the masked mean, taken with the attention mask so padding never enters it (the published code read
the last position, which is padding for all but the longest text of a right-padded batch). ``lora_r > 0`` wraps
the model with ``peft`` LoRA adapters and freezes the rest. ``transformers``/``peft`` are optional extras.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from apps.ncal.encoder import pool_features

logger = logging.getLogger(__name__)

__all__ = ["HFEncoder", "HFTokenizer", "parse_hf_source"]


def parse_hf_source(source: str) -> Path:
    """``"hf:/path"`` → the folder; ``ValueError`` when it is not that form, ``FileNotFoundError`` when absent."""
    if not source.startswith("hf:"):
        raise ValueError(f"an HF encoder is given as 'hf:/path/to/model', got {source!r}")
    path = Path(source[3:]).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"no local Hugging Face model folder at {path} (nothing is downloaded)")
    return path


def _transformers():
    try:
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the hf: encoder needs transformers: pip install transformers") from e
    return transformers


class HFTokenizer:
    """``batch(texts) -> {"input_ids", "attention_mask" (bool)}`` with a local HF tokenizer (right padding)."""

    def __init__(self, path: str | Path, *, max_length: int = 256) -> None:
        tf = _transformers()
        self.tok = tf.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token or self.tok.unk_token
        self.tok.padding_side = "right"
        self.max_length = int(max_length)

    def batch(self, texts, *, device=None) -> dict[str, torch.Tensor]:
        enc = self.tok(list(texts), padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        out = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"].bool()}
        return {k: v.to(device) for k, v in out.items()} if device is not None else out


class HFEncoder(nn.Module):
    """A local HF model whose pooled final hidden state is the feature.

    Args:
        path: local model folder.
        pool: ``"last"`` (last real token) or ``"mean"``.
        lora_r: LoRA rank (0: fine-tune every weight).
        lora_alpha: LoRA scaling numerator.
        lora_targets: module names LoRA wraps (None: peft's default for the architecture).
    """

    def __init__(self, path: str | Path, *, pool: str = "last", lora_r: int = 0, lora_alpha: int = 16,
                 lora_targets: list[str] | None = None) -> None:
        super().__init__()
        tf = _transformers()
        if pool not in ("last", "mean"):
            raise ValueError(f"pool must be 'last' or 'mean' for an HF encoder, got {pool!r}")
        self.pool = pool
        self.model = tf.AutoModel.from_pretrained(str(path), local_files_only=True)
        self.lora_r = int(lora_r)
        if self.lora_r > 0:
            try:
                import peft
            except ImportError as e:
                raise ImportError("LoRA needs peft: pip install peft (or use --lora-r 0)") from e
            cfg = peft.LoraConfig(r=self.lora_r, lora_alpha=lora_alpha, target_modules=lora_targets, lora_dropout=0.0)
            self.model = peft.get_peft_model(self.model, cfg)

    @property
    def feature_dim(self) -> int:
        cfg = self.model.config
        return int(getattr(cfg, "hidden_size", None) or getattr(cfg, "d_model"))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask.long())
        h_BSD = out.last_hidden_state
        return pool_features(h_BSD, attention_mask.bool(), self.pool)
