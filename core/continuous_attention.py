"""Gibbs continuous attention over a memory (the reading half of :mod:`core.continuous`).

``p(t) ∝ exp(q . K(t) / sqrt(d))`` on ``[0, 1]`` and the context ``∫ p(t) V(t) dt``, by the trapezoid rule on
``T`` points: exactly softmax attention over the evaluated points with an additive bias ``log w_i``, so it runs
through :func:`core.attention.attention`. :func:`read_memory` reads a :class:`core.continuous.ContinuousMemory`
through an attention layer's own key/value projections and records the density for sticky consolidation.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from core.attention import attention

if TYPE_CHECKING:
    from core.continuous import ContinuousMemory

__all__ = ["continuous_attention", "attention_density", "continuous_attention_with_density", "mix_attention",
           "read_memory"]


def continuous_attention(
    q_BHQD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    logw_T: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Gibbs continuous attention ``∫ p(t) V(t) dt`` with ``p(t) ∝ exp(scale · q . K(t))``, by quadrature.

    Args:
        q_BHQD: queries ``(B, H, Q, D)``.
        k_BHTD: keys evaluated at the ``T`` integration points, ``(B, H_kv, T, D)``.
        v_BHTD: values evaluated at the same points, ``(B, H_kv, T, D_v)``.
        logw_T: log quadrature weights ``(T,)`` (see :func:`trapezoid_grid`).
        scale: score scale, default ``1/sqrt(D)``.
        backend: attention backend name, passed to :func:`core.attention.attention`.

    Returns:
        Context vectors ``(B, H, Q, D_v)``. Normalising ``p`` by the same quadrature makes the
        weights ``w_i exp(s_i) / sum_j w_j exp(s_j)``, i.e. softmax with bias ``log w``.
    """
    T = k_BHTD.shape[2]
    if logw_T.shape != (T,):
        raise ValueError(f"logw must be ({T},) to match the keys' integration points, got {tuple(logw_T.shape)}")
    bias = logw_T.to(q_BHQD.dtype).view(1, 1, 1, T)
    return attention(q_BHQD, k_BHTD, v_BHTD, attn_bias=bias, scale=scale, backend=backend)


def attention_density(
    q_BHQD: torch.Tensor,
    k_BHTD: torch.Tensor,
    logw_T: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The Gibbs density ``p(t_i)`` at the integration points, averaged over heads and queries.

    Returns:
        ``(B, T)`` float32 with ``sum_i w_i p(t_i) = 1`` (a density on ``[0, 1]``, not a probability vector).
    """
    B, H, Q, D = q_BHQD.shape
    Hkv = k_BHTD.shape[1]
    if H % Hkv:
        raise ValueError(f"key heads ({Hkv}) must divide query heads ({H})")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    k = k_BHTD.float().repeat_interleave(H // Hkv, dim=1)  # (B, H, T, D)
    scores = torch.einsum("bhqd,bhtd->bhqt", q_BHQD.float(), k) * scale + logw_T.float()
    probs = scores.softmax(dim=-1)  # quadrature probabilities w_i p(t_i)
    return probs.mean(dim=(1, 2)) / logw_T.float().exp()  # (B, T) density


def continuous_attention_with_density(
    q_BHQD: torch.Tensor,
    k_BHTD: torch.Tensor,
    v_BHTD: torch.Tensor,
    logw_T: torch.Tensor,
    *,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`continuous_attention` and :func:`attention_density` from one softmax over the points.

    The two read the same quadrature probabilities ``w_i p(t_i)``; computing them once halves the
    score work of a memory read. Scores and probabilities are float32.

    Returns:
        ``(context (B, H, Q, D_v)`` in the queries' dtype, ``density (B, T)`` float32).
    """
    B, H, Q, D = q_BHQD.shape
    Hkv, T = k_BHTD.shape[1], k_BHTD.shape[2]
    if logw_T.shape != (T,):
        raise ValueError(f"logw must be ({T},) to match the keys' integration points, got {tuple(logw_T.shape)}")
    if H % Hkv:
        raise ValueError(f"key heads ({Hkv}) must divide query heads ({H})")
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    g = H // Hkv
    q = q_BHQD.float().reshape(B, Hkv, g * Q, D)  # query heads grouped under their key head
    logw = logw_T.float()
    probs = torch.baddbmm(logw.expand(B * Hkv, g * Q, T), q.reshape(B * Hkv, g * Q, D),
                          k_BHTD.float().reshape(B * Hkv, T, D).transpose(1, 2), alpha=scale).softmax(dim=-1)
    out = torch.bmm(probs, v_BHTD.float().reshape(B * Hkv, T, -1))  # (B*Hkv, g*Q, D_v)
    density = probs.reshape(B, H * Q, T).mean(dim=1) / logw.exp()
    return out.reshape(B, H, Q, -1).to(q_BHQD.dtype), density


def mix_attention(short_term: torch.Tensor, long_term: torch.Tensor | None, alpha: float) -> torch.Tensor:
    """``alpha * short_term + (1 - alpha) * long_term``; ``alpha = 1`` or no memory gives ``short_term``."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if long_term is None or alpha == 1.0:
        return short_term
    if long_term.shape != short_term.shape:
        raise ValueError(f"short-term {tuple(short_term.shape)} and long-term {tuple(long_term.shape)} shapes differ")
    return alpha * short_term + (1.0 - alpha) * long_term


def read_memory(memory: "ContinuousMemory", q_BHQD: torch.Tensor, kv_fn, *, scale: float | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Continuous attention of queries over a memory, through an attention layer's key/value projections.

    Runs :func:`continuous_attention_with_density` on the keys and values of the signal at the integration
    points and records the density for the next consolidation (:meth:`ContinuousMemory.set_density`).

    Args:
        memory: a memory holding at least one chunk.
        q_BHQD: projected queries ``(B, H, Q, d)``.
        kv_fn: ``(B, n, D) -> (keys, values)``, each ``(B, H_kv, n, d)``: the layer's projections, affine.
        scale: score scale, default ``1/sqrt(d)``.

    Returns:
        ``(context (B, H, Q, d_v), density (B, T))``.
    """
    scale = 1.0 / math.sqrt(q_BHQD.shape[-1]) if scale is None else scale
    if memory.config.reference:
        kc, vc = kv_fn(memory.coef)
        psi_TN = memory._grid_basis(memory.coef.device).T
        k, v = psi_TN.to(kc.dtype) @ kc, psi_TN.to(vc.dtype) @ vc
        logw = memory.grid(device=memory.coef.device)[1]
        ctx, density = continuous_attention_with_density(q_BHQD, k, v, logw, scale=scale)
        memory.set_density(density, last_read=(q_BHQD, kc, scale))
        return ctx, density
    (k, v), logw = memory.project_points(kv_fn)
    ctx, density = continuous_attention_with_density(q_BHQD, k, v, logw, scale=scale)
    memory.set_density(density)
    return ctx, density
