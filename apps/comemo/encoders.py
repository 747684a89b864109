"""Pretrained vision encoders for CoMemo: ``timm:<name>`` or ``open_clip:<name>`` ViTs from a local file.

Building and loading go through :mod:`core.infra.backbones` (local weights only, strict keys, constructor kwargs,
install hint). CoMemo
needs the patch tokens, not the pooled feature: timm's ``forward_features`` without its prefix (class /
register) tokens, open_clip's image tower with ``output_tokens``. The tokens must form a square grid of
``(tile / patch)**2`` tokens for the configured tile and patch (set ``img_size`` / ``image_size`` through
the encoder kwargs so the encoder takes ``tile``-pixel input).

When a saved CoMemo model is loaded, the encoder is built without its original file (its weights are in
the CoMemo file): ``load_weights=False`` builds it with :func:`core.infra.backbones.build_timm` /
:func:`core.infra.backbones.build_open_clip`.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ExternalEncoder"]


class ExternalEncoder(nn.Module):
    """A timm or open_clip ViT that maps tiles to patch tokens ``(N, P, width)``.

    Args:
        cfg: :class:`apps.comemo.model.VisionConfig` with ``encoder = "timm:<name>"`` or ``"open_clip:<name>"``,
            ``encoder_weights`` (a local file) and ``encoder_kwargs``.
        load_weights: load ``encoder_weights`` (False: build the architecture only; the caller loads weights).
    """

    def __init__(self, cfg, *, load_weights: bool = True) -> None:
        super().__init__()
        from core.infra import backbones

        self.cfg = cfg
        library, name = cfg.encoder.split(":", 1)
        kwargs = dict(cfg.encoder_kwargs or {})
        if load_weights and not cfg.encoder_weights:
            raise ValueError(f"vision encoder {cfg.encoder!r} needs a local weights file (encoder_weights); nothing is downloaded")
        if library == "timm":
            bb = (backbones.load_timm(name, cfg.encoder_weights, model_kwargs=kwargs) if load_weights
                  else backbones.build_timm(name, model_kwargs=kwargs))
            self.prefix = int(getattr(bb.model, "num_prefix_tokens", 0))
            self.width = int(bb.model.num_features)
        elif library == "open_clip":
            bb = (backbones.load_open_clip(name, cfg.encoder_weights, model_kwargs=kwargs) if load_weights
                  else backbones.build_open_clip(name, model_kwargs=kwargs))
            if not hasattr(bb.model, "output_tokens") or not hasattr(bb.model, "conv1"):
                raise ValueError(f"open_clip model {name!r} is not a ViT image tower with patch tokens")
            bb.model.output_tokens = True
            self.prefix = 0
            self.width = int(bb.model.conv1.out_channels)
        else:
            raise ValueError(f"unknown encoder library {library!r}; use 'timm:<name>' or 'open_clip:<name>'")
        model, mean, std = bb.model, bb.mean, bb.std
        self.library = library
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

    def forward(self, tiles_N3HW: torch.Tensor) -> torch.Tensor:
        """Tiles normalised by :func:`apps.comemo.model.normalise_tiles` -> ``(N, P, width)`` patch tokens."""
        x = (tiles_N3HW * 0.25 + 0.5 - self.mean) / self.std  # back to [0, 1], then the encoder's normalisation
        if self.library == "timm":
            tokens = self.model.forward_features(x)[:, self.prefix:]
        else:
            _, tokens = self.model(x)
        P = (self.cfg.tile // self.cfg.patch) ** 2
        if tokens.dim() != 3 or tokens.shape[1] != P:
            raise ValueError(
                f"encoder {self.cfg.encoder!r} gives {tuple(tokens.shape)} tokens for {self.cfg.tile}-px tiles; expected "
                f"(N, {P}, width) for patch {self.cfg.patch} (set the encoder's image size to the tile and --patch to its patch)"
            )
        return tokens
