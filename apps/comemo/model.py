"""CoMemo model: tiles -> small ViT -> pixel shuffle -> MLP projector -> image tokens for a causal decoder.

The image tokens reach the decoder (:class:`core.decoder.Decoder`) by one or two paths, chosen by
``CoMemoConfig.variant`` (all variants share every size):

========== ============================ ============================================================
variant    context path (tokens in LM)   memory path (gated cross-attention every k-th layer)
========== ============================ ============================================================
lvlm-1d    yes, plain 1-D positions      no   (the LLaVA / InternVL baseline)
lvlm-dhr   yes, RoPE-DHR positions       no
flamingo   no (a ``<image>`` marker)     yes, keys at the marker's position
comemo     yes, RoPE-DHR positions       yes, keys at their RoPE-DHR ids
========== ============================ ============================================================

Image tokens of one image, in sequence order: its ``rows*cols`` tiles (row-major, ``T*T`` tokens each,
row-major inside a tile), then the thumbnail (``T*T`` tokens, ``G = T``). A single-tile image has no
thumbnail: its one tile shows the whole image and takes the thumbnail's ids. RoPE-DHR ids come from
:func:`core.rope.rope_dhr_position_ids` (an image uses ``T*T`` ids whatever its tile count).

Memory-path layout (``CoMemoConfig``; the defaults follow CoMemo's released code): a block before decoder layer
``i`` where ``(i + 1) % cross_every == 0`` (``cross_placement="reference"``); every token queries the memory
(``memory_queries="all"``; ``"text"``: image slots get no update, via ``memory_attn_bias``), with its own
position; one norm shared by the queries and the memory (``memory_norm="shared"``). Files written before these
options (the shipped weights among them) load with the first layout, :data:`LEGACY_MEMORY`: blocks before layers
0, k, 2k, text queries, a separate memory LayerNorm.

Layouts: tiles ``(N, 3, tile, tile)`` float (normalised by :func:`normalise_tiles`); ViT output
``(N, P, vision_dim)`` with ``P = (tile/patch)**2``; after the shuffle ``(N, T*T, vision_dim*s*s)`` with
``T = tile/patch/s``; projected image tokens ``(N*T*T, dim)`` flat over the batch's images.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from einops import rearrange
from torch import nn
from torch.nn import functional as F

from apps.comemo.tokenizer import IMAGE_LABELS
from core.decoder import Decoder, DecoderConfig
from core.layers import GatedCrossAttentionBlock, SelfAttentionBlock
from core.infra.fileio import atomic_path, load_safetensors_model, open_safetensors

logger = logging.getLogger(__name__)

__all__ = ["VARIANTS", "LEGACY_MEMORY", "VisionConfig", "CoMemoConfig", "VisionEncoder", "pixel_shuffle", "Projector",
           "CoMemoModel", "normalise_tiles", "lm_loss"]

VARIANTS = ("lvlm-1d", "lvlm-dhr", "flamingo", "comemo")
CONTEXT_VARIANTS = ("lvlm-1d", "lvlm-dhr", "comemo")
MEMORY_VARIANTS = ("flamingo", "comemo")
DHR_VARIANTS = ("lvlm-dhr", "comemo")
MODEL_FORMAT = "longctx.comemo.v1"
CROSS_PLACEMENTS = ("reference", "first")
MEMORY_QUERIES = ("all", "text")
MEMORY_NORMS = ("shared", "own")
#: The memory-path layout of files written before the layout options existed (the shipped weights among them).
LEGACY_MEMORY = {"cross_placement": "first", "memory_queries": "text", "memory_norm": "own"}


@dataclass(kw_only=True)
class VisionConfig:
    """The small ViT that encodes each tile, and the pixel shuffle after it."""

    encoder: str = "vit"  # "vit" (small ViT built here) or "timm:<name>" / "open_clip:<name>" (apps.comemo.encoders)
    encoder_weights: str | None = None  # local weights file of a timm/open_clip encoder (nothing is downloaded)
    encoder_kwargs: dict = field(default_factory=dict)  # constructor kwargs of a timm/open_clip encoder (JSON values)
    tile: int = 32  # tile side in pixels (InternVL: 448; tiny here for the CPU)
    patch: int = 4  # ViT patch side in pixels -> (tile/patch)^2 patch tokens per tile
    dim: int = 96  # ViT width
    depth: int = 2  # ViT blocks
    num_heads: int = 4  # ViT heads
    shuffle: int = 2  # pixel-shuffle factor s: s*s neighbouring patch tokens fold into one token
    tokens_per_side: int = field(init=False)  # derived: T = tile / patch / shuffle (tokens per tile side)

    def __post_init__(self) -> None:
        if self.encoder != "vit" and not self.encoder.startswith(("timm:", "open_clip:")):
            raise ValueError(f"unknown vision encoder {self.encoder!r}; use 'vit', 'timm:<name>' or 'open_clip:<name>'")
        for name in ("tile", "patch", "dim", "depth", "num_heads", "shuffle"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"vision {name} must be a positive int, got {v!r}")
        if self.tile % (self.patch * self.shuffle):
            raise ValueError(f"tile ({self.tile}) must be a multiple of patch * shuffle ({self.patch * self.shuffle})")
        if self.dim % self.num_heads:
            raise ValueError(f"vision num_heads ({self.num_heads}) must divide vision dim ({self.dim})")
        self.tokens_per_side = self.tile // self.patch // self.shuffle


@dataclass(kw_only=True)
class CoMemoConfig:
    """A CoMemo model: variant, decoder sizes, vision encoder and input limits."""

    variant: str = "comemo"  # one of VARIANTS (see module docs)
    vocab_size: int = 320  # tokenizer size
    dim: int = 128  # decoder width
    depth: int = 4  # decoder layers
    num_heads: int = 4  # decoder heads
    mlp_ratio: float = 4.0  # decoder MLP width / dim
    cross_every: int = 2  # memory path: a gated cross-attention block every k-th layer (cross_placement; paper: 4)
    vision: VisionConfig = field(default_factory=VisionConfig)
    min_tiles: int = 1  # tiling: fewest tiles per image
    max_tiles: int = 6  # tiling: most tiles per image (InternVL: 12; 6 covers the detail task's grids)
    max_images: int = 64  # most images in one prompt
    max_context: int = 4096  # most tokens in the decoder sequence (prompt + answer)
    max_pixels: int = 1_048_576  # largest accepted image (width * height) before tiling
    backend: str = "auto"  # attention backend (core.attention)
    # a text label "image K" next to each image in the prompt: "before" (InternVL's "Image-K: <image>") or
    # "after" it (the label's tokens then see their image), so answers that name an image copy a label instead
    # of counting images; "none" keeps the original layout (and old files)
    image_labels: str = "none"
    # factor on the projected image tokens: at initialisation they are ~10x the norm of the token embeddings
    # (std 0.02), which drowns the text in the residual stream; 1.0 keeps the original (and old files)
    image_token_scale: float = 1.0
    # memory-path layout (files written before these options lack them and load with LEGACY_MEMORY):
    # "reference": a block before decoder layer i where (i + 1) % cross_every == 0 (CoMemo's released code);
    # "first": before layers 0, k, 2k, ... (the first layout here)
    cross_placement: str = "reference"
    memory_queries: str = "all"  # "all": every token queries the memory (the reference); "text": text tokens only
    memory_norm: str = "shared"  # "shared": one norm for text and memory (the reference); "own": a separate LayerNorm

    def __post_init__(self) -> None:
        if isinstance(self.vision, dict):
            self.vision = VisionConfig(**{k: v for k, v in self.vision.items() if k != "tokens_per_side"})
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {list(VARIANTS)}")
        for name in ("max_images", "max_context", "max_pixels", "min_tiles", "max_tiles"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.min_tiles > self.max_tiles:
            raise ValueError(f"min_tiles ({self.min_tiles}) must be <= max_tiles ({self.max_tiles})")
        if isinstance(self.image_labels, bool):  # files from the first version of the option (a flag: before)
            self.image_labels = "before" if self.image_labels else "none"
        if self.image_labels not in IMAGE_LABELS:
            raise ValueError(f"unknown image_labels {self.image_labels!r}; choose one of {list(IMAGE_LABELS)}")
        if not (isinstance(self.image_token_scale, (int, float)) and self.image_token_scale > 0):
            raise ValueError(f"image_token_scale must be a positive number, got {self.image_token_scale!r}")
        if self.uses_memory and not (isinstance(self.cross_every, int) and self.cross_every > 0):
            raise ValueError(f"variant {self.variant!r} needs cross_every > 0, got {self.cross_every!r}")
        for name, allowed in (("cross_placement", CROSS_PLACEMENTS), ("memory_queries", MEMORY_QUERIES),
                              ("memory_norm", MEMORY_NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"unknown {name} {getattr(self, name)!r}; choose one of {list(allowed)}")
        if self.uses_memory and self.cross_placement == "reference" and self.cross_every > self.depth:
            raise ValueError(f"cross_every ({self.cross_every}) > depth ({self.depth}) leaves no memory block")

    @property
    def cross_layers(self) -> list[int]:
        """Indices of the decoder layers preceded by a memory block (empty without a memory path)."""
        if not self.uses_memory:
            return []
        if self.cross_placement == "first":
            return list(range(0, self.depth, self.cross_every))
        return [i for i in range(self.depth) if (i + 1) % self.cross_every == 0]

    @property
    def uses_context(self) -> bool:
        return self.variant in CONTEXT_VARIANTS

    @property
    def uses_memory(self) -> bool:
        return self.variant in MEMORY_VARIANTS

    @property
    def uses_dhr(self) -> bool:
        return self.variant in DHR_VARIANTS

    def decoder_config(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size, dim=self.dim, depth=self.depth, num_heads=self.num_heads,
            mlp_ratio=self.mlp_ratio, cross_every=self.cross_every if self.uses_memory else 0, memory_dim=self.dim,
            cross_gate_init=0.0, backend=self.backend,
        )

    def to_json(self) -> str:
        d = asdict(self)
        d["vision"].pop("tokens_per_side")
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CoMemoConfig:
        """A config from :meth:`to_json`; keys missing from older files take the values of that time."""
        return cls(**{**LEGACY_MEMORY, **json.loads(text)})


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Next-token cross-entropy (logits at ``t`` against ``labels[t + 1]``, -100 ignored) and token accuracy."""
    logits = logits_BSV[:, :-1]
    labels = labels_BS[:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100)
    keep = labels != -100
    acc = (logits.argmax(-1)[keep] == labels[keep]).float().mean() if bool(keep.any()) else torch.tensor(0.0)
    return loss, {"loss": float(loss.detach()), "token_acc": float(acc)}


