"""Querent: query-aware region attention over the patches of a whole-slide image.

Patches are grouped into spatial *regions* of ``R×R`` patch cells (from their grid coordinates). The
sequence is laid out region by region, each region padded to ``R²`` slots, so region ``n`` is block ``n``
of ``block_size = R²`` rows in the block-sparse format of :mod:`core.blocksparse`. In every layer:

1. keys of each region are summarised by their per-dimension min and max (``core.blocksparse.block_summaries``);
2. each region's queries score every region by the upper bound ``Σ_i max(q_i·min_i, q_i·max_i)``
   (max over the region's queries, ``core.blocksparse.query_block_upper_bound``);
3. the region attends to its own 3×3 neighbourhood of regions plus the ``topk`` best-scoring other
   regions, exactly (``core.blocksparse.block_sparse_attention``).

``selection`` chooses who picks the ``topk`` regions: ``"region"`` (above, the default: one choice per query
region, shared by its queries), ``"query"`` (every query picks its own ``topk`` by its own bound, as in
the published per-query bound; each query attends exactly its own choice, computed by key region, so it
costs more than ``"region"``), or ``"dense"`` (exact attention
over all patches, ``core.attention``: the same weights without selection, the reference for the
approximation error).

Positions (``pos_encoding``): a 2-D sine-cosine code of the patch's grid cell added to its input token
(``"sincos"``, the default), or 2-D RoPE (``core.rope.RotaryEmbedding2D``) applied to queries and keys in every
layer (``"rope2d"``), so that a score depends on the offset between two patches; ``"both"``; ``"none"``.

Cost per layer: ``O(N · (9 + topk) · R²)`` instead of ``O(N²)``. Attention pooling (gated, ABMIL-style)
turns the tokens into a slide embedding; a head gives class logits or a survival risk. The pooling
weights are the per-patch attention used for heatmaps.

Usage::

    model = Querent(QuerentConfig(in_dim=256, num_classes=2))
    out = model(features_ND, coords_N2, patch_size_level0=256)
    out.logits, out.attention  # (1, C), (N,)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from core.attention import attention
from core.blocksparse import block_sparse_attention, block_summaries, block_upper_bound
from core.layers import MLP, MultiHeadAttention
from core.rope import RotaryEmbedding2D, apply_rope

__all__ = ["QuerentConfig", "Querent", "RegionLayout", "build_regions", "MILOutput", "GatedAttentionPool",
           "sincos_2d", "querent_small", "select_regions", "per_query_region_attention", "SELECTIONS", "POS_ENCODINGS",
           "POOL_FROM"]

#: Values of ``QuerentConfig.selection``.
SELECTIONS = ("region", "query", "dense")
#: Values of ``QuerentConfig.pos_encoding``.
POS_ENCODINGS = ("sincos", "rope2d", "both", "none")
#: Values of ``QuerentConfig.pool_from``.
POOL_FROM = ("tokens", "embed_gate", "embed_values")


@dataclass(kw_only=True)
class QuerentConfig:
    """Hyperparameters of :class:`Querent`."""

    in_dim: int  # patch feature size (encoder output)
    dim: int = 256  # token width inside the model
    depth: int = 2  # Querent layers
    num_heads: int = 4  # attention heads; must divide dim
    region_size: int = 8  # R: a region is R×R patch cells; block size R² (64 at R=8)
    topk: int = 8  # regions chosen by the upper-bound score per query region, beyond its neighbourhood
    neighbourhood: int = 1  # own region plus regions within this Chebyshev distance are always attended (1 = 3×3)
    mlp_ratio: float = 2.0  # MLP hidden size / dim
    dropout: float = 0.1  # dropout on the input projection, attention output and MLP
    num_classes: int = 2  # classification outputs; 1 with task="survival" (a risk score)
    task: str = "cls"  # "cls" (logits) or "survival" (risk: higher = earlier event)
    pool_hidden: int = 128  # hidden size of the gated attention pooling
    region_score: str = "max"  # "max": per-query bound, max over the region's queries (tight, O(N·N/R²·D));
    # "mean": bound for the region's mean query (cheaper, O((N/R²)²·D), for very large bags; not a bound for every query)
    backend: str = "auto"  # block-sparse backend: "auto" (Triton on CUDA when available), "torch", "triton"
    select_budget_mb: float = 32.0  # working-set budget (MiB) of one batch of query regions in region selection
    selection: str = "region"  # "region": topk chosen per query region (max bound over its queries);
    # "query": topk chosen per query by its own bound; "dense": exact attention over all patches (no selection)
    dense_backend: str = "auto"  # core.attention backend of selection="dense" ("auto" is chunked on CPU for large bags)
    query_group: int = 32  # selection="query": queries scored together against one chosen region (tile; cost knob, exact)
    pos_encoding: str = "sincos"  # "sincos": 2-D sine-cosine embedding added to the input; "rope2d": 2-D rotary
    # embedding of queries and keys in every layer (scores depend on the patches' offset); "both"; "none"
    rope_scale: float = 0.25  # rope2d: rotary position units per grid cell (sincos uses the same scale)
    nystrom_landmarks: int = 0  # TransMIL only: Nyström landmarks (0: dim // 2, TransMIL's rule)
    # What the attention pooling reads (the normalised pre-layer embedding is the patch's own embedding with its
    # position code; the tokens are the layers' output; both go through the final LayerNorm): "tokens" (gate scores
    # and pooled values from the tokens), "embed_gate" (gate scores from the pre-layer embedding, values from the
    # tokens: the layers cannot move the pooling's weights), "embed_values" (gate scores from the tokens, values
    # from the pre-layer embedding: the layers change only which patches are weighted, never what is pooled).
    # The same model at depth 0.
    pool_from: str = "tokens"
    # LayerNorm on what the pooling reads (tokens and pre-layer embedding); False: they are pooled unnormalised, as
    # ABMIL pools its embedding (a LayerNorm divides every patch by its own spread, so a strong and a weak copy of a
    # pattern look alike afterwards)
    final_norm: bool = True

    def __post_init__(self) -> None:
        if self.in_dim < 1 or self.dim < 1:
            raise ValueError(f"in_dim ({self.in_dim}) and dim ({self.dim}) must be >= 1")
        if self.dim % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide dim ({self.dim})")
        if self.depth < 0:
            raise ValueError(f"depth ({self.depth}) must be >= 0")
        if self.region_size < 1:
            raise ValueError(f"region_size ({self.region_size}) must be >= 1")
        if self.topk < 0 or self.neighbourhood < 0:
            raise ValueError(f"topk ({self.topk}) and neighbourhood ({self.neighbourhood}) must be >= 0")
        if self.query_group < 1:
            raise ValueError(f"query_group ({self.query_group}) must be >= 1")
        if not self.select_budget_mb > 0:
            raise ValueError(f"select_budget_mb ({self.select_budget_mb}) must be > 0")
        if self.pos_encoding not in POS_ENCODINGS:
            raise ValueError(f"pos_encoding ({self.pos_encoding!r}) must be one of {', '.join(POS_ENCODINGS)}")
        if self.pos_encoding in ("rope2d", "both") and (self.dim // self.num_heads) % 4:
            raise ValueError(f"pos_encoding={self.pos_encoding!r} needs a head size (dim / num_heads = "
                             f"{self.dim // self.num_heads}) divisible by 4")
        if not self.rope_scale > 0:
            raise ValueError(f"rope_scale ({self.rope_scale}) must be > 0")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection ({self.selection!r}) must be one of {', '.join(SELECTIONS)}")
        if self.region_score not in ("max", "mean"):
            raise ValueError(f"region_score ({self.region_score!r}) must be 'max' or 'mean'")
        if self.task not in ("cls", "survival"):
            raise ValueError(f"task ({self.task!r}) must be 'cls' or 'survival'")
        if self.task == "survival":
            self.num_classes = 1
        if self.num_classes < 1:
            raise ValueError(f"num_classes ({self.num_classes}) must be >= 1")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"dropout ({self.dropout}) must be in [0, 1)")
        if self.pool_from not in POOL_FROM:
            raise ValueError(f"pool_from ({self.pool_from!r}) must be one of {', '.join(POOL_FROM)}")

    @property
    def block_size(self) -> int:
        return self.region_size * self.region_size


def querent_small(in_dim: int, **kw) -> QuerentConfig:
    """The size used in this project's benchmarks: width 256, 2 layers, 4 heads, 8×8 regions, top-8."""
    return QuerentConfig(in_dim=in_dim, **kw)


