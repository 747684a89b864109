"""TabICL: in-context classification of tables with a three-stage transformer.

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
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch
from torch import nn

from core.layers import MLP, InducedSetAttentionBlock, SelfAttentionBlock
from core.rope import RotaryEmbedding
from tabular.readout import logistic_readout, logistic_scores

logger = logging.getLogger(__name__)

__all__ = ["TabICLConfig", "TabICL", "TrainContext", "column_stats", "standardize", "tabicl_tiny", "tabicl_small", "tabicl_medium", "tabicl_base", "standardize_columns", "CONFIGS"]


@dataclass(kw_only=True)
class TabICLConfig:
    """Sizes of the three stages."""

    max_classes: int = 10  # logits the decoder emits; more classes go through hierarchical grouping
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

    def __post_init__(self) -> None:
        for name in ("max_classes", "embed_dim", "col_blocks", "col_heads", "col_inducing", "row_blocks",
                     "row_heads", "n_cls", "icl_blocks", "icl_heads", "icl_ffn"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if self.max_classes < 2:
            raise ValueError(f"max_classes ({self.max_classes}) must be at least 2")
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


@dataclass(kw_only=True)
class TrainContext:
    """Everything test rows need from the train rows: the train-side cache of repeated predictions."""

    mean: torch.Tensor  # (B, 1, F) train column means
    std: torch.Tensor  # (B, 1, F) train column stds
    summaries: list  # per column block: (B*F, M, d) inducing summaries
    kv: list  # per ICL block: (k, v), each (B, H, n_train, head_dim)
    row_mean: torch.Tensor  # (B, 1, D) train row-vector mean
    row_std: torch.Tensor  # (B, 1, D) train row-vector std
    n_train: int  # train rows
    ridge_w: torch.Tensor | None = None  # (B, D, len(icl_ridge) * max_classes) ridge readout weights, if any
    logit_w: torch.Tensor | None = None  # (B, F + 1, len(icl_logistic) * max_classes) logistic readout, if any

    def nbytes(self) -> int:
        ts = [self.mean, self.std, self.row_mean, self.row_std, *self.summaries, *(t for kv in self.kv for t in kv)]
        ts += [t for t in (self.ridge_w, self.logit_w) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


class ColumnEmbedding(nn.Module):
    """Distribution-aware cell embedding: ISAB over each column (train rows induce), per-cell weight and bias."""

    def __init__(self, cfg: TabICLConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.lift = nn.Linear(1, d)
        self.blocks = nn.ModuleList(
            InducedSetAttentionBlock(d, cfg.col_heads, cfg.col_inducing, mlp_ratio=cfg.mlp_ratio)
            for _ in range(cfg.col_blocks)
        )
        self.norm = nn.LayerNorm(d)
        self.weight_head = nn.Linear(d, d)
        self.bias_head = nn.Linear(d, d)

    def summaries(self, x_SN1: torch.Tensor, n_train: int) -> list[torch.Tensor]:
        """Per-block inducing summaries ``(S, M, d)`` of columns ``x (S, N, 1)``; reads rows ``[:n_train]``."""
        return self.encode_train(x_SN1[:, :n_train], chunk=max(1, n_train), cells=False)[0]

    def encode_train(
        self, x_SN1: torch.Tensor, *, chunk: int, cells: bool = True
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """One pass over train columns ``x (S, n, 1)``: the per-block summaries and (``cells``) the cell embeddings.

        The inducing points of block ``i`` read all rows of block ``i``'s input; the broadcast step and the
        output heads act on each row alone, so they run ``chunk`` rows at a time (bounded working memory). The
        train cells come out of the same pass that builds the summaries (no second pass over the train rows).

        Returns:
            ``(summaries, cells)``: summaries ``[(S, M, d)] * col_blocks``; cells ``(S, n, d)`` or None.
        """
        h = self.lift(x_SN1)  # (S, n, d)
        out = []
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            H = blk.induce(h)  # (S, M, d): inducing points attend to the train rows
            out.append(H)
            if i == last and not cells:
                break  # the last broadcast only feeds the cells
            nxt = torch.empty_like(h)
            for s in range(0, h.shape[1], chunk):
                nxt[:, s : s + chunk] = blk.broadcast_block(h[:, s : s + chunk], H)
            h = nxt
        if not cells:
            return out, None
        for s in range(0, h.shape[1], chunk):
            hn = self.norm(h[:, s : s + chunk])
            h[:, s : s + chunk] = x_SN1[:, s : s + chunk] * self.weight_head(hn) + self.bias_head(hn)
        return out, h

    def apply(self, x_SN1: torch.Tensor, summaries: list[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        """Cell embeddings ``(S, N, d)`` of any rows given the column summaries (rows are independent)."""
        h = self.lift(x_SN1)
        for blk, H in zip(self.blocks, summaries):
            h = blk.broadcast_block(h, H)
        h = self.norm(h)
        return x_SN1 * self.weight_head(h) + self.bias_head(h)

    def forward(self, x_SN1: torch.Tensor, n_train: int) -> torch.Tensor:
        """Cell embeddings ``(S, N, d)`` of columns ``(S, N, 1)``; the summaries read rows ``[:n_train]``."""
        h = self.lift(x_SN1)
        for blk in self.blocks:
            h = blk.broadcast_block(h, blk.induce(h[:, :n_train]))
        h = self.norm(h)
        return x_SN1 * self.weight_head(h) + self.bias_head(h)


class RowInteraction(nn.Module):
    """Self-attention across the features of one row (RoPE over feature positions), read out by CLS tokens."""

    def __init__(self, cfg: TabICLConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.n_cls = cfg.n_cls
        self.cls = nn.Parameter(torch.randn(cfg.n_cls, d) * 0.02)  # (n_cls, d) learned CLS tokens
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(d, cfg.row_heads, mlp_ratio=cfg.mlp_ratio) for _ in range(cfg.row_blocks)
        )
        self.rope = RotaryEmbedding(d // cfg.row_heads, base=cfg.rope_base)
        # Feature identity: sinusoids of the feature position, projected. Without it the value vectors of features
        # with alike distributions are exchangeable and only RoPE's attention weights can tell them apart,
        # which learns slowly; ensembles shuffle feature order, so the identity stays arbitrary.
        self.n_pos_freqs = 16
        self.pos_proj = nn.Linear(2 * self.n_pos_freqs, d)
        self.norm = nn.LayerNorm(d)

    def position_embedding(self, F: int, device, dtype) -> torch.Tensor:
        """``(F, d)`` identity vectors of feature positions ``0..F-1`` (sin/cos at geometric frequencies)."""
        pos = torch.arange(F, device=device, dtype=torch.float32)[:, None]
        freqs = torch.exp(-torch.arange(self.n_pos_freqs, device=device, dtype=torch.float32) * (6.0 / self.n_pos_freqs))
        ang = pos * freqs[None]  # (F, n_freqs), periods from 2*pi up to ~2*pi*e^6 positions
        return self.pos_proj(torch.cat([ang.sin(), ang.cos()], dim=-1).to(dtype))

    def forward(self, cells_RFD: torch.Tensor) -> torch.Tensor:
        """Cells of ``R`` rows ``(R, F, d)`` -> row vectors ``(R, n_cls * d)``."""
        R, F, d = cells_RFD.shape
        cells_RFD = cells_RFD + self.position_embedding(F, cells_RFD.device, cells_RFD.dtype)[None]
        tokens = torch.cat([self.cls.to(cells_RFD.dtype)[None].expand(R, -1, -1), cells_RFD], dim=1)  # (R, C+F, d)
        pos = torch.arange(self.n_cls + F, device=cells_RFD.device)
        rope = self.rope(pos, dtype=cells_RFD.dtype)  # (C+F, hd) each
        for blk in self.blocks:
            tokens = blk(tokens, rope=rope)
        return self.norm(tokens[:, : self.n_cls]).reshape(R, self.n_cls * d)


class ICLTransformer(nn.Module):
    """Pre-norm blocks where every row attends to the train rows only; labels embedded on train rows."""

    def __init__(self, cfg: TabICLConfig) -> None:
        super().__init__()
        D = cfg.icl_dim
        self.max_classes = cfg.max_classes
        self.label_embed = nn.Linear(cfg.max_classes, D)
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(D, cfg.icl_heads, mlp_hidden_dim=cfg.icl_ffn) for _ in range(cfg.icl_blocks)
        )
        self.norm = nn.LayerNorm(D)
        self.decoder = MLP(D, 2 * D, out_dim=cfg.max_classes)
        self.ridge_alphas = tuple(cfg.icl_ridge)
        if self.ridge_alphas:
            self.ridge_proj = nn.Linear(len(self.ridge_alphas) * cfg.max_classes, D)
            nn.init.zeros_(self.ridge_proj.weight)  # a model extended with the readout starts as the model without
            nn.init.zeros_(self.ridge_proj.bias)
        self.logistic_alphas = tuple(cfg.icl_logistic)
        if self.logistic_alphas:
            self.logit_proj = nn.Linear(len(self.logistic_alphas) * cfg.max_classes, D)
            nn.init.zeros_(self.logit_proj.weight)  # as for the ridge readout: starts as the model without it
            nn.init.zeros_(self.logit_proj.bias)

    def ridge_fit(self, rows_train: torch.Tensor, y_train: torch.Tensor, *, chunk: int = 1024,
                  alphas: tuple[float, ...] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Ridge readout of standardized train rows ``(B, n, D)``: weights ``(B, D, A·C)`` (``A`` penalties, ``C =
        max_classes``) and the train rows' leave-one-out predictions ``(B, n, A·C)``. ``alphas``: the penalties
        (default the config's ``icl_ridge``).

        Targets are the one-hot labels centred on their train mean; the penalty of ``alpha`` is ``alpha · n`` (the
        rows are standardized, so ``RᵀR`` has ``n`` on its diagonal). Solved in float64 in the primal (``D × D``),
        ``chunk`` rows at a time, so time is linear in ``n`` and the float64 working memory is ``O(B·D²)`` plus one
        chunk. Leave-one-out: ``(ŷᵢ − hᵢ·yᵢ) / (1 − hᵢ)`` with the hat diagonal ``hᵢ``, so train rows see
        predictions of the same kind as test rows (not their own fitted labels).
        """
        B, n, D = rows_train.shape
        C = self.max_classes
        Y = nn.functional.one_hot(y_train, C).double()
        Y = Y - Y.mean(1, keepdim=True)
        G = rows_train.new_zeros(B, D, D, dtype=torch.float64)
        RtY = rows_train.new_zeros(B, D, C, dtype=torch.float64)
        for s in range(0, n, chunk):
            R = rows_train[:, s : s + chunk].double()
            G = G + R.transpose(1, 2) @ R
            RtY = RtY + R.transpose(1, 2) @ Y[:, s : s + chunk]
        eye = torch.eye(D, dtype=torch.float64, device=rows_train.device)
        ws, loos = [], []
        for alpha in self.ridge_alphas if alphas is None else alphas:
            Ainv = torch.cholesky_inverse(torch.linalg.cholesky(G + (alpha * n) * eye))  # (B, D, D)
            W = Ainv @ RtY
            parts = []
            for s in range(0, n, chunk):
                R = rows_train[:, s : s + chunk].double()
                h = ((R @ Ainv) * R).sum(-1, keepdim=True)  # hat diagonal of these rows
                parts.append((R @ W - h * Y[:, s : s + chunk]) / (1.0 - h).clamp_min(1e-6))
            ws.append(W)
            loos.append(torch.cat(parts, dim=1))
        dtype = rows_train.dtype
        return torch.cat(ws, dim=2).to(dtype), torch.cat(loos, dim=2).to(dtype)

    def ridge_features(self, rows: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """The readout's contribution ``(B, S, D)`` for standardized rows ``(B, S, D)`` and weights from
        :meth:`ridge_fit`."""
        return self.ridge_proj(rows @ W)

    def _block(self, blk: SelfAttentionBlock, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One block for rows ``x (B, S, D)`` attending to cached train keys/values ``(B, H, n_train, hd)``."""
        q = blk.attn.project_q(blk.norm1(x))
        x = x + blk.attn.merge(blk.attn.attend(q, k, v))
        return x + blk.mlp(blk.norm2(x))

    def embed_train(self, rows_train: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor:
        """Add the label embedding to train rows ``(B, n_train, D)``."""
        onehot = nn.functional.one_hot(y_train, self.max_classes).to(rows_train.dtype)
        return rows_train + self.label_embed(onehot)

    def context(
        self, rows_train: torch.Tensor, y_train: torch.Tensor, *, chunk: int | None = None,
        ridge_loo: torch.Tensor | None = None, logit_loo: torch.Tensor | None = None,
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-block train keys/values: the train-side cache that test rows attend to.

        ``rows_train`` must already be standardized (see :meth:`row_stats`). Keys/values of a block need all
        train rows; the queries, the attention over those keys and the MLP run ``chunk`` rows at a time
        (None = all at once). ``ridge_loo``: the train rows' leave-one-out readout (:meth:`ridge_fit`), when
        the model has one; ``logit_loo``: the same for the logistic readout (:func:`tabular.readout.logistic_readout`).
        """
        x = self.embed_train(rows_train, y_train)
        if ridge_loo is not None:
            x = x + self.ridge_proj(ridge_loo)
        if logit_loo is not None:
            x = x + self.logit_proj(logit_loo)
        n = x.shape[1]
        chunk = n if chunk is None else max(1, int(chunk))
        cache = []
        for blk in self.blocks:
            k, v = blk.attn.project_kv(blk.norm1(x))
            cache.append((k, v))
            if chunk >= n:
                x = self._block(blk, x, k, v)
            else:
                nxt = torch.empty_like(x)
                for s in range(0, n, chunk):
                    nxt[:, s : s + chunk] = self._block(blk, x[:, s : s + chunk], k, v)
                x = nxt
        return cache

    def predict(self, rows_test: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits ``(B, n_test, max_classes)`` of standardized test rows ``(B, n_test, D)`` given the train cache."""
        x = rows_test
        for blk, (k, v) in zip(self.blocks, cache):
            x = self._block(blk, x, k, v)
        return self.decoder(self.norm(x))

    @staticmethod
    def row_stats(rows_train: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-table mean and std over train rows ``(B, n_train, D)`` -> 2 x ``(B, 1, D)``."""
        mean = rows_train.mean(1, keepdim=True)
        std = rows_train.std(1, keepdim=True, unbiased=False) + 1e-5
        return mean, std

    def forward(self, rows: torch.Tensor, y_train: torch.Tensor, logits: torch.Tensor | None = None) -> torch.Tensor:
        """Rows ``(B, N, D)`` with the first ``n_train = y_train.shape[1]`` labelled -> test logits.

        ``logits``: the logistic readout's ``(B, N, P·C)`` features (leave-one-out for train rows), when the model
        has one.

        Row vectors are first standardized with their train rows' mean and std (per table and dimension):
        it removes the component shared by all rows, so rows differ at unit scale from the first step on
        (without it the ICL attention starts near-uniform and learning stalls on a long plateau).
        """
        n_train = y_train.shape[1]
        mean, std = self.row_stats(rows[:, :n_train])
        rows = (rows - mean) / std
        x = torch.cat([self.embed_train(rows[:, :n_train], y_train), rows[:, n_train:]], dim=1)
        if self.ridge_alphas:
            W, loo = self.ridge_fit(rows[:, :n_train], y_train)
            x = x + torch.cat([self.ridge_proj(loo), self.ridge_features(rows[:, n_train:], W)], dim=1)
        if self.logistic_alphas:
            if logits is None:
                raise ValueError("this model has a logistic readout (icl_logistic): pass its logits")
            x = x + self.logit_proj(logits)
        for blk in self.blocks:
            h = blk.norm1(x)
            k, v = blk.attn.project_kv(h[:, :n_train])  # keys/values from train rows only
            q = blk.attn.project_q(h)
            x = x + blk.attn.merge(blk.attn.attend(q, k, v))
            x = x + blk.mlp(blk.norm2(x))
        return self.decoder(self.norm(x[:, n_train:]))


class TabICL(nn.Module):
    """The full model. ``forward(X, y_train) -> logits (B, N - n_train, max_classes)``."""

    def __init__(self, config: TabICLConfig | None = None) -> None:
        super().__init__()
        self.config = config or tabicl_small()
        self.col = ColumnEmbedding(self.config)
        self.row = RowInteraction(self.config)
        self.icl = ICLTransformer(self.config)

    def _cells(self, Z: torch.Tensor, n_train: int) -> torch.Tensor:
        """``(B, N, F)`` standardized (:func:`standardize_columns`) -> cell embeddings ``(B, N, F, d)``."""
        B, N, F = Z.shape
        cols = Z.permute(0, 2, 1).reshape(B * F, N, 1)  # (B*F, N, 1): one set per column
        E = self.col(cols, n_train)  # (B*F, N, d)
        return E.reshape(B, F, N, -1).permute(0, 2, 1, 3)

    def encode_rows(self, X: torch.Tensor, n_train: int) -> torch.Tensor:
        """Row vectors ``(B, N, n_cls * d)`` of raw tables ``X (B, N, F)``."""
        return self._rows(standardize_columns(X, n_train, self.config.clip_value), n_train)

    def _rows(self, Z: torch.Tensor, n_train: int) -> torch.Tensor:
        """Row vectors ``(B, N, n_cls * d)`` of standardized cells ``Z (B, N, F)``."""
        B, N, F = Z.shape
        E = self._cells(Z, n_train)
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
        if int(y_train.min()) < 0 or int(y_train.max()) >= self.config.max_classes:
            raise ValueError(f"labels must lie in [0, {self.config.max_classes}), got [{int(y_train.min())}, {int(y_train.max())}]")
        Z = standardize_columns(X, n_train, self.config.clip_value)  # the cells both stages and the readout read
        return self.icl(self._rows(Z, n_train), y_train, self._readout_logits(Z, y_train))

    def _readout_logits(self, Z: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor | None:
        """The logistic readout's features ``(B, N, P·C)`` of standardized cells (train rows: leave-one-out), or
        None."""
        if not self.icl.logistic_alphas:
            return None
        n_train = y_train.shape[1]
        with torch.no_grad():  # no parameters: a closed-form fit of the cells, no graph through it
            W, loo = logistic_readout(Z[:, :n_train], y_train, self.icl.logistic_alphas, self.config.max_classes)
            return torch.cat([loo, logistic_scores(Z[:, n_train:], W)], dim=1)

    # -- inference with a train-side cache ---------------------------------------------------------------
    def _rows_from_cells(self, Z: torch.Tensor, summaries: list, chunk: int) -> torch.Tensor:
        """Standardized ``Z (B, N, F)`` -> row vectors ``(B, N, D)``, ``chunk`` rows at a time (rows independent)."""
        B, N, F = Z.shape
        out = []
        for s in range(0, N, chunk):
            z = Z[:, s : s + chunk]
            n = z.shape[1]
            cols = z.permute(0, 2, 1).reshape(B * F, n, 1)
            E = self.col.apply(cols, summaries).reshape(B, F, n, -1).permute(0, 2, 1, 3)  # (B, n, F, d)
            out.append(self.row(E.reshape(B * n, F, -1)).reshape(B, n, -1))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def build_context(self, X_train: torch.Tensor, y_train: torch.Tensor, *, chunk: int = 4096) -> TrainContext:
        """Run the train rows once: column summaries, column statistics and the ICL keys/values.

        Working memory: the full-width tensors are the column stage's hidden cells ``(B·F, n, d)``, the row
        vectors ``(B, n, D)`` and the cached keys/values; everything else (broadcast blocks, row interaction,
        ICL queries and MLPs) runs ``chunk`` rows at a time. Results do not depend on ``chunk`` (up to float
        rounding).

        Args:
            X_train: ``(B, n_train, F)`` raw train rows (NaN = missing).
            y_train: ``(B, n_train)`` labels in ``[0, max_classes)``.
            chunk: rows per chunk in the row-wise stages (memory bound).
        """
        if not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        mean, std = column_stats(X_train)
        Z = standardize(X_train, mean, std, self.config.clip_value)
        B, n, F = Z.shape
        logit_w = logit_loo = None
        if self.icl.logistic_alphas:
            logit_w, logit_loo = logistic_readout(Z, y_train, self.icl.logistic_alphas, self.config.max_classes)
        cols = Z.permute(0, 2, 1).reshape(B * F, n, 1)
        del Z
        summaries, cells = self.col.encode_train(cols, chunk=chunk)  # cells (B*F, n, d)
        del cols
        cells = cells.view(B, F, n, -1)
        rows = cells.new_empty(B, n, self.config.icl_dim)
        for s in range(0, n, chunk):
            c = cells[:, :, s : s + chunk]  # (B, F, c, d)
            m = c.shape[2]
            rows[:, s : s + m] = self.row(c.permute(0, 2, 1, 3).reshape(B * m, F, -1)).view(B, m, -1)
        del cells
        row_mean, row_std = self.icl.row_stats(rows)
        rows.sub_(row_mean).div_(row_std)
        ridge_w = loo = None
        if self.icl.ridge_alphas:
            ridge_w, loo = self.icl.ridge_fit(rows, y_train, chunk=chunk)
        kv = self.icl.context(rows, y_train, chunk=chunk, ridge_loo=loo, logit_loo=logit_loo)
        return TrainContext(mean=mean, std=std, summaries=summaries, kv=kv, row_mean=row_mean, row_std=row_std,
                            n_train=n, ridge_w=ridge_w, logit_w=logit_w)

    @torch.no_grad()
    def predict_logits(self, X_test: torch.Tensor, ctx: TrainContext, *, chunk: int = 4096) -> torch.Tensor:
        """Logits ``(B, n_test, max_classes)`` of raw test rows ``(B, n_test, F)`` against a train context,
        ``chunk`` test rows at a time (test rows are independent, so the result does not depend on ``chunk``)."""
        if not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(f"chunk must be a positive int, got {chunk!r}")
        out = []
        for s in range(0, X_test.shape[1], chunk):
            Z = standardize(X_test[:, s : s + chunk], ctx.mean, ctx.std, self.config.clip_value)
            rows = (self._rows_from_cells(Z, ctx.summaries, chunk) - ctx.row_mean) / ctx.row_std
            if ctx.ridge_w is not None:
                rows = rows + self.icl.ridge_features(rows, ctx.ridge_w)
            if ctx.logit_w is not None:
                rows = rows + self.icl.logit_proj(logistic_scores(Z, ctx.logit_w))
            out.append(self.icl.predict(rows, ctx.kv))
        return torch.cat(out, dim=1)
