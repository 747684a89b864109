"""What the EMLoC CLIs share: the default host weights and loading a host."""

from __future__ import annotations

from pathlib import Path

from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost

__all__ = ["DEFAULT_WEIGHTS", "load_host"]


def load_host(path: Path | None) -> EMLoCHost:
    """The host at ``path``, or the shipped default; FileNotFoundError with a hint when neither exists."""
    path = Path(path) if path is not None else DEFAULT_WEIGHTS
    if not path.is_file():
        raise FileNotFoundError(
            f"no EMLoC host weights at {path}; pass --model PATH (train one with `python -m apps.emloc.train --out DIR`)"
        )
    return EMLoCHost.load(path)
