"""Patch encoders: a registry of names -> models that turn RGB patches into feature vectors.

Names:
- ``default`` (alias ``longctx-small``): a small CNN this project trains on synthetic tiles
  (``pathology/weights/patch_encoder_small.safetensors``). It is a stand-in so the pipeline runs out of
  the box, not a histology foundation model.
- presets of pathology foundation models (timm architectures with their published constructor
  arguments; weights are the model's own file, downloaded by the user from its model card):
  ``uni`` (UNI, ViT-L/16), ``uni2-h`` (UNI2-h, ViT-H/14 with 8 register tokens), ``virchow2``
  (Virchow2, ViT-H/14 with 4 register tokens, class token + mean patch token), ``gigapath``
  (Prov-GigaPath tile encoder, ViT-g). CONCH is not a preset: it needs the CONCH fork of open_clip.
- ``timm:<model_name>``: any timm model, weights from a local file (``weights=PATH``; safetensors or
  a torch state dict).
- ``open_clip:<model_name>``: the image tower of an open_clip model, weights from a local file.

Loading goes through :mod:`core.infra.backbones`: keys must match exactly (``strict=False``, the CLI's
``--allow-partial-weights``, relaxes that) and ``encoder_kwargs`` reach the model's constructor
(``--encoder-kwargs '{"img_size": 448}'``), overriding a preset's. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from core.infra.backbones import load_open_clip, load_state_dict_file, load_timm, load_weights
from core.infra.fileio import open_safetensors

logger = logging.getLogger(__name__)

__all__ = ["PatchEncoder", "SmallPatchCNN", "EncoderPreset", "PRESETS", "ClsMeanPool", "build_encoder",
           "encoder_settings", "load_state_dict_file", "ENCODER_NAMES", "DEFAULT_WEIGHTS"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
DEFAULT_WEIGHTS = os.path.join(os.path.dirname(__file__), "weights", "patch_encoder_small.safetensors")

@dataclass(frozen=True)
class EncoderPreset:
    """A named foundation model: the timm architecture, its constructor arguments and preprocessing."""

    timm_name: str  # timm architecture the weights belong to
    kwargs: dict  # constructor arguments (layer classes by timm.layers name, so the preset stays JSON)
    input_size: int  # side the patches are resized to
    pool: str = "model"  # "model": the model's own output; "cls+mean": class token ⊕ mean of the patch tokens
    card: str = ""  # model card the arguments come from
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD


# Arguments as published on each model card (``timm.create_model(..., **timm_kwargs)``) and in
# TRIDENT's encoder registry (mahmoodlab/TRIDENT, trident/patch_encoder_models/load.py).
PRESETS: dict[str, EncoderPreset] = {
    # UNI: ViT-L/16, LayerScale 1e-5, 1024-d class token. https://huggingface.co/MahmoodLab/UNI
    "uni": EncoderPreset("vit_large_patch16_224", {
        "img_size": 224, "patch_size": 16, "init_values": 1e-5, "num_classes": 0, "dynamic_img_size": True},
        224, card="https://huggingface.co/MahmoodLab/UNI"),
    # UNI2-h: ViT-H/14 (24 blocks, width 1536), SwiGLU MLP, 8 register tokens, 1536-d class token.
    # https://huggingface.co/MahmoodLab/UNI2-h
    "uni2-h": EncoderPreset("vit_giant_patch14_224", {
        "img_size": 224, "patch_size": 14, "depth": 24, "num_heads": 24, "init_values": 1e-5, "embed_dim": 1536,
        "mlp_ratio": 2.66667 * 2, "num_classes": 0, "no_embed_class": True, "mlp_layer": "SwiGLUPacked",
        "act_layer": "silu", "reg_tokens": 8, "dynamic_img_size": True},
        224, card="https://huggingface.co/MahmoodLab/UNI2-h"),
    # Virchow2: ViT-H/14, SwiGLU MLP, 4 register tokens; embedding = class token ⊕ mean of the patch
    # tokens (registers excluded), 2560-d. https://huggingface.co/paige-ai/Virchow2
    "virchow2": EncoderPreset("vit_huge_patch14_224", {
        "img_size": 224, "init_values": 1e-5, "num_classes": 0, "reg_tokens": 4, "mlp_ratio": 5.3375,
        "global_pool": "", "dynamic_img_size": True, "mlp_layer": "SwiGLUPacked", "act_layer": "silu"},
        224, pool="cls+mean", card="https://huggingface.co/paige-ai/Virchow2"),
    # Prov-GigaPath tile encoder: ViT-g layout with 16-px patches (40 blocks, width 1536), 1536-d.
    # https://huggingface.co/prov-gigapath/prov-gigapath
    "gigapath": EncoderPreset("vit_giant_patch14_dinov2", {
        "img_size": 224, "in_chans": 3, "patch_size": 16, "embed_dim": 1536, "depth": 40, "num_heads": 24,
        "init_values": 1e-5, "mlp_ratio": 5.33334, "num_classes": 0, "dynamic_img_size": True},
        224, card="https://huggingface.co/prov-gigapath/prov-gigapath"),
}
ENCODER_NAMES = ("default", "longctx-small", *PRESETS, "timm:<name>", "open_clip:<name>")


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



class ClsMeanPool(nn.Module):
    """``model.forward_features`` tokens -> class token ⊕ mean of the patch tokens (prefix tokens skipped).

    Output (B, 2·D). Used by Virchow2, whose embedding is this concatenation.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 1))

    def forward(self, x_BCHW: torch.Tensor) -> torch.Tensor:
        tok_BTD = self.model.forward_features(x_BCHW)
        return torch.cat([tok_BTD[:, 0], tok_BTD[:, self.num_prefix_tokens:].mean(1)], dim=-1)


