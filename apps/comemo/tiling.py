"""InternVL's dynamic high-resolution tiling: aspect-ratio grid, row-major tiles, thumbnail.

An image of ``W x H`` pixels is resized to ``(cols * tile) x (rows * tile)`` for the grid ``(rows, cols)``
whose aspect ratio ``cols / rows`` is closest to ``W / H`` among the grids with
``min_tiles <= rows * cols <= max_tiles``, then cut into ``rows * cols`` tiles of ``tile x tile`` pixels
**row-major** (tile ``t = r * cols + c`` covers rows ``r*tile .. (r+1)*tile`` and columns
``c*tile .. (c+1)*tile``). When there is more than one tile a thumbnail (the whole image resized to
``tile x tile``) is appended. Tile ``t`` is tile ``t`` of :func:`core.rope.rope_dhr_position_ids`
(tests/test_comemo_tiling.py checks this on 1x3, 3x1, 2x3 and 3x2 grids against the crop boxes).

Tie rule (InternVL's ``find_closest_aspect_ratio``): grids are visited in order of increasing tile count;
a grid replaces the best one if its aspect-ratio difference is strictly smaller, or equal and the image
area exceeds half the grid's pixel area (``W * H > 0.5 * tile**2 * rows * cols``), so a large image prefers
the larger of two equally close grids. Grids with the same tile count are visited in order of increasing
``cols`` (InternVL iterates a Python set here, whose order is an implementation detail).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

__all__ = ["TileLayout", "candidate_grids", "closest_grid", "tile_image", "tile_boxes"]


@dataclass(frozen=True)
class TileLayout:
    """The tiles of one image.

    Attributes:
        grid: ``(rows, cols)`` of the high-resolution tiles.
        tiles: ``rows * cols`` RGB uint8 arrays ``(tile, tile, 3)``, row-major.
        boxes: crop box ``(left, top, right, bottom)`` of each tile in the resized image, row-major.
        thumbnail: ``(tile, tile, 3)`` whole-image thumbnail, or None for a single tile (which already
            shows the whole image).
    """

    grid: tuple[int, int]
    tiles: list[np.ndarray]
    boxes: list[tuple[int, int, int, int]]
    thumbnail: np.ndarray | None

    @property
    def num_tiles(self) -> int:
        return len(self.tiles)


def _check_range(min_tiles: int, max_tiles: int) -> None:
    if not (isinstance(min_tiles, int) and isinstance(max_tiles, int) and 1 <= min_tiles <= max_tiles):
        raise ValueError(f"need ints 1 <= min_tiles <= max_tiles, got min_tiles={min_tiles!r}, max_tiles={max_tiles!r}")


def candidate_grids(min_tiles: int = 1, max_tiles: int = 6) -> list[tuple[int, int]]:
    """All ``(rows, cols)`` with ``min_tiles <= rows * cols <= max_tiles``, by tile count then ``cols``."""
    _check_range(min_tiles, max_tiles)
    grids = {(r, c) for r in range(1, max_tiles + 1) for c in range(1, max_tiles + 1) if min_tiles <= r * c <= max_tiles}
    return sorted(grids, key=lambda g: (g[0] * g[1], g[1]))


def closest_grid(width: int, height: int, tile: int, *, min_tiles: int = 1, max_tiles: int = 6) -> tuple[int, int]:
    """The ``(rows, cols)`` grid InternVL picks for a ``width x height`` image (see module docs)."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size must be positive, got {width}x{height}")
    aspect = width / height
    area = width * height
    best, best_diff = (1, 1), float("inf")
    for rows, cols in candidate_grids(min_tiles, max_tiles):
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (rows, cols), diff
        elif diff == best_diff and area > 0.5 * tile * tile * rows * cols:
            best = (rows, cols)
    return best


def tile_boxes(grid: tuple[int, int], tile: int) -> list[tuple[int, int, int, int]]:
    """Crop boxes ``(left, top, right, bottom)`` of the tiles of ``grid``, row-major."""
    rows, cols = grid
    return [(c * tile, r * tile, (c + 1) * tile, (r + 1) * tile) for r in range(rows) for c in range(cols)]


def tile_image(image: Image.Image | np.ndarray, tile: int, *, min_tiles: int = 1, max_tiles: int = 6,
               use_thumbnail: bool = True) -> TileLayout:
    """Cut an image into aspect-ratio tiles (row-major) plus a thumbnail when there are several tiles.

    Args:
        image: PIL image or ``(H, W, 3)`` / ``(H, W)`` uint8 array.
        tile: tile side in pixels.
        min_tiles, max_tiles: allowed tile counts.
        use_thumbnail: append the thumbnail when the grid has more than one tile.
    """
    if not (isinstance(tile, int) and tile > 0):
        raise ValueError(f"tile must be a positive int, got {tile!r}")
    if isinstance(image, np.ndarray):
        image = Image.fromarray(image)
    image = image.convert("RGB")
    grid = closest_grid(image.width, image.height, tile, min_tiles=min_tiles, max_tiles=max_tiles)
    rows, cols = grid
    resized = image.resize((cols * tile, rows * tile), Image.BICUBIC)
    boxes = tile_boxes(grid, tile)
    tiles = [np.asarray(resized.crop(box)) for box in boxes]
    thumb = None
    if use_thumbnail and len(tiles) > 1:
        thumb = np.asarray(image.resize((tile, tile), Image.BICUBIC))
    return TileLayout(grid=grid, tiles=tiles, boxes=boxes, thumbnail=thumb)
