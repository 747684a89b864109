"""Feature reduction of wide tables for :class:`tabular.TabICLClassifier` (``feature_reduction``): numeric columns
projected onto their top principal components, and the row subset fitted transforms use."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["NORM_FIT_ROWS", "fit_rows", "PCAReducer"]

NORM_FIT_ROWS = 65_536  # normalisations and projections are fitted on at most this many train rows (random subset)


def fit_rows(n: int, seed) -> np.ndarray:
    """Row indices that fitted transforms use: all ``n``, or a sorted random ``NORM_FIT_ROWS`` of them."""
    if n <= NORM_FIT_ROWS:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, NORM_FIT_ROWS, replace=False))


@dataclass(kw_only=True, eq=False)
class PCAReducer:
    """Numeric columns projected onto their top principal components; categorical columns pass through.

    Missing cells are imputed with the train mean first; the columns are centred (and, with ``standardize``,
    scaled to unit variance) before the projection. Fitted on at most ``NORM_FIT_ROWS`` train rows.
    """

    num: np.ndarray  # indices of the numeric input columns
    cat: np.ndarray  # indices of the categorical input columns (kept as they are)
    mean: np.ndarray  # (n_num,) train means (imputation and centring)
    scale: np.ndarray  # (n_num,) divisors (1, or the train standard deviations)
    components: np.ndarray  # (n_num, k)
    standardize: bool
    explained: float  # share of the (scaled) variance the k components keep

    @classmethod
    def fit(cls, Xv: np.ndarray, is_cat: np.ndarray, k: int, *, standardize: bool, seed) -> "PCAReducer":
        num, cat = np.flatnonzero(~is_cat), np.flatnonzero(is_cat)
        X = Xv[np.ix_(fit_rows(len(Xv), seed), num)].astype(np.float64)
        mean = np.nanmean(X, axis=0)
        X = np.where(np.isnan(X), mean, X) - mean
        scale = X.std(axis=0) if standardize else np.ones(X.shape[1])
        scale = np.where(scale > 0, scale, 1.0)
        X /= scale
        evals, evecs = np.linalg.eigh(X.T @ X / max(1, len(X) - 1))
        order = np.argsort(evals)[::-1][:k]
        comps = evecs[:, order]
        comps *= np.where(comps[np.abs(comps).argmax(0), np.arange(comps.shape[1])] < 0, -1.0, 1.0)  # fixed signs
        explained = float(evals[order].sum() / max(evals.sum(), 1e-300))
        return cls(num=num, cat=cat, mean=mean, scale=scale, components=comps, standardize=standardize,
                   explained=explained)

    def transform(self, Xv: np.ndarray) -> np.ndarray:
        out = np.empty((len(Xv), self.components.shape[1] + len(self.cat)), dtype=np.float32)
        for r0 in range(0, len(Xv), NORM_FIT_ROWS):  # row blocks: float64 temporaries stay small
            X = Xv[r0 : r0 + NORM_FIT_ROWS, self.num].astype(np.float64)
            X = (np.where(np.isnan(X), self.mean, X) - self.mean) / self.scale
            out[r0 : r0 + len(X), : self.components.shape[1]] = X @ self.components
        out[:, self.components.shape[1] :] = Xv[:, self.cat]
        return out

    @property
    def is_cat(self) -> np.ndarray:
        return np.r_[np.zeros(self.components.shape[1], bool), np.ones(len(self.cat), bool)]

    def describe(self) -> dict:
        return {"components": int(self.components.shape[1]), "standardize": self.standardize,
                "numeric_columns": int(len(self.num)), "explained_variance": round(self.explained, 4)}
