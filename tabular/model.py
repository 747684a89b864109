"""TabICL: in-context classification (and regression) of tables with a three-stage transformer.

Layouts: a batch of ``B`` tables with ``N`` rows (the first ``n_train`` labelled, the rest queries) and ``F``
features: ``X (B, N, F)`` float (NaN = missing), ``y_train (B, n_train)`` int64 in ``[0, max_classes)``.

1. **Column embedding** (distribution-aware): every column is a set of ``N`` scalars. ``Linear(1, d)`` lifts each
   cell, induced set attention blocks (:class:`core.layers.InducedSetAttentionBlock`) let each cell see a summary
   of its column — the inducing points read the **train rows only**, so a query row never influences another
   row. Two heads give a per-cell weight ``W`` and bias ``b`` (``d`` each); the cell embedding is ``x·W + b``.
2. **Row interaction**: the ``F`` cell embeddings of one row plus ``n_cls`` learned CLS tokens go through
   self-attention blocks with rotary position embeddings over feature positions (:mod:`core.rope`, base 1e5);
   the CLS outputs concatenated give the row vector (``n_cls · d`` features).
3. **ICL transformer**: train rows get a label embedding (one-hot -> linear) added; in every block, queries of
   all rows attend to keys/values of the train rows only (one attention call with train keys; no N² mask), so
   train rows attend to train rows and a test row attends to train rows only. An MLP decoder maps each test
   row to ``max_classes`` logits. Row vectors are standardized with train-row statistics before this stage.
   Optional (``icl_ridge``, off by default): an in-context ridge readout — ridge regression of the one-hot train
   labels on the train row vectors, solved in closed form inside the forward pass — whose predictions (leave-one-out
   for train rows) are added to the rows entering this stage, so a linear fit is an input of the ICL stage
   instead of something its attention has to learn to compute.
   Optional (``icl_logistic``, off by default): an in-context logistic readout (:mod:`tabular.readout`) —
   one-vs-rest penalised logistic regression of the train labels on the standardized cells themselves, fitted
   by Newton's method inside the forward pass — whose logits (approximate leave-one-out for train rows) enter
   the ICL stage the same way.

All attention goes through ``core`` modules (backend chosen per module, ``core.attention`` picks memory-bounded
kernels for long contexts).

The published TabICL architectures (v1/v1.1 and v2, :mod:`tabular.official`) are this model with switches of
:class:`TabICLConfig` set: cells standardized outside the model, no feature-position identity, no row-vector
standardization, the column heads' LayerNorm after the heads (v1) or no heads (v2), and for v2 grouped cells, a
target-aware column stage and query-aware scalable softmax; ``max_classes=0`` builds their regression models
(the label embeddings read the standardized target, the decoder emits ``num_quantiles`` quantiles). The inference
paths with a train-side context (:meth:`TabICL.build_context`, ``predict_logits``, ``predict_proba``) and the
one-shot path with bounded memory (``predict_once``) are in :mod:`tabular.inference`; more classes than
``max_classes`` go through the official model's mixed-radix label views and class hierarchy
(:mod:`tabular.many_class`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from tabular.inference import CachedInference, TrainContext
from tabular.many_class import label_views
from tabular.readout import logistic_readout, logistic_scores
from tabular.stages import ColumnEmbedding, ICLTransformer, RowInteraction

logger = logging.getLogger(__name__)

__all__ = ["TabICLConfig", "TabICL", "TrainContext", "column_stats", "standardize", "tabicl_tiny", "tabicl_small", "tabicl_medium", "tabicl_base", "standardize_columns", "CONFIGS"]


COL_OUTPUTS = ("affine", "affine_ln_after", "direct")
SSMAX_TYPES = ("none", "qassmax-mlp-elementwise", "qassmax-mlp")


@dataclass(kw_only=True)
class TabICLConfig:
    """Sizes of the three stages."""

    max_classes: int = 10  # logits the decoder emits; more classes go through hierarchical grouping. 0: regression
    # (the published regression checkpoints): the label embeddings read the standardized target and the decoder
    # emits num_quantiles quantiles of it
    num_quantiles: int = 999  # quantiles a regression decoder emits (read only when max_classes = 0)
    embed_dim: int = 128  # cell / feature-token width d shared by column embedding and row interaction
    col_blocks: int = 3  # induced set attention blocks over each column (paper: 3)
    col_heads: int = 4  # heads in the column blocks
    col_inducing: int = 128  # inducing points per ISAB (paper: 128); summary size of a column
    row_blocks: int = 3  # row-interaction self-attention blocks (paper: 3)
    row_heads: int = 8  # heads in the row blocks
    n_cls: int = 4  # CLS tokens per row; the row vector is their concatenation (n_cls * embed_dim)
    rope_base: float = 100_000.0  # RoPE frequency base over feature positions (paper: 1e5)
    icl_blocks: int = 12  # ICL transformer blocks (paper: 12)
    icl_heads: int = 4  # heads in the ICL blocks
    icl_ffn: int = 1024  # MLP hidden size of the ICL blocks (paper: 1024)
    mlp_ratio: float = 2.0  # MLP hidden size / width in the column and row blocks
    clip_value: float = 10.0  # standardized cells are clipped to +-clip_value before embedding
    # In-context ridge readout (an addition to the published design, off when empty): for each alpha, ridge
    # regression of the one-hot train labels on the standardized train row vectors (penalty alpha * n_train);
    # its predictions (leave-one-out for train rows) enter the ICL stage through a zero-initialised projection.
    icl_ridge: tuple = ()
    # In-context logistic readout (an addition to the published design, off when empty; tabular.readout): for each
    # alpha, one-vs-rest logistic regression of the train labels on the standardized cells (weight penalty
    # alpha * n_train); its logits (leave-one-out for train rows) enter the ICL stage through a zero-initialised
    # projection. The cells keep what the row embedding loses on wide tables (logistic regression on the medium
    # model's row vectors: 0.954 on breast_cancer, on the cells 0.967).
    icl_logistic: tuple = ()
    # Switches that build the published TabICL architectures (official checkpoints, tabular/official.py); the
    # defaults are this project's design. v1/v1.1: input_standardize=False, row_standardize=False,
    # row_pos_embed=False, col_output="affine_ln_after". v2 adds col_output="direct", col_group_size=3,
    # col_target_aware=True, col_ssmax=icl_ssmax="qassmax-mlp-elementwise".
    input_standardize: bool = True  # standardize and clip cells inside the model (official: preprocessing does it)
    row_standardize: bool = True  # standardize the row vectors with train statistics before the ICL stage
    row_pos_embed: bool = True  # add the sinusoidal feature-position identity before row interaction
    col_output: str = "affine"  # "affine": LayerNorm, then weight/bias heads; "affine_ln_after": heads, then a
    # LayerNorm on each (v1); "direct": the set blocks' output is the cell embedding (v2)
    col_group_size: int = 1  # > 1 (v2: 3): a cell reads its column and columns j+2^i (cyclic) of its row
    col_target_aware: bool = False  # label embedding added to the train cells before the column blocks (v2)
    col_ssmax: str = "none"  # scalable softmax on the inducing points' queries ("qassmax-mlp-elementwise": v2)
    icl_ssmax: str = "none"  # scalable softmax on the ICL queries

    def __post_init__(self) -> None:
        for name in ("embed_dim", "col_blocks", "col_heads", "col_inducing", "row_blocks", "row_heads", "n_cls",
                     "icl_blocks", "icl_heads", "icl_ffn", "num_quantiles"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not (isinstance(self.max_classes, int) and (self.max_classes == 0 or self.max_classes >= 2)):
            raise ValueError(f"max_classes must be 0 (regression) or an int >= 2, got {self.max_classes!r}")
        if self.regression and (self.icl_ridge or self.icl_logistic):
            raise ValueError("the in-context readouts (icl_ridge, icl_logistic) need classes (max_classes >= 2)")
        for name in ("col_heads", "row_heads"):
            h = getattr(self, name)
            if self.embed_dim % h != 0:
                raise ValueError(f"{name} ({h}) must divide embed_dim ({self.embed_dim})")
        if (self.embed_dim // self.row_heads) % 2 != 0:
            raise ValueError(f"row head dim ({self.embed_dim // self.row_heads}) must be even for RoPE")
        if self.icl_dim % self.icl_heads != 0:
            raise ValueError(f"icl_heads ({self.icl_heads}) must divide the row vector size ({self.icl_dim})")
        if not self.rope_base > 1.0:
            raise ValueError(f"rope_base must be > 1, got {self.rope_base}")
        if not self.clip_value > 0:
            raise ValueError(f"clip_value must be > 0, got {self.clip_value}")
        if self.col_output not in COL_OUTPUTS:
            raise ValueError(f"col_output must be one of {COL_OUTPUTS}, got {self.col_output!r}")
        if not (isinstance(self.col_group_size, int) and self.col_group_size >= 1):
            raise ValueError(f"col_group_size must be a positive int, got {self.col_group_size!r}")
        if self.col_group_size > 1 and self.col_output != "direct":
            raise ValueError("col_group_size > 1 needs col_output='direct' (a group has no single cell to scale)")
        for name in ("col_ssmax", "icl_ssmax"):
            if getattr(self, name) not in SSMAX_TYPES:
                raise ValueError(f"{name} must be one of {SSMAX_TYPES}, got {getattr(self, name)!r}")
        for name in ("icl_ridge", "icl_logistic"):
            given = getattr(self, name)
            try:
                alphas = tuple(float(a) for a in given)
            except (TypeError, ValueError):
                raise ValueError(f"{name} must be a sequence of positive numbers, got {given!r}") from None
            if any(not a > 0 for a in alphas):
                raise ValueError(f"{name} penalties must be > 0, got {given!r}")
            setattr(self, name, alphas)  # JSON round trips give lists

    @property
    def regression(self) -> bool:
        """True for a regression model (``max_classes = 0``)."""
        return self.max_classes == 0

    @property
    def out_dim(self) -> int:
        """Width of the decoder's output: ``max_classes`` logits, or ``num_quantiles`` quantiles (regression)."""
        return self.num_quantiles if self.regression else self.max_classes

    @property
    def icl_dim(self) -> int:
        """Width of the ICL transformer: the concatenated CLS outputs."""
        return self.n_cls * self.embed_dim

    def to_dict(self) -> dict:
        return asdict(self)