def normalise_tiles(tiles_NHWC: torch.Tensor) -> torch.Tensor:
    """uint8 ``(N, H, W, 3)`` -> float ``(N, 3, H, W)`` scaled to about [-2, 2]."""
    return (tiles_NHWC.permute(0, 3, 1, 2).float() / 255.0 - 0.5) / 0.25


class VisionEncoder(nn.Module):
    """Small ViT: patch embedding, learned positions, pre-norm blocks (no class token)."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.width = cfg.dim
        n = (cfg.tile // cfg.patch) ** 2
        self.patch_embed = nn.Conv2d(3, cfg.dim, cfg.patch, stride=cfg.patch)
        self.pos = nn.Parameter(torch.randn(n, cfg.dim) * 0.02)  # (P, vision_dim)
        self.blocks = nn.ModuleList(SelfAttentionBlock(cfg.dim, cfg.num_heads) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, tiles_N3HW: torch.Tensor) -> torch.Tensor:
        """``(N, 3, tile, tile)`` -> ``(N, P, vision_dim)`` patch tokens, row-major."""
        x = self.patch_embed(tiles_N3HW)  # (N, C, h, w)
        x = rearrange(x, "n c h w -> n (h w) c") + self.pos
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def pixel_shuffle(x_NPC: torch.Tensor, s: int) -> torch.Tensor:
    """InternVL's token reduction: ``(N, h*w, C)`` -> ``(N, (h/s)*(w/s), C*s*s)``, tokens row-major.

    Each output token concatenates the ``s x s`` block of input tokens it covers (row-major inside the block).
    """
    N, P, C = x_NPC.shape
    h = int(round(P ** 0.5))
    if h * h != P or h % s:
        raise ValueError(f"pixel_shuffle needs a square token grid divisible by {s}, got {P} tokens")
    return rearrange(x_NPC, "n (h s1 w s2) c -> n (h w) (s1 s2 c)", h=h // s, s1=s, s2=s)


class Projector(nn.Module):
    """InternVL's MLP projector: LayerNorm -> Linear -> GELU -> Linear into the decoder width."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(in_dim)
        self.fc1 = nn.Linear(in_dim, dim)
        self.fc2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


