"""Validated arguments of :func:`core.attention.attention` (:class:`AttentionInputs`, :func:`prepare_inputs`).

Layout ``(B, H, S, D)`` and mask semantics: :mod:`core.attention`. Every check raises ``ValueError`` naming the
value and what is accepted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["AttentionInputs", "prepare_inputs"]


@dataclass(kw_only=True)
class AttentionInputs:
    """Validated attention arguments handed to a backend."""

    q: torch.Tensor  # (B, Hq, Sq, D)
    k: torch.Tensor  # (B, Hkv, Sk, D)
    v: torch.Tensor  # (B, Hkv, Sk, Dv)
    causal: bool
    key_padding_mask: torch.Tensor | None  # (B, Sk) bool, True = padded
    attn_bias: torch.Tensor | None  # broadcastable to (B, Hq, Sq, Sk)
    scale: float
    window: int | None = None  # sliding window (causal: keys per query, itself included; else |p - j| < window)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None  # (B|1, Hq|1, Sq|1) sink logits (GPT-OSS), or None
    q_segment_ids: torch.Tensor | None = None  # (B, Sq) int segment of each query
    segment_ids: torch.Tensor | None = None  # (B, Sk) int segment of each key
    q_group_ids: torch.Tensor | None = None  # (B, Sq) int bidirectional group of each query (-1: none)
    group_ids: torch.Tensor | None = None  # (B, Sk) int bidirectional group of each key (-1: none)
    q_chunk_size: int | None = None  # chunked backend: queries per chunk (None = its default)
    k_chunk_size: int | None = None  # chunked backend: keys per chunk (None = its default)

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]


def prepare_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    key_padding_mask: torch.Tensor | None = None,
    attn_bias: torch.Tensor | None = None,
    scale: float | None = None,
    q_chunk_size: int | None = None,
    k_chunk_size: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    segment_ids: torch.Tensor | None = None,
    q_segment_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
    q_group_ids: torch.Tensor | None = None,
) -> AttentionInputs:
    """Check shapes, dtypes and devices; raise ``ValueError`` naming what is wrong."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have layout (B, H, S, D), got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"attention needs floating-point inputs, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Sq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on (B, H, S)")
    if k.shape[3] != D:
        raise ValueError(f"q head dim ({D}) must equal k head dim ({k.shape[3]})")
    Hkv = k.shape[1]
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(f"key/value heads ({Hkv}) must divide query heads ({Hq})")
    Sk = k.shape[2]
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(f"key_padding_mask must be bool (True = padded), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (B, Sk):
            raise ValueError(f"key_padding_mask must have shape (B, S_k) = ({B}, {Sk}), got {tuple(key_padding_mask.shape)}")
        key_padding_mask = key_padding_mask.to(q.device)
    if attn_bias is not None:
        if not attn_bias.dtype.is_floating_point:
            raise ValueError(f"attn_bias must be a float tensor, got {attn_bias.dtype}")
        try:
            torch.broadcast_shapes(attn_bias.shape, (B, Hq, Sq, Sk))
        except RuntimeError:
            raise ValueError(
                f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to (B, H, S_q, S_k) = {(B, Hq, Sq, Sk)}"
            ) from None
        attn_bias = attn_bias.to(q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int (keys per query) or None, got {window!r}")
    if softcap is not None:
        if isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0:
            raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
        softcap = float(softcap)
    sinks = _check_sinks(sinks, B, Hq, Sq, q.device)
    segment_ids, q_segment_ids = _check_segments(segment_ids, q_segment_ids, B, Sq, Sk, q.device)
    group_ids, q_group_ids = _check_segments(group_ids, q_group_ids, B, Sq, Sk, q.device, "group_ids")
    if group_ids is not None and not causal:
        group_ids = q_group_ids = None  # without causality every key is seen: a group adds nothing
    for name, size in (("q_chunk_size", q_chunk_size), ("k_chunk_size", k_chunk_size)):
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{name} must be a positive int or None, got {size!r}")
    return AttentionInputs(
        q=q,
        k=k,
        v=v,
        causal=bool(causal),
        key_padding_mask=key_padding_mask,
        attn_bias=attn_bias,
        scale=float(scale),
        window=window,
        softcap=softcap,
        sinks=sinks,
        q_segment_ids=q_segment_ids,
        segment_ids=segment_ids,
        q_group_ids=q_group_ids,
        group_ids=group_ids,
        q_chunk_size=q_chunk_size,
        k_chunk_size=k_chunk_size,
    )


def _check_sinks(sinks, B: int, Hq: int, Sq: int, device) -> torch.Tensor | None:
    """Sink logits as a 3-d view broadcastable to ``(B, H_q, S_q)`` (a ``(H_q,)`` tensor: one per head)."""
    if sinks is None:
        return None
    if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks must be a float tensor, got {getattr(sinks, 'dtype', type(sinks).__name__)}")
    if sinks.dim() == 1 and sinks.shape[0] == Hq:
        sinks = sinks.view(1, Hq, 1)
    elif sinks.dim() == 4 and sinks.shape[-1] == 1:  # (B, H, S, 1), as models concatenate them to the scores
        sinks = sinks.squeeze(-1)
    ok = sinks.dim() == 3
    if ok:
        try:
            ok = torch.broadcast_shapes(sinks.shape, (B, Hq, Sq)) == (B, Hq, Sq)
        except RuntimeError:
            ok = False
    if not ok:
        raise ValueError(
            f"sinks of shape {tuple(sinks.shape)} must be (H_q,) = ({Hq},) or broadcastable to (B, H_q, S_q) = "
            f"{(B, Hq, Sq)}"
        )
    return sinks.to(device)


def _check_segments(segment_ids, q_segment_ids, B: int, Sq: int, Sk: int, device, kind: str = "segment_ids"):
    """Key and query ids (``kind``: segment or group ids) as int64 ``(B, S_k)`` and ``(B, S_q)`` (queries default
    to their positions')."""
    if segment_ids is None:
        if q_segment_ids is not None:
            raise ValueError(f"q_{kind} needs {kind} (the keys' ids)")
        return None, None
    for name, t, n in ((kind, segment_ids, Sk), (f"q_{kind}", q_segment_ids, Sq)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        if tuple(t.shape) != (B, n):
            raise ValueError(f"{name} must have shape ({B}, {n}), got {tuple(t.shape)}")
    segment_ids = segment_ids.to(device=device, dtype=torch.long)
    if q_segment_ids is None:
        if Sq > Sk:
            raise ValueError(f"with more queries ({Sq}) than keys ({Sk}), pass q_{kind}")
        q_segment_ids = segment_ids[:, Sk - Sq :]
    return segment_ids, q_segment_ids.to(device=device, dtype=torch.long)
