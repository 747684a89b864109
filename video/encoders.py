"""Frame encoders: a registry of ``name -> module`` mapping RGB frames to a few tokens per frame.

Names:
    ``tiny``: the default small CNN trained by ``python -m video.train`` (16 tokens per frame).
    ``open_clip:<model>``: an open_clip vision tower; ``weights`` is a local checkpoint file.
    ``timm:<model>``: a timm backbone's final feature map as tokens; ``weights`` is a local file.

Nothing is downloaded: the open_clip and timm paths need ``weights`` (a local file) and their package
(``pip install 'longctx-suite[backbones]'``); both are imported only when asked for. They load through
:mod:`core.infra.backbones`: keys must match exactly unless ``strict=False``, and ``encoder_kwargs`` reach the
model's constructor (``{"img_size": 64}`` for timm, ``{"vision_cfg": {"image_size": 64}}`` for open_clip).

Every encoder takes ``(N, 3, H, W)`` uint8 or float in ``[0, 255]`` and returns ``(N, T, dim)``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from core.infra.backbones import load_open_clip, load_state_dict_file, load_timm, load_weights

logger = logging.getLogger(__name__)

__all__ = ["TinyFrameEncoder", "build_frame_encoder", "ENCODER_PREFIXES", "load_state_file"]

ENCODER_PREFIXES = ("tiny", "open_clip:", "timm:")
_MEAN = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1) * 255
_STD = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1) * 255


def _prep(frames_N3HW: torch.Tensor, size: int) -> torch.Tensor:
    x = frames_N3HW.float()
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    return (x - _MEAN.to(x.device)) / _STD.to(x.device)


class TinyFrameEncoder(nn.Module):
    """Four stride-2 conv layers on a ``input_size`` square frame; the final grid cells are the tokens.

    Args:
        dim: token features.
        input_size: frames are resized to ``input_size x input_size``.
        width: channels of the first conv (doubled twice).
        grid: the final feature map is average-pooled to ``grid x grid`` tokens.
    """

    def __init__(self, *, dim: int = 128, input_size: int = 32, width: int = 32, grid: int = 2) -> None:
        super().__init__()
        if input_size % 8:
            raise ValueError(f"input_size must be a multiple of 8, got {input_size}")
        self.dim, self.input_size = dim, input_size
        c = [3, width, 2 * width, 4 * width]
        layers = []
        for a, b in zip(c[:-1], c[1:]):
            layers += [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.GroupNorm(8, b), nn.GELU()]
        self.convs = nn.Sequential(*layers)
        self.proj = nn.Conv2d(c[-1], dim, 1)
        self.grid = grid
        self.num_tokens = grid**2

    def forward(self, frames_N3HW: torch.Tensor) -> torch.Tensor:
        """``(N, 3, H, W)`` in [0, 255] -> ``(N, grid^2, dim)``."""
        h = self.proj(self.convs(_prep(frames_N3HW, self.input_size)))  # (N, dim, s, s)
        h = F.adaptive_avg_pool2d(h, self.grid)  # (N, dim, grid, grid)
        return h.flatten(2).transpose(1, 2)


def load_state_file(path) -> dict[str, torch.Tensor]:
    """Tensors from a local ``.safetensors`` or PyTorch checkpoint (:func:`core.infra.backbones.load_state_dict_file`)."""
    return load_state_dict_file(path)


class _TimmEncoder(nn.Module):
    def __init__(self, model: nn.Module, input_size: int) -> None:
        super().__init__()
        self.model, self.input_size = model, input_size
        self.dim = int(getattr(model, "num_features"))

    def forward(self, frames_N3HW: torch.Tensor) -> torch.Tensor:
        feats = self.model.forward_features(_prep(frames_N3HW, self.input_size))
        if feats.dim() == 4:  # (N, C, h, w) conv map
            return feats.flatten(2).transpose(1, 2)
        return feats  # (N, T, C) transformer tokens


class _OpenClipEncoder(nn.Module):
    def __init__(self, visual: nn.Module, input_size: int, dim: int, mean, std) -> None:
        super().__init__()
        self.visual, self.input_size, self.dim = visual, input_size, dim
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, frames_N3HW: torch.Tensor) -> torch.Tensor:
        x = F.interpolate(frames_N3HW.float(), size=(self.input_size,) * 2, mode="bilinear", antialias=True)
        return self.visual((x - self.mean) / self.std)[:, None, :]  # one token per frame (the pooled embedding)


def build_frame_encoder(name: str = "tiny", *, weights=None, encoder_kwargs: Mapping | None = None,
                        strict: bool = True, **kwargs) -> nn.Module:
    """Build a frame encoder by registry name (see the module docstring).

    Args:
        name: ``"tiny"``, ``"open_clip:<model>"`` or ``"timm:<model>"``.
        weights: local weights file; required for open_clip and timm (nothing is downloaded).
        encoder_kwargs: constructor arguments of the model: ``TinyFrameEncoder`` options for ``tiny``,
            ``timm.create_model`` / ``open_clip.create_model`` arguments for the others.
        strict: weights must match the model key for key and shape for shape (``False``: load what
            fits and warn).
        kwargs: ``TinyFrameEncoder`` options (``dim``, ``input_size``, ``width``), or ``input_size`` for others.

    Returns:
        A module with attributes ``dim`` (token features) mapping ``(N, 3, H, W)`` to ``(N, T, dim)``.
    """
    if encoder_kwargs is not None and not isinstance(encoder_kwargs, Mapping):
        raise ValueError(f"encoder_kwargs must be a dict (JSON object), got {type(encoder_kwargs).__name__}")
    ekw = dict(encoder_kwargs or {})
    if name == "tiny":
        enc = TinyFrameEncoder(**{**kwargs, **ekw})
        if weights is not None:
            load_weights(enc, load_state_dict_file(weights), strict=strict, source=f"weights {str(weights)!r}")
        return enc
    if name.startswith(("timm:", "open_clip:")):
        unknown = sorted(set(kwargs) - {"input_size"})
        if unknown:
            raise ValueError(f"{name!r} takes input_size and encoder_kwargs, not {unknown}")
        if weights is None:
            raise ValueError(f"{name!r} needs weights=PATH (a local file); nothing is downloaded")
        if name.startswith("timm:"):
            bb = load_timm(name[len("timm:"):], weights, model_kwargs=ekw, strict=strict)
            return _TimmEncoder(bb.model, kwargs.get("input_size", bb.input_size))
        bb = load_open_clip(name[len("open_clip:"):], weights, model_kwargs=ekw, strict=strict)
        return _OpenClipEncoder(bb.model, kwargs.get("input_size", bb.input_size), bb.num_features, bb.mean, bb.std)
    raise ValueError(f"unknown frame encoder {name!r}; use 'tiny', 'open_clip:<model>' or 'timm:<model>'")
