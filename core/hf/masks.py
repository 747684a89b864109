"""The ``"longctx"`` mask function: transformers' mask patterns kept compact (:class:`LongctxMask`).

transformers hands a mask function a *pattern*: a ``mask_function(batch, head, q_idx, kv_idx)`` composed from a few
known pieces (:mod:`transformers.masking_utils`), plus sizes and offsets. :func:`recognise` reads the composition
structurally (the code objects and closures of the pieces, so an unknown composition is never mistaken for a known
one) and returns what :func:`core.attention.attention` needs instead of a dense ``(S_q, S_k)`` mask:

* causal or bidirectional (``and_masks`` of the two is causal);
* a sliding window: causal (``sliding_window_overlay(w)``: ``window = w``) or bidirectional
  (``sliding_window_bidirectional_overlay(w)``: ``|q - kv| <= w``, ``window = w + 1``);
* segment ids: packed sequences (``packed_sequence_mask_function`` with the causal/window pattern remapped to
  positions by ``remap_positions_for_packed_sequence``: within a packed sequence positions advance with the index,
  so the remapped pattern equals the plain one there) and chunked attention (Llama 4's ``chunked_overlay``:
  ``(index - left_padding) // chunk``); several segmentations combine into one id per token;
* bidirectional groups inside causal attention (image tokens: ``or_masks(causal, blockwise_overlay(ids))``, and
  Gemma 3's sliding layers ``and_masks(sliding_window_overlay(w), or_masks(causal, blockwise_overlay(ids)))``).

Offsets: query ``i`` sits at absolute index ``q_offset + i``, key ``j`` at ``kv_offset + j``. A causal pattern is
compact when ``q_offset - kv_offset <= kv_length - q_length``: the keys past the last query's frontier (a static
cache's unfilled tail) are seen by no query, so the attention function drops them (``kv_used``) and
:mod:`core.attention`'s bottom-right alignment holds on the rest. Anything else (image overlays built with
``or_masks`` with anything but a plain causal pattern, a pattern misaligned otherwise) is built densely with transformers' own ``sdpa_mask`` (exact,
``O(S_q · S_k)`` memory, logged once per pattern).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from transformers.masking_utils import (
    and_masks,
    bidirectional_mask_function,
    blockwise_overlay,
    causal_mask_function,
    chunked_overlay,
    or_masks,
    packed_sequence_mask_function,
    prepare_padding_mask,
    remap_positions_for_packed_sequence,
    sdpa_mask,
    sliding_window_bidirectional_overlay,
    sliding_window_overlay,
)

logger = logging.getLogger("core.hf.backend")

__all__ = ["LongctxMask", "Pattern", "recognise", "longctx_mask", "dense_mask"]

_WARNED: set[str] = set()


def warn_once(reason: str, message: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.warning(message)


@dataclass(eq=False)
class LongctxMask:
    """The attention pattern of one mask call, kept compact (what the mask function returns to the model).

    Attributes:
        causal: bottom-right aligned causal mask (:mod:`core.attention`'s convention), over the first ``kv_used``
            keys.
        window: :mod:`core.attention`'s ``window`` (causal: the latest ``window`` keys; else ``|p - j| < window``).
        key_padding: bool ``(B, S_k)``, True = padded key; None when nothing is padded.
        q_length, kv_length: the sizes the mask was made for.
        q_segments, k_segments: int ``(B, S_q)`` / ``(B, S_k)`` segment ids (a query sees its own segment only), or
            None.
        kv_used: keys ``>= kv_used`` are seen by no query (a static cache's unfilled tail); default ``kv_length``.
        q_groups, k_groups: int ``(B, S_q)`` / ``(B, S_k)`` bidirectional group ids (``-1``: none): with ``causal``,
            a query also sees the later keys of its own group; or None.

    A pattern without a compact form is returned by the mask function as transformers' dense bool mask instead.
    """

    causal: bool
    window: int | None
    key_padding: torch.Tensor | None
    q_length: int
    kv_length: int
    q_segments: torch.Tensor | None = None
    k_segments: torch.Tensor | None = None
    kv_used: int | None = None
    q_groups: torch.Tensor | None = None
    k_groups: torch.Tensor | None = None

    #: Reads as an already prepared 4-D mask to transformers' mask helpers (generation prepares masks ahead for
    #: static caches and passes them back in; :func:`longctx_mask` then returns them unchanged).
    ndim = 4
    dtype = torch.bool

    def __post_init__(self):
        if self.kv_used is None:
            self.kv_used = self.kv_length

    @property
    def shape(self) -> tuple[int, int, int, int]:
        batch = [t.shape[0] for t in (self.key_padding, self.k_segments) if t is not None]
        return (batch[0] if batch else 1, 1, self.q_length, self.kv_length)

    @property
    def device(self) -> torch.device:
        for t in (self.key_padding, self.k_segments):
            if t is not None:
                return t.device
        return torch.device("cpu")

    def contiguous(self) -> LongctxMask:
        """Itself (transformers' generation calls ``.contiguous()`` on prepared masks)."""
        return self

    def to(self, *args, **kwargs) -> LongctxMask:
        """The same pattern with its tensors moved (``Tensor.to`` arguments; a dtype is ignored)."""
        args = tuple(a for a in args if not isinstance(a, torch.dtype))
        kwargs.pop("dtype", None)
        move = (lambda t: t if t is None else t.to(*args, **kwargs)) if (args or kwargs) else (lambda t: t)
        return LongctxMask(causal=self.causal, window=self.window, key_padding=move(self.key_padding),
                           q_length=self.q_length, kv_length=self.kv_length, q_segments=move(self.q_segments),
                           k_segments=move(self.k_segments), kv_used=self.kv_used, q_groups=move(self.q_groups),
                           k_groups=move(self.k_groups))  # fmt: skip

    def to_bool(self, batch_size: int, device: torch.device) -> torch.Tensor:
        """The same pattern as a dense bool ``(B, 1, S_q, S_k)`` keep mask (for the fallbacks and tests)."""
        sq, sk, used = self.q_length, self.kv_length, self.kv_used
        qi = torch.arange(used - sq, used, device=device)[:, None]  # query i sits at key position i + used - sq
        kj = torch.arange(sk, device=device)[None, :]
        keep = (kj < used)[None, None].expand(batch_size, 1, sq, sk)
        if self.causal:
            seen = (kj <= qi)[None, None]
            if self.q_groups is not None:
                qg = self.q_groups.to(device)[:, None, :, None]
                seen = seen | ((qg == self.k_groups.to(device)[:, None, None, :]) & (qg >= 0))
            keep = keep & seen
        if self.window is not None:
            keep = keep & (kj > qi - self.window)
            if not self.causal:
                keep = keep & (kj < qi + self.window)
        if self.q_segments is not None:
            keep = keep & (self.q_segments[:, :, None] == self.k_segments[:, None, :]).to(device)[:, None]
        if self.key_padding is not None:
            keep = keep & ~self.key_padding[:, None, None, :].to(device)
        return keep

    def __getitem__(self, index) -> torch.Tensor:
        """Indexing reads the dense mask (a model's own code that slices the mask, e.g. DeepSeek-V3.2's indexer,
        which scores every query-key pair anyway)."""
        warn_once("dense:getitem", "longctx: a model indexes the attention mask; a dense copy is built for it, "
                                   "O(S_q * S_k) memory")  # fmt: skip
        return dense_mask(self)[index]


def dense_mask(m: LongctxMask) -> torch.Tensor:
    """``m`` as a dense bool keep mask (counted by the tests as a dense-mask build)."""
    return m.to_bool(m.shape[0], m.device)


# --- recognising transformers' mask patterns -------------------------------------------------------------------


@dataclass
class Pattern:
    """A recognised pattern: causal or not, a window (core semantics), segment functions of absolute indices."""

    causal: bool
    window: int | None = None
    segments: list = field(default_factory=list)  # each: (B|1, n) absolute indices -> (B|1, n) int ids
    groups: list = field(default_factory=list)  # at most one: absolute indices -> bidirectional group ids (-1: none)
    packed: bool = False  # holds packed-sequence segments
    remapped: bool = False  # its pieces were remapped to positions (exact only within packed segments)


def _code(fn):
    return getattr(fn, "__code__", None)


def _closure(fn) -> dict:
    code = _code(fn)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, (c.cell_contents for c in cells))) if code is not None else {}


_AND_CODE = _code(and_masks(causal_mask_function))
_OR_CODE = _code(or_masks(causal_mask_function))
_BLOCKWISE_CODE = _code(blockwise_overlay(torch.zeros(1, 1, dtype=torch.long)))
_WINDOW_CODE = _code(sliding_window_overlay(1))
_BIWINDOW_CODE = _code(sliding_window_bidirectional_overlay(1))
_CHUNK_CODE = _code(chunked_overlay(1, torch.zeros(1, dtype=torch.long)))
_PACKED_CODE = _code(packed_sequence_mask_function(torch.zeros(1, 1, dtype=torch.long)))
_REMAP_CODE = _code(remap_positions_for_packed_sequence(causal_mask_function, torch.zeros(1, 1, dtype=torch.long)))


def _gather(table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``table[b, idx[b, n]]`` for a ``(B, S)`` table and ``(B|1, n)`` indices (an index past ``S`` raises)."""
    idx = idx.to(table.device).expand(table.shape[0], -1)
    if idx.numel() and (int(idx.max()) >= table.shape[1] or int(idx.min()) < 0):
        raise IndexError(f"index past the {tuple(table.shape)} table")
    return table.gather(1, idx)


def _piece(fn):
    """One argument of ``and_masks``: a :class:`Pattern` (a base or a nested composition) or an overlay
    ``(kind, value)``; None when unknown."""
    if fn is causal_mask_function:
        return Pattern(causal=True)
    if fn is bidirectional_mask_function:
        return Pattern(causal=False)
    code, cl = _code(fn), _closure(fn)
    if code is _AND_CODE:
        return _and([_piece(p) for p in cl.get("mask_functions", ())])
    if code is _OR_CODE:
        return _or([_piece(p) for p in cl.get("mask_functions", ())])
    if code is _BLOCKWISE_CODE and isinstance(cl.get("block_sequence_ids"), torch.Tensor):
        table = cl["block_sequence_ids"]
        return ("group", lambda idx: _gather(table, idx))
    if code is _WINDOW_CODE and isinstance(cl.get("sliding_window"), int) and cl["sliding_window"] >= 1:
        return ("window", cl["sliding_window"])
    if code is _BIWINDOW_CODE and isinstance(cl.get("sliding_window"), int) and cl["sliding_window"] >= 0:
        return ("biwindow", cl["sliding_window"] + 1)  # |q - kv| <= w  <=>  |q - kv| < w + 1
    if code is _CHUNK_CODE and isinstance(cl.get("chunk_size"), int) and cl["chunk_size"] >= 1:
        size, left = cl["chunk_size"], cl["left_padding"]
        return ("segment", lambda idx: (idx.to(left.device) - left.view(-1, 1)) // size)
    if code is _PACKED_CODE and isinstance(cl.get("packed_sequence_mask"), torch.Tensor):
        table = cl["packed_sequence_mask"]
        return ("packed", lambda idx: _gather(table, idx))
    if code is _REMAP_CODE and isinstance(cl.get("position_ids"), torch.Tensor):
        inner = _piece(cl.get("mask_function"))
        if not isinstance(inner, Pattern):
            return None
        pos = cl["position_ids"]
        remap = [lambda idx, f=f: f(_gather(pos, idx)) for f in inner.segments]
        return Pattern(causal=inner.causal, window=inner.window, segments=remap, packed=inner.packed, remapped=True)
    return None


def _and(parts: list) -> Pattern | None:
    """The intersection of ``and_masks``' pieces as one :class:`Pattern` (None when some piece is unknown)."""
    if any(p is None for p in parts):
        return None
    bases = [p for p in parts if isinstance(p, Pattern)]
    if not bases:
        return None
    causal = any(b.causal for b in bases)
    windows = [b.window for b in bases if b.window is not None]
    segments = [f for b in bases for f in b.segments]
    groups = [f for b in bases for f in b.groups]
    packed = any(b.packed for b in bases)
    if len(groups) > 1 or any(isinstance(p, tuple) and p[0] == "group" for p in parts):
        return None  # groups only as or_masks(causal, blockwise_overlay)
    for kind, value in (p for p in parts if not isinstance(p, Pattern)):
        if kind == "window":
            if not causal:  # a one-sided window without causality has no compact form here
                return None
            windows.append(value)
        elif kind == "biwindow":
            windows.append(value)  # with causal: q - kv < w + 1, a causal window of w + 1
        else:
            segments.append(value)
            packed = packed or kind == "packed"
    if any(b.remapped for b in bases) and not packed:
        return None  # positions remapped outside packed segments: not the plain pattern
    if groups and segments:
        return None
    return Pattern(causal=causal, window=min(windows) if windows else None, segments=segments, packed=packed,
                   groups=groups)  # fmt: skip


def _or(parts: list) -> Pattern | None:
    """``or_masks(causal, blockwise_overlay(ids))``: causal attention plus bidirectional groups (None otherwise)."""
    bases = [p for p in parts if isinstance(p, Pattern)]
    groups = [p[1] for p in parts if isinstance(p, tuple) and p[0] == "group"]
    if len(bases) != 1 or len(groups) != 1 or len(parts) != 2:
        return None
    base = bases[0]
    if not base.causal or base.window is not None or base.segments or base.groups or base.remapped:
        return None  # (causal ∧ more) ∨ group is not (causal ∨ group) ∧ more
    return Pattern(causal=True, groups=groups)


def recognise(mask_function) -> Pattern | None:
    """The compact :class:`Pattern` of a transformers mask function, or None (module docs)."""
    p = _piece(mask_function)
    if not isinstance(p, Pattern) or p.remapped:  # positions remapped without packed segments: not the plain pattern
        return None
    return p


def _segment_ids(pattern: Pattern, q_idx: torch.Tensor, k_idx: torch.Tensor, batch: int):
    """Query and key segment ids ``(B, S_q)``, ``(B, S_k)`` (several segmentations combined into one id)."""
    q_ids = k_ids = None
    for fn in pattern.segments:
        q_new = fn(q_idx).long().expand(batch, -1)
        k_new = fn(k_idx).long().expand(batch, -1)
        if q_ids is None:
            q_ids, k_ids = q_new, k_new
            continue
        both_old, both_new = torch.cat([q_ids, k_ids], 1), torch.cat([q_new, k_new], 1)
        lo_old, lo_new, span = both_old.min(), both_new.min(), both_new.max() - both_new.min() + 1
        q_ids = (q_ids - lo_old) * span + (q_new - lo_new)
        k_ids = (k_ids - lo_old) * span + (k_new - lo_new)
    return q_ids, k_ids


def longctx_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    use_vmap: bool = False,
    **kwargs,
) -> LongctxMask | torch.Tensor:
    """transformers' mask interface for ``"longctx"`` (signature of ``transformers.masking_utils.sdpa_mask``).

    Query ``i`` has absolute index ``q_offset + i``, key ``j`` has ``kv_offset + j``; the 2-D ``attention_mask``
    (True = real token) is indexed by absolute key index. Returns a compact :class:`LongctxMask` for the patterns of
    the module docs; otherwise transformers' own dense bool ``(B, 1, S_q, S_k)`` mask.
    """
    if isinstance(attention_mask, LongctxMask):  # prepared ahead (generation with a static cache)
        return attention_mask
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    key_padding = None
    if padding is not None:
        padding = padding[:, kv_offset : kv_offset + kv_length].to(device=device, dtype=torch.bool)
        if not bool(padding.all()):
            key_padding = ~padding
    pattern = recognise(mask_function)
    compact = _compact(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, key_padding, device)
    if compact is not None:
        return compact
    warn_once(
        f"dense:{getattr(mask_function, '__qualname__', mask_function)}",
        "longctx: this mask pattern has no compact form here (an overlay or misaligned offsets); it is built "
        "densely, O(S_q * S_k) memory",
    )
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     allow_is_causal_skip=False, allow_is_bidirectional_skip=False, use_vmap=use_vmap,
                     device=device)  # fmt: skip


