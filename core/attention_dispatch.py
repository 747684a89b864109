"""The ``auto`` rule of :func:`core.attention.attention`: the facts it reads from the inputs, the rule as a plain
function of those facts (:func:`auto_rule`), and the budgets and limits it uses. The order of its steps is in
:mod:`core.attention`'s module docs.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from core.attention import AttentionInputs

__all__ = [
    "choose_backend",
    "dense_score_bytes",
    "sdpa_mask_bytes",
    "sdpa_fused",
    "dispatch_facts",
    "auto_rule",
    "triton_installed",
    "DEFAULT_MEMORY_BUDGET",
    "DECODE_MAX_QUERIES",
    "CPU_MASKED_CHUNKED_MIN_PAIRS",
    "TRITON_HEAD_DIMS",
    "SDPA_FUSED_MAX_HEAD_DIM",
]

#: Largest dense score matrix (bytes, counted as fp32) that ``auto`` hands to ``sdpa``; per call: ``memory_budget=``.
DEFAULT_MEMORY_BUDGET = 512 * 2**20
#: Head dims the Triton kernel is chosen for by ``auto``.
TRITON_HEAD_DIMS = (16, 128)
#: Query lengths up to this are decode-sized: one Triton query tile (64-128 rows) per (batch, head) would be
#: mostly idle rows, and ``B · H`` programs fill a few percent of a large GPU; ``auto`` prefers SDPA there.
DECODE_MAX_QUERIES = 16
#: On a CPU, causal attention that also needs a mask (padding, window, bias) goes to ``chunked`` from this many
#: query-key pairs (``S_q · S_k``) on: SDPA would take a materialised mask and compute the hidden half.
CPU_MASKED_CHUNKED_MIN_PAIRS = 512 * 512
#: Head dims up to which ``auto`` counts on SDPA's fused CUDA kernels (flash: <= 256; memory-efficient: more).
SDPA_FUSED_MAX_HEAD_DIM = 256


def _sdpa_causal(a: AttentionInputs) -> bool:
    """Whether ``sdpa`` must apply the causal mask: one query (bottom-right aligned) sees every key."""
    return a.causal and not (a.q.shape[2] == 1 and a.k.shape[2] >= 1)


def _sdpa_mask_shape(a: AttentionInputs) -> tuple[int, ...] | None:
    """Shape of the mask ``sdpa`` hands to SDPA (None: none, ``is_causal`` or no masking at all)."""
    B, Hq, Sq, _ = a.q.shape
    Sk = a.k.shape[2]
    causal = _sdpa_causal(a) or a.window is not None
    masks = a.segment_ids is not None or a.group_ids is not None
    if causal and a.key_padding_mask is None and a.attn_bias is None and Sq == Sk and a.window is None \
            and not masks:  # fmt: skip
        return None
    shapes = []
    if causal:
        shapes.append((1, 1, Sq, Sk))
    if masks:
        shapes.append((B, 1, Sq, Sk))
    if a.key_padding_mask is not None:
        shapes.append((B, 1, 1, Sk))
    if a.attn_bias is not None:
        shapes.append(tuple(a.attn_bias.shape))
    return tuple(torch.broadcast_shapes(*shapes)) if shapes else None


@functools.lru_cache(maxsize=1)
def triton_installed() -> bool:
    """Whether the ``triton`` package can be imported (looked up on first call, not at import)."""
    return importlib.util.find_spec("triton") is not None


def dense_score_bytes(a: AttentionInputs) -> int:
    """Bytes of a dense fp32 score matrix ``(B, H_q, S_q, S_k)`` for these inputs."""
    B, Hq, Sq, _ = a.q.shape
    return B * Hq * Sq * a.k.shape[2] * 4


def sdpa_mask_bytes(a: AttentionInputs) -> int:
    """Bytes of the masks ``sdpa`` materializes for these inputs (0 without a mask): the bool keep mask, the
    bias copy it is merged into, and SDPA's own float (and alignment-padded) copy, each the mask's broadcast
    shape — ``S_q · S_k`` per batch entry for a causal mask with ``S_q ≠ S_k``."""
    shape = _sdpa_mask_shape(a)
    if shape is None:
        return 0
    n = math.prod(shape)
    return n * (1 + 2 * a.q.element_size())


def sdpa_fused(*, dtype: torch.dtype, head_dim: int, value_dim: int) -> bool:
    """Whether SDPA runs these CUDA inputs with a fused kernel that never builds the score matrix.

    Flash: fp16/bf16, no mask (``is_causal`` is fine), equal head dims. Memory-efficient: fp16/bf16/fp32, any
    additive or bool mask, equal head dims. Both: head dims multiples of 8 up to ``SDPA_FUSED_MAX_HEAD_DIM``
    (a conservative reading of PyTorch's ``sdp_utils`` constraints; where the flash kernel cannot run, ``sdpa``
    maps GQA heads itself: :func:`_sdpa_call`).
    """
    return (
        dtype in (torch.float16, torch.bfloat16, torch.float32)
        and head_dim == value_dim
        and head_dim % 8 == 0
        and 8 <= head_dim <= SDPA_FUSED_MAX_HEAD_DIM
    )


def dispatch_facts(a: AttentionInputs, *, device_type: str | None = None, allow_triton: bool = True) -> dict:
    """The facts :func:`auto_rule` looks at, for these inputs (``device_type`` overrides ``q``'s device: what
    ``auto`` would choose for the same shapes on CUDA, e.g. from ``meta`` tensors)."""
    device_type = device_type or a.q.device.type
    masks = a.segment_ids is not None or a.group_ids is not None
    return {
        "device_type": device_type,
        "dtype": a.q.dtype,
        "head_dim": a.q.shape[3],
        "value_dim": a.v.shape[3],
        "q_len": a.q.shape[2],
        "has_bias": a.attn_bias is not None,
        "score_bytes": dense_score_bytes(a),
        "sdpa_fused": device_type == "cuda"
        and sdpa_fused(dtype=a.q.dtype, head_dim=a.q.shape[3], value_dim=a.v.shape[3]),
        "mask_bytes": sdpa_mask_bytes(a),
        "triton_ok": allow_triton and device_type == "cuda" and triton_installed(),
        "has_window": a.window is not None,
        "has_softcap": a.softcap is not None,
        "has_sinks": a.sinks is not None,
        "has_segments": masks,
        "masked_causal": _sdpa_causal(a) or a.window is not None or masks,
        "k_len": a.k.shape[2],
    }


def auto_rule(
    *,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int,
    value_dim: int,
    has_bias: bool,
    score_bytes: int,
    memory_budget: int | None = None,
    triton_ok: bool = True,
    q_len: int | None = None,
    sdpa_fused: bool = False,
    mask_bytes: int = 0,
    has_window: bool = False,
    has_softcap: bool = False,
    masked_causal: bool = False,
    k_len: int | None = None,
    has_sinks: bool = False,
    has_segments: bool = False,
) -> str:
    """The ``auto`` rule as a plain function of the facts it looks at (see module docs).

    Args:
        device_type: ``q.device.type``.
        dtype: input dtype.
        head_dim: ``D`` of q/k; value_dim: ``D_v`` of v.
        has_bias: whether an ``attn_bias`` is given.
        score_bytes: bytes of the dense fp32 score matrix (:func:`dense_score_bytes`).
        memory_budget: bytes allowed for that matrix (or for SDPA's masks); default ``DEFAULT_MEMORY_BUDGET``.
        triton_ok: whether Triton is installed (and allowed).
        q_len: ``S_q``; up to ``DECODE_MAX_QUERIES`` is decode-sized (None: not known, not decode).
        sdpa_fused: whether SDPA runs these inputs on this device with a fused kernel (:func:`sdpa_fused`).
        mask_bytes: bytes of the masks ``sdpa`` would build (:func:`sdpa_mask_bytes`).
        has_window: a sliding window is set (``sdpa`` builds it as a mask; the Triton kernel takes it).
        has_softcap: a softcap is set: ``sdpa`` cannot apply one (``triton``, ``reference``, ``chunked`` do).
        masked_causal: the call needs a per-query mask (causal with ``S_q > 1``, a window, segment ids); with
            ``mask_bytes > 0`` ``sdpa`` would build that mask densely.
        k_len: ``S_k`` (None: not known).
        has_sinks: attention sinks are given: as ``has_softcap``, ``sdpa`` cannot apply them.
        has_segments: segment or group ids are given (the Triton kernel has none; ``sdpa`` builds them as a mask).
    """
    lo, hi = TRITON_HEAD_DIMS
    budget = DEFAULT_MEMORY_BUDGET if memory_budget is None else memory_budget
    triton_fits = (
        device_type == "cuda"
        and dtype in (torch.float16, torch.bfloat16)
        and lo <= head_dim <= hi
        and lo <= value_dim <= hi
        and not has_bias
        and not has_segments
        and triton_ok
    )
    if has_softcap or has_sinks:  # not sdpa
        if triton_fits:
            return "triton"
        return "reference" if score_bytes <= budget else "chunked"
    decode = q_len is not None and q_len <= DECODE_MAX_QUERIES
    if triton_fits and not decode:
        return "triton"
    if device_type == "cuda" and sdpa_fused and mask_bytes <= budget:
        return "sdpa"
    if score_bytes <= budget:
        pairs = (q_len or 0) * (k_len or 0)
        if device_type == "cpu" and masked_causal and mask_bytes > 0 and pairs >= CPU_MASKED_CHUNKED_MIN_PAIRS:
            return "chunked"
        return "sdpa"
    return "triton" if triton_fits else "chunked"


def choose_backend(
    a: AttentionInputs, *, memory_budget: int | None = None, allow_triton: bool = True, device_type: str | None = None
) -> str:
    """The ``auto`` rule (module docs) applied to these inputs. ``allow_triton=False`` applies it without
    Triton; ``device_type="cuda"`` tells what it would choose for the same shapes on a CUDA device."""
    _check_budget(memory_budget)
    return auto_rule(**dispatch_facts(a, device_type=device_type, allow_triton=allow_triton), memory_budget=memory_budget)


def _check_budget(memory_budget: int | None) -> None:
    bad = memory_budget is not None and (
        isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget < 0
    )
    if bad:
        raise ValueError(f"memory_budget must be a non-negative int (bytes) or None, got {memory_budget!r}")
