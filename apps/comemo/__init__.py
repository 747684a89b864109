"""CoMemo: a vision-language model with two image paths (context tokens and gated cross-attention memory)
and RoPE-DHR positions for tiled high-resolution images.

Modules: :mod:`apps.comemo.tiling` (InternVL's dynamic tiling), :mod:`apps.comemo.tokenizer`
(``tokenizer.json`` with image special tokens), :mod:`apps.comemo.synthetic` (procedural multi-image tasks),
:mod:`apps.comemo.model` (vision encoder, pixel shuffle, projector, the four variants),
:mod:`apps.comemo.train` (staged training CLI), :mod:`apps.comemo.api` (``CoMemo``),
:mod:`apps.comemo.predict` (CLI); :mod:`apps.comemo.hf` (``CoMemo.from_hf``: the memory path on a transformers
InternVL model; :mod:`apps.comemo.hf_config` its architecture switches, :mod:`apps.comemo.hf_prompt` its prompts),
:mod:`apps.comemo.recipes.internvl` (its staged training), :mod:`apps.comemo.release` and :mod:`apps.comemo.convert`
(the authors' released checkpoints, converted). Importing this package does no work.
"""

from __future__ import annotations

__all__ = ["CoMemo"]


def __getattr__(name: str):
    if name == "CoMemo":  # imported on first use, so importing the package stays free
        from apps.comemo.api import CoMemo

        return CoMemo
    raise AttributeError(f"module 'apps.comemo' has no attribute {name!r}")