def _compact(pattern, batch_size, q_length, kv_length, q_offset, kv_offset, key_padding, device):
    if pattern is None:
        return None
    d = q_offset - kv_offset  # query i sees key j (causal) iff j <= i + d
    kv_used = kv_length
    if pattern.causal:
        if d > kv_length - q_length or q_length + d < 1:
            return None
        kv_used = q_length + d  # keys past the last query's frontier are seen by no query
    elif pattern.window is not None and d != kv_length - q_length:
        return None
    q_seg = k_seg = q_grp = k_grp = None
    q_idx = torch.arange(q_offset, q_offset + q_length, device=device)[None]
    k_idx = torch.arange(kv_offset, kv_offset + kv_length, device=device)[None]
    try:
        if pattern.segments:
            q_seg, k_seg = _segment_ids(pattern, q_idx, k_idx, batch_size)
        if pattern.groups:
            fn = pattern.groups[0]
            q_grp, k_grp = fn(q_idx).long().expand(batch_size, -1), fn(k_idx).long().expand(batch_size, -1)
    except (IndexError, RuntimeError) as err:  # a table shorter than the indices: the dense path
        logger.debug("segment or group ids not computable (%s); dense mask", err)
        return None
    return LongctxMask(causal=pattern.causal, window=pattern.window, key_padding=key_padding, q_length=q_length,
                       kv_length=kv_length, q_segments=q_seg, k_segments=k_seg, kv_used=kv_used, q_groups=q_grp,
                       k_groups=k_grp)  # fmt: skip