@dataclass
class MILOutput:
    """What a slide model returns."""

    logits: torch.Tensor  # (1, C) class logits, or (1, 1) risk for survival
    attention: torch.Tensor  # (N,) pooling weight of each patch (sums to 1)
    embedding: torch.Tensor  # (1, dim) slide embedding
    block_index: list[torch.Tensor] | None = None  # per layer: (H, NR, K) region ids chosen per query region
    # (selection="region"), (H, S, K) per query slot of the padded sequence (selection="query"), None ("dense")
    layout: RegionLayout | None = None


# ----------------------------------------------------------------------------------------------- regions


@dataclass
class RegionLayout:
    """Where each patch sits in the region-padded sequence."""

    slot: torch.Tensor  # (N,) int64 position of each patch in the padded sequence (length NR·R²)
    padded_len: int  # NR·R²
    region_xy: torch.Tensor  # (NR, 2) int64 region column/row on the region grid
    grid_xy: torch.Tensor  # (N, 2) int64 patch column/row on the patch grid
    neighbours: torch.Tensor  # (NR, M) int64 region ids always attended (own first), -1 padded
    region_size: int
    fill_src: torch.Tensor  # (padded_len,) int64: each slot itself if it holds a patch, else a filled slot of its region

    @property
    def num_regions(self) -> int:
        return int(self.region_xy.shape[0])

    def region_of_patch(self) -> torch.Tensor:
        return self.slot // (self.region_size * self.region_size)


