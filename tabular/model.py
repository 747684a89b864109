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

The published TabICL architectures (v1/v1.1 and v2, :mod:`tabular.official`) are this model with switches of
:class:`TabICLConfig` set: cells standardized outside the model, no feature-position identity, no row-vector
standardization, the column heads' LayerNorm after the heads (v1) or no heads (v2), and for v2 grouped cells, a
target-aware column stage and query-aware scalable softmax. :meth:`TabICL.predict_once` is the one-shot inference
path with bounded memory (no train-side cache kept).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

from core.layers import MLP, InducedSetAttentionBlock, SelfAttentionBlock
from core.rope import RotaryEmbedding
from tabular.readout import logistic_readout, logistic_scores

logger = logging.getLogger(__name__)

__all__ = ["TabICLConfig", "TabICL", "TrainContext", "column_stats", "standardize", "tabicl_tiny", "tabicl_small", "tabicl_medium", "tabicl_base", "standardize_columns", "CONFIGS"]


COL_OUTPUTS = ("affine", "affine_ln_after", "direct")
SSMAX_TYPES = ("none", "qassmax-mlp-elementwise", "qassmax-mlp")


class QASSMax(nn.Module):
    """Query-aware scalable softmax (TabICL v2): queries ``(B, H, S, hd)`` scaled by
    ``base_mlp(log n) * (1 + tanh(query_mlp(q)))`` where ``n`` is the number of keys; per element of the head
    (``elementwise``) or per head."""

    def __init__(self, num_heads: int, head_dim: int, *, elementwise: bool, hidden: int = 64) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.elementwise = num_heads, head_dim, elementwise
        self.base_mlp = nn.Sequential(nn.Linear(1, hidden), nn.GELU(), nn.Linear(hidden, num_heads * (head_dim if elementwise else 1)))
        self.query_mlp = nn.Sequential(nn.Linear(head_dim, hidden), nn.GELU(), nn.Linear(hidden, head_dim if elementwise else 1))
        nn.init.zeros_(self.query_mlp[-1].weight)
        nn.init.zeros_(self.query_mlp[-1].bias)

    def forward(self, q: torch.Tensor, n: int) -> torch.Tensor:
        logn = torch.full((1, 1), math.log(max(n, 1)), device=q.device, dtype=q.dtype)
        base = self.base_mlp(logn).view(1, self.num_heads, 1, self.head_dim if self.elementwise else 1)
        return q * (base * (1 + torch.tanh(self.query_mlp(q))))


