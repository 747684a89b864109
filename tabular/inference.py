"""Inference with a train-side context: :class:`TrainContext` and the paths of :class:`tabular.model.TabICL` that
run the train rows once and serve any number of test rows from what they leave.

- :meth:`CachedInference.build_context`: the train rows' column summaries (per label view), column statistics and
  the ICL keys/values of every block (or, with more classes than ``max_classes``, a class hierarchy of contexts);
- :meth:`CachedInference.predict_logits` / :meth:`CachedInference.predict_proba`: test rows against a context
  (chunked; rows are independent, so results do not depend on the chunk);
- :meth:`CachedInference.predict_once`: both in one pass with bounded working memory and no context kept.

Layouts: ``X_train (B, n_train, F)``, ``y_train (B, n_train)`` (int classes, or the standardized target of a
regression model), ``X_test (B, n_test, F)``; outputs ``(B, n_test, max_classes)`` logits or ``(B, n_test,
num_quantiles)`` quantiles.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tabular.many_class import NODE_TEMPERATURE, fit_tree, tree_proba
from tabular.readout import logistic_readout, logistic_scores
from tabular.stages import label_features

__all__ = ["TrainContext", "CachedInference"]


@dataclass(kw_only=True)
class TrainContext:
    """Everything test rows need from the train rows: the train-side cache of repeated predictions."""

    mean: torch.Tensor | None  # (B, 1, F) train column means (None: the model does not standardize cells)
    std: torch.Tensor | None  # (B, 1, F) train column stds
    summaries: list  # per label view (one, or the mixed-radix digits of many classes), per column block:
    # (B*F, M, d) inducing summaries
    kv: list  # per ICL block: (k, v), each (B, H, n_train, head_dim); empty when ``tree`` holds the contexts
    row_mean: torch.Tensor | None  # (B, 1, D) train row-vector mean (None: rows are not standardized)
    row_std: torch.Tensor | None  # (B, 1, D) train row-vector std
    n_train: int  # train rows
    ridge_w: torch.Tensor | None = None  # (B, D, len(icl_ridge) * max_classes) ridge readout weights, if any
    logit_w: torch.Tensor | None = None  # (B, F + 1, len(icl_logistic) * max_classes) logistic readout, if any
    n_classes: int = 0  # distinct labels of the first table (0: regression)
    tree: list | None = None  # per table: its class hierarchy (tabular.many_class.ClassTree) when there are more
    # classes than max_classes; test rows then get probabilities (predict_proba), not logits

    def nbytes(self) -> int:
        ts = [t for t in (self.mean, self.std, self.row_mean, self.row_std) if t is not None]
        ts += [*(t for view in self.summaries for t in view), *(t for kv in self.kv for t in kv)]
        ts += [t for t in (self.ridge_w, self.logit_w) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts) + sum(node.nbytes() for node in self.tree or ())


def _check_chunk(chunk) -> None:
    if not (isinstance(chunk, int) and chunk >= 1):
        raise ValueError(f"chunk must be a positive int, got {chunk!r}")


class CachedInference:
    """The cached inference paths of :class:`tabular.model.TabICL` (a mixin: it uses the model's stages)."""

    def _rows_from_cells(self, Z: torch.Tensor, summaries: list, chunk: int, views: list | None = None,
                         out: torch.Tensor | None = None) -> torch.Tensor:
        """Standardized ``Z (B, N, F)`` -> row vectors ``(B, N, D)``, ``chunk`` rows at a time (rows independent).
        ``views``: label views ``[(B, N)]`` when these are train rows of a target-aware model; ``out``: write into
        it."""
        B, N, F = Z.shape
        parts = []
        for s in range(0, N, chunk):
            z = Z[:, s : s + chunk]
            n = z.shape[1]
            y = None if views is None else self._col_labels([v[:, s : s + chunk] for v in views], F)
            E = self.col.apply(self._columns(z), summaries, y).reshape(B, F, n, -1).permute(0, 2, 1, 3)  # (B, n, F, d)
            r = self.row(E.reshape(B * n, F, -1)).reshape(B, n, -1)
            if out is None:
                parts.append(r)
            else:
                out[:, s : s + n] = r
        return torch.cat(parts, dim=1) if out is None else out

    def _train_rows(self, Z: torch.Tensor, views: list | None, chunk: int) -> tuple[list, torch.Tensor]:
        """Column summaries and row vectors ``(B, n, D)`` of prepared train cells ``Z (B, n, F)`` in one column
        pass (the cells are held: ``(B·F, n, d)``)."""
        B, n, F = Z.shape
        summaries, cells = self.col.encode_train(self._columns(Z), chunk=chunk, y=self._col_labels(views, F))
        cells = cells.view(B, F, n, -1)
        rows = Z.new_empty(B, n, self.config.icl_dim)
        for s in range(0, n, chunk):
            c = cells[:, :, s : s + chunk]  # (B, F, c, d)
            m = c.shape[2]
            rows[:, s : s + m] = self.row(c.permute(0, 2, 1, 3).reshape(B * m, F, -1)).view(B, m, -1)
        return summaries, rows

    @torch.no_grad()
    def build_context(self, X_train: torch.Tensor, y_train: torch.Tensor, *, chunk: int = 4096) -> TrainContext:
        """Run the train rows once: column summaries, column statistics and the ICL keys/values.

        Working memory: the full-width tensors are the column stage's hidden cells ``(B·F, n, d)`` (twice with
        several label views), the row vectors ``(B, n, D)`` and the cached keys/values; everything else (broadcast
        blocks, row interaction, ICL queries and MLPs) runs ``chunk`` rows at a time. Results do not depend on
        ``chunk`` (up to float rounding).

        More classes than ``max_classes`` (published checkpoints, :mod:`tabular.many_class`): the column stage reads
        the labels' mixed-radix digits, and each table gets a class hierarchy whose every node keeps the ICL
        context of its train rows (read with :meth:`predict_proba`).

        Args:
            X_train: ``(B, n_train, F)`` raw train rows (NaN = missing).
            y_train: ``(B, n_train)`` labels (int classes; regression: the standardized target).
            chunk: rows per chunk in the row-wise stages (memory bound).
        """
        _check_chunk(chunk)
        cfg = self.config
        many = self._many_classes(y_train)
        if many and (self.icl.ridge_alphas or self.icl.logistic_alphas or self.icl.standardize):
            raise ValueError(f"more classes than max_classes ({cfg.max_classes}) are handled inside the model only "
                             "for the published architectures (this model has a readout or standardizes row vectors)")
        mean, std = self._column_stats(X_train)
        Z = self._prepare(X_train, mean, std)
        B, n, F = Z.shape
        logit_w = logit_loo = None
        if self.icl.logistic_alphas:
            logit_w, logit_loo = logistic_readout(Z, y_train, self.icl.logistic_alphas, cfg.max_classes)
        summaries, rows = self._train_rows(Z, self._label_views(y_train), chunk)
        del Z
        row_mean = row_std = None
        if self.icl.standardize:
            row_mean, row_std = self.icl.row_stats(rows)
            rows.sub_(row_mean).div_(row_std)
        ridge_w = loo = None
        if self.icl.ridge_alphas:
            ridge_w, loo = self.icl.ridge_fit(rows, y_train, chunk=chunk)
        n_classes = 0 if cfg.regression else len(torch.unique(y_train[0]))
        tree, kv = None, []
        if many:
            tree = [fit_tree(self.icl, rows[b], y_train[b], cfg.max_classes, chunk=chunk) for b in range(B)]
        else:
            kv = self.icl.context(rows, y_train, chunk=chunk, ridge_loo=loo, logit_loo=logit_loo)
        return TrainContext(mean=mean, std=std, summaries=summaries, kv=kv, row_mean=row_mean, row_std=row_std,
                            n_train=n, ridge_w=ridge_w, logit_w=logit_w, n_classes=n_classes, tree=tree)

    def _test_rows(self, X_test: torch.Tensor, ctx: TrainContext, chunk: int):
        """``(Z, rows)`` of a chunk of raw test rows: prepared cells and the ICL stage's input."""
        Z = self._prepare(X_test, ctx.mean, ctx.std)
        rows = self._rows_from_cells(Z, ctx.summaries, chunk)
        if ctx.row_mean is not None:
            rows = (rows - ctx.row_mean) / ctx.row_std
        if ctx.ridge_w is not None:
            rows = rows + self.icl.ridge_features(rows, ctx.ridge_w)
        if ctx.logit_w is not None:
            rows = rows + self.icl.logit_proj(logistic_scores(Z, ctx.logit_w))
        return Z, rows

    @torch.no_grad()
    def predict_logits(self, X_test: torch.Tensor, ctx: TrainContext, *, chunk: int = 4096) -> torch.Tensor:
        """Logits ``(B, n_test, max_classes)`` (regression: quantiles ``(B, n_test, num_quantiles)``) of raw test
        rows ``(B, n_test, F)`` against a train context, ``chunk`` test rows at a time (test rows are independent,
        so the result does not depend on ``chunk``). A many-class context has no logits: :meth:`predict_proba`."""
        _check_chunk(chunk)
        if ctx.tree is not None:
            raise ValueError(f"this context holds {ctx.n_classes} classes, more than the decoder's "
                             f"{self.config.max_classes}: read it with predict_proba")
        out = []
        for s in range(0, X_test.shape[1], chunk):
            out.append(self.icl.predict(self._test_rows(X_test[:, s : s + chunk], ctx, chunk)[1], ctx.kv))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def predict_proba(self, X_test: torch.Tensor, ctx: TrainContext, *, temperature: float = NODE_TEMPERATURE,
                      chunk: int = 4096) -> torch.Tensor:
        """Class probabilities ``(B, n_test, n_classes)`` of raw test rows against a train context: the softmax
        of the first ``n_classes`` logits at ``temperature``, or with more classes than ``max_classes`` the
        hierarchy's products of node softmaxes (every node at ``temperature``)."""
        _check_chunk(chunk)
        if self.config.regression:
            raise ValueError("a regression model predicts quantiles (predict_logits), not class probabilities")
        if ctx.tree is None:
            logits = self.predict_logits(X_test, ctx, chunk=chunk)[..., : ctx.n_classes]
            return torch.softmax(logits / temperature, dim=-1)
        out = []
        for s in range(0, X_test.shape[1], chunk):
            rows = self._test_rows(X_test[:, s : s + chunk], ctx, chunk)[1]
            out.append(torch.stack([tree_proba(self.icl, node, rows[b], ctx.n_classes, temperature)
                                    for b, node in enumerate(ctx.tree)]))
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def predict_once(self, X_train: torch.Tensor, y_train: torch.Tensor, X_test: torch.Tensor, *,
                     chunk: int = 2048, memory_budget_mb: float = 2048.0) -> torch.Tensor:
        """Test logits ``(B, n_test, max_classes)`` (regression: quantiles) in one pass with bounded working memory,
        no train-side cache.

        Equal to ``forward`` (up to float rounding). When the train cells ``(B·F, n, d)`` (with the column pass's
        working copies, about 4 x their size) exceed half of ``memory_budget_mb`` they are never held: the column
        summaries are built ``F`` columns at a time (as many as fit the budget), then every row's cells are
        recomputed from the summaries ``chunk`` rows at a time and go straight into the row stage (the column
        blocks' broadcast steps run twice over the train rows: time for memory). The ICL stage keeps one block's
        train keys/values at a time, not all of them. Peak memory: the cells ``(B, n, F)``, the row vectors
        ``(B, n + n_test, D)``, one block's keys/values and one chunk. More classes than ``max_classes``:
        :meth:`build_context` and :meth:`predict_proba`.
        """
        if self._many_classes(y_train):
            raise ValueError(f"more classes than max_classes ({self.config.max_classes}) have probabilities, not "
                             "logits: use build_context and predict_proba")
        if self.icl.ridge_alphas or self.icl.logistic_alphas:
            ctx = self.build_context(X_train, y_train, chunk=chunk)  # the readouts keep their own path
            return self.predict_logits(X_test, ctx, chunk=chunk)
        B, n, F = X_train.shape
        mean, std = self._column_stats(X_train)
        Z = self._prepare(X_train, mean, std)
        d = self.config.embed_dim
        views = self._label_views(y_train)
        cell_bytes = B * F * n * d * X_train.element_size()
        # The column pass holds the cells, their normalised copy and the inducing keys/values: about 4 x the cells.
        if 4 * cell_bytes <= memory_budget_mb * 2**19:  # that fits half the budget: one pass, cells kept
            summaries, rows = self._train_rows(Z, views, chunk)
        else:
            rows = Z.new_empty(B, n, self.config.icl_dim)
            # A column's hidden cells, their normalised copy and the inducing step's keys and values: 4 x (n, d).
            per_col = 4 * B * n * d * X_train.element_size()
            fc = max(1, int(memory_budget_mb * 2**19 // per_col))
            cols, y_cols = self._columns(Z), self._col_labels(views, F)
            cols = cols.view(B, F, n, -1)
            y_cols = None if y_cols is None else [y.view(B, F, n) for y in y_cols]
            parts = []
            for f in range(0, F, fc):
                x = cols[:, f : f + fc].reshape(-1, n, cols.shape[-1])
                y = None if y_cols is None else [yc[:, f : f + fc].reshape(-1, n) for yc in y_cols]
                parts.append(self.col.encode_train(x, chunk=chunk, cells=False, y=y)[0])
            summaries = [[torch.cat([p[v][i].view(B, -1, *p[v][i].shape[1:]) for p in parts], 1).flatten(0, 1)
                          for i in range(len(parts[0][v]))] for v in range(len(parts[0]))]
            del cols, parts
            self._rows_from_cells(Z, summaries, chunk, views, out=rows)
        del Z
        if self.icl.standardize:
            row_mean, row_std = self.icl.row_stats(rows)
            rows.sub_(row_mean).div_(row_std)
        Zt = self._prepare(X_test, mean, std)
        test = self._rows_from_cells(Zt, summaries, chunk)
        if self.icl.standardize:
            test.sub_(row_mean).div_(row_std)
        x = rows  # the label embedding goes into the train rows in place
        for s in range(0, n, chunk):
            x[:, s : s + chunk] += self.icl.label_embed(label_features(y_train[:, s : s + chunk], self.config.max_classes,
                                                                       x.dtype))
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

