"""Patch grids at a target magnification, their HDF5 files (CLAM layout) and overview thumbnails.

Coordinates are the top-left corners of patches in level-0 pixels, ``(x, y)``; a patch covers
``patch_size_level0 = round(patch_size · mpp / slide_mpp)`` level-0 pixels per side and is read at the
pyramid level ``patch_level`` nearest above the target resolution, then resized to ``patch_size``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from core.infra.fileio import open_hdf5
from pathology.slide import Slide
from pathology.tissue import TissueMask

__all__ = ["PatchGrid", "patch_grid", "write_h5", "read_h5", "overview_image", "save_png"]


@dataclass
class PatchGrid:
    """Patch coordinates of one slide and how to read them."""

    coords: np.ndarray  # (N, 2) int64, level-0 (x, y) of each patch's top-left corner
    patch_size: int  # output side in pixels (at the target mpp)
    patch_size_level0: int  # side in level-0 pixels
    patch_level: int  # pyramid level the pixels are read from
    mpp: float  # target micrometres per pixel of the output patches
    slide_mpp: float  # micrometres per level-0 pixel
    tissue_fraction: np.ndarray  # (N,) float32, tissue fraction of each kept patch

    def attrs(self) -> dict:
        return {
            "patch_size": self.patch_size,
            "patch_level": self.patch_level,
            "patch_size_level0": self.patch_size_level0,
            "mpp": self.mpp,
            "slide_mpp": self.slide_mpp,
        }


def patch_grid(slide: Slide, tissue: TissueMask, *, mpp: float = 0.5, patch_size: int = 256,
               min_tissue: float = 0.25, overlap: float = 0.0) -> PatchGrid:
    """Regular grid of patches whose tissue fraction (from the mask) is at least ``min_tissue``.

    Args:
        mpp: target micrometres per pixel of the patches (0.5 ≈ 20×).
        patch_size: patch side in pixels at ``mpp``.
        min_tissue: minimum fraction of the patch area covered by tissue, in [0, 1].
        overlap: fraction of a patch shared with its neighbour, in [0, 1).
    """
    if not mpp > 0:
        raise ValueError(f"mpp ({mpp}) must be > 0")
    if patch_size < 8:
        raise ValueError(f"patch_size ({patch_size}) must be >= 8")
    if not 0 <= min_tissue <= 1:
        raise ValueError(f"min_tissue ({min_tissue}) must be in [0, 1]")
    if not 0 <= overlap < 1:
        raise ValueError(f"overlap ({overlap}) must be in [0, 1)")
    slide_mpp = slide.mpp
    size0 = max(1, int(round(patch_size * mpp / slide_mpp)))
    if mpp < slide_mpp * 0.95:
        raise ValueError(f"target mpp ({mpp}) is finer than the slide's level 0 ({slide_mpp:.4f} µm/px); "
                         "patches would be upsampled")
    stride = max(1, int(round(size0 * (1 - overlap))))
    W, H = slide.dimensions
    xs = np.arange(0, W - size0 + 1, stride)
    ys = np.arange(0, H - size0 + 1, stride)
    level = slide.best_level_for_downsample(size0 / patch_size)
    if len(xs) == 0 or len(ys) == 0:
        return PatchGrid(np.zeros((0, 2), np.int64), patch_size, size0, level, mpp, slide_mpp, np.zeros(0, np.float32))
    # Tissue fraction per patch from an integral image of the mask.
    m = tissue.mask.astype(np.float64)
    ii = np.zeros((m.shape[0] + 1, m.shape[1] + 1))
    ii[1:, 1:] = m.cumsum(0).cumsum(1)
    d = tissue.downsample
    gx, gy = np.meshgrid(xs, ys)  # (ny, nx)
    x0 = np.clip(np.floor(gx / d).astype(int), 0, m.shape[1])
    y0 = np.clip(np.floor(gy / d).astype(int), 0, m.shape[0])
    x1 = np.clip(np.ceil((gx + size0) / d).astype(int), 0, m.shape[1])
    y1 = np.clip(np.ceil((gy + size0) / d).astype(int), 0, m.shape[0])
    area = np.maximum((x1 - x0) * (y1 - y0), 1)
    frac = (ii[y1, x1] - ii[y0, x1] - ii[y1, x0] + ii[y0, x0]) / area
    keep = frac >= max(min_tissue, 1e-9)
    coords = np.stack([gx[keep], gy[keep]], axis=1).astype(np.int64)  # (N, 2) row-major order
    return PatchGrid(coords, patch_size, size0, level, mpp, slide_mpp, frac[keep].astype(np.float32))


def _atomic_target(path: str) -> str:
    d, b = os.path.split(path)
    return os.path.join(d, f".{b}.{os.getpid()}.tmp")


def write_h5(path: str | os.PathLike, grid: PatchGrid, features: np.ndarray | None = None, **extra_attrs) -> None:
    """Write ``coords`` (and ``features`` (N, D) if given) into an HDF5 file atomically (temp + rename).

    Layout (CLAM): dataset ``coords`` (N, 2) int64 with attrs ``patch_size``, ``patch_level``, ``mpp``
    (plus ``patch_size_level0``, ``slide_mpp``); dataset ``features`` (N, D) float32; dataset
    ``tissue_fraction`` (N,). Extra keyword attrs go on the file root (e.g. ``encoder``).
    """
    import h5py

    path = os.fspath(path)
    tmp = _atomic_target(path)
    try:
        with h5py.File(tmp, "w") as f:
            dc = f.create_dataset("coords", data=grid.coords.astype(np.int64), maxshape=(None, 2))
            for k, v in grid.attrs().items():
                dc.attrs[k] = v
            f.create_dataset("tissue_fraction", data=grid.tissue_fraction.astype(np.float32))
            if features is not None:
                if features.shape[0] != grid.coords.shape[0]:
                    raise ValueError(f"features rows ({features.shape[0]}) != coords rows ({grid.coords.shape[0]})")
                f.create_dataset("features", data=np.asarray(features, np.float32))
            for k, v in extra_attrs.items():
                f.attrs[k] = v
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_h5(path: str | os.PathLike) -> dict:
    """Read a patch/feature HDF5 file: dict with ``coords``, ``features`` (or None), ``tissue_fraction`` (or None:
    files of other writers) and ``attrs`` (coords attrs + root)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"HDF5 file not found: {path!r}")
    try:
        with open_hdf5(path, what="patch coordinates (and features) written by pathology.patching") as f:
            if "coords" not in f:
                raise ValueError(f"{path!r} has no 'coords' dataset (keys: {list(f.keys())})")
            out = {
                "coords": f["coords"][:],
                "features": f["features"][:] if "features" in f else None,
                "tissue_fraction": f["tissue_fraction"][:] if "tissue_fraction" in f else None,
                "attrs": {**dict(f["coords"].attrs), **dict(f.attrs)},
            }
    except OSError as e:  # a file that opens but whose datasets cannot be read (damaged)
        raise ValueError(f"{path!r} is not a readable HDF5 file: {e}") from e
    return out


