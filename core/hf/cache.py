"""Cache surgery on transformers' ``DynamicCache``: read, prune per layer and per key/value head, save, reload.

Keys in a transformers cache carry their rotary position already, so a pruned cache needs no re-rotation: the
kept tokens stay where they were, and new tokens go on with explicit ``position_ids`` (see
:mod:`core.hf.positions`) continuing from the uncompressed maximum.

Pruning takes, per layer, the tokens to keep: one index list for every head, or one per ``(batch, key/value
head)``. Where every head of a layer keeps the same number of tokens, each head's tokens are gathered into a
dense ``(B, H_kv, K, D)`` tensor (order inside a head does not matter to attention once positions are baked into
the keys). Where counts differ, or with ``compact=False``, the layer keeps the union (or everything) and hides
the rest per head with a bool mask: a :class:`HiddenKeysLayer`, whose ``update`` hands the mask to the
``"longctx"`` attention function on the key tensor it returns. New tokens are visible to every head.

A saved cache (safetensors) carries a fingerprint of the model (architecture sizes, rotary settings and a hash of
the key/value projection weights of the first and last decoder layers) and is refused for another model.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from core.infra.fileio import atomic_path, open_safetensors
from core.hf.backend import HIDDEN_ATTR

__all__ = [
    "HiddenKeysLayer",
    "CacheMismatchError",
    "cache_tensors",
    "prune_cache",
    "save_cache",
    "load_cache",
    "model_fingerprint",
    "FORMAT",
]

#: Format tag written into saved caches.
FORMAT = "longctx-hf-cache/1"


class CacheMismatchError(ValueError):
    """A saved cache was made by another model (its fingerprint differs)."""


class HiddenKeysLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys may be hidden per head: ``hidden`` bool ``(B, H_kv, S)``, True = hidden.

    ``update`` appends the new tokens (visible to every head) and tags the returned key tensor with the mask
    (attribute ``core.hf.backend.HIDDEN_ATTR``), which the ``"longctx"`` attention function turns into a bias;
    its fallbacks put it into their dense mask.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self.keys, self.values = keys, values
        self.hidden = hidden.to(device=keys.device, dtype=torch.bool)

    def update(self, key_states, value_states, *args, **kwargs):
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        new = torch.zeros(*self.hidden.shape[:2], key_states.shape[-2], dtype=torch.bool, device=self.hidden.device)
        self.hidden = torch.cat([self.hidden, new], dim=-1)
        setattr(keys, HIDDEN_ATTR, self.hidden)
        return keys, values

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.hidden = self.hidden[..., : self.keys.shape[-2]]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.hidden = self.hidden[indices]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.hidden = self.hidden.repeat_interleave(repeats, dim=0)


def cache_tensors(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(keys, values), ...]`` per layer, each ``(B, H_kv, S, D)`` (views of the cache, not copies)."""
    out = []
    for i, layer in enumerate(cache.layers):
        if layer.keys is None or not getattr(layer, "is_initialized", True):
            raise ValueError(f"cache layer {i} is empty (run a prefill first)")
        out.append((layer.keys, layer.values))
    return out


def _layer_keep(keep, B: int, H: int, S: int, device) -> torch.Tensor:
    """Normalise one layer's keep spec to bool ``(B, H, S)``."""
    keep = torch.as_tensor(keep, device=device)
    if keep.dtype == torch.bool:
        if keep.shape[-1] != S:
            raise ValueError(f"a bool keep mask must have S = {S} entries on its last axis, got {tuple(keep.shape)}")
        return keep.expand(B, H, S).clone() if keep.dim() < 3 else keep.expand(B, H, S).clone()
    if keep.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8):
        raise ValueError(f"keep indices must be integer or bool tensors, got {keep.dtype}")
    keep = keep.long()
    if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= S):
        raise ValueError(f"keep indices must lie in [0, {S}), got min {int(keep.min())}, max {int(keep.max())}")
    if keep.dim() == 1:
        keep = keep.expand(B, H, -1)
    elif keep.dim() == 2:  # (H, K)
        keep = keep.unsqueeze(0).expand(B, -1, -1)
    if tuple(keep.shape[:2]) != (B, H):
        raise ValueError(f"per-head keep indices must be (B, H_kv, K) = ({B}, {H}, K), got {tuple(keep.shape)}")
    mask = torch.zeros(B, H, S, dtype=torch.bool, device=device)
    mask.scatter_(2, keep, True)
    return mask


