"""Pretrained vision encoders for CoMemo: ``timm:<name>`` or ``open_clip:<name>`` ViTs from a local file.

Loading goes through :mod:`core.backbones` (local weights only, strict keys, constructor kwargs). CoMemo
needs the patch tokens, not the pooled feature: timm's ``forward_features`` without its prefix (class /
register) tokens, open_clip's image tower with ``output_tokens``. The tokens must form a square grid of
``(tile / patch)**2`` tokens for the configured tile and patch (set ``img_size`` / ``image_size`` through
the encoder kwargs so the encoder takes ``tile``-pixel input).

When a saved CoMemo model is loaded, the encoder is built without its original file (its weights are in
the CoMemo file): ``load_weights=False``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["ExternalEncoder"]


def _lib(module: str):
    """Import an optional encoder library, with the install command when it is missing."""
    import importlib

    from core.backbones import INSTALL_HINT

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{module} is needed for this vision encoder: {INSTALL_HINT}") from e


def _merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


class ExternalEncoder(nn.Module):
    """A timm or open_clip ViT that maps tiles to patch tokens ``(N, P, width)``.

    Args:
        cfg: :class:`apps.comemo.model.VisionConfig` with ``encoder = "timm:<name>"`` or ``"open_clip:<name>"``,
            ``encoder_weights`` (a local file) and ``encoder_kwargs``.
        load_weights: load ``encoder_weights`` (False: build the architecture only; the caller loads weights).
    """

    def __init__(self, cfg, *, load_weights: bool = True) -> None:
        super().__init__()
        from core import backbones

        self.cfg = cfg
        library, name = cfg.encoder.split(":", 1)
        kwargs = dict(cfg.encoder_kwargs or {})
        if load_weights and not cfg.encoder_weights:
            raise ValueError(f"vision encoder {cfg.encoder!r} needs a local weights file (encoder_weights); nothing is downloaded")
        if library == "timm":
            if load_weights:
                bb = backbones.load_timm(name, cfg.encoder_weights, model_kwargs=kwargs)
                model, mean, std = bb.model, bb.mean, bb.std
            else:
                timm = _lib("timm")
                model = timm.create_model(name, pretrained=False, **{"num_classes": 0, **backbones.resolve_timm_kwargs(kwargs)})
                pc = dict(getattr(model, "pretrained_cfg", None) or {})
                mean, std = pc.get("mean", backbones.IMAGENET_MEAN), pc.get("std", backbones.IMAGENET_STD)
            self.prefix = int(getattr(model, "num_prefix_tokens", 0))
            self.width = int(model.num_features)
        elif library == "open_clip":
            if load_weights:
                bb = backbones.load_open_clip(name, cfg.encoder_weights, model_kwargs=kwargs)
                model, mean, std = bb.model, bb.mean, bb.std
            else:
                open_clip = _lib("open_clip")
                base = open_clip.get_model_config(name)
                if base is None:
                    raise ValueError(f"unknown open_clip model {name!r} (see open_clip.list_models())")
                over = {k: (_merge(base[k], v) if isinstance(v, Mapping) and isinstance(base.get(k), dict) else v)
                        for k, v in kwargs.items()}
                full = open_clip.create_model(name, pretrained=None, **over)
                model = full.visual
                pre = open_clip.get_model_preprocess_cfg(full) or {}
                mean = pre.get("mean", backbones.OPENAI_CLIP_MEAN)
                std = pre.get("std", backbones.OPENAI_CLIP_STD)
            if not hasattr(model, "output_tokens") or not hasattr(model, "conv1"):
                raise ValueError(f"open_clip model {name!r} is not a ViT image tower with patch tokens")
            model.output_tokens = True
            self.prefix = 0
            self.width = int(model.conv1.out_channels)
        else:
            raise ValueError(f"unknown encoder library {library!r}; use 'timm:<name>' or 'open_clip:<name>'")
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
