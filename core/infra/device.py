"""One device and dtype convention for every real-model path, CLI and recipe.

- ``--device auto`` (the default): CUDA when a GPU is present, else the CPU. A device asked for by name that this
  machine does not have (``cuda`` without a GPU, ``cuda:3`` on a one-GPU machine, ``mps`` off a Mac) is a
  :class:`~core.infra.cli.UsageError`: one line, exit code 2, naming what was asked and what is available.
- ``--dtype auto`` (the default): bf16 on CUDA (fp16 where the GPU has no bf16), fp32 on the CPU.

Library functions take ``device=None`` / ``dtype=None`` (both meaning "auto") and call :func:`resolve_device` /
:func:`resolve_dtype` once; CLIs add the two options with :func:`add_device_options` and resolve them with
:func:`device_from_args`. Nothing here queries CUDA at import.
"""

from __future__ import annotations

import argparse
import re
from typing import Any

__all__ = ["DTYPES", "resolve_device", "resolve_dtype", "add_device_options", "device_from_args", "available_devices"]

#: names accepted by ``--dtype`` (and ``dtype=`` as a string) -> torch dtype attribute name
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}  # fmt: skip

_DEVICE = re.compile(r"^(cpu|cuda|mps|xpu)(:\d+)?$")


def available_devices() -> list[str]:
    """The devices this machine has, e.g. ``['cpu', 'cuda:0']``."""
    import torch

    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(device: Any = None, *, flag: str = "--device") -> "torch.device":  # noqa: F821
    """``device`` as a ``torch.device``: None or ``"auto"`` -> CUDA when present, else CPU; a device that this
    machine lacks raises :class:`~core.infra.cli.UsageError` (one line: what was asked, what is available)."""
    import torch

    from core.infra.cli import UsageError

    if isinstance(device, torch.device):
        text = str(device)
    else:
        text = "auto" if device is None else str(device).strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not _DEVICE.match(text):
        raise UsageError(f"{flag} {device!r} is not a device; accepted: auto, cpu, cuda, cuda:N, mps")
    kind, _, index = text.partition(":")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {text}: no CUDA GPU on this machine (available: {', '.join(available_devices())}); "
                             f"use {flag} auto or cpu")
        if index and int(index) >= torch.cuda.device_count():
            raise UsageError(f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA GPU(s) "
                             f"(available: {', '.join(available_devices())})")
    elif kind == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise UsageError(f"{flag} {text}: no MPS device on this machine (available: {', '.join(available_devices())})")
    elif kind == "xpu":
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not xpu.is_available():
            raise UsageError(f"{flag} {text}: no XPU device on this machine (available: {', '.join(available_devices())})")
    return torch.device(text)


def resolve_dtype(dtype: Any = None, device: Any = None, *, flag: str = "--dtype") -> "torch.dtype":  # noqa: F821
    """``dtype`` as a ``torch.dtype``: None or ``"auto"`` -> bf16 on CUDA (fp16 where bf16 is not supported), fp32
    elsewhere; a name of :data:`DTYPES` or a ``torch.dtype`` as given; anything else a ``UsageError``."""
    import torch

    from core.infra.cli import UsageError

    if isinstance(dtype, torch.dtype):
        return dtype
    text = "auto" if dtype is None else str(dtype).strip().lower().removeprefix("torch.")
    if text == "auto":
        dev = resolve_device(device)
        if dev.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if text not in DTYPES:
        raise UsageError(f"{flag} {dtype!r} is not a dtype; accepted: auto, {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[text])


def _device_arg(text: str) -> str:
    text = text.strip().lower()
    if text != "auto" and not _DEVICE.match(text):
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda, cuda:N or mps, got {text!r}")
    return text


def _dtype_arg(text: str) -> str:
    text = text.strip().lower()
    if text != "auto" and text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected auto or one of {', '.join(DTYPES)}, got {text!r}")
    return text


def add_device_options(p: argparse.ArgumentParser, *, dtype: bool = True, dtype_default: str = "auto") -> None:
    """``--device`` (default ``auto``) and, unless ``dtype=False``, ``--dtype`` (default ``dtype_default``, ``auto``
    unless a command measures at a fixed dtype); their spelling is checked when parsed, their availability by
    :func:`device_from_args` (exit 2 when missing)."""
    p.add_argument("--device", type=_device_arg, default="auto",
                   help="auto (CUDA when present, else CPU), cpu, cuda, cuda:N, mps (default auto)")
    if dtype:
        p.add_argument("--dtype", type=_dtype_arg, default=_dtype_arg(dtype_default),
                       help=f"auto (bf16 on CUDA, fp32 on CPU), float32, float16, bfloat16 (default {dtype_default})")


def device_from_args(args: argparse.Namespace) -> tuple["torch.device", "torch.dtype"]:  # noqa: F821
    """The ``torch.device`` and ``torch.dtype`` that ``--device``/``--dtype`` ask for (see :func:`resolve_device`,
    :func:`resolve_dtype`); a missing device raises ``UsageError`` (exit 2 under ``run_cli``)."""
    device = resolve_device(getattr(args, "device", None))
    return device, resolve_dtype(getattr(args, "dtype", None), device)
