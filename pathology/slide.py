"""Whole-slide image access: OpenSlide formats and plain PNG/JPEG/TIFF images behind one class.

Coordinates follow OpenSlide: ``(x, y)`` in level-0 pixels, sizes ``(width, height)`` in pixels of the
requested level. Pixel arrays are ``(H, W, 3)`` uint8 RGB (transparent pixels composited on white).
Regions are read on demand; a whole level is never loaded (except for plain images, which are one
level by nature and are refused above :data:`MAX_PLAIN_PIXELS`).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

__all__ = ["Slide", "SlideError", "PLAIN_EXTENSIONS", "MAX_PLAIN_PIXELS"]

PLAIN_EXTENSIONS = (".png", ".jpg", ".jpeg", ".tif", ".tiff")
# A plain (untiled, single-level) image must be decoded whole; refuse ones that would not fit comfortably.
MAX_PLAIN_PIXELS = 16_384 * 16_384


class SlideError(ValueError):
    """A file that cannot be read as a slide (corrupt, truncated, unsupported), or a bad read request."""


def _openslide():
    try:
        import openslide
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("reading slides needs openslide: pip install 'longctx-suite[pathology]'") from e
    return openslide


class _OpenSlideBackend:
    def __init__(self, path: str):
        self._os = _openslide()
        self.handle = self._os.OpenSlide(path)
        self.level_dimensions = tuple(self.handle.level_dimensions)
        self.level_downsamples = tuple(float(d) for d in self.handle.level_downsamples)
        self.properties = dict(self.handle.properties)
        self.vendor = self.properties.get("openslide.vendor", "unknown")

    def file_mpp(self) -> float | None:
        try:
            x = float(self.properties["openslide.mpp-x"])
            y = float(self.properties.get("openslide.mpp-y", x))
        except (KeyError, ValueError):
            return None
        if not (x > 0 and y > 0):
            return None
        return (x + y) / 2

    def read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        try:
            rgba = np.asarray(self.handle.read_region((x, y), level, (w, h)))
        except self._os.OpenSlideError as e:
            raise SlideError(f"could not read region {(x, y, w, h)} at level {level}: {e}") from e
        return _composite(rgba)

    def close(self) -> None:
        self.handle.close()


class _PlainBackend:
    """A single-level PNG/JPEG/TIFF image, decoded whole at open (it has no tiles to read separately)."""

    def __init__(self, path: str):
        from PIL import Image

        self.path = path
        try:
            with Image.open(path) as im:
                im.verify()
            self._im = Image.open(path)
        except Exception as e:
            raise SlideError(f"{path!r} is not a readable image ({type(e).__name__}: {e})") from e
        w, h = self._im.size
        if w * h > MAX_PLAIN_PIXELS:
            raise SlideError(
                f"{path!r} is a plain {w}x{h} image; images above {MAX_PLAIN_PIXELS} pixels must be tiled "
                "pyramidal files (e.g. BigTIFF) that can be read region by region"
            )
        self.level_dimensions = ((w, h),)
        self.level_downsamples = (1.0,)
        self.properties = {k: str(v) for k, v in self._im.info.items() if isinstance(v, (str, int, float, tuple))}
        self.vendor = f"plain-{(self._im.format or 'image').lower()}"
        try:
            self._arr = _composite(np.asarray(self._im.convert("RGBA")))
        except Exception as e:
            raise SlideError(f"could not decode {path!r} (truncated or corrupt?): {type(e).__name__}: {e}") from e

    def file_mpp(self) -> float | None:
        info = self._im.info
        dpi = info.get("dpi")
        if isinstance(dpi, tuple) and dpi and float(dpi[0]) > 1.0:
            # A default 72/96 dpi says nothing about the scan; accept only microscope-like resolutions.
            mpp = 25_400.0 / float(dpi[0])
            return mpp if mpp < 20.0 else None
        return None

    def read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        out = np.full((h, w, 3), 255, np.uint8)
        H, W = self._arr.shape[:2]
        x0, y0, x1, y1 = max(x, 0), max(y, 0), min(x + w, W), min(y + h, H)
        if x1 > x0 and y1 > y0:
            out[y0 - y : y1 - y, x0 - x : x1 - x] = self._arr[y0:y1, x0:x1]
        return out

    def close(self) -> None:
        self._im.close()


def _composite(rgba: np.ndarray) -> np.ndarray:
    """RGBA uint8 -> RGB uint8 over white (OpenSlide returns premultiplied alpha 0 outside the slide)."""
    if rgba.shape[-1] == 3:
        return np.ascontiguousarray(rgba)
    rgb = rgba[..., :3].astype(np.float32)
    a = rgba[..., 3:4].astype(np.float32) / 255.0
    return np.clip(rgb * a + 255.0 * (1 - a), 0, 255).astype(np.uint8) if (a < 1).any() else np.ascontiguousarray(rgba[..., :3])


class Slide:
    """One whole-slide image.

    Args:
        path: an OpenSlide-readable file (SVS, NDPI, MRXS, generic tiled TIFF, ...) or a plain
            PNG/JPEG/TIFF image.
        mpp: micrometres per level-0 pixel; overrides the file's value. When ``None`` the file's
            ``openslide.mpp-x`` (or resolution tags / DPI of plain images) is used, and reading
            :attr:`mpp` raises a ``ValueError`` if the file has none.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        SlideError: the file is corrupt, truncated or in no supported format.
    """

    def __init__(self, path: str | os.PathLike, mpp: float | None = None):
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"slide file not found: {self.path!r}")
        if mpp is not None and not (float(mpp) > 0 and math.isfinite(float(mpp))):
            raise ValueError(f"mpp ({mpp}) must be a positive number of micrometres per pixel")
        self._mpp_override = float(mpp) if mpp is not None else None
        self._backend: Any = self._open()
        self.name = os.path.splitext(os.path.basename(self.path))[0]

    def _open(self):
        openslide = _openslide()
        errors = []
        try:
            fmt = openslide.OpenSlide.detect_format(self.path)
        except Exception as e:  # noqa: BLE001 - any probe failure means "not an OpenSlide file"
            fmt, errors = None, [f"{type(e).__name__}: {e}"]
        if fmt is not None:
            try:
                backend = _OpenSlideBackend(self.path)
            except Exception as e:  # noqa: BLE001
                raise SlideError(f"{self.path!r} looks like a {fmt} slide but OpenSlide cannot open it: {e}") from e
            # A truncated file may open but fail on its first tile: probe the smallest level once.
            lvl = len(backend.level_dimensions) - 1
            w, h = backend.level_dimensions[lvl]
            backend.read(0, 0, lvl, min(w, 64), min(h, 64))
            return backend
        if self.path.lower().endswith(PLAIN_EXTENSIONS):
            return _PlainBackend(self.path)
        raise SlideError(
            f"{self.path!r} is not a slide: OpenSlide does not recognise it{' (' + '; '.join(errors) + ')' if errors else ''} and it is not a "
            f"plain image ({', '.join(PLAIN_EXTENSIONS)})"
        )

    # ------------------------------------------------------------------ metadata
    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 ``(width, height)`` in pixels."""
        return self._backend.level_dimensions[0]

    @property
    def level_count(self) -> int:
        return len(self._backend.level_dimensions)

    @property
    def level_dimensions(self) -> tuple[tuple[int, int], ...]:
        return self._backend.level_dimensions

    @property
    def level_downsamples(self) -> tuple[float, ...]:
        return self._backend.level_downsamples

    @property
    def properties(self) -> dict[str, str]:
        return self._backend.properties

    @property
    def vendor(self) -> str:
        return self._backend.vendor

    @property
    def file_mpp(self) -> float | None:
        """µm/px stored in the file, or ``None``."""
        return self._backend.file_mpp()

    @property
    def has_mpp(self) -> bool:
        return self._mpp_override is not None or self.file_mpp is not None

    @property
    def mpp(self) -> float:
        """Micrometres per level-0 pixel (override first, then the file)."""
        if self._mpp_override is not None:
            return self._mpp_override
        m = self.file_mpp
        if m is None:
            raise ValueError(
                f"slide {self.path!r} has no micrometres-per-pixel in its metadata; pass it explicitly "
                "(Slide(path, mpp=0.25) or --mpp 0.25 on the command line)"
            )
        return m

    def best_level_for_downsample(self, downsample: float) -> int:
        """The deepest level whose downsample is <= ``downsample`` (level 0 if none)."""
        best = 0
        for i, d in enumerate(self.level_downsamples):
            if d <= downsample * (1 + 1e-6):
                best = i
        return best

    # ------------------------------------------------------------------ pixels
    def read_region(self, location: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """Pixels of a ``size=(w, h)`` region at ``level`` whose top-left is ``location`` in level-0 pixels.

        Returns:
            (h, w, 3) uint8 RGB; areas outside the slide are white.
        """
        if not 0 <= level < self.level_count:
            raise ValueError(f"level ({level}) must be in [0, {self.level_count - 1}]")
        w, h = int(size[0]), int(size[1])
        if w <= 0 or h <= 0:
            raise ValueError(f"size ({size}) must be positive")
        if w * h > 64_000_000:
            raise ValueError(f"region {w}x{h} is too large to read at once; read it in tiles")
        return self._backend.read(int(location[0]), int(location[1]), level, w, h)

    def read_scaled(self, location: tuple[int, int], size0: int, out_size: int) -> np.ndarray:
        """A square of ``size0`` level-0 pixels at ``location``, resized to ``out_size``² (best level, then resize)."""
        ds = size0 / out_size
        level = self.best_level_for_downsample(ds)
        lds = self.level_downsamples[level]
        n = max(1, int(round(size0 / lds)))
        img = self.read_region(location, level, (n, n))
        if n != out_size:
            from PIL import Image

            img = np.asarray(Image.fromarray(img).resize((out_size, out_size), Image.BILINEAR))
        return img

    def thumbnail(self, max_size: int = 1024) -> np.ndarray:
        """A whole-slide thumbnail no larger than ``max_size`` per side, read from the level nearest above it."""
        if max_size < 1:
            raise ValueError(f"max_size ({max_size}) must be >= 1")
        W, H = self.dimensions
        ds = max(W, H) / max_size
        level = self.best_level_for_downsample(max(ds, 1.0))
        lw, lh = self.level_dimensions[level]
        from PIL import Image

        if lw * lh > 64_000_000:  # read in strips so the lowest stored level may still be big
            strips = []
            step = max(1, 16_000_000 // lw)
            tw, th = max(1, round(W / ds)), max(1, round(H / ds))
            for y in range(0, lh, step):
                hh = min(step, lh - y)
                strip = self._backend.read(0, int(y * self.level_downsamples[level]), level, lw, hh)
                strips.append(np.asarray(Image.fromarray(strip).resize((tw, max(1, round(hh * th / lh))), Image.BILINEAR)))
            return np.concatenate(strips, axis=0)
        img = self._backend.read(0, 0, level, lw, lh)
        if max(lw, lh) > max_size:
            s = max_size / max(lw, lh)
            img = np.asarray(Image.fromarray(img).resize((max(1, round(lw * s)), max(1, round(lh * s))), Image.BILINEAR))
        return img

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Slide({self.path!r}, dimensions={self.dimensions}, levels={self.level_count}, vendor={self.vendor!r})"
