"""Whole-slide image pipeline and the Querent slide model.

Slides (OpenSlide formats and plain images) -> tissue mask -> patch grid at a target µm/px -> patch
encoder -> HDF5 bags (CLAM layout) -> Querent (query-aware region attention) or a MIL baseline.
Names are imported lazily so ``import pathology`` stays cheap.
"""

from __future__ import annotations

import importlib

__all__ = ["Querent", "QuerentConfig", "Slide", "SlideError", "build_model", "build_encoder", "segment_tissue",
           "patch_grid"]

_LAZY = {
    "Querent": "pathology.querent",
    "QuerentConfig": "pathology.querent",
    "Slide": "pathology.slide",
    "SlideError": "pathology.slide",
    "build_model": "pathology.mil",
    "build_encoder": "pathology.encoders",
    "segment_tissue": "pathology.tissue",
    "patch_grid": "pathology.patching",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pathology' has no attribute {name!r}")
