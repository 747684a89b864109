"""``TabICLRegressor``: scikit-learn regression with the official TabICL regression checkpoint.

``fit`` standardizes the target, prepares the table with the official package's preprocessing and ensemble
(:mod:`tabular.official_pipeline`) and, with ``kv_cache``, runs the train rows once; ``predict`` runs this
project's model on every ensemble member, reads each member's predicted quantiles as a distribution
(:mod:`tabular.quantiles`), de-standardizes the requested statistic and averages it over the members, as
``tabicl.TabICLRegressor.predict`` does. The model is the official architecture with ``max_classes = 0``
(:mod:`tabular.official`): the label embeddings read the standardized target, the decoder emits 999 quantiles.
"""

from __future__ import annotations

import numpy as np
from sklearn.base import RegressorMixin
from sklearn.utils.validation import check_is_fitted, column_or_1d

from tabular.quantiles import DEFAULT_ALPHAS, OUTPUT_TYPES
from tabular.sklearn_base import TabularEstimator

__all__ = ["TabICLRegressor"]


class TabICLRegressor(RegressorMixin, TabularEstimator):
    """In-context tabular regression with an official TabICL regression checkpoint.

    Args:
        n_estimators: ensemble members (feature shuffles x normalisations), as the official estimator.
        checkpoint: "v2-regressor" (default: ``tabicl-regressor-v2-20260212.ckpt`` found in the local Hugging Face
            cache, never downloaded; :mod:`tabular.checkpoints`), a path of an official regression ``.ckpt`` or of one
            converted by ``tabular.convert``.
        device: "cpu", "cuda", "cuda:N", ...; None picks CUDA when available, else CPU.
        dtype: the model's compute dtype: None = bf16 autocast on CUDA (fp16 where the GPU has no bf16), fp32 on
            the CPU; "float32", "bfloat16" or "float16" as given (``torch.autocast`` on the device).
        random_state: seed of the ensemble (the official default, 42).
        batch_size: ensemble members per forward pass (None: the official default 8).
        kv_cache: build the train context of every member batch at ``fit`` and serve every ``predict`` from it (the
            official ``kv_cache=True``); off, every ``predict`` runs the train rows again.
        norm_methods: normalisations of the numeric columns the members cycle through: "none", "power",
            "quantile", "quantile_rtdl", "robust".
        feat_shuffle_method: feature orders of the members: "none", "shift", "random" or "latin".
        memory_budget_mb: bound of the one-shot path's working memory (without ``kv_cache``).
    """

    def __init__(self, *, n_estimators: int = 8, checkpoint="v2-regressor", device=None, dtype=None,
                 random_state=42, batch_size=None, kv_cache: bool = False, norm_methods=("none", "power"),
                 feat_shuffle_method: str = "latin", memory_budget_mb: float = 2048.0) -> None:
        self.n_estimators = n_estimators
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype
        self.random_state = random_state
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self.norm_methods = norm_methods
        self.feat_shuffle_method = feat_shuffle_method
        self.memory_budget_mb = memory_budget_mb

    def _check_params(self) -> None:
        if not (isinstance(self.n_estimators, (int, np.integer)) and not isinstance(self.n_estimators, bool)
                and self.n_estimators >= 1):
            raise ValueError(f"n_estimators must be a positive int, got {self.n_estimators!r}")
        if self.batch_size is not None and not (isinstance(self.batch_size, (int, np.integer)) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be None or a positive int (members per pass), got {self.batch_size!r}")
        if not (isinstance(self.memory_budget_mb, (int, float)) and self.memory_budget_mb > 0):
            raise ValueError(f"memory_budget_mb must be a positive number, got {self.memory_budget_mb!r}")
        self._check_official_params(official=True, classes=False)

    def fit(self, X, y):
        """Standardize the target, fit the official preprocessing and ensemble (and with ``kv_cache`` build the train
        contexts)."""
        from sklearn.preprocessing import StandardScaler

        from tabular.official_pipeline import OfficialEnsemble

        self._check_params()
        df = self._validate_X(X, reset=True)
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        y = column_or_1d(np.asarray(y) if not hasattr(y, "to_numpy") else y.to_numpy(), warn=True)
        if len(y) != len(df):
            raise ValueError(f"X has {len(df)} rows but y has {len(y)} targets")
        try:
            y = y.astype(np.float64)
        except (TypeError, ValueError):
            raise ValueError(f"y must be numbers (a regression target), got values of dtype {y.dtype}") from None
        if not np.isfinite(y).all():
            raise ValueError("y contains NaN or infinity; drop those rows or fill them")
        model = self._official_model(regression=True)
        self.y_scaler_ = StandardScaler()
        y_scaled = self.y_scaler_.fit_transform(y.astype(np.float32).reshape(-1, 1)).flatten()
        self._official = OfficialEnsemble(model, **self._official_kwargs())
        self._official.fit(df, y_scaled)
        self.context_nbytes_ = self._official.context_nbytes()
        return self

    def predict(self, X, output_type="mean", alphas=None):
        """Predictions in the target's units, averaged over the ensemble members.

        Args:
            X: rows to predict (array or DataFrame, the columns of ``fit``).
            output_type: "mean" (default) or "median" -> ``(n,)``; "quantiles" -> ``(n, len(alphas))`` at levels
                ``alphas`` (default 0.1, ..., 0.9); "raw_quantiles" -> ``(n, Q)`` the model's sorted quantiles; or a
                list of these -> a dict of them.
            alphas: levels in (0, 1) for "quantiles".
        """
        check_is_fitted(self, "_official")
        kinds = [output_type] if isinstance(output_type, str) else list(output_type)
        bad = [k for k in kinds if k not in OUTPUT_TYPES]
        if bad or not kinds:
            raise ValueError(f"output_type must be one of {OUTPUT_TYPES} or a list of them, got {output_type!r}")
        if alphas is not None:
            a = np.asarray(alphas, dtype=np.float64).ravel()
            if a.size == 0 or not ((a > 0) & (a < 1)).all():
                raise ValueError(f"alphas must be levels in (0, 1), got {alphas!r}")
        stats = self._official.predict_stats(self._validate_X(X, reset=False), kinds,
                                             DEFAULT_ALPHAS if alphas is None else list(np.ravel(alphas)))
        out = {}
        for k, arr in stats.items():  # (members, n) or (members, n, k): each member de-standardized, then averaged
            back = self.y_scaler_.inverse_transform(arr.reshape(-1, 1)).reshape(arr.shape)
            out[k] = np.mean(back, axis=0)
        return out[kinds[0]] if isinstance(output_type, str) else out
