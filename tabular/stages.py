"""The three stages of :class:`tabular.model.TabICL`: column embedding, row interaction and the ICL transformer.

Layouts as in :mod:`tabular.model`. Every stage reads its sizes and switches from a :class:`tabular.model.TabICLConfig`;
the label embeddings read one-hot classes (classification, ``max_classes > 0``) or the target value itself
(regression, ``max_classes = 0``: :func:`label_features`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from core.layers import MLP, InducedSetAttentionBlock, SelfAttentionBlock
from core.rope import RotaryEmbedding

if TYPE_CHECKING:
    from tabular.model import TabICLConfig

__all__ = ["QASSMax", "make_ssmax", "label_features", "ColumnEmbedding", "RowInteraction", "ICLTransformer"]

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



def label_features(y: torch.Tensor, max_classes: int, dtype: torch.dtype) -> torch.Tensor:
    """What a label embedding reads: one-hot classes ``(..., max_classes)`` of int labels ``y (...)``, or for regression
    (``max_classes = 0``) the target value itself ``(..., 1)``."""
    if max_classes == 0:
        return y.to(dtype).unsqueeze(-1)
    return nn.functional.one_hot(y.long(), max_classes).to(dtype)


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
        self.label_embed = nn.Linear(cfg.max_classes or 1, d) if cfg.col_target_aware else None
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
            h[:, :n] += self.label_embed(label_features(y, self.max_classes, h.dtype))
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

    @staticmethod
    def _views(ys) -> list:
        """The label views of a call: ``[None]`` (no labels), ``[y]`` (one tensor) or the list given."""
        return [ys] if ys is None or torch.is_tensor(ys) else list(ys)

    def encode_train(
        self, x_SNg: torch.Tensor, *, chunk: int, cells: bool = True, y=None
    ) -> tuple[list[list[torch.Tensor]], torch.Tensor | None]:
        """One pass over train columns ``x (S, n, g)``: the per-block summaries and (``cells``) the cell embeddings.

        The inducing points of block ``i`` read all rows of block ``i``'s input; the broadcast step and the
        output heads act on each row alone, so they run ``chunk`` rows at a time (bounded working memory). The
        train cells come out of the same pass that builds the summaries (no second pass over the train rows).

        ``y``: None, the labels ``(S, n)`` of a target-aware stage, or a list of label views (the mixed-radix digits
        of many classes, :mod:`tabular.many_class`): the blocks run once per view and their outputs are averaged
        before the output heads.

        Returns:
            ``(summaries, cells)``: summaries per view ``[[(S, M, d)] * col_blocks] * views``; cells ``(S, n, d)`` or
            None.
        """
        views = self._views(y)
        out, acc = [], None
        last = len(self.blocks) - 1
        for yv in views:
            h = self._lift(x_SNg, yv)  # (S, n, d)
            per_block = []
            for i, blk in enumerate(self.blocks):
                H = self._induce(i, h)  # (S, M, d): inducing points attend to the train rows
                per_block.append(H)
                if i == last and not cells:
                    break  # the last broadcast only feeds the cells
                for s in range(0, h.shape[1], chunk):  # in place: each row's update reads only that row
                    h[:, s : s + chunk] = blk.broadcast_block(h[:, s : s + chunk], H)
            out.append(per_block)
            if cells:
                acc = h if acc is None else acc.add_(h)
            del h
        if not cells:
            return out, None
        if len(views) > 1:
            acc.div_(len(views))
        if self.output != "direct":
            for s in range(0, acc.shape[1], chunk):
                acc[:, s : s + chunk] = self._out(x_SNg[:, s : s + chunk], acc[:, s : s + chunk])
        return out, acc

    def apply(self, x_SNg: torch.Tensor, summaries: list[list[torch.Tensor]],  # type: ignore[override]
              y=None) -> torch.Tensor:
        """Cell embeddings ``(S, N, d)`` of any rows given the column summaries per view (rows are independent);
        ``y``: the labels ``(S, N)`` (or their views) when these are train rows of a target-aware model (test rows:
        None)."""
        ys = self._views(y) if y is not None else [None] * len(summaries)
        acc = None
        for yv, per_block in zip(ys, summaries):
            h = self._lift(x_SNg, yv) if yv is not None else self.lift(x_SNg)
            for blk, H in zip(self.blocks, per_block):
                h = blk.broadcast_block(h, H)
            acc = h if acc is None else acc + h
        if len(summaries) > 1:
            acc = acc / len(summaries)
        return self._out(x_SNg, acc)

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
        self.label_embed = nn.Linear(cfg.max_classes or 1, D)
        self.blocks = nn.ModuleList(
            SelfAttentionBlock(D, cfg.icl_heads, mlp_hidden_dim=cfg.icl_ffn) for _ in range(cfg.icl_blocks)
        )
        self.norm = nn.LayerNorm(D)
        self.decoder = MLP(D, 2 * D, out_dim=cfg.out_dim)  # logits, or quantiles (regression)
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
        """Add the label embedding to train rows ``(B, n_train, D)`` (labels ``(B, n_train)``: classes, or the target
        of a regression model)."""
        return rows_train + self.label_embed(label_features(y_train, self.max_classes, rows_train.dtype))

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
        """Logits ``(B, n_test, max_classes)`` (regression: quantiles ``(B, n_test, num_quantiles)``) of standardized
        test rows ``(B, n_test, D)`` given the train cache."""
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
