"""The bridge to real transformers models.

* ``register()`` adds ``"longctx"`` to transformers' attention and mask interfaces: a model loaded with
  ``attn_implementation="longctx"`` runs every attention call on :func:`core.attention.attention`
  (:mod:`core.hf.backend`).
* ``load(path, ...)`` loads a model and its processor from a local folder only (:mod:`core.hf.loading`).
* cache surgery on ``DynamicCache`` — read, prune per layer and key/value head, save and reload with a model
  fingerprint (:mod:`core.hf.cache`); explicit (M-RoPE) position ids through prefill and decode
  (:mod:`core.hf.positions`); attention/hidden-state probes (:mod:`core.hf.probes`); modules inserted before
  chosen decoder layers (:mod:`core.hf.insert`).

Needs the ``hf`` extra: ``pip install 'longctx-suite[hf]'``.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the installed extras
    raise ImportError("core.hf needs transformers: pip install 'longctx-suite[hf]'") from err

from core.hf.backend import (
    ATTN_NAME,
    LongctxMask,
    is_registered,
    longctx_attention,
    longctx_mask,
    register,
    set_attention_options,
)
from core.hf.cache import (
    CacheMismatchError,
    HiddenKeysLayer,
    cache_tensors,
    load_cache,
    model_fingerprint,
    prune_cache,
    save_cache,
)
from core.hf.insert import ContextInsert, InsertedBefore, decoder_layers, insert_before, inserted_modules, revert
from core.hf.loading import Loaded, check_model_folder, load
from core.hf.positions import greedy_decode, mrope_position_ids, next_positions, prefill
from core.hf.probes import ProbeRecord, probe

__all__ = [
    "ATTN_NAME",
    "CacheMismatchError",
    "ContextInsert",
    "HiddenKeysLayer",
    "InsertedBefore",
    "Loaded",
    "LongctxMask",
    "ProbeRecord",
    "cache_tensors",
    "check_model_folder",
    "decoder_layers",
    "greedy_decode",
    "insert_before",
    "inserted_modules",
    "is_registered",
    "load",
    "load_cache",
    "longctx_attention",
    "longctx_mask",
    "model_fingerprint",
    "mrope_position_ids",
    "next_positions",
    "prefill",
    "probe",
    "prune_cache",
    "register",
    "revert",
    "save_cache",
    "set_attention_options",
]
