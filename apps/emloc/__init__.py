"""EMLoC: many-shot multimodal in-context learning with a compressed, reusable demonstration prefix.

Host model (:mod:`apps.emloc.model`), episodes (:mod:`apps.emloc.data`), meta-training
(``python -m apps.emloc.train``), and the faces ``compress`` / ``CompressedContext`` (:mod:`apps.emloc.api`).
"""

from apps.emloc.api import CompressedContext, check_demos, compress
from apps.emloc.model import EMLoCHost, HostConfig

__all__ = ["compress", "CompressedContext", "check_demos", "EMLoCHost", "HostConfig"]
