"""Batch slide processing: tissue segmentation, patch coordinates and patch features for a folder of slides.

``python -m pathology.batch --slides DIR --out DIR [--task seg|coords|feat|all] [--mpp 0.5]
[--patch-size 256] [--encoder NAME] [--weights PATH] [--shard I/N] [--skip-errors] [--workers K]``

Outputs under ``--out``:
- ``seg/<slide>.png`` thumbnail with the tissue mask (green) and the patch grid (blue), ``seg/<slide>_mask.png``
  the mask itself;
- ``patches/<slide>.h5`` ``coords`` (N, 2) level-0 (x, y), attrs ``patch_size``, ``patch_level``, ``mpp``;
- ``features/<encoder>/<slide>.h5`` ``coords`` + ``features`` (N, D) (CLAM layout);
- ``manifest.csv`` (``manifest_<I>of<N>.csv`` with ``--shard``): one row per slide with its status;
- ``failures.log``: tracebacks of failed slides; ``locks/``: lock files of slides in progress.

Every output is written to a temp file and renamed, so a killed run leaves no partial file; a rerun
skips finished outputs and takes over locks whose process is gone.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import re
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pathology.patching import _atomic_target

logger = logging.getLogger(__name__)

__all__ = ["BatchConfig", "list_slides", "run_batch", "build_parser", "main", "SLIDE_EXTENSIONS"]

SLIDE_EXTENSIONS = (".svs", ".tif", ".tiff", ".ndpi", ".vms", ".vmu", ".scn", ".mrxs", ".svslide", ".bif",
                    ".dcm", ".czi", ".png", ".jpg", ".jpeg")
TASKS = ("seg", "coords", "feat", "all")
MANIFEST_FIELDS = ["slide_id", "path", "status", "task", "n_patches", "patches_per_s", "seconds", "error"]


@dataclass(kw_only=True)
class BatchConfig:
    """One batch run."""

    slides: str  # folder of slides (searched non-recursively)
    out: str  # output folder
    task: str = "all"  # seg | coords | feat | all (each task runs its prerequisites)
    mpp: float = 0.5  # target micrometres per pixel of patches (0.5 ≈ 20×)
    patch_size: int = 256  # patch side in pixels at the target mpp
    min_tissue: float = 0.25  # minimum tissue fraction of a kept patch
    slide_mpp: float | None = None  # override of the slides' own µm/px (for files without it)
    encoder: str = "default"  # patch encoder registry name
    weights: str | None = None  # local weights file for the encoder
    shard: tuple[int, int] = (0, 1)  # (index, count): this process handles slides index, index+count, ...
    skip_errors: bool = False  # record a failed slide and go on (otherwise stop with an error)
    workers: int = 0  # DataLoader workers reading tiles while the encoder runs
    batch_size: int = 64  # patches per encoder batch
    device: str | None = None  # encoder device (default: CUDA if present, else CPU)
    progress: bool = True  # tqdm bars

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task ({self.task!r}) must be one of {TASKS}")
        if not self.mpp > 0:
            raise ValueError(f"mpp ({self.mpp}) must be > 0")
        if self.patch_size < 8:
            raise ValueError(f"patch_size ({self.patch_size}) must be >= 8")
        i, n = self.shard
        if not (n >= 1 and 0 <= i < n):
            raise ValueError(f"shard ({i}/{n}) must satisfy 0 <= I < N")
        if self.workers < 0:
            raise ValueError(f"workers ({self.workers}) must be >= 0")
        if self.slide_mpp is not None and not self.slide_mpp > 0:
            raise ValueError(f"slide_mpp ({self.slide_mpp}) must be > 0")

    @property
    def encoder_tag(self) -> str:
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", self.encoder)


def list_slides(folder: str) -> list[str]:
    """Slide files in ``folder`` (sorted by name), by extension."""
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"slides folder not found: {folder!r}")
    return sorted(
        os.path.join(folder, f) for f in os.listdir(folder)
        if f.lower().endswith(SLIDE_EXTENSIONS) and not f.startswith(".") and os.path.isfile(os.path.join(folder, f))
    )


def _slide_id(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


# --------------------------------------------------------------------------------------------- locks


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    """Remove a file that another process may have removed first."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _remove_if_writer_dead(tmp: str, pid: str) -> None:
    """Remove the temp file ``tmp`` written by process ``pid`` if that process is gone (and is not this one)."""
    if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
        _unlink(tmp)


