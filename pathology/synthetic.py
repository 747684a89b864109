"""Synthetic whole-slide images: pyramidal tiled BigTIFF files with known labels.

Each slide is rendered tile by tile (never a whole level 0 in memory) from a low-resolution *layout*
map of classes (background, tissue, lesion, pattern A, pattern B) and textures cut from scikit-image's
``ihc.png`` histology image. The file is a tiled (256²) JPEG BigTIFF, level 0 first, reduced levels as
further pages with ``subfiletype=1``, and resolution tags giving µm/px, so OpenSlide opens it as a
generic tiled TIFF.

Tasks written to ``labels.csv``:
- ``lesion`` (local task): 1 if the slide holds lesion texture anywhere, else 0.
- ``longrange``: every slide holds exactly two pattern sites of the same size, placed far apart, each
  wholly inside tissue. Label 1: one site of pattern A and one of pattern B; label 0: two sites of A, or
  two of B (``generate_dataset`` makes half the slides positive and splits the negatives evenly between
  AA and BB). The amount of pattern tissue is the same in every slide and each pattern occurs in both
  classes, so neither a single site nor the bag's average (positives sit halfway between AA and BB) tells
  the label; a model has to relate the two far-apart sites.
- ``time``, ``event`` (survival): exponential time with hazard growing with lesion burden, uniform
  censoring.

CLI: ``python -m pathology.synthetic --out DIR --n N --seed S [--size 8192] [--mpp 0.5]``.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from core.infra.cli import capped_int, memory_capped_int, nonempty_path, positive_float, run_cli
from core.infra.guard import check_outputs

logger = logging.getLogger(__name__)

__all__ = [
    "CLASSES",
    "SlideSpec",
    "sample_spec",
    "balanced_labels",
    "render_layout",
    "write_slide",
    "generate_dataset",
    "build_parser",
    "main",
]

# Layout classes. The values are stored in the ``truth/*.png`` maps written beside each slide.
CLASSES = {"background": 0, "tissue": 1, "lesion": 2, "pattern_a": 3, "pattern_b": 4}
TILE = 256
LAYOUT_SCALE = 16  # one layout cell covers 16×16 level-0 pixels


@dataclass(kw_only=True)
class SlideSpec:
    """What one synthetic slide contains (drawn by :func:`sample_spec`)."""

    name: str  # file stem
    width: int  # level-0 width in pixels
    height: int  # level-0 height in pixels
    mpp: float  # micrometres per pixel at level 0
    seed: int  # seed of every random choice inside the slide
    lesion: int  # local task label: lesion texture present (1) or not (0)
    longrange: int  # long-range task label: the two pattern sites are A and B (1), or both A / both B (0)
    has_a: bool  # pattern A present
    has_b: bool  # pattern B present
    sites: str = ""  # patterns of the two sites: "AB", "AA" or "BB" (derived from has_a/has_b when empty)
    time: float = 0.0  # survival time (filled after rendering, from the lesion burden)
    event: int = 0  # 1 = death observed, 0 = censored
    burden: float = 0.0  # lesion area / tissue area (filled after rendering)

    def __post_init__(self) -> None:
        if self.width < TILE or self.height < TILE:
            raise ValueError(f"slide size ({self.width}x{self.height}) must be at least {TILE} px per side")
        if not self.mpp > 0:
            raise ValueError(f"mpp ({self.mpp}) must be > 0")
        if not self.sites:
            self.sites = "AB" if self.has_a and self.has_b else ("AA" if self.has_a else "BB")
        if self.sites not in ("AB", "AA", "BB"):
            raise ValueError(f"sites ({self.sites!r}) must be 'AB', 'AA' or 'BB'")
        if (self.sites == "AB") != bool(self.longrange) or self.has_a != ("A" in self.sites) or self.has_b != ("B" in self.sites):
            raise ValueError(f"sites ({self.sites!r}) disagree with longrange={self.longrange}, has_a={self.has_a}, "
                             f"has_b={self.has_b}")


def sample_spec(rng: np.random.Generator, *, name: str, width: int, height: int, mpp: float,
                lesion: int | None = None, sites: str | None = None) -> SlideSpec:
    """Draw the labels of one slide: lesion and long-range labels independent of each other.

    ``lesion`` and ``sites`` ("AB", "AA", "BB") override the draws (the random numbers are consumed either
    way, so the slide's seed does not depend on them); by default each label is 1 with probability 1/2 and
    a negative long-range slide is AA or BB with probability 1/2 each.
    """
    drawn_lesion = int(rng.random() < 0.5)
    drawn_longrange = int(rng.random() < 0.5)
    drawn_a = bool(rng.random() < 0.5) if not drawn_longrange else True
    lesion = drawn_lesion if lesion is None else int(lesion)
    if sites is None:
        sites = "AB" if drawn_longrange else ("AA" if drawn_a else "BB")
    if sites not in ("AB", "AA", "BB"):
        raise ValueError(f"sites ({sites!r}) must be 'AB', 'AA' or 'BB'")
    return SlideSpec(
        name=name, width=width, height=height, mpp=mpp, seed=int(rng.integers(2**31)), lesion=lesion,
        longrange=int(sites == "AB"), has_a="A" in sites, has_b="B" in sites, sites=sites,
    )


def balanced_labels(n: int, rng: np.random.Generator) -> tuple[list[int], list[str]]:
    """Lesion labels and pattern sites, balanced in every consecutive group of four slides.

    Each group holds two lesion and two lesion-free slides, and the sites "AB", "AB", "AA", "BB", each
    shuffled independently; so half the slides are long-range positives, a quarter each AA and BB. Groups
    are drawn in order, so the first ``m`` labels do not depend on ``n`` (a larger dataset extends a smaller one).
    """
    lesion: list[int] = []
    sites: list[str] = []
    for _ in range(0, n, 4):
        lesion += [int(v) for v in rng.permutation([0, 1, 0, 1])]
        sites += [str(v) for v in rng.permutation(["AB", "AB", "AA", "BB"])]
    return lesion[:n], sites[:n]


# --------------------------------------------------------------------------------------------- textures


def _ihc() -> np.ndarray:
    from skimage import data

    return data.immunohistochemistry()  # (512, 512, 3) uint8


def _atlas(rng: np.random.Generator, base: np.ndarray, size: int = 1024, piece: int = 128) -> np.ndarray:
    """A size×size texture mosaic of random flipped/rotated crops of ``base`` (breaks the 512-px period)."""
    out = np.empty((size, size, 3), np.uint8)
    h, w = base.shape[:2]
    for y in range(0, size, piece):
        for x in range(0, size, piece):
            oy, ox = rng.integers(0, h - piece), rng.integers(0, w - piece)
            crop = base[oy : oy + piece, ox : ox + piece]
            crop = np.rot90(crop, int(rng.integers(4)))
            if rng.random() < 0.5:
                crop = crop[:, ::-1]
            out[y : y + piece, x : x + piece] = crop
    return out


def _textures(rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Texture atlases per layout class (float32 RGB in [0, 255])."""
    from skimage.color import hed2rgb, rgb2hed

    ihc = _ihc()
    tissue = _atlas(rng, ihc).astype(np.float32)
    hed = rgb2hed(ihc)
    # Lesion: dense hematoxylin (nuclei-rich), little DAB; reads as crowded dark-purple cells.
    les = hed.copy()
    les[..., 0] *= 2.6
    les[..., 2] *= 0.2
    lesion = _atlas(rng, np.clip(hed2rgb(les) * 255, 0, 255).astype(np.uint8)).astype(np.float32)
    yy, xx = np.mgrid[0:1024, 0:1024]
    # Pattern A: brown (DAB-rich) tissue with a dotted grid of dark nuclei clusters.
    pa = hed.copy()
    pa[..., 2] *= 3.0
    pa[..., 0] *= 0.6
    a = _atlas(rng, np.clip(hed2rgb(pa) * 255, 0, 255).astype(np.uint8)).astype(np.float32)
    dots = ((np.sin(xx / 5.0) * np.sin(yy / 5.0)) > 0.6)[..., None]
    a = np.where(dots, a * 0.45, a)
    # Pattern B: pink fibrous bands (diagonal stripes) over faint tissue.
    pb = hed.copy()
    pb[..., 1] *= 4.0
    pb[..., 0] *= 0.5
    b = _atlas(rng, np.clip(hed2rgb(pb) * 255, 0, 255).astype(np.uint8)).astype(np.float32)
    stripes = (np.sin((xx + yy) / 4.0) > 0.3)[..., None]
    b = np.where(stripes, b * 0.7 + np.array([60, 0, 40], np.float32) * 0.3, b)
    return {1: tissue, 2: lesion, 3: a, 4: np.clip(b, 0, 255)}


# ----------------------------------------------------------------------------------------------- layout


def _smooth_noise(rng: np.random.Generator, shape: tuple[int, int], sigma: float) -> np.ndarray:
    from scipy.ndimage import gaussian_filter

    n = gaussian_filter(rng.standard_normal(shape).astype(np.float32), sigma)
    return (n - n.mean()) / (n.std() + 1e-8)


def _disk(shape: tuple[int, int], cy: float, cx: float, r: float) -> np.ndarray:
    yy, xx = np.ogrid[: shape[0], : shape[1]]
    return (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r


def render_layout(spec: SlideSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Class map, tissue alpha and artifact map at 1/``LAYOUT_SCALE`` of level 0.

    Returns:
        classes (h, w) uint8 with :data:`CLASSES` values; alpha (h, w) float32 tissue opacity in [0, 1];
        artifacts (h, w) uint8 (0 none, 1 pen mark, 2 dust, 3 fold).
    """
    rng = np.random.default_rng(spec.seed)
    h, w = math.ceil(spec.height / LAYOUT_SCALE), math.ceil(spec.width / LAYOUT_SCALE)
    # Tissue: a few elliptical lobes with a wobbly border, away from the slide edge.
    field = np.full((h, w), -3.0, np.float32)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for _ in range(int(rng.integers(2, 5))):
        cy, cx = rng.uniform(0.25, 0.75) * h, rng.uniform(0.25, 0.75) * w
        ry, rx = rng.uniform(0.15, 0.3) * h, rng.uniform(0.15, 0.3) * w
        field = np.maximum(field, 1.0 - ((yy - cy) / ry) ** 2 - ((xx - cx) / rx) ** 2)
    field = field + 0.35 * _smooth_noise(rng, (h, w), max(h, w) / 40)
    tissue = field > 0
    # Holes (lumen / fat) inside the tissue.
    holes = _smooth_noise(rng, (h, w), max(h, w) / 60) > 2.0
    tissue &= ~holes
    classes = tissue.astype(np.uint8)
    alpha = np.clip(field * 4.0, 0.0, 1.0).astype(np.float32) * tissue
    ys, xs = np.nonzero(tissue)
    if len(ys) == 0:  # degenerate tiny slide: put one blob in the middle
        classes[h // 2, w // 2] = 1
        ys, xs = np.array([h // 2]), np.array([w // 2])

    def place(r: float, far_from: tuple[float, float] | None = None) -> tuple[float, float]:
        best, best_d = (float(ys[0]), float(xs[0])), -1.0
        for _ in range(64):
            i = int(rng.integers(len(ys)))
            p = (float(ys[i]), float(xs[i]))
            if far_from is None:
                return p
            d = math.hypot(p[0] - far_from[0], p[1] - far_from[1])
            if d > best_d:
                best, best_d = p, d
        return best

    if spec.lesion:
        for _ in range(int(rng.integers(1, 4))):
            r = rng.uniform(0.02, 0.06) * max(h, w)
            cy, cx = place(r)
            blob = _disk((h, w), cy, cx, r) & (_smooth_noise(rng, (h, w), r / 3) > -0.8)
            classes[blob & tissue] = CLASSES["lesion"]
    # Two pattern sites of equal size (AB, AA or BB), each wholly inside tissue where the tissue allows it,
    # the second as far as possible from the first: the same amount of pattern tissue in every slide.
    r_pat = 0.07 * max(h, w)
    _place_sites(rng, classes, tissue, spec.sites, r_pat)
    if spec.lesion and not (classes == CLASSES["lesion"]).any():
        # rare on small slides: the blobs missed the tissue or the pattern sites covered them; the label must
        # still hold, so plain tissue gets a small lesion disk (no random draw: other slides are unchanged)
        ty, tx = np.nonzero(classes == CLASSES["tissue"])
        if len(ty) == 0:
            ty, tx = np.nonzero(tissue)
        i = len(ty) // 2
        disk = _disk((h, w), float(ty[i]), float(tx[i]), max(2.0, 0.02 * max(h, w)))
        classes[disk & (classes == CLASSES["tissue"])] = CLASSES["lesion"]
        if not (classes == CLASSES["lesion"]).any():
            classes[ty[i], tx[i]] = CLASSES["lesion"]
    # Artifacts: pen strokes, dust specks, a tissue fold.
    art = np.zeros((h, w), np.uint8)
    for _ in range(int(rng.integers(0, 3))):
        t = np.linspace(0, 1, 200)
        y0, x0 = rng.uniform(0, h), rng.uniform(0, w)
        py = y0 + rng.uniform(-0.3, 0.3) * h * t + 0.05 * h * np.sin(6 * t + rng.uniform(0, 6))
        px = x0 + rng.uniform(-0.3, 0.3) * w * t
        for y, x in zip(py, px):
            art[_disk((h, w), y, x, max(1.0, 0.004 * max(h, w)))] = 1
    for _ in range(int(rng.integers(3, 12))):
        art[_disk((h, w), rng.uniform(0, h), rng.uniform(0, w), rng.uniform(0.5, 1.5))] = 2
    if rng.random() < 0.5 and len(ys):
        i = int(rng.integers(len(ys)))
        band = np.abs((yy - ys[i]) * 0.6 - (xx - xs[i]) * 0.8) < 0.006 * max(h, w)
        art[band & tissue & (np.hypot(yy - ys[i], xx - xs[i]) < 0.15 * max(h, w))] = 3
    return classes, alpha, art


def _place_sites(rng: np.random.Generator, classes: np.ndarray, tissue: np.ndarray, sites: str, r: float) -> None:
    """Paint the two pattern disks of ``sites`` into ``classes`` (in place)."""
    from scipy.ndimage import distance_transform_edt

    h, w = tissue.shape
    depth = distance_transform_edt(np.pad(tissue, 1))[1:-1, 1:-1]  # distance to the nearest non-tissue cell
    inside = depth > r  # centres whose whole disk lies in tissue
    if not inside.any():  # small or thin tissue: the deepest cells (the disks get clipped by the tissue)
        inside = depth >= max(1.0, float(depth.max()) * 0.8)
    cy, cx = np.nonzero(inside)
    i = int(rng.integers(len(cy)))
    first = (float(cy[i]), float(cx[i]))
    # Second centre: the candidate farthest from the first (on a tiny slide the disks may overlap).
    d = np.hypot(cy - first[0], cx - first[1])
    j = int(np.argmax(d))
    second = (float(cy[j]), float(cx[j]))
    code = {"A": CLASSES["pattern_a"], "B": CLASSES["pattern_b"]}
    for letter, (y, x) in zip(sites, (first, second)):
        classes[_disk((h, w), y, x, r) & tissue] = code[letter]


# -------------------------------------------------------------------------------------------- rendering


def _bilinear_weights(start: int, n: int, size: int) -> np.ndarray:
    """(n, size) weights mapping layout cells to level-0 pixels start..start+n-1 (bilinear, edge-clamped)."""
    pos = (np.arange(start, start + n, dtype=np.float32) + 0.5) / LAYOUT_SCALE - 0.5
    pos = np.clip(pos, 0, size - 1)
    i0 = np.floor(pos).astype(int)
    i1 = np.minimum(i0 + 1, size - 1)
    f = (pos - i0).astype(np.float32)
    w = np.zeros((n, size), np.float32)
    w[np.arange(n), i0] += 1 - f
    w[np.arange(n), i1] += f
    return w


class _Renderer:
    """Renders level-0 tiles of one slide and accumulates its reduced levels."""

    def __init__(self, spec: SlideSpec, classes: np.ndarray, alpha: np.ndarray, art: np.ndarray, down: int):
        self.spec = spec
        self.classes, self.alpha, self.art = classes, alpha, art
        self.rng = np.random.default_rng(spec.seed + 1)
        self.tex = _textures(self.rng)
        self.pen_colour = np.array(self.rng.choice([[40, 110, 60], [40, 60, 150], [20, 20, 30]]), np.float32)
        self.down = down
        self.level1 = np.zeros((math.ceil(spec.height / down), math.ceil(spec.width / down), 3), np.uint8)

    def _upsample(self, arr: np.ndarray, y0: int, x0: int, th: int, tw: int, order: int) -> np.ndarray:

        if order == 0:
            iy = np.minimum(np.arange(y0, y0 + th) // LAYOUT_SCALE, arr.shape[0] - 1)
            ix = np.minimum(np.arange(x0, x0 + tw) // LAYOUT_SCALE, arr.shape[1] - 1)
            return arr[iy[:, None], ix[None, :]]
        # Bilinear as two small matrix products over the covering crop: (th, hc) @ crop (hc, wc) @ (wc, tw).
        cy0, cy1 = max(0, y0 // LAYOUT_SCALE - 1), min(arr.shape[0], (y0 + th) // LAYOUT_SCALE + 2)
        cx0, cx1 = max(0, x0 // LAYOUT_SCALE - 1), min(arr.shape[1], (x0 + tw) // LAYOUT_SCALE + 2)
        wy = _bilinear_weights(y0, th, arr.shape[0])[:, cy0:cy1]
        wx = _bilinear_weights(x0, tw, arr.shape[1])[:, cx0:cx1]
        return wy @ arr[cy0:cy1, cx0:cx1].astype(np.float32) @ wx.T

    @staticmethod
    def _tex(tex: np.ndarray, y0: int, x0: int, th: int, tw: int) -> np.ndarray:
        n = tex.shape[0]
        ry, rx = y0 % n, x0 % n
        if ry + th <= n and rx + tw <= n:
            return tex[ry : ry + th, rx : rx + tw]
        return tex[(np.arange(y0, y0 + th) % n)[:, None], (np.arange(x0, x0 + tw) % n)[None, :]]

    def tile(self, y0: int, x0: int) -> np.ndarray:
        th, tw = TILE, TILE
        cls = self._upsample(self.classes, y0, x0, th, tw, order=0)
        alpha = self._upsample(self.alpha, y0, x0, th, tw, order=1)[..., None]
        art = self._upsample(self.art, y0, x0, th, tw, order=0)
        bg = 238.0 + self.rng.normal(0, 3, (th, tw, 1)).astype(np.float32)
        if alpha.max() <= 0:
            out = np.repeat(bg, 3, axis=2)
        else:
            rgb = self._tex(self.tex[1], y0, x0, th, tw).copy()
            for c in (2, 3, 4):
                m = cls == c
                if m.any():
                    rgb[m] = self._tex(self.tex[c], y0, x0, th, tw)[m]
            out = alpha * rgb + (1 - alpha) * bg
        if (art == 1).any():
            out[art == 1] = out[art == 1] * 0.35 + self.pen_colour * 0.65
        if (art == 2).any():
            out[art == 2] = 30.0
        if (art == 3).any():
            out[art == 3] = out[art == 3] * 0.55
        tile = np.clip(out, 0, 255).astype(np.uint8)
        # Reduced level: box-filter the tile and store it.
        d = self.down
        small = (tile.reshape(th // d, d, tw // d, d, 3).sum(axis=(1, 3), dtype=np.uint32) // (d * d)).astype(np.uint8)
        ly, lx = y0 // d, x0 // d
        dst = self.level1[ly : ly + th // d, lx : lx + tw // d]
        dst[...] = small[: dst.shape[0], : dst.shape[1]]
        return tile

    def tiles(self) -> Iterator[np.ndarray]:
        for y0 in range(0, self.spec.height, TILE):
            for x0 in range(0, self.spec.width, TILE):
                yield self.tile(y0, x0)


def _downsample(img: np.ndarray, d: int) -> np.ndarray:
    h, w = img.shape[0] // d * d, img.shape[1] // d * d
    if h == 0 or w == 0:
        return img[:1, :1].copy()
    return img[:h, :w].reshape(h // d, d, w // d, d, 3).mean(axis=(1, 3)).astype(np.uint8)


def _level_tiles(img: np.ndarray) -> Iterator[np.ndarray]:
    h, w = img.shape[:2]
    for y0 in range(0, h, TILE):
        for x0 in range(0, w, TILE):
            t = np.full((TILE, TILE, 3), 238, np.uint8)
            crop = img[y0 : y0 + TILE, x0 : x0 + TILE]
            t[: crop.shape[0], : crop.shape[1]] = crop
            yield t


def write_slide(spec: SlideSpec, path: str | os.PathLike, *, quality: int = 85) -> SlideSpec:
    """Render ``spec`` into a pyramidal tiled JPEG BigTIFF at ``path`` (atomically) and fill its survival fields.

    Level 0 is streamed tile by tile; level 1 (4× down) is accumulated from the level-0 tiles, and further
    levels (4× each) come from it, until a level fits in one tile. Writes ``truth/<stem>.png`` (the layout
    class map, one pixel per 16×16 level-0 pixels) beside the slide. Returns the spec with ``burden``, ``time`` and ``event`` set.
    """
    import tifffile
    from PIL import Image

    path = os.fspath(path)
    # Pad level 0 to whole tiles so every tile is full (OpenSlide reports the padded size).
    _pad(spec)
    classes, alpha, art = render_layout(spec)
    _set_survival(spec, classes)

    down = 4
    renderer = _Renderer(spec, classes, alpha, art, down)
    res = 1e4 / spec.mpp  # pixels per centimetre
    opts = dict(photometric="rgb", compression="jpeg", compressionargs={"level": quality}, tile=(TILE, TILE),
                resolutionunit="CENTIMETER", metadata=None)
    tmp = path + ".tmp"
    with tifffile.TiffWriter(tmp, bigtiff=True) as tif:
        tif.write(renderer.tiles(), shape=(spec.height, spec.width, 3), dtype=np.uint8, resolution=(res, res),
                  description=f"synthetic slide {spec.name}; mpp={spec.mpp}", **opts)
        level = renderer.level1
        scale = down
        while True:
            tif.write(_level_tiles(level), shape=level.shape, dtype=np.uint8, subfiletype=1,
                      resolution=(res / scale, res / scale), **opts)
            if max(level.shape[:2]) <= TILE:
                break
            level = _downsample(level, down)
            scale *= down
    os.replace(tmp, path)
    truth_dir = os.path.join(os.path.dirname(path) or ".", "truth")
    os.makedirs(truth_dir, exist_ok=True)
    truth = os.path.join(truth_dir, os.path.splitext(os.path.basename(path))[0] + ".png")
    Image.fromarray(classes).save(truth + ".tmp.png")
    os.replace(truth + ".tmp.png", truth)
    return spec


LABEL_FIELDS = ["slide_id", "lesion", "longrange", "time", "event", "burden", "has_a", "has_b", "sites", "mpp",
                "width", "height"]


def generate_dataset(out: str | os.PathLike, *, n: int, seed: int = 0, size: int = 8192, mpp: float = 0.5,
                     size_jitter: float = 0.25, progress: bool = False) -> list[SlideSpec]:
    """Write ``n`` slides ``slide_000.tiff``... and ``labels.csv`` into ``out``; resumable (finished slides are kept).

    Args:
        size: nominal level-0 side in pixels; each side is drawn in ``size·[1-jitter, 1+jitter]``.
    """
    if n < 1:
        raise ValueError(f"n ({n}) must be >= 1")
    if size < TILE:
        raise ValueError(f"size ({size}) must be >= {TILE}")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(seed)
    lesions, sites = balanced_labels(n, np.random.default_rng([seed, 1]))
    specs = []
    for i in range(n):
        w = int(size * rng.uniform(1 - size_jitter, 1 + size_jitter))
        h = int(size * rng.uniform(1 - size_jitter, 1 + size_jitter))
        specs.append(sample_spec(rng, name=f"slide_{i:03d}", width=w, height=h, mpp=mpp, lesion=lesions[i],
                                 sites=sites[i]))
    it: Sequence[SlideSpec] | Iterator[SlideSpec] = specs
    if progress:
        from tqdm import tqdm

        it = tqdm(specs, desc="synthetic slides", unit="slide")
    for spec in it:
        # Rendering is deterministic from the spec, so a rerun re-derives the survival fields cheaply.
        path = os.path.join(out, spec.name + ".tiff")
        if os.path.exists(path):
            _fill_survival(spec)
            continue
        write_slide(spec, path)
    tmp = os.path.join(out, "labels.csv.tmp")
    with open(tmp, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=LABEL_FIELDS)
        wr.writeheader()
        for s in specs:
            wr.writerow({"slide_id": s.name, "lesion": s.lesion, "longrange": s.longrange, "time": s.time,
                         "event": s.event, "burden": round(s.burden, 5), "has_a": int(s.has_a),
                         "has_b": int(s.has_b), "sites": s.sites, "mpp": s.mpp, "width": s.width, "height": s.height})
    os.replace(tmp, os.path.join(out, "labels.csv"))
    return specs


def _pad(spec: SlideSpec) -> None:
    spec.width = math.ceil(spec.width / TILE) * TILE
    spec.height = math.ceil(spec.height / TILE) * TILE


def _set_survival(spec: SlideSpec, classes: np.ndarray) -> None:
    """Lesion burden -> exponential event time (hazard 0.05·exp(12·burden)), uniform censoring in [5, 60]."""
    spec.burden = float((classes == CLASSES["lesion"]).sum() / max(1, (classes > 0).sum()))
    rng = np.random.default_rng(spec.seed + 2)
    hazard = 0.05 * math.exp(12.0 * spec.burden)
    t_event = rng.exponential(1.0 / hazard)
    t_cens = rng.uniform(5.0, 60.0)
    spec.time = float(round(min(t_event, t_cens), 3))
    spec.event = int(t_event <= t_cens)


def _fill_survival(spec: SlideSpec) -> None:
    _pad(spec)
    _set_survival(spec, render_layout(spec)[0])


#: memory of rendering per level-0 pixel (the layout and the first pyramid level are held; measured: 0.19 B/px
#: at 16384 px), the largest --size (whole-slide scans reach about 150,000 px) and the most slides per call
BYTES_PER_PIXEL = 0.25
MAX_SIDE = 200_000
MAX_SLIDES = 100_000


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.synthetic", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder (created)")
    p.add_argument("--n", type=capped_int(MAX_SLIDES, why="slides per call"), default=8, help="number of slides")
    p.add_argument("--seed", type=int, default=0, help="random seed")
    p.add_argument("--size", type=memory_capped_int(BYTES_PER_PIXEL, power=2, what="rendering a slide", minimum=TILE,
                                                    limit=MAX_SIDE, limit_why="larger than whole-slide scans"),
                   default=8192, help=f"nominal level-0 side in pixels (default 8192, {TILE} to {MAX_SIDE})")
    p.add_argument("--mpp", type=positive_float, default=0.5, help="micrometres per pixel at level 0 (default 0.5)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)])
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    specs = generate_dataset(args.out, n=args.n, seed=args.seed, size=args.size, mpp=args.mpp, progress=True)
    logger.info("wrote %d slides and labels.csv to %s", len(specs), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
