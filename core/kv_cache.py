"""KV cache of a causal decoder: per-layer keys/values with each token's position id, and attention over it.

Layouts (per layer, :class:`LayerKV`):
    ``k``, ``v``: ``(B, H_kv, S_l, head_dim)`` (grouped-query layout), keys stored **after** RoPE;
    ``pos``: ``(B, S_l)`` int64 position id of the token in each slot;
    ``mask``: bool ``(B, H_kv, S_l)``, True = slot hidden from that KV head (padded or pruned); None = all
    visible. Layers may have different lengths ``S_l`` after pruning.

Per-head pruning layout: a layer keeps one token axis shared by its KV heads — the union of the tokens any
head keeps, in their original order — and the per-head mask hides, per KV head, the slots that head dropped.
Position ids therefore stay per token; a head's visible token count is exactly what it kept; memory is that
of the union. When the heads' masks differ, :func:`cached_attention` folds KV heads into the batch
(``(B·H_kv, G, S_q, D)`` queries against ``(B·H_kv, 1, S_k, D)`` keys with a ``(B·H_kv, S_k)`` key padding
mask), so every backend of :func:`core.attention.attention` serves it.

Caches are immutable values: :meth:`KVCache.select` and the decoder's forward return new caches.
Saved files are safetensors (:meth:`KVCache.save`, atomic) with the format tag ``longctx.kv_cache.v1``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from einops import rearrange

from core.attention import attention
from core.infra.fileio import atomic_path, open_safetensors

__all__ = ["LayerKV", "KVCache", "cached_attention", "probe_attention", "CACHE_FORMAT"]

CACHE_FORMAT = "longctx.kv_cache.v1"


@dataclass
class LayerKV:
    """One layer's cache.

    Attributes:
        k: keys after RoPE ``(B, H_kv, S, head_dim)``.
        v: values ``(B, H_kv, S, head_dim)``.
        pos: position id of the token in each slot ``(B, S)`` int64.
        mask: bool ``(B, H_kv, S)``, True = slot hidden from that KV head (padded or pruned); None = all visible.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor | None = None

    def __len__(self) -> int:
        return self.k.shape[2]

    def visible(self) -> torch.Tensor:
        """Bool ``(B, H_kv, S)``: True where the slot is visible to the head."""
        if self.mask is None:
            return torch.ones(self.k.shape[:3], dtype=torch.bool, device=self.k.device)
        return ~self.mask

    def kept_counts(self) -> torch.Tensor:
        """Visible tokens per batch item and KV head, int64 ``(B, H_kv)``."""
        return self.visible().sum(-1)


def _normalize_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    return None if mask is None or not bool(mask.any()) else mask


