"""Atomic save/load of NCAL weights (safetensors + JSON config) and of full training states (torch pickles)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from core.infra.fileio import atomic_path, torch_save_atomic, write_json_atomic

__all__ = ["save_safetensors", "load_safetensors", "save_state", "load_state", "read_json", "write_json_atomic"]


def save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write tensors (made contiguous, on CPU) to a safetensors file atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    return path


def load_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no weights file at {path}")
    return load_file(str(path))


def save_state(path: str | os.PathLike, state: dict) -> Path:
    """``torch.save`` to a temp file then rename (a killed run keeps its previous state)."""
    return torch_save_atomic(state, path)


def load_state(path: str | os.PathLike) -> dict:
    return torch.load(Path(path), map_location="cpu", weights_only=False)


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}")
    return json.loads(path.read_text(encoding="utf-8"))
