"""Extra modules before chosen decoder layers, the way peft injects adapters: a named, reversible wrapper.

``insert_before(model, {2: block_a, 5: block_b})`` replaces decoder layer ``i`` by :class:`InsertedBefore`
(``inserted`` then the original ``layer``); :func:`revert` puts the original layers back. Nothing in
transformers' classes is edited. The wrapper forwards unknown attributes to the wrapped layer (models read
``decoder_layer.attention_type`` and alike), and its state-dict keys are ``...layers.{i}.layer.*`` (original) and
``...layers.{i}.inserted.*``.

An inserted module maps hidden states ``(B, S, D) -> (B, S, D)``. One that needs more input (a gated
cross-attention reading image tokens) holds it as state set before the forward: :class:`ContextInsert` wraps
a module ``f(x, context, **kw)`` with a ``context`` attribute.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

__all__ = ["InsertedBefore", "ContextInsert", "decoder_layers", "insert_before", "revert", "inserted_modules"]

_LAYER_PATHS = (
    "model.layers",  # Llama, Qwen2, Mistral, Gemma (CausalLM)
    "layers",  # the base models themselves
    "model.language_model.layers",  # Qwen2-VL, InternVL, LLaVA (ForConditionalGeneration)
    "language_model.layers",
    "language_model.model.layers",  # InstructBLIP(-Video) with a Llama/OPT LM
    "language_model.model.decoder.layers",
    "model.decoder.layers",
    "decoder.layers",
)


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ``nn.ModuleList`` of the language model's decoder layers (known paths first, then the longest list of
    modules whose class name ends in ``DecoderLayer``)."""
    for path in _LAYER_PATHS:
        found = _get(model, path)
        if isinstance(found, nn.ModuleList) and len(found) > 0:
            return found
    best = None
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > 0:
            names = {type(_unwrap(m)).__name__ for m in mod}
            if all(n.endswith("DecoderLayer") for n in names) and (best is None or len(mod) > len(best)):
                best = mod
    if best is None:
        raise ValueError(f"found no decoder layers in {type(model).__name__} (looked for {', '.join(_LAYER_PATHS)})")
    return best


def _unwrap(m: nn.Module) -> nn.Module:
    return m.layer if isinstance(m, InsertedBefore) else m


class InsertedBefore(nn.Module):
    """``layer(inserted(hidden_states), ...)``: a decoder layer with a module run on its input first."""

    def __init__(self, inserted: nn.Module, layer: nn.Module) -> None:
        super().__init__()
        self.inserted = inserted
        self.layer = layer

    def forward(self, *args, **kwargs):
        if args:
            args = (self.inserted(args[0]), *args[1:])
        else:
            kwargs["hidden_states"] = self.inserted(kwargs["hidden_states"])
        return self.layer(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("layer"), name)


class ContextInsert(nn.Module):
    """``module(x, context, **context_kwargs)`` as a hidden-state map; ``context`` is set before each forward
    (None: the identity, so the model runs unchanged while no context is given).

    Example: ``ContextInsert(GatedCrossAttentionBlock(dim, heads, context_dim=vision_dim))``, then
    ``ins.context = image_tokens_BND`` before ``model(...)``.
    """

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self.context: torch.Tensor | None = None
        self.context_kwargs: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            return x
        ctx = self.context.to(x.dtype)
        if ctx.shape[0] != x.shape[0]:
            if ctx.shape[0] != 1:
                raise ValueError(f"context batch {ctx.shape[0]} does not match hidden states batch {x.shape[0]}")
            ctx = ctx.expand(x.shape[0], -1, -1)
        return self.module(x, ctx, **self.context_kwargs)


def insert_before(
    model: nn.Module, modules: Mapping[int, nn.Module] | Callable[[int], nn.Module], layers=None
) -> dict[int, nn.Module]:
    """Insert a module before each chosen decoder layer; returns ``{layer index: inserted module}``.

    Args:
        model: the transformers model.
        modules: ``{layer index: module}``, or a factory ``f(index) -> module`` used with ``layers``.
        layers: layer indices for a factory (negative counts from the end).

    Raises:
        ValueError: an index out of range, or a layer that already has an inserted module.
    """
    stack = decoder_layers(model)
    n = len(stack)
    if callable(modules) and not isinstance(modules, nn.Module):
        if layers is None:
            raise ValueError("a module factory needs layers=[...]")
        modules = {i: modules(i % n) for i in layers}
    out = {}
    for i, mod in modules.items():
        if not -n <= i < n:
            raise ValueError(f"layer {i} out of range for a model with {n} decoder layers")
        j = i % n
        if isinstance(stack[j], InsertedBefore):
            raise ValueError(f"decoder layer {j} already has an inserted module; revert(model) first")
        ref = next(stack[j].parameters(), None)
        if ref is not None:
            mod = mod.to(device=ref.device)
        stack[j] = InsertedBefore(mod, stack[j])
        out[j] = mod
    return out


def inserted_modules(model: nn.Module) -> dict[int, nn.Module]:
    """``{layer index: inserted module}`` currently in the model."""
    return {i: m.inserted for i, m in enumerate(decoder_layers(model)) if isinstance(m, InsertedBefore)}


def revert(model: nn.Module) -> dict[int, nn.Module]:
    """Remove every inserted module (the original layers return, unchanged); returns what was removed."""
    stack = decoder_layers(model)
    removed = {}
    for i, m in enumerate(stack):
        if isinstance(m, InsertedBefore):
            removed[i] = m.inserted
            stack[i] = m.layer
    return removed
