"""Video question answering model: frame encoder -> Q-former over chunks -> question-conditioned answer head.

Data flow for one video, split into chunks of frames:

    frames (B, L, H, W, 3) uint8 + frame times t in [0, 1] (position in the whole video)
      -> frame tokens (B, L, T, D) = encoder(frame) + time embedding(t)
      -> per chunk: Q-former blocks; each block's cross-attention reads the chunk's tokens and, with a
         long-term memory (``core.continuous``), mixes in continuous attention over everything seen so
         far: out = alpha * short_term + (1 - alpha) * long_term, through the same key/value projections
      -> chunk outputs (B, C, Q, D) for the C chunks
      -> answer head: the question (type + colour arguments) attends over a fixed-size read-out of the
         chunk outputs -> logits. The bounded read-outs of the published pipelines are ``"last"`` (the
         final chunk's Q queries: whatever the answer needs from earlier chunks must come through the
         long-term memory) and ``"mean"`` (the Q queries averaged over chunks, as the released ∞-Video
         code feeds the LLM); ``"attention"`` (over every chunk's queries plus a chunk-time embedding, a
         read-out that grows with the video) is kept for models trained with it.

The same weights serve every reading strategy (:mod:`video.infinite`): uniform subsampling (one chunk),
chunk-by-chunk without memory (alpha = 1), ∞-Video (memory, with or without sticky resampling) and
MovieChat-style frame merging.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from core.continuous import ContinuousMemory, ContinuousMemoryConfig, mix_attention, read_memory
from core.layers import QFormerBlock
from video.encoders import build_frame_encoder
from video.synthetic import ANSWERS, COLOURS, QUESTION_TYPES

__all__ = ["AGGREGATES", "BOUNDED_AGGREGATES", "VideoQAConfig", "VideoQAModel", "time_embedding", "question_tensor"]

AGGREGATES = ("attention", "mean", "last")  # how the answer head pools the chunks' query outputs
BOUNDED_AGGREGATES = ("last", "mean")  # read-outs of a fixed size whatever the number of chunks


@dataclass(kw_only=True)
class VideoQAConfig:
    """Sizes of the video QA model (defaults: the shipped small model)."""

    dim: int = 64  # token / query features
    num_heads: int = 4  # attention heads in the Q-former
    num_layers: int = 2  # Q-former blocks
    num_queries: int = 8  # learned queries (Video-LLaMA uses 32; 8 keep CPU training cheap)
    encoder: str = "tiny"  # frame encoder registry name (video.encoders)
    encoder_dim: int = 64  # tokens out of the tiny encoder
    encoder_width: int = 16  # channels of the tiny encoder's first conv (doubled twice)
    input_size: int = 16  # frames are resized to this square before the tiny encoder
    num_answers: int = len(ANSWERS)  # closed answer vocabulary
    num_question_types: int = len(QUESTION_TYPES)
    num_colours: int = len(COLOURS)
    readout: str = "attention"  # the answer read-out the model was trained with (see VideoQAModel.answer);
    # readers use it unless told otherwise. "attention" for weights saved before the field existed

    def __post_init__(self) -> None:
        if self.readout not in AGGREGATES:
            raise ValueError(f"readout must be one of {list(AGGREGATES)}, got {self.readout!r}")
        if self.dim % self.num_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must divide dim ({self.dim})")
        for name in ("dim", "num_heads", "num_layers", "num_queries", "encoder_dim", "num_answers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    def to_dict(self) -> dict:
        return asdict(self)


def time_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of times ``t`` in ``[0, 1]``: ``(...,) -> (..., dim)``.

    Frequencies are spaced geometrically from 1/2 to 64 cycles over ``[0, 1]``: the slow ones order
    events across the whole video, the fast ones separate neighbouring frames of a short clip.
    """
    half = dim // 2
    freqs = torch.exp(torch.linspace(math.log(0.5), math.log(64.0), half, device=t.device))
    ang = t.float()[..., None] * freqs * 2 * math.pi  # (..., half)
    out = torch.cat([ang.sin(), ang.cos()], dim=-1)
    return out if dim % 2 == 0 else torch.nn.functional.pad(out, (0, 1))


def question_tensor(questions, device=None) -> torch.Tensor:
    """``(B, 3)`` long: question type, first colour + 1, second colour + 1 (0 = no argument)."""
    rows = [[q.qtype_id, q.arg1 + 1, q.arg2 + 1] for q in questions]
    return torch.tensor(rows, dtype=torch.long, device=device)


