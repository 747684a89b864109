"""Rotary embeddings: norms, relative positions, 2D layout, RoPE-DHR ids for tiled images."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F

from core.rope import (
    RotaryEmbedding,
    RotaryEmbedding2D,
    apply_rope,
    grid_position_ids,
    rope_dhr_position_ids,
)


def _complex_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Independent rotate-half RoPE: pair (i, i + R/2) as a complex number times exp(i·angle_i)."""
    R = 2 * angles.shape[-1]
    half = R // 2
    z = torch.complex(x[..., :half].double(), x[..., half:R].double())
    z = z * torch.polar(torch.ones_like(angles, dtype=torch.float64), angles.double())
    return torch.cat([z.real, z.imag, x[..., R:].double()], dim=-1)


def test_matches_complex_rotation():
    D, base = 16, 500.0
    x = torch.randn(2, 3, 11, D)
    pos = torch.randint(0, 1000, (2, 11))
    cos, sin = RotaryEmbedding(D, base=base)(pos)
    assert cos.shape == (2, 11, D) and sin.shape == (2, 11, D)
    inv_freq = base ** (-torch.arange(D // 2, dtype=torch.float64) / (D // 2))
    angles = pos[:, None, :, None].double() * inv_freq  # (B, 1, S, D/2)
    expected = _complex_rope(x, angles)
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.float32])
def test_rotation_preserves_norms(pos_dtype):
    D = 32
    x = torch.randn(3, 4, 17, D) * 3
    pos = (torch.rand(17) * 5000).to(pos_dtype)
    cos, sin = RotaryEmbedding(D)(pos)
    y = apply_rope(x, cos, sin)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)
    assert not torch.allclose(y[..., 1:, :], x[..., 1:, :], atol=1e-3)  # it does rotate


def test_relative_property():
    D = 24
    rope = RotaryEmbedding(D)
    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(m, n):
        cq, sq = rope(torch.tensor([m]))
        ck, sk = rope(torch.tensor([n]))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    for _ in range(5):
        m, n, shift = (int(v) for v in torch.randint(0, 400, (3,)))
        assert score(m, n) == pytest.approx(score(m + shift, n + shift), abs=1e-3)
    # ... and it does depend on the difference
    assert abs(score(5, 2) - score(5, 3)) > 1e-3


def test_partial_rotary_and_broadcast_shapes():
    D, R = 16, 8
    x = torch.randn(2, 3, 5, D)
    cos, sin = RotaryEmbedding(R)(torch.arange(5))
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., R:], x[..., R:])
    assert not torch.allclose(y[..., :R], x[..., :R])
    # (S, R), (B, S, R) and (B, H, S, R) tables agree
    y3 = apply_rope(x, cos.expand(2, 5, R), sin.expand(2, 5, R))
    y4 = apply_rope(x, cos.expand(2, 3, 5, R), sin.expand(2, 3, 5, R))
    torch.testing.assert_close(y3, y)
    torch.testing.assert_close(y4, y)


def test_low_precision_keeps_dtype():
    x = torch.randn(1, 2, 6, 8)
    cos, sin = RotaryEmbedding(8)(torch.arange(6))
    y = apply_rope(x.to(torch.bfloat16), cos, sin)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), apply_rope(x, cos, sin), atol=3e-2, rtol=3e-2)


def test_apply_rope_rejects_bad_shapes():
    x = torch.randn(1, 2, 6, 8)
    cos, sin = RotaryEmbedding(8)(torch.arange(5))
    with pytest.raises(ValueError, match="positions"):
        apply_rope(x, cos, sin)
    cos, sin = RotaryEmbedding(16)(torch.arange(6))
    with pytest.raises(ValueError, match="rotary dim"):
        apply_rope(x, cos, sin)
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(7)
    with pytest.raises(ValueError, match="multiple of 4"):
        RotaryEmbedding2D(6)