def make_ssmax(kind: str, num_heads: int, dim: int, count: int) -> nn.ModuleList | None:
    """``count`` scalable-softmax modules of ``kind`` (None for "none")."""
    if kind == "none":
        return None
    return nn.ModuleList(QASSMax(num_heads, dim // num_heads, elementwise=kind.endswith("elementwise")) for _ in range(count))


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

    mean: torch.Tensor | None  # (B, 1, F) train column means (None: the model does not standardize cells)
    std: torch.Tensor | None  # (B, 1, F) train column stds
    summaries: list  # per column block: (B*F, M, d) inducing summaries
    kv: list  # per ICL block: (k, v), each (B, H, n_train, head_dim)
    row_mean: torch.Tensor | None  # (B, 1, D) train row-vector mean (None: rows are not standardized)
    row_std: torch.Tensor | None  # (B, 1, D) train row-vector std
    n_train: int  # train rows
    ridge_w: torch.Tensor | None = None  # (B, D, len(icl_ridge) * max_classes) ridge readout weights, if any
    logit_w: torch.Tensor | None = None  # (B, F + 1, len(icl_logistic) * max_classes) logistic readout, if any

    def nbytes(self) -> int:
        ts = [t for t in (self.mean, self.std, self.row_mean, self.row_std) if t is not None]
        ts += [*self.summaries, *(t for kv in self.kv for t in kv)]
        ts += [t for t in (self.ridge_w, self.logit_w) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)


class ColumnEmbedding(nn.Module):
    """Distribution-aware cell embedding: ISAB over each column (train rows induce), then per-cell weight and bias
    (``col_output`` "affine" / "affine_ln_after") or the blocks' output itself ("direct").

    Inputs are columns ``x (S, N, g)``: ``g = col_group_size`` values per cell (1 unless grouped). With
    ``col_target_aware`` the train rows' labels ``y (S, n_train)`` are embedded and added before the blocks.
    """

    def __init__(self, cfg: TabICLConfig) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.output = cfg.col_output
        self.max_classes = cfg.max_classes
        self.lift = nn.Linear(cfg.col_group_size, d)
        self.blocks = nn.ModuleList(
            InducedSetAttentionBlock(d, cfg.col_heads, cfg.col_inducing, mlp_ratio=cfg.mlp_ratio)
            for _ in range(cfg.col_blocks)
        )
        self.ssmax = make_ssmax(cfg.col_ssmax, cfg.col_heads, d, cfg.col_blocks)  # inducing queries only
        self.label_embed = nn.Linear(cfg.max_classes, d) if cfg.col_target_aware else None
        if self.output == "affine":
            self.norm = nn.LayerNorm(d)
        if self.output != "direct":
            self.weight_head = nn.Linear(d, d)
            self.bias_head = nn.Linear(d, d)
        if self.output == "affine_ln_after":
            self.ln_w = nn.LayerNorm(d)
            self.ln_b = nn.LayerNorm(d)

    def _lift(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """``Linear(g, d)`` of the cells, plus the label embedding on the first ``y.shape[1]`` rows (if any)."""
        h = self.lift(x)
        if self.label_embed is not None:
            if y is None:
                raise ValueError("this model's column stage is target-aware: pass the train labels")
            n = y.shape[1]
            h[:, :n] += self.label_embed(nn.functional.one_hot(y, self.max_classes).to(h.dtype))
        return h

    def _induce(self, i: int, h: torch.Tensor) -> torch.Tensor:
        """Block ``i``'s inducing summary ``(S, M, d)`` of train rows ``h (S, n, d)``."""
        blk = self.blocks[i]
        if self.ssmax is None:
            return blk.induce(h)
        ib = blk.induce_block  # the same pre-norm block, with the scalable softmax on its queries
        x = blk.inducing.to(h.dtype)[None].expand(h.shape[0], -1, -1)
        q = self.ssmax[i](ib.attn.project_q(ib.norm1(x)), h.shape[1])
        k, v = ib.attn.project_kv(ib.norm_context(h))
        x = x + ib.attn.merge(ib.attn.attend(q, k, v))
        return x + ib.mlp(ib.norm2(x))

    def _out(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Cell embeddings from cells ``x (.., g)`` and the blocks' output ``h (.., d)``."""
        if self.output == "direct":
            return h
        if self.output == "affine":
            h = self.norm(h)
            return x * self.weight_head(h) + self.bias_head(h)
        return x * self.ln_w(self.weight_head(h)) + self.ln_b(self.bias_head(h))

    def summaries(self, x_SNg: torch.Tensor, n_train: int, y: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Per-block inducing summaries ``(S, M, d)`` of columns ``x (S, N, g)``; reads rows ``[:n_train]``."""
        return self.encode_train(x_SNg[:, :n_train], chunk=max(1, n_train), cells=False, y=y)[0]

    def encode_train(
        self, x_SNg: torch.Tensor, *, chunk: int, cells: bool = True, y: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """One pass over train columns ``x (S, n, g)``: the per-block summaries and (``cells``) the cell embeddings.

        The inducing points of block ``i`` read all rows of block ``i``'s input; the broadcast step and the
        output heads act on each row alone, so they run ``chunk`` rows at a time (bounded working memory). The
        train cells come out of the same pass that builds the summaries (no second pass over the train rows).

        Returns:
            ``(summaries, cells)``: summaries ``[(S, M, d)] * col_blocks``; cells ``(S, n, d)`` or None.
        """
        h = self._lift(x_SNg, y)  # (S, n, d)
        out = []
        last = len(self.blocks) - 1
        for i, blk in enumerate(self.blocks):
            H = self._induce(i, h)  # (S, M, d): inducing points attend to the train rows
            out.append(H)
            if i == last and not cells:
                break  # the last broadcast only feeds the cells
            for s in range(0, h.shape[1], chunk):  # in place: each row's update reads only that row
                h[:, s : s + chunk] = blk.broadcast_block(h[:, s : s + chunk], H)
        if not cells:
            return out, None
        if self.output != "direct":
            for s in range(0, h.shape[1], chunk):
                h[:, s : s + chunk] = self._out(x_SNg[:, s : s + chunk], h[:, s : s + chunk])
        return out, h

    def apply(self, x_SNg: torch.Tensor, summaries: list[torch.Tensor],  # type: ignore[override]
              y: torch.Tensor | None = None) -> torch.Tensor:
        """Cell embeddings ``(S, N, d)`` of any rows given the column summaries (rows are independent); ``y (S, N)``:
        the labels of train rows for a target-aware model (test rows: None)."""
        h = self._lift(x_SNg, y) if y is not None else self.lift(x_SNg)
        for blk, H in zip(self.blocks, summaries):
            h = blk.broadcast_block(h, H)
        return self._out(x_SNg, h)

    def forward(self, x_SNg: torch.Tensor, n_train: int, y: torch.Tensor | None = None) -> torch.Tensor:
        """Cell embeddings ``(S, N, d)`` of columns ``(S, N, g)``; the summaries read rows ``[:n_train]``."""
        h = self._lift(x_SNg, y)
        for i, blk in enumerate(self.blocks):
            h = blk.broadcast_block(h, self._induce(i, h[:, :n_train]))
        return self._out(x_SNg, h)


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
        self.pos_proj = nn.Linear(2 * self.n_pos_freqs, d) if cfg.row_pos_embed else None
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
        if self.pos_proj is not None:
            cells_RFD = cells_RFD + self.position_embedding(F, cells_RFD.device, cells_RFD.dtype)[None]
        tokens = torch.cat([self.cls.to(cells_RFD.dtype)[None].expand(R, -1, -1), cells_RFD], dim=1)  # (R, C+F, d)
        pos = torch.arange(self.n_cls + F, device=cells_RFD.device)
        rope = self.rope(pos, dtype=cells_RFD.dtype)  # (C+F, hd) each
        for blk in self.blocks[:-1]:
            tokens = blk(tokens, rope=rope)
        # Only the CLS outputs of the last block are read: its queries and MLP run on the CLS tokens alone.
        blk, C = self.blocks[-1], self.n_cls
        h = blk.norm1(tokens)
        q = blk.attn.project_q(h[:, :C], rope=(rope[0][:C], rope[1][:C]))
        k, v = blk.attn.project_kv(h, rope=rope)
        x = tokens[:, :C] + blk.attn.merge(blk.attn.attend(q, k, v))
        x = x + blk.mlp(blk.norm2(x))
        return self.norm(x).reshape(R, C * d)


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
        self.ssmax = make_ssmax(cfg.icl_ssmax, cfg.icl_heads, D, cfg.icl_blocks)
        self.standardize = cfg.row_standardize
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

    def _block(self, i: int, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Block ``i`` for rows ``x (B, S, D)`` attending to cached train keys/values ``(B, H, n_train, hd)``."""
        blk = self.blocks[i]
        q = blk.attn.project_q(blk.norm1(x))
        if self.ssmax is not None:
            q = self.ssmax[i](q, k.shape[2])
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
        for i, blk in enumerate(self.blocks):
            k, v = blk.attn.project_kv(blk.norm1(x))
            cache.append((k, v))
            if i == len(self.blocks) - 1:
                break  # the last block's output feeds no later keys
            if chunk >= n:
                x = self._block(i, x, k, v)
            else:
                for s in range(0, n, chunk):  # in place: each row's update reads only that row and k, v
                    x[:, s : s + chunk] = self._block(i, x[:, s : s + chunk], k, v)
        return cache

    def predict(self, rows_test: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Logits ``(B, n_test, max_classes)`` of standardized test rows ``(B, n_test, D)`` given the train cache."""
        x = rows_test
        for i, (k, v) in enumerate(cache):
            x = self._block(i, x, k, v)
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
        if self.standardize:
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
        for i, blk in enumerate(self.blocks):
            k, v = blk.attn.project_kv(blk.norm1(x[:, :n_train]))  # keys/values from train rows only
            x = self._block(i, x, k, v)
        return self.decoder(self.norm(x[:, n_train:]))


class TabICL(nn.Module):
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

    def _col_labels(self, y_train: torch.Tensor, F: int) -> torch.Tensor | None:
        """Train labels per column set ``(B*F, n_train)`` for a target-aware column stage, else None."""
        if self.col.label_embed is None:
            return None
        B, n = y_train.shape
        return y_train[:, None].expand(B, F, n).reshape(B * F, n)

    def _prepare(self, X: torch.Tensor, mean=None, std=None) -> torch.Tensor:
        """Cells the model reads: standardized and clipped with train statistics (``input_standardize``), else
        ``X`` with NaN -> 0 (the published checkpoints expect preprocessed input)."""
        if not self.config.input_standardize:
            return X.nan_to_num(nan=0.0)
        return standardize(X, mean, std, self.config.clip_value)

    def _cells(self, Z: torch.Tensor, n_train: int, y_train: torch.Tensor | None = None) -> torch.Tensor:
        """``(B, N, F)`` standardized (:func:`standardize_columns`) -> cell embeddings ``(B, N, F, d)``."""
        B, N, F = Z.shape
        y = None if y_train is None else self._col_labels(y_train, F)
        E = self.col(self._columns(Z), n_train, y)  # (B*F, N, d): one set per column
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
        if int(y_train.min()) < 0 or int(y_train.max()) >= self.config.max_classes:
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

    # -- inference with a train-side cache ---------------------------------------------------------------
    def _rows_from_cells(self, Z: torch.Tensor, summaries: list, chunk: int, y_train: torch.Tensor | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Standardized ``Z (B, N, F)`` -> row vectors ``(B, N, D)``, ``chunk`` rows at a time (rows independent).
        ``y_train (B, N)``: labels when these are train rows of a target-aware model; ``out``: write into it."""
        B, N, F = Z.shape
        parts = []
        for s in range(0, N, chunk):
            z = Z[:, s : s + chunk]
            n = z.shape[1]
            y = None if y_train is None else self._col_labels(y_train[:, s : s + chunk], F)
            E = self.col.apply(self._columns(z), summaries, y).reshape(B, F, n, -1).permute(0, 2, 1, 3)  # (B, n, F, d)
            r = self.row(E.reshape(B * n, F, -1)).reshape(B, n, -1)
            if out is None:
                parts.append(r)
            else:
                out[:, s : s + n] = r
        return torch.cat(parts, dim=1) if out is None else out

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
        mean, std = column_stats(X_train) if self.config.input_standardize else (None, None)
        Z = self._prepare(X_train, mean, std)
        B, n, F = Z.shape
        logit_w = logit_loo = None
        if self.icl.logistic_alphas:
            logit_w, logit_loo = logistic_readout(Z, y_train, self.icl.logistic_alphas, self.config.max_classes)
        cols = self._columns(Z)
        del Z
        summaries, cells = self.col.encode_train(cols, chunk=chunk, y=self._col_labels(y_train, F))  # (B*F, n, d)
        del cols
        cells = cells.view(B, F, n, -1)
        rows = cells.new_empty(B, n, self.config.icl_dim)
        for s in range(0, n, chunk):
            c = cells[:, :, s : s + chunk]  # (B, F, c, d)
            m = c.shape[2]
            rows[:, s : s + m] = self.row(c.permute(0, 2, 1, 3).reshape(B * m, F, -1)).view(B, m, -1)
        del cells
        row_mean = row_std = None
        if self.icl.standardize:
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
            Z = self._prepare(X_test[:, s : s + chunk], ctx.mean, ctx.std)
            rows = self._rows_from_cells(Z, ctx.summaries, chunk)
            if ctx.row_mean is not None:
                rows = (rows - ctx.row_mean) / ctx.row_std
            if ctx.ridge_w is not None:
                rows = rows + self.icl.ridge_features(rows, ctx.ridge_w)
            if ctx.logit_w is not None:
                rows = rows + self.icl.logit_proj(logistic_scores(Z, ctx.logit_w))
            out.append(self.icl.predict(rows, ctx.kv))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def predict_once(self, X_train: torch.Tensor, y_train: torch.Tensor, X_test: torch.Tensor, *,
                     chunk: int = 2048, memory_budget_mb: float = 2048.0) -> torch.Tensor:
        """Test logits ``(B, n_test, max_classes)`` in one pass with bounded working memory, no train-side cache.

        Equal to ``forward`` (up to float rounding). When the train cells ``(B·F, n, d)`` (with the column pass's
        working copies, about 4 x their size) exceed half of ``memory_budget_mb`` they are never held: the column summaries are built ``F`` columns at a time (as many
        as fit the budget), then every row's cells are recomputed from the summaries ``chunk`` rows at a time and
        go straight into the row stage (the column blocks' broadcast steps run twice over the train rows: time for
        memory). The ICL stage keeps one block's train keys/values at a time, not all of them. Peak memory: the
        cells ``(B, n, F)``, the row vectors ``(B, n + n_test, D)``, one block's keys/values and one chunk.
        """
        if self.icl.ridge_alphas or self.icl.logistic_alphas:
            ctx = self.build_context(X_train, y_train, chunk=chunk)  # the readouts keep their own path
            return self.predict_logits(X_test, ctx, chunk=chunk)
        B, n, F = X_train.shape
        mean, std = column_stats(X_train) if self.config.input_standardize else (None, None)
        Z = self._prepare(X_train, mean, std)
        d, D = self.config.embed_dim, self.config.icl_dim
        cell_bytes = B * F * n * d * X_train.element_size()
        rows = Z.new_empty(B, n, D)
        # The column pass holds the cells, their normalised copy and the inducing keys/values: about 4 x the cells.
        if 4 * cell_bytes <= memory_budget_mb * 2**19:  # that fits half the budget: one pass, cells kept
            summaries, cells = self.col.encode_train(self._columns(Z), chunk=chunk, y=self._col_labels(y_train, F))
            cells = cells.view(B, F, n, -1)
            for s in range(0, n, chunk):
                c = cells[:, :, s : s + chunk]
                m = c.shape[2]
                rows[:, s : s + m] = self.row(c.permute(0, 2, 1, 3).reshape(B * m, F, -1)).view(B, m, -1)
            del cells
        else:
            # A column's hidden cells, their normalised copy and the inducing step's keys and values: 4 x (n, d).
            per_col = 4 * B * n * d * X_train.element_size()
            fc = max(1, int(memory_budget_mb * 2**19 // per_col))
            cols, y_cols = self._columns(Z), self._col_labels(y_train, F)
            cols, y_cols = cols.view(B, F, n, -1), None if y_cols is None else y_cols.view(B, F, n)
            parts = []
            for f in range(0, F, fc):
                x = cols[:, f : f + fc].reshape(-1, n, cols.shape[-1])
                y = None if y_cols is None else y_cols[:, f : f + fc].reshape(-1, n)
                parts.append(self.col.encode_train(x, chunk=chunk, cells=False, y=y)[0])
            summaries = [torch.cat([p[i].view(B, -1, *p[i].shape[1:]) for p in parts], 1).flatten(0, 1)
                         for i in range(len(parts[0]))]
            del cols, parts
            self._rows_from_cells(Z, summaries, chunk, y_train, out=rows)
        del Z
        if self.icl.standardize:
            row_mean, row_std = self.icl.row_stats(rows)
            rows.sub_(row_mean).div_(row_std)
        Zt = self._prepare(X_test, mean, std)
        test = self._rows_from_cells(Zt, summaries, chunk)
        if self.icl.standardize:
            test.sub_(row_mean).div_(row_std)
        x, onehot = rows, nn.functional.one_hot  # the label embedding goes into the train rows in place
        for s in range(0, n, chunk):
            x[:, s : s + chunk] += self.icl.label_embed(onehot(y_train[:, s : s + chunk], self.config.max_classes).to(x.dtype))
        last = len(self.icl.blocks) - 1
        for i, blk in enumerate(self.icl.blocks):
            k, v = blk.attn.project_kv(blk.norm1(x))
            for s in range(0, test.shape[1], chunk):
                test[:, s : s + chunk] = self.icl._block(i, test[:, s : s + chunk], k, v)
            if i < last:
                for s in range(0, n, chunk):
                    x[:, s : s + chunk] = self.icl._block(i, x[:, s : s + chunk], k, v)
            del k, v
        return self.icl.decoder(self.icl.norm(test))