@dataclass
class KVCache:
    """Per-layer keys/values with their tokens' position ids; an immutable value (methods return new caches).

    Attributes:
        layers: one :class:`LayerKV` per decoder layer (lengths may differ between layers after pruning).
        next_pos: ``(B,)`` int64, the position id a continuation starts at by default: one past the largest
            position ever appended (pruning does not lower it).
    """

    layers: list[LayerKV]
    next_pos: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.next_pos.shape[0]

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def lengths(self) -> list[int]:
        """Slots per layer (the union over KV heads)."""
        return [len(layer) for layer in self.layers]

    def kept_counts(self) -> list[torch.Tensor]:
        """Visible tokens per layer, each ``(B, H_kv)``."""
        return [layer.kept_counts() for layer in self.layers]

    def to(self, device: torch.device | str) -> KVCache:
        return KVCache(
            layers=[
                LayerKV(l.k.to(device), l.v.to(device), l.pos.to(device), None if l.mask is None else l.mask.to(device))
                for l in self.layers
            ],
            next_pos=self.next_pos.to(device),
        )

    def select(self, indices: list[torch.Tensor | None]) -> KVCache:
        """Keep chosen slots per layer (and per KV head); returns a new cache.

        Args:
            indices: one entry per layer: None (keep the layer whole), slot indices shared by all heads
                ``(K,)`` or ``(B, K)``, or per KV head ``(B, H_kv, K)``. Indices refer to the layer's current
                slots; duplicates within a head are not allowed. Choosing an already padded slot leaves it
                padded. Per-head indices keep the union of the heads' slots (in slot order, so original
                order is preserved) and mask, per head, the slots it did not choose; a batch item with a
                smaller union is padded at the end.
        """
        if len(indices) != self.num_layers:
            raise ValueError(f"select needs one index entry per layer ({self.num_layers}), got {len(indices)}")
        return KVCache(
            layers=[l if idx is None else _select_layer(l, idx) for l, idx in zip(self.layers, indices)],
            next_pos=self.next_pos.clone(),
        )

    def save(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None) -> Path:
        """Write the cache to ``path`` (safetensors), atomically (temp file in the same folder, then rename).

        ``metadata``: extra string pairs stored in the file header (e.g. the model's config as JSON).
        """
        from safetensors.torch import save_file

        path = Path(path)
        tensors: dict[str, torch.Tensor] = {"next_pos": self.next_pos.contiguous().cpu()}
        for i, l in enumerate(self.layers):
            tensors[f"layers.{i}.k"] = l.k.contiguous().cpu()
            tensors[f"layers.{i}.v"] = l.v.contiguous().cpu()
            tensors[f"layers.{i}.pos"] = l.pos.contiguous().cpu()
            if l.mask is not None:
                tensors[f"layers.{i}.mask"] = l.mask.contiguous().cpu()
        seen: set[int] = set()  # layers may share one tensor (the position ids of an unpruned prefill): one copy each
        for name, t in tensors.items():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen and t.numel():
                tensors[name] = t.clone()
            seen.add(ptr)
        meta = {"format": CACHE_FORMAT, "num_layers": str(self.num_layers), **(metadata or {})}
        with atomic_path(path) as tmp:
            save_file(tensors, tmp, metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, *, device: torch.device | str = "cpu") -> KVCache:
        """Read a cache written by :meth:`save`."""
        path = Path(path)
        with open_safetensors(path, what=f"a KV cache written by KVCache.save (format {CACHE_FORMAT!r})",
                              device=device) as f:
            meta = f.metadata() or {}
            if meta.get("format") != CACHE_FORMAT:
                raise ValueError(f"{path} is not a KV cache file (format {meta.get('format')!r}, expected {CACHE_FORMAT!r})")
            n = int(meta["num_layers"])
            names = set(f.keys())
            layers = [
                LayerKV(
                    f.get_tensor(f"layers.{i}.k"),
                    f.get_tensor(f"layers.{i}.v"),
                    f.get_tensor(f"layers.{i}.pos"),
                    f.get_tensor(f"layers.{i}.mask") if f"layers.{i}.mask" in names else None,
                )
                for i in range(n)
            ]
            return cls(layers=layers, next_pos=f.get_tensor("next_pos"))

    @staticmethod
    def load_metadata(path: str | os.PathLike) -> dict[str, str]:
        """The header metadata of a saved cache."""
        with open_safetensors(path, what=f"a KV cache written by KVCache.save (format {CACHE_FORMAT!r})") as f:
            return dict(f.metadata() or {})


def _select_layer(l: LayerKV, idx: torch.Tensor) -> LayerKV:
    B, H, S, _ = l.k.shape
    idx = torch.as_tensor(idx, device=l.k.device).long()
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= S):
        raise ValueError(f"slot indices must lie in [0, {S}), got min {int(idx.min())}, max {int(idx.max())}")
    if idx.dim() == 1:
        idx = idx[None].expand(B, -1)
    if idx.dim() == 2:  # shared by all heads: (B, K)
        if idx.shape[0] != B:
            raise ValueError(f"shared slot indices must be (K,) or (B={B}, K), got {tuple(idx.shape)}")
        gk = idx[:, None, :, None].expand(B, H, -1, l.k.shape[3])
        mask = None if l.mask is None else l.mask.gather(2, idx[:, None, :].expand(B, H, -1))
        return LayerKV(l.k.gather(2, gk), l.v.gather(2, gk), l.pos.gather(1, idx), _normalize_mask(mask))
    if idx.dim() != 3 or idx.shape[:2] != (B, H):
        raise ValueError(f"per-head slot indices must be (B={B}, H_kv={H}, K), got {tuple(idx.shape)}")
    chosen_BHS = torch.zeros(B, H, S, dtype=torch.bool, device=idx.device)
    chosen_BHS.scatter_(2, idx, True)
    if int(chosen_BHS.sum()) != idx.numel():
        raise ValueError("per-head slot indices must not repeat a slot within a head")
    chosen_BHS &= l.visible()
    union_BS = chosen_BHS.any(1)
    U = int(union_BS.sum(-1).max()) if S else 0
    # slots of the union first, in slot order (stable sort of "not in union"), then filler slots
    order_BS = torch.sort((~union_BS).to(torch.int8), dim=-1, stable=True).indices
    keep_BU = order_BS[:, :U]
    gk = keep_BU[:, None, :, None].expand(B, H, U, l.k.shape[3])
    mask = ~chosen_BHS.gather(2, keep_BU[:, None, :].expand(B, H, U))  # filler slots are not chosen: padded
    return LayerKV(l.k.gather(2, gk), l.v.gather(2, gk), l.pos.gather(1, keep_BU), _normalize_mask(mask))


