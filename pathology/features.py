"""Patch feature extraction: tiles are read by DataLoader workers while the encoder computes."""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pathology.encoders import PatchEncoder
from pathology.patching import PatchGrid
from pathology.slide import Slide

logger = logging.getLogger(__name__)

__all__ = ["PatchDataset", "extract_features"]


class PatchDataset(Dataset):
    """Patches of one slide as uint8 (patch_size, patch_size, 3) tensors; the slide opens lazily per worker."""

    def __init__(self, path: str, grid: PatchGrid, mpp: float | None = None):
        self.path, self.grid, self.mpp = path, grid, mpp
        self._slide: Slide | None = None

    def __len__(self) -> int:
        return int(self.grid.coords.shape[0])

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._slide is None:
            self._slide = Slide(self.path, mpp=self.mpp)
        x, y = self.grid.coords[i]
        img = self._slide.read_scaled((int(x), int(y)), self.grid.patch_size_level0, self.grid.patch_size)
        return torch.from_numpy(np.array(img, dtype=np.uint8, copy=True))

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_slide"] = None  # OpenSlide handles do not cross processes
        return d


def extract_features(path: str, grid: PatchGrid, encoder: PatchEncoder, *, batch_size: int = 64, workers: int = 0,
                     mpp: float | None = None, progress: bool = False) -> tuple[np.ndarray, float]:
    """Encode every patch of ``grid`` on slide ``path``.

    Returns:
        features (N, D) float32 and throughput in patches per second (reading + encoding).
    """
    n = int(grid.coords.shape[0])
    if n == 0:
        return np.zeros((0, encoder.dim), np.float32), 0.0
    ds = PatchDataset(path, grid, mpp)
    dl = DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=workers,
                    persistent_workers=False, prefetch_factor=4 if workers > 0 else None)
    it = dl
    if progress:
        from tqdm import tqdm

        it = tqdm(dl, desc="  patches", unit="batch", leave=False)
    out = []
    t0 = time.perf_counter()
    for batch in it:
        out.append(encoder.encode(batch).numpy())
    dt = time.perf_counter() - t0
    feats = np.concatenate(out, 0).astype(np.float32)
    return feats, n / max(dt, 1e-9)