class _MemoryCrossAttention:
    """Cross-attention hook: ordinary attention over the chunk mixed with the continuous long-term memory."""

    def __init__(self, memory: ContinuousMemory, alpha: float, tokens_per_frame: int, record: list | None,
                 times_BL: torch.Tensor | None = None) -> None:
        self.memory, self.alpha, self.tpf, self.record, self.times = memory, alpha, tokens_per_frame, record, times_BL

    def __call__(self, attn, queries_BQD, context_BND, pad):
        short = attn(queries_BQD, context_BND, key_padding_mask=pad)  # (B, Q, dim)
        B, N, D = context_BND.shape
        frames_BLD = context_BND.reshape(B, N // self.tpf, self.tpf, D).mean(2)  # one vector per frame
        self.memory.update(frames_BLD, self.times)
        # keys and values of the signal at the integration points (B, H, T, hd), through the same projections
        # (affine, so applied to the N basis coefficients rather than the T points); one softmax for both outputs
        q = attn.project_q(queries_BQD)  # (B, H, Q, hd)
        ctx_BHQD, density = read_memory(self.memory, q, lambda c: attn.project_kv(c.to(context_BND.dtype)))
        long = attn.merge(ctx_BHQD)
        if self.record is not None:
            self.record.append(density)
        return mix_attention(short, long, self.alpha)


class VideoQAModel(nn.Module):
    """Frame encoder, Q-former (``core.layers.QFormerBlock``) and a question-conditioned answer head."""

    def __init__(self, config: VideoQAConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or VideoQAConfig()
        kw = {"dim": cfg.encoder_dim, "input_size": cfg.input_size, "width": cfg.encoder_width} if cfg.encoder == "tiny" else {}
        self.encoder = build_frame_encoder(cfg.encoder, **kw)
        self.tokens_per_frame = getattr(self.encoder, "num_tokens", None)
        self.frame_proj = nn.Linear(self.encoder.dim, cfg.dim)
        # training-only auxiliary head: which colours a frame shows (max over its tokens)
        self.frame_tagger = nn.Linear(self.encoder.dim, cfg.num_colours)
        self.time_proj = nn.Linear(cfg.dim, cfg.dim)
        self.queries = nn.Parameter(torch.randn(cfg.num_queries, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            QFormerBlock(cfg.dim, cfg.num_heads, norm_context=True) for _ in range(cfg.num_layers)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.q_type = nn.Embedding(cfg.num_question_types, cfg.dim)
        self.q_arg1 = nn.Embedding(cfg.num_colours + 1, cfg.dim)
        self.q_arg2 = nn.Embedding(cfg.num_colours + 1, cfg.dim)
        self.chunk_time = nn.Linear(cfg.dim, cfg.dim)
        self.pool = nn.MultiheadAttention(cfg.dim, cfg.num_heads, batch_first=True)
        self.head = nn.Sequential(nn.Linear(2 * cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.num_answers))

    # -- frames ------------------------------------------------------------------------------------------
    def encode_frames(self, frames_BLHWC: torch.Tensor, times_BL: torch.Tensor, *, tags: list | None = None) -> torch.Tensor:
        """uint8 frames ``(B, L, H, W, 3)`` and their video times ``(B, L)`` in [0, 1] -> tokens ``(B, L, T, dim)``.

        If ``tags`` is a list, the auxiliary per-frame colour logits ``(B, L, num_colours)`` are appended to it.
        """
        B, L = frames_BLHWC.shape[:2]
        x = frames_BLHWC.reshape(B * L, *frames_BLHWC.shape[2:]).permute(0, 3, 1, 2)  # (B*L, 3, H, W)
        feats = self.encoder(x)  # (B*L, T, enc_dim)
        if tags is not None:
            tags.append(self.frame_tagger(feats).amax(dim=1).reshape(B, L, -1))
        tok = self.frame_proj(feats)  # (B*L, T, dim)
        tok = tok.reshape(B, L, tok.shape[1], -1)
        self.tokens_per_frame = tok.shape[2]
        return tok + self.time_proj(time_embedding(times_BL, self.config.dim))[:, :, None, :]

    # -- Q-former over one chunk --------------------------------------------------------------------------
    def read_chunk(
        self,
        tokens_BLTD: torch.Tensor,
        *,
        memories: list[ContinuousMemory] | None = None,
        alpha: float = 0.75,
        record: list | None = None,
        times_BL: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the Q-former over one chunk's tokens; returns query outputs ``(B, Q, dim)``.

        Args:
            tokens_BLTD: the chunk's frame tokens.
            memories: one :class:`ContinuousMemory` per block (updated in place), or None for no memory.
            alpha: weight of the ordinary (short-term) cross-attention; 1 - alpha goes to the memory.
            record: if a list, each block's attention density over the memory ``(B, T_int)`` is appended.
            times_BL: the frames' video times, handed to the memories for their source maps
                (:meth:`ContinuousMemory.source_times`); default frame counts.
        """
        B, L, T, D = tokens_BLTD.shape
        ctx = tokens_BLTD.reshape(B, L * T, D)
        q = self.queries.expand(B, -1, -1)
        if memories is not None and len(memories) != len(self.blocks):
            raise ValueError(f"need one memory per block ({len(self.blocks)}), got {len(memories)}")
        for i, block in enumerate(self.blocks):
            hook = None
            if memories is not None and alpha < 1.0:
                hook = _MemoryCrossAttention(memories[i], alpha, T, record, times_BL)
            q = block(q, ctx, cross_attn=hook)
        return self.norm(q)

    # -- answer ---------------------------------------------------------------------------------------------
    def answer(self, chunk_out_BCQD: torch.Tensor, questions_B3: torch.Tensor, chunk_times_BC: torch.Tensor,
               *, aggregate: str = "attention") -> torch.Tensor:
        """Answer logits ``(B, num_answers)`` from all chunks' query outputs.

        Args:
            chunk_out_BCQD: query outputs of the ``C`` chunks.
            questions_B3: see :func:`question_tensor`.
            chunk_times_BC: centre time of each chunk in [0, 1].
            aggregate: ``"last"`` (only the last chunk's queries: whatever the answer needs from earlier
                chunks must come through the long-term memory), ``"mean"`` (queries averaged over chunks,
                as the released pipeline feeds the LLM) — both of a fixed size — or ``"attention"`` (the
                question attends over every chunk's queries plus a chunk-time embedding; grows with ``C``).
        """
        B, C, Q, D = chunk_out_BCQD.shape
        if aggregate == "mean":
            x = chunk_out_BCQD.mean(1, keepdim=True)  # (B, 1, Q, D)
        elif aggregate == "last":
            x = chunk_out_BCQD[:, -1:]  # (B, 1, Q, D)
        elif aggregate == "attention":
            x = chunk_out_BCQD + self.chunk_time(time_embedding(chunk_times_BC, D))[:, :, None, :]
        else:
            raise ValueError(f"aggregate must be one of {list(AGGREGATES)}, got {aggregate!r}")
        x = x.reshape(B, -1, D)
        qv = self.q_type(questions_B3[:, 0]) + self.q_arg1(questions_B3[:, 1]) + self.q_arg2(questions_B3[:, 2])
        pooled, _ = self.pool(qv[:, None, :], x, x, need_weights=False)  # (B, 1, D)
        return self.head(torch.cat([pooled[:, 0], qv], dim=-1))

    def forward(self, frames_BLHWC: torch.Tensor, times_BL: torch.Tensor, questions: torch.Tensor,
                *, num_chunks: int = 1, tags: list | None = None, aggregate: str = "attention",
                memory: ContinuousMemoryConfig | None = None, alpha: float = 0.75) -> torch.Tensor:
        """Training path: split ``L`` frames into ``num_chunks`` equal chunks, read them, answer.

        Args:
            questions: ``(B, 3)`` one question per clip, or ``(B, K, 3)`` several questions per clip
                (the clip is read once and every question answered from it).
            aggregate: the answer head's read-out (see :meth:`answer`).
            memory: None reads the chunks independently (no memory, the published training); a
                configuration reads them in order with one long-term memory per block, mixed at ``alpha``
                (the memory in the training loop; gradients flow through the ridge fits, not the draws).

        Returns:
            Logits ``(B, num_answers)`` or ``(B, K, num_answers)``.
        """
        B, L = frames_BLHWC.shape[:2]
        if L % num_chunks:
            raise ValueError(f"num_chunks ({num_chunks}) must divide the clip length ({L})")
        tok = self.encode_frames(frames_BLHWC, times_BL, tags=tags)  # (B, L, T, D)
        c = L // num_chunks
        if memory is None:
            chunks = tok.reshape(B * num_chunks, c, *tok.shape[2:])  # chunks read independently
            out = self.read_chunk(chunks).reshape(B, num_chunks, self.config.num_queries, -1)
        else:
            mems = [ContinuousMemory(memory) for _ in self.blocks]
            out = torch.stack([self.read_chunk(tok[:, i * c:(i + 1) * c], memories=mems, alpha=alpha,
                                               times_BL=times_BL[:, i * c:(i + 1) * c])
                               for i in range(num_chunks)], dim=1)  # (B, C, Q, D)
        ctimes = times_BL.reshape(B, num_chunks, c).mean(-1)
        if questions.dim() == 2:
            return self.answer(out, questions, ctimes, aggregate=aggregate)
        K = questions.shape[1]
        out_rep = out[:, None].expand(B, K, *out.shape[1:]).reshape(B * K, *out.shape[1:])  # (B*K, C, Q, D)
        ct_rep = ctimes[:, None].expand(B, K, num_chunks).reshape(B * K, num_chunks)
        return self.answer(out_rep, questions.reshape(B * K, 3), ct_rep, aggregate=aggregate).reshape(B, K, -1)