def _remove_dead_temps(paths) -> None:
    """Delete temp files (``.<name>.<pid>.tmp[.png]``, from :func:`pathology.patching._atomic_target`: outputs,
    locks and the manifest) of these paths whose writer process is gone.

    A run killed mid-write leaves its temp file behind; the run that takes over the slide clears it, so no
    partial file survives a kill and rerun. Temps of live processes are left alone.
    """
    import glob

    for path in paths:
        d, b = os.path.split(path)
        for tmp in glob.glob(os.path.join(glob.escape(d), f".{glob.escape(b)}.*.tmp*")):
            _remove_if_writer_dead(tmp, os.path.basename(tmp)[len(b) + 2:].split(".", 1)[0])


class _Lock:
    """An exclusive lock file; a lock left by a dead process on this host is taken over."""

    def __init__(self, path: str):
        self.path = path
        self.held = False

    def acquire(self) -> bool:
        me = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()})
        # The lock appears whole or not at all: its content goes to a temp file that is then hard-linked to
        # the lock's name (atomic, fails if the name exists), so a kill never leaves an empty lock behind.
        _remove_dead_temps([self.path])
        tmp = _atomic_target(self.path)
        with open(tmp, "w") as f:
            f.write(me)
        try:
            for _ in range(2):
                try:
                    os.link(tmp, self.path)
                except FileExistsError:
                    if self._stale():
                        _unlink(self.path)
                        continue
                    return False
                self.held = True
                return True
            return False
        finally:
            os.remove(tmp)

    def clear_if_stale(self) -> None:
        """Remove the lock if its process is gone (e.g. killed after writing the output, before unlocking)."""
        _remove_dead_temps([self.path])
        if os.path.exists(self.path) and self._stale():
            _unlink(self.path)

    def _stale(self) -> bool:
        try:
            with open(self.path) as f:
                info = json.load(f)
        except (OSError, ValueError):
            # Unreadable or half-written: stale if older than a minute.
            try:
                return time.time() - os.path.getmtime(self.path) > 60
            except FileNotFoundError:
                return True
        if info.get("host") != socket.gethostname():
            return False  # another machine's job: leave it alone
        return not _pid_alive(int(info.get("pid", -1)))

    def release(self) -> None:
        if self.held:
            _unlink(self.path)
            self.held = False


# ------------------------------------------------------------------------------------------ manifest


def _write_csv_atomic(path: str, rows: list[dict]) -> None:
    tmp = _atomic_target(path)
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MANIFEST_FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in MANIFEST_FIELDS})
    os.replace(tmp, path)


def _read_manifest(path: str) -> dict[str, dict]:
    if not os.path.exists(path):
        return {}
    with open(path, newline="") as f:
        return {r["slide_id"]: r for r in csv.DictReader(f)}


# ------------------------------------------------------------------------------------------ the work