def tabicl_tiny() -> TabICLConfig:
    """A few thousand parameters' worth of model for tests."""
    return TabICLConfig(embed_dim=16, col_blocks=1, col_heads=2, col_inducing=8, row_blocks=1, row_heads=2,
                        n_cls=2, icl_blocks=2, icl_heads=2, icl_ffn=64)


def tabicl_small() -> TabICLConfig:
    """The shipped default: small enough to pretrain on CPU (about 0.6M parameters, < 3 MB in fp32)."""
    return TabICLConfig(embed_dim=32, col_blocks=2, col_heads=4, col_inducing=32, row_blocks=2, row_heads=4,
                        n_cls=4, icl_blocks=4, icl_heads=4, icl_ffn=256)


def tabicl_medium() -> TabICLConfig:
    """Twice the small model's width, 6 ICL blocks (about 3.5M parameters, 14 MB in fp32): the next size to
    pretrain on CPU, for tables wider than the small model reads well."""
    return TabICLConfig(embed_dim=64, col_blocks=2, col_heads=4, col_inducing=32, row_blocks=2, row_heads=8,
                        n_cls=4, icl_blocks=6, icl_heads=8, icl_ffn=512)


def tabicl_base() -> TabICLConfig:
    """The published sizes (about 27M parameters)."""
    return TabICLConfig()


