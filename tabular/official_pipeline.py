"""The official package's preprocessing and ensembling around this project's model (``TabICLClassifier(official=True)``).

The published checkpoints were trained on tables prepared by the official ``tabicl`` package (ordinal encoding,
constant-column filter, per-member standard scaling, Yeo-Johnson power transform on half the members, soft outlier
clipping at z = 4, Latin-square feature shuffles, cyclic class shifts, logits averaged, softmax at temperature 0.9).
To get the official predictions exactly, this module does not re-implement those steps: it runs the official
package's own ``TransformToNumerical`` and ``EnsembleGenerator`` (``pip install tabicl==2.2.0``; imported only
here) and replaces only the model call with :meth:`tabular.model.TabICL.predict_once` (bounded memory, fp32).
Averaging and the temperature follow ``tabicl.TabICLClassifier.predict_proba``. Not covered: more classes than
the checkpoint's ``max_classes`` (the official model then switches to mixed-radix column embedding and a
hierarchical ICL stage inside its forward pass, which :class:`tabular.model.TabICL` does not implement).
"""

from __future__ import annotations

import numpy as np
import torch

from tabular.model import TabICL

__all__ = ["OfficialEnsemble"]

OFFICIAL_BATCH = 8  # tabicl.TabICLClassifier's default batch_size (ensemble members per forward pass)


def _official_preprocessing():
    try:
        from tabicl._sklearn.preprocessing import EnsembleGenerator, TransformToNumerical
    except ImportError as err:
        raise ImportError("official=True runs the official package's preprocessing: pip install tabicl==2.2.0") from err
    return TransformToNumerical, EnsembleGenerator


class OfficialEnsemble:
    """Fit/predict with the official preprocessing and ensembling; the model is this project's."""

    def __init__(self, model: TabICL, *, n_estimators: int = 8, norm_methods=None, softmax_temperature: float = 0.9,
                 random_state=42, outlier_threshold: float = 4.0, chunk: int = 2048, memory_budget_mb: float = 2048.0,
                 device: torch.device | str = "cpu") -> None:
        self.model, self.n_estimators, self.norm_methods = model, n_estimators, norm_methods
        self.softmax_temperature, self.random_state, self.outlier_threshold = softmax_temperature, random_state, outlier_threshold
        self.chunk, self.memory_budget_mb, self.device = chunk, memory_budget_mb, torch.device(device)

    def fit(self, X, y_enc: np.ndarray, n_classes: int) -> "OfficialEnsemble":
        """``X``: the raw table (array or DataFrame); ``y_enc``: labels encoded ``0 .. n_classes-1``."""
        if n_classes > self.model.config.max_classes:
            raise ValueError(f"official=True supports at most {self.model.config.max_classes} classes (the "
                             f"checkpoint's max_classes), got {n_classes}; use official=False (class hierarchy)")
        TransformToNumerical, EnsembleGenerator = _official_preprocessing()
        self.n_classes = n_classes
        self.encoder_ = TransformToNumerical()
        Xn = self.encoder_.fit_transform(X)
        self.generator_ = EnsembleGenerator(
            classification=True, n_estimators=self.n_estimators,
            norm_methods=list(self.norm_methods) if self.norm_methods else ["none", "power"],
            feat_shuffle_method="latin", class_shuffle_method="shift", outlier_threshold=self.outlier_threshold,
            random_state=self.random_state,
        )
        self.generator_.fit(Xn, y_enc)
        return self

    @staticmethod
    def _as_official_batches(Xs: np.ndarray, shuffles, batch_size: int = OFFICIAL_BATCH) -> np.ndarray:
        """The column orders the official model really sees. Without feature groups (v1), ``tabicl`` 2.2.0 embeds the
        columns of a batch's first member once and gives member ``i`` the embeddings at ``mapping[j] = (position of
        the first member's feature j in member i's order)`` — the inverse of the relative shuffle, so member ``i``
        sees ``Xs[first][:, mapping]`` instead of ``Xs[i]`` (the same when the relative shuffle is its own inverse).
        Batches: ``np.array_split`` of the members into ``ceil(members / batch_size)`` parts, as the official
        ``_batch_forward``."""
        Xs = Xs.copy()
        for part in np.array_split(np.arange(len(Xs)), int(np.ceil(len(Xs) / batch_size))):
            ref = list(shuffles[part[0]])
            for i in part[1:]:
                pos = {f: j for j, f in enumerate(shuffles[i])}
                Xs[i] = Xs[part[0]][:, [pos[f] for f in ref]]
        return Xs

    @torch.no_grad()
    def predict_proba(self, X) -> np.ndarray:
        data = self.generator_.transform(self.encoder_.transform(X), mode="both")
        outputs = []
        for method, (Xs, ys) in data.items():  # per normalisation: (members, n_train + n_test, F), (members, n_train)
            if self.model.config.col_group_size == 1:
                Xs = self._as_official_batches(Xs, self.generator_.feature_shuffles_[method])
            n_train = ys.shape[1]
            Xt = torch.from_numpy(np.ascontiguousarray(Xs)).float().to(self.device)
            yt = torch.from_numpy(np.ascontiguousarray(ys)).long().to(self.device)
            logits = self.model.predict_once(Xt[:, :n_train], yt, Xt[:, n_train:], chunk=self.chunk,
                                             memory_budget_mb=self.memory_budget_mb)
            outputs.append(logits[..., : self.n_classes].float().cpu().numpy())
        outputs = np.concatenate(outputs, axis=0)
        shuffles = [s for group in self.generator_.class_shuffles_.values() for s in group]
        avg = sum(outputs[i][..., s] for i, s in enumerate(shuffles)) / len(shuffles)
        z = avg / self.softmax_temperature
        e = np.exp(z - z.max(axis=1, keepdims=True))
        p = e / e.sum(axis=1, keepdims=True)
        return p / p.sum(axis=1, keepdims=True)
