"""Settings fingerprints of batch-job outputs: canonical JSON, SHA-256, readable differences, file identity."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------- settings fingerprint


def canonical_settings(settings: Any) -> Any:
    """``settings`` as plain JSON values: tuples become lists, integral floats ints (``1.0`` and ``1`` agree)."""
    if isinstance(settings, dict):
        return {str(k): canonical_settings(v) for k, v in settings.items()}
    if isinstance(settings, (list, tuple)):
        return [canonical_settings(v) for v in settings]
    if isinstance(settings, bool) or settings is None or isinstance(settings, (str, int)):
        return settings
    if isinstance(settings, float):
        if not math.isfinite(settings):
            raise ValueError(f"settings hold a non-finite number ({settings}); only finite numbers are accepted")
        return int(settings) if settings.is_integer() else settings
    raise ValueError(f"settings hold a {type(settings).__name__} ({settings!r}); accepted: dict, list, tuple, str, "
                     "int, float, bool, None")


def _settings_json(settings: dict) -> str:
    return json.dumps(canonical_settings(settings), sort_keys=True, separators=(",", ":"))


def settings_fingerprint(settings: dict) -> str:
    """Stable 16-hex-digit hash of a settings dict (SHA-256 of its sorted, canonical JSON)."""
    return hashlib.sha256(_settings_json(settings).encode()).hexdigest()[:16]


def settings_diff(stored: dict | None, wanted: dict) -> list[str]:
    """Human-readable differences ``"key: stored -> wanted"`` (nested keys dotted); empty when they agree."""
    if stored is None:
        return ["no settings record (written by an older version or another tool)"]

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out

    a, b = flat(canonical_settings(stored)), flat(canonical_settings(wanted))
    missing = object()
    return [f"{k}: {json.dumps(a.get(k)) if k in a else '(absent)'} -> {json.dumps(b.get(k)) if k in b else '(absent)'}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def file_identity(path: str | os.PathLike) -> dict:
    """Identity of a file's content for settings: size and SHA-256 of all its bytes (not its path or time, so a
    copied or moved file keeps it). Reads the whole file: call it once per run."""
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


