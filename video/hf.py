"""∞-Video on a real Q-former video-LLM: a local InstructBLIP-Video (transformers), or a bare BLIP-2 Q-former with
any vision tower and causal language model.

The video streams from the file in chunks (:class:`video.io.VideoStream`, never the whole video in memory). Every
chunk goes through the vision tower and the Q-former; while a video is read, each Q-former cross-attention layer
gets a forward hook that mixes its output (the attention context, before the output projection) with continuous
attention over that layer's long-term memory (:class:`core.continuous.ContinuousMemory`):
``alpha * short + (1 - alpha) * long``, the memory read through the layer's own ``query`` / ``key`` / ``value``
projections, consolidated at every chunk with sticky resampling (the published ∞-Video recipe, training-free).
The chunks' LLM inputs (the projected query outputs) are averaged over chunks, as the released code does
(``aggregate="mean"``; ``"last"`` keeps the last chunk's), and the language model answers with ``generate``.

The hooks live only while a video is read (:meth:`InfiniteVideoLM.patched`), so the model is never modified:
after reading, or with ``alpha = 1``, it computes exactly what the unmodified model computes.

    from video import InfiniteVideo
    lm = InfiniteVideo.from_hf("path/to/instructblip-video")     # a local folder; nothing is downloaded
    lm.answer("video.mp4", "What happens after the man opens the door?")

Methods (``HFVideoConfig.method``): ``uniform`` (``clip_frames`` frames spread over the whole video, one clip: how
InstructBLIP-Video is used natively), ``chunks`` (every chunk, no memory, mean over chunks), ``infinite_nosticky``
and ``infinite`` (the long-term memory, evenly spaced or sticky resampling).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from core.continuous import ContinuousMemory, ContinuousMemoryConfig, check_basis_coverage, mix_attention, read_memory

logger = logging.getLogger(__name__)

__all__ = ["HF_METHODS", "HFVideoConfig", "QFormerMemoryHooks", "InfiniteVideoLM", "HFVideoResult", "cross_attentions",
           "folder_identity", "parse_hf_spec"]

HF_METHODS = ("uniform", "chunks", "infinite", "infinite_nosticky")
SUPPORTED_MODEL_TYPES = ("instructblipvideo",)


@dataclass(kw_only=True)
class HFVideoConfig:
    """How a video is read by :class:`InfiniteVideoLM` (memory defaults: the published ∞-Video settings; chunks of 16
    frames as VideoChat2 reads them, one basis function per frame of a chunk as Video-LLaMA's 256 / 256)."""

    method: str = "infinite"  # one of HF_METHODS
    chunk_size: int | None = 16  # frames per chunk (VideoChat2's 16); None = the model's clip length (4 for
    # InstructBLIP-Video). The LLM reads chunk_size x 32 query tokens (the mean over chunks)
    fps: float | None = None  # read rate in frames/s; None = every frame of the file
    alpha: float = 0.75  # weight of the ordinary cross-attention over the chunk; 1 - alpha on the memory
    num_basis: int | None = None  # basis functions per memory; None = the chunk size, so every function gets frames
    # from the first chunk on (fewer frames than functions leave boxes empty: a warning says so)
    basis: str = "box"
    ridge: float = 0.5
    tau: float = 0.75
    num_samples: int = 512
    num_bins: int = 128
    num_points: int = 1000
    aggregate: str = "mean"  # LLM input: "mean" over chunks (the reference) or the "last" chunk's
    max_frames: int | None = None  # stop reading after this many frames
    seed: int = 0  # sticky draws

    def __post_init__(self) -> None:
        if self.method not in HF_METHODS:
            raise ValueError(f"method must be one of {list(HF_METHODS)}, got {self.method!r}")
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.num_basis is not None and self.num_basis < 1:
            raise ValueError(f"num_basis must be >= 1 or None (the chunk size), got {self.num_basis}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {self.alpha}")
        if self.aggregate not in ("mean", "last"):
            raise ValueError(f"aggregate must be 'mean' or 'last', got {self.aggregate!r}")
        self.memory_config()  # validates the memory settings

    def memory_config(self, chunk_size: int | None = None) -> ContinuousMemoryConfig:
        """The memory of one layer for chunks of ``chunk_size`` frames (``num_basis`` None = that many functions)."""
        n = self.num_basis or chunk_size or self.chunk_size or 4
        return ContinuousMemoryConfig(num_basis=n, basis=self.basis, ridge=self.ridge, tau=self.tau,
                                      num_samples=self.num_samples, sticky=self.method == "infinite",
                                      num_bins=self.num_bins, num_points=self.num_points)

    @property
    def uses_memory(self) -> bool:
        return self.method in ("infinite", "infinite_nosticky") and self.alpha < 1.0


def cross_attentions(qformer: nn.Module) -> list[nn.Module]:
    """The Q-former's cross-attention cores (the modules with ``query``/``key``/``value`` that read the frames), in
    layer order: ``layer.crossattention.attention`` of every layer with ``has_cross_attention``."""
    found = []
    for mod in qformer.modules():
        if getattr(mod, "has_cross_attention", False) and hasattr(mod, "crossattention"):
            core = getattr(mod.crossattention, "attention", mod.crossattention)
            if not all(hasattr(core, n) for n in ("query", "key", "value")):
                raise ValueError(f"{type(core).__name__} has no query/key/value projections; not a BLIP-2 Q-former")
            found.append(core)
    if not found:
        raise ValueError(f"{type(qformer).__name__} has no cross-attention layers; expected a BLIP-2 style Q-former")
    return found


class QFormerMemoryHooks:
    """Forward hooks on a Q-former's cross-attention cores that mix in a continuous long-term memory.

    Rows of the Q-former batch are ``K`` videos-or-questions times ``F`` frames (batch-major, as InstructBLIP-Video
    lays them out); each of the ``K`` rows has its own memory per layer. Every call of a hooked layer (one per chunk)
    consolidates the chunk's frames (one vector per frame: the mean of its tokens) into that layer's memory, reads
    the memory with the layer's queries (all ``F * Q`` query rows of a video together) through the layer's own
    key/value projections, and returns ``alpha * short + (1 - alpha) * long``. :meth:`remove` takes the hooks out.
    """

    def __init__(self, qformer: nn.Module, config: HFVideoConfig, num_rows: int, chunk_size: int | None = None) -> None:
        self.config, self.K = config, num_rows
        self.cores = cross_attentions(qformer)
        mcfg = config.memory_config(chunk_size)
        if chunk_size is not None:
            check_basis_coverage(mcfg, chunk_size, where="HFVideoConfig")
        self.memories = [ContinuousMemory(mcfg, seed=config.seed + i) for i in range(len(self.cores))]
        self.times: torch.Tensor | None = None  # (F,) video times of the current chunk's frames, set by the reader
        self.densities: list[torch.Tensor | None] = [None] * len(self.cores)
        self._handles = [c.register_forward_hook(self._hook(i), with_kwargs=True) for i, c in enumerate(self.cores)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, i: int):
        def hook(module, args, kwargs, output):
            return self._mix(i, module, args, kwargs, output)
        return hook

    def _mix(self, i: int, module, args, kwargs, output):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        enc = kwargs.get("encoder_hidden_states", args[2] if len(args) > 2 else None)
        if enc is None:  # not a cross-attention call
            return output
        ctx, rest = (output[0], output[1:]) if isinstance(output, tuple) else (output, ())
        R, Q, E = ctx.shape
        K = self.K
        if R % K:
            raise ValueError(f"Q-former batch {R} is not a multiple of the {K} rows the memory was built for")
        F = R // K
        mem = self.memories[i]
        frames = enc.float().mean(1).reshape(K, F, -1)  # one vector per frame
        times = None if self.times is None else self.times.reshape(1, F).expand(K, F)
        mem.update(frames, times)
        H, hd = module.num_attention_heads, module.attention_head_size
        w = module.key.weight.dtype

        def kv(c):  # (K, n, Dv) -> keys and values (K, H, n, hd), the layer's own projections
            c = c.to(w)
            return tuple(p(c).reshape(K, c.shape[1], H, hd).transpose(1, 2) for p in (module.key, module.value))

        q = module.query(hidden).reshape(K, F, Q, H, hd).permute(0, 3, 1, 2, 4).reshape(K, H, F * Q, hd)
        long, density = read_memory(mem, q, kv, scale=module.scaling)
        long = long.reshape(K, H, F, Q, hd).permute(0, 2, 3, 1, 4).reshape(R, Q, E).to(ctx.dtype)
        self.densities[i] = density.detach()
        mixed = mix_attention(ctx, long, self.config.alpha)
        return (mixed, *rest) if isinstance(output, tuple) else mixed


@dataclass
class HFVideoResult:
    """What reading one video for ``K`` questions leaves."""

    path: str
    method: str
    num_frames: int  # frames in the file
    frames_read: int
    num_chunks: int
    features: torch.Tensor  # (K, F * Q, D_llm) the LLM inputs after aggregation
    answers: list[str] | None = None
    coefficients: list[torch.Tensor] | None = None  # per memory layer (K, N, Dv)
    densities: list[torch.Tensor] | None = None  # per memory layer (K, T), last chunk's attention density
    peak_frames_held: int = 0


def _default_preprocess(image_size: int, mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)):
    def pre(frames: np.ndarray) -> torch.Tensor:
        x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).float() / 255.0
        x = nn.functional.interpolate(x, size=(image_size, image_size), mode="bicubic", align_corners=False)
        return (x - torch.tensor(mean)[:, None, None]) / torch.tensor(std)[:, None, None]
    return pre


