"""∞-Video: answer questions about a video of any length with a Q-former trained on short clips.

The video is streamed chunk by chunk (:class:`video.io.VideoStream`); each chunk's frames are encoded
and read by the Q-former, whose cross-attention layers mix ordinary attention over the chunk with
continuous attention over a long-term memory (:class:`core.continuous.ContinuousMemory`, one per layer)
that is consolidated at every chunk. Memory use does not grow with the video's length.

Peers run through the same code path and the same weights (``method``):

- ``uniform``: subsample the whole video to the training length and read it as one chunk.
- ``chunks``: read every chunk without memory (alpha = 1), the chunk-by-chunk baseline.
- ``infinite``: the continuous long-term memory with sticky resampling.
- ``infinite_nosticky``: the same with evenly spaced resampling.
- ``moviechat``: MovieChat-style merging: keep a buffer of frames, merge the most similar adjacent
  pair (cosine of mean frame tokens) whenever it exceeds the training length, read the result at the end.

    from video import InfiniteVideo
    iv = InfiniteVideo()                      # shipped small model
    mem = iv.ingest("video.mp4")              # streams the file
    iv.answer(mem, "first")                   # -> ("red", {answer: prob})
    times, mass = iv.density_over_time(mem)   # attention over the video's time, for plots
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.continuous import ContinuousMemory, ContinuousMemoryConfig
from video.io import VideoStream
from video.model import AGGREGATES, VideoQAModel, question_tensor
from video.synthetic import ANSWERS, COLOURS, QUESTION_TYPES, Question

logger = logging.getLogger(__name__)

__all__ = ["METHODS", "InfiniteVideoConfig", "VideoMemory", "InfiniteVideo", "default_weights_path", "parse_question"]

METHODS = ("uniform", "chunks", "infinite", "infinite_nosticky", "moviechat")


def default_weights_path() -> Path:
    """The shipped model (trained by ``python -m video.train``)."""
    return Path(__file__).resolve().parent / "weights" / "videoqa_tiny.safetensors"


@dataclass(kw_only=True)
class InfiniteVideoConfig:
    """How a video is read."""

    method: str = "infinite"  # one of METHODS
    chunk_size: int = 32  # frames per chunk (the model was trained on 16-32 frame clips)
    fps: float | None = None  # read rate in frames/s; None = every frame of the file
    alpha: float = 0.75  # weight of the short-term (current chunk) attention; 1 - alpha on the memory
    num_basis: int = 64  # basis functions of each layer's memory
    basis: str = "box"  # "box" or "gaussian"
    ridge: float = 0.5  # ridge penalty of the memory fit
    tau: float = 0.75  # old memory squeezed into (0, tau] at each consolidation
    num_samples: int = 512  # positions of the old signal resampled per consolidation
    num_bins: int = 128  # density histogram bins for sticky resampling
    num_points: int = 1000  # integration points of the continuous attention
    num_frames: int = 32  # frames kept by "uniform" and "moviechat" (the training length)
    aggregate: str = "attention"  # how the answer head pools chunk outputs: "attention", "mean" or "last" chunk only
    max_frames: int | None = None  # stop reading after this many frames
    seed: int = 0  # sticky draws

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if self.chunk_size < 1 or self.num_frames < 1:
            raise ValueError(f"chunk_size ({self.chunk_size}) and num_frames ({self.num_frames}) must be >= 1")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {self.aggregate!r}")

    def memory_config(self) -> ContinuousMemoryConfig:
        return ContinuousMemoryConfig(num_basis=self.num_basis, basis=self.basis, ridge=self.ridge, tau=self.tau,
                                      num_samples=self.num_samples, sticky=self.method == "infinite",
                                      num_bins=self.num_bins, num_points=self.num_points)


@dataclass
class VideoMemory:
    """What ingesting one video leaves: enough to answer any question without reading it again."""

    path: str
    method: str
    num_frames: int  # frames in the file
    duration: float  # seconds
    frames_read: int  # frames decoded and encoded
    chunk_outputs: torch.Tensor  # (C, Q, D) query outputs per chunk
    chunk_times: torch.Tensor  # (C,) centre of each chunk in [0, 1] of the video
    chunk_bounds: list[tuple[float, float]] = field(default_factory=list)  # each chunk's [start, end) in [0, 1]
    coefficients: list[torch.Tensor] = field(default_factory=list)  # per layer (N, D), infinite methods only
    densities: list[torch.Tensor] = field(default_factory=list)  # per layer (T,), last chunk's density
    tau: float = 0.75
    timings: dict[str, float] = field(default_factory=dict)  # seconds: decode, encode, memory
    peak_frames_held: int = 0  # most decoded frames held at once


def parse_question(question, arg1: int | str = -1, arg2: int | str = -1) -> torch.Tensor:
    """A :class:`Question`, or a question type name with colour arguments (names or indices) -> ``(1, 3)``."""
    if isinstance(question, Question):
        return question_tensor([question])

    def colour(c) -> int:
        if isinstance(c, str):
            if c not in COLOURS:
                raise ValueError(f"unknown colour {c!r}; choose one of {list(COLOURS)}")
            return COLOURS.index(c)
        if not -1 <= int(c) < len(COLOURS):
            raise ValueError(f"colour index must lie in [-1, {len(COLOURS) - 1}], got {c}")
        return int(c)

    if question not in QUESTION_TYPES:
        raise ValueError(f"unknown question type {question!r}; choose one of {list(QUESTION_TYPES)}")
    a1, a2 = colour(arg1), colour(arg2)
    if question in ("count", "exists", "order") and a1 < 0:
        raise ValueError(f"a {question!r} question needs a colour argument")
    if question == "order" and a2 < 0:
        raise ValueError("an 'order' question needs two colours")
    return torch.tensor([[QUESTION_TYPES.index(question), a1 + 1, a2 + 1]], dtype=torch.long)


class InfiniteVideo:
    """Read videos of any length with a short-clip video QA model and answer questions about them.

    Args:
        model: a :class:`VideoQAModel`, a path to weights, or None for the shipped model.
        config: how videos are read (method, chunk size, memory settings).
        device: torch device (None = CUDA if available, else CPU).
    """

    def __init__(self, model: VideoQAModel | str | Path | None = None, config: InfiniteVideoConfig | None = None,
                 *, device=None) -> None:
        from video.train import load_model

        if model is None or isinstance(model, (str, Path)):
            path = Path(model) if model is not None else default_weights_path()
            if not path.is_file():
                raise FileNotFoundError(f"model weights not found: {str(path)!r}; train them with python -m video.train")
            model = load_model(path)
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.config = config or InfiniteVideoConfig()

    # -- reading -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def _encode(self, frames: np.ndarray, indices: np.ndarray, num_frames: int) -> torch.Tensor:
        x = torch.from_numpy(frames).to(self.device)[None]  # (1, L, H, W, 3)
        t = torch.from_numpy((indices.astype(np.float32) + 0.5) / num_frames).to(self.device)[None]  # (1, L)
        return self.model.encode_frames(x, t)  # (1, L, T, D)

    @torch.no_grad()
    def ingest(self, path, *, progress: bool = False) -> VideoMemory:
        """Stream a video file and keep what is needed to answer questions (see :class:`VideoMemory`)."""
        cfg = self.config
        stream = VideoStream(path, fps=cfg.fps, chunk_size=cfg.chunk_size, max_frames=cfg.max_frames)
        n_total = stream.info.num_frames
        timings = {"decode": 0.0, "encode": 0.0, "memory": 0.0}
        if cfg.method == "uniform":
            pick = np.linspace(0, stream.num_selected - 1, min(cfg.num_frames, stream.num_selected)).round()
            stream.indices = stream.indices[np.unique(pick.astype(np.int64))]
            stream.chunk_size = len(stream.indices)
        use_memory = cfg.method in ("infinite", "infinite_nosticky") and cfg.alpha < 1.0
        memories = None
        if use_memory:
            memories = [ContinuousMemory(cfg.memory_config(), seed=cfg.seed) for _ in self.model.blocks]
        outs, ctimes, bounds, densities = [], [], [], []
        merged = None  # moviechat buffer: tokens (n, T, D), features (n, D), times (n,), weights (n,)
        peak = 0
        it = iter(stream)
        if progress:
            from tqdm import tqdm

            it = tqdm(it, total=len(stream), desc=Path(path).name, unit="chunk")
        t0 = time.perf_counter()
        for chunk in it:
            t1 = time.perf_counter()
            timings["decode"] += t1 - t0
            peak = max(peak, len(chunk.frames))
            tok = self._encode(chunk.frames, chunk.indices, n_total)  # (1, L, T, D)
            t2 = time.perf_counter()
            timings["encode"] += t2 - t1
            lo = float(chunk.indices[0]) / n_total
            hi = float(chunk.indices[-1] + 1) / n_total
            times = torch.from_numpy((chunk.indices.astype(np.float32) + 0.5) / n_total)
            if cfg.method == "moviechat":
                merged = _moviechat_merge(merged, tok[0], times, cfg.num_frames)
            else:
                record = [] if use_memory else None
                outs.append(self.model.read_chunk(tok, memories=memories, alpha=cfg.alpha, record=record)[0])
                ctimes.append(float(times.mean()))
                bounds.append((lo, hi))
                if record:
                    densities = [d[0] for d in record]
            t0 = time.perf_counter()
            timings["memory"] += t0 - t2
        if cfg.method == "moviechat" and merged is not None:
            t2 = time.perf_counter()
            tokens, _, mtimes, _ = merged
            outs.append(self.model.read_chunk(tokens[None])[0])
            ctimes.append(float(mtimes.mean()))
            bounds.append((0.0, 1.0))
            timings["memory"] += time.perf_counter() - t2
        return VideoMemory(
            path=str(path), method=cfg.method, num_frames=n_total, duration=stream.info.duration,
            frames_read=stream.num_selected, chunk_outputs=torch.stack(outs).cpu(),
            chunk_times=torch.tensor(ctimes), chunk_bounds=bounds,
            coefficients=[m.coef[0].cpu() for m in memories] if memories else [],
            densities=[d.cpu() for d in densities], tau=cfg.tau, timings=timings, peak_frames_held=peak,
        )

    # -- answering -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def answer(self, memory: VideoMemory, question, arg1: int | str = -1, arg2: int | str = -1) -> tuple[str, dict]:
        """Answer a question about an ingested video; returns the answer and the probability of each answer."""
        q = parse_question(question, arg1, arg2).to(self.device)
        logits = self.model.answer(memory.chunk_outputs[None].to(self.device), q, memory.chunk_times[None].to(self.device),
                                   aggregate=self.config.aggregate)[0]
        probs = logits.float().softmax(-1).cpu()
        return ANSWERS[int(probs.argmax())], {a: float(p) for a, p in zip(ANSWERS, probs)}

    def ask(self, path, question, arg1: int | str = -1, arg2: int | str = -1) -> str:
        """Ingest ``path`` and answer one question."""
        return self.answer(self.ingest(path), question, arg1, arg2)[0]

    @staticmethod
    def density_over_time(memory: VideoMemory, num_bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
        """Where the last chunk's continuous attention fell, mapped back onto the video's time axis.

        Memory position ``s`` maps to video time through the consolidation history: the last chunk fills
        ``(tau, 1]``, the one before ``(tau^2, tau]`` and so on (each old position was multiplied by
        ``tau`` at every later consolidation), the first chunk ``(0, tau^(C-1)]``.

        Returns:
            ``(times_s, mass)``: bin centres in seconds and the attention mass in each of ``num_bins``
            equal bins of the video (sums to 1; averaged over layers).
        """
        if not memory.densities:
            raise ValueError(f"method {memory.method!r} keeps no continuous memory; use 'infinite' or 'infinite_nosticky'")
        dens = torch.stack(memory.densities).float().mean(0).numpy()  # (T,)
        T = dens.shape[0]
        s = np.linspace(0, 1, T)
        w = np.full(T, 1.0 / (T - 1))
        w[0] = w[-1] = 0.5 / (T - 1)
        mass = dens * w
        C, tau = len(memory.chunk_bounds), memory.tau
        # chunk k from the end covers (tau^(k+1), tau^k]; the first chunk covers (0, tau^(C-1)]
        k = np.where(s > 0, np.floor(np.log(np.maximum(s, 1e-300)) / np.log(tau)), C - 1)
        k = np.minimum(k, C - 1).astype(int)
        upper = tau**k
        lower = np.where(k == C - 1, 0.0, tau ** (k + 1))
        frac = np.clip((s - lower) / np.maximum(upper - lower, 1e-12), 0, 1)
        bounds = np.asarray(memory.chunk_bounds)  # (C, 2)
        lo, hi = bounds[C - 1 - k, 0], bounds[C - 1 - k, 1]
        t_video = lo + frac * (hi - lo)  # in [0, 1]
        hist = np.bincount(np.clip((t_video * num_bins).astype(int), 0, num_bins - 1), weights=mass, minlength=num_bins)
        hist = hist / max(hist.sum(), 1e-12)
        centres = (np.arange(num_bins) + 0.5) / num_bins * memory.duration
        return centres, hist


def _moviechat_merge(state, tok_LTD: torch.Tensor, times_L: torch.Tensor, capacity: int):
    """Append frames to the MovieChat-style buffer, then merge the most similar adjacent pairs down to ``capacity``.

    Frames are compared by the cosine similarity of their mean tokens; a merged frame is the
    count-weighted average of the pair (tokens and time).
    """
    feats = tok_LTD.mean(1)  # (L, D)
    weights = torch.ones(len(times_L))
    if state is None:
        tokens, f, t, w = tok_LTD, feats, times_L, weights
    else:
        tokens = torch.cat([state[0], tok_LTD])
        f = torch.cat([state[1], feats])
        t = torch.cat([state[2], times_L])
        w = torch.cat([state[3], weights])
    while len(t) > capacity:
        sim = torch.nn.functional.cosine_similarity(f[:-1], f[1:], dim=-1)  # (n-1,)
        i = int(sim.argmax())
        a, b = w[i], w[i + 1]
        wa = (a / (a + b)).to(tokens.dtype)
        tokens = torch.cat([tokens[:i], (wa * tokens[i] + (1 - wa) * tokens[i + 1])[None], tokens[i + 2:]])
        f = torch.cat([f[:i], (wa * f[i] + (1 - wa) * f[i + 1])[None], f[i + 2:]])
        t = torch.cat([t[:i], ((a * t[i] + b * t[i + 1]) / (a + b))[None], t[i + 2:]])
        w = torch.cat([w[:i], (a + b)[None], w[i + 2:]])
    return tokens, f, t, w
