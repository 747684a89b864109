"""``TabICLClassifier``: a scikit-learn classifier that predicts by in-context learning.

``fit`` stores the (preprocessed) train table; ``predict_proba`` runs the pretrained TabICL model with the
train rows as context. Optionally (``finetune_steps``) ``fit`` first adapts a copy of the model to the table
with a few gradient steps on the in-context loss of its train rows. An ensemble of ``n_estimators`` views of
the table — feature orders (cyclic shifts of a random permutation, a Latin-square design so each feature visits
each position), cyclic class shifts and the numeric-column normalisations of ``norm_methods`` (none /
Yeo-Johnson power by default; quantile too) — is averaged in logit space, then a softmax with temperature
``softmax_temperature``. A table wider than the checkpoint's pretraining tables may have its numeric columns
projected onto principal components (``feature_reduction``; "auto" decides on a holdout of the train rows).
More classes than the model's decoder has go through a balanced hierarchy of class groups (≤ ``max_classes``
groups per node); probabilities multiply down the tree.

Train sets above ``max_context`` rows are split into stratified folds that act as separate contexts (logits
averaged), so time and memory grow linearly in rows. Test rows and ensemble members are processed in batches
sized from ``memory_budget_mb`` (half of it bounds the activations, every stage runs in row chunks); the
train-side representation (column summaries and ICL keys/values) of each (fold, member batch) is cached after
the first ``predict`` while the cache fits in the other half, so repeated predictions skip those train rows.
"""

from __future__ import annotations

import copy
import logging
import math
import sys
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.base import ClassifierMixin
from sklearn.utils.multiclass import check_classification_targets
from sklearn.utils.validation import check_is_fitted, column_or_1d
from tqdm import tqdm

from tabular.finetune import VIEWS as FINETUNE_VIEWS
from tabular.finetune import finetune, rows_for_budget
from tabular.model import TabICL
from tabular.preprocess import TablePreprocessor
from tabular.reduction import PCAReducer as _PCAReducer
from tabular.reduction import fit_rows as _fit_rows
from tabular.sklearn_base import TabularEstimator
from tabular.sklearn_base import get_model as _get_model

logger = logging.getLogger(__name__)

__all__ = ["TabICLClassifier"]

NORM_METHODS = ("none", "power", "quantile")  # numeric-column views an ensemble member can see
_MIN_CHUNK = 16  # fewest rows per chunk the memory plan picks (below it Python overhead dominates)
_REDUCTION_DIMS = (8, 12, 16, 24)  # principal-component counts feature_reduction="auto" tries
_REDUCTION_ROWS = 2048  # at most this many train rows (stratified subset) choose the reduction
_REDUCTION_MIN_ROWS = 40  # fewer train rows than this: too noisy to choose, all columns are kept
_REDUCTION_MEMBERS = 2  # ensemble members of each candidate's holdout run
_DEFAULT_TEMPERATURE = 0.9  # softmax temperature of the published model, and the centre of "auto"'s prior
_TEMPERATURE_PRIOR_SIGMA = 0.5  # std of the log-normal prior of softmax_temperature="auto" (in log space)


@dataclass(kw_only=True)
class _Member:
    """One ensemble view."""

    perm: np.ndarray  # feature order
    shift: int  # cyclic class shift
    norm: str  # transform of the numeric columns: one of NORM_METHODS


@dataclass(kw_only=True, eq=False)
class _CacheLedger:
    """Bytes held by the train-side cache of a fitted estimator (mutated by ``predict``, so not a plain attribute)."""

    nbytes: int = 0  # sum of the kept contexts' tensor bytes
    skipped: int = 0  # contexts built by the last predict call and not kept (the cache was full)


@dataclass(kw_only=True)
class _Node:
    """A node of the class hierarchy: the model classifies its rows into ``len(children)`` groups (or classes)."""

    classes: np.ndarray  # encoded class ids covered by this node
    groups: list  # per group: array of encoded class ids
    children: list  # per group: _Node, or None when the group is a single class
    cache: dict = field(default_factory=dict)  # train context per member batch

    def group_of(self, n_classes: int) -> np.ndarray:
        """``(n_classes,)`` group index of every encoded class at this node (-1: a class outside it)."""
        out = np.full(n_classes, -1, dtype=np.int64)
        for g, members in enumerate(self.groups):
            out[members] = g
        return out


def say(text: str) -> None:
    """A ``verbose`` message on standard error, written around any progress bar shown."""
    tqdm.write(f"TabICL: {text}", file=sys.stderr)


def _walk(node: _Node):
    """``node`` and every node below it."""
    yield node
    for child in node.children:
        if child is not None:
            yield from _walk(child)


def _balanced_tree(classes: np.ndarray, k: int) -> _Node:
    """Split ``classes`` into at most ``k`` near-equal contiguous groups, recursively."""
    if len(classes) <= k:
        return _Node(classes=classes, groups=[classes[i : i + 1] for i in range(len(classes))], children=[None] * len(classes))
    n_groups = min(k, math.ceil(len(classes) / k))
    groups = np.array_split(classes, n_groups)
    return _Node(classes=classes, groups=list(groups), children=[_balanced_tree(g, k) if len(g) > 1 else None for g in groups])