class InfiniteVideoLM:
    """A Q-former video-LLM that reads videos of any length with the ∞-Video memory and answers in free text.

    Build it with :meth:`from_hf` (a local InstructBLIP-Video folder) or :meth:`from_pieces` (a BLIP-2
    ``Blip2QFormerModel`` with a vision tower, query tokens, a projection and any causal LM).
    """

    def __init__(self, *, vision: Callable, qformer: nn.Module, query_tokens: torch.Tensor, projection: nn.Module,
                 language_model: nn.Module, tokenizer, qformer_tokenizer=None, preprocess: Callable,
                 clip_frames: int = 4, video_token_id: int | None = None, config: HFVideoConfig | None = None,
                 model: nn.Module | None = None, source: str = "") -> None:
        self.vision, self.qformer, self.query_tokens, self.projection = vision, qformer, query_tokens, projection
        self.language_model, self.tokenizer, self.qformer_tokenizer = language_model, tokenizer, qformer_tokenizer
        self.preprocess, self.clip_frames, self.video_token_id = preprocess, int(clip_frames), video_token_id
        self.config = config or HFVideoConfig()
        self.model, self.source = model, source
        self.progress = True  # a tqdm bar over the frames of each video read (ingest(progress=False) per call)
        cross_attentions(qformer)  # refuses a module that is not a BLIP-2 style Q-former
        self.device = query_tokens.device

    # -- construction --------------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, path, *, config: HFVideoConfig | None = None, device=None, dtype=None,
                attn: str = "eager") -> "InfiniteVideoLM":
        """Load a local InstructBLIP-Video folder (``InstructBlipVideoForConditionalGeneration`` with its processor).

        Raises a clear error for a hub id, a missing folder, a folder without weights, or a model of another kind.
        """
        from core.hf import check_model_folder, load

        folder, cfg = check_model_folder(path)
        kind = cfg.get("model_type")
        if kind not in SUPPORTED_MODEL_TYPES:
            archs = ", ".join(cfg.get("architectures") or []) or "no architectures listed"
            raise ValueError(f"{path} holds a {kind!r} model ({archs}); ∞-Video needs an InstructBLIP-Video folder "
                             f"(model_type 'instructblipvideo', InstructBlipVideoForConditionalGeneration), or use "
                             f"InfiniteVideoLM.from_pieces with a BLIP-2 Q-former and a causal LM")
        loaded = load(folder, dtype=dtype, device=device, attn=attn)
        proc = loaded.processor
        if proc is None or not hasattr(proc, "qformer_tokenizer") or not hasattr(proc, "video_processor"):
            raise ValueError(f"{path} has no InstructBLIP-Video processor (processor_config.json with a video processor, "
                             f"tokenizer and qformer_tokenizer); save one with processor.save_pretrained({str(path)!r})")
        m = loaded.model
        vp = proc.video_processor

        def preprocess(frames: np.ndarray) -> torch.Tensor:
            return vp(videos=[list(frames)], return_tensors="pt")["pixel_values"][0]  # (L, 3, H, W)

        return cls(vision=lambda px: m.vision_model(pixel_values=px)[0], qformer=m.qformer, query_tokens=m.query_tokens,
                   projection=m.language_projection, language_model=m.language_model, tokenizer=proc.tokenizer,
                   qformer_tokenizer=proc.qformer_tokenizer, preprocess=preprocess, clip_frames=4,
                   video_token_id=m.config.video_token_index, config=config, model=m, source=str(folder))

    @classmethod
    def from_pieces(cls, *, vision: Callable, qformer: nn.Module, query_tokens: torch.Tensor, projection: nn.Module,
                    language_model: nn.Module, tokenizer, image_size: int, qformer_tokenizer=None,
                    preprocess: Callable | None = None, clip_frames: int = 1, config: HFVideoConfig | None = None,
                    video_token_id: int | None = None) -> "InfiniteVideoLM":
        """A bare Q-former (``Blip2QFormerModel``; ``qformer_tokenizer`` for an instruction-aware one) with the pieces
        around it: ``vision(pixels (N, 3, H, W)) -> tokens (N, T, Dv)``, ``query_tokens (1, Q, Dq)``, ``projection``
        (Q-former width -> LLM width), a causal LM and its tokenizer. Without ``video_token_id`` the visual tokens are
        put before the prompt's embeddings (BLIP-2 style). ``preprocess`` defaults to a CLIP-normalised resize."""
        return cls(vision=vision, qformer=qformer, query_tokens=query_tokens, projection=projection,
                   language_model=language_model, tokenizer=tokenizer, qformer_tokenizer=qformer_tokenizer,
                   preprocess=preprocess or _default_preprocess(image_size), clip_frames=clip_frames,
                   video_token_id=video_token_id, config=config)

    # -- one chunk ----------------------------------------------------------------------------------------------
    def qformer_inputs(self, questions: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The instruction token ids and mask ``(K, S)`` for an instruction-aware Q-former, else None."""
        if self.qformer_tokenizer is None:
            return None
        enc = self.qformer_tokenizer(list(questions), padding=True, return_tensors="pt")
        return enc["input_ids"].to(self.device), enc["attention_mask"].to(self.device)

    @torch.no_grad()
    def chunk_features(self, pixel_F3HW: torch.Tensor, K: int, q_inputs) -> torch.Tensor:
        """One chunk of ``F`` preprocessed frames, read for ``K`` questions -> LLM inputs ``(K, F * Q, D_llm)``.

        The same steps as ``InstructBlipVideoForConditionalGeneration.get_video_features`` (vision tower once for
        all questions).
        """
        F = pixel_F3HW.shape[0]
        dtype = next(self.qformer.parameters()).dtype
        embeds = self.vision(pixel_F3HW.to(self.device, dtype))  # (F, T, Dv)
        embeds = embeds.repeat(K, 1, 1) if K > 1 else embeds  # rows k * F + f
        emask = torch.ones(embeds.shape[:-1], dtype=torch.long, device=embeds.device)
        query = self.query_tokens.expand(embeds.shape[0], -1, -1)
        kw = {"query_embeds": query, "encoder_hidden_states": embeds, "encoder_attention_mask": emask}
        if q_inputs is not None:
            ids, mask = q_inputs
            qmask = torch.ones(query.shape[:-1], dtype=torch.long, device=embeds.device)
            kw["input_ids"] = ids.repeat_interleave(F, dim=0)
            kw["attention_mask"] = torch.cat([qmask, mask.repeat_interleave(F, dim=0).to(qmask.device)], dim=1)
        out = self.qformer(**kw)[0][:, : query.shape[1], :]
        return self.projection(out).reshape(K, F * query.shape[1], -1)

    # -- reading ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def patched(self, num_rows: int):
        """The memory hooks on the Q-former for the duration of the block (none without a memory); always removed."""
        hooks = (QFormerMemoryHooks(self.qformer, self.config, num_rows, self.chunk_size) if self.config.uses_memory
                 else None)
        try:
            yield hooks
        finally:
            if hooks is not None:
                hooks.remove()

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size or self.clip_frames

    def _stream(self, path):
        from video.io import VideoStream

        cfg = self.config
        stream = VideoStream(path, fps=cfg.fps, chunk_size=self.chunk_size, max_frames=cfg.max_frames)
        if cfg.method == "uniform":  # the model's own use: one clip of clip_frames frames spread over the video
            pick = np.linspace(0, len(stream.indices) - 1, self.clip_frames).round().astype(np.int64)
            stream.indices = stream.indices[pick]
            stream.chunk_size = self.clip_frames
        return stream

    @torch.no_grad()
    def read_chunks(self, chunks: Iterable[tuple[np.ndarray, np.ndarray]], num_frames: int, questions: Sequence[str],
                    *, path: str = "", progress: bool = False, total_frames: int | None = None) -> HFVideoResult:
        """Read ``(frames (L, H, W, 3) uint8, file indices (L,))`` chunks of a ``num_frames`` video for the questions.

        A chunk shorter than the chunk size (the last one) is padded by repeating its last frame: the LLM's input
        has room for exactly one chunk's queries. Only a running sum of the chunk features is kept. ``progress``
        shows a tqdm bar over the frames (``total_frames`` of them, when known).
        """
        from tqdm import tqdm

        cfg, K = self.config, len(questions)
        if K < 1:
            raise ValueError("need at least one question")
        q_inputs = self.qformer_inputs(questions)
        total, last, n_chunks, read, peak = None, None, 0, 0, 0
        size = self.chunk_size if cfg.method != "uniform" else self.clip_frames
        bar = tqdm(total=total_frames, desc=Path(path).name or "video", unit="frame", disable=not progress, leave=False)
        with self.patched(K) as hooks, bar:
            for frames, idx in chunks:
                if len(frames) == 0:
                    continue
                bar.update(len(frames))
                read += len(frames)
                peak = max(peak, len(frames))
                if len(frames) < size:
                    pad = size - len(frames)
                    frames = np.concatenate([frames, np.repeat(frames[-1:], pad, axis=0)])
                    idx = np.concatenate([idx, np.repeat(idx[-1:], pad)])
                if hooks is not None:
                    hooks.times = torch.from_numpy((idx.astype(np.float32) + 0.5) / max(num_frames, 1))
                feats = self.chunk_features(self.preprocess(frames), K, q_inputs)
                last = feats
                total = feats.float() if total is None else total + feats.float()
                n_chunks += 1
            coefs = [m.coef.cpu() for m in hooks.memories if m.coef is not None] if hooks is not None else None
            dens = [d.cpu() for d in hooks.densities if d is not None] if hooks is not None else None
        if n_chunks == 0:
            raise ValueError(f"no frames were read from {path or 'the video'!r}")
        if cfg.aggregate == "last" or n_chunks == 1:
            agg = last  # one chunk: its features as they are (bit for bit the model's own)
        else:
            agg = (total / n_chunks).to(last.dtype)
        return HFVideoResult(path=path, method=cfg.method, num_frames=num_frames, frames_read=read, num_chunks=n_chunks,
                             features=agg, coefficients=coefs, densities=dens, peak_frames_held=peak)

    def ingest(self, path, questions: Sequence[str] | str, *, progress: bool | None = None) -> HFVideoResult:
        """Stream a video file for the questions (the instruction-aware Q-former reads each question).

        ``progress``: a tqdm bar over the frames read (None = :attr:`progress`, on unless set to False).
        """
        questions = [questions] if isinstance(questions, str) else list(questions)
        stream = self._stream(path)
        chunks = ((c.frames, c.indices) for c in stream)
        return self.read_chunks(chunks, stream.info.num_frames, questions, path=str(path),
                                progress=self.progress if progress is None else progress,
                                total_frames=len(stream.indices))

    # -- answering ----------------------------------------------------------------------------------------------
    def prompt_inputs(self, features_SD: torch.Tensor, question: str) -> dict:
        """``inputs_embeds`` / ``attention_mask`` / ``input_ids`` for the language model, the features in place."""
        tok = self.tokenizer
        text_ids = tok(question, add_special_tokens=True)["input_ids"]
        emb = self.language_model.get_input_embeddings()
        n = features_SD.shape[0]
        if self.video_token_id is not None:  # as the InstructBLIP-Video processor and generate lay them out
            ids = torch.tensor([[self.video_token_id] * n + list(text_ids)], device=self.device)
            embeds = emb(ids)
            mask = (ids == self.video_token_id)[..., None].to(embeds.device)
            embeds = embeds.masked_scatter(mask, features_SD[None].to(embeds.device, embeds.dtype))
            return {"inputs_embeds": embeds, "attention_mask": torch.ones_like(ids), "input_ids": ids}
        ids = torch.tensor([list(text_ids)], device=self.device)
        embeds = torch.cat([features_SD[None].to(self.device, emb.weight.dtype), emb(ids)], dim=1)
        return {"inputs_embeds": embeds, "attention_mask": torch.ones(embeds.shape[:2], dtype=torch.long, device=self.device)}

    @torch.no_grad()
    def generate(self, features_SD: torch.Tensor, question: str, **generate_kwargs) -> torch.Tensor:
        """Token ids the language model generates for one question (new tokens only)."""
        inputs = self.prompt_inputs(features_SD, question)
        generate_kwargs.setdefault("max_new_tokens", 32)
        generate_kwargs.setdefault("do_sample", False)
        out = self.language_model.generate(**inputs, **generate_kwargs)
        n_in = inputs["input_ids"].shape[1] if "input_ids" in inputs else 0
        return out[0, n_in:] if out.shape[1] > n_in and n_in else out[0]

    def answer(self, path, questions: Sequence[str] | str, *, progress: bool | None = None,
               **generate_kwargs) -> list[str] | str:
        """Read the video once for all questions and answer each in free text (``progress``: see :meth:`ingest`)."""
        single = isinstance(questions, str)
        res = self.ingest(path, questions, progress=progress)
        answers = [self.tokenizer.decode(self.generate(res.features[k], q, **generate_kwargs), skip_special_tokens=True).strip()
                   for k, q in enumerate([questions] if single else questions)]
        res.answers = answers
        self.last_result = res
        return answers[0] if single else answers

    def settings(self) -> dict:
        """The reading settings and the model's identity (for files written from this reader)."""
        ident = folder_identity(self.source) if self.source and Path(self.source).is_dir() else None
        return {"reader": asdict(self.config), "model": ident, "clip_frames": self.clip_frames}


def folder_identity(folder) -> dict:
    """A model folder's identity without reading its weights: SHA-256 of ``config.json`` and each weights file's
    name and size."""
    import hashlib

    folder = Path(folder)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".safetensors", ".bin"))
    return {"config_sha256": hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
            "weights": [[p.name, p.stat().st_size] for p in files]}


def parse_hf_spec(spec: str) -> str | None:
    """``"hf:DIR"`` -> ``DIR``; anything else -> None. An empty folder after ``hf:`` is refused."""
    if not isinstance(spec, str) or not spec.startswith("hf:"):
        return None
    folder = spec[3:].strip()
    if not folder:
        raise ValueError("--model hf: needs a folder after 'hf:' (a local InstructBLIP-Video, e.g. hf:./instructblip-video)")
    return folder
