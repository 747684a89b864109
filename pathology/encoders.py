"""Patch encoders: a registry of names -> models that turn RGB patches into feature vectors.

Names:
- ``default`` (alias ``longctx-small``): a small CNN this project trains on synthetic tiles
  (``pathology/weights/patch_encoder_small.safetensors``). It is a stand-in so the pipeline runs out of
  the box, not a histology foundation model.
- ``timm:<model_name>``: any timm model, weights from a local file (``weights=PATH``; safetensors or
  a torch state dict). Needs ``pip install timm``.
- ``open_clip:<model_name>``: the image tower of an open_clip model, weights from a local file.
  Needs ``pip install open_clip_torch``.

Nothing is downloaded: the timm/open_clip paths refuse to run without a local weights file.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["PatchEncoder", "SmallPatchCNN", "build_encoder", "load_state_dict_file", "ENCODER_NAMES",
           "DEFAULT_WEIGHTS"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_WEIGHTS = os.path.join(os.path.dirname(__file__), "weights", "patch_encoder_small.safetensors")
ENCODER_NAMES = ("default", "longctx-small", "timm:<name>", "open_clip:<name>")


class SmallPatchCNN(nn.Module):
    """Five conv stages (stride 2 each) + global average pooling + linear projection to ``dim``.

    Input (B, 3, H, W) normalized RGB; output (B, dim). ~1.2M parameters at the defaults.
    """

    def __init__(self, *, dim: int = 256, widths: tuple[int, ...] = (32, 64, 128, 192, 256), num_classes: int = 0):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for c in widths:
            layers += [nn.Conv2d(c_in, c, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(c), nn.GELU(),
                       nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.GELU()]
            c_in = c
        self.features = nn.Sequential(*layers)
        self.proj = nn.Linear(c_in, dim)
        self.dim = dim
        # Optional classifier used only while training the encoder (dropped in inference use).
        self.head = nn.Linear(dim, num_classes) if num_classes else None

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        h = self.features(x_BCHW).mean(dim=(2, 3))  # (B, C)
        return self.proj(h)  # (B, dim)


@dataclass
class PatchEncoder:
    """A model plus its preprocessing. ``encode(uint8 (B, H, W, 3)) -> float32 (B, dim)``."""

    name: str
    model: nn.Module
    dim: int
    input_size: int  # patches are resized to this side before the model
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def preprocess(self, patches_BHWC: torch.Tensor) -> torch.Tensor:
        """uint8 (B, H, W, 3) -> normalized float (B, 3, S, S) on the encoder's device."""
        x = patches_BHWC.to(self.device).permute(0, 3, 1, 2).float() / 255.0  # (B, 3, H, W)
        if x.shape[-1] != self.input_size or x.shape[-2] != self.input_size:
            x = nn.functional.interpolate(x, size=(self.input_size, self.input_size), mode="bilinear",
                                          antialias=True, align_corners=False)
        mean = torch.tensor(self.mean, device=x.device).view(1, 3, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(1, 3, 1, 1)
        return (x - mean) / std

    @torch.no_grad()
    def encode(self, patches_BHWC: torch.Tensor | np.ndarray) -> torch.Tensor:
        if isinstance(patches_BHWC, np.ndarray):
            patches_BHWC = torch.from_numpy(patches_BHWC)
        if patches_BHWC.ndim != 4 or patches_BHWC.shape[-1] != 3:
            raise ValueError(f"patches must be (B, H, W, 3) uint8, got shape {tuple(patches_BHWC.shape)}")
        self.model.eval()
        out = self.model(self.preprocess(patches_BHWC))
        if out.ndim > 2:  # some towers return tokens; pool them
            out = out.flatten(2).mean(-1) if out.ndim == 4 else out.mean(1)
        return out.float().cpu()


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from ``.safetensors`` or a torch file (``.pt``/``.pth``/``.bin``; tensors only)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file not found: {path!r}")
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    try:
        sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{path!r} is neither safetensors nor a torch state dict: {e}") from e
    for key in ("state_dict", "model", "module"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise ValueError(f"{path!r} holds a {type(sd).__name__}, expected a dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _default(weights: str | None, device: torch.device) -> PatchEncoder:
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = weights or DEFAULT_WEIGHTS
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"default encoder weights not found at {path!r}; train them with "
            "`python -m pathology.train_encoder --out pathology/weights` or pass --weights PATH"
        )
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    dim = int(meta.get("dim", 256))
    input_size = int(meta.get("input_size", 128))
    widths = tuple(int(w) for w in meta.get("widths", "32,64,128,192,256").split(","))
    model = SmallPatchCNN(dim=dim, widths=widths)
    sd = {k: v for k, v in load_file(path).items() if not k.startswith("head.")}
    model.load_state_dict(sd)
    return PatchEncoder("default", model.to(device).eval(), dim, input_size, device=device)


def _timm(name: str, weights: str | None, device: torch.device) -> PatchEncoder:
    try:
        import timm
    except ImportError as e:
        raise ImportError(f"encoder 'timm:{name}' needs timm: pip install timm") from e
    if not weights:
        raise ValueError(f"encoder 'timm:{name}' needs --weights PATH (a local file); nothing is downloaded")
    model = timm.create_model(name, pretrained=False, num_classes=0)
    sd = load_state_dict_file(weights)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.startswith(("head", "fc."))]
    if missing:
        raise ValueError(f"weights {weights!r} do not fit timm model {name!r}: missing {missing[:5]}...")
    if unexpected:
        logger.warning("ignoring %d unexpected keys in %s (e.g. %s)", len(unexpected), weights, unexpected[:3])
    cfg = getattr(model, "pretrained_cfg", {}) or {}
    size = int((cfg.get("input_size") or (3, 224, 224))[-1])
    mean = tuple(cfg.get("mean", IMAGENET_MEAN))
    std = tuple(cfg.get("std", IMAGENET_STD))
    return PatchEncoder(f"timm:{name}", model.to(device).eval(), int(model.num_features), size, mean, std, device)


def _open_clip(name: str, weights: str | None, device: torch.device) -> PatchEncoder:
    try:
        import open_clip
    except ImportError as e:
        raise ImportError(f"encoder 'open_clip:{name}' needs open_clip: pip install open_clip_torch") from e
    if not weights:
        raise ValueError(f"encoder 'open_clip:{name}' needs --weights PATH (a local file); nothing is downloaded")
    model = open_clip.create_model(name, pretrained=None)
    sd = load_state_dict_file(weights)
    if any(k.startswith("visual.") for k in sd):
        sd = {k.removeprefix("visual."): v for k, v in sd.items() if k.startswith("visual.")}
    visual = model.visual
    missing, _ = visual.load_state_dict(sd, strict=False)
    if missing:
        raise ValueError(f"weights {weights!r} do not fit open_clip model {name!r}: missing {missing[:5]}...")
    size = visual.image_size[0] if isinstance(getattr(visual, "image_size", 224), (tuple, list)) else int(getattr(visual, "image_size", 224))
    mean = tuple(getattr(visual, "image_mean", None) or (0.48145466, 0.4578275, 0.40821073))
    std = tuple(getattr(visual, "image_std", None) or (0.26862954, 0.26130258, 0.27577711))
    dim = int(getattr(visual, "output_dim", 0) or model.text_projection.shape[-1])
    return PatchEncoder(f"open_clip:{name}", visual.to(device).eval(), dim, int(size), mean, std, device)


def build_encoder(name: str = "default", *, weights: str | os.PathLike | None = None, device=None) -> PatchEncoder:
    """Build a patch encoder by registry name (see module docstring)."""
    dev = _resolve_device(device)
    w = os.fspath(weights) if weights is not None else None
    if w is not None and not os.path.isfile(w):
        raise FileNotFoundError(f"weights file not found: {w!r}")
    if name in ("default", "longctx-small"):
        return _default(w, dev)
    if name.startswith("timm:") and len(name) > 5:
        return _timm(name[5:], w, dev)
    if name.startswith("open_clip:") and len(name) > 10:
        return _open_clip(name[10:], w, dev)
    raise ValueError(f"unknown encoder {name!r}; accepted: {', '.join(ENCODER_NAMES)}")
