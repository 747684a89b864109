"""EMLoC: many-shot multimodal in-context learning with a compressed, reusable demonstration prefix.

Host model (:mod:`apps.emloc.model`), episodes (:mod:`apps.emloc.data`), meta-training
(``python -m apps.emloc.train``), and the faces ``compress`` / ``CompressedContext`` (:mod:`apps.emloc.api`).
Real transformers vision-language models (Qwen2-VL first): ``compress_hf`` / ``HFContext`` (:mod:`apps.emloc.hf`,
loaded lazily: it needs the ``hf`` extra); ``compress(model, demos, processor=...)`` dispatches there too.
"""

from apps.emloc.api import CompressedContext, check_demos, compress
from apps.emloc.model import EMLoCHost, HostConfig

__all__ = ["compress", "CompressedContext", "check_demos", "EMLoCHost", "HostConfig", "compress_hf", "HFContext"]


def __getattr__(name: str):
    if name in ("compress_hf", "HFContext"):
        from apps.emloc import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'apps.emloc' has no attribute {name!r}")
