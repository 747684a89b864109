"""Atomic save/load of NCAL weights (safetensors + JSON config) and of full training states (torch pickles)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from core.infra.fileio import atomic_path, torch_load, torch_save_atomic, write_json_atomic
from core.infra.fileio import load_safetensors as _load_safetensors

__all__ = ["save_safetensors", "load_safetensors", "save_state", "load_state", "read_json", "write_json_atomic"]


def save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> Path:
    """Write tensors (made contiguous, on CPU) to a safetensors file atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    with atomic_path(path) as tmp:
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
    return path


def load_safetensors(path: str | os.PathLike, *, what: str = "NCAL weights written by apps.ncal.train or "
                     "apps.ncal.pretrain") -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file; a missing or unreadable file names itself (core.infra.fileio)."""
    return _load_safetensors(path, what=what)


def save_state(path: str | os.PathLike, state: dict) -> Path:
    """``torch.save`` to a temp file then rename (a killed run keeps its previous state)."""
    return torch_save_atomic(state, path)


def load_state(path: str | os.PathLike) -> dict:
    """A training state written by :func:`save_state` (a file that is not one names itself)."""
    return torch_load(path, what="an NCAL training state (last.pt written by apps.ncal.train or apps.ncal.pretrain)")


def read_json(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no file at {path}")
    return json.loads(path.read_text(encoding="utf-8"))
