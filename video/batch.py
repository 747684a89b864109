"""Batch ingestion: one consolidated memory file per video, resumable, shardable.

    python -m video.batch --videos DIR --out DIR [--shard I/N] [--skip-errors]

For each video (sorted by name; shard ``I`` of ``N`` takes every ``N``-th starting at ``I``) it writes
``OUT/<name>.safetensors`` holding the query embeddings of every chunk (``chunk_outputs`` (C, Q, D),
``chunk_times`` (C,)) and, for the ∞-Video methods, each Q-former layer's memory (``layer<i>.coef``
(N, D) basis coefficients and ``layer<i>.density`` (T,), the last attention density), with the reading
settings in the metadata. Writes go to a temp file renamed into place, so a killed run leaves no partial
file; a rerun skips every finished video. A ``.lock`` file (holding the process id) keeps two workers off
the same video; a lock whose process is gone is taken over. ``manifest.csv`` (``manifest_<I>of<N>.csv``
per shard) lists each video's status: ``done``, ``exists`` (done by an earlier run) or ``error``.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["list_videos", "parse_shard", "process_video", "run_batch", "build_parser", "main"]

MANIFEST_FIELDS = ["video", "status", "output", "frames", "chunks", "seconds", "error"]


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def list_videos(folder, shard: tuple[int, int] = (0, 1)) -> list[Path]:
    """Video files directly in ``folder`` (by extension), sorted by name, this shard's share."""
    from video.io import is_video_file

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"videos folder not found: {str(folder)!r}")
    files = sorted(p for p in folder.iterdir() if p.is_file() and is_video_file(p))
    i, n = shard
    return files[i::n]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _acquire(lock: Path) -> bool:
    """Create ``lock`` holding our pid; take over a lock whose process is gone. False if another worker holds it."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or "0")
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _pid_alive(pid):
                return False
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def process_video(iv, path: Path, out_file: Path) -> dict:
    """Ingest one video and write its memory file atomically; returns manifest fields."""
    from safetensors.torch import save_file

    t0 = time.perf_counter()
    mem = iv.ingest(path)
    tensors = {"chunk_outputs": mem.chunk_outputs.contiguous(), "chunk_times": mem.chunk_times.contiguous()}
    for i, c in enumerate(mem.coefficients):
        tensors[f"layer{i}.coef"] = c.contiguous()
    for i, d in enumerate(mem.densities):
        tensors[f"layer{i}.density"] = d.contiguous()
    meta = {
        "video": path.name, "method": mem.method, "num_frames": str(mem.num_frames), "duration": str(mem.duration),
        "frames_read": str(mem.frames_read), "chunk_bounds": json.dumps(mem.chunk_bounds),
        "config": json.dumps(vars(iv.config)), "timings": json.dumps(mem.timings),
    }
    fd, tmp = tempfile.mkstemp(dir=out_file.parent, prefix=f".{out_file.name}.")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=meta)
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_file)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {"frames": mem.frames_read, "chunks": len(mem.chunk_times), "seconds": round(time.perf_counter() - t0, 3)}


def _write_manifest(path: Path, rows: dict[str, dict]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=MANIFEST_FIELDS)
        w.writeheader()
        for name in sorted(rows):
            w.writerow({k: rows[name].get(k, "") for k in MANIFEST_FIELDS})
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def run_batch(videos, out, *, iv=None, shard: tuple[int, int] = (0, 1), skip_errors: bool = False,
              progress: bool = False) -> dict[str, dict]:
    """Process every video of this shard; returns the manifest rows by video name."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = list_videos(videos, shard)
    i, n = shard
    manifest = out / ("manifest.csv" if n == 1 else f"manifest_{i}of{n}.csv")
    rows: dict[str, dict] = {}
    if manifest.exists():
        with open(manifest, newline="") as f:
            rows = {r["video"]: r for r in csv.DictReader(f)}
    if iv is None:
        from video.infinite import InfiniteVideo

        iv = InfiniteVideo()
    it = files
    if progress:
        from tqdm import tqdm

        it = tqdm(files, desc="videos", unit="video")
    for path in it:
        out_file = out / f"{path.stem}.safetensors"
        if out_file.exists():
            if rows.get(path.name, {}).get("status") != "done":
                rows[path.name] = {**rows.get(path.name, {}), "video": path.name, "status": "exists",
                                   "output": out_file.name, "error": ""}
            continue
        lock = out / f"{path.stem}.lock"
        if not _acquire(lock):
            logger.info("%s is being processed by another worker; skipping", path.name)
            continue
        try:
            fields = process_video(iv, path, out_file)
            rows[path.name] = {"video": path.name, "status": "done", "output": out_file.name, "error": "", **fields}
        except Exception as e:
            rows[path.name] = {"video": path.name, "status": "error", "output": "", "error": f"{type(e).__name__}: {e}"[:500]}
            _write_manifest(manifest, rows)
            if not skip_errors:
                raise
            logger.warning("failed on %s: %s", path.name, e)
        finally:
            lock.unlink(missing_ok=True)
        _write_manifest(manifest, rows)
    _write_manifest(manifest, rows)
    return rows


def build_parser() -> argparse.ArgumentParser:
    from video.infinite import METHODS

    p = argparse.ArgumentParser(prog="python -m video.batch", description=__doc__.split("\n\n")[0])
    p.add_argument("--videos", required=True, help="folder of video files")
    p.add_argument("--out", required=True, help="output folder (one .safetensors per video + manifest)")
    p.add_argument("--shard", default="0/1", help="I/N: process every N-th video starting at I")
    p.add_argument("--skip-errors", action="store_true", help="record a failing video in the manifest and go on")
    p.add_argument("--weights", default=None, help="model weights (default: the shipped model)")
    p.add_argument("--method", default="infinite", choices=METHODS, help="how each video is read")
    p.add_argument("--chunk-size", type=int, default=32, help="frames per chunk")
    p.add_argument("--fps", type=float, default=None, help="read rate in frames/s (default: every frame)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        shard = parse_shard(args.shard)
    except ValueError as e:
        raise SystemExit(str(e))
    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    iv = InfiniteVideo(args.weights, InfiniteVideoConfig(method=args.method, chunk_size=args.chunk_size, fps=args.fps),
                       device=args.device)
    rows = run_batch(args.videos, args.out, iv=iv, shard=shard, skip_errors=args.skip_errors, progress=True)
    counts = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    logger.info("finished: %s", counts)
    return 1 if counts.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
