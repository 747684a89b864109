"""∞-Video: question answering over videos of any length with a short-clip Q-former and a continuous memory.

``from video import InfiniteVideo``; see :mod:`video.infinite`. Submodules: ``io`` (streaming reader),
``synthetic`` (procedural long-video QA), ``encoders``, ``model``, ``train``, ``batch``, ``hf``
(a real transformers Q-former video-LLM: ``InfiniteVideo.from_hf(folder)``), ``recipes``.
"""

from __future__ import annotations

__all__ = ["InfiniteVideo", "InfiniteVideoConfig", "InfiniteVideoLM", "HFVideoConfig", "VideoStream"]


def __getattr__(name: str):
    # Lazy: importing the package loads no model and imports nothing heavy.
    if name in ("InfiniteVideo", "InfiniteVideoConfig"):
        from video import infinite

        return getattr(infinite, name)
    if name in ("InfiniteVideoLM", "HFVideoConfig"):
        from video import hf

        return getattr(hf, name)
    if name == "VideoStream":
        from video.io import VideoStream

        return VideoStream
    raise AttributeError(f"module 'video' has no attribute {name!r}")
