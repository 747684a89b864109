"""Episodes of many-shot in-context image classification with a random label mapping.

An *image class* is either procedural (``("proc", c)``: a smooth random prototype drawn from seed ``c``,
each instance shifted, rescaled in contrast and noised) or a real handwritten digit from scikit-learn's
``load_digits`` (``("digit", d)``: 8×8 scans upsampled to the image size, plus noise). Every episode draws
``n_way`` classes and a **random injective mapping** of them onto label ids ``0..num_labels-1``, so the label
of a class can only be read from the demonstrations.

Training and evaluation use disjoint classes (:func:`class_pool`): procedural ids below ``EVAL_PROC_START``
and digits 0–5 for training; procedural ids from ``EVAL_PROC_START`` on and digits 6–9 for evaluation.

Layouts: images ``(N, size, size)`` float32 in ``[0, 1]`` (plus noise), labels ``(N,)`` int64.
Episodes are pure functions of their seed (:func:`make_episode`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["EpisodeConfig", "Episode", "class_pool", "make_episode", "render", "EVAL_PROC_START"]

EVAL_PROC_START = 1_000_000  # procedural class ids from here on are never used in training
TRAIN_DIGITS = (0, 1, 2, 3, 4, 5)
EVAL_DIGITS = (6, 7, 8, 9)


@dataclass(kw_only=True)
class EpisodeConfig:
    """How episodes are drawn."""

    n_way: int = 5  # classes per episode
    num_labels: int = 16  # label vocabulary; each episode maps its classes onto random distinct ids
    image_size: int = 16  # side of the square images (digits are upsampled from 8×8)
    noise: float = 0.15  # std of the Gaussian pixel noise added to every instance
    digit_fraction: float = 0.4  # share of an episode's classes drawn from the digits (at most the pool's size)

    def __post_init__(self) -> None:
        if not (isinstance(self.n_way, int) and self.n_way >= 2):
            raise ValueError(f"n_way must be an int >= 2, got {self.n_way!r}")
        if not (isinstance(self.num_labels, int) and self.num_labels >= self.n_way):
            raise ValueError(f"num_labels ({self.num_labels}) must be an int >= n_way ({self.n_way})")
        if not (isinstance(self.image_size, int) and self.image_size >= 8 and self.image_size % 4 == 0):
            raise ValueError(f"image_size must be an int >= 8 divisible by 4, got {self.image_size!r}")
        if not 0.0 <= self.digit_fraction <= 1.0:
            raise ValueError(f"digit_fraction must lie in [0, 1], got {self.digit_fraction}")


@dataclass
class Episode:
    """One episode: demonstrations and queries with their (episode-specific) label ids.

    Attributes:
        demo_images: ``(K, size, size)``; demo_labels: ``(K,)`` int64 label ids.
        query_images: ``(Q, size, size)``; query_labels: ``(Q,)``.
        classes: the episode's classes, in label order of ``label_ids``; label_ids: ``(n_way,)`` their ids.
    """

    demo_images: torch.Tensor
    demo_labels: torch.Tensor
    query_images: torch.Tensor
    query_labels: torch.Tensor
    classes: list[tuple[str, int]]
    label_ids: torch.Tensor


@functools.cache
def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images / 16.0).astype(np.float32), d.target.astype(np.int64)


def class_pool(split: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    """``((proc_lo, proc_hi), digits)`` of a split: ``"train"`` or ``"eval"`` (held-out classes)."""
    if split == "train":
        return (0, EVAL_PROC_START), TRAIN_DIGITS
    if split == "eval":
        return (EVAL_PROC_START, 2 * EVAL_PROC_START), EVAL_DIGITS
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def _prototype(c: int, size: int) -> torch.Tensor:
    """Smooth random pattern of procedural class ``c``: a 4×4 grid of intensities upsampled, plus a bar."""
    g = torch.Generator().manual_seed(int(c) * 7919 + 17)
    coarse = (torch.rand(1, 1, 4, 4, generator=g) > 0.5).float()
    img = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)[0, 0]
    return img


def render(cls: tuple[str, int], n: int, size: int, noise: float, gen: torch.Generator) -> torch.Tensor:
    """``n`` instances ``(n, size, size)`` of class ``cls`` drawn with ``gen``."""
    kind, c = cls
    if kind == "proc":
        proto = _prototype(c, size)[None].expand(n, -1, -1)
        shifts = torch.randint(-1, 2, (n, 2), generator=gen)
        imgs = torch.stack([torch.roll(proto[i], (int(shifts[i, 0]), int(shifts[i, 1])), dims=(0, 1)) for i in range(n)])
        contrast = 0.7 + 0.6 * torch.rand(n, 1, 1, generator=gen)
        imgs = imgs * contrast
    elif kind == "digit":
        images, target = _digits()
        idx = np.flatnonzero(target == c)
        pick = idx[torch.randint(0, len(idx), (n,), generator=gen).numpy()]
        small = torch.from_numpy(images[pick])[:, None]  # (n, 1, 8, 8)
        imgs = F.interpolate(small, size=(size, size), mode="bilinear", align_corners=False)[:, 0]
    else:
        raise ValueError(f"unknown image class kind {kind!r}; expected 'proc' or 'digit'")
    return imgs + noise * torch.randn(imgs.shape, generator=gen)


def make_episode(seed: int, *, num_demos: int, num_queries: int, split: str, config: EpisodeConfig | None = None) -> Episode:
    """Episode ``seed`` of a split: classes, label mapping, demos (balanced then shuffled) and queries."""
    cfg = config or EpisodeConfig()
    if not (isinstance(num_demos, int) and num_demos >= 1) or not (isinstance(num_queries, int) and num_queries >= 0):
        raise ValueError(f"num_demos must be >= 1 and num_queries >= 0, got {num_demos!r}, {num_queries!r}")
    (lo, hi), digits = class_pool(split)
    gen = torch.Generator().manual_seed(int(seed))
    n_dig = min(len(digits), int(round(cfg.digit_fraction * cfg.n_way)))
    dig = [("digit", int(digits[i])) for i in torch.randperm(len(digits), generator=gen)[:n_dig]]
    proc = [("proc", int(lo + torch.randint(0, hi - lo, (1,), generator=gen))) for _ in range(cfg.n_way - n_dig)]
    classes = dig + proc
    label_ids = torch.randperm(cfg.num_labels, generator=gen)[: cfg.n_way]
    demo_cls = torch.arange(num_demos) % cfg.n_way
    demo_cls = demo_cls[torch.randperm(num_demos, generator=gen)]
    query_cls = torch.randint(0, cfg.n_way, (num_queries,), generator=gen)
    all_cls = torch.cat([demo_cls, query_cls])
    images = torch.zeros(len(all_cls), cfg.image_size, cfg.image_size)
    for j, cls in enumerate(classes):
        where = (all_cls == j).nonzero()[:, 0]
        if len(where):
            images[where] = render(cls, len(where), cfg.image_size, cfg.noise, gen)
    labels = label_ids[all_cls]
    return Episode(
        demo_images=images[:num_demos], demo_labels=labels[:num_demos], query_images=images[num_demos:],
        query_labels=labels[num_demos:], classes=classes, label_ids=label_ids,
    )
