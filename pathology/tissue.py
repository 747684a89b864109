"""Tissue segmentation: Otsu threshold on (square-root) saturation at a low-resolution level, then morphology.

Otsu runs on the square root of the saturation: the saturation of stained tissue has a long tail (a few
dark, strongly stained regions near 1.0 next to pale stroma near 0.1), and on the raw values that tail
pulls the threshold above most of the tissue. The square root compresses the tail and spreads out the low
end where tissue and glass separate.

The mask lives at a low resolution (``downsample`` level-0 pixels per mask pixel; by default the thumbnail
is at about 8 µm/px, 16× below a 0.5 µm/px scan) so it is cheap for any slide size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pathology.slide import Slide

__all__ = ["TissueConfig", "TissueMask", "segment_tissue", "tissue_mask_from_rgb"]


@dataclass(kw_only=True)
class TissueConfig:
    """How tissue is found."""

    seg_mpp: float = 8.0  # micrometres per pixel of the thumbnail the mask is computed on (16× below 0.5 µm/px)
    max_seg_size: int = 4096  # cap on the thumbnail's longest side (pixels), for very large slides
    median: int = 5  # median-filter width on saturation (pixels of the thumbnail); removes JPEG noise and dust
    min_saturation: float = 0.05  # saturation floor: an Otsu threshold below it is raised to it (blank slides)
    max_value_dark: float = 0.12  # pixels darker than this value (V in HSV) are debris/pen, not tissue
    close_um: float = 64.0  # closing radius in micrometres (joins nearby tissue fragments)
    min_area_um2: float = 40_000.0  # tissue pieces smaller than this (µm²) are dropped (0.04 mm²)
    max_hole_um2: float = 20_000.0  # holes smaller than this (µm²) are filled; larger ones (lumen, fat) stay

    def __post_init__(self) -> None:
        if not self.seg_mpp > 0:
            raise ValueError(f"seg_mpp ({self.seg_mpp}) must be > 0")
        if self.max_seg_size < 16:
            raise ValueError(f"max_seg_size ({self.max_seg_size}) must be >= 16")
        if self.median < 1 or self.median % 2 == 0:
            raise ValueError(f"median ({self.median}) must be an odd number >= 1")
        if not 0 <= self.min_saturation < 1:
            raise ValueError(f"min_saturation ({self.min_saturation}) must be in [0, 1)")
        for name in ("close_um", "min_area_um2", "max_hole_um2"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} ({getattr(self, name)}) must be >= 0")


#: the smallest slide side (pixels) the tissue detector reads
MIN_SLIDE_SIDE = 16


@dataclass
class TissueMask:
    """A boolean tissue mask and its scale."""

    mask: np.ndarray  # (h, w) bool, True = tissue
    downsample: float  # level-0 pixels per mask pixel
    thumbnail: np.ndarray  # (h, w, 3) uint8, the image the mask was computed on

    @property
    def tissue_fraction(self) -> float:
        return float(self.mask.mean()) if self.mask.size else 0.0


def tissue_mask_from_rgb(rgb: np.ndarray, *, um_per_px: float, config: TissueConfig | None = None) -> np.ndarray:
    """Tissue mask of an RGB image whose pixels are ``um_per_px`` micrometres wide."""
    from scipy import ndimage as ndi
    from skimage.color import rgb2hsv
    from skimage.filters import threshold_otsu
    from skimage.morphology import disk, remove_small_holes, remove_small_objects

    cfg = config or TissueConfig()
    hsv = rgb2hsv(rgb)
    sat = ndi.median_filter(hsv[..., 1], size=cfg.median)
    val = hsv[..., 2]
    try:
        thr = float(threshold_otsu(np.sqrt(sat))) ** 2  # see the module docstring
    except ValueError:  # constant image
        thr = 1.0
    thr = max(thr, cfg.min_saturation)
    mask = (sat > thr) & (val > cfg.max_value_dark)
    r = min(int(round(cfg.close_um / um_per_px)), max(mask.shape))  # a disk wider than the image closes nothing more
    if r >= 1:
        mask = ndi.binary_closing(np.pad(mask, r), structure=disk(r))[r:-r, r:-r]
    px_area = um_per_px * um_per_px
    min_px = int(cfg.min_area_um2 / px_area)
    if min_px > 1:
        mask = remove_small_objects(mask, max_size=min_px)
    hole_px = int(cfg.max_hole_um2 / px_area)
    if hole_px > 1:
        mask = remove_small_holes(mask, max_size=hole_px)
    return mask.astype(bool)


def segment_tissue(slide: Slide, config: TissueConfig | None = None) -> TissueMask:
    """Tissue mask of ``slide`` computed on a thumbnail at about ``config.seg_mpp`` µm/px."""
    cfg = config or TissueConfig()
    W, H = slide.dimensions
    if min(W, H) < MIN_SLIDE_SIDE:
        raise ValueError(f"the slide is {W}x{H} pixels: too small to hold tissue (at least {MIN_SLIDE_SIDE} pixels a "
                         "side)")
    size = int(min(cfg.max_seg_size, max(16, round(max(W, H) * slide.mpp / cfg.seg_mpp))))
    thumb = slide.thumbnail(size)
    downsample = W / thumb.shape[1]
    mask = tissue_mask_from_rgb(thumb, um_per_px=slide.mpp * downsample, config=cfg)
    return TissueMask(mask=mask, downsample=downsample, thumbnail=thumb)