class _Runner:
    def __init__(self, cfg: BatchConfig):
        self.cfg = cfg
        self.dirs = {k: os.path.join(cfg.out, k) for k in ("seg", "patches", "locks")}
        self.dirs["features"] = os.path.join(cfg.out, "features", cfg.encoder_tag)
        for d in self.dirs.values():
            os.makedirs(d, exist_ok=True)
        self._encoder = None

    def outputs(self, sid: str) -> dict[str, str]:
        return {
            "seg": os.path.join(self.dirs["seg"], f"{sid}_mask.png"),
            "seg_png": os.path.join(self.dirs["seg"], f"{sid}.png"),
            "coords": os.path.join(self.dirs["patches"], f"{sid}.h5"),
            "feat": os.path.join(self.dirs["features"], f"{sid}.h5"),
        }

    def final_output(self, sid: str) -> str:
        t = self.cfg.task
        return self.outputs(sid)["feat" if t in ("feat", "all") else t]

    def encoder(self):
        if self._encoder is None:
            from pathology.encoders import build_encoder

            self._encoder = build_encoder(self.cfg.encoder, weights=self.cfg.weights, device=self.cfg.device)
        return self._encoder

    def process(self, path: str) -> dict:
        """Run the configured task (and its prerequisites) on one slide; returns a manifest row."""
        from PIL import Image

        from pathology.patching import grid_from_h5, overview_image, patch_grid, read_h5, save_png, write_h5
        from pathology.slide import Slide
        from pathology.tissue import TissueMask, segment_tissue

        cfg, sid = self.cfg, _slide_id(path)
        out = self.outputs(sid)
        row = {"slide_id": sid, "path": path, "task": cfg.task}
        t0 = time.perf_counter()
        with Slide(path, mpp=cfg.slide_mpp) as slide:
            _ = slide.mpp  # fail early and clearly when µm/px is unknown
            # seg
            if os.path.exists(out["seg"]):
                mask = np.asarray(Image.open(out["seg"])) > 0
                W, _h = slide.dimensions
                tissue = TissueMask(mask=mask, downsample=W / mask.shape[1], thumbnail=None)  # type: ignore[arg-type]
            else:
                tissue = segment_tissue(slide)
                grid_preview = patch_grid(slide, tissue, mpp=cfg.mpp, patch_size=cfg.patch_size, min_tissue=cfg.min_tissue)
                save_png(out["seg_png"], overview_image(tissue.thumbnail, tissue.downsample, mask=tissue.mask,
                                                        coords=grid_preview.coords,
                                                        patch_size_level0=grid_preview.patch_size_level0))
                save_png(out["seg"], (tissue.mask.astype(np.uint8) * 255))
            if cfg.task == "seg":
                row.update(status="done", n_patches="", seconds=round(time.perf_counter() - t0, 2))
                return row
            # coords
            if os.path.exists(out["coords"]):
                grid = grid_from_h5(read_h5(out["coords"]))
            else:
                grid = patch_grid(slide, tissue, mpp=cfg.mpp, patch_size=cfg.patch_size, min_tissue=cfg.min_tissue)
                write_h5(out["coords"], grid, slide_id=sid)
            n = int(grid.coords.shape[0])
            if cfg.task == "coords":
                row.update(status="done" if n else "empty", n_patches=n, seconds=round(time.perf_counter() - t0, 2))
                return row
        # feat (the slide is reopened inside the workers)
        enc = self.encoder()
        from pathology.features import extract_features

        feats, pps = extract_features(path, grid, enc, batch_size=cfg.batch_size, workers=cfg.workers,
                                      mpp=cfg.slide_mpp, progress=cfg.progress)
        write_h5(out["feat"], grid, feats, slide_id=sid, encoder=enc.name)
        row.update(status="done" if n else "empty", n_patches=n, patches_per_s=round(pps, 1),
                   seconds=round(time.perf_counter() - t0, 2))
        return row