def cached_attention(
    q_BHSD: torch.Tensor,
    k_BHSD: torch.Tensor,
    v_BHSD: torch.Tensor,
    mask_BHS: torch.Tensor | None,
    *,
    backend: str = "auto",
    **options,
) -> torch.Tensor:
    """Causal attention of ``S_q`` new queries over a layer's keys (cache slots, then the new tokens).

    Args:
        q_BHSD: ``(B, H_q, S_q, D)`` queries of the new tokens.
        k_BHSD, v_BHSD: ``(B, H_kv, S_k, D)``; the last ``S_q`` slots are the new tokens.
        mask_BHS: bool ``(B, H_kv, S_k)``, True = hidden from that KV head; None = all visible.
        backend, options: passed to :func:`core.attention.attention`.

    Returns:
        ``(B, H_q, S_q, D)``. Bottom-right causal: query ``i`` sees every visible cached slot and new
        tokens ``0..i``.
    """
    if mask_BHS is None:
        return attention(q_BHSD, k_BHSD, v_BHSD, causal=True, backend=backend, **options)
    if bool((mask_BHS == mask_BHS[:, :1]).all()):  # same mask for every head
        return attention(q_BHSD, k_BHSD, v_BHSD, causal=True, key_padding_mask=mask_BHS[:, 0], backend=backend, **options)
    B, Hkv = k_BHSD.shape[:2]
    q = rearrange(q_BHSD, "b (h g) s d -> (b h) g s d", h=Hkv)  # (B*H_kv, G, S_q, D)
    k = rearrange(k_BHSD, "b h s d -> (b h) 1 s d")  # (B*H_kv, 1, S_k, D)
    v = rearrange(v_BHSD, "b h s d -> (b h) 1 s d")
    kpm = rearrange(mask_BHS, "b h s -> (b h) s")  # (B*H_kv, S_k)
    out = attention(q, k, v, causal=True, key_padding_mask=kpm, backend=backend, **options)
    return rearrange(out, "(b h) g s d -> b (h g) s d", b=B)  # (B, H_q, S_q, D)


def probe_attention(
    q_BHQD: torch.Tensor, query_index: torch.Tensor, k_BHSD: torch.Tensor, mask_BHS: torch.Tensor | None, s_new: int
) -> torch.Tensor:
    """fp32 attention probabilities of chosen new-token queries (reference math, same masks as
    :func:`cached_attention`).

    Args:
        q_BHQD: ``(B, H_q, Q, D)`` queries of the chosen tokens.
        query_index: ``(Q,)`` index of each chosen query among the ``s_new`` new tokens.
        k_BHSD: ``(B, H_kv, S_k, D)`` keys (cache slots then new tokens).
        mask_BHS: bool ``(B, H_kv, S_k)`` or None, True = hidden.
        s_new: number of new tokens (the last ``s_new`` key slots).

    Returns:
        ``(B, H_q, Q, S_k)`` probabilities; each row sums to 1 over its visible keys (0 elsewhere).
    """
    B, Hq, Q, D = q_BHQD.shape
    Hkv, Sk = k_BHSD.shape[1], k_BHSD.shape[2]
    k = k_BHSD.float().repeat_interleave(Hq // Hkv, dim=1)
    scores_BHQS = torch.matmul(q_BHQD.float(), k.transpose(-1, -2)) / D**0.5
    limit_Q = (Sk - s_new) + query_index.to(k.device)  # last key index each query may see
    hide = torch.arange(Sk, device=k.device)[None, :] > limit_Q[:, None]  # (Q, S_k)
    hide = hide[None, None]
    if mask_BHS is not None:
        hide = hide | mask_BHS.repeat_interleave(Hq // Hkv, dim=1)[:, :, None, :]
    scores_BHQS = scores_BHQS.masked_fill(hide, float("-inf"))
    probs = torch.softmax(scores_BHQS, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)
