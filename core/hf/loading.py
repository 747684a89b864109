"""Load a transformers model (and its processor or tokenizer) from a local folder only.

Nothing is downloaded: every ``from_pretrained`` call passes ``local_files_only=True``. A hub id such as
``"Qwen/Qwen2-VL-2B-Instruct"`` is refused with a message that says how to fetch it yourself; a folder without a
config or weights, or an architecture this transformers does not know, gets an error that names what is missing.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

__all__ = ["Loaded", "load", "KINDS", "check_model_folder"]

#: ``kind=`` -> the transformers auto class that loads it ("auto": the class named in the config's
#: ``architectures``).
KINDS = {
    "auto": None,
    "causal-lm": "AutoModelForCausalLM",
    "image-text-to-text": "AutoModelForImageTextToText",
    "base": "AutoModel",
}

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json", "pytorch_model.bin.index.json")


@dataclass
class Loaded:
    """A loaded model with what prepares its inputs.

    Attributes:
        model: the transformers model, in eval mode.
        processor: the folder's processor (multimodal models) or tokenizer; None when the folder has neither.
        path: the folder it came from.
    """

    model: torch.nn.Module
    processor: object | None
    path: Path

    @property
    def tokenizer(self):
        """The tokenizer (the processor's own for multimodal models)."""
        return getattr(self.processor, "tokenizer", self.processor)

    def __iter__(self):  # model, processor = core.hf.load(...)
        return iter((self.model, self.processor))


def _resolve_device(device) -> torch.device:
    from core.infra.device import resolve_device

    return resolve_device(device, flag="device")


def _resolve_dtype(dtype, device: torch.device):
    """None / "auto": bf16 on CUDA (fp16 without bf16 support), fp32 on the CPU (the project's convention,
    :mod:`core.infra.device`); "checkpoint": the dtype the checkpoint was saved in; else as named."""
    from core.infra.device import resolve_dtype

    if isinstance(dtype, str) and dtype.lower() == "checkpoint":
        return "auto"  # transformers' "auto": the checkpoint's own
    return resolve_dtype(dtype, device, flag="dtype")


def _near_misses(p: Path) -> list[str]:
    """Folders beside the missing ``p`` whose names are close to its name (for "did you mean")."""
    import difflib

    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        return []
    names = [c.name for c in parent.iterdir() if c.is_dir()]
    return [str(parent / n) for n in difflib.get_close_matches(p.name, names, n=3, cutoff=0.6)]


def check_model_folder(path: str | os.PathLike) -> tuple[Path, dict]:
    """The folder as a ``Path`` and its ``config.json``; raises a clear error for a hub id, a missing folder, a
    folder without config or weights."""
    text = str(path)
    p = Path(path).expanduser()
    if not p.exists():
        close = _near_misses(p)
        hint = f" (did you mean {' or '.join(close)}?)" if close else ""
        # a path whose first part exists here (runs/qwen2vl with runs/ present), or that is written as a path, is a
        # mistyped folder, not a hub id
        first = Path(text.split("/")[0]).expanduser()
        looks_local = text.startswith((".", "/", "~")) or first.exists() or bool(close)
        if _HUB_ID.match(text) and not looks_local:
            raise ValueError(
                f"no local folder {text!r}; if it is a Hugging Face hub id: nothing is downloaded here. Download it "
                f"yourself, e.g. `huggingface-cli download {text} --local-dir ./{text.split('/')[-1]}`, and pass that folder"
            )
        where = f"{text} (resolved to {p.resolve()})" if not p.is_absolute() else text
        raise FileNotFoundError(f"no model folder at {where}{hint}")
    if not p.is_dir():
        raise ValueError(f"{text} is a file; pass the model folder (with config.json and the weights)")
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{text} has no config.json; pass a folder saved by save_pretrained or downloaded")
    try:
        config = json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{cfg_file} is not valid JSON: {err}") from None
    if not any(any(p.glob(pat)) for pat in _WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{text} has no weights (looked for {', '.join(_WEIGHT_PATTERNS)}); the download may be incomplete"
        )
    return p, config


def _model_class(kind: str, config: dict, folder: str):
    import transformers

    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {sorted(KINDS)}")
    if KINDS[kind] is not None:
        return getattr(transformers, KINDS[kind])
    archs = config.get("architectures") or []
    for name in archs:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    model_type = config.get("model_type")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{folder}: transformers {transformers.__version__} does not know model_type {model_type!r} "
            f"(architectures {archs}); update transformers or pass a folder of a supported model"
        )
    if archs:
        raise ValueError(
            f"{folder}: transformers {transformers.__version__} has no class {archs[0]!r}; pass kind= one of "
            f"{sorted(k for k in KINDS if k != 'auto')}"
        )
    return transformers.AutoModel


def _load_processor(p: Path):
    from transformers import AutoProcessor, AutoTokenizer

    try:
        return AutoProcessor.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.debug("no processor in %s (%s); trying a tokenizer", p, err)
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as err:
        logger.info("no processor or tokenizer in %s (%s)", p, err)
        return None


def load(
    path: str | os.PathLike,
    *,
    kind: str = "auto",
    dtype=None,
    device=None,
    attn: str = "longctx",
    processor: bool = True,
    **model_kwargs,
) -> Loaded:
    """Load a model and its processor from a local folder.

    Args:
        path: a folder with ``config.json`` and weights (``save_pretrained`` output or a downloaded snapshot).
        kind: ``"auto"`` (the class in the config's ``architectures``), ``"causal-lm"``, ``"image-text-to-text"``
            or ``"base"``.
        dtype: ``torch.float32`` / ``"bfloat16"`` / ... ; None/``"auto"``: bf16 on CUDA, fp32 on the CPU
            (:mod:`core.infra.device`); ``"checkpoint"``: the dtype the checkpoint was saved in.
        device: where to put the model; None/``"auto"``: CUDA when available, else CPU. A device this machine
            lacks (``"cuda"`` without a GPU) is a one-line ``UsageError``.
        attn: attention implementation; ``"longctx"`` (registered on first use) runs every attention call on
            :mod:`core.attention`; ``"sdpa"``/``"eager"`` are transformers' own.
        processor: also load the processor or tokenizer.
        model_kwargs: passed to ``from_pretrained``.

    Returns:
        :class:`Loaded` (unpacks as ``model, processor``).
    """
    dev = _resolve_device(device)  # a missing GPU is refused before anything is read
    torch_dtype = _resolve_dtype(dtype, dev)
    p, config = check_model_folder(path)
    cls = _model_class(kind, config, str(path))
    if attn == "longctx":
        from core.hf.backend import register

        register()
    try:
        kwargs = {"dtype": torch_dtype, "attn_implementation": attn, **model_kwargs}
        model = cls.from_pretrained(str(p), local_files_only=True, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"could not load {path} as {cls.__name__}: {err}") from None
    model.to(dev).eval()
    proc = _load_processor(p) if processor else None
    return Loaded(model=model, processor=proc, path=p)
