"""Rotary position embeddings (RoPE): 1D, 2D, and RoPE-DHR position ids for tiled images.

Convention ("rotate half", as in GPT-NeoX / Llama): the rotated part of a head vector of size ``R`` is split
into two halves ``x = [x1, x2]`` (``R/2`` each); dimension ``i`` of ``x1`` is paired with dimension ``i`` of
``x2`` and the pair is rotated by the angle ``pos * inv_freq[i]``::

    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([x1, x2]) = [-x2, x1]

where ``cos``/``sin`` hold each pair's angle twice (``[angles, angles]``). Rotation preserves norms, and
``<rope(q, m), rope(k, n)>`` depends only on ``m - n``. If ``cos`` has fewer dims than the head (``R < D``),
only the first ``R`` dims of the head are rotated and the rest pass through ("partial rotary").

2D RoPE (:class:`RotaryEmbedding2D`) gives half of the rotated dims to the row coordinate and half to the
column coordinate; its ``cos``/``sin`` use the same layout, so :func:`apply_rope` serves both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

__all__ = [
    "RotaryEmbedding",
    "RotaryEmbedding2D",
    "apply_rope",
    "rotate_half",
    "grid_position_ids",
    "rope_dhr_position_ids",
    "DHR_CELLS",
    "DHR_TILE_ORDERS",
]


def _inv_freq(num_freqs: int, base: float, device=None) -> torch.Tensor:
    """``base ** (-i / num_freqs)`` for ``i = 0 .. num_freqs-1`` (fp32)."""
    exponent = torch.arange(num_freqs, dtype=torch.float64, device=device) / num_freqs
    return (float(base) ** -exponent).to(torch.float32)


def _check_base(base: float) -> None:
    if not (isinstance(base, (int, float)) and base > 1.0):
        raise ValueError(f"RoPE base must be a number > 1, got {base!r}")


class RotaryEmbedding(nn.Module):
    """1D rotary embedding: position ids -> ``(cos, sin)`` for :func:`apply_rope`.

    Args:
        head_dim: number of rotated dims per head (even). Use the attention head dim for full rotary,
            or fewer for partial rotary.
        base: frequency base (10000 for text; TabICL's row interaction uses 100000).
        device: device of the frequency buffer.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, *, base: float = 10000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 2 == 0):
            raise ValueError(f"head_dim must be a positive even int, got {head_dim!r}")
        _check_base(base)
        self.head_dim = head_dim
        self.base = float(base)
        # (head_dim/2,) angular frequency of each rotated pair; not saved in state dicts (derived).
        self.register_buffer("inv_freq", _inv_freq(head_dim // 2, base, device), persistent=False)

    def forward(self, position_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos/sin tables for ``position_ids``.

        Args:
            position_ids: integer or float positions of any shape ``(..., S)``.
            dtype: dtype of the returned tables (angles are always computed in fp32).

        Returns:
            ``(cos, sin)``, each ``(..., S, head_dim)``.
        """
        if not isinstance(position_ids, torch.Tensor):
            position_ids = torch.as_tensor(position_ids)
        angles = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)  # (..., S, head_dim): each pair's angle twice
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"


class RotaryEmbedding2D(nn.Module):
    """2D rotary embedding for ``(row, col)`` positions: half the rotated dims per axis.

    Pairs ``0 .. head_dim/4 - 1`` rotate with the row coordinate and pairs ``head_dim/4 .. head_dim/2 - 1``
    with the column coordinate, each axis with frequencies ``base ** (-i / (head_dim/4))``. So
    ``<rope(q, (r1, c1)), rope(k, (r2, c2))>`` depends only on ``(r1 - r2, c1 - c2)``.

    Args:
        head_dim: number of rotated dims per head, a multiple of 4.
        base: frequency base.
        device: device of the frequency buffer.
    """

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, *, base: float = 10000.0, device: torch.device | str | None = None) -> None:
        super().__init__()
        if not (isinstance(head_dim, int) and head_dim > 0 and head_dim % 4 == 0):
            raise ValueError(f"head_dim for 2D RoPE must be a positive multiple of 4, got {head_dim!r}")
        _check_base(base)
        self.head_dim = head_dim
        self.base = float(base)
        # (head_dim/4,) frequencies shared by both axes.
        self.register_buffer("inv_freq", _inv_freq(head_dim // 4, base, device), persistent=False)

    def forward(self, position_ids: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """Cos/sin tables for 2D positions.

        Args:
            position_ids: ``(..., S, 2)`` integer or float ``(row, col)`` positions
                (see :func:`grid_position_ids`).
            dtype: dtype of the returned tables.

        Returns:
            ``(cos, sin)``, each ``(..., S, head_dim)``.
        """
        if not isinstance(position_ids, torch.Tensor):
            position_ids = torch.as_tensor(position_ids)
        if position_ids.dim() < 2 or position_ids.shape[-1] != 2:
            raise ValueError(f"2D position ids must have shape (..., S, 2), got {tuple(position_ids.shape)}")
        pos = position_ids.to(device=self.inv_freq.device, dtype=torch.float32)
        rows = pos[..., 0, None] * self.inv_freq  # (..., S, head_dim/4)
        cols = pos[..., 1, None] * self.inv_freq  # (..., S, head_dim/4)
        half = torch.cat([rows, cols], dim=-1)  # (..., S, head_dim/2)
        angles = torch.cat([half, half], dim=-1)  # (..., S, head_dim)
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"


def grid_position_ids(rows: int, cols: int, *, device: torch.device | str | None = None) -> torch.Tensor:
    """``(rows * cols, 2)`` int64 ``(row, col)`` ids of a grid enumerated row-major."""
    if rows <= 0 or cols <= 0:
        raise ValueError(f"grid must have positive size, got rows={rows}, cols={cols}")
    r = torch.arange(rows, device=device).repeat_interleave(cols)
    c = torch.arange(cols, device=device).repeat(rows)
    return torch.stack([r, c], dim=-1)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[x1, x2] -> [-x2, x1]`` over the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x_BHSD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` by the angles in ``cos``/``sin`` (rotate-half convention, see module docs).

    Args:
        x_BHSD: ``(B, H, S, D)`` queries or keys.
        cos: ``(S, R)``, ``(B, S, R)`` (shared by all heads) or ``(B, H, S, R)`` (any dim may be 1 for
            broadcasting), from :class:`RotaryEmbedding` / :class:`RotaryEmbedding2D`. ``R`` is even
            and ``<= D``; dims ``R..D-1`` of ``x`` pass through unchanged.
        sin: same shape as ``cos``.

    Returns:
        ``(B, H, S, D)`` in the dtype of ``x`` (the rotation is computed in fp32).
    """
    if x_BHSD.dim() != 4:
        raise ValueError(f"apply_rope expects x of layout (B, H, S, D), got shape {tuple(x_BHSD.shape)}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.dim() == 2:  # (S, R)
        cos, sin = cos[None, None], sin[None, None]
    elif cos.dim() == 3:  # (B, S, R): same angles for every head
        cos, sin = cos[:, None], sin[:, None]
    elif cos.dim() != 4:
        raise ValueError(f"cos/sin must be (S, R), (B, S, R) or (B, H, S, R), got shape {tuple(cos.shape)}")
    D, R = x_BHSD.shape[-1], cos.shape[-1]
    if R % 2 != 0 or R > D:
        raise ValueError(f"rotary dim ({R}) must be even and at most the head dim ({D})")
    if cos.shape[-2] != x_BHSD.shape[-2]:
        raise ValueError(f"cos/sin cover {cos.shape[-2]} positions but x has sequence length {x_BHSD.shape[-2]}")
    xf = x_BHSD.float()
    x_rot, x_pass = xf[..., :R], xf[..., R:]
    cos, sin = cos.to(device=xf.device, dtype=torch.float32), sin.to(device=xf.device, dtype=torch.float32)
    out = x_rot * cos + rotate_half(x_rot) * sin
    if R < D:
        out = torch.cat([out, x_pass], dim=-1)
    return out.to(x_BHSD.dtype)


def rope_dhr_position_ids(
    tile_grid: tuple[int, int] = (1, 1),
    thumb_grid: int = 16,
    tile_grid_tokens: int = 16,
    start: int = 0,
    *,
    cells: str = "centre",
    tile_order: str = "row",
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE-DHR 1D position ids for an image cut into high-resolution tiles plus a thumbnail (CoMemo).

    The thumbnail is a ``thumb_grid x thumb_grid`` token grid of the whole image; its tokens get ids
    ``start .. start + thumb_grid**2 - 1`` row-major. The high-resolution image is cut into
    ``rows x cols`` tiles, **enumerated row-major** (tile ``t = tr * cols + tc``, the order in which
    aspect-ratio tiles are cropped), each a ``tile_grid_tokens x tile_grid_tokens`` token grid (row-major
    inside the tile). A tile token at global token coordinates ``(R, C)`` of the
    ``(rows * T) x (cols * T)`` high-resolution grid lies in thumbnail cell
    ``(floor((R + 1/2) * G / (rows*T)), floor((C + 1/2) * G / (cols*T)))`` (the cell containing the token's
    centre; ``G = thumb_grid``) and inherits that cell's id. Rows and columns are scaled separately, so
    non-square grids are handled correctly. An image thus uses ``G**2`` ids however many tiles it has.

    Tile order: CoMemo's released code numbers tiles column-first although InternVL crops them row-major, which
    transposes the 2-D positions on every grid with more than one row and column; here tiles are numbered in
    the order they are cropped, so a tile token's id is the thumbnail cell it lies in.

    The released code (and its checkpoints) differs in two ways, each a switch here:

    - ``cells="linspace"``: the released cell boundaries. Along an axis cut into ``n`` tiles, token ``k`` of tile
      ``i`` takes cell ``int(linspace(i * w, (i + 1) * w, T)[k])`` with ``w = G / n - 1e-6`` (``T`` points from the
      tile's first to its last cell, both ends included) instead of the cell holding its centre. The two rules
      agree on most tokens (16 of 512 ids differ on a 1x2 grid, 63 of 1,024 on 2x2).
    - ``tile_order="column"``: the released tile numbering, column-first (sequence tile ``t`` is taken to lie at
      column ``t // rows``, row ``t % rows``), although tiles are cropped row-major: on grids with more than one
      row and column every tile but the first and last gets another tile's ids. Only to reproduce the release.

    Args:
        tile_grid: ``(rows, cols)`` tiles of the high-resolution view.
        thumb_grid: thumbnail tokens per side (16 for InternVL's 448-px tiles: 256 tokens).
        tile_grid_tokens: tokens per side of one tile.
        start: id of the first thumbnail token (the text position where the image begins).
        cells: ``"centre"`` (the cell holding the token's centre) or ``"linspace"`` (the release's rule).
        tile_order: ``"row"`` (the crop order) or ``"column"`` (the release's numbering).
        device: device of the returned tensors.

    Returns:
        ``(tile_ids, thumb_ids)``: int64 ``(rows * cols, tile_grid_tokens**2)`` ids of each tile's tokens
        (tiles row-major, tokens row-major), and int64 ``(thumb_grid**2,)`` ids of the thumbnail tokens.
        For InternVL's sequence order (tiles first, then the thumbnail) use
        ``torch.cat([tile_ids.flatten(), thumb_ids])``.
    """
    try:
        rows, cols = (int(v) for v in tile_grid)
    except (TypeError, ValueError):
        raise ValueError(f"tile_grid must be a pair (rows, cols) of ints, got {tile_grid!r}") from None
    if rows <= 0 or cols <= 0:
        raise ValueError(f"tile_grid must have positive entries, got {tile_grid!r}")
    for name, v in (("thumb_grid", thumb_grid), ("tile_grid_tokens", tile_grid_tokens)):
        if not (isinstance(v, int) and v > 0):
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative int, got {start!r}")
    if cells not in DHR_CELLS:
        raise ValueError(f"cells must be one of {DHR_CELLS}, got {cells!r}")
    if tile_order not in DHR_TILE_ORDERS:
        raise ValueError(f"tile_order must be one of {DHR_TILE_ORDERS}, got {tile_order!r}")
    G, T = thumb_grid, tile_grid_tokens
    thumb_ids = start + torch.arange(G * G, device=device)
    cell_r = _dhr_cells(rows, T, G, cells).to(device)  # (rows*T,) thumbnail row of each token row
    cell_c = _dhr_cells(cols, T, G, cells).to(device)  # (cols*T,) thumbnail col of each token col
    ids_HW = start + cell_r[:, None] * G + cell_c[None, :]  # (H, W) = (rows*T, cols*T)
    # (rows*T, cols*T) -> (rows, T, cols, T) -> (rows, cols, T, T) -> (rows*cols, T*T), tiles row-major
    tile_ids = ids_HW.reshape(rows, T, cols, T).permute(0, 2, 1, 3).reshape(rows * cols, T * T)
    if tile_order == "column":  # sequence tile t holds the ids of the tile at column t // rows, row t % rows
        t = torch.arange(rows * cols, device=device)
        tile_ids = tile_ids[(t % rows) * cols + t // rows]
    return tile_ids, thumb_ids


DHR_CELLS = ("centre", "linspace")
DHR_TILE_ORDERS = ("row", "column")


def _dhr_cells(n: int, T: int, G: int, cells: str) -> torch.Tensor:
    """``(n * T,)`` int64 thumbnail cell (0 .. G-1) of each token along an axis of ``n`` tiles of ``T`` tokens."""
    if cells == "centre":
        return ((2 * torch.arange(n * T) + 1) * G) // (2 * n * T)
    w = G / n - 1e-6  # the release's cell span of one tile, shrunk so the last point stays inside the grid
    return torch.from_numpy(np.concatenate([np.linspace(i * w, (i + 1) * w, T) for i in range(n)]).astype(np.int64))
