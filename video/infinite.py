"""∞-Video: answer questions about a video of any length with a Q-former trained on short clips.

The video is streamed chunk by chunk (:class:`video.io.VideoStream`); each chunk's frames are encoded
and read by the Q-former, whose cross-attention layers mix ordinary attention over the chunk with
continuous attention over a long-term memory (:class:`core.continuous.ContinuousMemory`, one per layer)
that is consolidated at every chunk. Memory use does not grow with the video's length.

Peers run through the same code path and the same weights (``method``); the answer head reads a
fixed-size output (``aggregate``: the last read's queries, or their mean over reads) for all of them:

- ``uniform``: subsample the whole video to ``num_frames`` frames (an equal budget: as many frames as
  the memory has basis functions) and read them as one chunk.
- ``chunks``: read every chunk without memory (alpha = 1), the chunk-by-chunk baseline.
- ``infinite``: the continuous long-term memory with sticky resampling.
- ``infinite_nosticky``: the same with evenly spaced resampling.
- ``moviechat``: MovieChat's memory: a short-term buffer of ``moviechat_short`` frames; when it is full,
  its most similar adjacent frames (cosine of mean frame tokens) are merged until ``moviechat_merge``
  remain, which join a long-term memory of at most ``moviechat_long`` frames (merged the same way when
  over); long-term plus short-term frames are read as one chunk at the end.

Reading is a small state machine (:meth:`InfiniteVideo.start`, :meth:`~InfiniteVideo.feed`,
:meth:`~InfiniteVideo.finish`) so that one decoded and encoded stream can feed several methods at once
(the benchmark does); :meth:`InfiniteVideo.ingest` streams a file through it.

    from video import InfiniteVideo
    iv = InfiniteVideo()                      # shipped small model
    mem = iv.ingest("video.mp4")              # streams the file
    iv.answer(mem, "first")                   # -> ("green", {answer: prob})
    times, mass = iv.density_over_time(mem)   # attention over the video's time, for plots
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from core.continuous import ContinuousMemory, ContinuousMemoryConfig, check_basis_coverage
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
    num_basis: int | None = None  # basis functions of each layer's memory; None = chunk_size: one per frame of a
    # chunk (Video-LLaMA's 256 frames / 256 functions ratio), so every function gets frames from the first chunk on
    basis: str = "box"  # "box" or "gaussian"
    ridge: float = 0.5  # ridge penalty of the memory fit
    tau: float = 0.75  # old memory squeezed into (0, tau] at each consolidation
    num_samples: int = 512  # positions of the old signal resampled per consolidation
    num_bins: int = 128  # density histogram bins for sticky resampling
    num_points: int = 1000  # integration points of the continuous attention
    num_frames: int = 32  # frames kept by "uniform" (the benchmark sets it to num_basis: an equal budget)
    moviechat_short: int = 18  # MovieChat's short-term buffer, frames
    moviechat_merge: int = 2  # frames a full short-term buffer is merged down to before joining the long-term memory
    moviechat_long: int = 256  # MovieChat's long-term memory, frames
    aggregate: str | None = None  # answer read-out: "last" chunk or "mean" over chunks (fixed size), "attention"
    # over every chunk (grows with the video); None = what the model was trained with (its card), else "last"
    max_frames: int | None = None  # stop reading after this many frames
    seed: int = 0  # sticky draws

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {self.method!r}")
        if self.chunk_size < 1 or self.num_frames < 1:
            raise ValueError(f"chunk_size ({self.chunk_size}) and num_frames ({self.num_frames}) must be >= 1")
        if self.num_basis is not None and self.num_basis < 1:
            raise ValueError(f"num_basis must be >= 1 or None (the chunk size), got {self.num_basis}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.aggregate is not None and self.aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {self.aggregate!r}")
        if not 1 <= self.moviechat_merge < self.moviechat_short or self.moviechat_long < self.moviechat_merge:
            raise ValueError(f"MovieChat sizes need 1 <= merge ({self.moviechat_merge}) < short "
                             f"({self.moviechat_short}) and long ({self.moviechat_long}) >= merge")

    @property
    def basis_count(self) -> int:
        """The memory's basis functions: ``num_basis``, else the chunk size."""
        return self.num_basis or self.chunk_size

    def memory_config(self) -> ContinuousMemoryConfig:
        return ContinuousMemoryConfig(num_basis=self.basis_count, basis=self.basis, ridge=self.ridge, tau=self.tau,
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
    sources: list[torch.Tensor] = field(default_factory=list)  # per layer (T,): video time in [0, 1] held at each point


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

    @classmethod
    def from_hf(cls, path, config=None, **kwargs):
        """A local transformers InstructBLIP-Video folder read with the ∞-Video memory, answering in free text:
        a :class:`video.hf.InfiniteVideoLM` (``config``: :class:`video.hf.HFVideoConfig`; ``kwargs``: ``device``,
        ``dtype``, ``attn``)."""
        from video.hf import InfiniteVideoLM

        return InfiniteVideoLM.from_hf(path, config=config, **kwargs)

    @property
    def aggregate(self) -> str:
        """The answer read-out in use: the config's, else the one the model was trained with."""
        return self.config.aggregate or getattr(self.model.config, "readout", "last")

    # -- reading -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def encode(self, frames: np.ndarray, indices: np.ndarray, num_frames: int) -> torch.Tensor:
        """Frames ``(L, H, W, 3)`` uint8 at file indices ``indices`` of a ``num_frames`` video -> tokens ``(1, L, T, D)``."""
        x = torch.from_numpy(frames).to(self.device)[None]  # (1, L, H, W, 3)
        t = torch.from_numpy((indices.astype(np.float32) + 0.5) / num_frames).to(self.device)[None]  # (1, L)
        return self.model.encode_frames(x, t)  # (1, L, T, D)

    def uniform_picks(self, selected: np.ndarray) -> np.ndarray:
        """The file indices ``uniform`` keeps out of the ``selected`` ones: ``num_frames`` evenly spread."""
        pick = np.linspace(0, len(selected) - 1, min(self.config.num_frames, len(selected))).round()
        return selected[np.unique(pick.astype(np.int64))]

    def start(self, path, num_frames: int, duration: float, selected: np.ndarray) -> "_ReadState":
        """Begin reading a video of ``num_frames`` frames of which the file indices ``selected`` will be fed."""
        cfg = self.config
        state = _ReadState(path=str(path), num_frames=num_frames, duration=duration, frames_read=len(selected))
        if cfg.method == "uniform":
            state.keep = self.uniform_picks(np.asarray(selected))
            state.frames_read = len(state.keep)
        if cfg.method in ("infinite", "infinite_nosticky") and cfg.alpha < 1.0:
            check_basis_coverage(cfg.memory_config(), cfg.chunk_size, where="InfiniteVideoConfig")
            state.memories = [ContinuousMemory(cfg.memory_config(), seed=cfg.seed) for _ in self.model.blocks]
        return state

    @torch.no_grad()
    def feed(self, state: "_ReadState", tok_1LTD: torch.Tensor, indices: np.ndarray) -> None:
        """Read one chunk: its tokens (:meth:`encode`) and file indices."""
        cfg = self.config
        times = torch.from_numpy((indices.astype(np.float32) + 0.5) / state.num_frames)  # (L,) in [0, 1]
        if cfg.method == "uniform":
            sel = np.isin(indices, state.keep)
            if sel.any():
                state.buffer.append((tok_1LTD[0, torch.from_numpy(sel).to(tok_1LTD.device)], times[sel]))
            return
        if cfg.method == "moviechat":
            state.moviechat = _moviechat_feed(state.moviechat, tok_1LTD[0], times, cfg)
            return
        record = [] if state.memories else None
        out = self.model.read_chunk(tok_1LTD, memories=state.memories, alpha=cfg.alpha, record=record,
                                    times_BL=times[None].to(tok_1LTD.device))
        state.outs.append(out[0])
        state.ctimes.append(float(times.mean()))
        state.bounds.append((float(indices[0]) / state.num_frames, float(indices[-1] + 1) / state.num_frames))
        if record:
            state.densities = [d[0] for d in record]

    @torch.no_grad()
    def finish(self, state: "_ReadState") -> VideoMemory:
        """End reading: the last reads of ``uniform`` and ``moviechat``, and what answering needs."""
        cfg = self.config
        if cfg.method == "uniform" and state.buffer:
            tok = torch.cat([b[0] for b in state.buffer])  # (n, T, D)
            times = torch.cat([b[1] for b in state.buffer])
            state.outs.append(self.model.read_chunk(tok[None])[0])
            state.ctimes.append(float(times.mean()))
            state.bounds.append((0.0, 1.0))
        if cfg.method == "moviechat" and state.moviechat is not None:
            tokens, times = _moviechat_frames(state.moviechat)
            state.outs.append(self.model.read_chunk(tokens[None])[0])
            state.ctimes.append(float(times.mean()))
            state.bounds.append((0.0, 1.0))
        if not state.outs:
            raise ValueError(f"no frames were read from {state.path!r}")
        mems = state.memories or []
        return VideoMemory(
            path=state.path, method=cfg.method, num_frames=state.num_frames, duration=state.duration,
            frames_read=state.frames_read, chunk_outputs=torch.stack(state.outs).cpu(),
            chunk_times=torch.tensor(state.ctimes), chunk_bounds=state.bounds,
            coefficients=[m.coef[0].cpu() for m in mems], densities=[d.cpu() for d in state.densities],
            tau=cfg.tau, timings=state.timings, peak_frames_held=state.peak,
            sources=[m.source_times()[0].cpu() for m in mems],
        )

    @torch.no_grad()
    def ingest(self, path, *, progress: bool = True) -> VideoMemory:
        """Stream a video file and keep what is needed to answer questions (see :class:`VideoMemory`).

        ``progress``: a tqdm bar over the frames read (``False`` to hide it).
        """
        from tqdm import tqdm

        cfg = self.config
        stream = VideoStream(path, fps=cfg.fps, chunk_size=cfg.chunk_size, max_frames=cfg.max_frames)
        n_total = stream.info.num_frames
        state = self.start(path, n_total, stream.info.duration, stream.indices)
        if cfg.method == "uniform":  # decode only the kept frames, as one chunk
            stream.indices = state.keep
            stream.chunk_size = len(stream.indices)
        it = iter(stream)
        bar = tqdm(total=len(stream.indices), desc=Path(path).name, unit="frame", disable=not progress, leave=False)
        timings = state.timings
        t0 = time.perf_counter()
        for chunk in it:
            t1 = time.perf_counter()
            bar.update(len(chunk.indices))
            timings["decode"] += t1 - t0
            state.peak = max(state.peak, len(chunk.frames))
            tok = self.encode(chunk.frames, chunk.indices, n_total)  # (1, L, T, D)
            t2 = time.perf_counter()
            timings["encode"] += t2 - t1
            self.feed(state, tok, chunk.indices)
            t0 = time.perf_counter()
            timings["memory"] += t0 - t2
        bar.close()
        t2 = time.perf_counter()
        mem = self.finish(state)
        mem.timings["memory"] += time.perf_counter() - t2
        return mem

    # -- answering -----------------------------------------------------------------------------------------
    @torch.no_grad()
    def answer(self, memory: VideoMemory, question, arg1: int | str = -1, arg2: int | str = -1) -> tuple[str, dict]:
        """Answer a question about an ingested video; returns the answer and the probability of each answer."""
        q = parse_question(question, arg1, arg2).to(self.device)
        logits = self.model.answer(memory.chunk_outputs[None].to(self.device), q, memory.chunk_times[None].to(self.device),
                                   aggregate=self.aggregate)[0]
        probs = logits.float().softmax(-1).cpu()
        return ANSWERS[int(probs.argmax())], {a: float(p) for a, p in zip(ANSWERS, probs)}

    def ask(self, path, question, arg1: int | str = -1, arg2: int | str = -1) -> str:
        """Ingest ``path`` and answer one question."""
        return self.answer(self.ingest(path), question, arg1, arg2)[0]

    @staticmethod
    def density_over_time(memory: VideoMemory, num_bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
        """Where the last chunk's continuous attention fell, mapped back onto the video's time axis.

        Memory position ``s`` maps to video time through each layer's source map (sticky consolidation
        warps the time axis: an attended span spreads over more of the memory). Without source maps the
        history is taken as evenly resampled: the last chunk fills ``(tau, 1]``, the one before
        ``(tau^2, tau]`` and so on, the first chunk ``(0, tau^(C-1)]``.

        Returns:
            ``(times_s, mass)``: bin centres in seconds and the attention mass in each of ``num_bins``
            equal bins of the video (sums to 1; averaged over layers).
        """
        if not memory.densities:
            raise ValueError(f"method {memory.method!r} keeps no continuous memory; use 'infinite' or 'infinite_nosticky'")
        if memory.sources:  # each layer's source map says which video time every integration point holds
            hist = np.zeros(num_bins)
            for dens_T, src_T in zip(memory.densities, memory.sources):
                dens = dens_T.float().numpy()
                T = dens.shape[0]
                w = np.full(T, 1.0 / (T - 1))
                w[0] = w[-1] = 0.5 / (T - 1)
                idx = np.clip((src_T.float().numpy() * num_bins).astype(int), 0, num_bins - 1)
                hist += np.bincount(idx, weights=dens * w, minlength=num_bins)
            hist = hist / max(hist.sum(), 1e-12)
            return (np.arange(num_bins) + 0.5) / num_bins * memory.duration, hist
        # no source maps (a memory saved before they existed): every consolidation multiplied positions by tau
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


@dataclass
class _ReadState:
    """What :meth:`InfiniteVideo.feed` accumulates for one video."""

    path: str
    num_frames: int
    duration: float
    frames_read: int
    keep: np.ndarray | None = None  # uniform: the file indices kept
    buffer: list = field(default_factory=list)  # uniform: (tokens (n, T, D), times (n,)) of kept frames
    memories: list | None = None  # infinite: one ContinuousMemory per Q-former block
    moviechat: dict | None = None  # moviechat: short- and long-term buffers
    outs: list = field(default_factory=list)  # (Q, D) per read
    ctimes: list = field(default_factory=list)
    bounds: list = field(default_factory=list)
    densities: list = field(default_factory=list)
    timings: dict = field(default_factory=lambda: {"decode": 0.0, "encode": 0.0, "memory": 0.0})
    peak: int = 0


def _moviechat_feed(state: dict | None, tok_LTD: torch.Tensor, times_L: torch.Tensor, cfg: InfiniteVideoConfig) -> dict:
    """MovieChat's memory, one frame at a time: fill the short-term buffer; when full, merge it down to
    ``moviechat_merge`` frames and move them to the long-term memory (merged down to ``moviechat_long``)."""
    if state is None:
        state = {"short": None, "long": None}
    for i in range(tok_LTD.shape[0]):
        state["short"] = _moviechat_merge(state["short"], tok_LTD[i:i + 1], times_L[i:i + 1], cfg.moviechat_short)
        if len(state["short"][2]) >= cfg.moviechat_short:
            tokens, f, t, w = _moviechat_merge(state["short"], tok_LTD[:0], times_L[:0], cfg.moviechat_merge)
            state["long"] = _moviechat_merge(state["long"], tokens, t, cfg.moviechat_long, feats=f, weights=w)
            state["short"] = None
    return state


def _moviechat_frames(state: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Long-term then short-term frames: tokens ``(n, T, D)`` and times ``(n,)``."""
    parts = [p for p in (state["long"], state["short"]) if p is not None]
    return torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])


def _moviechat_merge(state, tok_LTD: torch.Tensor, times_L: torch.Tensor, capacity: int, *,
                     feats: torch.Tensor | None = None, weights: torch.Tensor | None = None):
    """Append frames to the MovieChat-style buffer, then merge the most similar adjacent pairs down to ``capacity``.

    Frames are compared by the cosine similarity of their mean tokens; a merged frame is the
    count-weighted average of the pair (tokens and time).
    """
    feats = tok_LTD.mean(1) if feats is None else feats  # (L, D)
    weights = torch.ones(len(times_L)) if weights is None else weights
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