def _resolve_device(device) -> torch.device:
    from core.infra.device import resolve_device

    return resolve_device(device)


def _default(weights: str | None, device: torch.device, strict: bool) -> PatchEncoder:
    path = weights or DEFAULT_WEIGHTS
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"default encoder weights not found at {path!r}; train them with "
            "`python -m pathology.train_encoder --out pathology/weights` or pass --weights PATH"
        )
    with open_safetensors(path, what="patch encoder weights written by pathology.train_encoder") as f:
        meta = f.metadata() or {}
    dim = int(meta.get("dim", 256))
    input_size = int(meta.get("input_size", 128))
    widths = tuple(int(w) for w in meta.get("widths", "32,64,128,192,256").split(","))
    model = SmallPatchCNN(dim=dim, widths=widths)
    load_weights(model, load_state_dict_file(path), strict=strict, source=f"weights {path!r}",
                 ignore_unexpected=("head.",))  # the training-time classifier is not part of the encoder
    return PatchEncoder("default", model.to(device).eval(), dim, input_size, device=device)


def _split(name: str) -> tuple[str, str]:
    """``(kind, arch)``: kind is 'default', 'preset', 'timm' or 'open_clip'."""
    if name in ("default", "longctx-small"):
        return "default", name
    if name in PRESETS:
        return "preset", name
    if name.startswith("timm:") and len(name) > 5:
        return "timm", name[5:]
    if name.startswith("open_clip:") and len(name) > 10:
        return "open_clip", name[10:]
    raise ValueError(f"unknown encoder {name!r}; accepted: {', '.join(ENCODER_NAMES)}")


def _check_kwargs(encoder_kwargs) -> dict[str, Any]:
    if encoder_kwargs is None:
        return {}
    if not isinstance(encoder_kwargs, Mapping):
        raise ValueError(f"encoder_kwargs must be a dict (JSON object), got {type(encoder_kwargs).__name__}")
    return dict(encoder_kwargs)


