"""CoMemo tiling: InternVL's grid choice and tie rule, row-major crops that match RoPE-DHR's tile order."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from apps.comemo.tiling import candidate_grids, closest_grid, tile_boxes, tile_image
from core.rope import rope_dhr_position_ids


def test_candidate_grids_respect_the_range_and_order():
    grids = candidate_grids(2, 6)
    assert all(2 <= r * c <= 6 for r, c in grids)
    assert (1, 1) not in grids and (2, 3) in grids and (3, 2) in grids and (1, 6) in grids
    counts = [r * c for r, c in grids]
    assert counts == sorted(counts)
    with pytest.raises(ValueError, match="min_tiles"):
        candidate_grids(3, 2)


@pytest.mark.parametrize(
    ("w", "h", "tile", "max_tiles", "expected"),
    [
        (896, 448, 448, 6, (1, 2)),  # 2:1 wide
        (448, 1344, 448, 6, (3, 1)),  # 1:3 tall
        (800, 600, 448, 6, (2, 3)),  # 4:3 -> 3/2 is closer than 1/1
        (1000, 1000, 448, 6, (2, 2)),  # tie 1x1 vs 2x2: a large image takes the larger grid
        (300, 300, 448, 6, (1, 1)),  # tie again, small image keeps 1x1
        (5000, 100, 448, 6, (1, 6)),  # extreme aspect: the widest grid allowed
        (64, 32, 32, 1, (1, 1)),  # max_tiles=1: always one tile
    ],
)
def test_closest_grid_matches_internvl_rule(w, h, tile, max_tiles, expected):
    assert closest_grid(w, h, tile, max_tiles=max_tiles) == expected


def test_tie_between_1x1_and_2x2_follows_the_area_threshold():
    tile = 10
    # area > 0.5 * tile^2 * 4 = 200 -> 2x2 ; else 1x1
    assert closest_grid(15, 15, tile, max_tiles=4) == (2, 2)  # 225 > 200
    assert closest_grid(14, 14, tile, max_tiles=4) == (1, 1)  # 196 <= 200


def _cell_image(rows: int, cols: int, tile: int, G: int) -> np.ndarray:
    """Image of exactly the tiled size whose pixels hold the index of the thumbnail cell they lie in."""
    Hp, Wp = rows * tile, cols * tile
    cr = ((2 * np.arange(Hp) + 1) * G) // (2 * Hp)
    cc = ((2 * np.arange(Wp) + 1) * G) // (2 * Wp)
    cell = cr[:, None] * G + cc[None, :]
    img = np.zeros((Hp, Wp, 3), dtype=np.uint8)
    img[..., 0] = cell * 7  # G*G <= 36 cells -> < 256
    return img


def _cells_seen_by_tokens(tiles: list[np.ndarray], T: int) -> np.ndarray:
    """(num_tiles, T*T) cell index at each token's centre pixel, tokens row-major inside the tile."""
    p = tiles[0].shape[0] // T
    centres = np.arange(T) * p + p // 2
    return np.stack([t[centres][:, centres, 0].reshape(-1) // 7 for t in tiles])


@pytest.mark.parametrize("grid", [(1, 3), (3, 1), (2, 3), (3, 2), (2, 2), (1, 1)])
def test_tile_t_of_the_crop_is_tile_t_of_rope_dhr(grid):
    rows, cols = grid
    G = T = 4  # thumbnail and tile token grids
    tile = 32  # 8 px per token
    img = _cell_image(rows, cols, tile, G)
    layout = tile_image(img, tile, min_tiles=rows * cols, max_tiles=rows * cols)
    assert layout.grid == grid
    assert layout.boxes == tile_boxes(grid, tile)
    for t, (left, top, right, bottom) in enumerate(layout.boxes):
        assert (left, top) == ((t % cols) * tile, (t // cols) * tile)  # row-major
        np.testing.assert_array_equal(layout.tiles[t], img[top:bottom, left:right])
    tile_ids, thumb_ids = rope_dhr_position_ids(grid, thumb_grid=G, tile_grid_tokens=T, start=5)
    seen = _cells_seen_by_tokens(layout.tiles, T)
    np.testing.assert_array_equal(seen, tile_ids.numpy() - 5)
    assert thumb_ids.tolist() == list(range(5, 5 + G * G))
    if rows != cols and min(rows, cols) > 1:  # column-major enumeration (published code) breaks these grids
        col_major = [layout.tiles[r * cols + c] for c in range(cols) for r in range(rows)]
        assert not np.array_equal(_cells_seen_by_tokens(col_major, T), tile_ids.numpy() - 5)


def test_thumbnail_only_for_several_tiles():
    wide = np.random.default_rng(0).integers(0, 255, (32, 96, 3), dtype=np.uint8)
    lay = tile_image(wide, 32, max_tiles=6)
    assert lay.grid == (1, 3) and lay.num_tiles == 3 and lay.thumbnail.shape == (32, 32, 3)
    single = tile_image(Image.fromarray(wide[:, :32]), 32, max_tiles=6)
    assert single.grid == (1, 1) and single.thumbnail is None and single.tiles[0].shape == (32, 32, 3)
    with pytest.raises(ValueError, match="tile"):
        tile_image(wide, 0)
