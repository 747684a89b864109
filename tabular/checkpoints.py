"""The official TabICL checkpoints where a user of the official package already has them: the local Hugging Face cache.

``checkpoint="v1" | "v1.1" | "v2" | "v2-regressor"`` (or a released file name such as
``"tabicl-classifier-v2-20260212.ckpt"`` that is not a path here) resolves to the file the official package keeps in
the Hugging Face hub cache (repository ``jingang/TabICL``)::

    $HF_HUB_CACHE/models--jingang--TabICL/snapshots/<revision>/<file>

The cache folder is ``HF_HUB_CACHE`` (or the older ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else
``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``, read when a name is resolved. The revision is
the one ``refs/main`` names, else the newest snapshot holding the file. Nothing is downloaded: a release absent from
the cache is a :class:`CheckpointNotCached` error (one line) naming the file and the command that fetches it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["HF_REPO", "RELEASES", "CheckpointNotCached", "hub_cache_dir", "find_cached", "resolve_checkpoint"]

#: The Hugging Face repository of the official checkpoints.
HF_REPO = "jingang/TabICL"
#: Release names -> the released files.
RELEASES = {
    "v1": "tabicl-classifier-v1-20250208.ckpt",
    "v1.1": "tabicl-classifier-v1.1-20250506.ckpt",
    "v2": "tabicl-classifier-v2-20260212.ckpt",
    "v2-regressor": "tabicl-regressor-v2-20260212.ckpt",
}


class CheckpointNotCached(FileNotFoundError):
    """A release name whose file is not in the local Hugging Face cache (the message says how to fetch it)."""


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache folder, from the environment as the official package would find it."""
    env = os.environ.get
    home = env("HF_HOME") or os.path.join(env("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    hub = env("HF_HUB_CACHE") or env("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(hub)))


def find_cached(filename: str, cache: str | os.PathLike | None = None) -> Path | None:
    """The cached file ``filename`` of :data:`HF_REPO` (``refs/main``'s snapshot first, else the newest snapshot that
    holds it), or None."""
    repo = Path(cache if cache is not None else hub_cache_dir()) / ("models--" + HF_REPO.replace("/", "--"))
    snapshots = repo / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo / "refs" / "main"
    if ref.is_file():
        path = snapshots / ref.read_text().strip() / filename
        if path.is_file():
            return path
    found = [p / filename for p in snapshots.iterdir() if (p / filename).is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def _not_cached(name: str, filename: str) -> CheckpointNotCached:
    where = hub_cache_dir() / ("models--" + HF_REPO.replace("/", "--"))
    label = f"TabICL release {name!r} ({filename})" if name != filename else f"TabICL checkpoint {filename}"
    return CheckpointNotCached(f"{label} is not in the local Hugging Face cache ({where}); download it with: "
                               f"hf download {HF_REPO} {filename}   (or give the file's path)")


def resolve_checkpoint(checkpoint) -> Path | None:
    """``checkpoint`` as a file path: None stays None (the caller's default); a release name of :data:`RELEASES`
    is looked up in the Hugging Face cache; a released file name that is not a file here is too; any other value is
    returned as a path (its loader reports a missing file). Raises :class:`CheckpointNotCached` for a release that
    is not cached."""
    if checkpoint is None:
        return None
    text = os.fspath(checkpoint)
    if text in RELEASES:
        found = find_cached(RELEASES[text])
        if found is None:
            raise _not_cached(text, RELEASES[text])
        return found
    path = Path(text)
    if text in RELEASES.values() and not path.exists():
        found = find_cached(text)
        if found is None:
            raise _not_cached(text, text)
        return found
    return path
