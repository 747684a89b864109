"""Atomic file writes: a temp file in the target's folder, then ``os.replace``, so a killed process never leaves
a half-written file under the final name; and :func:`check_writable`, which a command calls on its output paths
before the work whose results they record.

Readers of user files in the formats the project loads (:func:`load_safetensors`, :func:`open_safetensors`,
:func:`load_safetensors_model`, :func:`torch_load`, :func:`open_hdf5`, :func:`open_image`): a missing path is a
``FileNotFoundError``, and a file the library cannot read (text, truncated, another format) or, for a model
(:func:`load_safetensors_model`, :func:`load_state_dict_checked`), weights of another model a ``ValueError``,
both naming the file, the format and what was expected there, e.g. ``runs/x/model.safetensors is not a readable
safetensors file (header too large); expected the weights written by rl.train``. Videos and slides have their
readers in ``video.io`` and ``pathology.slide``.

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

__all__ = ["file_mode", "set_file_mode", "atomic_path", "torch_save_atomic", "write_text_atomic", "write_json_atomic",
           "check_writable", "load_safetensors", "open_safetensors", "load_safetensors_model",
           "load_state_dict_checked", "torch_load", "open_hdf5", "open_image", "file_sha256", "check_finite_tensors"]


def _umask() -> int:
    """The process's umask, read without changing it where the system tells it (``/proc/self/status``)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)  # elsewhere: set and restore at once
    os.umask(old)
    return old


def file_mode() -> int:
    """The mode a plain ``open(path, "w")`` gives a new file: ``0o666`` less the user's umask (``0o644`` under the
    usual umask 022, ``0o600`` under 077, ``0o664`` under 002)."""
    return 0o666 & ~_umask()


