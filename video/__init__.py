"""∞-Video: question answering over videos of any length with a short-clip Q-former and a continuous memory.

``from video import InfiniteVideo``; see :mod:`video.infinite`. Submodules: ``io`` (streaming reader),
``synthetic`` (procedural long-video QA), ``encoders``, ``model``, ``train``, ``batch``.
"""

from __future__ import annotations

__all__ = ["InfiniteVideo", "InfiniteVideoConfig", "VideoStream"]


def __getattr__(name: str):
    # Lazy: importing the package loads no model and imports nothing heavy.
    if name in ("InfiniteVideo", "InfiniteVideoConfig"):
        from video import infinite

        return getattr(infinite, name)
    if name == "VideoStream":
        from video.io import VideoStream

        return VideoStream
    raise AttributeError(f"module 'video' has no attribute {name!r}")
