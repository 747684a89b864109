"""Multi-head attention and MLP modules built on :func:`core.attention.attention`.

These are the parts the transformer blocks in :mod:`core.layers` are made of; import them from there
(``from core.layers import MultiHeadAttention, MLP``).

Layouts: token tensors are ``(B, S, dim)``; per-head tensors are ``(B, H, S, head_dim)`` as in
:mod:`core.attention`. Masks follow :mod:`core.attention`: ``key_padding_mask`` is bool ``(B, S_k)`` with
``True`` = padded, ``attn_bias`` is additive and broadcastable to ``(B, H, S_q, S_k)``, ``causal`` is
bottom-right aligned.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import nn

from core.attention import BACKENDS, attention
from core.rope import apply_rope

logger = logging.getLogger(__name__)

__all__ = [
    "MLP",
    "MultiHeadAttention",
    "set_attention_backend",
    "check_backend",
    "hidden_dim_for",
    "HasBackend",
    "ACTIVATIONS",
]

#: Activation names accepted by :class:`MLP`. ``swiglu`` uses a gated hidden layer (two input projections).
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu")

RopeTables = tuple[torch.Tensor, torch.Tensor]


def check_backend(backend: str) -> str:
    """Return ``backend`` if it is ``"auto"`` or registered in ``core.attention.BACKENDS``, else raise."""
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {['auto', *BACKENDS]}")
    return backend


def set_attention_backend(module: nn.Module, backend: str) -> nn.Module:
    """Set ``backend`` on every :class:`MultiHeadAttention` inside ``module`` (itself included); returns ``module``."""
    check_backend(backend)
    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            m.backend = backend
    return module


class MLP(nn.Module):
    """Two-layer feed-forward network: ``fc2(drop(act(fc1(x))))`` then dropout.

    Args:
        dim: input features.
        hidden_dim: hidden features.
        dropout: dropout after the activation and after the output projection.
        activation: one of :data:`ACTIVATIONS`.
        out_dim: output features (default ``dim``).
        bias: whether the linear layers have biases.
        device, dtype: parameter factory arguments.
    """

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        *,
        dropout: float = 0.0,
        activation: str = "gelu",
        out_dim: int | None = None,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        for name, v in (("dim", dim), ("hidden_dim", hidden_dim)):
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"MLP {name} must be a positive int, got {v!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose one of {list(ACTIVATIONS)}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        fk = {"device": device, "dtype": dtype}
        self.activation = activation
        out_dim = dim if out_dim is None else out_dim
        gated = activation == "swiglu"
        self.fc1 = nn.Linear(dim, hidden_dim * (2 if gated else 1), bias=bias, **fk)
        self.fc2 = nn.Linear(hidden_dim, out_dim, bias=bias, **fk)
        self.drop = nn.Dropout(dropout)

    def _act(self, h: torch.Tensor) -> torch.Tensor:
        if self.activation == "gelu":
            return F.gelu(h)
        if self.activation == "gelu_tanh":
            return F.gelu(h, approximate="tanh")
        if self.activation == "relu":
            return F.relu(h)
        if self.activation == "silu":
            return F.silu(h)
        a, b = h.chunk(2, dim=-1)  # swiglu: silu(a) * b
        return F.silu(a) * b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(..., dim) -> (..., out_dim)``."""
        return self.drop(self.fc2(self.drop(self._act(self.fc1(x)))))


