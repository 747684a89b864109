"""Per-table fine-tuning of a TabICL model: gradient steps on the in-context loss of a table's own train rows.

``TabICLClassifier(finetune_steps=N)`` calls :func:`finetune` at ``fit``. Each step draws a stratified subset of
at most ``ROWS`` train rows, splits every class into context (70%) and queries (30%, never a class's last row),
and minimises the cross-entropy of the queries given the context — the pretraining objective, on this table.
With a ``score`` function (the estimator's holdout log-loss) the weights are scored at step 0 and every
``EVAL_EVERY`` steps, and the best-scoring ones are kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

__all__ = ["finetune", "row_bytes", "rows_for_budget", "FinetuneResult", "ROWS", "MIN_ROWS", "RESERVE_MB", "QUERY",
           "VIEWS", "CLIP", "EVAL_EVERY"]

ROWS = 1024  # at most this many train rows (stratified draw) make up one step's table
MIN_ROWS = 64  # a memory budget never shrinks a step's table below this
RESERVE_MB = 256  # part of a memory budget kept for what does not grow with rows (model copy, optimizer state)
QUERY = 0.3  # share of a step's rows that are queries (the rest is the context)
VIEWS = 2  # ensemble views per step (tables in one batch)
CLIP = 1.0  # gradient-norm clip
EVAL_EVERY = 20  # steps between scores (when a score function is given)


@dataclass
class FinetuneResult:
    losses: list = field(default_factory=list)  # in-context loss of every step
    evals: list = field(default_factory=list)  # (step, score) pairs; step 0 = the weights passed in
    best_step: int | None = None  # the step whose weights were kept (None: the last, no scoring)
    rows_per_step: int = 0  # most rows of one step's table


def row_bytes(embed_dim: int, n_features: int) -> int:
    """Bytes one row of one view holds during a training step (forward activations kept for the backward pass,
    and their gradients): ``4 · embed_dim · (100 · n_features + 2000)``. Conservative against the growth of peak
    RSS over a first 1,024-row step of two views (``python -m benchmarks.tabular_finetune_memory``): small model
    (embed 32) 291, 551, 1,003 KB per row at 20, 50, 100 features against 500, 875, 1,500 KB from the formula;
    medium model (embed 64, 6 ICL blocks) 508, 1,082, 1,671 KB against 1,000, 1,750, 3,000 KB."""
    return 4 * int(embed_dim) * (100 * int(n_features) + 2000)


def rows_for_budget(budget_mb: float, embed_dim: int, n_features: int) -> int:
    """Most rows of one step's table (``VIEWS`` views) whose activations fit in ``budget_mb`` less ``RESERVE_MB``
    (or half of it, if larger), by :func:`row_bytes`; never below ``MIN_ROWS`` (logged) nor above ``ROWS``."""
    usable = max(budget_mb / 2, budget_mb - RESERVE_MB) * 2**20
    rows = int(usable // (VIEWS * row_bytes(embed_dim, n_features)))
    if rows < MIN_ROWS:
        logger.warning("a memory budget of %s MB allows %d rows per fine-tuning step for %d features; using %d",
                       budget_mb, rows, n_features, MIN_ROWS)
        return MIN_ROWS
    return min(ROWS, rows)


def _queries(n: int) -> int:
    """Query rows drawn from a class with ``n`` rows in a step (its last row always stays in context)."""
    return min(int(round(QUERY * n)), n - 1)


def finetune(
    model: torch.nn.Module,
    labels: np.ndarray,
    rows: np.ndarray,
    make_batch: Callable[[np.ndarray, np.ndarray, np.random.Generator], tuple[torch.Tensor, torch.Tensor]],
    *,
    n_classes: int,
    steps: int,
    lr: float,
    seed,
    score: Callable[[torch.nn.Module], float] | None = None,
    max_rows: int = ROWS,
    verbose: bool = False,
) -> FinetuneResult | None:
    """Fine-tune ``model`` in place on train rows ``rows``; returns None (model untouched) when the rows leave no
    query row (every class has a single row).

    Args:
        model: the model to adapt (pass a copy to keep the original); returned in eval mode.
        labels: ``(n_train,)`` labels in ``[0, n_classes)`` of every train row (indexed by ``rows``).
        rows: indices of the train rows fine-tuning may use.
        make_batch: ``(order, labels[order], rng) -> (X (B, N, F), y (B, N))``: the step's tables — ``order``
            lists the context rows then the query rows — as the model reads them (views, shifted labels).
        n_classes: classes the loss ranges over (the first logits).
        steps, lr: AdamW steps (no weight decay, gradient norm clipped at ``CLIP``) and learning rate.
        seed: seed of the row draws.
        score: lower is better; called with the model in eval mode at step 0, every ``EVAL_EVERY`` steps and
            after the last; the best-scoring weights are restored at the end.
        max_rows: most rows of one step's table (a memory bound, see :func:`rows_for_budget`); at most ``ROWS``.
        verbose: a progress bar of the steps (mean loss of the last 10, best holdout score) on standard error.
    """
    rng = np.random.default_rng(seed)
    y = labels[rows]
    by_class = [rows[y == c] for c in range(n_classes)]
    if sum(_queries(len(r)) for r in by_class if len(r)) < 1:
        return None
    out, best = FinetuneResult(rows_per_step=min(ROWS, int(max_rows), len(rows))), None
    take = out.rows_per_step / len(rows)  # share of each class drawn per step (< 1 on large tables)
    opt = torch.optim.AdamW(model.parameters(), lr=float(lr), weight_decay=0.0)

    def evaluate(step: int) -> None:
        nonlocal best
        model.eval()
        with torch.no_grad():
            value = float(score(model))
        out.evals.append((step, value))
        if best is None or value < best[1]:
            best = (step, value, {k: v.detach().clone() for k, v in model.state_dict().items()})

    if score is not None:
        evaluate(0)
    bar = tqdm(total=int(steps), desc="TabICL fine-tuning", unit="step", disable=not verbose)
    for step in range(int(steps)):
        model.train()
        ctx, qry = [], []
        for r in by_class:
            n = len(r) if take == 1.0 else min(len(r), max(2, int(round(take * len(r)))))
            drawn = rng.permutation(r)[:n]
            nq = _queries(n) if n else 0
            qry.append(drawn[:nq])
            ctx.append(drawn[nq:])
        ctx, qry = np.concatenate(ctx), np.concatenate(qry)
        order = np.concatenate([ctx, qry])
        xs, ys = make_batch(order, labels[order], rng)
        with torch.enable_grad():
            logits = model(xs, ys[:, : len(ctx)])[..., :n_classes]
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, n_classes), ys[:, len(ctx) :].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        out.losses.append(loss.item())
        bar.update(1)
        if score is not None and ((step + 1) % EVAL_EVERY == 0 or step + 1 == steps):
            evaluate(step + 1)
        if verbose:
            held = f", best holdout {min(v for _, v in out.evals):.4f}" if out.evals else ""
            bar.set_postfix_str(f"loss {np.mean(out.losses[-10:]):.4f}{held}", refresh=False)
    bar.close()
    if best is not None:
        model.load_state_dict(best[2])
        out.best_step = best[0]
    model.eval()
    return out
