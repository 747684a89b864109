"""Atomic file writes: a temp file in the target's folder, then ``os.replace``, so a killed process never leaves
a half-written file under the final name; and :func:`check_writable`, which a command calls on its output paths
before the work whose results they record.

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

__all__ = ["atomic_path", "torch_save_atomic", "write_text_atomic", "write_json_atomic", "check_writable"]


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


def check_writable(path: str | os.PathLike | None, *, what: str = "output", folder: bool = False) -> Path:
    """``path`` as a :class:`Path` if an output can be written there, else ``ValueError`` naming ``what`` (the
    option, e.g. ``"--json"``) and what is accepted. Nothing is created: a missing folder on the way is fine (the
    atomic writers create it) when the nearest existing one is a folder this process can write in.

    Refused: an empty path; for a file (``folder=False``) an existing folder or anything but a regular file; for a
    folder (``folder=True``) an existing file; a path under a file; a place where no file can be created (the
    nearest existing folder is probed with a temp file, so read-only file systems are caught as well).
    """
    kind = "folder" if folder else "file"
    if path is None or not str(path).strip():
        raise ValueError(f"{what} is empty; give a {kind} path")
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a file; give a folder (existing or to be created)")
    if not folder and p.is_dir():
        raise ValueError(f"{what} {str(p)!r} is a folder; give a file path (e.g. {str(p / 'results.json')!r})")
    if not folder and p.exists() and not p.is_file():
        raise ValueError(f"{what} {str(p)!r} is not a regular file; give a file path to create or replace")
    base = p if folder else p.parent
    base = base.absolute()
    while not base.exists() and base != base.parent:
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{what} {str(p)!r} cannot be made: {str(base)!r} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(dir=base, prefix=".write-check.")
    except OSError as err:
        raise ValueError(f"{what} {str(p)!r} cannot be written: no file can be created in {str(base)!r} "
                         f"({err.strerror or err})") from None
    os.close(fd)
    os.unlink(probe)
    return p
