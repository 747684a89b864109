"""The models ``benchmarks.tabular_bench`` compares TabICL with, and the small tuning budget of the GBDTs.

Every model is a factory ``make() -> estimator`` whose estimator has ``fit(X, y)``, ``predict_proba(X)`` and
``classes_``; ``X`` is a table cleaned by :func:`benchmarks.tabular_suites.load_table` (strings as pandas
``category``, NaN where missing).

- ``LogisticRegression``, ``RandomForest`` (300 trees), ``HistGradientBoosting`` (native NaN and categories),
  ``kNN`` (15 neighbours): :func:`tabular.compare.baseline_models`: median / most-frequent imputation, one-hot
  categories, standardised numbers for LogisticRegression and kNN.
- ``LightGBM``, ``XGBoost``, ``CatBoost``: library defaults with each library's own categorical and missing-value
  handling (LightGBM reads pandas categories, XGBoost ``enable_categorical=True`` with ``tree_method="hist"``,
  CatBoost ``cat_features`` with missing categories as the level ``"nan"``), one thread, seed 0.
- ``LightGBM-tuned``, ``XGBoost-tuned``, ``CatBoost-tuned``: the same budget for each: ``n_configs`` (10)
  configurations drawn at random (seed 0, the same draws on every table and split) from the space in
  :data:`SPACES`, each scored by mean accuracy over a stratified ``folds``-fold (3) cross-validation of the
  training split only; the best (ties: the earlier draw) is refit on the whole training split. The test split is
  never seen while choosing.
- ``TabICL``: ``TabICLClassifier(random_state=0)`` with its shipped defaults (``n_estimators``, ``checkpoint`` and
  any other estimator parameter, ``tabicl_kwargs``, may be overridden for experiments; the results record them).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["SPACES", "PEERS", "GBDTS", "Tuned", "make_gbdt", "model_factories", "model_settings", "sample_configs"]

GBDTS = ("LightGBM", "XGBoost", "CatBoost")
#: Model names in a run's default order (TabICL first, then the peers).
PEERS = ("LogisticRegression", "RandomForest", "HistGradientBoosting", "kNN", *GBDTS,
         *(f"{g}-tuned" for g in GBDTS))

# Search spaces: name -> (kind, low, high) with kind "log" (log-uniform float), "float" (uniform), "int"
# (uniform integer, inclusive) or ("choice", values). Comparable ranges across the three libraries: learning rate,
# tree size, leaf regularisation, row / column subsampling, and 100-400 trees (CatBoost's default is 1,000, so its
# default run is not one of the draws).
SPACES: dict[str, dict[str, tuple]] = {
    "LightGBM": {
        "learning_rate": ("log", 0.02, 0.3), "num_leaves": ("int", 8, 128), "min_child_samples": ("int", 5, 50),
        "subsample": ("float", 0.6, 1.0), "colsample_bytree": ("float", 0.5, 1.0), "reg_lambda": ("log", 1e-3, 10.0),
        "n_estimators": ("choice", (100, 200, 400)),
    },
    "XGBoost": {
        "learning_rate": ("log", 0.02, 0.3), "max_depth": ("int", 2, 10), "min_child_weight": ("log", 0.5, 10.0),
        "subsample": ("float", 0.6, 1.0), "colsample_bytree": ("float", 0.5, 1.0), "reg_lambda": ("log", 1e-3, 10.0),
        "n_estimators": ("choice", (100, 200, 400)),
    },
    "CatBoost": {
        "learning_rate": ("log", 0.02, 0.3), "depth": ("int", 3, 8), "l2_leaf_reg": ("log", 1.0, 10.0),
        "bagging_temperature": ("float", 0.0, 1.0), "rsm": ("float", 0.5, 1.0),
        "iterations": ("choice", (100, 200, 400)),
    },
}


def sample_configs(space: dict[str, tuple], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` configurations drawn from ``space`` with ``numpy.random.default_rng(seed)`` (same draws every call)."""
    if n < 1:
        raise ValueError(f"n (configurations) must be at least 1, got {n}")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        cfg: dict[str, Any] = {}
        for name, (kind, *rest) in space.items():
            if kind == "log":
                cfg[name] = float(math.exp(rng.uniform(math.log(rest[0]), math.log(rest[1]))))
            elif kind == "float":
                cfg[name] = float(rng.uniform(rest[0], rest[1]))
            elif kind == "int":
                cfg[name] = int(rng.integers(rest[0], rest[1] + 1))
            elif kind == "choice":
                cfg[name] = rest[0][int(rng.integers(len(rest[0])))]
            else:
                raise ValueError(f"unknown kind {kind!r} for {name!r}; accepted: log, float, int, choice")
        out.append(cfg)
    return out