def set_file_mode(path: str | os.PathLike) -> None:
    """Give ``path`` the mode of :func:`file_mode`: temp files (``mkstemp`` makes them ``0o600``, as does the
    safetensors writer) follow the user's umask once renamed into place, like any file the user creates."""
    os.chmod(path, file_mode())


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[str]:
    """Yield a temp file name beside ``path`` for a writer that takes a file name (``safetensors``' ``save_file``,
    ``save_model``); on success it replaces ``path``, on any exception it is removed. Creates the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield tmp
        set_file_mode(tmp)  # after the writer: mkstemp and some writers (safetensors) create 0600
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
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        set_file_mode(tmp)  # mkstemp creates 0600; the output follows the user's umask
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


# -- readers: a file a library cannot read becomes an error that names it and what was expected -------------------


def _input_file(path: str | os.PathLike, fmt: str, what: str) -> str:
    """``path`` as a string when it is an existing file, else ``FileNotFoundError`` / ``ValueError`` naming it."""
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FileNotFoundError(f"no {fmt} file at {p}; expected {what}")
    if os.path.isdir(p):
        raise ValueError(f"{p} is a folder, not a {fmt} file; expected {what}")
    return p


def _unreadable(path: str, fmt: str, what: str, err: BaseException) -> ValueError:
    reason = " ".join(str(err).split()).removeprefix("Error while deserializing header: ")
    if type(err).__name__ != "SafetensorError":  # the library's message alone can be cryptic ("pop from empty list")
        reason = f"{type(err).__name__}: {reason}" if reason else type(err).__name__
    if len(reason) > 300:
        reason = reason[:300] + "..."
    return ValueError(f"{path} is not a readable {fmt} file ({reason}); expected {what}")


def load_safetensors(path: str | os.PathLike, *, what: str = "safetensors weights",
                     device: Any = "cpu") -> dict[str, Any]:
    """Every tensor of a safetensors file, on ``device``.

    Args:
        what: what the file should hold, for the error message (``"the weights written by rl.train"``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a folder, or a file that is not safetensors (text, truncated, another format).
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    p = _input_file(path, "safetensors", what)
    try:
        tensors = load_file(p, device=str(device))
    except PermissionError:
        raise
    except (SafetensorError, OSError) as err:
        raise _unreadable(p, "safetensors", what, err) from err
    check_finite_tensors(tensors, p, what=what)
    return tensors


@contextmanager
def open_safetensors(path: str | os.PathLike, *, what: str = "safetensors weights", device: Any = "cpu") -> Iterator[Any]:
    """``safetensors.safe_open(path, framework="pt", device=device)`` as a context; the library's errors, at
    opening and inside the block (``get_tensor`` of a name the file lacks), become the ``ValueError`` of
    :func:`load_safetensors`, as does a missing path its ``FileNotFoundError``."""
    from safetensors import SafetensorError, safe_open

    p = _input_file(path, "safetensors", what)
    try:
        handle = safe_open(p, framework="pt", device=str(device))
    except PermissionError:
        raise
    except (SafetensorError, OSError) as err:
        raise _unreadable(p, "safetensors", what, err) from err
    with handle as f:
        try:
            yield _FiniteHandle(f, p, what)
        except SafetensorError as err:
            raise _unreadable(p, "safetensors", what, err) from err


def load_safetensors_model(model: Any, path: str | os.PathLike, *, what: str = "safetensors weights",
                           device: Any = "cpu", strict: bool = True) -> tuple[list[str], list[str]]:
    """``safetensors.torch.load_model`` (weights stored once for tied parameters are restored to all of them):
    a file that is not safetensors, or (``strict``) whose tensors do not match ``model``'s, is a ``ValueError``
    naming the file. Returns ``(missing, unexpected)`` key lists (empty when ``strict``)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_model

    p = _input_file(path, "safetensors", what)
    try:
        result = load_model(model, p, strict=strict, device=str(device))
    except PermissionError:
        raise
    except (SafetensorError, OSError) as err:
        raise _unreadable(p, "safetensors", what, err) from err
    except RuntimeError as err:  # strict: keys or shapes that do not fit the model
        if "Error(s) in loading state_dict" not in str(err):
            raise
        with safe_open(p, framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        raise _misfit(model, shapes, p, what) from err
    with safe_open(p, framework="pt") as f:  # the header only: which of the model's tensors came from the file
        stored = set(f.keys())
    check_finite_tensors({k: v for k, v in model.state_dict().items() if k in stored}, p, what=what)
    return result


def load_state_dict_checked(model: Any, state: dict[str, Any], path: str | os.PathLike, *, what: str) -> None:
    """``model.load_state_dict(state)`` (strict) for tensors read from ``path``; keys or shapes that do not fit
    ``model`` are the ``ValueError`` of :func:`load_safetensors_model` naming ``path``."""
    check_finite_tensors(state, path, what=what)
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        if "Error(s) in loading state_dict" not in str(err):
            raise
        raise _misfit(model, {k: tuple(v.shape) for k, v in state.items()}, os.fspath(path), what) from err


def _misfit(model: Any, shapes: dict[str, tuple], path: str, what: str) -> ValueError:
    """One line for a file whose tensors (name -> shape) do not fit ``model``: keys missing, unexpected, of another
    shape (three of each named)."""
    own = model.state_dict()
    stored = {own[k].data_ptr() for k in shapes if k in own}  # a tied weight is stored under one of its names
    groups = {"missing keys": [k for k in own if k not in shapes and own[k].data_ptr() not in stored],
              "unexpected keys": [k for k in shapes if k not in own],
              "other shapes": [f"{k} {list(shapes[k])} (model {list(own[k].shape)})" for k in shapes
                               if k in own and tuple(own[k].shape) != tuple(shapes[k])]}
    parts = [f"{name} ({len(keys)}) {', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}"
             for name, keys in groups.items() if keys]
    return ValueError(f"{path} does not fit the model (weights of another model: {'; '.join(parts)}); expected {what}")


def torch_load(path: str | os.PathLike, *, what: str = "a checkpoint written by torch.save",
               map_location: Any = "cpu", weights_only: bool = False) -> Any:
    """``torch.load(path)``; any failure to unpickle (text, truncated, another format: the library raises
    ``UnpicklingError``, ``EOFError``, ``RuntimeError``, ``OSError``, ...) is a ``ValueError`` naming the file.
    ``weights_only=False`` (the default here) runs pickled code: use it only for the project's own checkpoints."""
    import torch

    p = _input_file(path, "PyTorch checkpoint", what)
    try:
        obj = torch.load(p, map_location=map_location, weights_only=weights_only)
    except PermissionError:
        raise
    except Exception as err:  # noqa: BLE001 - torch.load raises many types for a file it cannot unpickle
        raise _unreadable(p, "PyTorch checkpoint", what, err) from err
    check_finite_tensors(dict(_nested_tensors(obj)), p, what=what)
    return obj


def open_hdf5(path: str | os.PathLike, *, what: str = "an HDF5 file") -> Any:
    """``h5py.File(path, "r")`` (use it as a context); a file that is not HDF5, or is truncated, is a
    ``ValueError`` naming it."""
    try:
        import h5py
    except ImportError as err:  # pragma: no cover - depends on the install
        raise ImportError("reading HDF5 files needs h5py: pip install h5py") from err

    p = _input_file(path, "HDF5", what)
    try:
        return h5py.File(p, "r")
    except PermissionError:
        raise
    except OSError as err:  # h5py reports every unreadable file as OSError
        raise _unreadable(p, "HDF5", what, err) from err


def open_image(path: str | os.PathLike, *, what: str = "an image (PNG, JPEG, TIFF, ...)",
               max_pixels: int | None = None) -> Any:
    """A ``PIL.Image`` of ``path``, decoded (so a truncated file fails here, not at first use; use it as a
    context or ``.close()`` it); a file PIL cannot identify or decode is a ``ValueError`` naming it, as is one of
    more than ``max_pixels`` pixels (checked from the header, before decoding)."""
    from PIL import Image

    p = _input_file(path, "image", what)
    try:
        im = Image.open(p)
    except PermissionError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:  # UnidentifiedImageError: OSError
        raise _unreadable(p, "image", what, err) from err
    w, h = im.size
    if max_pixels is not None and w * h > max_pixels:
        im.close()
        raise ValueError(f"{p} is a {w}x{h} image ({w * h} pixels), above the limit of {max_pixels}; expected {what}")
    try:
        im.load()
    except Exception as err:  # noqa: BLE001 - decoders raise OSError ("image file is truncated"), ValueError, ...
        im.close()
        raise _unreadable(p, "image", what, err) from err
    return im


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 hex digest of a file's bytes, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- non-finite weights: a diverged or corrupted checkpoint is refused where it is read, naming the file ------------


def check_finite_tensors(tensors: Any, path: str | os.PathLike, *, what: str) -> None:
    """``ValueError`` naming ``path``, the tensors and ``what`` was expected when a floating-point tensor of
    ``tensors`` (a mapping name -> tensor; other values are skipped) holds NaN or infinity: the weights of a run
    that diverged, or a damaged file, would otherwise give NaN outputs (or a constant class) without a word."""
    import torch

    bad = []
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()) and t.numel() \
                and not bool(torch.isfinite(t).all()):
            bad.append(str(name))
    if bad:
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise ValueError(f"{os.fspath(path)} holds values that are not finite (NaN or infinity) in "
                         f"{', '.join(bad[:3])}{more}; "
                         f"expected {what} with finite weights (a diverged or damaged run is not loaded)")


def _nested_tensors(obj: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(dotted name, tensor) of every tensor in nested dicts, lists and tuples (a training state, an optimizer's)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield prefix or "tensor", obj
    elif depth < 8 and isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nested_tensors(v, f"{prefix}.{k}" if prefix else str(k), depth + 1)
    elif depth < 8 and isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _nested_tensors(v, f"{prefix}.{i}" if prefix else str(i), depth + 1)


class _FiniteHandle:
    """A ``safe_open`` handle whose ``get_tensor`` refuses a tensor with NaN or infinity (see
    :func:`check_finite_tensors`); everything else is the handle's own."""

    def __init__(self, handle: Any, path: str, what: str) -> None:
        self._handle, self._path, self._what = handle, path, what

    def get_tensor(self, name: str) -> Any:
        t = self._handle.get_tensor(name)
        check_finite_tensors({name: t}, self._path, what=self._what)
        return t

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)