class CoMemoModel(nn.Module):
    """Vision encoder + pixel shuffle + projector + decoder (with cross blocks for memory variants).

    Inputs come from :func:`apps.comemo.batch.build_batch`; see the module docs for the paths.
    ``load_encoder_weights=False`` builds a timm/open_clip encoder without reading its original file (used
    when a saved CoMemo file supplies every weight).
    """

    def __init__(self, cfg: CoMemoConfig, *, load_encoder_weights: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        v = cfg.vision
        if v.encoder == "vit":
            self.vision = VisionEncoder(v)
        else:
            from apps.comemo.encoders import ExternalEncoder

            self.vision = ExternalEncoder(v, load_weights=load_encoder_weights)
        self.projector = Projector(self.vision.width * v.shuffle ** 2, cfg.dim)
        self.decoder = Decoder(cfg.decoder_config())
        if cfg.uses_memory and (cfg.cross_placement, cfg.memory_norm) != ("first", "own"):
            d = cfg.decoder_config()
            self.decoder.cross = nn.ModuleDict({
                str(i): GatedCrossAttentionBlock(
                    d.dim, d.num_heads, context_dim=d.dim, norm_context="shared" if cfg.memory_norm == "shared" else True,
                    gate_init=0.0, mlp_ratio=d.mlp_ratio, activation=d.activation, num_kv_heads=d.num_kv_heads,
                    norm_eps=d.norm_eps, bias=d.bias, backend=d.backend)
                for i in cfg.cross_layers})

    def image_tokens(self, tiles_N3HW: torch.Tensor) -> torch.Tensor:
        """``(N, 3, tile, tile)`` -> ``(N * T*T, dim)`` projected tokens, tiles in order, tokens row-major."""
        if tiles_N3HW.shape[0] == 0:
            return tiles_N3HW.new_zeros(0, self.cfg.dim)
        feats = pixel_shuffle(self.vision(tiles_N3HW), self.cfg.vision.shuffle)  # (N, T*T, C*s*s)
        img = self.projector(feats).flatten(0, 1)  # (N*T*T, dim)
        return img * self.cfg.image_token_scale if self.cfg.image_token_scale != 1.0 else img

    def decoder_inputs(self, batch) -> dict:
        """Keyword arguments of :meth:`Decoder.forward` for a :class:`~apps.comemo.batch.Batch`."""
        img_TD = self.image_tokens(batch.tiles)  # (total image tokens, dim)
        x_BSD = self.decoder.embed(batch.input_ids)
        slot = batch.image_slot
        if self.cfg.uses_context and bool((slot >= 0).any()):
            x_BSD = x_BSD.masked_scatter((slot >= 0)[..., None], img_TD[slot[slot >= 0]])
        kw = {"inputs_embeds": x_BSD, "position_ids": batch.position_ids, "padding_mask": batch.padding_mask}
        if self.cfg.uses_memory and batch.memory_index is not None and batch.memory_index.shape[1] > 0:
            kw["memory_BMD"] = img_TD[batch.memory_index.clamp(min=0)]  # (B, M, dim)
            kw["memory_position_ids"] = batch.memory_position_ids
            kw["memory_padding_mask"] = batch.memory_index < 0
            if self.cfg.memory_queries == "text" and bool((slot >= 0).any()):  # image slots query no memory
                bias = torch.zeros(slot.shape, dtype=x_BSD.dtype, device=x_BSD.device)
                kw["memory_attn_bias"] = bias.masked_fill(slot >= 0, float("-inf"))[:, None, :, None]
        return kw

    def forward(self, batch, *, attn_queries=None):
        """Decoder output (logits ``(B, S, vocab)``) for a batch."""
        return self.decoder(**self.decoder_inputs(batch), use_cache=False, attn_queries=attn_queries)

    def loss(self, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """Mean next-token cross-entropy over the labelled tokens; also token accuracy."""
        return lm_loss(self(batch).logits, batch.labels)

    @contextlib.contextmanager
    def memory_kv_cache(self):
        """Within the block, each memory block computes the memory's keys/values once per memory tensor and
        reuses them while the same memory comes back (decoding steps of one prompt); dropped on exit."""
        blocks = list(self.decoder.cross.values())
        for b in blocks:
            b.cache_memory_kv = True
        try:
            yield self
        finally:
            for b in blocks:
                b.cache_memory_kv = False
                b.clear_memory_kv()

    def gates(self) -> dict[str, float]:
        """tanh of every cross-attention gate (0 for variants without a memory path)."""
        out = {}
        for name, block in self.decoder.cross.items():
            out[f"layer{name}.attn"] = float(torch.tanh(block.attn_gate.detach()))
            out[f"layer{name}.ff"] = float(torch.tanh(block.ff_gate.detach()))
        return out

    def save(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
        """Weights as safetensors with the config in the header, written atomically."""
        from safetensors.torch import save_model

        path = Path(path)
        with atomic_path(path) as tmp:
            save_model(self, tmp, metadata={"format": MODEL_FORMAT, "config": self.cfg.to_json(), **(metadata or {})})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: str | torch.device = "cpu") -> CoMemoModel:
        path = Path(path)
        what = f"CoMemo weights written by apps.comemo.train (format {MODEL_FORMAT!r})"
        with open_safetensors(path, what=what) as f:
            meta = f.metadata() or {}
        if meta.get("format") != MODEL_FORMAT:
            raise ValueError(f"{path} is not a CoMemo weights file (format {meta.get('format')!r}, expected {MODEL_FORMAT!r})")
        model = cls(CoMemoConfig.from_json(meta["config"]), load_encoder_weights=False).to(device)
        load_safetensors_model(model, path, what=what, device=device)
        return model.eval()