class _Encoded:
    """Wraps a GBDT: labels -> 0..K-1 (XGBoost needs it), the frame prepared by ``prep``; ``classes_`` are labels."""

    def __init__(self, model, prep: Callable | None = None) -> None:
        self.model, self.prep = model, prep

    def fit(self, X, y):
        self.classes_, y_enc = np.unique(np.asarray(y), return_inverse=True)
        self.model.fit(self.prep(X) if self.prep else X, y_enc)
        return self

    def predict_proba(self, X) -> np.ndarray:
        p = np.asarray(self.model.predict_proba(self.prep(X) if self.prep else X), dtype=np.float64)
        if p.shape[1] != len(self.classes_):  # a class unseen by the booster: should not happen after encoding
            raise ValueError(f"{type(self.model).__name__} returned {p.shape[1]} columns for "
                             f"{len(self.classes_)} classes")
        return p


def _catboost_frame(X):
    X = X.copy()
    for c in X.columns:
        if str(X[c].dtype) == "category":
            v = X[c].astype(object)
            X[c] = np.asarray(v.where(v.notna(), "nan"), dtype=str).astype(object)  # NaN -> "nan": its own level
    return X


def make_gbdt(name: str, params: dict[str, Any] | None = None, seed: int = 0):
    """A GBDT with library defaults updated by ``params``, one thread, seed ``seed``."""
    params = dict(params or {})
    if name == "LightGBM":
        from lightgbm import LGBMClassifier

        if "subsample" in params:
            params.setdefault("subsample_freq", 1)  # LightGBM bags rows only when subsample_freq > 0
        return _Encoded(LGBMClassifier(random_state=seed, n_jobs=1, verbose=-1, **params))
    if name == "XGBoost":
        from xgboost import XGBClassifier

        return _Encoded(XGBClassifier(random_state=seed, n_jobs=1, tree_method="hist", enable_categorical=True,
                                      **params))
    if name == "CatBoost":
        from catboost import CatBoostClassifier

        class _Cat(_Encoded):
            def fit(self, X, y):
                cats = [c for c in X.columns if str(X[c].dtype) == "category"]
                self.model.set_params(cat_features=cats or None)
                return super().fit(X, y)

        return _Cat(CatBoostClassifier(random_seed=seed, thread_count=1, verbose=0, allow_writing_files=False,
                                       **params), _catboost_frame)
    raise ValueError(f"unknown GBDT {name!r}; choose one of {list(GBDTS)}")


class Tuned:
    """Random search of ``n_configs`` configurations by stratified ``folds``-fold CV accuracy on the training data.

    After ``fit``: ``best_params_``, ``cv_accuracy_`` (mean CV accuracy per configuration, in draw order),
    ``classes_``; ``predict_proba`` uses the best configuration refit on all the training data.
    """

    def __init__(self, name: str, *, n_configs: int = 10, folds: int = 3, seed: int = 0) -> None:
        self.name, self.n_configs, self.folds, self.seed = name, n_configs, folds, seed

    def fit(self, X, y):
        from sklearn.model_selection import StratifiedKFold

        y = np.asarray(y)
        configs = sample_configs(SPACES[self.name], self.n_configs, self.seed)
        cv = StratifiedKFold(n_splits=self.folds, shuffle=True, random_state=self.seed)
        folds = list(cv.split(np.zeros(len(y)), y))
        scores = []
        for cfg in configs:
            acc = []
            for tr, va in folds:
                m = make_gbdt(self.name, cfg, self.seed).fit(X.iloc[tr], y[tr])
                pred = m.classes_[np.argmax(m.predict_proba(X.iloc[va]), 1)]
                acc.append(float(np.mean(pred == y[va])))
            scores.append(float(np.mean(acc)))
        best = int(np.argmax(scores))  # first maximum: ties go to the earlier draw
        self.cv_accuracy_, self.best_params_ = scores, configs[best]
        self.model_ = make_gbdt(self.name, configs[best], self.seed).fit(X, y)
        self.classes_ = self.model_.classes_
        return self

    def predict_proba(self, X) -> np.ndarray:
        return self.model_.predict_proba(X)


