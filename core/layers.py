"""Transformer blocks built on :func:`core.attention.attention`.

Public names (all importable from here):

- :class:`MLP`, :class:`MultiHeadAttention`, :func:`set_attention_backend` (defined in :mod:`core.mha`)
- :class:`SelfAttentionBlock`: pre-norm (or post-norm) self-attention + MLP with residuals.
- :class:`CrossAttentionBlock`: cross-attention to a context + MLP with residuals.
- :class:`GatedCrossAttentionBlock`: tanh-gated cross-attention + FFN; the identity at initialisation.
- :class:`InducedSetAttentionBlock`: Set Transformer ISAB whose inducing points read training rows only.
- :class:`QFormerBlock`: learned queries: self-attention, (replaceable) cross-attention to context, FFN
  (defined in :mod:`core.qformer`).

Layouts: tokens ``(B, S, dim)``. Masks follow :mod:`core.attention` (bool ``key_padding_mask`` with
``True`` = padded; additive ``attn_bias`` broadcastable to ``(B, H, S_q, S_k)``; bottom-right ``causal``).
Every block has a ``backend`` attribute: reading it gives the backend of its attention layers, setting it
sets all of them. RoPE tables are ``(cos, sin)`` pairs from :mod:`core.rope`.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from core.mha import (
    ACTIVATIONS,
    MLP,
    HasBackend,
    MultiHeadAttention,
    RopeTables,
    hidden_dim_for,
    set_attention_backend,
)
from core.qformer import CrossAttentionHook, QFormerBlock

logger = logging.getLogger(__name__)

__all__ = [
    "ACTIVATIONS",
    "MLP",
    "MultiHeadAttention",
    "set_attention_backend",
    "SelfAttentionBlock",
    "CrossAttentionBlock",
    "GatedCrossAttentionBlock",
    "InducedSetAttentionBlock",
    "QFormerBlock",
    "CrossAttentionHook",
]


class SelfAttentionBlock(HasBackend, nn.Module):
    """Self-attention + MLP, each with a residual.

    Pre-norm (``norm_first=True``): ``x += Attn(LN x); x += MLP(LN x)``.
    Post-norm: ``x = LN(x + Attn x); x = LN(x + MLP x)``.

    Args:
        dim: token features.
        num_heads: attention heads.
        mlp_ratio: MLP hidden size as a multiple of ``dim`` (ignored if ``mlp_hidden_dim`` is given).
        mlp_hidden_dim: explicit MLP hidden size.
        activation: MLP activation (see ``core.mha.ACTIVATIONS``).
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
        dropout: dropout on the attention output and inside the MLP.
        norm_first: pre-norm (True) or post-norm (False).
        norm_eps: LayerNorm epsilon.
        bias: biases on the projections.
        backend: attention backend (see :mod:`core.attention`).
        device, dtype: parameter factory arguments.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        mlp_ratio: float = 4.0,
        mlp_hidden_dim: int | None = None,
        activation: str = "gelu",
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        norm_eps: float = 1e-5,
        bias: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        self.norm_first = norm_first
        self.attn = MultiHeadAttention(
            dim, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout, backend=backend, **fk
        )
        self.mlp = MLP(dim, hidden_dim_for(dim, mlp_ratio, mlp_hidden_dim), dropout=dropout, activation=activation, bias=bias, **fk)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **fk)

    def forward(
        self,
        x_BSD: torch.Tensor,
        *,
        causal: bool = False,
        key_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        rope: RopeTables | None = None,
        context_len: int | None = None,
    ) -> torch.Tensor:
        """``(B, S, dim) -> (B, S, dim)``; masks and ``rope`` as in :meth:`MultiHeadAttention.forward`.

        Args:
            x_BSD: tokens.
            causal: bottom-right aligned causal mask.
            key_padding_mask: bool ``(B, S)``, True = padded token (never attended to). A padded position
                is still computed (it attends to the unpadded keys); ignore its output.
            attn_bias: additive bias broadcastable to ``(B, H, S, S)`` (``(B, H, S, context_len)`` with
                ``context_len``).
            rope: ``(cos, sin)`` tables for the ``S`` positions, applied to queries and keys.
            context_len: if given, keys/values are only the first ``context_len`` tokens and every token
                attends to those alone (in-context learning: train and test rows read the train rows
                only, in one call, without an ``S x S`` mask). Not combinable with ``causal``.
        """
        if context_len is not None:
            S = x_BSD.shape[1]
            if not (isinstance(context_len, int) and 1 <= context_len <= S):
                raise ValueError(f"context_len must be an int in [1, S={S}], got {context_len!r}")
            if causal:
                raise ValueError("context_len and causal=True cannot be combined")
        if self.norm_first:
            x_BSD = x_BSD + self._attend(self.norm1(x_BSD), key_padding_mask, attn_bias, causal, rope, context_len)
            return x_BSD + self.mlp(self.norm2(x_BSD))
        x_BSD = self.norm1(x_BSD + self._attend(x_BSD, key_padding_mask, attn_bias, causal, rope, context_len))
        return self.norm2(x_BSD + self.mlp(x_BSD))

    def _attend(self, h_BSD, key_padding_mask, attn_bias, causal, rope, context_len) -> torch.Tensor:
        if context_len is None:
            return self.attn(h_BSD, causal=causal, key_padding_mask=key_padding_mask, attn_bias=attn_bias, rope=rope)
        k_rope = None if rope is None else (rope[0][..., :context_len, :], rope[1][..., :context_len, :])
        kpm = None if key_padding_mask is None else key_padding_mask[:, :context_len]
        return self.attn(
            h_BSD, h_BSD[:, :context_len], key_padding_mask=kpm, attn_bias=attn_bias, q_rope=rope, k_rope=k_rope
        )