CONFIGS = {"tiny": tabicl_tiny, "small": tabicl_small, "medium": tabicl_medium, "base": tabicl_base}


def column_stats(X_train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-aware per-table, per-column mean and std over train rows ``(B, n_train, F)`` -> 2 x ``(B, 1, F)``."""
    valid = ~torch.isnan(X_train)
    cnt = valid.sum(1, keepdim=True).clamp_min(1)
    mean = torch.where(valid, X_train, 0).sum(1, keepdim=True) / cnt
    var = torch.where(valid, (X_train - mean) ** 2, 0).sum(1, keepdim=True) / cnt
    std = var.sqrt()
    return mean, torch.where(std > 1e-8, std, torch.ones_like(std))


def standardize(X: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, clip: float) -> torch.Tensor:
    """``(X - mean) / std``, NaN -> 0 (the train mean), clipped to ``[-clip, clip]``."""
    return ((X - mean) / std).nan_to_num(nan=0.0).clamp(-clip, clip)


def standardize_columns(X: torch.Tensor, n_train: int, clip: float) -> torch.Tensor:
    """Per table and column: standardize with train-row statistics (rows ``[:n_train]``), NaN -> 0, clip.

    Args:
        X: ``(B, N, F)`` float, NaN = missing.
        n_train: statistics use rows ``[:n_train]`` only (a query row never changes another row's value).
        clip: clip to ``[-clip, clip]``.
    """
    mean, std = column_stats(X[:, :n_train])
    return standardize(X, mean, std, clip)


class TabICL(CachedInference, nn.Module):
    """The full model. ``forward(X, y_train) -> logits (B, N - n_train, max_classes)``."""

    def __init__(self, config: TabICLConfig | None = None) -> None:
        super().__init__()
        self.config = config or tabicl_small()
        self.col = ColumnEmbedding(self.config)
        self.row = RowInteraction(self.config)
        self.icl = ICLTransformer(self.config)

    def _columns(self, Z: torch.Tensor) -> torch.Tensor:
        """``(B, N, F)`` cells -> column sets ``(B*F, N, g)``; with ``col_group_size = g > 1`` set ``j`` holds
        columns ``(j + 2^i) mod F``, ``i < g`` (the published v2 grouping)."""
        B, N, F = Z.shape
        g = self.config.col_group_size
        if g == 1:
            return Z.permute(0, 2, 1).reshape(B * F, N, 1)
        idx = torch.arange(F, device=Z.device)
        Zg = torch.stack([Z[:, :, (idx + 2**i) % F] for i in range(g)], dim=-1)  # (B, N, F, g)
        return Zg.permute(0, 2, 1, 3).reshape(B * F, N, g)

    def _label_views(self, y_train: torch.Tensor) -> list[torch.Tensor] | None:
        """The labels ``(B, n_train)`` a target-aware column stage reads, as views: ``[y_train]``, or its mixed-radix
        digits when the labels need more classes than ``max_classes`` (:func:`tabular.many_class.label_views`);
        None when the column stage does not read labels."""
        if self.col.label_embed is None:
            return None
        if self.config.regression:
            return [y_train]
        return label_views(y_train, self.config.max_classes)

    def _col_labels(self, views: list[torch.Tensor] | None, F: int) -> list[torch.Tensor] | None:
        """Label views ``(B, n)`` -> per column set ``(B*F, n)`` (None stays None)."""
        if views is None:
            return None
        B, n = views[0].shape
        return [v[:, None].expand(B, F, n).reshape(B * F, n) for v in views]

    def _many_classes(self, y_train: torch.Tensor) -> bool:
        """Whether these labels ``(B, n)`` hold more classes than the decoder has (the official many-class path)."""
        if self.config.regression:
            return False
        return int(y_train.max()) + 1 > self.config.max_classes or len(torch.unique(y_train[0])) > self.config.max_classes

    def _column_stats(self, X_train: torch.Tensor):
        """``(mean, std)`` ``(B, 1, F)`` of the train columns when the model standardizes cells itself, else
        ``(None, None)``."""
        return column_stats(X_train) if self.config.input_standardize else (None, None)

    def _prepare(self, X: torch.Tensor, mean=None, std=None) -> torch.Tensor:
        """Cells the model reads: standardized and clipped with train statistics (``input_standardize``), else
        ``X`` with NaN -> 0 (the published checkpoints expect preprocessed input)."""
        if not self.config.input_standardize:
            return X.nan_to_num(nan=0.0)
        return standardize(X, mean, std, self.config.clip_value)

    def _cells(self, Z: torch.Tensor, n_train: int, y_train: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N, F)`` standardized (:func:`standardize_columns`) -> cell embeddings ``(B, N, F, d)``."""
        B, N, F = Z.shape
        ys = None if y_train is None else self._col_labels(self._label_views(y_train), F)
        if ys is not None and len(ys) > 1:
            raise ValueError(f"more classes than max_classes ({self.config.max_classes}): use build_context and "
                             "predict_proba (the many-class path)")
        E = self.col(self._columns(Z), n_train, None if ys is None else ys[0])  # (B*F, N, d): one set per column
        return E.reshape(B, F, N, -1).permute(0, 2, 1, 3)

    def _standardized(self, X: torch.Tensor, n_train: int) -> torch.Tensor:
        if not self.config.input_standardize:
            return self._prepare(X)
        return standardize_columns(X, n_train, self.config.clip_value)

    def encode_rows(self, X: torch.Tensor, n_train: int, y_train: torch.Tensor | None = None) -> torch.Tensor:
        """Row vectors ``(B, N, n_cls * d)`` of raw tables ``X (B, N, F)`` (``y_train``: target-aware models)."""
        return self._rows(self._standardized(X, n_train), n_train, y_train)

    def _rows(self, Z: torch.Tensor, n_train: int, y_train: torch.Tensor | None = None) -> torch.Tensor:
        """Row vectors ``(B, N, n_cls * d)`` of standardized cells ``Z (B, N, F)``."""
        B, N, F = Z.shape
        E = self._cells(Z, n_train, y_train)
        return self.row(E.reshape(B * N, F, -1)).reshape(B, N, -1)

    def forward(self, X: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor:
        """Test-row logits.

        Args:
            X: ``(B, N, F)`` float tables, NaN = missing; rows ``[:n_train]`` are labelled.
            y_train: ``(B, n_train)`` int64 labels in ``[0, max_classes)``.

        Returns:
            ``(B, N - n_train, max_classes)`` logits.
        """
        if X.dim() != 3:
            raise ValueError(f"X must be (B, N, F), got shape {tuple(X.shape)}")
        if y_train.dim() != 2 or y_train.shape[0] != X.shape[0]:
            raise ValueError(f"y_train must be (B, n_train) with B = {X.shape[0]}, got {tuple(y_train.shape)}")
        n_train = y_train.shape[1]
        if not 0 < n_train < X.shape[1]:
            raise ValueError(f"n_train ({n_train}) must be in [1, N) with N = {X.shape[1]}")
        if not self.config.regression and (int(y_train.min()) < 0 or int(y_train.max()) >= self.config.max_classes):
            raise ValueError(f"labels must lie in [0, {self.config.max_classes}), got [{int(y_train.min())}, {int(y_train.max())}]")
        Z = self._standardized(X, n_train)  # the cells both stages and the readout read
        return self.icl(self._rows(Z, n_train, y_train), y_train, self._readout_logits(Z, y_train))

    def _readout_logits(self, Z: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor | None:
        """The logistic readout's features ``(B, N, P·C)`` of standardized cells (train rows: leave-one-out), or
        None."""
        if not self.icl.logistic_alphas:
            return None
        n_train = y_train.shape[1]
        with torch.no_grad():  # no parameters: a closed-form fit of the cells, no graph through it
            W, loo = logistic_readout(Z[:, :n_train], y_train, self.icl.logistic_alphas, self.config.max_classes)
            return torch.cat([loo, logistic_scores(Z[:, n_train:], W)], dim=1)
