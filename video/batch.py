"""Batch ingestion: one consolidated memory file per video, resumable, shardable.

    python -m video.batch --videos DIR --out DIR [--shard I/N] [--skip-errors] [--overwrite] [--time-limit S]
    python -m video.batch --model hf:DIR --videos DIR --out DIR [--prompt TEXT] [--max-new-tokens N] [--alpha A]

For each video (sorted by name; shard ``I`` of ``N`` takes every ``N``-th starting at ``I``) it writes
``OUT/<file name>.safetensors`` (``a.mp4.safetensors``: ``a.mp4`` and ``a.mkv`` do not collide) holding the
query embeddings of every chunk (``chunk_outputs`` (C, Q, D), ``chunk_times`` (C,)) and, for the ∞-Video methods,
each Q-former layer's memory (``layer<i>.coef`` (N, D) basis coefficients and ``layer<i>.density`` (T,), the last
attention density), with the reading settings in the metadata.

With ``--model hf:DIR`` (a local transformers InstructBLIP-Video, :mod:`video.hf`) the Q-former reads ``--prompt``
as its instruction and each file holds ``features`` (the LLM inputs, mean over chunks, ``(F * Q, D_llm)``) and each
cross-attention layer's memory (``layer<i>.coef``, ``layer<i>.density``); ``--max-new-tokens N`` also generates the
answer to the prompt (metadata ``answer``).

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

from core.infra.cli import UsageError, capped_int, fraction, nonempty_path, positive_float, run_cli
from core.infra.fileio import check_writable
from core.infra.guard import check_outputs
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
    """Video files directly in ``folder`` (by extension), sorted by name, this shard's share; a link to a missing
    file is listed (it fails, with a manifest row, rather than vanishing)."""
    from video.io import is_video_file

    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"videos folder not found: {str(folder)!r}")
    files = sorted(p for p in folder.iterdir() if (p.is_file() or p.is_symlink()) and is_video_file(p))
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


class _HFVideoJob(_VideoJob):
    """The per-video work with a transformers Q-former video-LLM (:class:`video.hf.InfiniteVideoLM`)."""

    extra_fields = ("frames", "chunks")

    def __init__(self, lm, out: Path, prompt: str, max_new_tokens: int):
        super().__init__(lm, out)
        self.prompt, self.max_new_tokens = prompt, max_new_tokens

    def run_settings(self) -> dict:
        if self._settings is None:
            self._settings = {**self.iv.settings(), "prompt": self.prompt, "max_new_tokens": self.max_new_tokens}
        return self._settings

    def process(self, item: Item) -> dict:
        from safetensors.torch import save_file

        res = self.iv.ingest(item.path, [self.prompt])
        tensors = {"features": res.features[0].float().contiguous().cpu()}
        for i, c in enumerate(res.coefficients or []):
            tensors[f"layer{i}.coef"] = c[0].contiguous()
        for i, d in enumerate(res.densities or []):
            tensors[f"layer{i}.density"] = d[0].contiguous()
        meta = {"video": Path(item.path).name, "method": res.method, "num_frames": str(res.num_frames),
                "frames_read": str(res.frames_read), "chunks": str(res.num_chunks), "prompt": self.prompt}
        if self.max_new_tokens:
            ids = self.iv.generate(res.features[0], self.prompt, max_new_tokens=self.max_new_tokens)
            meta["answer"] = self.iv.tokenizer.decode(ids, skip_special_tokens=True).strip()
        settings = self.run_settings()
        meta["settings"] = json.dumps(canonical_settings(settings), sort_keys=True)
        meta["settings_fingerprint"] = settings_fingerprint(settings)
        with atomic_write(Path(self.outputs(item)[0])) as tmp:
            save_file(tensors, tmp, metadata=meta)
        return {"frames": res.frames_read, "chunks": res.num_chunks}


def _run(videos, cfg: JobConfig, iv, job=None) -> dict[str, dict]:
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    items = [Item(key=p.name, path=str(p)) for p in list_videos(videos)]
    if iv is None:
        from video.infinite import InfiniteVideo

        iv = InfiniteVideo()
    return run_job(job or _VideoJob(iv, Path(cfg.out)), items, cfg)


#: the most frames per chunk (a chunk's frames are decoded and encoded together)
MAX_CHUNK = 4096
#: read rates accepted by --fps: from one frame per 1000 s to 1000 frames/s (no camera records faster; above the
#: file's own rate frames repeat)
MIN_FPS, MAX_FPS = 0.001, 1000.0


def fps_arg(text: str) -> float:
    """An argparse type: a read rate in frames per second in [:data:`MIN_FPS`, :data:`MAX_FPS`]."""
    value = positive_float(text)
    if not MIN_FPS <= value <= MAX_FPS:
        raise argparse.ArgumentTypeError(f"must be frames per second in [{MIN_FPS:g}, {MAX_FPS:g}], got {value:g}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from video.infinite import METHODS

    p = batch_parser("python -m video.batch", __doc__)
    p.add_argument("--videos", required=True, type=nonempty_path, help="folder of video files")
    p.add_argument("--out", type=nonempty_path, required=True, help="output folder (one .safetensors per video + manifest)")
    p.add_argument("--weights", default=None, help="model weights (default: the shipped model)")
    p.add_argument("--model", default=None, type=nonempty_path,
                   help="hf:DIR for a local transformers InstructBLIP-Video folder (free-text prompt, see --prompt); "
                        "a weights file is the same as --weights")
    p.add_argument("--method", default="infinite", choices=METHODS, help="how each video is read")
    p.add_argument("--chunk-size", type=capped_int(MAX_CHUNK, why="frames held in memory at once"), default=None,
                   help="frames per chunk (default 32; with hf: the model's clip length, 4)")
    p.add_argument("--alpha", type=fraction, default=0.75, help="weight of the chunk's own attention; 1 - alpha on the memory (default 0.75)")
    p.add_argument("--prompt", default="Describe what happens in the video.",
                   help="instruction the Q-former reads (hf: only)")
    p.add_argument("--max-new-tokens", type=capped_int(4096, minimum=0, why="tokens of one answer"), default=0,
                   help="also generate the answer to --prompt with this many tokens (hf: only; 0 = no text)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"], help="hf: model dtype")
    p.add_argument("--fps", type=fps_arg, default=None, help="read rate in frames/s (default: every frame)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    add_job_arguments(p, item="video")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    check_outputs([("--out", args.out)], inputs=[args.videos, args.weights, args.model])
    from video.infinite import InfiniteVideo, InfiniteVideoConfig

    # Bad options, a missing videos folder and files made with other settings are bad usage or input: one line,
    # exit 2 (run_cli), before any work. A video that fails stops the run (exit 1) unless --skip-errors.
    from video.hf import HF_METHODS, parse_hf_spec

    hf_dir = parse_hf_spec(args.model) if args.model else None
    if args.model and hf_dir is None:
        if args.weights:
            raise UsageError("give the toy model's weights with --weights or --model, not both")
        args.weights = args.model
    if hf_dir is not None and args.method not in HF_METHODS:
        raise UsageError(f"--method {args.method} is not available with --model hf:; choose one of {list(HF_METHODS)}")
    if hf_dir is None and (args.max_new_tokens or args.dtype):
        raise UsageError("--max-new-tokens and --dtype apply to --model hf:DIR only")
    list_videos(args.videos)
    check_writable(args.out, what="--out", folder=True)
    job = None
    if hf_dir is not None:
        from video.hf import HFVideoConfig, InfiniteVideoLM

        iv = InfiniteVideoLM.from_hf(hf_dir, config=HFVideoConfig(method=args.method, chunk_size=args.chunk_size,
                                                                  fps=args.fps, alpha=args.alpha),
                                     device=args.device, dtype=args.dtype)
        job = _HFVideoJob(iv, Path(args.out), args.prompt, args.max_new_tokens)
    else:
        iv = InfiniteVideo(args.weights, InfiniteVideoConfig(method=args.method, chunk_size=args.chunk_size or 32,
                                                             fps=args.fps, alpha=args.alpha), device=args.device)
    try:
        rows = _run(args.videos, job_config_from_args(args, args.out, desc="videos"), iv, job)
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
