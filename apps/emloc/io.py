"""Reading demonstrations and query images from disk for the EMLoC CLIs.

Demonstrations come from a folder (``DIR/<label id>/<image>``, one subfolder per integer label id) or a JSONL
file (one ``{"image": path, "label": id}`` per line, paths relative to the file). Images are PNG/JPEG/...
(read with Pillow, converted to grayscale) or ``.npy`` 2-D arrays; each is resized to the host's image size
and scaled to ``[0, 1]``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from core.infra.fileio import open_image

__all__ = ["read_image", "read_demos", "list_images", "IMAGE_SUFFIXES"]

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".npy")


def read_image(path: str | Path, size: int) -> torch.Tensor:
    """One image as ``(size, size)`` float32 in ``[0, 1]``; ValueError naming the file if it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no image file at {path}")
    if path.suffix.lower() == ".npy":
        try:
            arr = np.load(path, allow_pickle=False).astype(np.float32)
            if arr.ndim != 2:
                raise ValueError(f"expected a 2-D array, got shape {arr.shape}")
            lo, hi = float(arr.min()), float(arr.max())
            arr = (arr - lo) / (hi - lo) if hi > lo else np.zeros_like(arr)
        except Exception as err:  # noqa: BLE001 - any decoder failure is reported with the file name
            raise ValueError(f"cannot read image {path}: {err}") from err
    else:
        with open_image(path, what=f"an image ({', '.join(IMAGE_SUFFIXES)})") as im:
            arr = np.asarray(im.convert("L"), dtype=np.float32) / 255.0
    if not np.isfinite(arr).all():
        raise ValueError(f"image {path} has NaN or infinite values")
    t = torch.from_numpy(np.ascontiguousarray(arr))[None, None]
    return F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False)[0, 0]


def list_images(paths: list[str | Path]) -> list[Path]:
    """Image files among ``paths`` (folders are listed, sorted)."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(q for q in p.iterdir() if q.suffix.lower() in IMAGE_SUFFIXES))
        else:
            out.append(p)
    if not out:
        raise ValueError(f"no images found in {[str(p) for p in paths]} (accepted: {', '.join(IMAGE_SUFFIXES)})")
    return out


def read_demos(source: str | Path, size: int) -> tuple[torch.Tensor, torch.Tensor, list[Path]]:
    """``(images (K, size, size), labels (K,), paths)`` from a labelled folder or a JSONL file."""
    source = Path(source)
    items: list[tuple[Path, int]] = []
    if source.is_dir():
        for sub in sorted(source.iterdir()):
            if not sub.is_dir():
                continue
            try:
                label = int(sub.name)
            except ValueError:
                raise ValueError(f"demo folder {sub} is not an integer label id; use DIR/<label id>/<image>") from None
            items.extend((p, label) for p in sorted(sub.iterdir()) if p.suffix.lower() in IMAGE_SUFFIXES)
        if not items:
            raise ValueError(f"no labelled demonstrations in {source}: expected DIR/<label id>/<image> (unlabelled images at the top level are not demonstrations)")
    elif source.is_file():
        for n, line in enumerate(source.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{source}:{n} is not JSON: {err}") from None
            if not isinstance(rec, dict) or "image" not in rec:
                raise ValueError(f"{source}:{n} needs an 'image' field")
            if rec.get("label") is None:
                raise ValueError(f"{source}:{n}: demonstration without a label ({rec['image']})")
            if not isinstance(rec["label"], int) or isinstance(rec["label"], bool):
                raise ValueError(f"{source}:{n}: label must be an integer id, got {rec['label']!r}")
            items.append((source.parent / rec["image"], rec["label"]))
        if not items:
            raise ValueError(f"{source} holds no demonstrations")
    else:
        raise FileNotFoundError(f"no demonstrations at {source} (a DIR/<label id>/<image> folder or a JSONL file)")
    images = torch.stack([read_image(p, size) for p, _ in items])
    labels = torch.tensor([l for _, l in items], dtype=torch.long)
    return images, labels, [p for p, _ in items]
