"""The computation behind the "Attention core" tab: select key blocks, run block-sparse attention,
compare it with dense attention, time every backend.

Inputs are synthetic: ``q, k, v`` of shape ``(1, H, S, D)`` drawn from a seeded normal, with a few
"salient" key blocks (keys shifted along a shared direction that the queries also lean towards), so the
top-k selection has something to find and block-sparse attention is close to dense.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["DemoConfig", "run_attention_demo", "block_map"]


@dataclass(kw_only=True)
class DemoConfig:
    """One run of the attention demo."""

    seq_len: int = 2048  # tokens S (queries = keys); small enough that the dense reference runs quickly
    block_size: int = 64  # rows per query block and key block
    topk: int = 8  # key blocks per query block, first and diagonal blocks included
    causal: bool = True  # bottom-right aligned causal mask
    heads: int = 4  # attention heads H
    head_dim: int = 64  # head dim D
    salient_blocks: int = 4  # key blocks made salient in the synthetic inputs
    seed: int = 0  # RNG seed of the inputs
    max_reference_len: int = 4096  # the fp32 reference materialises S×S scores: only run it up to this length

    def __post_init__(self) -> None:
        if not 1 <= self.seq_len <= 65536:
            raise ValueError(f"seq_len must be in [1, 65536], got {self.seq_len}")
        if self.block_size not in (16, 32, 64, 128, 256):
            raise ValueError(f"block_size must be one of 16, 32, 64, 128, 256, got {self.block_size}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.heads < 1 or self.head_dim < 1:
            raise ValueError(f"heads ({self.heads}) and head_dim ({self.head_dim}) must be >= 1")
        if self.salient_blocks < 0:
            raise ValueError(f"salient_blocks must be >= 0, got {self.salient_blocks}")


def _inputs(cfg: DemoConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    g = torch.Generator().manual_seed(cfg.seed)
    shape = (1, cfg.heads, cfg.seq_len, cfg.head_dim)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    nk = math.ceil(cfg.seq_len / cfg.block_size)
    direction = torch.randn(cfg.heads, 1, cfg.head_dim, generator=g)
    direction = direction / direction.norm(dim=-1, keepdim=True)
    salient = sorted(torch.randperm(nk, generator=g)[: cfg.salient_blocks].tolist())
    # Salient keys gain ~5 logits with every query (scale 1/sqrt(D)): attention concentrates on them.
    boost = 5.0 * math.sqrt(cfg.head_dim)
    for j in salient:
        k[0, :, j * cfg.block_size : (j + 1) * cfg.block_size] += boost * direction
    q += direction  # queries lean towards the salient direction
    return q, k, v, salient


def block_map(block_index: torch.Tensor, nk: int, *, causal: bool, seq_len: int, block_size: int) -> torch.Tensor:
    """``(NQ, NK)`` int map of one head: 2 = selected, 1 = visible but skipped, 0 = causally invisible."""
    nq = block_index.shape[0]
    out = torch.ones(nq, nk, dtype=torch.int64)
    if causal:
        last = torch.clamp((torch.arange(nq) + 1) * block_size, max=seq_len) - 1
        out[(torch.arange(nk)[None, :] * block_size) > last[:, None]] = 0
    ids = block_index[block_index >= 0]
    rows = (block_index >= 0).nonzero()[:, 0]
    out[rows, ids] = 2
    return out


def _timed(fn) -> tuple[torch.Tensor, float]:
    """Median of 3 calls after a warm-up when a call is fast (< 0.3 s); otherwise the first call alone."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    if first > 0.3:
        return out, first
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, sorted(times)[1]


@torch.no_grad()
def run_attention_demo(cfg: DemoConfig) -> dict:
    """Select blocks, run block-sparse and dense attention, time each backend.

    Returns a dict with ``block_map`` (``(NQ, NK)`` of head 0, see :func:`block_map`), ``density``,
    ``salient_blocks``, ``max_abs_err`` and ``rel_err`` (block-sparse vs the dense fp32 reference, or vs
    SDPA when the reference is skipped), ``err_vs`` (which), and ``timings``: a list of
    ``{"backend", "seconds", "note"}``.
    """
    from core.attention import BACKENDS, attention
    from core.blocksparse import block_density, block_sparse_attention, select_blocks

    q, k, v, salient = _inputs(cfg)
    S, bs = cfg.seq_len, cfg.block_size
    nk = math.ceil(S / bs)
    timings = []
    idx, t_sel = _timed(lambda: select_blocks(q, k, block_size=bs, topk=cfg.topk, causal=cfg.causal))
    sparse, t_att = _timed(lambda: block_sparse_attention(q, k, v, idx, block_size=bs, causal=cfg.causal))
    density = block_density(idx, nk)
    timings.append({"backend": "block-sparse: selection", "seconds": t_sel, "note": f"top-{cfg.topk} of {nk} blocks"})
    timings.append({"backend": "block-sparse: attention", "seconds": t_att, "note": f"density {density:.1%}"})
    timings.append({"backend": "block-sparse: total", "seconds": t_sel + t_att, "note": ""})
    dense = {}
    for name in ("reference", "sdpa", "chunked"):
        if name not in BACKENDS:
            timings.append({"backend": name, "seconds": None, "note": "not available in this build"})
            continue
        if name == "reference" and S > cfg.max_reference_len:
            timings.append({"backend": name, "seconds": None, "note": f"skipped: S > {cfg.max_reference_len}"})
            continue
        dense[name], t = _timed(lambda n=name: attention(q, k, v, causal=cfg.causal, backend=n))
        timings.append({"backend": name, "seconds": t, "note": "dense"})
    err_vs = "reference" if "reference" in dense else "sdpa"
    ref = dense[err_vs].float()
    diff = (sparse.float() - ref)
    return {
        "block_map": block_map(idx[0, 0], nk, causal=cfg.causal, seq_len=S, block_size=bs),
        "density": density,
        "salient_blocks": salient,
        "max_abs_err": float(diff.abs().max()),
        "rel_err": float(diff.norm() / ref.norm().clamp(min=1e-30)),
        "err_vs": err_vs,
        "timings": timings,
    }
