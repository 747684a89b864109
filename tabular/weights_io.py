"""Saving and loading TabICL weights as ``safetensors`` with the config in the file's metadata."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from core.infra.fileio import load_safetensors, load_state_dict_checked, open_safetensors, set_file_mode, torch_load
from tabular.model import TabICL, TabICLConfig

logger = logging.getLogger(__name__)

__all__ = ["save_model", "load_model", "default_checkpoint", "atomic_write_text"]

#: The shipped default checkpoint, inside the package.
DEFAULT_WEIGHTS = Path(__file__).resolve().parent / "weights" / "tabicl_medium.safetensors"


def default_checkpoint() -> Path:
    """Path of the shipped checkpoint (raises ``FileNotFoundError`` when the package holds none)."""
    if not DEFAULT_WEIGHTS.is_file():
        raise FileNotFoundError(
            f"the default TabICL checkpoint {DEFAULT_WEIGHTS.name} is missing from the package; "
            "pass checkpoint=PATH or pretrain one with `python -m tabular.pretrain`"
        )
    return DEFAULT_WEIGHTS


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, path)


def save_model(model: TabICL, path: str | os.PathLike, *, extra: dict | None = None) -> None:
    """Write the model's weights (fp32) and config to a ``.safetensors`` file atomically."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().float().cpu().contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "tabicl", "config": json.dumps(model.config.to_dict())}
    if extra:
        meta["extra"] = json.dumps(extra)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    save_file(tensors, tmp, metadata=meta)
    set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
    os.replace(tmp, path)


def _config(read, path: Path, what: str) -> TabICLConfig:
    """``TabICLConfig(**read())``; a config that is not JSON or not a TabICL one is a ``ValueError`` naming the file."""
    try:
        return TabICLConfig(**read())
    except (TypeError, ValueError) as err:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} holds no TabICL config ({type(err).__name__}: {err}); expected {what}") from err


def load_model(path: str | os.PathLike, *, device: torch.device | str = "cpu") -> TabICL:
    """Load a model written by :func:`save_model`, a pretraining checkpoint ``.pt`` or an official TabICL checkpoint
    ``.ckpt`` (v1, v1.1, v2, v2-regressor: :mod:`tabular.official`; by release name from the local Hugging Face cache:
    :mod:`tabular.checkpoints`), in eval mode; its card (the metadata ``extra`` written with
    it) is ``model.card``."""
    from tabular.checkpoints import resolve_checkpoint

    path = resolve_checkpoint(path)  # an official release name ("v2", ...) -> its file in the Hugging Face cache
    if not path.is_file():
        raise FileNotFoundError(f"TabICL checkpoint {str(path)!r} does not exist (expected a .safetensors, .pt or .ckpt file)")
    if path.suffix == ".safetensors":
        what = "TabICL weights written by tabular.pretrain (--export or best.safetensors)"
        with open_safetensors(path, what=what) as f:
            meta = f.metadata() or {}
        if meta.get("format") != "tabicl" or "config" not in meta:
            raise ValueError(f"{str(path)!r} is not a TabICL checkpoint (no 'tabicl' config in its metadata)")
        config = _config(lambda: json.loads(meta["config"]), path, what)
        state = load_safetensors(path, what=what)
        card = json.loads(meta.get("extra") or "{}")
    elif path.suffix == ".pt":
        what = "a TabICL pretraining checkpoint (last.pt written by tabular.pretrain)"
        ckpt = torch_load(path, what=what)
        if not isinstance(ckpt, dict) or "model" not in ckpt or "model_config" not in ckpt:
            raise ValueError(f"{str(path)!r} is not a TabICL pretraining checkpoint (keys 'model', 'model_config')")
        config = _config(lambda: ckpt["model_config"], path, what)
        state = ckpt["model"]
        card = {"step": ckpt.get("step"), "pretrained_max_features": ckpt.get("max_features_seen")}
    elif path.suffix == ".ckpt":
        from tabular.official import read_official

        what = "an official TabICL checkpoint (tabicl-classifier-v1-20250208.ckpt, -v1.1-20250506, -v2-20260212, tabicl-regressor-v2-20260212.ckpt)"
        ckpt = torch_load(path, what=what, weights_only=True)  # a third-party file: tensors and plain data only
        model, card = read_official(path, ckpt)
        model.card = card
        return model.to(device)
    else:
        raise ValueError(f"unsupported checkpoint suffix {path.suffix!r} for {str(path)!r}; use .safetensors, .pt "
                         "(tabular.pretrain) or .ckpt (official TabICL)")
    model = TabICL(config)
    load_state_dict_checked(model, state, path, what=what)
    model.card = card  # the model card (pretraining facts such as ``pretrained_max_features``), may be empty
    return model.to(device).eval()