def run_batch(cfg: BatchConfig) -> list[dict]:
    """Process every slide of this shard; returns the manifest rows. Raises on the first failure unless skip_errors."""
    os.makedirs(cfg.out, exist_ok=True)
    slides = list_slides(cfg.slides)
    i, n = cfg.shard
    mine = slides[i::n]
    runner = _Runner(cfg)
    manifest_path = os.path.join(cfg.out, "manifest.csv" if n == 1 else f"manifest_{i}of{n}.csv")
    _remove_dead_temps([manifest_path])  # a run killed while rewriting the manifest leaves its temp
    rows = _read_manifest(manifest_path)
    fail_log = os.path.join(cfg.out, "failures.log")
    it = mine
    if cfg.progress:
        from tqdm import tqdm

        it = tqdm(mine, desc=f"slides [{cfg.task}]", unit="slide")
    first_error: BaseException | None = None
    for path in it:
        sid = _slide_id(path)
        final = runner.final_output(sid)
        lock = _Lock(os.path.join(runner.dirs["locks"], f"{sid}.{cfg.task}.lock"))
        if os.path.exists(final):
            lock.clear_if_stale()
            prev = rows.get(sid, {})
            if prev.get("status") not in ("done", "empty") or prev.get("task") != cfg.task:
                rows[sid] = {"slide_id": sid, "path": path, "status": prev.get("status") if prev.get("status") in ("done", "empty") else "done",
                             "task": cfg.task, "n_patches": prev.get("n_patches", "")}
            continue
        if not lock.acquire():
            logger.info("%s is locked by another process; skipping", sid)
            rows[sid] = {"slide_id": sid, "path": path, "status": "locked", "task": cfg.task}
            _write_csv_atomic(manifest_path, list(rows.values()))
            continue
        try:
            _remove_dead_temps(runner.outputs(sid).values())
            rows[sid] = runner.process(path)
        except Exception as e:  # noqa: BLE001 - every failure is recorded; re-raised unless skip_errors
            msg = f"{type(e).__name__}: {e}"
            logger.error("failed on %s: %s", path, msg)
            with open(fail_log, "a") as f:
                f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {path}\n{traceback.format_exc()}\n")
            rows[sid] = {"slide_id": sid, "path": path, "status": "failed", "task": cfg.task, "error": msg[:500]}
            if not cfg.skip_errors:
                first_error = e
        finally:
            lock.release()
        _write_csv_atomic(manifest_path, list(rows.values()))
        if first_error is not None:
            raise first_error
    _write_csv_atomic(manifest_path, list(rows.values()))
    return list(rows.values())


def _parse_shard(s: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", s.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"--shard must look like I/N (e.g. 0/4), got {s!r}")
    return int(m.group(1)), int(m.group(2))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pathology.batch", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slides", required=True, help="folder with slide files")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--task", choices=TASKS, default="all", help="what to compute (default all)")
    p.add_argument("--mpp", type=float, default=0.5, help="target micrometres per pixel of patches (default 0.5 ≈ 20x)")
    p.add_argument("--patch-size", type=int, default=256, help="patch side in pixels at --mpp (default 256)")
    p.add_argument("--min-tissue", type=float, default=0.25, help="minimum tissue fraction of a patch (default 0.25)")
    p.add_argument("--slide-mpp", type=float, default=None, help="µm/px of level 0 for slides whose files lack it")
    p.add_argument("--encoder", default="default", help="patch encoder: default | timm:<name> | open_clip:<name>")
    p.add_argument("--weights", default=None, help="local weights file for the encoder")
    p.add_argument("--shard", type=_parse_shard, default=(0, 1), help="I/N: process slides I, I+N, ... (0-based)")
    p.add_argument("--skip-errors", action="store_true", help="record failed slides and continue")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers reading tiles (default 0)")
    p.add_argument("--batch-size", type=int, default=64, help="patches per encoder batch")
    p.add_argument("--device", default=None, help="encoder device (default cuda if available else cpu)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = BatchConfig(slides=args.slides, out=args.out, task=args.task, mpp=args.mpp, patch_size=args.patch_size,
                      min_tissue=args.min_tissue, slide_mpp=args.slide_mpp, encoder=args.encoder, weights=args.weights,
                      shard=args.shard, skip_errors=args.skip_errors, workers=args.workers,
                      batch_size=args.batch_size, device=args.device, progress=not args.no_progress)
    try:
        rows = run_batch(cfg)
    except Exception as e:  # noqa: BLE001
        logger.error("stopped: %s (use --skip-errors to record failures and continue)", e)
        return 1
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    logger.info("finished: %s", ", ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    return 0 if counts.get("failed", 0) == 0 else 2


if __name__ == "__main__":
    sys.exit(main())
