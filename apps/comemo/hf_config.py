"""The CoMemo memory path's settings on a transformers model, and the positions it reads (position ids, and the
memory's own fixed-base RoPE tables, :class:`PlainRope`).

:class:`MemoryConfig` holds every architecture choice of the memory blocks that :class:`apps.comemo.hf.HFCoMemo`
inserts. Its defaults are the project's layout (what ``CoMemo.from_hf`` adds to a plain InternVL folder and what the
recipe trains); :meth:`MemoryConfig.release` is the layout of the authors' released checkpoints (CoMemo-2B/9B),
which ``python -m apps.comemo.convert`` records in the converted folder so that ``from_hf`` picks it by itself.

Two settings are deliberate fixes of the release, each its own switch (``reference=True`` sets both to the release):

- ``tile_order``: RoPE-DHR ids of a tiled image follow the crop order (row-major), the release numbers tiles
  column-first (:func:`core.rope.rope_dhr_position_ids`);
- ``decode_query_positions``: a generated token queries the memory at its own language-model position (``"next"``:
  one past the prompt's largest id, then counting up); the release uses the raw sequence count (``"count"``: the
  prompt's token count, then counting up), which under RoPE-DHR is larger than the token's position.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from core.rope import DHR_CELLS, DHR_TILE_ORDERS, rope_dhr_position_ids

__all__ = ["MemoryConfig", "PlainRope", "memory_layers", "dhr_position_ids", "image_runs", "QUERIES", "POSITIONS", "KV_HEADS", "FFNS",
           "DECODE_QUERY_POSITIONS"]

QUERIES = ("all", "text")
POSITIONS = ("dhr", "1d")
KV_HEADS = ("grouped", "full")
FFNS = ("silu", "swiglu")
DECODE_QUERY_POSITIONS = ("next", "count")


@dataclass(kw_only=True)
class MemoryConfig:
    """Architecture of the memory blocks (see module docs; ``None`` = take it from the language model)."""

    # a memory block before decoder layer i when (i + 1) % every == 0 (the release: 4)
    every: int = 4
    # tokens that query the memory: "all" (the release) or "text" (image tokens get no memory update)
    queries: str = "all"
    # position ids fed to the language model and the memory: RoPE-DHR ("dhr") or 0, 1, 2, ... ("1d")
    positions: str = "dhr"
    # memory attention heads and their size (None: the language model's); the release reads them from mixin_config
    num_heads: int | None = None
    head_dim: int | None = None
    # memory keys/values: the language model's grouped KV heads ("grouped") or one per query head ("full", the release)
    kv_heads: str = "grouped"
    # memory FFN: silu(fc1 x) -> fc2 ("silu") or w2(silu(w1 x) * w3 x) ("swiglu", the release)
    ffn: str = "silu"
    # FFN hidden width (None: the language model's intermediate_size)
    ffn_hidden: int | None = None
    # RoPE of memory queries and keys: None = the language model's own rotary embedding (its base and scaling), a
    # number = plain RoPE with that base (the release: 1e6 whatever the language model uses)
    rope_base: float | None = None
    # RMSNorm eps of the memory block (None: the language model's rms_norm_eps; the release: 1e-5)
    norm_eps: float | None = None
    # RoPE-DHR cell rule: "centre" (the cell holding a token's centre) or "linspace" (the release's boundaries)
    dhr_cells: str = "centre"
    # RoPE-DHR tile numbering: "row" (crop order) or "column" (the release; see module docs)
    tile_order: str = "row"
    # memory query position of a generated token: "next" (its own position) or "count" (the release)
    decode_query_positions: str = "next"

    def __post_init__(self) -> None:
        if not (isinstance(self.every, int) and self.every >= 1):
            raise ValueError(f"every must be a positive int, got {self.every!r}")
        for name, allowed in (("queries", QUERIES), ("positions", POSITIONS), ("kv_heads", KV_HEADS), ("ffn", FFNS),
                              ("dhr_cells", DHR_CELLS), ("tile_order", DHR_TILE_ORDERS),
                              ("decode_query_positions", DECODE_QUERY_POSITIONS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("num_heads", "head_dim", "ffn_hidden"):
            v = getattr(self, name)
            if v is not None and not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name} must be a positive int or None, got {v!r}")
        if self.rope_base is not None and not (isinstance(self.rope_base, (int, float)) and self.rope_base > 1):
            raise ValueError(f"rope_base must be a number > 1 or None, got {self.rope_base!r}")
        if self.norm_eps is not None and not (isinstance(self.norm_eps, (int, float)) and self.norm_eps > 0):
            raise ValueError(f"norm_eps must be a positive number or None, got {self.norm_eps!r}")

    @property
    def reference(self) -> bool:
        """Whether both deliberate fixes are set to the release's behaviour."""
        return self.tile_order == "column" and self.decode_query_positions == "count"

    def with_reference(self, reference: bool) -> MemoryConfig:
        """A copy with the release's tile order and decode query positions (``True``) or the project's (``False``)."""
        return dataclasses.replace(self, tile_order="column" if reference else "row",
                                   decode_query_positions="count" if reference else "next")

    @classmethod
    def release(cls, *, every: int, num_heads: int, head_dim: int, ffn_hidden: int,
                reference: bool = False) -> MemoryConfig:
        """The released checkpoints' layout (``mixin_config`` of their ``config.json``; RoPE base 1e6 and RMSNorm eps
        1e-5 are hard-coded in the release's ``helpers.py``)."""
        return cls(every=every, num_heads=num_heads, head_dim=head_dim, kv_heads="full", ffn="swiglu",
                   ffn_hidden=ffn_hidden, rope_base=1e6, norm_eps=1e-5, dhr_cells="linspace").with_reference(reference)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> MemoryConfig:
        """From :meth:`to_dict`, or from the settings older memory files recorded (``mlp_hidden_dim``)."""
        d = dict(d)
        if "mlp_hidden_dim" in d and "ffn_hidden" not in d:
            d["ffn_hidden"] = d.pop("mlp_hidden_dim")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


