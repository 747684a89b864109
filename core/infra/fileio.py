"""Atomic file writes: a temp file in the target's folder, then ``os.replace``, so a killed process never leaves
a half-written file under the final name.

Used by the domain packages' CLIs and by the benchmark scripts (which re-export :func:`write_json_atomic` from
``benchmarks.common``).
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "torch_save_atomic", "write_text_atomic", "write_json_atomic"]


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp file name beside ``path`` for a writer that takes a file name (``safetensors``' ``save_file``,
    ``save_model``); on success it replaces ``path``, on any exception it is removed. Creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are shared files (results, weights)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``; creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.chmod(tmp, 0o644)  # mkstemp creates 0600; outputs are shared files (results, weights)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """``obj`` as indented JSON (trailing newline) at ``path``, written atomically (see :func:`write_text_atomic`)."""
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def torch_save_atomic(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save(obj)`` at ``path`` through :func:`atomic_path` (a killed run keeps the previous file)."""
    import torch

    with atomic_path(path) as tmp:
        torch.save(obj, tmp)
    return Path(path)