def grid_from_h5(data: dict) -> PatchGrid:
    """The :class:`PatchGrid` stored by :func:`write_h5` (as :func:`read_h5` returns it), its tissue fractions
    included; ``ValueError`` when the file holds none (another writer's file: make the grid again)."""
    a = data["attrs"]
    n = data["coords"].shape[0]
    frac = data.get("tissue_fraction")
    if frac is None or np.shape(frac) != (n,):
        raise ValueError(f"the patch file holds no tissue_fraction for its {n} patches; make the grid again")
    return PatchGrid(data["coords"].astype(np.int64), int(a["patch_size"]), int(a["patch_size_level0"]),
                     int(a["patch_level"]), float(a["mpp"]), float(a["slide_mpp"]), np.asarray(frac, np.float32))


def overview_image(thumbnail: np.ndarray, downsample: float, *, mask: np.ndarray | None = None,
                   coords: np.ndarray | None = None, patch_size_level0: int | None = None,
                   heat: np.ndarray | None = None) -> np.ndarray:
    """Thumbnail with the tissue mask tinted green, patch outlines in blue and optionally a per-patch heatmap.

    Args:
        thumbnail: (h, w, 3) uint8; ``downsample`` level-0 pixels per thumbnail pixel.
        mask: (h', w') bool tissue mask (resized to the thumbnail if needed).
        heat: (N,) values in [0, 1] per patch, drawn with a colour map over the patches.
    """
    from PIL import Image, ImageDraw

    img = thumbnail.astype(np.float32).copy()
    h, w = img.shape[:2]
    if mask is not None:
        mk = mask
        if mk.shape != (h, w):
            mk = np.asarray(Image.fromarray(mask.astype(np.uint8) * 255).resize((w, h), Image.NEAREST)) > 0
        img[mk] = img[mk] * 0.75 + np.array([0, 200, 0], np.float32) * 0.25
    out = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    if coords is not None and patch_size_level0 is not None and len(coords):
        s = patch_size_level0 / downsample
        if heat is not None:
            import matplotlib

            cmap = matplotlib.colormaps["inferno"]
            over = Image.new("RGBA", out.size, (0, 0, 0, 0))
            d = ImageDraw.Draw(over)
            for (x, y), v in zip(coords, np.clip(heat, 0, 1)):
                r, g, b, _ = cmap(float(v))
                d.rectangle([x / downsample, y / downsample, x / downsample + s, y / downsample + s],
                            fill=(int(r * 255), int(g * 255), int(b * 255), 170))
            out = Image.alpha_composite(out.convert("RGBA"), over).convert("RGB")
        else:
            d = ImageDraw.Draw(out)
            for x, y in coords:
                d.rectangle([x / downsample, y / downsample, x / downsample + s - 1, y / downsample + s - 1],
                            outline=(30, 60, 220))
    return np.asarray(out)


def save_png(path: str | os.PathLike, img: np.ndarray) -> None:
    """Save an RGB array as PNG atomically."""
    from PIL import Image

    path = os.fspath(path)
    tmp = _atomic_target(path) + ".png"
    Image.fromarray(img).save(tmp)
    os.replace(tmp, path)