def build_encoder(name: str = "default", *, weights: str | os.PathLike | None = None, device=None,
                  encoder_kwargs: Mapping[str, Any] | None = None, strict: bool = True) -> PatchEncoder:
    """Build a patch encoder by registry name (see the module docstring).

    Args:
        name: ``default``, a preset name (``uni``, ``uni2-h``, ``virchow2``, ``gigapath``),
            ``timm:<model>`` or ``open_clip:<model>``.
        weights: local weights file (required for everything but ``default``; nothing is downloaded).
        device: torch device; ``None`` picks CUDA when present, else CPU.
        encoder_kwargs: constructor arguments of the model (timm / open_clip), overriding a preset's
            (``{"img_size": 448}``, ``{"depth": 2}``); layer classes by name (``"SwiGLUPacked"``).
        strict: weights must match the model key for key and shape for shape (``False``: load what
            fits and warn — the CLI's ``--allow-partial-weights``).
    """
    kind, arch = _split(name)
    kw = _check_kwargs(encoder_kwargs)
    dev = _resolve_device(device)
    w = os.fspath(weights) if weights is not None else None
    if w is not None and not os.path.isfile(w):
        raise FileNotFoundError(f"weights file not found: {w!r}")
    if kind == "default":
        if kw:
            raise ValueError(f"the default encoder takes no encoder_kwargs (its size is stored in its weights); "
                             f"got {kw}")
        return _default(w, dev, strict)
    if w is None:
        raise ValueError(f"encoder {name!r} needs --weights PATH (a local file); nothing is downloaded")
    if kind == "open_clip":
        bb = load_open_clip(arch, w, model_kwargs=kw, strict=strict)
        return PatchEncoder(name, bb.model.to(dev).eval(), bb.num_features, bb.input_size, bb.mean, bb.std, dev)
    if kind == "timm":
        bb = load_timm(arch, w, model_kwargs=kw, strict=strict)
        return PatchEncoder(name, bb.model.to(dev).eval(), bb.num_features, bb.input_size, bb.mean, bb.std, dev)
    preset = PRESETS[arch]
    bb = load_timm(preset.timm_name, w, model_kwargs={**preset.kwargs, **kw}, strict=strict)
    model, dim = bb.model, bb.num_features
    if preset.pool == "cls+mean":
        model, dim = ClsMeanPool(model), 2 * dim
    size = int(kw.get("img_size", preset.input_size))
    return PatchEncoder(name, model.to(dev).eval(), dim, size, preset.mean, preset.std, dev)


def _file_identity(path: str) -> dict[str, Any]:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns),
            "sha256_first_mb": h.hexdigest()}


def encoder_settings(name: str, weights: str | os.PathLike | None = None,
                     encoder_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """JSON-serialisable settings that identify an encoder (for a batch run's settings fingerprint).

    Returns:
        ``{"name", "kind", "preset", "encoder_kwargs", "weights"}``: ``preset`` is the resolved preset
        (timm architecture, its constructor arguments with ``encoder_kwargs`` applied, input size,
        pooling) or ``None``; ``weights`` is ``{"path", "size", "mtime_ns", "sha256_first_mb"}`` of the
        file (the shipped file for ``default`` without ``weights``), or ``None`` when no file is given.
        Compare ``size`` + ``sha256_first_mb`` to tell whether the weights changed (a copied file keeps
        them but gets a new ``mtime_ns``).

    Raises:
        ValueError: unknown ``name`` or ``encoder_kwargs`` that is not a dict.
        FileNotFoundError: ``weights`` given but not a file.
    """
    import json

    kind, arch = _split(name)
    kw = _check_kwargs(encoder_kwargs)
    try:
        json.dumps(kw)
    except TypeError as e:
        raise ValueError(f"encoder_kwargs must be JSON values (layer classes by name), got {kw}: {e}") from e
    w = os.fspath(weights) if weights is not None else (DEFAULT_WEIGHTS if kind == "default" else None)
    if w is not None and not os.path.isfile(w):
        raise FileNotFoundError(f"weights file not found: {w!r}")
    preset = None
    if kind == "preset":
        p = PRESETS[arch]
        preset = {"timm_name": p.timm_name, "kwargs": {**p.kwargs, **kw},
                  "input_size": int(kw.get("img_size", p.input_size)), "pool": p.pool,
                  "mean": list(p.mean), "std": list(p.std)}
    return {"name": name, "kind": kind, "preset": preset, "encoder_kwargs": dict(sorted(kw.items())),
            "weights": _file_identity(w) if w is not None else None}