def test_2d_rope_halves_and_relative_property():
    D = 16
    rope = RotaryEmbedding2D(D, base=100.0)
    pos = grid_position_ids(3, 4)
    assert pos.tolist()[:5] == [[0, 0], [0, 1], [0, 2], [0, 3], [1, 0]]
    x = torch.randn(1, 2, 12, D)
    cos, sin = rope(pos)
    assert cos.shape == (12, D)
    # independent check: row angles on pairs 0..D/4-1, column angles on pairs D/4..D/2-1
    inv = 100.0 ** (-torch.arange(D // 4, dtype=torch.float64) / (D // 4))
    angles = torch.cat([pos[:, :1].double() * inv, pos[:, 1:].double() * inv], dim=-1)
    torch.testing.assert_close(apply_rope(x, cos, sin).double(), _complex_rope(x, angles), atol=1e-5, rtol=1e-5)

    q, k = torch.randn(1, 1, 1, D), torch.randn(1, 1, 1, D)

    def score(p, r):
        cq, sq = rope(torch.tensor([p]))
        ck, sk = rope(torch.tensor([r]))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum().item()

    assert score([3, 1], [0, 5]) == pytest.approx(score([10, 7], [7, 11]), abs=1e-4)
    assert abs(score([3, 1], [0, 5]) - score([3, 1], [0, 6])) > 1e-4  # columns matter
    assert abs(score([3, 1], [0, 5]) - score([3, 1], [1, 5])) > 1e-4  # rows matter


# ---------------------------------------------------------------- RoPE-DHR


def _dhr_independent(rows: int, cols: int, G: int, T: int, start: int) -> torch.Tensor:
    """Upsample the thumbnail id grid to the high-res token grid (nearest, by cell centre), crop tiles row-major."""
    thumb = (start + torch.arange(G * G)).reshape(1, 1, G, G).double()
    big = F.interpolate(thumb, size=(rows * T, cols * T), mode="nearest-exact")[0, 0].long()
    tiles = [big[i * T:(i + 1) * T, j * T:(j + 1) * T].flatten() for i in range(rows) for j in range(cols)]
    return torch.stack(tiles)


@pytest.mark.parametrize("grid", [(2, 3), (3, 2), (1, 4), (4, 1), (2, 2), (1, 1), (3, 5)])
def test_dhr_matches_independent_upsampling(grid):
    start = int(torch.randint(0, 50, ()).item())
    tile_ids, thumb_ids = rope_dhr_position_ids(tile_grid=grid, thumb_grid=16, tile_grid_tokens=16, start=start)
    rows, cols = grid
    assert tile_ids.shape == (rows * cols, 256) and tile_ids.dtype == torch.int64
    assert torch.equal(thumb_ids, start + torch.arange(256))
    assert torch.equal(tile_ids, _dhr_independent(rows, cols, 16, 16, start))


def test_dhr_non_square_grid_by_hand():
    # 2 rows x 3 cols of 16x16 token tiles -> a 32 x 48 token image; thumbnail 16 x 16.
    tile_ids, _ = rope_dhr_position_ids(tile_grid=(2, 3), start=100)
    grid = tile_ids.reshape(2, 3, 16, 16)  # (tile row, tile col, token row, token col)
    # tile (row 0, col 1) covers columns 16..31 of 48 -> thumbnail columns 5..10; rows 0..15 of 32 -> 0..7
    assert grid[0, 1, 0, 0].item() == 100 + 0 * 16 + 5
    assert grid[0, 1, 15, 15].item() == 100 + 7 * 16 + 10
    # tile (row 1, col 0): bottom-left -> thumbnail rows 8..15, columns 0..5
    assert grid[1, 0, 0, 0].item() == 100 + 8 * 16 + 0
    assert grid[1, 0, 15, 15].item() == 100 + 15 * 16 + 5
    # the column-major enumeration (the published flaw) would put tile (1, 0) second; ours is row-major
    assert grid.reshape(6, 256)[1, 0].item() == 100 + 5


@pytest.mark.parametrize("rows,cols,G,T", [(2, 3, 16, 12), (3, 1, 8, 10), (1, 2, 16, 7)])
def test_dhr_other_sizes_cell_of_token_centre(rows, cols, G, T):
    tile_ids, thumb_ids = rope_dhr_position_ids((rows, cols), thumb_grid=G, tile_grid_tokens=T)
    H, W = rows * T, cols * T
    for t in range(rows * cols):
        tr, tc = divmod(t, cols)
        for i in range(T):
            for j in range(T):
                R, C = tr * T + i, tc * T + j
                # exact rational arithmetic: the thumbnail cell that contains the token's centre
                cr = int((Fraction(2 * R + 1, 2) * G / H).__floor__())
                cc = int((Fraction(2 * C + 1, 2) * G / W).__floor__())
                assert tile_ids[t, i * T + j].item() == cr * G + cc
    assert thumb_ids.numel() == G * G


@pytest.mark.parametrize("grid", [(1, 1), (2, 3), (4, 6), (1, 12)])
def test_dhr_uses_thumb_grid_squared_ids(grid):
    tile_ids, thumb_ids = rope_dhr_position_ids(tile_grid=grid, start=7)
    all_ids = torch.cat([tile_ids.flatten(), thumb_ids])
    assert torch.equal(torch.unique(all_ids), 7 + torch.arange(256))
    assert torch.unique(thumb_ids).numel() == 256


def test_dhr_rejects_bad_input():
    with pytest.raises(ValueError, match="tile_grid"):
        rope_dhr_position_ids(tile_grid=(0, 2))
    with pytest.raises(ValueError, match="tile_grid"):
        rope_dhr_position_ids(tile_grid=3)
    with pytest.raises(ValueError, match="thumb_grid"):
        rope_dhr_position_ids(thumb_grid=0)


# -- the released code's RoPE-DHR rules, as switches (cells="linspace", tile_order="column") -------------------------

def _linspace_cell(n: int, i: int, k: int, G: int = 16, T: int = 16) -> int:
    """Token ``k`` of tile ``i`` along an axis of ``n`` tiles: ``int`` of the k-th of T evenly spaced points from
    ``i * w`` to ``(i + 1) * w``, ``w = G / n - 1e-6`` (the released rule, restated)."""
    w = G / n - 1e-6
    start, stop = i * w, (i + 1) * w
    x = stop if k == T - 1 else start + k * (stop - start) / (T - 1)
    return int(x)


@pytest.mark.parametrize("grid,n_diff", [((1, 2), 16), ((2, 2), 63), ((2, 4), 157)])
def test_dhr_linspace_cells_are_the_released_rule(grid, n_diff):
    rows, cols = grid
    tiles, thumb = rope_dhr_position_ids(grid, 16, 16, start=3, cells="linspace")
    centre, _ = rope_dhr_position_ids(grid, 16, 16, start=3)
    for t in range(rows * cols):
        tr, tc = divmod(t, cols)
        for a in range(16):
            for b in range(16):
                want = 3 + _linspace_cell(rows, tr, a) * 16 + _linspace_cell(cols, tc, b)
                assert tiles[t, a * 16 + b].item() == want
    assert torch.equal(thumb, 3 + torch.arange(256))
    assert int((tiles != centre).sum()) == n_diff  # the counts the two rules differ by (1x2: 16 of 512 ids, ...)


@pytest.mark.parametrize("grid", [(2, 2), (2, 3), (3, 2), (1, 3), (3, 1)])
def test_dhr_column_order_numbers_tiles_column_first(grid):
    rows, cols = grid
    row_major, _ = rope_dhr_position_ids(grid, 16, 16)
    col_first, _ = rope_dhr_position_ids(grid, 16, 16, tile_order="column")
    for t in range(rows * cols):  # sequence tile t carries the ids of the tile at column t // rows, row t % rows
        assert torch.equal(col_first[t], row_major[(t % rows) * cols + t // rows])
    assert torch.equal(col_first, row_major) == (rows == 1 or cols == 1)
    with pytest.raises(ValueError, match="tile_order"):
        rope_dhr_position_ids(grid, tile_order="diagonal")
    with pytest.raises(ValueError, match="cells"):
        rope_dhr_position_ids(grid, cells="corner")
