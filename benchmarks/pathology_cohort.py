"""Lab-sized cohorts: a planted co-occurrence label on bags of precomputed patch features, for training recipes.

A cohort (:func:`make_cohort`) is ``n`` bags (:class:`pathology.features.Bag`), labels alternating 1, 0. Every
bag is ``bag_size`` patches on a square grid (a random ``bag_size`` of the ``side²`` cells), each patch an
``in_dim`` feature vector: unit Gaussian noise plus one of four "tissue" directions laid out in smooth spatial
clusters, plus, in the disks of its *pattern sites* (``site_patches`` patches each, ~1% of a 2,000-patch bag),
a pattern direction times ``strength``. The directions are fixed by ``pattern_seed`` (the same for every bag, as an
encoder's features of a tissue type would be).

- label 1: one A site and one B site, far apart (centres at least half the grid side apart);
- label 0: one of A, B, AA, BB (``negatives="mixed"``) or one of A, B, nothing (``negatives="single"``).
- ``decoys`` more sites per bag (any label), each A or B at random, at ``decoy_strength`` (default half of
  ``strength``).

So a label-1 bag is "both patterns present": a score linear in the pattern amounts (what mean pooling
computes) ranks AB level with AA and BB, and decoys blur the amounts; a model that attends to the strong sites
and asks "A and B both" can do better. ``python -m benchmarks.pathology_cohort_bench`` trains the models on
families of these cohorts.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

import numpy as np

NEGATIVES = {"mixed": ("A", "B", "AA", "BB"), "single": ("A", "B", "")}


@dataclass(kw_only=True)
class CohortConfig:
    """How :func:`make_cohort` draws bags."""

    bag_size: int = 2000  # patches per bag
    in_dim: int = 16  # feature size
    strength: float = 2.5  # length of the pattern direction added to a strong site's patches
    site_patches: int = 20  # patches per site (a disk of about this area)
    decoys: int = 2  # half-strength sites per bag (A or B at random)
    decoy_strength: float | None = None  # None: strength / 2
    negatives: str = "mixed"  # label-0 bags: "mixed" (A, B, AA, BB) or "single" (A, B, none)
    texture: float = 1.5  # length of the tissue directions
    pattern_seed: int = 4321

    def __post_init__(self) -> None:
        if self.bag_size < 64 or self.in_dim < 7 or self.site_patches < 1:
            raise ValueError(f"need bag_size >= 64 ({self.bag_size}), in_dim >= 7 ({self.in_dim}), "
                             f"site_patches >= 1 ({self.site_patches})")
        if self.negatives not in NEGATIVES:
            raise ValueError(f"negatives ({self.negatives!r}) must be one of {', '.join(NEGATIVES)}")
        if self.decoys < 0:
            raise ValueError(f"decoys ({self.decoys}) must be >= 0")

    def as_dict(self) -> dict:
        return asdict(self)


def directions(cfg: CohortConfig) -> np.ndarray:
    """(7, in_dim) orthonormal unit vectors: A, B, then four tissue directions and a spare."""
    rng = np.random.default_rng(cfg.pattern_seed)
    q, _ = np.linalg.qr(rng.standard_normal((cfg.in_dim, 7)))
    return q.T.astype(np.float32)


def _smooth(rng: np.random.Generator, side: int, cells: int = 5) -> np.ndarray:
    coarse = rng.standard_normal((cells, cells))
    pos = np.linspace(0, cells - 1, side)
    i0 = np.clip(np.floor(pos).astype(int), 0, cells - 2)
    f = pos - i0
    rows = coarse[i0] * (1 - f)[:, None] + coarse[i0 + 1] * f[:, None]
    return rows[:, i0] * (1 - f)[None, :] + rows[:, i0 + 1] * f[None, :]


@functools.cache
def _cohort_bag_class():
    from pathology.features import Bag

    @dataclass
    class CohortBag(Bag):
        """A :class:`pathology.features.Bag` that knows its planted sites: ``sites`` lists ``(letter, strength,
        patch indices)`` per site, the strong ones (that decide the label) first, then the decoys."""

        sites: list = field(default_factory=list)
        strong: int = 0  # how many of ``sites`` are strong

        def strong_patches(self) -> np.ndarray:
            """Indices of the patches of the strong sites (empty for a bag without one)."""
            parts = [idx for _, _, idx in self.sites[: self.strong]]
            return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    return CohortBag


def make_bag(rng: np.random.Generator, label: int, cfg: CohortConfig, slide_id: str):
    """One bag (a :class:`pathology.features.Bag` with its planted ``sites``; coordinates in grid cells,
    ``patch_size_level0`` 1)."""
    import torch

    side = math.ceil(math.sqrt(cfg.bag_size / 0.9))
    d = directions(cfg)
    cells = np.sort(rng.choice(side * side, cfg.bag_size, replace=False))
    ys, xs = cells // side, cells % side
    fields = np.stack([_smooth(rng, side) for _ in range(4)], -1)[ys, xs]  # (N, 4)
    tissue = fields.argmax(1)
    f = rng.standard_normal((cfg.bag_size, cfg.in_dim)).astype(np.float32) + cfg.texture * d[2 + tissue]
    strong = "AB" if label else NEGATIVES[cfg.negatives][int(rng.integers(len(NEGATIVES[cfg.negatives])))]
    amp_decoy = cfg.strength / 2 if cfg.decoy_strength is None else cfg.decoy_strength
    sites = [(s, cfg.strength) for s in strong] + [("AB"[int(rng.integers(2))], amp_decoy) for _ in range(cfg.decoys)]
    taken = np.zeros(cfg.bag_size, bool)
    centres: list[np.ndarray] = []
    planted = []
    pts = np.stack([xs, ys], 1).astype(np.float64)
    for j, (letter, amp) in enumerate(sites):
        for _ in range(200):  # strong sites far apart (at least side/2), every site away from the others
            c = pts[int(rng.integers(cfg.bag_size))]
            far = side / 2 if j < len(strong) else side / 6
            if all(np.abs(c - o).max() >= far for o in centres):
                break
        centres.append(c)
        dist = np.hypot(*(pts - c).T) + rng.random(cfg.bag_size) * 1e-3
        dist[taken] = np.inf
        idx = np.argsort(dist)[: cfg.site_patches]
        taken[idx] = True
        f[idx] += amp * d["AB".index(letter)]
        planted.append((letter, float(amp), np.sort(idx)))
    coords = torch.from_numpy(np.stack([xs, ys], 1).astype(np.int64))
    return _cohort_bag_class()(slide_id, torch.from_numpy(f), coords, 1.0, label=int(label),
                               label_name=str(int(label)), sites=planted, strong=len(strong))


def make_cohort(n: int, seed: int, cfg: CohortConfig | None = None) -> list:
    """``n`` bags drawn from ``seed``, labels alternating 1, 0."""
    cfg = cfg or CohortConfig()
    if n < 2:
        raise ValueError(f"n ({n}) must be >= 2")
    rng = np.random.default_rng([seed, 52])
    return [make_bag(rng, 1 - i % 2, cfg, f"c{seed}_{i:04d}") for i in range(n)]
