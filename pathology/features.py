"""Patch features: extraction (tiles read by DataLoader workers while the encoder computes), and reading
feature files written by this project, CLAM or TRIDENT into labelled bags for training (:func:`load_bags`).

Feature-file layouts read by :func:`read_feature_file` (one HDF5 file per slide):

- this project and TRIDENT: ``features`` (N, D), ``coords`` (N, 2) level-0 (x, y) with the attribute
  ``patch_size_level0`` (TRIDENT also writes ``overlap``; with an overlap the grid step is inferred);
- CLAM (``h5_files/<slide_id>.h5``): ``features`` (N, D) and ``coords`` (N, 2) without attributes. The grid
  step is then inferred from the coordinates (the greatest common divisor of the gaps between distinct x
  and y values), or taken from ``patch_size_level0=`` (the training CLI's ``--patch-size-level0``).
"""

from __future__ import annotations

import csv
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from pathology.encoders import PatchEncoder
from pathology.patching import PatchGrid
from pathology.slide import Slide

logger = logging.getLogger(__name__)

__all__ = ["PatchDataset", "extract_features", "read_feature_file", "infer_grid_step", "FeatureFile", "Bag",
           "load_bags", "class_names", "patch_settings", "cohort_patch_settings", "PATCH_SETTINGS"]


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


@dataclass
class FeatureFile:
    """One slide's features as read from disk."""

    features: np.ndarray  # (N, D) float32
    coords: np.ndarray  # (N, 2) int64 level-0 (x, y) of each patch's top-left corner
    patch_size_level0: float  # grid step in level-0 pixels
    step_source: str  # "attribute", "flag" or "inferred"
    patch_settings: dict | None = None  # how the patches were made (:func:`patch_settings`); None: not stored


#: The settings a slide model needs to patch a new slide as its training slides were (keys of :func:`patch_settings`).
PATCH_SETTINGS = ("patch_mpp", "patch_size", "min_tissue", "encoder", "encoder_kwargs", "tissue")


def patch_settings(attrs: dict) -> dict | None:
    """The patch settings stored in a feature file by ``pathology.batch`` (the root attribute ``settings``, JSON):
    ``patch_mpp`` (target µm/px), ``patch_size`` (pixels), ``min_tissue``, ``encoder`` (name), ``encoder_kwargs``
    and ``tissue`` (the tissue-mask settings). ``None`` for a file without them (TRIDENT, CLAM, older files)."""
    import json

    text = attrs.get("settings")
    if isinstance(text, bytes):
        text = text.decode()
    try:
        s = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(s, dict) or "mpp" not in s or "patch_size" not in s:
        return None
    enc = s.get("encoder") if isinstance(s.get("encoder"), dict) else {}
    return {"patch_mpp": float(s["mpp"]), "patch_size": int(s["patch_size"]), "min_tissue": s.get("min_tissue"),
            "encoder": enc.get("name"), "encoder_kwargs": enc.get("encoder_kwargs") or {}, "tissue": s.get("tissue")}


def infer_grid_step(coords_N2: np.ndarray) -> int:
    """The grid step of patch coordinates: gcd of the positive gaps between distinct x and between distinct y.

    Raises:
        ValueError: fewer than two distinct x or y values (a single patch or a single row has no step).
    """
    c = np.rint(np.asarray(coords_N2, dtype=np.float64)).astype(np.int64)
    if c.ndim != 2 or c.shape[1] != 2:
        raise ValueError(f"coords must be (N, 2), got shape {c.shape}")
    gaps = np.concatenate([np.diff(np.unique(c[:, 0])), np.diff(np.unique(c[:, 1]))])
    gaps = gaps[gaps > 0]
    if len(gaps) == 0:
        raise ValueError(f"cannot infer the grid step from {len(c)} patch(es) on one row and column; "
                         "give it (--patch-size-level0)")
    return int(np.gcd.reduce(gaps))


