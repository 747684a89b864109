"""The official package's preprocessing and ensembling around this project's model (``TabICLClassifier(official=True)``
and :class:`tabular.TabICLRegressor`).

The published checkpoints were trained on tables prepared by the official ``tabicl`` package (ordinal encoding,
constant-column filter, per-member standard scaling, Yeo-Johnson power transform on half the members, soft outlier
clipping at z = 4, Latin-square feature shuffles, cyclic class shifts, logits averaged, softmax at temperature 0.9;
for regression a standardized target and averaged statistics of the predicted quantiles). To get the official
predictions exactly, this module does not re-implement those steps: it runs the official package's own
``TransformToNumerical`` and ``EnsembleGenerator`` (``pip install tabicl==2.2.0``; imported only here) and replaces
only the model calls with :class:`tabular.model.TabICL`'s (bounded-memory one-shot path, or a context built once
at ``fit`` with ``kv_cache``). Averaging, the temperature, the member batches and the target scaling follow
``tabicl.TabICLClassifier.predict_proba`` and ``tabicl.TabICLRegressor.predict``. More classes than the checkpoint's
``max_classes`` go through the model's mixed-radix label views and class hierarchy (:mod:`tabular.many_class`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from tabular.model import TabICL
from tabular.quantiles import DEFAULT_ALPHAS, OUTPUT_TYPES, QuantileDistribution

__all__ = ["OfficialEnsemble", "OFFICIAL_BATCH", "SHUFFLE_METHODS", "OFFICIAL_NORMS"]

OFFICIAL_BATCH = 8  # the official estimators' default batch_size (ensemble members per forward pass)
SHUFFLE_METHODS = ("none", "shift", "random", "latin")  # feature and class shuffles of the official ensemble
OFFICIAL_NORMS = ("none", "power", "quantile", "quantile_rtdl", "robust")  # its numeric-column normalisations
_LOG_FLOOR = 1e-6  # the official model's floor inside log(p) when a class hierarchy returns logits


def _official_preprocessing():
    try:
        from tabicl._sklearn.preprocessing import EnsembleGenerator, TransformToNumerical
    except ImportError as err:
        raise ImportError("the official pipeline (official=True, TabICLRegressor) runs the official package's "
                          "preprocessing: pip install tabicl==2.2.0") from err
    return TransformToNumerical, EnsembleGenerator


class OfficialEnsemble:
    """Fit/predict with the official preprocessing and ensembling; the model is this project's.

    Args:
        model: an official checkpoint's :class:`TabICL` (classification, or regression with ``max_classes=0``).
        n_estimators, norm_methods, feat_shuffle_method, class_shuffle_method, outlier_threshold, random_state: the
            official ``EnsembleGenerator``'s settings (``norm_methods`` None = ``["none", "power"]``).
        softmax_temperature: temperature of the final softmax (classification).
        average_logits: average the members' logits, then one softmax (True, the official default), or average
            their probabilities (False).
        batch_size: ensemble members per forward pass (None: all at once), as the official ``batch_size``. With
            v1 checkpoints and ``kv_cache=False`` it changes results: the official model embeds the columns of a
            batch's first member once and reorders them for the others (:meth:`_as_official_batches`).
        kv_cache: build every member batch's train context at ``fit`` and serve each ``predict`` from it (the
            official ``kv_cache=True``): the train rows are never run again. Off: every ``predict`` runs them.
        chunk, memory_budget_mb: rows per chunk and the memory bound of the one-shot path.
        device: where the model runs.
        dtype: the model's compute dtype: ``torch.float32`` runs as is; ``torch.bfloat16`` / ``torch.float16`` run
            under ``torch.autocast`` on ``device`` (the official ``use_amp``).
    """

    def __init__(self, model: TabICL, *, n_estimators: int = 8, norm_methods=None, feat_shuffle_method: str = "latin",
                 class_shuffle_method: str = "shift", softmax_temperature: float = 0.9, average_logits: bool = True,
                 batch_size: int | None = OFFICIAL_BATCH, kv_cache: bool = False, random_state=42,
                 outlier_threshold: float = 4.0, chunk: int = 2048, memory_budget_mb: float = 2048.0,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        self.model, self.n_estimators, self.norm_methods = model, n_estimators, norm_methods
        self.feat_shuffle_method, self.class_shuffle_method = feat_shuffle_method, class_shuffle_method
        self.softmax_temperature, self.average_logits = softmax_temperature, average_logits
        self.batch_size, self.kv_cache = batch_size, kv_cache
        self.random_state, self.outlier_threshold = random_state, outlier_threshold
        self.chunk, self.memory_budget_mb = chunk, memory_budget_mb
        self.device, self.dtype = torch.device(device), dtype
        self.regression = model.config.regression

    # -- fit ------------------------------------------------------------------------------------------------
    def fit(self, X, y: np.ndarray, n_classes: int | None = None) -> "OfficialEnsemble":
        """``X``: the raw table (array or DataFrame); ``y``: labels encoded ``0 .. n_classes-1`` (classification) or
        the target already standardized (regression, ``n_classes`` None)."""
        TransformToNumerical, EnsembleGenerator = _official_preprocessing()
        self.n_classes = n_classes
        self.encoder_ = TransformToNumerical()
        Xn = self.encoder_.fit_transform(X)
        kw = dict(n_estimators=self.n_estimators, norm_methods=list(self.norm_methods or ["none", "power"]),
                  feat_shuffle_method=self.feat_shuffle_method, outlier_threshold=self.outlier_threshold,
                  random_state=self.random_state)
        if self.regression:
            self.generator_ = EnsembleGenerator(classification=False, **kw)
        else:
            self.generator_ = EnsembleGenerator(classification=True, class_shuffle_method=self.class_shuffle_method, **kw)
        self.generator_.fit(Xn, y)
        self.contexts_ = None
        if self.kv_cache:
            self.contexts_ = {}
            with self._autocast(), torch.no_grad():
                for method, (Xs, ys) in self.generator_.transform(X=None, mode="train").items():
                    self.contexts_[method] = [self.model.build_context(self._tensor(Xs[b]), self._labels(ys[b]),
                                                                       chunk=self.chunk) for b in self._batches(len(Xs))]
        return self

    def context_nbytes(self) -> int:
        """Bytes held by the contexts kept at ``fit`` (0 without ``kv_cache``)."""
        return sum(c.nbytes() for cs in (self.contexts_ or {}).values() for c in cs)

    # -- helpers --------------------------------------------------------------------------------------------
    def _batches(self, members: int) -> list[np.ndarray]:
        """Member indices of each forward pass: ``np.array_split`` into ``ceil(members / batch_size)`` parts."""
        size = self.batch_size or members
        return np.array_split(np.arange(members), int(np.ceil(members / size)))

    def _autocast(self):
        if self.dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).float().to(self.device)

    def _labels(self, y: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(y)).to(self.device)
        return t.float() if self.regression else t.long()

    @staticmethod
    def _as_official_batches(Xs: np.ndarray, shuffles, batches: list[np.ndarray]) -> np.ndarray:
        """The column orders the official model really sees. Without feature groups (v1), ``tabicl`` 2.2.0 embeds the
        columns of a batch's first member once and gives member ``i`` the embeddings at ``mapping[j] = (position of
        the first member's feature j in member i's order)`` — the inverse of the relative shuffle, so member ``i``
        sees ``Xs[first][:, mapping]`` instead of ``Xs[i]`` (the same when the relative shuffle is its own inverse).
        Only its classifier without ``kv_cache`` does this (its cached path and its regressor embed every member)."""
        Xs = Xs.copy()
        for part in batches:
            ref = list(shuffles[part[0]])
            for i in part[1:]:
                pos = {f: j for j, f in enumerate(shuffles[i])}
                Xs[i] = Xs[part[0]][:, [pos[f] for f in ref]]
        return Xs

    def _forward(self, X) -> Iterator[tuple]:
        """Per member batch (every normalisation in turn): ``(context or None, X_train, y, X_test)`` tensors of the
        batch, the train rows absent when a context from ``fit`` serves it."""
        Xn = self.encoder_.transform(X)
        if self.contexts_ is not None:
            for method, (Xs,) in self.generator_.transform(Xn, mode="test").items():
                for b, ctx in zip(self._batches(len(Xs)), self.contexts_[method]):
                    yield ctx, None, None, self._tensor(Xs[b])
            return
        for method, (Xs, ys) in self.generator_.transform(Xn, mode="both").items():
            n_train = ys.shape[1]
            batches = self._batches(len(Xs))
            if not self.regression and self.model.config.col_group_size == 1:
                Xs = self._as_official_batches(Xs, self.generator_.feature_shuffles_[method], batches)
            for b in batches:
                Xt = self._tensor(Xs[b])
                yield None, Xt[:, :n_train], self._labels(ys[b]), Xt[:, n_train:]

    # -- classification ----------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        """``(n_samples, n_classes)`` probabilities, as ``tabicl.TabICLClassifier.predict_proba``."""
        if self.regression:
            raise ValueError("a regression checkpoint predicts values: use TabICLRegressor")
        C, T = self.n_classes, self.softmax_temperature
        outputs = []
        with self._autocast():
            for ctx, Xtr, ytr, Xte in self._forward(X):
                if ctx is None and self.model._many_classes(ytr):
                    ctx = self.model.build_context(Xtr, ytr, chunk=self.chunk)
                if ctx is not None and ctx.tree is not None:  # more classes than max_classes: probabilities
                    p = self.model.predict_proba(Xte, ctx, chunk=self.chunk).float()
                    out = T * torch.log(p + _LOG_FLOOR) if self.average_logits else p
                else:
                    if ctx is not None:
                        logits = self.model.predict_logits(Xte, ctx, chunk=self.chunk)
                    else:
                        logits = self.model.predict_once(Xtr, ytr, Xte, chunk=self.chunk,
                                                         memory_budget_mb=self.memory_budget_mb)
                    logits = logits[..., :C].float()
                    out = logits if self.average_logits else torch.softmax(logits / T, dim=-1)
                outputs.append(out.cpu().numpy())
        outputs = np.concatenate(outputs, axis=0)
        shuffles = [s for group in self.generator_.class_shuffles_.values() for s in group]
        avg = sum(outputs[i][..., s] for i, s in enumerate(shuffles)) / len(shuffles)
        if self.average_logits:
            z = avg / T
            e = np.exp(z - z.max(axis=1, keepdims=True))
            avg = e / e.sum(axis=1, keepdims=True)
        return avg / avg.sum(axis=1, keepdims=True)

    # -- regression ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def predict_stats(self, X, output_type=("mean",), alphas=None) -> dict[str, np.ndarray]:
        """Per requested output (of :data:`tabular.quantiles.OUTPUT_TYPES`) the members' statistics in the
        standardized target scale: ``(members, n)`` for "mean" and "median", ``(members, n, k)`` for "quantiles"
        (``alphas``, default :data:`DEFAULT_ALPHAS`) and "raw_quantiles" (the sorted ``Q``)."""
        if not self.regression:
            raise ValueError("a classification checkpoint predicts classes: use TabICLClassifier")
        bad = [k for k in output_type if k not in OUTPUT_TYPES]
        if bad:
            raise ValueError(f"output_type {bad[0]!r} is not one of {OUTPUT_TYPES}")
        levels = torch.tensor(list(DEFAULT_ALPHAS if alphas is None else alphas), device=self.device)
        half = torch.tensor([0.5], device=self.device)
        res: dict[str, list] = {k: [] for k in output_type}
        with self._autocast():
            for ctx, Xtr, ytr, Xte in self._forward(X):
                if ctx is not None:
                    raw = self.model.predict_logits(Xte, ctx, chunk=self.chunk)
                else:
                    raw = self.model.predict_once(Xtr, ytr, Xte, chunk=self.chunk, memory_budget_mb=self.memory_budget_mb)
                dist = QuantileDistribution(raw)
                stats = {"mean": lambda: dist.mean, "median": lambda: dist.icdf(half)[..., 0],
                         "quantiles": lambda: dist.icdf(levels), "raw_quantiles": lambda: dist.quantiles}
                for k in output_type:
                    res[k].append(stats[k]().float().cpu().numpy())
        return {k: np.concatenate(v, axis=0) for k, v in res.items()}
