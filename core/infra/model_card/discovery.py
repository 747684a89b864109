"""Where the shipped weights are, where their card and provenance go, and what the weights file itself says
(size, tensors, parameters, SHA-256)."""

from __future__ import annotations

import hashlib
import json
import logging
import struct
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


from core.infra.model_card.texts import REPO

# --------------------------------------------------------------------------------------------- discovery


def discover_weights(root: Path = REPO) -> list[Path]:
    """Every shipped ``*.safetensors`` in a ``weights/`` folder of a Python package of ``root``, sorted.

    Looks in ``<pkg>/weights/`` and ``<pkg>/<sub>/weights/`` (``tabular/weights/``, ``apps/ncal/weights/``) and in
    their sub-folders (``weights/<name>/model.safetensors``); a folder counts as a package when it holds
    ``__init__.py``. Hidden folders (``.venv``) are skipped.
    """
    root = Path(root)
    found = set()
    for pattern in ("*/weights/**/*.safetensors", "*/*/weights/**/*.safetensors"):
        for path in root.glob(pattern):
            rel = path.relative_to(root)
            if any(part.startswith(".") for part in rel.parts):
                continue
            weights_dir = next(p for p in path.parents if p.name == "weights")
            if (weights_dir.parent / "__init__.py").is_file():
                found.add(path)
    return sorted(found)


def card_path(weights: Path) -> Path:
    """Where the card of ``weights`` lives: ``<stem>.md`` beside a file directly in ``weights/``,
    ``weights/<name>.md`` for a file inside ``weights/<name>/...``."""
    weights = Path(weights)
    if weights.parent.name == "weights":
        return weights.with_suffix(".md")
    weights_dir = next((p for p in weights.parents if p.name == "weights"), None)
    if weights_dir is None:
        raise ValueError(f"{weights} is not inside a weights/ folder")
    return weights_dir / (weights.relative_to(weights_dir).parts[0] + ".md")


def provenance_path(weights: Path) -> Path:
    """The JSON a card is rendered from: ``<stem>.json`` beside a file directly in ``weights/``,
    ``weights/<name>.json`` for a file inside ``weights/<name>/...`` (always beside the card)."""
    return card_path(weights).with_suffix(".json")


def weights_summary(path: Path) -> dict[str, Any]:
    """Size, SHA-256, tensor and parameter counts of a safetensors file (read from its header, no torch)."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is not a safetensors file: {len(data)} bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path} is not a safetensors file: header length {n} exceeds the file ({len(data)} bytes)")
    try:
        header = json.loads(data[8 : 8 + n])
    except ValueError as e:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    params = 0
    dtypes = set()
    for name, t in tensors.items():
        count = 1
        for d in t["shape"]:
            count *= int(d)
        params += count
        dtypes.add(t["dtype"])
    return {
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "tensors": len(tensors),
        "elements": params,
        "dtypes": sorted(dtypes),
    }


