"""The host: a small multimodal decoder (core's :class:`~core.decoder.Decoder`) that reads images as tokens.

Sequence layout (one demonstration = ``tokens_per_demo`` tokens)::

    [img patch 0] ... [img patch P-1] [label] [img patch 0] ... [label] ... [img patch 0] ... [img patch P-1]
                                  ^ predicts the label                                          ^ query

Each image ``(size, size)`` is cut into ``P = (size / patch)²`` patches, each flattened and projected to
``dim`` (plus a learned patch-index embedding); a label token is the decoder's token embedding of its id.
Optionally (``image_summary``) every image token and the demo's label token also carry a projection of the
whole image, scaled by ``summary_scale`` (it lets one attention hop match a query to its class's labels; at
scale 1.0 the projection drowned the patch features and training stayed at ln 16, at 0.1 a 2-way host reached
0.97+ accuracy after four shots within 100 steps; off by default until a host trained with it is measured). The
output at an image's last patch predicts its label id (``0..num_labels-1``); the output at a label token is
trained to predict ``next_id`` ("another image follows"), so every answer token has a well-defined output.

Weights: :meth:`EMLoCHost.save` / :meth:`EMLoCHost.load` (safetensors with the config in the header).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from einops import rearrange
from torch import nn

from core.decoder import Decoder, DecoderConfig
from core.infra.fileio import atomic_path, load_safetensors_model, open_safetensors

__all__ = ["HostConfig", "EMLoCHost", "HOST_FORMAT"]

HOST_FORMAT = "longctx.emloc.host.v1"
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "host.safetensors"  # shipped host (python -m apps.emloc.ship)


@dataclass(kw_only=True)
class HostConfig:
    """Sizes of an :class:`EMLoCHost`."""

    num_labels: int = 16  # label ids the model can answer with
    image_size: int = 16  # image side in pixels
    patch: int = 8  # patch side; an image gives (image_size / patch)² tokens
    dim: int = 128  # decoder width
    depth: int = 4  # decoder layers
    num_heads: int = 4  # query heads
    num_kv_heads: int = 2  # key/value heads (GQA keeps the cache small)
    image_summary: bool = False  # add a whole-image projection to every image token and to the demo's label token
    summary_scale: float = 0.1  # factor on that projection: at 1.0 it drowns the patch features and training stalls at ln(num_labels)
    tokens_per_image: int = field(init=False)  # derived: (image_size / patch)²
    next_id: int = field(init=False)  # derived: token id the label positions predict
    vocab_size: int = field(init=False)  # derived: num_labels + 1

    def __post_init__(self) -> None:
        if self.image_size % self.patch != 0:
            raise ValueError(f"patch ({self.patch}) must divide image_size ({self.image_size})")
        if not self.summary_scale > 0:
            raise ValueError(f"summary_scale must be > 0, got {self.summary_scale!r}")
        if not (isinstance(self.num_labels, int) and self.num_labels >= 2):
            raise ValueError(f"num_labels must be an int >= 2, got {self.num_labels!r}")
        self.tokens_per_image = (self.image_size // self.patch) ** 2
        self.next_id = self.num_labels
        self.vocab_size = self.num_labels + 1

    @property
    def tokens_per_demo(self) -> int:
        return self.tokens_per_image + 1

    def to_json(self) -> str:
        return json.dumps({k: v for k, v in asdict(self).items() if k not in ("tokens_per_image", "next_id", "vocab_size")}, sort_keys=True)


class EMLoCHost(nn.Module):
    """Image-token embedder + :class:`~core.decoder.Decoder` (see module docs).

    Attributes:
        patch_proj: ``(patch², dim)`` linear patch embedding; patch_pos: ``(P, dim)`` patch-index embedding.
        decoder: the causal decoder (its ``embed`` holds the label tokens).
    """

    def __init__(self, config: HostConfig | None = None):
        super().__init__()
        c = self.config = config or HostConfig()
        self.patch_proj = nn.Linear(c.patch * c.patch, c.dim)
        self.patch_pos = nn.Parameter(torch.randn(c.tokens_per_image, c.dim) * 0.02)
        if c.image_summary:
            self.image_proj = nn.Linear(c.image_size * c.image_size, c.dim)  # whole image -> summary
            self.label_mix = nn.Linear(c.dim, c.dim)  # summary -> what the label token carries of its image
            nn.init.normal_(self.label_mix.weight, std=0.02)  # small at first: the label id dominates its token
            nn.init.zeros_(self.label_mix.bias)
        self.decoder = Decoder(
            DecoderConfig(vocab_size=c.vocab_size, dim=c.dim, depth=c.depth, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads)
        )

    def embed_images(self, images: torch.Tensor, *, return_summary: bool = False):
        """``(..., size, size)`` images -> ``(..., P, dim)`` image tokens (and the ``(..., dim)`` summaries)."""
        c = self.config
        if images.shape[-2:] != (c.image_size, c.image_size):
            raise ValueError(f"images must be (..., {c.image_size}, {c.image_size}), got {tuple(images.shape)}")
        lead = images.shape[:-2]
        x = images.reshape(-1, c.image_size, c.image_size).float()
        # (N, size, size) -> (N, P, patch*patch)
        x = rearrange(x, "n (h p) (w q) -> n (h w) (p q)", p=c.patch, q=c.patch)
        tok = self.patch_proj(x) + self.patch_pos  # (N, P, dim)
        summary = None
        if c.image_summary:
            summary = c.summary_scale * self.image_proj(x.flatten(1))  # (N, dim); pixel order does not matter for a Linear
            tok = tok + summary[:, None]
        tok = tok.reshape(*lead, c.tokens_per_image, c.dim)
        if return_summary:
            return tok, None if summary is None else summary.reshape(*lead, c.dim)
        return tok

    def embed_demos(self, images_BKHW: torch.Tensor, labels_BK: torch.Tensor) -> torch.Tensor:
        """Demonstrations ``(B, K, size, size)`` + labels ``(B, K)`` -> ``(B, K * (P + 1), dim)`` embeddings."""
        img, summary = self.embed_images(images_BKHW, return_summary=True)  # (B, K, P, dim), (B, K, dim)
        lab = self.decoder.embed(labels_BK.long())  # (B, K, dim)
        if summary is not None:
            lab = lab + self.label_mix(summary)
        lab = lab[:, :, None]  # (B, K, 1, dim)
        return torch.cat([img, lab], dim=2).flatten(1, 2)  # (B, K*(P+1), dim)

    def answer_mask(self, num_demos: int) -> torch.Tensor:
        """Bool ``(K * (P + 1),)``: True at each demo's last image patch, the token whose output is the label
        prediction (EMLoC's answer tokens: always kept, their attention scores the rest, their output
        distribution is what the JS bound protects)."""
        P = self.config.tokens_per_image
        m = torch.zeros(num_demos, P + 1, dtype=torch.bool)
        m[:, P - 1] = True
        return m.flatten()

    def fingerprint(self) -> str:
        """sha256 (16 hex digits) over the config and every weight: names the exact model a memory came from."""
        h = hashlib.sha256(self.config.to_json().encode())
        for name, t in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]

    def save(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
        """Weights as safetensors with the config in the header, written atomically."""
        from safetensors.torch import save_model

        path = Path(path)
        with atomic_path(path) as tmp:
            save_model(self, tmp, metadata={"format": HOST_FORMAT, "config": self.config.to_json(), **(metadata or {})})
        return path

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, *, device: torch.device | str = "cpu") -> EMLoCHost:
        """A host saved by :meth:`save` (strict keys), in eval mode; without ``path`` the shipped default
        (:data:`DEFAULT_WEIGHTS`, card beside it)."""
        path = Path(DEFAULT_WEIGHTS if path is None else path)
        what = f"EMLoC host weights written by apps.emloc.train (format {HOST_FORMAT!r})"
        with open_safetensors(path, what=what) as f:
            meta = f.metadata() or {}
        if meta.get("format") != HOST_FORMAT:
            raise ValueError(f"{path} is not an EMLoC host file (format {meta.get('format')!r}, expected {HOST_FORMAT!r})")
        cfg = json.loads(meta["config"])
        if cfg.get("image_summary") and "summary_scale" not in cfg:
            cfg["summary_scale"] = 1.0  # files from before the option used the projection unscaled
        model = cls(HostConfig(**cfg))
        load_safetensors_model(model, path, what=what, device=device)
        return model.eval()