def build_regions(coords_N2: torch.Tensor, patch_size_level0: float, region_size: int, neighbourhood: int = 1) -> RegionLayout:
    """Group patches into R×R-cell regions and lay them out region by region.

    Args:
        coords_N2: level-0 (x, y) of each patch's top-left corner.
        patch_size_level0: patch side (stride of the grid) in level-0 pixels.
        region_size: R.
        neighbourhood: regions within this Chebyshev distance (on the region grid) are neighbours.
    """
    if coords_N2.dim() != 2 or coords_N2.shape[1] != 2:
        raise ValueError(f"coords must be (N, 2), got {tuple(coords_N2.shape)}")
    if not patch_size_level0 > 0:
        raise ValueError(f"patch_size_level0 ({patch_size_level0}) must be > 0")
    dev = coords_N2.device
    c = coords_N2.to(torch.float64)
    grid = torch.round((c - c.min(dim=0).values) / float(patch_size_level0)).long() if len(c) else c.long()  # (N, 2)
    R = region_size
    reg = grid // R  # (N, 2) region column/row
    inner = (grid % R)[:, 1] * R + (grid % R)[:, 0]  # (N,) slot inside the region
    width = int(reg[:, 0].max().item()) + 1 if len(reg) else 1
    key = reg[:, 1] * width + reg[:, 0]  # (N,) region key, row-major
    uniq, region_id = torch.unique(key, return_inverse=True)  # regions sorted row-major
    slot = region_id * (R * R) + inner
    if len(slot) and torch.unique(slot).numel() != slot.numel():
        raise ValueError("two patches fall into the same grid cell: coords must lie on a grid of step patch_size_level0")
    region_xy = torch.stack([uniq % width, uniq // width], dim=1)  # (NR, 2)
    nr = region_xy.shape[0]
    # Neighbours: look up every offset in a dense region-grid table (cheap: the region grid is small).
    if nr:
        height = int(region_xy[:, 1].max().item()) + 1
        table = torch.full((height + 2 * neighbourhood, width + 2 * neighbourhood), -1, dtype=torch.long, device=dev)
        table[region_xy[:, 1] + neighbourhood, region_xy[:, 0] + neighbourhood] = torch.arange(nr, device=dev)
        offs = [(0, 0)] + [(dy, dx) for dy in range(-neighbourhood, neighbourhood + 1)
                           for dx in range(-neighbourhood, neighbourhood + 1) if (dy, dx) != (0, 0)]
        neigh = torch.stack([table[region_xy[:, 1] + neighbourhood + dy, region_xy[:, 0] + neighbourhood + dx]
                             for dy, dx in offs], dim=1)  # (NR, M)
    else:
        neigh = torch.zeros(0, 1, dtype=torch.long, device=dev)
    # Empty slots borrow a real slot of their region (used so padding never enters a region's query bound).
    S = nr * R * R
    first = torch.full((max(nr, 1),), S, dtype=torch.long, device=dev)
    if len(slot):
        first = first.scatter_reduce(0, region_id, slot, reduce="amin")
    fill_src = torch.arange(S, device=dev)
    filled = torch.zeros(S, dtype=torch.bool, device=dev)
    filled[slot] = True
    fill_src = torch.where(filled, fill_src, first[fill_src // (R * R)] if S else fill_src)
    return RegionLayout(slot=slot, padded_len=S, region_xy=region_xy, grid_xy=grid, neighbours=neigh,
                        region_size=R, fill_src=fill_src)


def _region_chunk(layout: RegionLayout, B: int, H: int, head_dim: int, budget_bytes: int) -> int:
    """Query regions scored per step so that one step's working set stays under ``budget_bytes``.

    A step over ``C`` regions holds the queries' bounds against every region (``B·H·C·R²·NR`` fp32), the
    split queries (``B·H·C·R²·2·head_dim``) and the per-region maxima (``B·H·C·NR``).
    """
    bs = layout.region_size**2
    nr = max(1, layout.num_regions)
    per_region = 4 * B * H * (bs * nr + 2 * bs * head_dim + 3 * nr) + 8 * bs
    return max(1, min(nr, budget_bytes // max(1, per_region)))


def _region_summaries(k_BHSD: torch.Tensor, key_padding_mask: torch.Tensor, bs: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-region min and max of the real keys, ``(B, H, NR, D)`` fp32, computed ``chunk`` regions at a time."""
    B, H, S, D = k_BHSD.shape
    nr = S // bs
    kmin = torch.empty(B, H, nr, D, dtype=torch.float32, device=k_BHSD.device)
    kmax = torch.empty_like(kmin)
    for c0 in range(0, nr, chunk):
        c1 = min(nr, c0 + chunk)
        lo, hi, _ = block_summaries(k_BHSD[:, :, c0 * bs : c1 * bs], bs, key_padding_mask=key_padding_mask[:, c0 * bs : c1 * bs])
        kmin[:, :, c0:c1], kmax[:, :, c0:c1] = lo, hi
    return kmin, kmax


def select_regions(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, layout: RegionLayout, topk: int,
                   key_padding_mask: torch.Tensor, score: str = "max", budget_bytes: int = 32 * 2**20) -> torch.Tensor:
    """Region ids per query region: the neighbourhood plus the ``topk`` best other regions by the Quest bound.

    ``score="max"``: the bound of each real query of the region, maxed over them; ``score="mean"``: the bound
    of the region's mean query (one row per region, so the scoring costs O(NR²·D) instead of O(N·NR·D)).

    Memory-bounded: query regions are scored and ranked a batch at a time, the batch sized so its working
    set (bounds of its queries against every region) stays under ``budget_bytes``; only the chosen ids are
    kept, so no ``N × NR`` (or ``NR × NR`` score) tensor is ever built for the whole bag.

    Returns:
        int64 (B, H, NR, K) in the :mod:`core.blocksparse` format (ascending ids, then -1).
    """
    bs = layout.region_size**2
    B, H, _, hd = q_BHSD.shape
    nr = layout.num_regions
    chunk = _region_chunk(layout, B, H, hd, budget_bytes)
    kmin, kmax = _region_summaries(k_BHSD, key_padding_mask, bs, chunk)  # (B, H, NR, hd) each
    neigh = layout.neighbours  # (NR, M)
    M = neigh.shape[1]
    k_extra = min(topk, nr)
    out = torch.empty(B, H, nr, M + k_extra, dtype=torch.long, device=q_BHSD.device)
    q = q_BHSD.detach()
    for c0 in range(0, nr, chunk):
        c1 = min(nr, c0 + chunk)
        C = c1 - c0
        if score == "mean":
            valid = (~key_padding_mask[:, c0 * bs : c1 * bs]).to(q.dtype).view(B, 1, C, bs, 1)
            q_sum = (q[:, :, c0 * bs : c1 * bs].reshape(B, H, C, bs, hd) * valid).sum(3)  # (B, H, C, hd)
            scores = block_upper_bound(q_sum / valid.sum(3).clamp(min=1), kmin, kmax)  # (B, H, C, NR)
        else:
            # Padded query rows copy a real query of their region, so the max is over real queries only.
            rows = q[:, :, layout.fill_src[c0 * bs : c1 * bs]]  # (B, H, C·bs, hd)
            scores = block_upper_bound(rows, kmin, kmax).view(B, H, C, bs, nr).amax(dim=3)  # (B, H, C, NR)
        own = torch.where(neigh[c0:c1] < 0, nr, neigh[c0:c1])  # (C, M), nr = none
        out[:, :, c0:c1] = _neighbours_plus_topk(scores, own[None, None], k_extra, nr)
    return torch.where(out >= nr, -1, out)


def _neighbours_plus_topk(scores: torch.Tensor, own_ids: torch.Tensor, k_extra: int, nr: int) -> torch.Tensor:
    """Ascending region ids: the always-attended ``own_ids`` plus the ``k_extra`` best other regions by ``scores``.

    Args:
        scores: (..., NR) bounds, overwritten (the neighbours' become -inf: they are not ranked).
        own_ids: (..., M) int64 neighbour ids, ``nr`` = none; its leading dims broadcast to those of ``scores``.

    Returns:
        int64 (..., M + k_extra), ``nr`` (= none) last.
    """
    forced = torch.zeros(*own_ids.shape[:-1], nr + 1, dtype=torch.bool, device=scores.device)
    forced.scatter_(-1, own_ids, True)  # at own_ids' (unbroadcast) shape
    scores.masked_fill_(forced[..., :nr], float("-inf"))
    ids = own_ids = own_ids.expand(*scores.shape[:-1], own_ids.shape[-1])
    if k_extra > 0:
        top = scores.topk(k_extra, dim=-1)
        # A -inf bound (a neighbour, an empty region) is never chosen.
        extra = torch.where(torch.isneginf(top.values), torch.full_like(top.indices, nr), top.indices)
        ids = torch.cat([own_ids, extra], dim=-1)
    return ids.sort(dim=-1).values


def _per_query_chunk(layout: RegionLayout, B: int, H: int, head_dim: int, k_sel: int, budget_bytes: int) -> int:
    """Query regions whose selections :func:`per_query_region_attention` computes per step.

    A step over ``C`` regions holds the bounds of its queries against every region (``B·H·C·R²·NR`` fp32),
    their top-k (values and ids) and the ids each query attends (``B·H·C·R²·k_sel`` int64, a few copies).
    """
    bs = layout.region_size**2
    nr = max(1, layout.num_regions)
    per_region = B * H * bs * (4 * nr + 40 * k_sel + 4 * head_dim)
    return max(1, min(nr, budget_bytes // max(1, per_region)))


def _pair_attention(q_BHSD: torch.Tensor, ids_BHSK: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                    kvalid: torch.Tensor, nr: int, scale: float, budget_bytes: int, tile: int) -> torch.Tensor:
    """Exact attention of every query over the keys of its own regions, computed by key region.

    The (query, region) pairs are sorted by region and packed into tiles of ``tile`` queries of one region, so
    a region's keys and values are read once per tile and scored against its queries with one matrix product;
    no key is gathered per query and no query scores a region it did not choose. Each query's softmax is
    assembled across its tiles (running maxima and sums by scatter). Queries go in batches sized so that one
    batch's working set stays under ``budget_bytes``.

    Args:
        q_BHSD: (B, H, S, D) queries.
        ids_BHSK: (B, H, S, K) int64 region ids each query attends; ``nr`` = none.
        k_blocks, v_blocks: (B, H, NR, R², D) keys and values in region blocks.
        kvalid: (B, NR, R²) bool, True = a real patch.

    Returns:
        (B, H, S, D) attention output.
    """
    B, H, S, D = q_BHSD.shape
    K = ids_BHSK.shape[-1]
    bs = k_blocks.shape[-2]
    BH, dev = B * H, q_BHSD.device
    kf, vf = k_blocks.reshape(BH * nr, bs, D), v_blocks.reshape(BH * nr, bs, D)
    kvf = kvalid[:, None].expand(B, H, nr, bs).reshape(BH * nr, bs)
    qf, idf = q_BHSD.reshape(BH * S, D), ids_BHSK.reshape(BH * S, K)
    bh_of_q = torch.arange(BH, device=dev).repeat_interleave(S)
    # per query: K pairs, each a tile row of scores and weights (fp32, a few copies) plus its bookkeeping
    per_query = K * (16 * bs + 8 * D + 64)
    nq = max(1, min(BH * S, budget_bytes // per_query))
    outs = []
    for c0 in range(0, BH * S, nq):
        c1 = min(BH * S, c0 + nq)
        n = c1 - c0
        ids = idf[c0:c1]
        ok = ids < nr
        lq = torch.arange(n, device=dev)[:, None].expand_as(ids)[ok]  # the query of each pair
        gr = (bh_of_q[c0:c1, None] * nr + ids)[ok]  # its key region, over all batches and heads
        gr, order = gr.sort()
        lq = lq[order]
        counts = torch.bincount(gr, minlength=BH * nr)
        ntile = (counts + tile - 1) // tile
        tile_start = torch.cumsum(ntile, 0) - ntile
        pair_start = torch.cumsum(counts, 0) - counts
        pos = tile_start[gr] * tile + (torch.arange(gr.numel(), device=dev) - pair_start[gr])  # (tile, row), flat
        T = int(ntile.sum())
        t_reg = torch.repeat_interleave(torch.arange(BH * nr, device=dev), ntile)  # key region of each tile
        qmap = torch.full((T * tile,), n, dtype=torch.long, device=dev)  # query of each tile row (n = empty row)
        qmap[pos] = lq
        qt = qf.new_zeros(T * tile, D).index_put((pos,), qf[c0:c1][lq] * scale).view(T, tile, D)
        st = torch.bmm(qt, kf[t_reg].transpose(1, 2))  # (T, tile, R²)
        st = st.masked_fill_(~kvf[t_reg][:, None, :], float("-inf"))  # empty slots; every region has a real patch
        mx = st.new_full((n + 1,), float("-inf")).scatter_reduce(0, qmap, st.detach().amax(-1).view(-1), "amax")
        mx[n] = 0.0  # empty rows: finite, discarded
        e = torch.exp(st - mx[qmap].view(T, tile, 1))
        den = e.new_zeros(n + 1).index_add(0, qmap, e.sum(-1).view(-1))
        ot = torch.bmm(e, vf[t_reg]).view(T * tile, D)
        outs.append(ot.new_zeros(n + 1, D).index_add(0, qmap, ot)[:n] / den[:n, None])
    return torch.cat(outs, 0).view(B, H, S, D)


def per_query_region_attention(q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, layout: RegionLayout,
                               topk: int, key_padding_mask: torch.Tensor, budget_bytes: int = 32 * 2**20,
                               query_group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Region attention with the ``topk`` regions chosen **per query** by its own Quest bound.

    Every query attends exactly to the keys of its region's neighbourhood (``layout.neighbours``) plus the
    ``topk`` other regions with the highest bound ``Σ_i max(q_i·min_i, q_i·max_i)`` for that query. The
    attention is computed by key region: the queries that chose a region are scored against its keys in
    tiles of ``query_group`` queries (:func:`_pair_attention`), so the cost is that of the chosen pairs, not
    of a union of choices. The result is exact for every tile size; only the cost changes. Selections are
    computed a batch of query regions at a time and the attention a batch of queries at a time, each sized
    to ``budget_bytes``.

    Args:
        q_BHSD, k_BHSD, v_BHSD: (B, H, S, hd) in the region-padded layout (S = NR·R²).
        key_padding_mask: (B, S) bool, True = empty slot (never attended).

    Returns:
        (B, H, S, hd) attention output (rows of empty slots are computed but meaningless) and the int64
        (B, H, S, M + topk) region ids each query attended (ascending, then -1).
    """
    bs = layout.region_size**2
    B, H, S, hd = q_BHSD.shape
    nr = layout.num_regions
    if S != nr * bs:
        raise ValueError(f"sequence length ({S}) must be num_regions·R² ({nr}·{bs})")
    neigh = layout.neighbours  # (NR, M)
    M = neigh.shape[1]
    k_extra = min(topk, nr)
    width = min(M + k_extra, nr)  # ids kept per query (every valid id fits: a query attends at most nr regions)
    tile = max(1, int(query_group))
    chunk = _per_query_chunk(layout, B, H, hd, M + k_extra, budget_bytes)
    kmin, kmax = _region_summaries(k_BHSD.detach(), key_padding_mask, bs, max(1, chunk))  # (B, H, NR, hd)
    neigh_ids = torch.where(neigh < 0, nr, neigh)  # (NR, M), nr = none
    ids_all = []
    for c0 in range(0, nr, chunk):
        c1 = min(nr, c0 + chunk)
        C = c1 - c0
        # Padded query rows copy a real query of their region, so every row's choice is a real query's.
        rows = q_BHSD.detach()[:, :, layout.fill_src[c0 * bs : c1 * bs]]  # (B, H, C·bs, hd)
        scores = block_upper_bound(rows, kmin, kmax).view(B, H, C, bs, nr)
        ids = _neighbours_plus_topk(scores, neigh_ids[c0:c1][None, None, :, None, :], k_extra, nr)
        ids_all.append(ids[..., :width].reshape(B, H, C * bs, width))  # ascending; nr = none
    ids = torch.cat(ids_all, dim=2)  # (B, H, S, width)
    o = _pair_attention(q_BHSD, ids, k_BHSD.reshape(B, H, nr, bs, hd), v_BHSD.reshape(B, H, nr, bs, hd),
                        (~key_padding_mask).reshape(B, nr, bs), nr, 1.0 / math.sqrt(hd), budget_bytes, tile)
    return o, torch.where(ids >= nr, -1, ids)


# ------------------------------------------------------------------------------------------------ layers


def sincos_2d(grid_xy_N2: torch.Tensor, dim: int, scale: float = 1.0) -> torch.Tensor:
    """Fixed 2D sine-cosine position embedding (N, dim) of grid positions (half the channels per axis)."""
    if dim % 4:
        raise ValueError(f"dim ({dim}) must be divisible by 4 for the 2D position embedding")
    n = dim // 4
    freq = torch.exp(-math.log(10000.0) * torch.arange(n, device=grid_xy_N2.device, dtype=torch.float32) / n)
    parts = []
    for a in range(2):
        ang = grid_xy_N2[:, a : a + 1].float() * scale * freq[None]  # (N, n)
        parts += [ang.sin(), ang.cos()]
    return torch.cat(parts, dim=1)


class GatedAttentionPool(nn.Module):
    """Gated attention pooling (Ilse et al.): ``a_i ∝ exp(w·(tanh(V h_i) ⊙ σ(U h_i)))``; returns Σ a_i h_i and a
    (Σ a_i v_i when other per-patch ``values_ND`` are given)."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.v = nn.Linear(dim, hidden)
        self.u = nn.Linear(dim, hidden)
        self.w = nn.Linear(hidden, 1)
        self.drop = nn.Dropout(dropout)

    def forward(self, h_ND: torch.Tensor, values_ND: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.w(self.drop(torch.tanh(self.v(h_ND)) * torch.sigmoid(self.u(h_ND)))).squeeze(-1)  # (N,)
        a = torch.softmax(s, dim=0)
        vals = h_ND if values_ND is None else values_ND
        return (a[:, None] * vals).sum(0, keepdim=True), a  # (1, D), (N,)


class QuerentLayer(nn.Module):
    """Pre-norm block: region-selective self-attention, then an MLP, each with a residual."""

    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.attn = MultiHeadAttention(cfg.dim, cfg.num_heads, dropout=cfg.dropout)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, int(cfg.dim * cfg.mlp_ratio), dropout=cfg.dropout)

    def forward(self, x_BSD: torch.Tensor, layout: RegionLayout, pad_BS: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.norm1(x_BSD)
        q = self.attn.project_q(h)  # (B, H, S, hd)
        k, v = self.attn.project_kv(h)  # (B, H, S, hd) each
        del h
        if rope is not None:  # rotate by each slot's grid position: scores depend on offsets (bounds stay valid)
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        # Contiguous keys/values: core.blocksparse reads them in block layout as views (S is a multiple of the
        # block size) instead of copying them, and the projections' (B, S, H·hd) buffers are freed here.
        k, v = k.contiguous(), v.contiguous()
        budget = int(self.cfg.select_budget_mb * 2**20)
        if self.cfg.selection == "dense":
            real = layout.slot  # exact attention over the real patches only
            o_real = attention(q[:, :, real], k[:, :, real], v[:, :, real], backend=self.cfg.dense_backend)
            o = q.new_zeros(q.shape).index_copy(2, real, o_real)  # (B, H, S, hd)
            idx = None
        elif self.cfg.selection == "query":
            o, idx = per_query_region_attention(q, k, v, layout, self.cfg.topk, pad_BS, budget,
                                                self.cfg.query_group)  # idx (B, H, S, K)
        else:
            idx = select_regions(q, k, layout, self.cfg.topk, pad_BS, self.cfg.region_score,
                                 budget_bytes=budget)  # (B, H, NR, K)
            o = block_sparse_attention(q, k, v, idx, block_size=self.cfg.block_size, key_padding_mask=pad_BS,
                                       backend=self.cfg.backend)
        del q, k, v  # without autograd their memory is free for the MLP below
        x_BSD = x_BSD + self.attn.merge(o)
        del o
        return x_BSD + self.mlp(self.norm2(x_BSD)), idx


class Querent(nn.Module):
    """The Querent slide model (see module docstring). One slide per call (bags differ in size)."""

    def __init__(self, cfg: QuerentConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Sequential(nn.Linear(cfg.in_dim, cfg.dim), nn.GELU(), nn.Dropout(cfg.dropout))
        self.layers = nn.ModuleList([QuerentLayer(cfg) for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.dim) if cfg.final_norm else nn.Identity()
        self.pool = GatedAttentionPool(cfg.dim, cfg.pool_hidden, cfg.dropout)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        self.rope = (RotaryEmbedding2D(cfg.dim // cfg.num_heads) if cfg.pos_encoding in ("rope2d", "both") else None)
        # True: the layers are left out and the model is its depth-0 form (embedding, pooling, head); set by training
        # while TrainConfig.layers_from holds them back, never saved
        self.skip_layers = False

    def forward(self, features_ND: torch.Tensor, coords_N2: torch.Tensor, *, patch_size_level0: float,
                return_index: bool = False) -> MILOutput:
        """Args:
            features_ND: patch features (N, in_dim).
            coords_N2: level-0 (x, y) of each patch's top-left corner, on a grid of step ``patch_size_level0``.
            patch_size_level0: grid step in level-0 pixels.
            return_index: also return each layer's chosen regions per query region.
        """
        if features_ND.dim() != 2 or features_ND.shape[1] != self.cfg.in_dim:
            raise ValueError(f"features must be (N, {self.cfg.in_dim}), got {tuple(features_ND.shape)}")
        N = features_ND.shape[0]
        if N == 0:
            raise ValueError("empty bag: the slide has no patches (no tissue found)")
        if coords_N2.shape != (N, 2):
            raise ValueError(f"coords must be ({N}, 2), got {tuple(coords_N2.shape)}")
        layout = build_regions(coords_N2.to(features_ND.device), patch_size_level0, self.cfg.region_size,
                               self.cfg.neighbourhood)
        h = self.embed(features_ND)
        if self.cfg.pos_encoding in ("sincos", "both"):
            h = h + sincos_2d(layout.grid_xy, self.cfg.dim, scale=0.25).to(features_ND.dtype)
        S = layout.padded_len
        rope = None
        if self.rope is not None:  # (row, col) of every slot; an empty slot takes its fill source's (it is masked)
            slot_xy = torch.zeros(S, 2, dtype=torch.long, device=features_ND.device)
            slot_xy[layout.slot] = layout.grid_xy.flip(1)
            rope = self.rope(slot_xy[layout.fill_src].float() * self.cfg.rope_scale)
        x = h.new_zeros(1, S, self.cfg.dim)
        x[0, layout.slot] = h  # (1, S, dim) region-padded sequence
        pre = self.norm(h) if self.cfg.pool_from != "tokens" else None  # (N, dim) (normalised) pre-layer embedding
        del h
        pad = torch.ones(1, S, dtype=torch.bool, device=x.device)
        pad[0, layout.slot] = False
        indices = []
        for layer in () if self.skip_layers else self.layers:
            x, idx = layer(x, layout, pad, rope)
            if return_index and idx is not None:
                indices.append(idx[0].detach())
        tok = self.norm(x[0, layout.slot])  # (N, dim) back in the input order
        if self.cfg.pool_from == "embed_gate":
            emb, a = self.pool(pre, tok)
        elif self.cfg.pool_from == "embed_values":
            emb, a = self.pool(tok, pre)
        else:
            emb, a = self.pool(tok)
        return MILOutput(self.head(emb), a, emb, indices if return_index and indices else None, layout)

    @torch.no_grad()
    def regions_for_patch(self, out: MILOutput, patch: int, layer: int = -1, head: int | None = None) -> torch.Tensor:
        """Region ids that ``patch`` (its region, with selection="region") attended to in ``layer`` (union over heads unless ``head``)."""
        if out.block_index is None or out.layout is None:
            raise ValueError("call forward(..., return_index=True) first")
        # Per-query selection stores one row per slot of the padded sequence, per-region one row per region.
        r = int(out.layout.slot[patch]) if self.cfg.selection == "query" else int(out.layout.region_of_patch()[patch])
        idx = out.block_index[layer][:, r] if head is None else out.block_index[layer][head : head + 1, r]
        ids = torch.unique(idx[idx >= 0])
        return ids