class CrossAttentionBlock(HasBackend, nn.Module):
    """Cross-attention from ``x`` to a context, then an MLP, each with a residual.

    Pre-norm: ``x += Attn(LN x, C); x += MLP(LN x)`` with ``C = LN_c(context)`` if ``norm_context`` else
    ``context``. Post-norm: ``x = LN(x + Attn(x, C)); x = LN(x + MLP x)``.

    Args:
        dim: features of ``x``.
        num_heads: attention heads.
        context_dim: context features (default ``dim``).
        norm_context: LayerNorm the context before the key/value projections.
        mlp_ratio, mlp_hidden_dim, activation, num_kv_heads, dropout, norm_first, norm_eps, bias, backend,
        device, dtype: as in :class:`SelfAttentionBlock`.
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
        num_kv_heads: int | None = None,
        dropout: float = 0.0,
        norm_first: bool = True,
        norm_eps: float = 1e-5,
        bias: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        fk = {"device": device, "dtype": dtype}
        context_dim = dim if context_dim is None else context_dim
        self.norm_first = norm_first
        self.attn = MultiHeadAttention(
            dim, num_heads, kv_dim=context_dim, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout,
            backend=backend, **fk,
        )
        self.mlp = MLP(dim, hidden_dim_for(dim, mlp_ratio, mlp_hidden_dim), dropout=dropout, activation=activation, bias=bias, **fk)
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps, **fk)
        self.norm_context = nn.LayerNorm(context_dim, eps=norm_eps, **fk) if norm_context else nn.Identity()

    def forward(
        self,
        x_BSD: torch.Tensor,
        context_BND: torch.Tensor,
        *,
        context_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        q_rope: RopeTables | None = None,
        k_rope: RopeTables | None = None,
    ) -> torch.Tensor:
        """``x (B, S, dim)``, ``context (B, N, context_dim)`` -> ``(B, S, dim)``.

        ``context_padding_mask``: bool ``(B, N)``, True = padded context token. A query whose context is
        entirely padded gets a zero attention update.
        """
        ctx = self.norm_context(context_BND)
        kw = {"key_padding_mask": context_padding_mask, "attn_bias": attn_bias, "q_rope": q_rope, "k_rope": k_rope}
        if self.norm_first:
            x_BSD = x_BSD + self.attn(self.norm1(x_BSD), ctx, **kw)
            return x_BSD + self.mlp(self.norm2(x_BSD))
        x_BSD = self.norm1(x_BSD + self.attn(x_BSD, ctx, **kw))
        return self.norm2(x_BSD + self.mlp(x_BSD))


class GatedCrossAttentionBlock(HasBackend, nn.Module):
    """Tanh-gated cross-attention block (Flamingo / CoMemo memory path), pre-norm.

    ``x += tanh(g_attn) · XAttn(N x, C)``; ``x += tanh(g_ff) · FFN(N x)``, with scalar gates
    ``attn_gate`` and ``ff_gate`` initialised to ``gate_init`` (0: the block is the identity at
    initialisation, so it can be inserted into a trained network without changing it).

    The context ``C`` is the memory as given (``norm_context=False``), through its own norm (``True``), or
    through the queries' norm ``norm1`` (``"shared"``: one norm for text and media, as CoMemo's released code).
    :meth:`context_norm` applies whichever is configured.

    Memory keys and values depend only on the memory, so a caller that reads the same memory at every
    decoding step can compute them once: :meth:`memory_kv` returns them, and ``forward(..., memory_kv=...)``
    uses them instead of ``context_BND``. With ``cache_memory_kv = True`` the block does this itself: it keeps
    the keys/values of the last memory it saw and reuses them while the same tensor (same object, same key
    RoPE table values) comes back; ``clear_memory_kv()`` drops them.

    Args:
        dim: features of ``x`` (e.g. the language model's hidden size).
        num_heads: attention heads.
        context_dim: features of the context (e.g. image tokens), default ``dim``.
        norm_context: ``False``, ``True`` or ``"shared"`` (see above; ``"shared"`` needs ``context_dim == dim``).
        norm: ``"layer"`` (LayerNorm) or ``"rms"`` (RMSNorm, as Llama/Qwen2-family language models).
        gate_init: initial value of both gates (before tanh).
        head_dim: per-head size (default ``dim // num_heads``).
        mlp_ratio, mlp_hidden_dim, activation, num_kv_heads, dropout, norm_eps, bias, backend, device,
        dtype: as in :class:`SelfAttentionBlock`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        context_dim: int | None = None,
        norm_context: bool | str = False,
        norm: str = "layer",
        gate_init: float = 0.0,
        head_dim: int | None = None,
        mlp_ratio: float = 4.0,
        mlp_hidden_dim: int | None = None,
        activation: str = "gelu",
        num_kv_heads: int | None = None,
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
        if norm_context not in (False, True, "shared"):
            raise ValueError(f"norm_context must be False, True or 'shared', got {norm_context!r}")
        if norm_context == "shared" and context_dim != dim:
            raise ValueError(f"a norm shared by text and memory needs context_dim == dim, got {context_dim} != {dim}")
        if norm not in ("layer", "rms"):
            raise ValueError(f"norm must be 'layer' or 'rms', got {norm!r}")
        make_norm = (lambda n: nn.LayerNorm(n, eps=norm_eps, **fk)) if norm == "layer" else (
            lambda n: nn.RMSNorm(n, eps=norm_eps, **fk))
        self.shared_norm = norm_context == "shared"
        self.attn = MultiHeadAttention(
            dim, num_heads, kv_dim=context_dim, num_kv_heads=num_kv_heads, head_dim=head_dim, bias=bias,
            dropout=dropout, backend=backend, **fk,
        )
        self.mlp = MLP(dim, hidden_dim_for(dim, mlp_ratio, mlp_hidden_dim), dropout=dropout, activation=activation, bias=bias, **fk)
        self.norm1 = make_norm(dim)
        self.norm2 = make_norm(dim)
        self.norm_context = make_norm(context_dim) if norm_context is True else nn.Identity()
        self.attn_gate = nn.Parameter(torch.full((), float(gate_init), **fk))
        self.ff_gate = nn.Parameter(torch.full((), float(gate_init), **fk))
        self.cache_memory_kv = False
        self._kv_cache: tuple | None = None  # (memory, key rope cos, k, v) while cache_memory_kv

    def context_norm(self, context_BND: torch.Tensor) -> torch.Tensor:
        """The memory as the key/value projections read it (own norm, shared norm or as given)."""
        return self.norm1(context_BND) if self.shared_norm else self.norm_context(context_BND)

    def memory_kv(self, context_BND: torch.Tensor, *, k_rope: RopeTables | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the memory, ``2 x (B, H_kv, N, head_dim)`` (keys rotated by ``k_rope``)."""
        return self.attn.project_kv(self.context_norm(context_BND), rope=k_rope)

    def clear_memory_kv(self) -> None:
        self._kv_cache = None

    def _cached_kv(self, context_BND, k_rope):
        c = self._kv_cache
        if c is not None and c[0] is context_BND and (
            (c[1] is None and k_rope is None)
            or (c[1] is not None and k_rope is not None and c[1].shape == k_rope[0].shape and torch.equal(c[1], k_rope[0]))
        ):
            return c[2], c[3]
        k, v = self.memory_kv(context_BND, k_rope=k_rope)
        self._kv_cache = (context_BND, None if k_rope is None else k_rope[0], k, v)
        return k, v

    def forward(
        self,
        x_BSD: torch.Tensor,
        context_BND: torch.Tensor | None = None,
        *,
        context_padding_mask: torch.Tensor | None = None,
        attn_bias: torch.Tensor | None = None,
        q_rope: RopeTables | None = None,
        k_rope: RopeTables | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``x (B, S, dim)``, ``context (B, N, context_dim)`` -> ``(B, S, dim)``.

        ``q_rope``/``k_rope``: RoPE tables for the queries (text positions) and keys (image positions,
        e.g. from :func:`core.rope.rope_dhr_position_ids`). ``attn_bias`` can restrict which context
        tokens each query sees (e.g. ``-inf`` for images that come later in the text). ``memory_kv``:
        keys/values from :meth:`memory_kv` (then ``context_BND`` and ``k_rope`` are not read).
        """
        if memory_kv is not None:
            k, v = memory_kv
        elif context_BND is None:
            raise ValueError("pass context_BND or memory_kv")
        elif self.cache_memory_kv:
            k, v = self._cached_kv(context_BND, k_rope)
        else:
            k, v = self.memory_kv(context_BND, k_rope=k_rope)
        q = self.attn.project_q(self.norm1(x_BSD), rope=q_rope)
        attn_out = self.attn.merge(self.attn.attend(q, k, v, key_padding_mask=context_padding_mask, attn_bias=attn_bias))
        x_BSD = x_BSD + torch.tanh(self.attn_gate) * attn_out
        return x_BSD + torch.tanh(self.ff_gate) * self.mlp(self.norm2(x_BSD))


def _non_train_mask(
    x_BND: torch.Tensor, n_train: int | torch.Tensor | None, train_mask: torch.Tensor | None
) -> torch.Tensor | None:
    """Bool ``(B, N)``: True for rows the inducing points must NOT read (non-train rows); None = all train."""
    B, N = x_BND.shape[:2]
    if n_train is not None and train_mask is not None:
        raise ValueError("pass either n_train or train_mask, not both")
    if train_mask is not None:
        if train_mask.dtype != torch.bool:
            raise ValueError(f"train_mask must be bool (True = train row), got {train_mask.dtype}")
        if train_mask.dim() == 1:
            train_mask = train_mask[None].expand(B, -1)
        if tuple(train_mask.shape) != (B, N):
            raise ValueError(f"train_mask must have shape (N,) or (B, N) = ({B}, {N}), got {tuple(train_mask.shape)}")
        return ~train_mask.to(x_BND.device)
    if n_train is None:
        return None
    rows = torch.arange(N, device=x_BND.device)
    if isinstance(n_train, torch.Tensor):
        if n_train.dim() == 0:
            n_train = n_train[None].expand(B)
        if tuple(n_train.shape) != (B,) or n_train.dtype.is_floating_point:
            raise ValueError(f"n_train tensor must be integer of shape (B,) = ({B},), got {n_train.dtype} {tuple(n_train.shape)}")
        n = n_train.to(x_BND.device)
        if bool(((n < 0) | (n > N)).any()):
            raise ValueError(f"n_train values must lie in [0, {N}], got {n.tolist()}")
        return rows[None, :] >= n[:, None]
    if not (isinstance(n_train, int) and 0 <= n_train <= N):
        raise ValueError(f"n_train must be an int in [0, N={N}], got {n_train!r}")
    return (rows >= n_train)[None].expand(B, N)


class InducedSetAttentionBlock(HasBackend, nn.Module):
    """Induced set attention block (Set Transformer ISAB) with train-only inducing summaries.

    ``H = MAB(I, X_train)`` (learned inducing points ``I`` attend to the training rows only), then
    ``out = MAB(X, H)`` (every row, train or test, attends to the summary ``H``). Each MAB is a
    :class:`CrossAttentionBlock` with a LayerNorm on its context. Cost is linear in the number of rows, and
    a test row influences only its own output: no test-to-train leakage, and test rows are independent.

    Args:
        dim: row features.
        num_heads: attention heads.
        num_inducing: inducing points ``M`` (TabICL: 128).
        mlp_ratio, mlp_hidden_dim, activation, dropout, norm_first, norm_eps, bias, backend, device, dtype:
            as in :class:`SelfAttentionBlock`.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_inducing: int,
        *,
        mlp_ratio: float = 4.0,
        mlp_hidden_dim: int | None = None,
        activation: str = "gelu",
        dropout: float = 0.0,
        norm_first: bool = True,
        norm_eps: float = 1e-5,
        bias: bool = True,
        backend: str = "auto",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not (isinstance(num_inducing, int) and num_inducing > 0):
            raise ValueError(f"num_inducing must be a positive int, got {num_inducing!r}")
        fk = {"device": device, "dtype": dtype}
        kw = dict(
            norm_context=True, mlp_ratio=mlp_ratio, mlp_hidden_dim=mlp_hidden_dim, activation=activation,
            dropout=dropout, norm_first=norm_first, norm_eps=norm_eps, bias=bias, backend=backend, **fk,
        )
        self.num_inducing = num_inducing
        self.inducing = nn.Parameter(torch.empty(num_inducing, dim, **fk))  # (M, dim) learned queries I
        nn.init.xavier_uniform_(self.inducing)
        self.induce_block = CrossAttentionBlock(dim, num_heads, **kw)  # MAB(I, X_train)
        self.broadcast_block = CrossAttentionBlock(dim, num_heads, **kw)  # MAB(X, H)

    def induce(
        self,
        x_BND: torch.Tensor,
        *,
        n_train: int | torch.Tensor | None = None,
        train_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Inducing summary ``H = MAB(I, X_train)``: ``(B, N, dim) -> (B, M, dim)``.

        Args:
            x_BND: rows of each set.
            n_train: the first ``n_train`` rows are training rows: an int, or an int tensor ``(B,)`` per set.
            train_mask: bool ``(N,)`` or ``(B, N)``, True = training row (alternative to ``n_train``).
                With neither, every row counts as a training row. A set without training rows gets a
                summary that depends on no row.
        """
        if x_BND.dim() != 3:
            raise ValueError(f"ISAB input must be (B, N, dim), got shape {tuple(x_BND.shape)}")
        masked = _non_train_mask(x_BND, n_train, train_mask)
        context = x_BND
        if n_train is not None and masked is not None:
            # Training rows come first: read only the longest training prefix (saves the test rows' keys).
            n_max = n_train if isinstance(n_train, int) else int(n_train.max())
            if n_max > 0:
                context, masked = x_BND[:, :n_max], masked[:, :n_max]  # (B, n_max, dim), (B, n_max)
                if isinstance(n_train, int):
                    masked = None  # every kept row is a training row
        queries = self.inducing.to(x_BND.dtype)[None].expand(x_BND.shape[0], -1, -1)  # (B, M, dim)
        return self.induce_block(queries, context, context_padding_mask=masked)

    def forward(
        self,
        x_BND: torch.Tensor,
        *,
        n_train: int | torch.Tensor | None = None,
        train_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``(B, N, dim) -> (B, N, dim)``; ``n_train`` / ``train_mask`` as in :meth:`induce`."""
        summary_BMD = self.induce(x_BND, n_train=n_train, train_mask=train_mask)
        return self.broadcast_block(x_BND, summary_BMD)
