"""What the scikit-learn estimators of this package share: input validation, tags, the device, and the model of
an official checkpoint with the options of the official pipeline (:mod:`tabular.official_pipeline`)."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import numpy as np
import torch
from sklearn.base import BaseEstimator
from sklearn.utils.validation import validate_data

from tabular.checkpoints import resolve_checkpoint
from tabular.model import TabICL
from tabular.preprocess import to_frame
from tabular.weights_io import default_checkpoint, load_model

__all__ = ["TabularEstimator", "get_model"]

_MODEL_CACHE: dict[tuple, TabICL] = {}


def get_model(checkpoint, device: torch.device, *, official: bool = False) -> TabICL:
    """The checkpoint's model. The published checkpoints read cells scaled outside the model; outside ``official``
    mode this estimator's own pipeline feeds them, so they get a view of the same weights that standardizes cells
    with train statistics itself (clipped at ±100, the official scaler's bound)."""
    path = str(default_checkpoint() if checkpoint is None else resolve_checkpoint(checkpoint))
    try:
        stamp = os.stat(path).st_mtime_ns  # a rewritten file is reloaded
    except OSError:
        stamp = None  # load_model raises the clear error
    key = (path, stamp, str(device))
    if key not in _MODEL_CACHE:
        _MODEL_CACHE[key] = load_model(path, device=device)
    model = _MODEL_CACHE[key]
    if official or model.config.input_standardize or model.config.regression:
        return model
    view = copy.copy(model)  # shares the modules and weights; only the config differs
    view.config = replace(model.config, input_standardize=True, clip_value=100.0)
    return view


class TabularEstimator(BaseEstimator):
    """Base of :class:`tabular.TabICLClassifier` and :class:`tabular.TabICLRegressor` (expects ``device``)."""

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.input_tags.allow_nan = True
        tags.input_tags.categorical = True
        tags.input_tags.string = True
        tags.non_deterministic = False
        return tags

    def _resolve_device(self) -> torch.device:
        """``device`` as a torch device; a clear error for a malformed one or an accelerator this machine lacks."""
        if not self.device:
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device must be None, 'cpu', 'cuda' or 'cuda:N' (a torch device), got {self.device!r}") from e
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(f"device={self.device!r} but CUDA is not available on this machine; use device='cpu' "
                                 "or None (CUDA when available, else CPU)")
            if dev.index is not None and dev.index >= torch.cuda.device_count():
                raise ValueError(f"device={self.device!r} but this machine has {torch.cuda.device_count()} CUDA "
                                 "device(s)")
        elif dev.type == "mps" and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            raise ValueError(f"device={self.device!r} but MPS is not available on this machine; use device='cpu'")
        return dev

    def _validate_X(self, X, *, reset: bool):
        import pandas as pd

        if X is None:
            raise ValueError("X is None; expected a 2-D array or DataFrame")
        if hasattr(X, "toarray") or type(X).__module__.startswith("scipy.sparse"):
            raise TypeError(f"{type(self).__name__} does not accept sparse input; pass a dense array or DataFrame")
        if not isinstance(X, pd.DataFrame):
            arr = np.asarray(X)
            if arr.dtype.kind in "cV":
                raise ValueError(f"Complex data not supported (got dtype {arr.dtype}); pass real numbers or strings")
            if arr.ndim != 2:
                raise ValueError(
                    f"Expected 2D array, got {'scalar' if arr.ndim == 0 else f'{arr.ndim}D'} array instead: "
                    f"shape {arr.shape}. Reshape your data with array.reshape(-1, 1) for one feature or "
                    "array.reshape(1, -1) for one sample."
                )
            if arr.dtype.kind == "O":
                for v in arr.ravel()[:1000]:
                    if not isinstance(v, (str, bytes, bool, int, float, np.generic, type(None))):
                        raise TypeError(f"argument must be a string or a real number, got a {type(v).__name__}")
        validate_data(self, X, skip_check_array=True, reset=reset)
        df = to_frame(X)
        if df.shape[0] == 0:
            raise ValueError(f"Found array with 0 sample(s) (shape={df.shape}) while a minimum of 1 is required.")
        if df.shape[1] == 0:
            raise ValueError(f"Found array with 0 feature(s) (shape={df.shape}) while a minimum of 1 is required.")
        return df

    # -- the official pipeline (official=True, the regressor) ------------------------------------------------
    #: The official-pipeline options and their defaults (classification adds the last two).
    _OFFICIAL_DEFAULTS = {"kv_cache": False, "feat_shuffle_method": "latin", "dtype": None, "average_logits": True,
                          "class_shuffle_method": "shift"}

    def _check_official_params(self, *, official: bool, classes: bool) -> None:
        """Refuse bad official-pipeline options, and (``official=False``) any of them set to a non-default."""
        from tabular.official_pipeline import OFFICIAL_NORMS, SHUFFLE_METHODS

        names = list(self._OFFICIAL_DEFAULTS)[: 5 if classes else 3]
        if not official:
            changed = [n for n in names if getattr(self, n) != self._OFFICIAL_DEFAULTS[n]]
            if changed:
                raise ValueError(f"{', '.join(changed)} apply to the official pipeline only: set official=True (with an "
                                 "official checkpoint) or leave them at their defaults")
            return
        for name in ("kv_cache", "average_logits")[: 2 if classes else 1]:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("feat_shuffle_method", "class_shuffle_method")[: 2 if classes else 1]:
            if getattr(self, name) not in SHUFFLE_METHODS:
                raise ValueError(f"{name} must be one of {SHUFFLE_METHODS}, got {getattr(self, name)!r}")
        norms = (self.norm_methods,) if isinstance(self.norm_methods, str) else self.norm_methods
        if (not isinstance(norms, (tuple, list)) or not norms
                or any(not isinstance(n, str) or n not in OFFICIAL_NORMS for n in norms)):
            raise ValueError(f"norm_methods must be a non-empty sequence of {OFFICIAL_NORMS}, got {self.norm_methods!r}")
        if self.dtype is not None:
            from core.infra.device import DTYPES

            if not (isinstance(self.dtype, torch.dtype) or str(self.dtype).lower().removeprefix("torch.") in DTYPES):
                raise ValueError(f"dtype must be None (auto), 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")

    def _official_model(self, *, regression: bool) -> TabICL:
        """The official checkpoint's model on the resolved device (sets ``_device`` and ``compute_dtype_``); refuses
        the project's own checkpoints and a checkpoint of the other task."""
        from core.infra.device import resolve_dtype

        self._device = self._resolve_device()
        self.compute_dtype_ = resolve_dtype(self.dtype, self._device, flag="dtype")
        model = get_model(self.checkpoint, self._device, official=True)
        if model.config.input_standardize:
            raise ValueError("the official pipeline needs an official TabICL checkpoint (a release name such as 'v2', "
                             "a tabicl-*.ckpt file, or one converted by tabular.convert); this checkpoint is the "
                             "project's own")
        if model.config.regression != regression:
            task, other = ("regression", "TabICLRegressor") if model.config.regression else ("classification",
                                                                                             "TabICLClassifier")
            raise ValueError(f"checkpoint {self.checkpoint!r} is a {task} checkpoint: use tabular.{other}")
        return model

    def _official_kwargs(self) -> dict:
        """The :class:`tabular.official_pipeline.OfficialEnsemble` settings both tasks share."""
        from tabular.official_pipeline import OFFICIAL_BATCH

        norms = (self.norm_methods,) if isinstance(self.norm_methods, str) else self.norm_methods
        return dict(n_estimators=int(self.n_estimators), norm_methods=list(norms),
                    feat_shuffle_method=self.feat_shuffle_method,
                    batch_size=OFFICIAL_BATCH if self.batch_size is None else int(self.batch_size),
                    kv_cache=bool(self.kv_cache), random_state=self.random_state,
                    memory_budget_mb=float(self.memory_budget_mb), device=self._device, dtype=self.compute_dtype_)