def read_feature_file(path: str | os.PathLike, *, patch_size_level0: float | None = None) -> FeatureFile:
    """Read a per-slide feature file in this project's, TRIDENT's or CLAM's layout (see the module docstring).

    Args:
        path: the ``.h5`` file.
        patch_size_level0: grid step for files without a ``patch_size_level0`` attribute (CLAM); when
            ``None`` it is inferred from the coordinates.

    Raises:
        ValueError: no ``features``, wrong shapes, or rows of ``features`` and ``coords`` that differ.
    """
    from pathology.patching import read_h5

    path = os.fspath(path)
    d = read_h5(path)
    feats = d["features"]
    if feats is None:
        raise ValueError(f"{path!r} has coords but no 'features' (run the batch CLI with --task feat)")
    coords = d["coords"]
    if feats.ndim == 3 and feats.shape[0] == 1:  # some writers keep a batch axis: (1, N, D)
        feats = feats[0]
    if coords.ndim == 3 and coords.shape[0] == 1:
        coords = coords[0]
    if feats.ndim != 2 or coords.ndim != 2 or coords.shape[1] != 2:
        raise ValueError(f"{path!r}: expected features (N, D) and coords (N, 2), got {feats.shape} and {coords.shape}")
    if feats.shape[0] != coords.shape[0]:
        raise ValueError(f"{path!r}: {feats.shape[0]} feature rows but {coords.shape[0]} coords")
    attrs = d["attrs"]
    overlap = float(attrs.get("overlap", 0) or 0)
    if "patch_size_level0" in attrs and overlap == 0:
        step, source = float(attrs["patch_size_level0"]), "attribute"
    elif patch_size_level0 is not None:
        step, source = float(patch_size_level0), "flag"
    elif len(coords) == 0:
        step, source = 0.0, "inferred"
    else:
        step, source = float(infer_grid_step(coords)), "inferred"
    return FeatureFile(np.asarray(feats, np.float32), np.rint(coords).astype(np.int64), step, source,
                       patch_settings(attrs))


@dataclass
class Bag:
    """One slide's patch features and label."""

    slide_id: str
    features: torch.Tensor  # (N, D) float32
    coords: torch.Tensor  # (N, 2) int64 level-0 (x, y)
    patch_size_level0: float  # grid step in level-0 pixels
    label: int = 0  # class index (classification)
    time: float = 0.0  # survival time
    event: int = 0  # 1 = event observed
    patient_id: str = ""  # slides of one patient stay in one fold ("" = the slide is its own patient)
    label_name: str = ""  # the label as written in the labels file
    patch_settings: dict | None = None  # how the patches were made (features.patch_settings); None: not stored

    def __post_init__(self) -> None:
        self.patient_id = self.patient_id or self.slide_id
        self.label_name = self.label_name or str(self.label)


def _encode_labels(values: list[str]) -> tuple[list[int], list[str]]:
    """Integer labels and class names: numeric labels keep their value, strings are numbered in sorted order."""
    try:
        nums = [float(v) for v in values]
    except ValueError:
        names = sorted(set(values))
        return [names.index(v) for v in values], names
    if any(not np.isfinite(n) or n != int(n) or n < 0 for n in nums):
        bad = next(v for v, n in zip(values, nums) if n != int(n) or n < 0)
        raise ValueError(f"class label {bad!r} is neither a non-negative integer nor a name")
    ints = [int(n) for n in nums]
    return ints, [str(i) for i in range(max(ints) + 1)]


def _features_folder(features_dir: str) -> str:
    """CLAM writes ``<dir>/h5_files/*.h5``: accept the parent folder too."""
    sub = os.path.join(features_dir, "h5_files")
    if os.path.isdir(sub) and not any(f.endswith(".h5") for f in os.listdir(features_dir)):
        return sub
    return features_dir