class PlainRope(nn.Module):
    """RoPE ``(cos, sin)`` tables with a fixed base and no scaling, computed as transformers' Llama-family rotary
    embeddings and the release's memory block compute them (inverse frequencies ``1 / base ** (2i / d)`` in fp32,
    angles ``position * inv_freq`` in fp32), so the tables agree bit for bit.

    Args:
        head_dim: rotated size (even).
        base: frequency base.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, base: float, *, device=None) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.base = float(base)
        inv = 1.0 / (self.base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``position_ids (B, S)`` -> ``(cos, sin)`` each ``(B, S, head_dim)`` in ``x.dtype``."""
        freqs = position_ids.to(self.inv_freq.device).float()[..., None] * self.inv_freq  # (B, S, head_dim/2)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def memory_layers(num_layers: int, every: int) -> list[int]:
    """Decoder layers preceded by a memory block: ``i`` with ``(i + 1) % every == 0`` (the reference)."""
    if not (isinstance(every, int) and every >= 1):
        raise ValueError(f"every must be a positive int, got {every!r}")
    layers = [i for i in range(num_layers) if (i + 1) % every == 0]
    if not layers:
        raise ValueError(f"every={every} places no memory block in a model with {num_layers} decoder layers")
    return layers


def _image_lengths(grids: list[tuple[int, int]], tokens_per_tile: int) -> list[int]:
    return [(r * c + (1 if r * c > 1 else 0)) * tokens_per_tile for r, c in grids]