def prune_cache(cache, keep: Sequence | torch.Tensor, *, compact: bool = True) -> DynamicCache:
    """A new ``DynamicCache`` holding only the kept tokens of each layer (the input cache is not changed).

    Args:
        cache: a transformers ``DynamicCache`` after prefill (full-attention layers; sliding-window layers are
            refused: their tokens already leave as the window moves).
        keep: per layer (a list with one entry per layer, or one entry for all layers): int indices ``(K,)``
            shared by every head, ``(H_kv, K)`` or ``(B, H_kv, K)`` per head, or a bool mask ``(S,)``,
            ``(H_kv, S)`` or ``(B, H_kv, S)``. Indices are positions in the cache (0..S-1).
        compact: drop the pruned tokens (True) or keep every token and hide the pruned ones per head (False:
            the same attention, for tests and for callers that prune and un-prune).

    Returns:
        ``DynamicCache`` whose layers are ``DynamicLayer`` (every head keeps the same count, compact) or
        :class:`HiddenKeysLayer`. Use it with the ``"longctx"`` attention implementation (the fallbacks honour the
        per-head masks too; transformers' own ``eager``/``sdpa`` functions do not know them).
    """
    layers = cache_tensors(cache)
    if isinstance(keep, torch.Tensor) or not isinstance(keep, Sequence):
        keep = [keep] * len(layers)
    if len(keep) == 1 and len(layers) > 1:
        keep = list(keep) * len(layers)
    if len(keep) != len(layers):
        raise ValueError(f"keep has {len(keep)} entries for a cache of {len(layers)} layers")
    out = DynamicCache()
    out.layers = []
    for i, ((k, v), spec) in enumerate(zip(layers, keep)):
        if getattr(cache.layers[i], "is_sliding", False):
            raise ValueError(f"cache layer {i} is a sliding-window layer; prune full-attention layers only")
        B, H, S, _ = k.shape
        mask = _layer_keep(spec, B, H, S, k.device)
        old_hidden = getattr(cache.layers[i], "hidden", None)
        if old_hidden is not None:  # tokens already hidden stay hidden
            mask = mask & ~old_hidden
        counts = mask.sum(-1)  # (B, H)
        if compact and bool((counts == counts.flatten()[0]).all()):
            K = int(counts.flatten()[0])
            idx = mask.nonzero()[:, 2].view(B, H, K)  # ascending positions per head
            kk = torch.gather(k, 2, idx[..., None].expand(B, H, K, k.shape[-1]))
            vv = torch.gather(v, 2, idx[..., None].expand(B, H, K, v.shape[-1]))
            layer = DynamicLayer()
            layer.lazy_initialization(kk, vv)
            layer.keys, layer.values = kk, vv
        elif compact:  # keep the union of the heads' tokens, hide the rest per head
            union = mask.any(dim=1).any(dim=0)  # (S,)
            cols = union.nonzero()[:, 0]
            layer = HiddenKeysLayer(k[:, :, cols], v[:, :, cols], ~mask[:, :, cols])
        else:
            layer = HiddenKeysLayer(k.clone(), v.clone(), ~mask)
        out.layers.append(layer)
    return out


# --- fingerprint, save, load ----------------------------------------------------------------------------------