def load_bags(features_dir: str, labels_csv: str, *, task: str = "cls", target: str = "label",
              time_col: str = "time", event_col: str = "event", id_col: str = "slide_id",
              patient_col: str = "patient_id", patch_size_level0: float | None = None) -> list[Bag]:
    """Bags for every labelled slide that has ``<features_dir>/<slide_id>.h5``.

    Feature files may be in this project's, TRIDENT's or CLAM's layout (see :mod:`pathology.features`);
    a CLAM folder with ``h5_files/`` inside is accepted as it is. Class labels may be integers or names
    (names are numbered in sorted order; :func:`class_names` gives them back). A ``patient_col``
    column, when present, groups a patient's slides. Slides without features, without a label or
    without patches are skipped with a warning.
    """
    if not os.path.isdir(features_dir):
        raise FileNotFoundError(f"features folder not found: {features_dir!r}")
    if not os.path.isfile(labels_csv):
        raise FileNotFoundError(f"labels file not found: {labels_csv!r}")
    if task not in ("cls", "survival"):
        raise ValueError(f"task {task!r} is not one of 'cls', 'survival'")
    if patch_size_level0 is not None and not patch_size_level0 > 0:
        raise ValueError(f"patch_size_level0 ({patch_size_level0}) must be > 0")
    folder = _features_folder(features_dir)
    rows = _read_label_rows(labels_csv)
    need = [id_col] + ([target] if task == "cls" else [time_col, event_col])
    missing = [c for c in need if c not in rows[0]]
    if missing:
        raise ValueError(f"{labels_csv!r} lacks column(s) {missing}; it has {list(rows[0])}")
    rows = _unique_ids(rows, labels_csv, id_col, need[1:])
    if patient_col not in rows[0]:
        logger.info("%s has no %r column: each slide is its own patient", labels_csv, patient_col)
    if task == "cls":
        unlabelled = [r[id_col] for r in rows if not (r[target] or "").strip()]
        if unlabelled:
            logger.warning("%d slide(s) without a %r label skipped (e.g. %s)", len(unlabelled), target, unlabelled[:3])
        rows = [r for r in rows if (r[target] or "").strip()]
        try:
            labels, names = _encode_labels([r[target].strip() for r in rows])
        except ValueError as err:
            bad = next((r for r in rows if r[target].strip().lower() in ("nan", "inf", "-inf", "+inf")), None)
            where = f" (line {bad['_line']}, slide {bad[id_col]!r})" if bad else ""
            raise ValueError(f"{labels_csv!r} column {target!r}{where}: {err}") from None
    else:
        labels, names = [0] * len(rows), []
    bags, inferred = [], []
    for r, y in zip(rows, labels):
        path = os.path.join(folder, f"{r[id_col]}.h5")
        if not os.path.exists(path):
            logger.warning("no features for %s (%s); skipped", r[id_col], path)
            continue
        ff = read_feature_file(path, patch_size_level0=patch_size_level0)
        finite = np.isfinite(ff.features).all(axis=1)
        if not finite.all():
            raise ValueError(f"{path}: {int((~finite).sum())} of {len(finite)} patches have non-finite features (NaN "
                             f"or infinity, first at row {int(np.argmin(finite))}); re-extract this slide's features")
        if len(ff.coords) == 0:
            logger.warning("%s has no patches (no tissue); skipped", r[id_col])
            continue
        if ff.step_source == "inferred":
            inferred.append((r[id_col], ff.patch_size_level0))
        bags.append(Bag(
            slide_id=r[id_col], features=torch.from_numpy(ff.features), coords=torch.from_numpy(ff.coords),
            patch_size_level0=ff.patch_size_level0, label=y if task == "cls" else 0,
            time=_survival_value(r, time_col, labels_csv, "time") if task == "survival" else 0.0,
            event=int(_survival_value(r, event_col, labels_csv, "event")) if task == "survival" else 0,
            patient_id=(r.get(patient_col) or "").strip(), label_name=names[y] if task == "cls" else "",
            patch_settings=ff.patch_settings,
        ))
    if inferred:
        steps = Counter(s for _, s in inferred)
        logger.warning("%d of %d feature files have no 'patch_size_level0' attribute (CLAM layout): the grid step "
                       "was inferred from their coordinates (%s; e.g. %s: %g px); pass --patch-size-level0 to set it",
                       len(inferred), len(bags), ", ".join(f"{s:g} px x{n}" for s, n in steps.most_common(3)),
                       inferred[0][0], inferred[0][1])
    if not bags:
        raise ValueError(f"no slide of {labels_csv!r} has features in {folder!r}")
    if task == "cls" and len({b.label for b in bags}) < 2:
        raise ValueError(f"{labels_csv!r} column {target!r}: every slide with features has the class "
                         f"{bags[0].label_name!r}; a classifier needs at least two classes")
    return bags