def image_runs(input_ids_S: torch.Tensor, image_token_id: int) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of consecutive image tokens in one row of ids."""
    runs, start = [], None
    flags = (input_ids_S == image_token_id).tolist()
    for i, f in enumerate(flags + [False]):
        if f and start is None:
            start = i
        elif not f and start is not None:
            runs.append((start, i - start))
            start = None
    return runs


def dhr_position_ids(input_ids: torch.Tensor, image_token_id: int, grids: list[list[tuple[int, int]]],
                     tokens_per_side: int, *, mode: str = "dhr", cells: str = "centre",
                     tile_order: str = "row") -> torch.Tensor:
    """``(B, S)`` position ids: text tokens count up; each image (its run of image tokens: ``rows * cols`` tiles of
    ``T * T`` tokens, row-major, then a ``T * T`` thumbnail when there is more than one tile) takes RoPE-DHR ids
    starting at the next free position and uses ``T * T`` of them whatever its tile count.

    Args:
        input_ids: ``(B, S)`` ids, image tokens as ``image_token_id``.
        image_token_id: the image placeholder id.
        grids: per row, the ``(rows, cols)`` of each of its images, in order.
        tokens_per_side: ``T`` (image tokens per tile side after pixel shuffle).
        mode: ``"dhr"`` or ``"1d"`` (``0 .. S-1``).
        cells, tile_order: see :func:`core.rope.rope_dhr_position_ids`.
    """
    B, S = input_ids.shape
    if mode == "1d":
        return torch.arange(S, device=input_ids.device)[None].expand(B, -1).clone()
    if mode != "dhr":
        raise ValueError(f"positions must be one of {POSITIONS}, got {mode!r}")
    if len(grids) != B:
        raise ValueError(f"image_grids has {len(grids)} rows for a batch of {B}")
    T = tokens_per_side
    out = torch.empty(B, S, dtype=torch.long)
    ids = input_ids.cpu()
    for b in range(B):
        is_img = (ids[b] == image_token_id).tolist()
        lengths = _image_lengths([tuple(g) for g in grids[b]], T * T)
        if sum(is_img) != sum(lengths):
            raise ValueError(f"row {b}: {sum(is_img)} image tokens, but its grids {grids[b]} need {sum(lengths)} "
                             f"({T * T} per tile, plus a thumbnail for more than one tile)")
        p, i, k = 0, 0, 0
        while i < S:
            if not is_img[i]:
                out[b, i] = p
                p, i = p + 1, i + 1
                continue
            rows, cols = grids[b][k]
            n = lengths[k]
            if not all(is_img[i:i + n]):
                raise ValueError(f"row {b}: image {k} ({rows}x{cols} tiles) needs {n} consecutive image tokens")
            if rows * cols == 1:
                ids_k = p + torch.arange(T * T)
            else:
                tile_ids, thumb_ids = rope_dhr_position_ids((rows, cols), T, T, start=p, cells=cells,
                                                            tile_order=tile_order)
                ids_k = torch.cat([tile_ids.flatten(), thumb_ids])
            out[b, i:i + n] = ids_k
            p, i, k = p + T * T, i + n, k + 1
    return out.to(input_ids.device)


def grids_without_sizes(input_ids: torch.Tensor, image_token_id: int, tokens_per_side: int) -> list[list[tuple]]:
    """Grids when none are given: every image must be a single tile (a run of exactly ``T * T`` image tokens).

    A longer run is a tiled image (or several images with nothing between them) whose grid the ids do not tell:
    it is refused rather than silently given 1-D-like ids (tiles numbered as separate images)."""
    T2 = tokens_per_side ** 2
    out = []
    for b, row in enumerate(input_ids.cpu()):
        grids = []
        for k, (start, n) in enumerate(image_runs(row, image_token_id)):
            if n != T2:
                views = f"{n / T2:g} views of {T2} tokens" if n % T2 == 0 else f"{n} tokens, not whole tiles of {T2}"
                raise ValueError(
                    f"row {b}: image {k} (at token {start}) has {views}: a tiled image (tiles + thumbnail) needs its "
                    "grid for RoPE-DHR; pass image_grids=[[(rows, cols), ...]] (what the processor cropped; "
                    "HFCoMemo.prompt and answer derive them), or positions='1d'")
            grids.append((1, 1))
        out.append(grids)
    return out
