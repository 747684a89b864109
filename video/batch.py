"""Batch ingestion: one consolidated memory file per video, resumable, shardable.

    python -m video.batch --videos DIR --out DIR [--shard I/N] [--skip-errors] [--overwrite] [--time-limit S]

For each video (sorted by name; shard ``I`` of ``N`` takes every ``N``-th starting at ``I``) it writes
``OUT/<file name>.safetensors`` (``a.mp4.safetensors``: ``a.mp4`` and ``a.mkv`` do not collide) holding the
query embeddings of every chunk (``chunk_outputs`` (C, Q, D), ``chunk_times`` (C,)) and, for the ∞-Video methods,
each Q-former layer's memory (``layer<i>.coef`` (N, D) basis coefficients and ``layer<i>.density`` (T,), the last
attention density), with the reading settings in the metadata.

Settings: each file's metadata holds ``settings`` (JSON) and ``settings_fingerprint``: every reading setting
(method, chunk size, fps, memory settings, ...) and the model's identity (its config, frame encoder included, and
a SHA-256 digest of its weights). A rerun whose settings differ from an existing file's refuses before any work
and names the differences; ``--overwrite`` redoes those files, or choose a new ``--out``.

Writes go to a temp file renamed into place, so a killed run leaves no partial file; a rerun skips every finished
video. ``OUT/locks/<file name>.lock`` keeps two workers (on any host sharing the folder) off the same video.
``--time-limit`` runs each video in a worker process killed past the limit (recorded as failed). ``manifest.csv``
(``manifest_<I>of<N>.csv`` per shard) lists each video's status: ``done``, ``exists`` (done by an earlier run),
``failed`` or ``locked``. The job machinery is :mod:`core.infra.jobs`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import time
from pathlib import Path

from core.infra.cli import nonempty_path, positive_float, positive_int, run_cli
from core.infra.fileio import check_writable
from core.infra.jobs import (
    Item,
    JobConfig,
    SettingsMismatch,
    add_job_arguments,
    atomic_write,
    batch_parser,
    canonical_settings,
    job_config_from_args,
    parse_shard,
    run_job,
    settings_fingerprint,
)

logger = logging.getLogger(__name__)

__all__ = ["list_videos", "parse_shard", "model_settings", "process_video", "run_batch", "build_parser", "main"]


def list_videos(folder, shard: tuple[int, int] = (0, 1)) -> list[Path]:
    """Video files directly in ``folder`` (by extension), sorted by name, this shard's share."""
    from video.io import is_video_file

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"videos folder not found: {str(folder)!r}")
    files = sorted(p for p in folder.iterdir() if p.is_file() and is_video_file(p))
    i, n = shard
    return files[i::n]


def model_settings(model) -> dict:
    """The model's identity: its config (frame encoder included) and a SHA-256 digest of its weights."""
    import torch

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    cfg = getattr(model, "config", None)
    return {"config": dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else None,
            "weights_sha256": h.hexdigest()}


def process_video(iv, path: Path, out_file: Path, *, settings: dict | None = None) -> dict:
    """Ingest one video and write its memory file atomically (with ``settings`` in its metadata); returns manifest
    fields."""
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
    if settings is not None:
        meta["settings"] = json.dumps(canonical_settings(settings), sort_keys=True)
        meta["settings_fingerprint"] = settings_fingerprint(settings)
    with atomic_write(out_file) as tmp:
        save_file(tensors, tmp, metadata=meta)
    return {"frames": mem.frames_read, "chunks": len(mem.chunk_times), "seconds": round(time.perf_counter() - t0, 3)}


class _VideoJob:
    """The per-video work of a batch run (a :class:`core.infra.jobs.Job`)."""

    key_field = "video"
    extra_fields = ("frames", "chunks")

    def __init__(self, iv, out: Path):
        self.iv, self.out = iv, Path(out)
        self._settings: dict | None = None

    def outputs(self, item: Item) -> list[str]:
        return [str(self.out / f"{item.key}.safetensors")]

    def run_settings(self) -> dict:
        if self._settings is None:
            self._settings = {"reader": vars(self.iv.config), "model": model_settings(self.iv.model)}
        return self._settings

    def settings(self, item: Item) -> dict[str, dict]:
        return {self.outputs(item)[0]: self.run_settings()}

    def stored_settings(self, path: str) -> dict | None:
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt") as f:
                text = (f.metadata() or {}).get("settings")
            return json.loads(text) if text else None
        except Exception:  # noqa: BLE001 - an unreadable file holds no record: it is refused, or redone
            return None

    def process(self, item: Item) -> dict:
        fields = process_video(self.iv, Path(item.path), Path(self.outputs(item)[0]), settings=self.run_settings())
        return {k: v for k, v in fields.items() if k != "seconds"}


def run_batch(videos, out, *, iv=None, shard: tuple[int, int] = (0, 1), skip_errors: bool = False,
              overwrite: bool = False, time_limit: float | None = None, stale_after: float = 600.0,
              progress: bool = False) -> dict[str, dict]:
    """Process every video of this shard; returns the manifest rows by video file name.

    Raises :class:`core.infra.jobs.SettingsMismatch` before any work when existing files were made with other settings
    (unless ``overwrite``), and the first failure unless ``skip_errors``.
    """
    cfg = JobConfig(out=str(out), shard=shard, skip_errors=skip_errors, overwrite=overwrite, time_limit=time_limit,
                    stale_after=stale_after, heartbeat=min(30.0, stale_after / 4), progress=progress, desc="videos")
    return _run(videos, cfg, iv)


def _run(videos, cfg: JobConfig, iv) -> dict[str, dict]:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    items = [Item(key=p.name, path=str(p)) for p in list_videos(videos)]
    if iv is None:
        from video.infinite import InfiniteVideo

        iv = InfiniteVideo()
    return run_job(_VideoJob(iv, Path(cfg.out)), items, cfg)


def build_parser() -> argparse.ArgumentParser:
    from video.infinite import METHODS

    p = batch_parser("python -m video.batch", __doc__)
    p.add_argument("--videos", required=True, type=nonempty_path, help="folder of video files")
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder (one .safetensors per video + manifest)")
    p.add_argument("--weights", default=None, help="model weights (default: the shipped model)")
    p.add_argument("--method", default="infinite", choices=METHODS, help="how each video is read")
    p.add_argument("--chunk-size", type=positive_int, default=32, help="frames per chunk")
    p.add_argument("--fps", type=positive_float, default=None, help="read rate in frames/s (default: every frame)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_job_arguments(p, item="video")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    # Bad options, a missing videos folder and files made with other settings are bad usage or input: one line,
    # exit 2 (run_cli), before any work. A video that fails stops the run (exit 1) unless --skip-errors.
    list_videos(args.videos)
    check_writable(args.out, what="--out", folder=True)
    iv = InfiniteVideo(args.weights, InfiniteVideoConfig(method=args.method, chunk_size=args.chunk_size, fps=args.fps),
                       device=args.device)
    try:
        rows = _run(args.videos, job_config_from_args(args, args.out, desc="videos"), iv)
    except SettingsMismatch:
        raise
    except Exception as e:  # noqa: BLE001
        logger.error("stopped: %s (use --skip-errors to record failures and continue)", e)
        return 1
    counts: dict[str, int] = {}
    for r in rows.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    logger.info("finished: %s", counts)
    return 1 if counts.get("failed") else 0  # 1: some videos failed (recorded in the manifest)


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