def _read_label_rows(labels_csv: str) -> list[dict]:
    """The rows of a labels CSV (each with ``_line``, its line number); ``ValueError`` naming the file and line for
    text that is not UTF-8 and for rows with more or fewer fields than the header."""
    try:
        with open(labels_csv, newline="", encoding="utf-8-sig") as f:
            reader = csv.DictReader(f)
            rows = []
            for r in reader:
                if None in r or any(v is None for v in r.values()):  # DictReader: extras under None, gaps None
                    n = len(reader.fieldnames or []) + len(r.get(None) or []) - sum(
                        v is None for k, v in r.items() if k is not None)
                    raise ValueError(f"{labels_csv!r} line {reader.line_num}: {n} fields, the header has "
                                     f"{len(reader.fieldnames or [])}; every row needs one value per column")
                r["_line"] = reader.line_num
                rows.append(r)
    except UnicodeDecodeError as err:
        with open(labels_csv, "rb") as f:
            line = f.read(err.start).count(b"\n") + 1
        raise ValueError(f"{labels_csv!r} line {line}: not UTF-8 text ({err.reason}); save the labels as UTF-8 CSV") \
            from None
    except csv.Error as err:
        raise ValueError(f"{labels_csv!r}: not a CSV file ({err})") from None
    if not rows:
        raise ValueError(f"{labels_csv!r} has no rows")
    return rows


def _unique_ids(rows: list[dict], labels_csv: str, id_col: str, columns: list[str]) -> list[dict]:
    """``rows`` with one row per slide id: a repeated id whose ``columns`` agree is kept once (with a warning); one
    whose ``columns`` differ is a ``ValueError`` naming the id and both lines."""
    first: dict[str, dict] = {}
    out = []
    for r in rows:
        sid = (r[id_col] or "").strip()
        if sid in first:
            a = first[sid]
            if any((a[c] or "").strip() != (r[c] or "").strip() for c in columns):
                diff = ", ".join(f"{c} {a[c]!r} vs {r[c]!r}" for c in columns if (a[c] or "").strip() != (r[c] or "").strip())
                raise ValueError(f"{labels_csv!r}: slide {sid!r} is on lines {a['_line']} and {r['_line']} with "
                                 f"different values ({diff}); keep one row per slide")
            logger.warning("%s: slide %r repeated on line %d (same values); counted once", labels_csv, sid, r["_line"])
            continue
        first[sid] = r
        out.append(r)
    return out


def _survival_value(row: dict, col: str, labels_csv: str, what: str) -> float:
    """A survival time (finite, >= 0) or event (0 or 1) of one row; ``ValueError`` naming file, column and line."""
    text = (row[col] or "").strip()
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    ok = np.isfinite(value) and (value >= 0 if what == "time" else value in (0.0, 1.0))
    if not ok:
        want = "a finite number >= 0" if what == "time" else "0 (censored) or 1 (event observed)"
        raise ValueError(f"{labels_csv!r} column {col!r} line {row['_line']}: {text!r} is not {want}")
    return value


def cohort_patch_settings(bags: list[Bag]) -> dict:
    """The patch settings shared by ``bags`` (:func:`patch_settings`): what a model trained on them needs to patch a
    new slide. Empty when no bag has them.

    Raises:
        ValueError: bags whose features were made with different settings (one model cannot read both), naming a
            slide of each and the settings that differ; or some bags with settings and some without.
    """
    have = [b for b in bags if b.patch_settings is not None]
    if not have:
        return {}
    if len(have) < len(bags):
        missing = next(b.slide_id for b in bags if b.patch_settings is None)
        raise ValueError(f"{len(bags) - len(have)} of {len(bags)} feature files do not store their patch settings "
                         f"(e.g. {missing}) while the others do (e.g. {have[0].slide_id}): make them all with one "
                         "pathology.batch run")
    first = have[0]
    for b in have[1:]:
        diff = [k for k in PATCH_SETTINGS if b.patch_settings.get(k) != first.patch_settings.get(k)]
        if diff:
            shown = ", ".join(f"{k}: {first.patch_settings.get(k)!r} vs {b.patch_settings.get(k)!r}" for k in diff)
            raise ValueError(f"feature files made with different settings ({first.slide_id} and {b.slide_id}: {shown});"
                             " a slide model reads features made one way: extract them again with one setting")
    return dict(first.patch_settings)


def class_names(bags: list[Bag]) -> list[str]:
    """Names of classes ``0..max(label)`` as found in the bags (``str(i)`` for a class no bag has)."""
    seen = {b.label: b.label_name for b in bags}
    return [seen.get(i, str(i)) for i in range(max(seen) + 1)]
