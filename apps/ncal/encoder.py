"""The default NCAL text encoder: a small bidirectional transformer on :mod:`core.layers`, with an MLM head.

Tokens come from :class:`apps.ncal.tokenizer.CharTokenizer`. The sentence feature is pooled over real tokens
only (``pool="mean"``: masked mean; ``"cls"``: the ``[CLS]`` token), never over padding.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from core.layers import SelfAttentionBlock

logger = logging.getLogger(__name__)

__all__ = ["EncoderConfig", "TextEncoder", "MLMHead", "pool_features", "POOLS"]

POOLS = ("mean", "cls", "last")


@dataclass(kw_only=True)
class EncoderConfig:
    """Size of the character transformer (defaults: ~1.6M parameters, a few MB in fp32)."""

    vocab_size: int  # tokenizer vocabulary, specials included
    dim: int = 160  # token width; small enough to pretrain on a CPU in an hour
    num_layers: int = 4  # transformer blocks
    num_heads: int = 4  # attention heads (must divide dim)
    mlp_ratio: float = 2.0  # MLP hidden = dim * mlp_ratio
    max_length: int = 160  # learned positions; the tokenizer truncates to this
    dropout: float = 0.1  # in attention output, MLP and embeddings
    pool: str = "mean"  # sentence feature: masked mean over real tokens, or the [CLS] token

    def __post_init__(self) -> None:
        if self.dim % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide dim ({self.dim})")
        if self.pool not in POOLS:
            raise ValueError(f"pool must be one of {POOLS}, got {self.pool!r}")
        if self.vocab_size < 6:
            raise ValueError(f"vocab_size must be at least 6, got {self.vocab_size}")

    def to_dict(self) -> dict:
        return asdict(self)


def pool_features(h_BSD: torch.Tensor, mask_BS: torch.Tensor, pool: str) -> torch.Tensor:
    """Sentence features ``(B, D)`` from token states over real tokens (``mask_BS`` True = real).

    ``mean``: average of real tokens; ``cls``: position 0; ``last``: the last real token of each row (works for
    left or right padding).
    """
    if pool == "mean":
        m_BS1 = mask_BS.unsqueeze(-1).to(h_BSD.dtype)
        return (h_BSD * m_BS1).sum(1) / m_BS1.sum(1).clamp_min(1.0)
    if pool == "cls":
        return h_BSD[:, 0]
    if pool == "last":
        S = mask_BS.shape[1]
        pos_BS = torch.arange(S, device=mask_BS.device).expand_as(mask_BS)
        last_B = torch.where(mask_BS, pos_BS, torch.full_like(pos_BS, -1)).amax(1).clamp_min(0)
        return h_BSD[torch.arange(h_BSD.shape[0], device=h_BSD.device), last_B]
    raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")


class TextEncoder(nn.Module):
    """Token + position embeddings, ``num_layers`` pre-norm self-attention blocks, final LayerNorm."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Embedding(cfg.max_length, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(cfg.dim, cfg.num_heads, mlp_ratio=cfg.mlp_ratio, dropout=cfg.dropout)
            for _ in range(cfg.num_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    @property
    def feature_dim(self) -> int:
        return self.cfg.dim

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Token states ``(B, S, dim)``; ``attention_mask`` ``(B, S)`` bool, True = real token."""
        B, S = input_ids.shape
        if S > self.cfg.max_length:
            raise ValueError(f"sequence length {S} exceeds max_length {self.cfg.max_length}")
        pos_S = torch.arange(S, device=input_ids.device)
        x_BSD = self.drop(self.tok(input_ids) + self.pos(pos_S)[None])
        pad_BS = ~attention_mask.bool()
        for blk in self.blocks:
            x_BSD = blk(x_BSD, key_padding_mask=pad_BS)
        return self.norm(x_BSD)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Sentence features ``(B, dim)`` pooled over real tokens (``cfg.pool``)."""
        h_BSD = self.hidden_states(input_ids, attention_mask)
        return pool_features(h_BSD, attention_mask.bool(), self.cfg.pool)


class MLMHead(nn.Module):
    """Masked-token prediction: dense + GELU + LayerNorm, then logits tied to the token embedding."""

    def __init__(self, encoder: TextEncoder) -> None:
        super().__init__()
        d = encoder.cfg.dim
        self.dense = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.bias = nn.Parameter(torch.zeros(encoder.cfg.vocab_size))
        self._tok = [encoder.tok]  # not a submodule: the weight is the encoder's

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        """Logits ``(N, vocab)`` for hidden states ``(N, dim)``."""
        z_ND = self.norm(torch.nn.functional.gelu(self.dense(h_ND)))
        return z_ND @ self._tok[0].weight.T + self.bias