class MultiHeadAttention(nn.Module):
    """Multi-head attention (self or cross) with grouped-query heads and optional RoPE.

    Queries come from ``x`` (``dim`` features); keys and values from ``context`` (``kv_dim`` features) or
    from ``x`` itself. The pieces are public so a caller can reuse them, e.g. a memory that reads keys and
    values through this layer's projections::

        q = attn.project_q(x)                # (B, H, S, hd)
        k, v = attn.project_kv(context)      # (B, H_kv, N, hd) each
        out = attn.merge(attn.attend(q, k, v))  # (B, S, dim)

    Args:
        dim: query (and output) features.
        num_heads: query heads; ``head_dim = dim // num_heads`` unless given.
        kv_dim: context features (default ``dim``).
        num_kv_heads: key/value heads (grouped-query attention); must divide ``num_heads``. Default ``num_heads``.
        head_dim: per-head size (default ``dim // num_heads``, which must then divide evenly).
        bias: biases on the four projections.
        dropout: dropout on the output projection's result (attention-probability dropout is not offered:
            the fused backends do not support it).
        backend: attention backend name (``"auto"`` or a key of ``core.attention.BACKENDS``); a plain
            attribute, change it any time (see :func:`set_attention_backend`).
        attention_options: extra keyword arguments for :func:`core.attention.attention` on every call,
            e.g. ``{"k_chunk_size": 256}`` for the ``chunked`` backend or ``{"memory_budget": ...}`` for
            ``auto``; stored as the plain attribute ``attention_options``.
        device, dtype: parameter factory arguments.

    Attributes:
        q_proj, k_proj, v_proj, out_proj: the ``nn.Linear`` projections.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        kv_dim: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        bias: bool = True,
        dropout: float = 0.0,
        backend: str = "auto",
        attention_options: dict | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(dim, int) and dim > 0):
            raise ValueError(f"dim must be a positive int, got {dim!r}")
        if not (isinstance(num_heads, int) and num_heads > 0):
            raise ValueError(f"num_heads must be a positive int, got {num_heads!r}")
        if head_dim is None:
            if dim % num_heads != 0:
                raise ValueError(f"num_heads ({num_heads}) must divide dim ({dim}), or pass head_dim")
            head_dim = dim // num_heads
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if not (isinstance(num_kv_heads, int) and num_kv_heads > 0 and num_heads % num_kv_heads == 0):
            raise ValueError(f"num_kv_heads ({num_kv_heads}) must be a positive divisor of num_heads ({num_heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        kv_dim = dim if kv_dim is None else kv_dim
        fk = {"device": device, "dtype": dtype}
        self.dim, self.kv_dim = dim, kv_dim
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.backend = check_backend(backend)
        self.attention_options = dict(attention_options or {})
        self.q_proj = nn.Linear(dim, num_heads * head_dim, bias=bias, **fk)
        self.k_proj = nn.Linear(kv_dim, num_kv_heads * head_dim, bias=bias, **fk)
        self.v_proj = nn.Linear(kv_dim, num_kv_heads * head_dim, bias=bias, **fk)
        self.out_proj = nn.Linear(num_heads * head_dim, dim, bias=bias, **fk)
        self.drop = nn.Dropout(dropout)

    def project_q(self, x_BSD: torch.Tensor, *, rope: RopeTables | None = None) -> torch.Tensor:
        """Queries ``(B, S, dim) -> (B, H, S, head_dim)``, rotated by ``rope = (cos, sin)`` if given."""
        if x_BSD.dim() != 3 or x_BSD.shape[-1] != self.dim:
            raise ValueError(f"queries must be (B, S, {self.dim}), got {tuple(x_BSD.shape)}")
        q = rearrange(self.q_proj(x_BSD), "b s (h d) -> b h s d", h=self.num_heads)
        return q if rope is None else apply_rope(q, *rope)

    def project_kv(
        self, context_BND: torch.Tensor, *, rope: RopeTables | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``(B, N, kv_dim) -> 2 x (B, H_kv, N, head_dim)``; ``rope`` rotates the keys only."""
        if context_BND.dim() != 3 or context_BND.shape[-1] != self.kv_dim:
            raise ValueError(f"context must be (B, N, {self.kv_dim}), got {tuple(context_BND.shape)}")
        k = rearrange(self.k_proj(context_BND), "b n (h d) -> b h n d", h=self.num_kv_heads)
        v = rearrange(self.v_proj(context_BND), "b n (h d) -> b h n d", h=self.num_kv_heads)
        if rope is not None:
            k = apply_rope(k, *rope)
        return k, v

    def attend(
        self,
        q_BHSD: torch.Tensor,
        k_BHND: torch.Tensor,
        v_BHND: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:func:`core.attention.attention` with this module's backend; returns ``(B, H, S, head_dim)``."""
        return attention(
            q_BHSD, k_BHND, v_BHND, causal=causal, key_padding_mask=key_padding_mask, attn_bias=attn_bias,
            backend=self.backend, **self.attention_options,
        )

    def merge(self, out_BHSD: torch.Tensor) -> torch.Tensor:
        """Heads ``(B, H, S, head_dim) -> (B, S, dim)`` through the output projection (and dropout)."""
        return self.drop(self.out_proj(rearrange(out_BHSD, "b h s d -> b s (h d)")))

    def forward(
        self,
        x_BSD: torch.Tensor,
        context_BND: torch.Tensor | None = None,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        q_rope: RopeTables | None = None,
        k_rope: RopeTables | None = None,
    ) -> torch.Tensor:
        """Attend from ``x`` to ``context`` (or to ``x`` itself when ``context`` is None).

        Args:
            x_BSD: queries ``(B, S, dim)``.
            context_BND: keys/values source ``(B, N, kv_dim)``; None for self-attention.
            causal: bottom-right aligned causal mask.
            key_padding_mask: bool ``(B, N)``, True = padded key.
            attn_bias: additive bias broadcastable to ``(B, H, S, N)``.
            rope: ``(cos, sin)`` applied to both queries and keys (self-attention: same positions).
            q_rope, k_rope: ``(cos, sin)`` for queries / keys separately; each overrides ``rope``.

        Returns:
            ``(B, S, dim)``.
        """
        context = x_BSD if context_BND is None else context_BND
        q = self.project_q(x_BSD, rope=q_rope if q_rope is not None else rope)
        k, v = self.project_kv(context, rope=k_rope if k_rope is not None else rope)
        out = self.attend(q, k, v, causal=causal, key_padding_mask=key_padding_mask, attn_bias=attn_bias)
        return self.merge(out)

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, kv_dim={self.kv_dim}, num_heads={self.num_heads}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, backend={self.backend!r}"
        )


def hidden_dim_for(dim: int, mlp_ratio: float, mlp_hidden_dim: int | None) -> int:
    """MLP hidden size: ``mlp_hidden_dim`` if given, else ``round(dim * mlp_ratio)``."""
    if mlp_hidden_dim is not None:
        if not (isinstance(mlp_hidden_dim, int) and mlp_hidden_dim > 0):
            raise ValueError(f"mlp_hidden_dim must be a positive int, got {mlp_hidden_dim!r}")
        return mlp_hidden_dim
    if not mlp_ratio > 0:
        raise ValueError(f"mlp_ratio must be > 0, got {mlp_ratio}")
    return max(1, int(round(dim * mlp_ratio)))


class HasBackend:
    """``backend`` property shared by the blocks: get = first attention layer's, set = all of them."""

    @property
    def backend(self) -> str:
        for m in self.modules():  # type: ignore[attr-defined]
            if isinstance(m, MultiHeadAttention):
                return m.backend
        raise AttributeError("block has no attention layer")

    @backend.setter
    def backend(self, name: str) -> None:
        set_attention_backend(self, check_backend(name))  # type: ignore[arg-type]
