"""Vision backbones from local weights: timm models and open_clip image towers.

One loader for every package that embeds images (``video``, ``pathology``, CoMemo, EMLoC):

- weights come from a local file only (``.safetensors`` or a torch state dict; nothing is downloaded);
- keys are matched strictly by default: a missing key, an unexpected key or a shape mismatch is a
  ``ValueError`` that lists them. ``strict=False`` loads what fits and logs a warning with the rest;
- constructor keyword arguments reach the model (``timm.create_model(name, **model_kwargs)``,
  ``open_clip.create_model(name, **model_kwargs)``), so architectures that need them (LayerScale,
  register tokens, another image size) can be built. Layer arguments may be given by name
  (``{"mlp_layer": "SwiGLUPacked", "act_layer": "silu"}``) so the settings stay JSON;
- a missing package raises ``ImportError`` with the install command.

:func:`build_timm` and :func:`build_open_clip` build the architecture alone (for a model whose own file holds
the backbone's weights); :func:`load_timm` and :func:`load_open_clip` build it the same way and load a local
file. This is the only module that calls ``timm.create_model`` or ``open_clip.create_model`` (a test checks the
repository's packages): domain packages keep only their own defaults and named presets on top of these four.

Example::

    bb = load_timm("vit_small_patch16_224", "vit_s.safetensors", model_kwargs={"num_classes": 0})
    feats_BD = bb.model(images_B3HW)  # normalised with bb.mean / bb.std at bb.input_size
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["Backbone", "load_state_dict_file", "load_weights", "build_timm", "build_open_clip", "load_timm",
           "load_open_clip", "resolve_timm_kwargs", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'longctx-suite[backbones]'"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# Keys of timm constructor arguments that take a layer class; a string value is looked up in timm.layers.
_LAYER_KEYS = ("mlp_layer", "norm_layer", "act_layer", "embed_layer", "block_fn", "attn_layer", "embed_norm_layer")
# Wrappers that checkpoints put around the state dict, unwrapped in this order.
_WRAPPER_KEYS = ("state_dict", "model", "module", "teacher")


@dataclass
class Backbone:
    """A loaded backbone and what its input needs.

    ``model`` maps normalised images ``(B, 3, input_size, input_size)`` to features (timm: its
    ``forward``; open_clip: the image tower). ``missing``/``unexpected``/``mismatched`` list the keys
    that did not load (all empty unless ``strict=False`` let them through).
    """

    model: nn.Module
    library: str  # "timm" or "open_clip"
    name: str  # the library's model name
    num_features: int  # width of the model's output
    input_size: int  # square side the model expects
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def load_state_dict_file(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Tensors from a local ``.safetensors`` file or a torch checkpoint (``.pt``/``.pth``/``.bin``).

    A checkpoint's ``state_dict``/``model``/``module``/``teacher`` wrapper is unwrapped and a leading
    ``module.`` (DataParallel) is stripped from the keys; entries that are not tensors are dropped.
    """
    from core.infra.fileio import load_safetensors, torch_load

    path = os.fspath(path)
    what = "backbone weights (a .safetensors file or a torch state dict)"
    if path.endswith(".safetensors"):
        return load_safetensors(path, what=what)
    sd = torch_load(path, what=what, weights_only=True)
    for key in _WRAPPER_KEYS:
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict):
        raise ValueError(f"{path!r} holds a {type(sd).__name__}, expected a dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _examples(keys: list[str], n: int = 5) -> str:
    return ", ".join(keys[:n]) + (f", ... ({len(keys)} in all)" if len(keys) > n else "")


def load_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor], *, strict: bool = True,
                 source: str = "weights",
                 ignore_unexpected: Iterable[str] = ()) -> tuple[list[str], list[str], list[str]]:
    """Load ``state_dict`` into ``model`` with exact key and shape checks.

    Args:
        model: the module to fill.
        state_dict: name -> tensor.
        strict: raise ``ValueError`` on any missing key, unexpected key or shape mismatch (the
            default). With ``strict=False`` the matching tensors load, the rest is logged as a warning.
        source: how the weights are named in messages (a file path).
        ignore_unexpected: key prefixes that may be present in the file without a place in the model
            (for example a classifier head the model was built without); never reported.

    Returns:
        ``(missing, unexpected, mismatched)`` key lists (empty when everything fitted).
    """
    own = model.state_dict()
    prefixes = tuple(ignore_unexpected)
    unexpected = [k for k in state_dict if k not in own and not (prefixes and k.startswith(prefixes))]
    missing = [k for k in own if k not in state_dict]
    mismatched = [f"{k} (file {tuple(v.shape)}, model {tuple(own[k].shape)})" for k, v in state_dict.items()
                  if k in own and tuple(v.shape) != tuple(own[k].shape)]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s): {_examples(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s): {_examples(unexpected)}")
        if mismatched:
            parts.append(f"{len(mismatched)} shape mismatch(es): {_examples(mismatched, 3)}")
        msg = f"{source} do not fit {type(model).__name__}: " + "; ".join(parts)
        if strict:
            raise ValueError(msg + ". Check the model name and its constructor arguments (encoder_kwargs), "
                             "or pass strict=False (--allow-partial-weights) to load the keys that fit")
        logger.warning("%s (strict=False: loading the %d tensors that fit)", msg,
                       len(own) - len(missing) - len(mismatched))
    fitting = {k: v for k, v in state_dict.items() if k in own and tuple(v.shape) == tuple(own[k].shape)}
    model.load_state_dict(fitting, strict=False)
    return missing, unexpected, [m.split(" ")[0] for m in mismatched]


def _import(module: str, pip_name: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise ImportError(f"this backbone needs the package {pip_name!r}: {INSTALL_HINT} "
                          f"(or pip install {pip_name})") from e


def resolve_timm_kwargs(model_kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """``model_kwargs`` with layer names (``"SwiGLUPacked"``) replaced by the ``timm.layers`` class.

    Activation and norm names that timm resolves itself (``"silu"``, ``"layernorm"``) are kept as strings.
    """
    out = dict(model_kwargs or {})
    layers = None
    for key in _LAYER_KEYS:
        val = out.get(key)
        if isinstance(val, str):
            if layers is None:
                layers = _import("timm", "timm").layers
            if hasattr(layers, val):
                out[key] = getattr(layers, val)
            elif key in ("mlp_layer", "embed_layer", "block_fn"):
                raise ValueError(f"{key}={val!r} is not a class in timm.layers (e.g. 'Mlp', 'SwiGLUPacked', 'GluMlp')")
    return out


def _check_file(weights) -> str:
    if weights is None:
        raise ValueError("a local weights file is needed (weights=PATH); nothing is downloaded")
    w = os.fspath(weights)
    if not os.path.isfile(w):
        raise FileNotFoundError(f"weights file not found: {w!r}")
    return w


def build_timm(name: str, *, model_kwargs: Mapping[str, Any] | None = None) -> Backbone:
    """A timm model built with ``pretrained=False`` and ``model_kwargs``, its weights left at their initialisation.

    For a caller that fills the weights itself (a saved model whose file also holds the backbone's tensors);
    :func:`load_timm` is this plus a local weights file.

    Args:
        name: timm architecture (``"vit_large_patch16_224"``).
        model_kwargs: constructor arguments (``num_classes``, ``img_size``, ``init_values``,
            ``reg_tokens``, ``mlp_layer`` by name, ...); ``num_classes`` defaults to 0 (features).

    Returns:
        A :class:`Backbone` in eval mode on the CPU; mean and std are the architecture's (``pretrained_cfg``).
    """
    timm = _import("timm", "timm")
    kwargs = {"num_classes": 0, **resolve_timm_kwargs(model_kwargs)}
    try:
        model = timm.create_model(name, pretrained=False, **kwargs)
    except RuntimeError as e:
        if "Unknown model" in str(e):
            raise ValueError(f"unknown timm model {name!r} (see timm.list_models())") from e
        raise
    except (TypeError, AssertionError) as e:  # timm asserts on some impossible sizes
        raise ValueError(f"timm model {name!r} cannot be built with the arguments {kwargs}: {e!r}") from e
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    size = cfg.get("input_size", (3, 224, 224))[-1]
    pe = getattr(model, "patch_embed", None)
    if pe is not None and getattr(pe, "img_size", None) is not None:
        size = pe.img_size[-1] if isinstance(pe.img_size, (tuple, list)) else pe.img_size
    elif "img_size" in kwargs:
        size = kwargs["img_size"]
    return Backbone(model.eval(), "timm", name, int(model.num_features), int(size),
                    tuple(cfg.get("mean", IMAGENET_MEAN)), tuple(cfg.get("std", IMAGENET_STD)))


def load_timm(name: str, weights: str | os.PathLike | None, *, model_kwargs: Mapping[str, Any] | None = None,
              strict: bool = True, ignore_unexpected: Iterable[str] = ()) -> Backbone:
    """A timm model built by :func:`build_timm`, weights from a local file.

    Args:
        name: timm architecture (``"vit_large_patch16_224"``).
        weights: local ``.safetensors`` / torch state dict. Required: nothing is downloaded.
        model_kwargs: constructor arguments, see :func:`build_timm`; ``num_classes`` defaults to 0 (features),
            and a classifier in the file is then dropped without a report.
        strict: see :func:`load_weights`.
        ignore_unexpected: key prefixes allowed in the file without a place in the model.

    Returns:
        A :class:`Backbone` in eval mode on the CPU.
    """
    w = _check_file(weights)
    bb = build_timm(name, model_kwargs=model_kwargs)
    model = bb.model
    cfg = dict(getattr(model, "pretrained_cfg", None) or {})
    ignore = tuple(ignore_unexpected)
    head = cfg.get("classifier")
    if (model_kwargs or {}).get("num_classes", 0) == 0 and isinstance(head, str):
        ignore += (head + ".",)  # a classifier in the file is dropped on purpose by num_classes=0
    sd = load_state_dict_file(w)
    dropped = [k for k in sd if isinstance(head, str) and k.startswith(head + ".") and k not in model.state_dict()]
    if dropped:
        logger.info("num_classes=0: the classifier in %s is not used (%s)", w, _examples(dropped))
    bb.missing, bb.unexpected, bb.mismatched = load_weights(model, sd, strict=strict, source=f"weights {w!r}",
                                                            ignore_unexpected=ignore)
    return bb


def _merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def build_open_clip(name: str, *, model_kwargs: Mapping[str, Any] | None = None) -> Backbone:
    """The image tower of an open_clip model (``pretrained=None``), its weights left at their initialisation.

    For a caller that fills the weights itself; :func:`load_open_clip` is this plus a local weights file.
    ``model_kwargs`` override the named config; dict values (``vision_cfg``, ``text_cfg``) are merged into it,
    so ``{"vision_cfg": {"image_size": 64}}`` changes only the image size.

    Returns:
        A :class:`Backbone` in eval mode on the CPU whose ``model`` is the image tower (output
        ``(B, embed_dim)``); mean and std are the model's preprocessing ones.
    """
    open_clip = _import("open_clip", "open_clip_torch")
    base = open_clip.get_model_config(name)
    if base is None:
        raise ValueError(f"unknown open_clip model {name!r} (see open_clip.list_models())")
    over = {k: (_merge(base[k], v) if isinstance(v, Mapping) and isinstance(base.get(k), dict) else v)
            for k, v in (model_kwargs or {}).items()}
    try:
        model = open_clip.create_model(name, pretrained=None, **over)
    except TypeError as e:
        raise ValueError(f"open_clip model {name!r} does not take the arguments {sorted(over)}: {e}") from e
    visual = model.visual
    pre = open_clip.get_model_preprocess_cfg(model) or {}
    size = pre.get("size", getattr(visual, "image_size", 224))
    size = size[-1] if isinstance(size, (tuple, list)) else size
    dim = int(getattr(visual, "output_dim", 0) or model.text_projection.shape[-1])
    return Backbone(visual.eval(), "open_clip", name, dim, int(size), tuple(pre.get("mean", OPENAI_CLIP_MEAN)),
                    tuple(pre.get("std", OPENAI_CLIP_STD)))


def load_open_clip(name: str, weights: str | os.PathLike | None, *, model_kwargs: Mapping[str, Any] | None = None,
                   strict: bool = True) -> Backbone:
    """The image tower of an open_clip model built by :func:`build_open_clip`, weights from a local file.

    The file may hold a whole CLIP model (keys ``visual.*`` next to the text tower's, which are
    ignored) or the image tower alone. ``model_kwargs``: see :func:`build_open_clip`.

    Returns:
        A :class:`Backbone` whose ``model`` is the image tower (output ``(B, embed_dim)``).
    """
    w = _check_file(weights)
    bb = build_open_clip(name, model_kwargs=model_kwargs)
    sd = load_state_dict_file(w)
    if any(k.startswith("visual.") for k in sd):
        sd = {k.removeprefix("visual."): v for k, v in sd.items() if k.startswith("visual.")}
    bb.missing, bb.unexpected, bb.mismatched = load_weights(bb.model, sd, strict=strict, source=f"weights {w!r}")
    return bb
