"""Querent where it is actually sparse: 10K-patch synthetic bags on a 2-D grid, two labels, 5-fold CV.

Bags (:func:`make_bag`): a ``side × side`` patch grid with ~10% holes (``side=106``: ~10.1K patches, 14×14 =
196 regions of 8×8 patches), each patch a ``in_dim`` feature vector: unit Gaussian noise plus two smooth
"tissue" fields, and in the disks (radius ``radius`` = 8 patches, ~200 patches each) of two *pattern sites*
a fixed pattern direction ``μ_A``, ``μ_B`` or ``μ_C`` times ``amplitude`` (3; the same directions for every
bag, as an encoder's features of a tissue type would be).

Labels (each on its own cohort, balanced):

- ``cooccur``: sites A+B (1) vs A+A, B+B or C+C (0; C is a decoy pattern of the same area), anywhere: a
  co-occurrence, no position needed. A score linear in the pattern amounts (A + B − C) reaches AUC 2/3 at
  best (it ranks AB level with AA and BB); telling AB from AA and BB needs "A and B both".
- ``spatial``: always one A site and one B site; 1 when their centres are ``near`` apart (Chebyshev
  distance 24-32 patches; a 3×3 neighbourhood of 8×8 regions reaches 8-23 patches from a patch, so most of
  one site lies outside the other's neighbourhood and Querent has to *select* its regions), 0 when
  ``≥ far_min`` (64) apart. Both patterns are in every bag with
  the same area, so co-occurrence and counts cannot tell the classes apart; the anchor site is drawn the
  same way in both classes (a far pair is drawn first, then for class 1 one site, chosen at random, is
  moved next to the other), so the absolute position of one site tells little. With ``--pairs K`` a bag holds
  K A sites and K B sites: label 1 when each A_i has its B_i ``near``, 0 when every A–B distance is ``≥ far_min``
  (the relation occurs K times per bag; ``cooccur`` bags always hold two sites).

Peers (all width ``dim``, depth ``depth``, trained the same way, :func:`build_peer`):
``mean`` (mean pooling + linear head), ``abmil`` (gated attention + MLP head, as CLAM uses it),
``transmil`` (:class:`pathology.mil.TransMIL`), ``dense`` (Querent's architecture with exact attention over
all patches, ``selection="dense"``: core.attention, chunked on CPU), ``querent_region`` (default Querent:
``topk`` chosen per query region), ``querent_query`` (``topk`` chosen per query). With the default
``--topk 20`` a query attends ≤ 9 + 20 = 29 of 196 regions (≤ 14.8%).

Stages (each resumable: every finished unit is one line of ``--records``, a JSONL file; a rerun skips
what is there):

1. ``speed``: forward CPU seconds (one thread, no autograd) of Querent (both selections) and dense on
   one bag of ``--speed-side``² · keep patches (270: ~65.6K), same process, same weights; ratio dense/Querent.
2. ``cv``: per label, seed and fold: train every model (AdamW, cosine decay, early stopping on the
   validation loss of an inner split of the training bags), test AUC on the held-out fold. Out-of-fold
   probabilities are kept, so AUC is pooled over folds per seed.
3. ``approx``: the trained ``dense`` weights of seed 0 run with Querent selection at several
   (selection, region size, topk): mean relative error ``‖o_sparse − o_dense‖ / ‖o_dense‖`` of the
   first layer's attention output (same input, same weights), and the out-of-fold AUC.
4. ``summary``: JSON at ``--out`` (atomic) and the curve PNG beside it.

    python -m benchmarks.pathology_sparse --quick     # tiny bags, seconds (a smoke run, not evidence)
    OMP_NUM_THREADS=1 python -m benchmarks.pathology_sparse
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results" / "pathology_sparse.json"
RECORDS = Path(__file__).resolve().parent / "results" / "pathology_sparse_records.jsonl"
LABELS = ("cooccur", "spatial")
PEERS = ("mean", "abmil", "transmil", "dense", "querent_region", "querent_query")
#: Approximation grid: (selection, region size, topk). ``topk=-1`` means every region (exact).
APPROX_GRID = (
    ("region", 8, 0), ("region", 8, 5), ("region", 8, 20), ("region", 8, 60),
    ("query", 8, 5), ("query", 8, 20),
    ("region", 4, 20), ("region", 4, 100),
    ("region", 16, 0), ("region", 16, 4),
)

# ------------------------------------------------------------------------------------------------ bags


@dataclass(kw_only=True)
class GridBagConfig:
    """How :func:`make_bag` draws a bag."""

    side: int = 106  # patch grid side (the bag has about keep·side² patches)
    keep: float = 0.9  # share of grid cells that hold a patch (the rest are holes)
    in_dim: int = 16  # feature size
    radius: float = 8.0  # pattern site radius (patches); a site holds ~π·r² patches
    amplitude: float = 3.0  # length of the pattern direction added to a site's patches
    texture: float = 1.0  # amplitude of the two smooth tissue fields
    near: tuple[int, int] = (24, 32)  # spatial label 1: Chebyshev distance of the two site centres
    far_min: int = 64  # spatial label 0: Chebyshev distance at least this
    pattern_seed: int = 1234  # seed of the pattern and tissue directions (shared by every bag)
    pairs: int = 1  # spatial label: A–B site pairs per bag (all near for 1, every A–B distance >= far_min for 0)

    def __post_init__(self) -> None:
        if self.pairs < 1:
            raise ValueError(f"pairs ({self.pairs}) must be >= 1")
        if self.side < 8:
            raise ValueError(f"side ({self.side}) must be >= 8")
        if not 0 < self.keep <= 1:
            raise ValueError(f"keep ({self.keep}) must be in (0, 1]")
        if self.in_dim < 2:
            raise ValueError(f"in_dim ({self.in_dim}) must be >= 2")
        if not (0 < self.near[0] <= self.near[1] < self.far_min):
            raise ValueError(f"need 0 < near[0] <= near[1] < far_min, got near={self.near}, far_min={self.far_min}")


@dataclass
class GridBag:
    """One synthetic bag."""

    features: "torch.Tensor"  # (N, in_dim) float32  # noqa: F821
    coords: "torch.Tensor"  # (N, 2) int64 grid (x, y); patch_size_level0 = 1  # noqa: F821
    label: int
    sites: str  # "AB", "AA", "BB" or "CC"
    centres: list[tuple[int, int]]  # (x, y) of each site, in the order of ``sites``
    bag_id: str = ""


def pattern_directions(cfg: GridBagConfig) -> np.ndarray:
    """(5, in_dim) unit vectors: μ_A, μ_B, the two tissue-field directions and μ_C (the decoy pattern),
    fixed by ``pattern_seed``; orthonormal when ``in_dim >= 5``."""
    rng = np.random.default_rng(cfg.pattern_seed)
    m = rng.standard_normal((5, cfg.in_dim))
    q, _ = np.linalg.qr(m.T)
    d = q.T if cfg.in_dim >= 5 else m / np.linalg.norm(m, axis=1, keepdims=True)
    return d.astype(np.float32)


def chebyshev(a: Sequence[int], b: Sequence[int]) -> int:
    return int(max(abs(a[0] - b[0]), abs(a[1] - b[1])))


def spatial_label(centre_a: Sequence[int], centre_b: Sequence[int], cfg: GridBagConfig) -> int:
    """1 if the sites are ``near`` apart, 0 if at least ``far_min`` apart; ValueError in between (not drawn)."""
    d = chebyshev(centre_a, centre_b)
    if cfg.near[0] <= d <= cfg.near[1]:
        return 1
    if d >= cfg.far_min:
        return 0
    raise ValueError(f"site distance {d} is neither near {cfg.near} nor far (>= {cfg.far_min})")


def _smooth_field(rng: np.random.Generator, side: int, cells: int = 6) -> np.ndarray:
    """A smooth (side, side) field: bilinear upsampling of a ``cells × cells`` Gaussian grid."""
    coarse = rng.standard_normal((cells, cells))
    pos = np.linspace(0, cells - 1, side)
    i0 = np.clip(np.floor(pos).astype(int), 0, cells - 2)
    f = pos - i0
    rows = coarse[i0] * (1 - f)[:, None] + coarse[i0 + 1] * f[:, None]  # (side, cells)
    return rows[:, i0] * (1 - f)[None, :] + rows[:, i0 + 1] * f[None, :]


def render_bag(rng: np.random.Generator, sites: str, centres: Sequence[Sequence[int]], cfg: GridBagConfig,
               label: int, bag_id: str = "") -> GridBag:
    """Draw the holes, noise and tissue fields of a bag and paint one site per letter of ``sites`` at ``centres``
    ((x, y) each)."""
    import torch

    if len(sites) < 2 or set(sites) - {"A", "B", "C"} or len(centres) != len(sites):
        raise ValueError(f"sites ({sites!r}) must be two or more of 'A'/'B'/'C', one centre each; got {len(centres)} centres")
    s = cfg.side
    dirs = pattern_directions(cfg)
    present = rng.random((s, s)) < cfg.keep
    yy, xx = np.mgrid[0:s, 0:s]
    site_of = np.full((s, s), -1, np.int64)
    for j, (cx, cy) in enumerate(centres):
        disk = (xx - cx) ** 2 + (yy - cy) ** 2 <= cfg.radius**2
        site_of[disk] = j
        present |= disk  # sites are whole (no holes), so every bag holds the same pattern area
    feats = rng.standard_normal((s, s, cfg.in_dim)).astype(np.float32)
    feats += cfg.texture * _smooth_field(rng, s)[..., None].astype(np.float32) * dirs[2]
    feats += cfg.texture * _smooth_field(rng, s)[..., None].astype(np.float32) * dirs[3]
    for j, letter in enumerate(sites):
        feats[site_of == j] += cfg.amplitude * dirs[{"A": 0, "B": 1, "C": 4}[letter]]
    ys, xs = np.nonzero(present)  # row-major order
    f = torch.from_numpy(np.ascontiguousarray(feats[ys, xs]))
    c = torch.from_numpy(np.stack([xs, ys], 1).astype(np.int64))
    return GridBag(features=f, coords=c, label=int(label), sites=sites, centres=[tuple(map(int, p)) for p in centres],
                   bag_id=bag_id)


def _uniform_centre(rng: np.random.Generator, cfg: GridBagConfig) -> tuple[int, int]:
    m = int(math.ceil(cfg.radius))
    return int(rng.integers(m, cfg.side - m)), int(rng.integers(m, cfg.side - m))


def _far_pair(rng: np.random.Generator, cfg: GridBagConfig, min_d: int) -> tuple[tuple[int, int], tuple[int, int]]:
    for _ in range(10000):
        a, b = _uniform_centre(rng, cfg), _uniform_centre(rng, cfg)
        if chebyshev(a, b) >= min_d:
            return a, b
    raise ValueError(f"side ({cfg.side}) too small for two sites {min_d} apart")


def _near_partner(rng: np.random.Generator, anchor: tuple[int, int], cfg: GridBagConfig) -> tuple[int, int] | None:
    m = int(math.ceil(cfg.radius))
    for _ in range(200):
        d = int(rng.integers(cfg.near[0], cfg.near[1] + 1))
        # a random point on the Chebyshev circle of radius d around the anchor
        t = int(rng.integers(-d, d + 1))
        side = int(rng.integers(4))
        dx, dy = [(d, t), (-d, t), (t, d), (t, -d)][side]
        p = (anchor[0] + dx, anchor[1] + dy)
        if m <= p[0] < cfg.side - m and m <= p[1] < cfg.side - m:
            return p
    return None


def _multi_pair_bag(rng: np.random.Generator, label: int, cfg: GridBagConfig, bag_id: str) -> GridBag:
    """``cfg.pairs`` A sites and as many B sites. First a layout in which every A–B distance is at least
    ``far_min`` and no two sites overlap (label 0); for label 1 one site of each pair i (A_i or B_i, at random) is
    moved next to its partner (``near``), keeping sites apart. So the anchors are drawn the same way in both
    classes and only the A–B distances tell them apart."""
    gap = int(2 * cfg.radius) + 2  # centres at least this far apart: disks do not touch
    K = cfg.pairs
    for _ in range(2000):
        a = [_uniform_centre(rng, cfg) for _ in range(K)]
        b = [_uniform_centre(rng, cfg) for _ in range(K)]
        if any(chebyshev(p, q) < cfg.far_min for p in a for q in b):
            continue
        if any(chebyshev(p, q) < gap for grp in (a, b) for i, p in enumerate(grp) for q in grp[i + 1:]):
            continue
        if label:
            ok = True
            for i in range(K):
                move_b = rng.random() < 0.5
                p = _near_partner(rng, a[i] if move_b else b[i], cfg)
                if p is None:
                    ok = False
                    break
                if move_b:
                    b[i] = p
                else:
                    a[i] = p
            every = a + b
            if not ok or any(chebyshev(p, q) < gap for i, p in enumerate(every) for q in every[i + 1:]):
                continue
            assert all(spatial_label(a[i], b[i], cfg) == 1 for i in range(K))
        centres = [c for i in range(K) for c in (a[i], b[i])]
        return render_bag(rng, "AB" * K, centres, cfg, label, bag_id)
    raise ValueError(f"could not place {K} A–B pairs (label {label}) on a {cfg.side}-patch grid with far_min "
                     f"{cfg.far_min}: lower pairs or far_min, or enlarge side")


def make_bag(rng: np.random.Generator, kind: str, label: int, cfg: GridBagConfig, bag_id: str = "") -> GridBag:
    """One bag of ``kind`` ("cooccur" or "spatial") with ``label`` (see the module docstring)."""
    if kind == "cooccur":
        sites = "AB" if label else ("AA", "BB", "CC")[int(rng.integers(3))]
        a, b = _far_pair(rng, cfg, int(2 * cfg.radius) + 2)  # anywhere, not overlapping
        return render_bag(rng, sites, [a, b], cfg, label, bag_id)
    if kind == "spatial" and cfg.pairs > 1:
        return _multi_pair_bag(rng, label, cfg, bag_id)
    if kind == "spatial":
        for _ in range(1000):
            a, b = _far_pair(rng, cfg, cfg.far_min)
            if label:
                # keep one site (A or B at random) where the far pair put it; move the other next to it
                if rng.random() < 0.5:
                    b = _near_partner(rng, a, cfg)
                else:
                    a = _near_partner(rng, b, cfg)
                if a is None or b is None:
                    continue
            assert spatial_label(a, b, cfg) == label
            return render_bag(rng, "AB", [a, b], cfg, label, bag_id)
        raise ValueError(f"could not place a near pair on a {cfg.side}-patch grid")
    raise ValueError(f"kind ({kind!r}) must be one of {', '.join(LABELS)}")


def make_cohort(kind: str, n: int, seed: int, cfg: GridBagConfig) -> list[GridBag]:
    """``n`` bags of ``kind``, labels alternating 1, 0 (balanced), drawn from ``seed``."""
    if n < 2:
        raise ValueError(f"n ({n}) must be >= 2")
    rng = np.random.default_rng([seed, LABELS.index(kind) if kind in LABELS else 99])
    return [make_bag(rng, kind, 1 - i % 2, cfg, bag_id=f"{kind}_{i:03d}") for i in range(n)]


# ---------------------------------------------------------------------------------------------- models


def build_peer(name: str, cfg):
    """A peer model by name (:data:`PEERS`); ``cfg`` is a :class:`pathology.querent.QuerentConfig`."""
    from torch import nn

    from pathology.mil import MeanMIL, TransMIL
    from pathology.querent import GatedAttentionPool, MILOutput, Querent

    class ABMILMLP(nn.Module):
        """Gated attention pooling with an MLP head (CLAM's attention branch; the head is an MLP here)."""

        def __init__(self, c):
            super().__init__()
            self.cfg = c
            self.embed = nn.Sequential(nn.Linear(c.in_dim, c.dim), nn.GELU(), nn.Dropout(c.dropout))
            self.pool = GatedAttentionPool(c.dim, c.pool_hidden, c.dropout)
            self.head = nn.Sequential(nn.Linear(c.dim, c.dim), nn.GELU(), nn.Dropout(c.dropout), nn.Linear(c.dim, c.num_classes))

        def forward(self, features_ND, coords_N2=None, *, patch_size_level0=None, return_index=False):
            emb, a = self.pool(self.embed(features_ND))
            return MILOutput(self.head(emb), a, emb)

    selection = {"dense": "dense", "querent_region": "region", "querent_query": "query"}
    if name in selection:
        return Querent(_with(cfg, selection=selection[name]))
    if name == "mean":
        return MeanMIL(cfg)
    if name == "abmil":
        return ABMILMLP(cfg)
    if name == "transmil":
        return TransMIL(cfg)
    raise ValueError(f"unknown peer {name!r}; accepted: {', '.join(PEERS)}")


def _with(cfg, **changes):
    """A copy of a dataclass config with ``changes`` (post-init re-run)."""
    d = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    d.update(changes)
    return type(cfg)(**d)


def model_config(args: argparse.Namespace, in_dim: int):
    from pathology.querent import QuerentConfig

    return QuerentConfig(in_dim=in_dim, dim=args.dim, depth=args.depth, num_heads=args.heads, region_size=args.region_size,
                         topk=args.topk, dropout=0.1, num_classes=2, pool_hidden=args.dim, mlp_ratio=2.0,
                         pos_encoding=args.pos_encoding, rope_scale=args.rope_scale)


# -------------------------------------------------------------------------------------------- training


def auc(labels: Sequence[int], scores: Sequence[float]) -> float:
    """ROC AUC by the rank-sum formula (ties count half); NaN when one class is missing."""
    y = np.asarray(labels)
    s = np.asarray(scores, dtype=np.float64)
    pos, neg = s[y == 1], s[y == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (len(pos) * len(neg)))


def folds_for(labels: Sequence[int], k: int, seed: int) -> list[list[int]]:
    """Stratified ``k`` folds of bag indices (shuffled by ``seed``)."""
    rng = np.random.default_rng(seed)
    out: list[list[int]] = [[] for _ in range(k)]
    for c in sorted(set(labels)):
        idx = [i for i, y in enumerate(labels) if y == c]
        rng.shuffle(idx)
        for j, i in enumerate(idx):
            out[j % k].append(i)
    return [sorted(f) for f in out]


def _probs(model, bags: Sequence[GridBag]) -> list[float]:
    import torch

    model.eval()
    with torch.no_grad():
        return [float(torch.softmax(model(b.features, b.coords, patch_size_level0=1).logits[0], -1)[1]) for b in bags]


def train_peer(name: str, mcfg, train: Sequence[GridBag], val: Sequence[GridBag], *, epochs: int, lr: float,
               patience: int, min_epochs: int, seed: int, batch_bags: int = 1, checkpoint: str | None = None):
    """Train ``name`` (AdamW, cosine decay, clip 1.0); keep the best validation-loss epoch.

    Each optimizer step averages the gradients of ``batch_bags`` bags (one forward per bag: bags differ in size).
    With one bag per step the head's bias follows the last few labels (Adam takes a full-size step on every
    bag's gradient), which costs more loss than the relation signal earns early on; a few bags per step remove
    that drift (``docs/experiments/pathology.md``).

    ``checkpoint``: a file the fit's state is written to after every epoch (atomically) and resumed from, so a
    stopped fit loses at most one epoch; the same result as an uninterrupted fit. Removed when the fit ends.

    Returns the model (eval mode) and a summary with the per-epoch history and CPU seconds.
    """
    import torch
    from torch import nn

    from core.infra.fileio import torch_save_atomic

    torch.manual_seed(seed)
    model = build_peer(name, mcfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-2)
    g = np.random.default_rng(seed)
    if batch_bags < 1:
        raise ValueError(f"batch_bags ({batch_bags}) must be >= 1")
    total = epochs * math.ceil(len(train) / batch_bags)  # optimizer steps
    step, best, since, history, start, cpu_before = 0, (float("inf"), 0, None), 0, [], 0, 0.0
    if checkpoint is not None and os.path.exists(checkpoint):
        st = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        g.bit_generator.state = st["rng"]
        torch.set_rng_state(st["torch_rng"])
        step, best, since, history, cpu_before = st["step"], st["best"], st["since"], st["history"], st["cpu_s"]
        start = len(history)
        logger.info("resuming %s from %s after epoch %d", name, checkpoint, start)
    stopped = start >= min_epochs and since >= patience  # a checkpoint written right before the early stop
    cpu0 = time.process_time()
    for ep in range(start, start if stopped else epochs):
        model.train()
        losses = []
        order = g.permutation(len(train))
        for s0 in range(0, len(order), batch_bags):
            batch = order[s0 : s0 + batch_bags]
            for pg in opt.param_groups:
                pg["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / max(1, total)))
            opt.zero_grad(set_to_none=True)
            for i in batch:
                b = train[int(i)]
                logits = model(b.features, b.coords, patch_size_level0=1).logits  # (1, 2)
                loss = nn.functional.cross_entropy(logits, torch.tensor([b.label]))
                (loss / len(batch)).backward()
                losses.append(float(loss.detach()))
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
        p = np.clip(np.array(_probs(model, val)), 1e-6, 1 - 1e-6)
        y = np.array([b.label for b in val])
        vloss = float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())
        history.append({"epoch": ep + 1, "train_loss": round(float(np.mean(losses)), 4), "val_loss": round(vloss, 4),
                        "val_auc": auc(y, p)})
        if vloss < best[0] - 1e-3:
            best, since = (vloss, ep + 1, copy.deepcopy(model.state_dict())), 0
        else:
            since += 1
        if checkpoint is not None:
            torch_save_atomic({"model": model.state_dict(), "opt": opt.state_dict(), "rng": g.bit_generator.state,
                               "torch_rng": torch.get_rng_state(), "step": step, "best": best, "since": since,
                               "history": history, "cpu_s": cpu_before + time.process_time() - cpu0}, checkpoint)
        if ep + 1 >= min_epochs and since >= patience:
            break
    if best[2] is not None:
        model.load_state_dict(best[2])
    model.eval()
    if checkpoint is not None and os.path.exists(checkpoint):
        os.unlink(checkpoint)
    return model, {"epochs_run": len(history), "best_epoch": best[1],
                   "train_cpu_s": round(cpu_before + time.process_time() - cpu0, 1), "history": history}


# --------------------------------------------------------------------------------------------- records


def record_key(rec: dict) -> str:
    """The identity of a record: its stage and the fields that say which unit of work it is."""
    fields = {"speed": ("n",), "cv": ("label", "seed", "fold", "model"), "approx": ("label", "fold", "selection",
                                                                                   "region_size", "topk")}
    if rec.get("stage") not in fields:
        raise ValueError(f"record stage ({rec.get('stage')!r}) must be one of {', '.join(fields)}")
    key = "|".join([rec["stage"], *(str(rec[f]) for f in fields[rec["stage"]])])
    return f"{key}|{rec['settings_id']}" if rec.get("settings_id") else key  # records of other settings coexist


#: Arguments that do not change a record's result (which units run, where things go, how it is shown).
_NOT_RESULT_ARGS = ("stages", "labels", "models", "late_models", "seeds", "folds", "approx_grid", "speed_reps", "n_boot",
                    "threads", "work", "records", "out", "no_progress", "quick", "legacy_records",
                    "settings_id")


def settings_id(args: argparse.Namespace) -> str:
    """A short hash of the arguments a record's result depends on (bags, models, training).

    Every record carries it; records made with other settings are ignored when the benchmark reads its records,
    so a rerun with other settings never reuses them."""
    import hashlib

    d = {k: v for k, v in sorted(vars(args).items()) if k not in _NOT_RESULT_ARGS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def matching_records(records: dict[str, dict], sid: str) -> dict[str, dict]:
    """The records made with settings ``sid``; the others are named in a warning and left in their files."""
    keep = {k: r for k, r in records.items() if r.get("settings_id") == sid}
    if len(keep) < len(records):
        logger.warning("%d of %d records were made with other settings (or before settings were recorded) and are "
                       "ignored: these settings' results are computed afresh", len(records) - len(keep), len(records))
    return keep


def read_records(path: str | os.PathLike) -> dict[str, dict]:
    """Finished records by key (a torn last line of a killed run is skipped)."""
    out: dict[str, dict] = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                logger.warning("skipping a torn record line in %s", path)
                continue
            out[record_key(rec)] = rec
    return out


def append_record(path: str | os.PathLike, rec: dict) -> None:
    """Append one record as a JSON line and flush it to disk (a killed run loses at most the unit in progress)."""
    record_key(rec)
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")
        f.flush()
        os.fsync(f.fileno())


def t_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """Mean and its 95% Student-t interval (NaNs dropped; a single value gives a zero-width interval)."""
    a = np.array([v for v in values if v == v], dtype=np.float64)
    if not len(a):
        return float("nan"), float("nan"), float("nan")
    if len(a) == 1:
        return float(a[0]), float(a[0]), float(a[0])
    from scipy.stats import t

    h = float(t.ppf(0.975, len(a) - 1) * a.std(ddof=1) / math.sqrt(len(a)))
    return float(a.mean()), float(a.mean() - h), float(a.mean() + h)


def _pooled(recs: Sequence[dict]) -> tuple[list[str], dict[int, dict[str, float]], dict[str, int]]:
    """Out-of-fold probabilities per seed: bag ids, {seed: {bag: prob}}, {bag: label}."""
    per_seed: dict[int, dict[str, float]] = {}
    labels: dict[str, int] = {}
    for r in recs:
        d = per_seed.setdefault(int(r["seed"]), {})
        for b, y, p in zip(r["test_ids"], r["test_labels"], r["test_probs"]):
            d[b] = p
            labels[b] = y
    ids = sorted(labels)
    return ids, per_seed, labels


def pooled_auc_ci(recs: Sequence[dict], n_boot: int = 2000, seed: int = 0, paired_with: Sequence[dict] | None = None) -> dict:
    """Pooled out-of-fold AUC, averaged over seeds, with a 95% bootstrap interval over bags.

    With ``paired_with`` (another model's records on the same bags and seeds) the statistic is the
    difference ``this − other``, resampling the same bags for both (a paired interval).
    """
    ids, ps, lab = _pooled(recs)
    seeds = sorted(ps)
    other = _pooled(paired_with)[1] if paired_with is not None else None
    if other is not None:
        seeds = [s for s in seeds if s in other]
    complete = [s for s in seeds if all(b in ps[s] for b in ids) and (other is None or all(b in other[s] for b in ids))]
    if not complete:
        return {"auc": float("nan"), "lo": float("nan"), "hi": float("nan"), "seeds": 0, "bags": len(ids)}
    y = np.array([lab[b] for b in ids])
    P = np.array([[ps[s][b] for b in ids] for s in complete])  # (seeds, bags)
    Q = np.array([[other[s][b] for b in ids] for s in complete]) if other is not None else None

    def stat(idx: np.ndarray) -> float:
        v = np.mean([auc(y[idx], P[i, idx]) for i in range(len(complete))])
        if Q is not None:
            v -= np.mean([auc(y[idx], Q[i, idx]) for i in range(len(complete))])
        return float(v)

    est = stat(np.arange(len(ids)))
    rng = np.random.default_rng(seed)
    boots = [stat(rng.integers(0, len(ids), len(ids))) for _ in range(n_boot)]
    boots = [b for b in boots if b == b]
    lo, hi = (np.percentile(boots, [2.5, 97.5]) if boots else (float("nan"), float("nan")))
    return {"auc": est, "lo": float(lo), "hi": float(hi), "seeds": len(complete), "bags": len(ids)}


def summarize(records: dict[str, dict], *, labels: Sequence[str] = LABELS, models: Sequence[str] = PEERS,
              n_boot: int = 2000) -> dict:
    """Table rows per (label, model) from CV records; approximation rows; speed rows; target checks."""
    cv = [r for r in records.values() if r["stage"] == "cv"]
    rows = []
    for lab in labels:
        dense = [r for r in cv if r["label"] == lab and r["model"] == "dense"]
        for m in models:
            rs = [r for r in cv if r["label"] == lab and r["model"] == m]
            if not rs:
                continue
            mean, lo, hi = t_interval([r["auc"] for r in rs])
            pooled = pooled_auc_ci(rs, n_boot=n_boot)
            row = {"label": lab, "model": m, "runs": len(rs), "seeds": sorted({r["seed"] for r in rs}),
                   "fold_auc_mean": mean, "fold_auc_lo": lo, "fold_auc_hi": hi,
                   "pooled_auc": pooled["auc"], "pooled_auc_lo": pooled["lo"], "pooled_auc_hi": pooled["hi"],
                   "pooled_seeds": pooled["seeds"], "pooled_bags": pooled["bags"],
                   "regions_kept": float(np.mean([r["regions_kept"] for r in rs])) if rs[0].get("regions_kept") is not None else None,
                   "epochs_mean": float(np.mean([r["epochs_run"] for r in rs])),
                   "train_cpu_s_per_step": float(np.sum([r["train_cpu_s"] for r in rs]) /
                                                 max(1, np.sum([r["steps"] for r in rs])))}
            if m != "dense" and dense:
                d = pooled_auc_ci(rs, n_boot=n_boot, paired_with=dense)
                if d["seeds"]:  # no seed with both models on every bag yet: no paired difference
                    row.update(minus_dense=d["auc"], minus_dense_lo=d["lo"], minus_dense_hi=d["hi"])
            rows.append(row)
    approx = []
    ap = [r for r in records.values() if r["stage"] == "approx"]
    for key in sorted({(r["label"], r["selection"], r["region_size"], r["topk"]) for r in ap}):
        rs = [r for r in ap if (r["label"], r["selection"], r["region_size"], r["topk"]) == key]
        probs = {b: p for r in rs for b, p in zip(r["test_ids"], r["test_probs"])}
        labs = {b: y for r in rs for b, y in zip(r["test_ids"], r["test_labels"])}
        ids = sorted(labs)
        approx.append({"label": key[0], "selection": key[1], "region_size": key[2], "topk": key[3], "folds": len(rs),
                       "regions_kept": float(np.mean([r["regions_kept"] for r in rs])),
                       "rel_error": float(np.mean([e for r in rs for e in r["rel_errors"]])),
                       "auc": auc([labs[b] for b in ids], [probs[b] for b in ids]),
                       "dense_auc": auc([labs[b] for b in ids], [{b: p for r in rs for b, p in zip(r["test_ids"], r["dense_probs"])}[b] for b in ids]),
                       "bags": len(ids)})
    speed = [r for r in records.values() if r["stage"] == "speed"]
    return {"rows": rows, "approx": approx, "speed": speed, "targets": _targets(rows, speed, labels)}


def _targets(rows: list[dict], speed: list[dict], labels: Sequence[str]) -> dict:
    """The issue's targets, checked on the pooled AUCs (point estimate and the paired interval)."""
    out: dict = {}
    get = {(r["label"], r["model"]): r for r in rows}
    for q in ("querent_region", "querent_query"):
        for lab in labels:
            r = get.get((lab, q))
            if r and "minus_dense" in r:
                out[f"{q}_{lab}_within_1pt_of_dense"] = {
                    "diff": r["minus_dense"], "ci": [r["minus_dense_lo"], r["minus_dense_hi"]],
                    "point_met": bool(r["minus_dense"] >= -0.01), "ci_met": bool(r["minus_dense_lo"] >= -0.01)}
        r, a = get.get(("spatial", q)), get.get(("spatial", "abmil"))
        if r and a:
            out[f"{q}_above_abmil_on_spatial"] = {"querent": r["pooled_auc"], "abmil": a["pooled_auc"],
                                                  "met": bool(r["pooled_auc_lo"] > a["pooled_auc_hi"]),
                                                  "point_met": bool(r["pooled_auc"] > a["pooled_auc"])}
    for s in speed:
        for q in ("region", "query"):
            if f"dense_over_{q}" in s:
                out[f"speed_{q}_at_{s['n']}"] = {"ratio": s[f"dense_over_{q}"], "met": bool(s[f"dense_over_{q}"] >= 5)}
    return out


# ----------------------------------------------------------------------------------------------- stages


def regions_kept(model, bag: GridBag) -> float:
    """Mean share of the bag's regions each query attends in the first layer (1.0 for dense)."""
    import torch

    if model.cfg.selection == "dense":
        return 1.0
    with torch.no_grad():
        out = model(bag.features, bag.coords, patch_size_level0=1, return_index=True)
    idx = out.block_index[0]  # (H, NR or S, K)
    if model.cfg.selection == "query":
        idx = idx[:, out.layout.slot]
    return float((idx >= 0).sum(-1).float().mean() / out.layout.num_regions)


def first_layer_attention(model, bag: GridBag, selection: str, region_size: int, topk: int):
    """The first layer's attention output on the real patches, ``(H, N, hd)``, with the given selection.

    Mirrors ``Querent.forward`` up to the first layer's attention (the same input for every selection),
    and returns the share of regions kept per query too.
    """
    import torch

    from core.attention import attention
    from core.blocksparse import block_sparse_attention
    from pathology.querent import build_regions, per_query_region_attention, select_regions, sincos_2d

    lay = build_regions(bag.coords, 1, region_size, model.cfg.neighbourhood)
    with torch.no_grad():
        h = model.embed(bag.features) + sincos_2d(lay.grid_xy, model.cfg.dim, scale=0.25)
        x = h.new_zeros(1, lay.padded_len, model.cfg.dim)
        x[0, lay.slot] = h
        pad = torch.ones(1, lay.padded_len, dtype=torch.bool)
        pad[0, lay.slot] = False
        layer = model.layers[0]
        hn = layer.norm1(x)
        q = layer.attn.project_q(hn)
        k, v = layer.attn.project_kv(hn)
        k, v = k.contiguous(), v.contiguous()
        real = lay.slot
        if selection == "dense":
            return attention(q[:, :, real], k[:, :, real], v[:, :, real])[0], 1.0
        if selection == "query":
            o, idx = per_query_region_attention(q, k, v, lay, topk, pad)
            kept = float((idx[0][:, real] >= 0).sum(-1).float().mean() / lay.num_regions)
        else:
            idx = select_regions(q, k, lay, topk, pad, model.cfg.region_score)
            o = block_sparse_attention(q, k, v, idx, block_size=region_size**2, key_padding_mask=pad)
            kept = float((idx[0] >= 0).sum(-1).float().mean() / lay.num_regions)
        return o[0][:, real], kept


def _configured(model, selection: str, region_size: int, topk: int):
    m = copy.deepcopy(model)
    m.cfg.selection, m.cfg.region_size, m.cfg.topk = selection, region_size, topk  # layers share this cfg
    return m


def run_speed(args, records: dict, path: str) -> None:
    import torch

    from pathology.querent import Querent

    bcfg = _bag_cfg(args, side=args.speed_side)
    bag = make_bag(np.random.default_rng(7), "spatial", 1, bcfg)
    n = int(bag.features.shape[0])
    key = record_key({"stage": "speed", "n": n, "settings_id": args.settings_id})
    if key in records:
        return
    torch.manual_seed(0)
    base = Querent(_with(model_config(args, bcfg.in_dim), selection="dense")).eval()
    rec = {"stage": "speed", "settings_id": args.settings_id, "n": n, "side": args.speed_side, "reps": args.speed_reps,
           "threads": torch.get_num_threads()}
    for sel in ("region", "query", "dense"):
        m = _configured(base, sel, args.region_size, args.topk)
        times = []
        with torch.no_grad():
            for _ in range(args.speed_reps):
                t0 = time.process_time()
                m(bag.features, bag.coords, patch_size_level0=1)
                times.append(time.process_time() - t0)
        rec[f"{sel}_cpu_s"] = round(min(times), 3)
        rec[f"{sel}_cpu_s_all"] = [round(t, 3) for t in times]
        logger.info("speed n=%d %s: %s CPU s", n, sel, rec[f"{sel}_cpu_s_all"])
    rec["regions_kept_region"] = regions_kept(_configured(base, "region", args.region_size, args.topk), bag)
    rec["dense_over_region"] = round(rec["dense_cpu_s"] / rec["region_cpu_s"], 2)
    rec["dense_over_query"] = round(rec["dense_cpu_s"] / rec["query_cpu_s"], 2)
    append_record(path, rec)
    records[key] = rec


def _bag_cfg(args, side: int | None = None) -> GridBagConfig:
    near = tuple(int(v) for v in args.near.split(","))
    return GridBagConfig(side=side or args.side, keep=args.keep, in_dim=args.in_dim, radius=args.radius, near=near,
                         far_min=args.far_min, amplitude=args.amplitude, pairs=args.pairs)


def _split(n_labels: Sequence[int], test: list[int], seed: int, fold: int, val_share: float) -> tuple[list[int], list[int]]:
    """Training and validation indices of the bags outside ``test`` (stratified, ``val_share`` to validation)."""
    rest = [i for i in range(len(n_labels)) if i not in set(test)]
    rng = np.random.default_rng([seed, fold, 17])
    val: list[int] = []
    for c in sorted({n_labels[i] for i in rest}):
        idx = [i for i in rest if n_labels[i] == c]
        rng.shuffle(idx)
        val += idx[: max(1, round(val_share * len(idx)))]
    return [i for i in rest if i not in set(val)], sorted(val)


def run_cv(args, records: dict, path: str, cohorts: dict[str, list[GridBag]], stage_models: list[tuple[int, str]]) -> None:
    import torch

    from tqdm import tqdm

    units = [(seed, m, lab, f) for seed, m in stage_models for lab in args.labels for f in range(args.folds)]
    todo = [u for u in units if record_key({"stage": "cv", "label": u[2], "seed": u[0], "fold": u[3], "model": u[1],
                                            "settings_id": args.settings_id})
            not in records]
    for seed, m, lab, f in tqdm(todo, desc="cv", unit="fit", disable=args.no_progress):
        bags = cohorts[lab]
        y = [b.label for b in bags]
        test = folds_for(y, args.folds, seed)[f]
        tr, va = _split(y, test, seed, f, args.val_share)
        mcfg = model_config(args, args.in_dim)
        os.makedirs(args.work, exist_ok=True)
        model, info = train_peer(m, mcfg, [bags[i] for i in tr], [bags[i] for i in va], epochs=args.epochs, lr=args.lr,
                                 patience=args.patience, min_epochs=args.min_epochs, seed=1000 * seed + f,
                                 batch_bags=args.batch_bags,
                                 checkpoint=os.path.join(args.work, f"fit_{lab}_s{seed}_f{f}_{m}_{args.settings_id}.pt"))
        t0 = time.process_time()
        probs = _probs(model, [bags[i] for i in test])
        rec = {"stage": "cv", "settings_id": args.settings_id, "label": lab, "seed": seed, "fold": f, "model": m,
               "n_train": len(tr), "n_val": len(va),
               "test_ids": [bags[i].bag_id for i in test], "test_labels": [y[i] for i in test],
               "test_probs": [round(p, 6) for p in probs], "auc": auc([y[i] for i in test], probs),
               "eval_cpu_s": round(time.process_time() - t0, 2), "steps": info["epochs_run"] * len(tr),
               "regions_kept": regions_kept(model, bags[test[0]]) if m.startswith("querent") or m == "dense" else None,
               **info}
        if m == "dense" and seed == args.seeds[0]:
            os.makedirs(args.work, exist_ok=True)
            torch.save(model.state_dict(), os.path.join(args.work, f"dense_{lab}_s{seed}_f{f}_{args.settings_id}.pt"))
        append_record(path, rec)
        records[record_key(rec)] = rec
        logger.info("cv %s seed %d fold %d %s: AUC %.3f (%d epochs, %.0f CPU s)", lab, seed, f, m, rec["auc"],
                    info["epochs_run"], info["train_cpu_s"])


def run_approx(args, records: dict, path: str, cohorts: dict[str, list[GridBag]]) -> None:
    import torch

    from tqdm import tqdm

    from pathology.querent import Querent

    seed = args.seeds[0]
    units = [(lab, f, g) for lab in args.labels for f in range(args.folds) for g in args.approx_grid]
    todo = [u for u in units if record_key({"stage": "approx", "label": u[0], "fold": u[1], "selection": u[2][0],
                                            "region_size": u[2][1], "topk": u[2][2], "settings_id": args.settings_id})
            not in records]
    cache: dict = {}
    missing: set[str] = set()
    for lab, f, (sel, R, k) in tqdm(todo, desc="approx", unit="config", disable=args.no_progress):
        wpath = os.path.join(args.work, f"dense_{lab}_s{seed}_f{f}_{args.settings_id}.pt")  # this settings' weights
        if not os.path.exists(wpath):
            if wpath not in missing:  # one warning per fold, not per grid point
                missing.add(wpath)
                logger.warning("approx: %s missing (run the cv stage for dense, seed %d, first); fold %d skipped",
                               wpath, seed, f)
            continue
        bags = cohorts[lab]
        y = [b.label for b in bags]
        test = folds_for(y, args.folds, seed)[f]
        if (lab, f) not in cache:
            cache.clear()
            dense = Querent(_with(model_config(args, args.in_dim), selection="dense"))
            dense.load_state_dict(torch.load(wpath))
            dense.eval()
            cache[(lab, f)] = (dense, {i: first_layer_attention(dense, bags[i], "dense", R, k)[0] for i in test},
                               _probs(dense, [bags[i] for i in test]))
        dense, ref, dprobs = cache[(lab, f)]
        t0 = time.process_time()
        errs, kept = [], []
        for i in test:
            o, kp = first_layer_attention(dense, bags[i], sel, R, k)
            errs.append(float((o - ref[i]).norm() / ref[i].norm()))
            kept.append(kp)
        probs = _probs(_configured(dense, sel, R, k), [bags[i] for i in test])
        rec = {"stage": "approx", "settings_id": args.settings_id, "label": lab, "fold": f, "selection": sel, "region_size": R, "topk": k, "seed": seed,
               "test_ids": [bags[i].bag_id for i in test], "test_labels": [y[i] for i in test],
               "test_probs": [round(p, 6) for p in probs], "dense_probs": [round(p, 6) for p in dprobs],
               "rel_errors": [round(e, 5) for e in errs], "regions_kept": float(np.mean(kept)),
               "cpu_s": round(time.process_time() - t0, 2)}
        append_record(path, rec)
        records[record_key(rec)] = rec


def plot_curves(summary: dict, png: str) -> str | None:
    """Relative error and AUC of Querent selection on dense weights vs the share of regions kept."""
    ap = summary["approx"]
    if not ap:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({r["label"] for r in ap})
    fig, axes = plt.subplots(1, 1 + len(labels), figsize=(5 * (1 + len(labels)), 4))
    series = sorted({(r["selection"], r["region_size"]) for r in ap})
    for sel, R in series:
        for j, lab in enumerate([None, *labels]):
            rs = sorted([r for r in ap if (r["selection"], r["region_size"]) == (sel, R) and (lab is None or r["label"] == lab)],
                        key=lambda r: r["regions_kept"])
            if lab is None:  # error panel: mean over labels at each topk
                by_k: dict[int, list[dict]] = {}
                for r in rs:
                    by_k.setdefault(r["topk"], []).append(r)
                xs = [np.mean([r["regions_kept"] for r in v]) for v in by_k.values()]
                ys = [np.mean([r["rel_error"] for r in v]) for v in by_k.values()]
                order = np.argsort(xs)
                axes[0].plot(np.array(xs)[order], np.array(ys)[order], "o-", label=f"per {sel}, R={R}")
            else:
                axes[j].plot([r["regions_kept"] for r in rs], [r["auc"] for r in rs], "o-", label=f"per {sel}, R={R}")
    axes[0].set(xscale="log", yscale="log", xlabel="share of regions attended per query", ylabel="relative error of attention output",
                title="first layer, dense-trained weights")
    axes[0].legend(fontsize=8)
    for j, lab in enumerate(labels, start=1):
        d = [r["dense_auc"] for r in ap if r["label"] == lab]
        axes[j].axhline(d[0], color="k", ls="--", label="dense (exact)")
        axes[j].set(xscale="log", xlabel="share of regions attended per query", ylabel="out-of-fold AUC", title=f"{lab}: dense weights")
        axes[j].legend(fontsize=8)
    fig.tight_layout()
    tmp = png + ".tmp.png"
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, png)
    return png


def format_rows(summary: dict) -> str:
    from benchmarks.common import format_table

    rows = [{"label": r["label"], "model": r["model"], "runs": r["runs"], "pooled seeds": r["pooled_seeds"],
             "pooled AUC [95% CI]": f"{r['pooled_auc']:.3f} [{r['pooled_auc_lo']:.3f}, {r['pooled_auc_hi']:.3f}]",
             "fold AUC [95% CI]": f"{r['fold_auc_mean']:.3f} [{r['fold_auc_lo']:.3f}, {r['fold_auc_hi']:.3f}]",
             "− dense [95% CI]": (f"{r['minus_dense']:+.3f} [{r['minus_dense_lo']:+.3f}, {r['minus_dense_hi']:+.3f}]"
                                  if "minus_dense" in r else ""),
             "regions kept": f"{r['regions_kept']:.3f}" if r["regions_kept"] is not None else "",
             "epochs": f"{r['epochs_mean']:.1f}",
             "train CPU s/step": f"{r['train_cpu_s_per_step']:.3f}"} for r in summary["rows"]]
    return format_table(rows, list(rows[0]) if rows else [])


def format_approx(summary: dict) -> str:
    """The approximation rows as a markdown table (selection on the dense-trained weights of each fold)."""
    from benchmarks.common import format_table

    rows = [{"label": a["label"], "selection": a["selection"], "R": a["region_size"], "topk": a["topk"],
             "folds": a["folds"], "regions kept per query": f"{a['regions_kept']:.3f}",
             "rel. error of attention output": f"{a['rel_error']:.3f}", "OOF AUC": f"{a['auc']:.3f}",
             "dense AUC (same weights)": f"{a['dense_auc']:.3f}"}
            for a in sorted(summary["approx"], key=lambda a: (a["label"], a["regions_kept"]))]
    return format_table(rows, list(rows[0]) if rows else [])


# -------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pathology_sparse", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny bags and one fold pass: a smoke run, not evidence")
    p.add_argument("--stages", default="speed,cv,approx,summary", help="comma-separated subset of speed,cv,approx,summary")
    p.add_argument("--labels", default=",".join(LABELS))
    p.add_argument("--models", default=",".join(PEERS))
    p.add_argument("--late-models", default="", help="models trained only after every --models fit of every seed")
    p.add_argument("--seeds", default="0,1", help="comma-separated CV seeds (fold assignment and model init)")
    p.add_argument("--folds", type=int, default=5)
    p.add_argument("--bags", type=int, default=40, help="bags per label (balanced)")
    p.add_argument("--cohort-seed", type=int, default=0)
    p.add_argument("--side", type=int, default=106, help="patch grid side (~0.9·side² patches per bag)")
    p.add_argument("--keep", type=float, default=0.9)
    p.add_argument("--in-dim", type=int, default=16)
    p.add_argument("--radius", type=float, default=8.0, help="pattern site radius in patches")
    p.add_argument("--amplitude", type=float, default=3.0, help="length of the pattern direction in a site's features")
    p.add_argument("--near", default="24,32", help="spatial label 1: Chebyshev distance range of the site centres")
    p.add_argument("--far-min", type=int, default=64, help="spatial label 0: Chebyshev distance at least this")
    p.add_argument("--pairs", type=int, default=1, help="spatial label: A–B site pairs per bag (all near or all far)")
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--heads", type=int, default=1)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--region-size", type=int, default=8)
    p.add_argument("--topk", type=int, default=20)
    p.add_argument("--pos-encoding", default="sincos", help="QuerentConfig.pos_encoding of the attention models")
    p.add_argument("--rope-scale", type=float, default=0.25, help="QuerentConfig.rope_scale (rotary units per grid cell)")
    p.add_argument("--epochs", type=int, default=6, help="most epochs (early stopping usually ends sooner)")
    p.add_argument("--min-epochs", type=int, default=4)
    p.add_argument("--patience", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-3)
    p.add_argument("--batch-bags", type=int, default=1, help="bags per optimizer step (gradients averaged)")
    p.add_argument("--val-share", type=float, default=0.2, help="share of each fold's training bags for early stopping")
    p.add_argument("--speed-side", type=int, default=270, help="grid side of the speed bag (270: ~65.6K patches)")
    p.add_argument("--speed-reps", type=int, default=2)
    p.add_argument("--approx-grid", default="", help="selection:R:topk,... (default: the built-in grid)")
    p.add_argument("--n-boot", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "longctx_pathology_sparse"),
                   help="folder for the dense weights the approximation stage reuses")
    p.add_argument("--records", default=str(RECORDS),
                   help="JSONL records (comma-separated: appended to the first, all read; for parts run in parallel)")
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--legacy-records", action="store_true",
                   help="summarise the records written before records carried their settings (with --stages summary)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import torch

    from benchmarks.common import env_info, write_json_atomic

    torch.set_num_threads(args.threads)
    if args.quick:
        args.side, args.bags, args.speed_side, args.epochs, args.min_epochs, args.speed_reps = 24, 10, 40, 2, 1, 1
        args.region_size, args.topk, args.seeds, args.near, args.far_min, args.radius = 4, 4, "0", "6,8", 14, 2.0
        args.approx_grid = args.approx_grid or "region:4:0,region:4:4,query:4:4"
        if args.records == str(RECORDS) or args.out == str(RESULTS):
            raise SystemExit("--quick writes nowhere by default: pass --records and --out")
    args.labels = [s for s in args.labels.split(",") if s]
    for lab in args.labels:
        if lab not in LABELS:
            raise SystemExit(f"--labels: {lab!r} is not one of {', '.join(LABELS)}")
    models = [s for s in args.models.split(",") if s]
    late = [s for s in args.late_models.split(",") if s]
    for m in models + late:
        if m not in PEERS:
            raise SystemExit(f"--models: {m!r} is not one of {', '.join(PEERS)}")
    args.seeds = [int(s) for s in args.seeds.split(",")]
    args.approx_grid = ([(s, int(r), int(k)) for s, r, k in (g.split(":") for g in args.approx_grid.split(","))]
                        if args.approx_grid else list(APPROX_GRID))
    stages = set(args.stages.split(","))
    if stages - {"speed", "cv", "approx", "summary"}:
        raise SystemExit(f"--stages: unknown {sorted(stages - {'speed', 'cv', 'approx', 'summary'})}")
    paths = [r for r in args.records.split(",") if r]
    args.records = paths[0]  # new records go to the first file; the others are read (parts run in parallel)
    records = {k: v for pth in paths for k, v in read_records(pth).items()}
    args.settings_id = settings_id(args)
    if args.legacy_records:
        if stages - {"summary"}:
            raise SystemExit("--legacy-records only summarises: use it with --stages summary")
        records = {k: r for k, r in records.items() if "settings_id" not in r}
    else:
        records = matching_records(records, args.settings_id)
    logger.info("%d finished records in %s", len(records), ", ".join(paths))
    if "speed" in stages:
        run_speed(args, records, args.records)
    cohorts = {}
    if stages & {"cv", "approx"}:
        bcfg = _bag_cfg(args)
        cohorts = {lab: make_cohort(lab, args.bags, args.cohort_seed, bcfg) for lab in args.labels}
        logger.info("cohorts: %s", {k: (len(v), int(np.mean([b.features.shape[0] for b in v]))) for k, v in cohorts.items()})
    if "cv" in stages:
        run_cv(args, records, args.records, cohorts, [(s, m) for s in args.seeds[:1] for m in models])
        if "approx" in stages:
            run_approx(args, records, args.records, cohorts)
        run_cv(args, records, args.records, cohorts, [(s, m) for s in args.seeds[1:] for m in models])
        run_cv(args, records, args.records, cohorts, [(s, m) for s in args.seeds for m in late])
    elif "approx" in stages:
        run_approx(args, records, args.records, cohorts)
    if "summary" in stages:
        summary = summarize(records, labels=args.labels, models=models + late, n_boot=args.n_boot)
        png = plot_curves(summary, os.path.splitext(args.out)[0] + "_curves.png")
        settings = {k: v for k, v in vars(args).items() if k not in ("records", "out", "work", "no_progress")}
        write_json_atomic(args.out, {"env": env_info(), "settings": settings, "bag_config": asdict(_bag_cfg(args)),
                                     "curves_png": os.path.basename(png) if png else None, **summary})
        if summary["rows"]:
            print(format_rows(summary))
        if summary["approx"]:
            print(format_approx(summary))
        print(json.dumps(summary["targets"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
