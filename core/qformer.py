"""Q-former block: learned queries that read a context through a replaceable cross-attention.

Import it from :mod:`core.layers` (``from core.layers import QFormerBlock``).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from core.mha import MLP, HasBackend, MultiHeadAttention, hidden_dim_for

__all__ = ["QFormerBlock", "CrossAttentionHook"]


class CrossAttentionHook(Protocol):
    """Replacement for :class:`QFormerBlock`'s cross-attention.

    Called as ``hook(attn, queries_BQD, context_BND, context_padding_mask)`` where ``attn`` is the block's
    :class:`MultiHeadAttention` (``attn.project_q``, ``attn.project_kv``, ``attn.attend``, ``attn.merge``
    reuse its projections), ``queries_BQD`` are the LayerNormed queries, ``context_BND`` the context as the
    default path would see it (after ``norm_context``; None if the caller passed None) and
    ``context_padding_mask`` the bool ``(B, N)`` mask or None. Returns the attended values ``(B, Q, dim)``
    (after the output projection), which the block adds to the queries as its residual update.
    """

    def __call__(
        self,
        attn: MultiHeadAttention,
        queries_BQD: torch.Tensor,
        context_BND: torch.Tensor | None,
        context_padding_mask: torch.Tensor | None,
    ) -> torch.Tensor: ...


class QFormerBlock(HasBackend, nn.Module):
    """Q-former block for learned queries, pre-norm: self-attention, cross-attention to context, FFN.

    ``q += SelfAttn(LN q); q += XAttn(LN q, C); q += FFN(LN q)``. The cross-attention can be replaced per
    call (``cross_attn=hook``, see :class:`CrossAttentionHook`), e.g. to mix ordinary attention over the
    current video chunk with a continuous long-term memory read through the same key/value projections::

        def hook(attn, q_BQD, ctx_BND, pad):
            short = attn(q_BQD, ctx_BND, key_padding_mask=pad)        # ordinary cross-attention
            q = attn.project_q(q_BQD)                                 # (B, H, Q, hd)
            long = attn.merge(memory_read(q, attn.k_proj, attn.v_proj))  # (B, Q, dim)
            return alpha * short + (1 - alpha) * long

    Args:
        dim: query features.
        num_heads: attention heads (self and cross).
        context_dim: context features (default ``dim``).
        norm_context: LayerNorm the context before the cross-attention's key/value projections.
        mlp_ratio, mlp_hidden_dim, activation, dropout, norm_eps, bias, backend, device, dtype: as in
            :class:`core.layers.SelfAttentionBlock`.

    Attributes:
        self_attn, cross_attn: :class:`MultiHeadAttention` layers; ``cross_attn.project_kv(context)`` gives
            the cross-attention keys and values.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        norm_context: bool = False,
        mlp_ratio: float = 4.0,
        mlp_hidden_dim: int | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
        norm_eps: float = 1e-5,
        bias: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        context_dim = dim if context_dim is None else context_dim
        self.self_attn = MultiHeadAttention(dim, num_heads, bias=bias, dropout=dropout, backend=backend, **fk)
        self.cross_attn = MultiHeadAttention(
            dim, num_heads, kv_dim=context_dim, bias=bias, dropout=dropout, backend=backend, **fk
        )
        self.mlp = MLP(dim, hidden_dim_for(dim, mlp_ratio, mlp_hidden_dim), dropout=dropout, activation=activation, bias=bias, **fk)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm3 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm_context = nn.LayerNorm(context_dim, eps=norm_eps, **fk) if norm_context else nn.Identity()

    def forward(
        self,
        queries_BQD: torch.Tensor,
        context_BND: torch.Tensor | None,
        *,
        context_padding_mask: torch.Tensor | None = None,
        cross_attn: CrossAttentionHook | None = None,
    ) -> torch.Tensor:
        """``queries (B, Q, dim)``, ``context (B, N, context_dim)`` -> ``(B, Q, dim)``.

        Args:
            queries_BQD: query tokens.
            context_BND: context tokens (may be None only when ``cross_attn`` is given).
            context_padding_mask: bool ``(B, N)``, True = padded context token.
            cross_attn: optional hook replacing the cross-attention (see :class:`CrossAttentionHook`).
        """
        if queries_BQD.dim() != 3:
            raise ValueError(f"queries must be (B, Q, dim), got shape {tuple(queries_BQD.shape)}")
        q = queries_BQD + self.self_attn(self.norm1(queries_BQD))
        ctx = None if context_BND is None else self.norm_context(context_BND)
        normed = self.norm2(q)
        if cross_attn is None:
            if ctx is None:
                raise ValueError("QFormerBlock needs a context tensor unless a cross_attn hook is given")
            update = self.cross_attn(normed, ctx, key_padding_mask=context_padding_mask)
        else:
            update = cross_attn(self.cross_attn, normed, ctx, context_padding_mask)
            if not isinstance(update, torch.Tensor) or update.shape != normed.shape:
                got = tuple(update.shape) if isinstance(update, torch.Tensor) else type(update).__name__
                raise ValueError(f"cross_attn hook must return a tensor of shape {tuple(normed.shape)}, got {got}")
        q = q + update
        return q + self.mlp(self.norm3(q))