class TabICLClassifier(ClassifierMixin, TabularEstimator):
    """In-context tabular classifier backed by a pretrained TabICL checkpoint.

    Args:
        n_estimators: ensemble members (feature shuffles x class shifts x normalisations).
        checkpoint: path of a ``.safetensors`` (or pretraining ``.pt``, or official ``.ckpt``) checkpoint; an official
            release by name ("v1", "v1.1", "v2"), found in the local Hugging Face cache (:mod:`tabular.checkpoints`,
            never downloaded); None = the shipped default.
        device: "cpu", "cuda", "cuda:N", ... ; None picks CUDA when available, else CPU. ``fit`` refuses a device this
            machine lacks with a ValueError.
        random_state: seed of the ensemble's feature permutations.
        memory_budget_mb: memory the inference may use: half bounds the activations (sets the row chunk and
            member batch sizes), half the train-side cache (contexts beyond it are recomputed per call).
        batch_size: test rows per forward pass; None derives it from ``memory_budget_mb``. With ``official``: the
            official ``batch_size``, ensemble members per forward pass (None = its default 8).
        max_context: most train rows in one context; larger tables are split into stratified folds, each a
            separate context whose logits are averaged (cost and memory linear in rows instead of quadratic).
        context: "local" (default): when a class node has more than ``local_context`` train rows, the test rows
            are clustered (k-means on standardised features, about 128 test rows per cluster, at most 16 clusters)
            and each cluster reads its own context: the ``local_context`` train rows nearest to any of its test
            rows (plus the nearest few rows of any class group they miss). A retrieval context in the spirit of
            LoCalPFN; no context is cached. At or under ``local_context`` train rows it is the global context.
            "global": every test row reads the same context(s) of train rows (cached after the first predict).
            Chosen on the development suite (``benchmarks/results/tabular_dev_choices.json``, choice "context").
        local_context: train rows per local context (``context="local"``).
        softmax_temperature: temperature applied to the averaged logits, or "auto": fitted at ``fit`` on a
            stratified holdout of the train rows (at most 2,048; the model with the same members reads the other
            70%) as the maximum a-posteriori temperature under a log-normal prior centred on 0.9 (σ 0.5 in log
            space), so a small holdout stays near 0.9; ``temperature_`` holds the value used.
        norm_methods: transforms of the numeric columns the members cycle through: "none", "power"
            (Yeo-Johnson) and "quantile" (ranks mapped to a normal).
        feature_reduction: "auto" projects the numeric columns of a table wider than the checkpoint's pretraining
            onto 8-24 principal components when that beats keeping them on a holdout of the train rows
            (``reduction_scores_`` lists the candidates); an int always projects onto that many (standardised)
            components; None never reduces. ``feature_reduction_`` describes what the fit chose.
        onehot_max_levels: 0 (default): a categorical column is one column of codes. An int L >= 3: a categorical
            column with 3 to L codes on the train rows (levels, plus missing when present) becomes one 0/1 column
            per code (``tabular.preprocess``), so a rule on one level is a threshold on one column.
        finetune_steps: 0 (default) predicts purely in context. A positive number adapts a copy of the model to
            this table first: that many AdamW steps (rate ``finetune_lr``, gradient norm clipped at 1) on the
            in-context loss of the train rows, each step drawing two ensemble views and a stratified split of at
            most 1,024 train rows (fewer for wide tables, so that a step fits in ``memory_budget_mb``;
            ``finetune_rows_`` holds the number) into context (70%) and queries (30%). With
            ``softmax_temperature="auto"`` the temperature's holdout rows are left out of fine-tuning: every 20
            steps the weights are scored on them (log-loss; step 0 = the pretrained weights), the best-scoring
            weights are kept (``finetune_eval_``), and the temperature is then fitted on them. Costs a forward
            and backward pass per step (tens of seconds per 100 steps on one CPU thread); ``finetune_loss_``
            holds the loss of every step. Test rows are never seen.
        finetune_lr: learning rate of the fine-tuning steps.
        verbose: progress bars on standard error (predictions: ensemble views done; fine-tuning: steps and
            loss), and there too the choices made at fit (temperature, feature reduction, kept fine-tuning step).
        official: with an official checkpoint (``checkpoint="v2"`` or a ``tabicl-classifier-....ckpt`` path), run the
            official package's own preprocessing and ensembling around this model (:mod:`tabular.official_pipeline`;
            needs ``pip install tabicl==2.2.0``): the official predictions. Uses ``n_estimators``, ``norm_methods``
            (also "quantile_rtdl", "robust"), ``random_state``, ``device``, ``memory_budget_mb``, ``batch_size``
            (members per pass), ``softmax_temperature`` ("auto" = the official 0.9) and the five options below; the
            other options do not apply. More classes than the checkpoint's ``max_classes`` go through the official
            model's mixed-radix label views and class hierarchy (:mod:`tabular.many_class`).
        kv_cache: (``official`` only) build the train context of every member batch at ``fit`` and serve every
            ``predict`` from it, as the official ``kv_cache=True``: the train rows are never run again (memory: the
            ICL keys and values of every train row, member and block; ``context_nbytes_``).
        average_logits: (``official`` only) average the members' logits, then one softmax (True), or their
            probabilities (False), as the official option.
        feat_shuffle_method, class_shuffle_method: (``official`` only) the official ensemble's feature orders and
            class permutations: "none", "shift", "random" or "latin".
        dtype: (``official`` only) the model's compute dtype: None = bf16 autocast on CUDA (fp16 where the GPU has no
            bf16), fp32 on the CPU; "float32", "bfloat16" or "float16" as given (``torch.autocast`` on the device;
            bf16 on the CPU runs but is slower than fp32 there).
    """

    def __init__(
        self,
        *,
        n_estimators: int = 8,
        checkpoint=None,
        device=None,
        random_state=0,
        memory_budget_mb: float = 2048.0,
        batch_size=None,
        max_context: int = 8192,
        context: str = "local",
        local_context: int = 1024,
        softmax_temperature="auto",
        norm_methods=("none", "power"),
        feature_reduction="auto",
        onehot_max_levels: int = 0,
        finetune_steps: int = 0,
        finetune_lr: float = 3e-4,
        verbose: bool = False,
        official: bool = False,
        kv_cache: bool = False,
        average_logits: bool = True,
        feat_shuffle_method: str = "latin",
        class_shuffle_method: str = "shift",
        dtype=None,
    ) -> None:
        self.official = official
        self.kv_cache = kv_cache
        self.average_logits = average_logits
        self.feat_shuffle_method = feat_shuffle_method
        self.class_shuffle_method = class_shuffle_method
        self.dtype = dtype
        self.n_estimators = n_estimators
        self.checkpoint = checkpoint
        self.device = device
        self.random_state = random_state
        self.memory_budget_mb = memory_budget_mb
        self.batch_size = batch_size
        self.max_context = max_context
        self.context = context
        self.local_context = local_context
        self.softmax_temperature = softmax_temperature
        self.norm_methods = norm_methods
        self.feature_reduction = feature_reduction
        self.onehot_max_levels = onehot_max_levels
        self.finetune_steps = finetune_steps
        self.finetune_lr = finetune_lr
        self.verbose = verbose

    # -- sklearn plumbing ---------------------------------------------------------------------------------
    def _check_params(self) -> None:
        if not isinstance(self.official, (bool, np.bool_)):
            raise ValueError(f"official must be True or False, got {self.official!r}")
        if not (isinstance(self.n_estimators, (int, np.integer)) and self.n_estimators >= 1):
            raise ValueError(f"n_estimators must be a positive int, got {self.n_estimators!r}")
        if not (isinstance(self.memory_budget_mb, (int, float)) and self.memory_budget_mb > 0):
            raise ValueError(f"memory_budget_mb must be a positive number, got {self.memory_budget_mb!r}")
        if self.batch_size is not None and not (isinstance(self.batch_size, (int, np.integer)) and self.batch_size >= 1):
            raise ValueError(f"batch_size must be None or a positive int, got {self.batch_size!r}")
        if not (isinstance(self.max_context, (int, np.integer)) and self.max_context >= 2):
            raise ValueError(f"max_context must be an int >= 2, got {self.max_context!r}")
        if self.context not in ("global", "local"):
            raise ValueError(f"context must be 'global' or 'local', got {self.context!r}")
        lc = self.local_context
        if not (isinstance(lc, (int, np.integer)) and not isinstance(lc, bool) and lc >= 16):
            raise ValueError(f"local_context must be an int >= 16 (train rows per local context), got {lc!r}")
        t = self.softmax_temperature
        if not (t == "auto" if isinstance(t, str) else isinstance(t, (int, float)) and not isinstance(t, bool) and t > 0):
            raise ValueError(f"softmax_temperature must be a number > 0 or 'auto', got {t!r}")
        self._check_official_params(official=bool(self.official), classes=True)
        if not self.official:
            norms = self._norm_list()
            if (not isinstance(norms, (tuple, list)) or not norms
                    or any(not isinstance(n, str) or n not in NORM_METHODS for n in norms)):
                raise ValueError(f"norm_methods must be a non-empty sequence of {NORM_METHODS}, got {self.norm_methods!r}")
        fs = self.finetune_steps
        if not (isinstance(fs, (int, np.integer)) and not isinstance(fs, bool) and fs >= 0):
            raise ValueError(f"finetune_steps must be an int >= 0, got {fs!r}")
        lr = self.finetune_lr
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 < lr < 1):
            raise ValueError(f"finetune_lr must be a number in (0, 1), got {lr!r}")
        fr = self.feature_reduction
        if not (fr is None or fr == "auto" or isinstance(fr, (int, np.integer)) and not isinstance(fr, bool) and fr >= 1):
            raise ValueError(f"feature_reduction must be 'auto', None or a positive int (principal components), got {fr!r}")

    def _norm_list(self):
        """``norm_methods`` as a sequence (a single name is accepted too)."""
        return (self.norm_methods,) if isinstance(self.norm_methods, str) else self.norm_methods

    # -- fit --------------------------------------------------------------------------------------------
    def fit(self, X, y):
        """Store the train table (preprocessed) and labels; with ``finetune_steps`` > 0 also adapt a copy of the
        model to it (the only case where ``fit`` takes gradient steps)."""
        self._check_params()
        df = self._validate_X(X, reset=True)
        if y is None:
            raise ValueError(f"{type(self).__name__} requires y to be passed, but the target y is None")
        y = column_or_1d(np.asarray(y) if not hasattr(y, "to_numpy") else y.to_numpy(), warn=True)
        if len(y) != len(df):
            raise ValueError(f"X has {len(df)} rows but y has {len(y)} labels")
        if y.dtype.kind == "f" and np.isnan(y).any() or y.dtype.kind == "O" and any(v is None or v != v for v in y):
            raise ValueError("y contains missing labels (NaN/None); drop those rows or label them")
        check_classification_targets(y)
        self.classes_, y_enc = np.unique(y, return_inverse=True)
        if self.official:
            return self._fit_official(df, y_enc.astype(np.int64))
        self._pre = TablePreprocessor(onehot_max_levels=self.onehot_max_levels)
        Xv, is_cat = self._pre.fit_transform(df)
        self._device = self._resolve_device()
        model = _get_model(self.checkpoint, self._device)
        if model.config.regression:
            raise ValueError(f"checkpoint {self.checkpoint!r} is a regression checkpoint: use tabular.TabICLRegressor")
        self._max_classes = model.config.max_classes
        y_enc = y_enc.astype(np.int64)
        trained_width = model.card.get("pretrained_max_features")
        self._reducer, self.reduction_scores_ = None, []
        # A refit starts from the pretrained model again.
        self._finetuned, self.finetune_loss_, self.finetune_eval_, self.finetune_rows_ = None, [], [], 0
        auto_reduce = self.feature_reduction == "auto" and trained_width and Xv.shape[1] > trained_width
        # One train holdout serves both choices made at fit time (the reduction, then the temperature).
        split = self._holdout(y_enc) if auto_reduce or self.softmax_temperature == "auto" else None
        if auto_reduce:
            self._reducer, self.reduction_scores_ = self._select_reduction(Xv, is_cat, y_enc, trained_width, split)
        elif self.feature_reduction not in (None, "auto") and int((~is_cat).sum()) > self.feature_reduction:
            self._reducer = _PCAReducer.fit(Xv, is_cat, int(self.feature_reduction), standardize=True,
                                            seed=self.random_state)
        if self._reducer is not None:
            Xv, is_cat = self._reducer.transform(Xv), self._reducer.is_cat
        self.feature_reduction_ = None if self._reducer is None else self._reducer.describe()
        F = Xv.shape[1]
        if trained_width and F > trained_width:
            hint = ("feature_reduction='auto' kept every column: no projection beat them on a train holdout"
                    if self.reduction_scores_ else
                    "feature_reduction='auto' or an int projects the numeric columns onto principal components")
            warnings.warn(f"the table has {F} informative features but this checkpoint was pretrained on tables of at "
                          f"most {trained_width}; expect lower accuracy ({hint})", UserWarning, stacklevel=2)
        self._setup(Xv, is_cat, y_enc)
        if self.finetune_steps and self._tree is not None:
            use_split = split if self.softmax_temperature == "auto" else None
            held_out = use_split[1] if use_split is not None else np.array([], dtype=np.int64)
            self._finetune(np.setdiff1d(np.arange(len(y_enc)), held_out), use_split)
        if self.softmax_temperature == "auto":
            self.temperature_ = self._fit_temperature(Xv, is_cat, y_enc, split)
        else:
            self.temperature_ = float(self.softmax_temperature)
        self.n_features_in_ = df.shape[1]
        return self

    def _setup(self, Xv: np.ndarray, is_cat: np.ndarray, y_enc: np.ndarray) -> None:
        """Store the model-ready train table and draw the ensemble (``fit`` after preprocessing and reduction)."""
        self._X_train, self._is_cat, self._y_train = Xv, is_cat, y_enc
        rng = np.random.default_rng(self.random_state)
        F = Xv.shape[1]
        base = rng.permutation(F)
        self._members = []
        C = len(self.classes_)
        norms = self._norm_list()
        for i in range(int(self.n_estimators)):
            perm = np.roll(base, i % F) if i < F or F == 1 else rng.permutation(F)
            self._members.append(_Member(perm=perm, shift=int(i % max(1, min(C, self._max_classes))),
                                         norm=norms[i % len(norms)]))
        self._norms = {n: self._fit_norm(Xv, n) for n in {m.norm for m in self._members} if n != "none"}
        self._tree = _balanced_tree(np.arange(C), self._max_classes) if C > 1 else None
        self._cache = _CacheLedger()  # bytes of train contexts kept for later predict calls

    def _model(self) -> TabICL:
        """The model predictions run: the table's fine-tuned copy, or the shared pretrained one."""
        ft = getattr(self, "_finetuned", None)
        return ft if ft is not None else _get_model(self.checkpoint, self._device)

    def _finetune(self, rows: np.ndarray, split=None) -> None:
        """Adapt a copy of the model to the train rows ``rows`` (see ``finetune_steps`` and :mod:`tabular.finetune`);
        sets ``_finetuned``, ``finetune_loss_`` and ``finetune_eval_``. Labels are the root node's groups (the
        classes themselves up to ``max_classes``); each step's tables are two of the ensemble's views.

        With a holdout ``split = (a, b)`` (``b`` disjoint from ``rows``) the weights are scored on it (rows ``a``
        as context, the ensemble's log-loss of rows ``b``) and the best-scoring ones are kept."""
        from sklearn.metrics import log_loss

        G = len(self._tree.groups)
        group_of = self._tree.group_of(len(self.classes_))  # the root covers every class

        def make_batch(order, yy, rng):
            pick = rng.choice(len(self._members), FINETUNE_VIEWS, replace=len(self._members) < FINETUNE_VIEWS)
            views = [self._members[i] for i in pick]
            xs = torch.from_numpy(np.stack([self._view(self._X_train[order], m) for m in views])).to(self._device)
            ys = torch.from_numpy(np.stack([(yy + m.shift) % G for m in views])).to(self._device)
            return xs, ys

        score = None
        if split is not None:
            a, b = split
            probe = self._probe(min(int(self.n_estimators), 4))
            probe._setup(self._X_train[a], self._is_cat, self._y_train[a])
            labels = np.arange(len(self.classes_))

            def score(model):
                probe._finetuned = model
                for node in _walk(probe._tree):
                    node.cache.clear()  # contexts of the previous weights
                proba = probe._proba(self._X_train[b])
                return log_loss(self._y_train[b], np.clip(proba, 1e-12, 1), labels=labels)

        model = copy.deepcopy(_get_model(self.checkpoint, self._device))
        # fit holds no train-side cache, so a fine-tuning step may use the whole budget (less a reserve).
        max_rows = rows_for_budget(self.memory_budget_mb, model.config.embed_dim, self._X_train.shape[1])
        res = finetune(model, group_of[self._y_train], rows, make_batch, n_classes=G, steps=int(self.finetune_steps),
                       lr=self.finetune_lr, seed=self.random_state, score=score, max_rows=max_rows,
                       verbose=self.verbose)
        if res is None:
            logger.warning("finetune_steps=%d skipped: %d train rows leave no query row for fine-tuning",
                           self.finetune_steps, len(rows))
            return
        self._finetuned, self.finetune_loss_, self.finetune_eval_ = model, res.losses, res.evals
        self.finetune_rows_ = res.rows_per_step
        if self.verbose and res.best_step is not None:
            say(f"fine-tuning: kept the weights of step {res.best_step} (holdout score "
                f"{dict(res.evals)[res.best_step]:.4f})")

    def _select_reduction(self, Xv, is_cat, y_enc, width: int, split):
        """``feature_reduction='auto'``: keep all columns or project the numeric ones onto ``k`` principal
        components (of the centred or of the standardised columns), whichever classifies a stratified holdout of
        the train rows best (accuracy, then log-loss); ``_REDUCTION_DIMS`` below the pretrained width are tried.

        ``split`` is :meth:`_holdout`'s. Returns ``(reducer or None, scores)``; ``scores`` lists every candidate's
        holdout accuracy and log-loss.
        """
        from sklearn.metrics import log_loss

        n_num = int((~is_cat).sum())
        dims = [k for k in _REDUCTION_DIMS if k < min(n_num, width)]
        if not dims or split is None:
            return None, []
        a, b = split
        probe = self._probe(_REDUCTION_MEMBERS)
        classes = np.arange(len(self.classes_))
        candidates = [None] + [(k, std) for std in (False, True) for k in dims]
        scores, best = [], None
        for cand in candidates:
            red = None if cand is None else _PCAReducer.fit(Xv[a], is_cat, cand[0], standardize=cand[1],
                                                            seed=self.random_state)
            Xa, Xb = (Xv[a], Xv[b]) if red is None else (red.transform(Xv[a]), red.transform(Xv[b]))
            probe._setup(Xa, is_cat if red is None else red.is_cat, y_enc[a])
            proba = probe._proba(Xb)
            rec = {"components": None if cand is None else cand[0], "standardize": None if cand is None else cand[1],
                   "accuracy": float(np.mean(proba.argmax(1) == y_enc[b])),
                   "log_loss": float(log_loss(y_enc[b], np.clip(proba, 1e-12, 1), labels=classes))}
            scores.append(rec)
            if best is None or (rec["accuracy"], -rec["log_loss"]) > (best[0]["accuracy"], -best[0]["log_loss"]):
                best = (rec, cand)
            if self.verbose:
                say(f"feature reduction {cand}: holdout accuracy {rec['accuracy']:.3f}, log-loss {rec['log_loss']:.3f}")
        cand = best[1]
        if cand is None:
            return None, scores
        return _PCAReducer.fit(Xv, is_cat, cand[0], standardize=cand[1], seed=self.random_state), scores

    def _holdout(self, y_enc: np.ndarray):
        """A stratified 70/30 split ``(a, b)`` of at most ``_REDUCTION_ROWS`` train rows (a stratified subset), or
        None when there are too few rows or a class has a single row."""
        from sklearn.model_selection import train_test_split

        counts = np.bincount(y_enc)
        rows = np.arange(len(y_enc))
        if len(rows) < _REDUCTION_MIN_ROWS or (counts[counts > 0] < 2).any():
            return None
        rng = np.random.default_rng(self.random_state)
        if len(rows) > _REDUCTION_ROWS:
            rows = np.sort(train_test_split(rows, train_size=_REDUCTION_ROWS, stratify=y_enc,
                                            random_state=int(rng.integers(2**31)))[0])
        return train_test_split(rows, test_size=0.3, stratify=y_enc[rows], random_state=int(rng.integers(2**31)))

    def _probe(self, n_estimators: int) -> "TabICLClassifier":
        """An estimator of the same settings to run on holdout splits (no reduction, the default temperature)."""
        probe = type(self)(**{**self.get_params(), "n_estimators": n_estimators, "feature_reduction": None,
                              "softmax_temperature": _DEFAULT_TEMPERATURE, "verbose": False})
        probe.classes_, probe._device, probe._max_classes = self.classes_, self._device, self._max_classes
        probe.temperature_ = _DEFAULT_TEMPERATURE
        probe._finetuned = getattr(self, "_finetuned", None)  # holdouts run the model the estimator predicts with
        return probe

    def _fit_temperature(self, Xv: np.ndarray, is_cat: np.ndarray, y_enc: np.ndarray, split) -> float:
        """``softmax_temperature='auto'``: the MAP temperature on the train holdout ``split`` (see the class
        docstring)."""
        from scipy.optimize import minimize_scalar

        if split is None or self._tree is None:
            return _DEFAULT_TEMPERATURE
        a, b = split
        probe = self._probe(int(self.n_estimators))
        probe._setup(Xv[a], is_cat, y_enc[a])
        memo: dict = {}  # the model runs once per node; each trial temperature only redoes the softmax
        centre, yb = math.log(_DEFAULT_TEMPERATURE), y_enc[b]

        def neg_log_posterior(log_t: float) -> float:
            p = probe._node_proba(probe._tree, Xv[b], math.exp(log_t), memo)[np.arange(len(b)), yb]
            return float(-np.log(np.clip(p, 1e-12, None)).sum() + (log_t - centre) ** 2 / (2 * _TEMPERATURE_PRIOR_SIGMA**2))

        res = minimize_scalar(neg_log_posterior, bounds=(math.log(0.02), math.log(10.0)), method="bounded")
        t = float(math.exp(res.x))
        if self.verbose:
            say(f"softmax temperature {t:.3f} (holdout of {len(b)} rows; negative log-posterior {res.fun:.3f}, "
                f"{neg_log_posterior(centre):.3f} at the default {_DEFAULT_TEMPERATURE:.1f})")
        return t

    def _fit_norm(self, Xv: np.ndarray, method: str):
        """The fitted transform of the numeric columns for ``method`` (None: no numeric column, or it failed,
        and the members of that method see the raw values)."""
        from sklearn.preprocessing import PowerTransformer, QuantileTransformer

        num = ~self._is_cat
        if not num.any():
            return None
        rows = _fit_rows(len(Xv), self.random_state)  # exponents and quantiles settle long before 65,536 rows
        if method == "power":
            tf = PowerTransformer(method="yeo-johnson", standardize=True)
        else:  # quantile: ranks mapped to a standard normal (NaN stays NaN)
            tf = QuantileTransformer(n_quantiles=max(2, min(1000, len(rows))), output_distribution="normal",
                                     random_state=0)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tf.fit(Xv[np.ix_(rows, np.flatnonzero(num))].astype(np.float64))
        except (ValueError, FloatingPointError):
            return None
        return tf

    def _view(self, Xv: np.ndarray, m: _Member) -> np.ndarray:
        tf = self._norms.get(m.norm)
        if tf is not None:
            Xv = Xv.copy()
            num = ~self._is_cat
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                Xv[:, num] = tf.transform(Xv[:, num].astype(np.float64)).astype(np.float32)
        return Xv[:, m.perm]

    # -- predict ----------------------------------------------------------------------------------------
    @staticmethod
    def _memory_model(model: TabICL, F: int) -> tuple[int, int, int]:
        """Bytes of the forward pass, per (row, ensemble member), from the model's sizes (fp32).

        Returns ``(full, chunked, cached)``: ``full`` is held for every train row of a context at once (the
        column stage's hidden cells and the key/value transients of its inducing step, the row vectors, the
        ICL stream); ``chunked`` is held per row of one chunk only (broadcast blocks, row interaction, ICL
        queries and MLP); ``cached`` is what the train-side cache keeps per train row (ICL keys/values).
        Measured peak resident memory stays below the estimate (``benchmarks/tabular_scaling.py``).
        """
        c = model.config
        d, D, tokens = c.embed_dim, c.icl_dim, F + c.n_cls
        act = 8 + 2 * c.mlp_ratio  # live (row, width) tensors inside one block, MLP hidden included
        cached = 2 * D * c.icl_blocks
        full = 4 * F * d + 3 * D + cached + 3 * F
        chunked = (F * d + tokens * d) * act + c.row_heads * tokens + 8 * D + 2 * c.icl_ffn
        return 4 * int(full), 4 * int(chunked), 4 * int(cached)

    def _plan(self, model: TabICL, F: int, n_ctx: int, n_members: int, n_test: int) -> tuple[int, int]:
        """``(members per batch, rows per chunk)`` so that one batch's working memory fits the budget.

        Half of ``memory_budget_mb`` is kept for the train-side cache; the other half bounds the activations:
        as many members per batch as fit with at least ``_MIN_CHUNK`` rows per chunk, then the largest chunk
        that fits. ``batch_size`` (if given) sets the chunk directly. A context too large for the budget even
        with one member runs with the smallest chunk (and says so in the log): lower ``max_context``.
        """
        full, chunked, _ = self._memory_model(model, F)
        act = self.memory_budget_mb * 2**20 / 2
        per_member = full * n_ctx + chunked * _MIN_CHUNK
        per_batch = max(1, min(n_members, int(act // max(1, per_member))))
        if self.batch_size:
            return per_batch, int(self.batch_size)
        room = act - per_batch * full * n_ctx
        chunk = int(room // max(1, per_batch * chunked))
        if chunk < _MIN_CHUNK:
            logger.warning(
                "memory_budget_mb=%s is below what one %d-row context needs (~%.0f MB); running with %d-row "
                "chunks; lower max_context to stay inside the budget",
                self.memory_budget_mb, n_ctx, 2 * per_member / 2**20, _MIN_CHUNK,
            )
            chunk = _MIN_CHUNK
        return per_batch, max(1, min(chunk, max(n_ctx, n_test)))

    def _folds(self, y: np.ndarray) -> list[np.ndarray]:
        """Train-row index sets of at most ``max_context`` rows each, stratified by label (one set if it fits)."""
        n = len(y)
        n_folds = max(1, math.ceil(n / int(self.max_context)))
        if n_folds == 1:
            return [np.arange(n)]
        rng = np.random.default_rng(self.random_state)
        order = np.concatenate([rng.permutation(np.flatnonzero(y == c)) for c in np.unique(y)])
        return [np.sort(order[f::n_folds]) for f in range(n_folds)]  # dealt round-robin: stratified

    def _node_logits(self, node: _Node, X_test: np.ndarray) -> np.ndarray:
        """Averaged view logits ``(n_test, len(node.groups))`` of the group of each test row at ``node``.

        A view is (ensemble member, train fold). Tables with more train rows than ``max_context`` are split
        into stratified folds that serve as separate contexts, so cost and memory grow linearly in rows; each
        fold gets at least one member and each member at least one fold.
        """
        model = self._model()
        group_of = node.group_of(len(self.classes_))
        rows_at = np.flatnonzero(np.isin(self._y_train, node.classes))  # train rows under this node (no copy)
        ytr_all = group_of[self._y_train[rows_at]]
        G = len(node.groups)
        n_test = X_test.shape[0]
        if self.context == "local" and len(rows_at) > int(self.local_context):
            return self._local_logits(model, node, X_test, rows_at, ytr_all, G)
        folds = self._folds(ytr_all)
        n_views = max(len(folds), len(self._members))
        views: dict[int, list[_Member]] = {}
        for v in range(n_views):
            views.setdefault(v % len(folds), []).append(self._members[v % len(self._members)])
        budget = self.memory_budget_mb * 2**20
        total = np.zeros((n_test, G), dtype=np.float64)
        where = "" if node is self._tree else f", class group of {len(node.classes)}"
        bar = tqdm(total=n_views, desc=f"TabICL predict ({n_test} rows{where})", unit="view",
                   disable=not self.verbose, leave=node is self._tree)
        done = 0
        for f, members in views.items():
            Xtr, ytr = self._X_train[rows_at[folds[f]]], ytr_all[folds[f]]
            per_batch, chunk = self._plan(model, Xtr.shape[1], len(Xtr), len(members), n_test)
            for b0 in range(0, len(members), per_batch):
                batch = members[b0 : b0 + per_batch]
                key = (f, b0)
                ctx = node.cache.get(key)
                if ctx is None:
                    ctx = self._batch_context(model, batch, Xtr, ytr, G, chunk)
                    if self._cache.nbytes + ctx.nbytes() <= budget / 2:  # keep contexts while half the budget lasts
                        node.cache[key] = ctx
                        self._cache.nbytes += ctx.nbytes()
                    else:
                        self._cache.skipped += 1
                total += self._batch_logits(model, batch, ctx, X_test, G, chunk)
                del ctx
                bar.update(len(batch))
                bar.set_postfix_str(f"fold {f + 1}/{len(folds)}, chunk {chunk}", refresh=False)
                done += len(batch)
                logger.debug("predict %d rows%s: %d/%d views, fold %d/%d, context %s, train cache %.0f MB",
                             n_test, where, done, n_views, f + 1, len(folds), "cached" if key in node.cache else
                             "not kept", self._cache.nbytes / 2**20)
        bar.close()
        return total / n_views

    def _batch_context(self, model: TabICL, batch: list[_Member], Xtr: np.ndarray, ytr: np.ndarray, G: int, chunk):
        """The train context of a batch of ensemble members (each its own view of ``Xtr`` and class shift)."""
        xs = torch.from_numpy(np.stack([self._view(Xtr, m) for m in batch])).to(self._device)
        ys = torch.from_numpy(np.stack([(ytr + m.shift) % G for m in batch])).to(self._device)
        return model.build_context(xs, ys, chunk=chunk)

    def _batch_logits(self, model: TabICL, batch: list[_Member], ctx, X_test: np.ndarray, G: int, chunk) -> np.ndarray:
        """The batch's logits for ``X_test`` read from ``ctx``, summed over its members, ``(n_test, G)`` float64."""
        xt = torch.from_numpy(np.stack([self._view(X_test, m) for m in batch])).to(self._device)
        logits = model.predict_logits(xt, ctx, chunk=chunk)[..., :G].double().cpu().numpy()  # (b, n, G)
        total = np.zeros((len(X_test), G), dtype=np.float64)
        for j, m in enumerate(batch):
            total += logits[j][:, (np.arange(G) + m.shift) % G]  # undo the class shift: id (g + s) % G holds g
        return total

    #: Test rows per local cluster, most clusters, and rows of each class group a local context keeps at least.
    _LOCAL_ROWS_PER_CLUSTER = 128
    _LOCAL_MAX_CLUSTERS = 16
    _LOCAL_MIN_PER_GROUP = 4

    def _local_contexts(self, X_tr: np.ndarray, y_tr: np.ndarray, X_test: np.ndarray, G: int):
        """``[(test row indices, train row indices), ...]``: the test rows clustered, and for each cluster the
        ``local_context`` train rows nearest (Euclidean, features standardised on the train rows, missing = mean)
        to any of its test rows, plus the nearest ``_LOCAL_MIN_PER_GROUP`` rows of each class group it lacks."""
        mu = np.nanmean(X_tr, axis=0)
        sd = np.nanstd(X_tr, axis=0)
        sd = np.where(np.isfinite(sd) & (sd > 0), sd, 1.0)
        mu = np.where(np.isfinite(mu), mu, 0.0)
        A = np.nan_to_num((X_tr - mu) / sd).astype(np.float32)
        T = np.nan_to_num((X_test - mu) / sd).astype(np.float32)
        n_test = len(T)
        k = max(1, min(self._LOCAL_MAX_CLUSTERS, math.ceil(n_test / self._LOCAL_ROWS_PER_CLUSTER)))
        if k > 1:
            from sklearn.cluster import KMeans

            labels = KMeans(n_clusters=k, n_init=1, random_state=self.random_state).fit_predict(T)
        else:
            labels = np.zeros(n_test, dtype=int)
        a2 = (A * A).sum(1)
        out = []
        m = int(self.local_context)
        for c in np.unique(labels):
            idx = np.flatnonzero(labels == c)
            d = np.full(len(A), np.inf, dtype=np.float32)
            for s in range(0, len(idx), 256):  # min over the cluster's test rows, in blocks
                t = T[idx[s : s + 256]]
                d = np.minimum(d, (a2[:, None] - 2 * A @ t.T + (t * t).sum(1)[None, :]).min(1))
            sel = np.argpartition(d, m - 1)[:m] if m < len(A) else np.arange(len(A))
            have = np.bincount(y_tr[sel], minlength=G)
            short = np.flatnonzero(have < np.minimum(self._LOCAL_MIN_PER_GROUP, np.bincount(y_tr, minlength=G)))
            extra = []
            for g in short:  # every class group the node's train rows hold appears in every local context
                rows = np.setdiff1d(np.flatnonzero(y_tr == g), sel)
                extra.append(rows[np.argsort(d[rows])[: self._LOCAL_MIN_PER_GROUP - have[g]]])
            if extra:
                sel = np.concatenate([sel, *extra])
            out.append((idx, np.sort(sel)))
        return out

    def _local_logits(self, model: TabICL, node: _Node, X_test: np.ndarray, rows_at: np.ndarray, ytr_all: np.ndarray,
                      G: int) -> np.ndarray:
        """Averaged member logits ``(n_test, G)`` with a local context per cluster of test rows (``context="local"``)."""
        X_all = self._X_train[rows_at]
        plans = self._local_contexts(X_all, ytr_all, X_test, G)
        total = np.zeros((len(X_test), G), dtype=np.float64)
        members = self._members
        bar = tqdm(total=len(plans), desc=f"TabICL predict ({len(X_test)} rows, local contexts)", unit="cluster",
                   disable=not self.verbose, leave=node is self._tree)
        for idx, sel in plans:
            Xtr, ytr, Xte = X_all[sel], ytr_all[sel], X_test[idx]
            per_batch, chunk = self._plan(model, Xtr.shape[1], len(Xtr), len(members), len(idx))
            for b0 in range(0, len(members), per_batch):
                batch = members[b0 : b0 + per_batch]
                ctx = self._batch_context(model, batch, Xtr, ytr, G, chunk)
                total[idx] += self._batch_logits(model, batch, ctx, Xte, G, chunk)
                del ctx
            bar.update()
        bar.close()
        return total / len(members)

    def _node_proba(self, node: _Node, X_test: np.ndarray, temperature: float, memo: dict | None = None) -> np.ndarray:
        """Class probabilities ``(n_test, n_classes)`` under ``node`` (zeros outside its classes).

        ``memo`` (id of node -> logits), when given, keeps each node's logits so that another temperature does not
        run the model again."""
        out = np.zeros((X_test.shape[0], len(self.classes_)))
        if memo is not None and id(node) in memo:
            logits = memo[id(node)]
        else:
            logits = self._node_logits(node, X_test)
            if memo is not None:
                memo[id(node)] = logits
        z = logits / temperature
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        p /= p.sum(axis=1, keepdims=True)
        for g, (grp, child) in enumerate(zip(node.groups, node.children)):
            if child is None:
                out[:, grp[0]] = p[:, g]
            else:
                out += p[:, g : g + 1] * self._node_proba(child, X_test, temperature, memo)
        return out

    def _fit_official(self, df, y_enc: np.ndarray) -> "TabICLClassifier":
        from tabular.official_pipeline import OfficialEnsemble

        model = self._official_model(regression=False)
        t = 0.9 if self.softmax_temperature == "auto" else float(self.softmax_temperature)
        self.temperature_ = t
        self._official = OfficialEnsemble(model, class_shuffle_method=self.class_shuffle_method, softmax_temperature=t,
                                          average_logits=bool(self.average_logits), **self._official_kwargs())
        self._official.fit(df, y_enc, len(self.classes_))
        self.context_nbytes_ = self._official.context_nbytes()
        return self

    def predict_proba(self, X) -> np.ndarray:
        """Class probabilities ``(n_samples, n_classes)``, columns in the order of ``classes_``."""
        if self.official:
            check_is_fitted(self, "_official")
            return self._official.predict_proba(self._validate_X(X, reset=False))
        check_is_fitted(self, "_members")
        df = self._validate_X(X, reset=False)
        Xv = self._pre.transform(df)
        if self._reducer is not None:
            Xv = self._reducer.transform(Xv)
        return self._proba(Xv)

    def _proba(self, Xv: np.ndarray) -> np.ndarray:
        self._cache.skipped = 0
        if self._tree is None:  # a single class seen at fit time
            return np.ones((len(Xv), 1))
        proba = self._node_proba(self._tree, Xv, self.temperature_)
        return proba / proba.sum(axis=1, keepdims=True)

    def predict(self, X) -> np.ndarray:
        """Most probable class label of each row."""
        proba = self.predict_proba(X)
        return self.classes_[np.argmax(proba, axis=1)]