def _text_config(config):
    for name in ("text_config", "llm_config"):
        sub = getattr(config, name, None)
        if sub is not None:
            return sub
    return config


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of what decides whether a cache fits a model: architecture, layer/head sizes, rotary settings,
    and the key/value projection weights of the first and last decoder layers (same config, other weights:
    another fingerprint)."""
    from core.hf.insert import _unwrap, decoder_layers

    cfg = model.config
    tc = _text_config(cfg)
    facts = {
        "architectures": getattr(cfg, "architectures", None) or [type(model).__name__],
        "model_type": getattr(cfg, "model_type", None),
    }
    for name in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                 "rope_theta", "rope_scaling", "rope_parameters", "sliding_window", "max_position_embeddings"):
        val = getattr(tc, name, None)
        facts[name] = val if isinstance(val, (int, float, str, bool, type(None))) else json.dumps(val, sort_keys=True,
                                                                                                   default=str)
    h = hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode())
    stack = decoder_layers(model)
    for layer in (_unwrap(stack[0]), _unwrap(stack[-1])):
        for name, p in sorted(layer.named_parameters()):
            if any(t in name for t in ("k_proj", "v_proj", "qkv", "wqkv", "key", "value")):
                h.update(name.encode())
                h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def save_cache(cache, path: str | os.PathLike, model: torch.nn.Module, *, metadata: dict | None = None) -> None:
    """Write the cache to ``path`` (safetensors, atomically) with the model's fingerprint and ``metadata`` (JSON-able:
    e.g. the next position ids, what was pruned and why)."""
    from safetensors.torch import save_file

    tensors, layers = {}, []
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        if k is None:
            raise ValueError(f"cache layer {i} is empty; nothing to save")
        tensors[f"layer.{i}.keys"] = k.contiguous()
        tensors[f"layer.{i}.values"] = v.contiguous()
        info = {"kind": "dynamic"}
        if isinstance(layer, HiddenKeysLayer):
            tensors[f"layer.{i}.hidden"] = layer.hidden.contiguous()
            info["kind"] = "hidden"
        elif isinstance(layer, DynamicSlidingWindowLayer):
            info = {"kind": "sliding", "sliding_window": int(layer.sliding_window),
                    "cumulative_length": int(layer.cumulative_length)}  # fmt: skip
        elif type(layer) is not DynamicLayer:
            raise ValueError(f"cache layer {i} is a {type(layer).__name__}; only dynamic caches can be saved")
        layers.append(info)
    meta = {
        "format": FORMAT,
        "fingerprint": model_fingerprint(model),
        "layers": json.dumps(layers),
        "metadata": json.dumps(metadata or {}),
    }
    with atomic_path(path) as tmp:
        save_file(tensors, tmp, metadata=meta)


def load_cache(path: str | os.PathLike, model: torch.nn.Module, *, device=None) -> tuple[DynamicCache, dict]:
    """Read a cache written by :func:`save_cache`; returns ``(cache, metadata)``.

    Raises:
        FileNotFoundError: no such file.
        CacheMismatchError: the cache was made by another model.
        ValueError: not a cache file of this format.
    """
    with open_safetensors(path, what=f"a saved longctx cache (format {FORMAT!r})",
                          device=device if device is not None else "cpu") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not a saved longctx cache (format {meta.get('format')!r}, expected {FORMAT!r})"
            )
        want = model_fingerprint(model)
        if meta.get("fingerprint") != want:
            raise CacheMismatchError(
                f"{path} was saved from another model (fingerprint {meta.get('fingerprint', '')[:12]}, this model "
                f"{want[:12]}); a cache only fits the model that made it"
            )
        cache = DynamicCache()
        cache.layers = []
        for i, info in enumerate(json.loads(meta["layers"])):
            k, v = f.get_tensor(f"layer.{i}.keys"), f.get_tensor(f"layer.{i}.values")
            if info["kind"] == "hidden":
                layer = HiddenKeysLayer(k, v, f.get_tensor(f"layer.{i}.hidden"))
            else:
                layer = (DynamicSlidingWindowLayer(sliding_window=info["sliding_window"]) if info["kind"] == "sliding"
                         else DynamicLayer())  # fmt: skip
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
                if info["kind"] == "sliding":
                    layer.cumulative_length = info["cumulative_length"]
            cache.layers.append(layer)
        return cache, json.loads(meta.get("metadata", "{}"))