def model_factories(*, n_configs: int = 10, folds: int = 3, tabicl_n_estimators: int | None = None,
                    checkpoint=None, finetune_steps: int = 0, seed: int = 0,
                    tabicl_kwargs: dict[str, Any] | None = None) -> dict[str, Callable[[], Any]]:
    """Name -> zero-argument factory for every model the benchmark knows (TabICL, TabICL-ft when
    ``finetune_steps`` > 0, and :data:`PEERS`). ``tabicl_kwargs``: further ``TabICLClassifier`` parameters
    (e.g. ``{"softmax_temperature": 1.0}``)."""
    from tabular.compare import baseline_models

    def tabicl(**extra):
        def make():
            from tabular import TabICLClassifier

            kw = {"random_state": seed, **(tabicl_kwargs or {}), **extra}
            if tabicl_n_estimators is not None:
                kw["n_estimators"] = tabicl_n_estimators
            if checkpoint is not None:
                kw["checkpoint"] = checkpoint
            return TabICLClassifier(**kw)
        return make

    out: dict[str, Callable[[], Any]] = {"TabICL": tabicl()}
    if finetune_steps:
        out["TabICL-ft"] = tabicl(finetune_steps=finetune_steps)
    out.update(baseline_models(seed))
    for g in GBDTS:
        out[g] = lambda g=g: make_gbdt(g, None, seed)
        out[f"{g}-tuned"] = lambda g=g: Tuned(g, n_configs=n_configs, folds=folds, seed=seed)
    return out


def model_settings(name: str, *, n_configs: int, folds: int, tabicl_n_estimators: int | None, checkpoint,
                   finetune_steps: int, seed: int = 0, tabicl_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a model's result depends on besides the data and split: library version, seed, tuning budget,
    TabICL's weights (size + SHA-256 of the file) and settings. Part of each record's settings fingerprint."""
    import sklearn

    s: dict[str, Any] = {"model": name, "seed": seed, "sklearn": sklearn.__version__}
    base = name.removesuffix("-tuned")
    if base in GBDTS:
        mod = {"LightGBM": "lightgbm", "XGBoost": "xgboost", "CatBoost": "catboost"}[base]
        s[mod] = __import__(mod).__version__
        if name.endswith("-tuned"):
            s.update(n_configs=n_configs, folds=folds, space=repr(SPACES[base]))
    if name.startswith("TabICL"):
        import torch

        from core.infra.jobs import file_identity
        from tabular.weights_io import default_checkpoint

        s["weights"] = file_identity(default_checkpoint() if checkpoint is None else checkpoint)
        s.update(n_estimators=tabicl_n_estimators, torch=torch.__version__)
        if name == "TabICL-ft":
            s["finetune_steps"] = finetune_steps
        kwargs = tabicl_effective_kwargs(tabicl_kwargs)
        if kwargs:  # only when not empty, so that the records of a default run keep their fingerprint
            s["kwargs"] = kwargs
    return s


# Estimator defaults that changed after records began to be fingerprinted: the value of the time. A parameter at
# one of these values is left out of the fingerprint, any other value is written as if it had been passed, so
# that a run of today's defaults never reuses a record made with the old ones (and reuses those made with the
# same values passed explicitly).
TABICL_RECORDED_DEFAULTS = {"context": "global"}


def tabicl_effective_kwargs(tabicl_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The estimator keywords a TabICL record depends on: those given, and today's defaults that differ from the
    defaults of the time the records were first fingerprinted (``TABICL_RECORDED_DEFAULTS``)."""
    from tabular.estimator import TabICLClassifier

    given = dict(tabicl_kwargs or {})
    defaults = TabICLClassifier().get_params()
    out = {k: v for k, v in given.items() if not (k in TABICL_RECORDED_DEFAULTS and v == TABICL_RECORDED_DEFAULTS[k])}
    for k, old in TABICL_RECORDED_DEFAULTS.items():
        if k not in given and defaults[k] != old:
            out[k] = defaults[k]
    return dict(sorted(out.items()))
