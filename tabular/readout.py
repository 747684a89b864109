"""In-context logistic readout: L2-penalised logistic regression of the labels on a table's standardized cells,
fitted inside the forward pass.

Used by :class:`tabular.model.TabICL` when its config has ``icl_logistic`` penalties (an addition to the published
design). Per table, per penalty and per class present among the train labels, a one-vs-rest logistic regression
with an unpenalised intercept is fitted by Newton's method on the train rows' standardized cells (the model's own
input: train-row column statistics, NaN -> 0, clipped). Test rows get the fitted logits; train rows get their
approximate leave-one-out logits (Rad & Maleki's ALO for penalised GLMs), so a train row never sees its own label
through the readout and train and test rows carry features of the same kind. The readout has no learned
parameters: it depends on the cells and labels only, so it is computed without gradients.

Cost per table: ``iters`` Newton steps, each a ``(F + 1) × (F + 1)`` system per penalty and class, built in
``chunk`` rows at a time (time linear in rows, float64 working memory ``O(P·C·F²)`` plus one chunk).
"""

from __future__ import annotations

import torch

__all__ = ["logistic_readout", "logistic_scores"]

_INTERCEPT_PENALTY = 1e-3  # keeps the Newton system positive definite when a class is separable by the intercept


def _design(Z: torch.Tensor) -> torch.Tensor:
    """Cells ``(B, n, F)`` -> float64 design with an intercept column ``(B, n, F + 1)``."""
    return torch.cat([Z.double(), Z.new_ones(*Z.shape[:2], 1, dtype=torch.float64)], dim=2)


@torch.no_grad()
def logistic_readout(
    Z_train: torch.Tensor, y_train: torch.Tensor, penalties: tuple[float, ...], n_classes: int, *,
    iters: int = 8, chunk: int = 256, clip: float = 8.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit the readout on train cells and return its weights and the train rows' leave-one-out logits.

    Args:
        Z_train: ``(B, n, F)`` standardized train cells (finite).
        y_train: ``(B, n)`` int64 labels in ``[0, n_classes)``.
        penalties: ``α`` values; the penalty of ``α`` on the weights is ``α · n · |w|² / 2`` (the cells are
            standardized, so ``α`` is relative to the data's own curvature; scikit-learn's default ``C = 1`` is
            ``α = 1 / n``).
        n_classes: logit columns per penalty (the model's ``max_classes``).
        iters: Newton steps from ``w = 0``.
        chunk: rows per chunk when building the Newton systems.
        clip: logits are clipped to ``[-clip, clip]``.

    Returns:
        ``W (B, F + 1, P·C)`` (intercept in the last row; columns penalty-major, ``C = n_classes``) and the
        leave-one-out logits ``(B, n, P·C)``, both in ``Z_train``'s dtype. Columns of classes absent from a
        table's train labels are zero.
    """
    if Z_train.dim() != 3 or y_train.shape != Z_train.shape[:2]:
        raise ValueError(f"need Z_train (B, n, F) and y_train (B, n), got {tuple(Z_train.shape)} and {tuple(y_train.shape)}")
    B, n, F = Z_train.shape
    P, C = len(penalties), n_classes
    c_used = int(y_train.max()) + 1  # fit only the classes some table has; the rest stay zero
    A = _design(Z_train)  # (B, n, F1)
    F1 = F + 1
    T = torch.nn.functional.one_hot(y_train, c_used).double()  # (B, n, c)
    present = T.sum(1) > 0  # (B, c)
    T = torch.where(present[:, None, :], T, 0.5)  # an absent class gets a flat target: its fit stays at w = 0
    lam = torch.tensor([a * n for a in penalties], dtype=torch.float64, device=Z_train.device)  # (P,)
    pen = lam.view(P, 1, 1).expand(P, 1, F1).clone()
    pen[..., -1] = _INTERCEPT_PENALTY
    pen = pen.view(1, P, 1, F1)  # diagonal of the penalty, per penalty
    w = A.new_zeros(B, P, c_used, F1)

    def systems(w: torch.Tensor, want_grad: bool = True):
        """Gradient ``(B, P, c, F1)`` and Hessian ``(B, P, c, F1, F1)`` of the penalised loss at ``w``."""
        g = torch.zeros_like(w)
        H = A.new_zeros(B, P, c_used, F1, F1)
        for s in range(0, n, chunk):
            a = A[:, s : s + chunk]  # (B, m, F1)
            eta = torch.einsum("bmf,bpcf->bpcm", a, w).clamp(-30, 30)
            p = torch.sigmoid(eta)
            if want_grad:
                g += torch.einsum("bmf,bpcm->bpcf", a, p - T[:, s : s + chunk].permute(0, 2, 1)[:, None])
            sa = (p * (1 - p)).unsqueeze(-1) * a[:, None, None]  # (B, P, c, m, F1)
            H += sa.transpose(-1, -2) @ a[:, None, None]
        g += pen * w
        H += torch.diag_embed(pen.expand_as(w))
        return g, H

    for _ in range(iters):
        g, H = systems(w)
        w = w - torch.linalg.solve(H, g.unsqueeze(-1)).squeeze(-1)
    _, H = systems(w, want_grad=False)
    Hinv = torch.cholesky_inverse(torch.linalg.cholesky(H))  # (B, P, c, F1, F1)
    loo = []
    for s in range(0, n, chunk):
        a = A[:, s : s + chunk]
        eta = torch.einsum("bmf,bpcf->bpcm", a, w)
        p = torch.sigmoid(eta.clamp(-30, 30))
        q = ((a[:, None, None] @ Hinv) * a[:, None, None]).sum(-1)  # x' H^-1 x, (B, P, c, m)
        t = T[:, s : s + chunk].permute(0, 2, 1)[:, None]
        loo.append(eta + q * (p - t) / (1 - q * p * (1 - p)).clamp_min(1e-6))  # ALO: leave row i out
    loo = torch.cat(loo, dim=-1)  # (B, P, c, n)
    keep = present.view(B, 1, c_used, 1).double()
    w = w * keep
    loo = (loo * keep).clamp(-clip, clip)
    W = A.new_zeros(B, F1, P, C)
    W[..., :c_used] = w.permute(0, 3, 1, 2)
    L = A.new_zeros(B, n, P, C)
    L[..., :c_used] = loo.permute(0, 3, 1, 2)
    return W.reshape(B, F1, P * C).to(Z_train.dtype), L.reshape(B, n, P * C).to(Z_train.dtype)


def logistic_scores(Z: torch.Tensor, W: torch.Tensor, *, clip: float = 8.0) -> torch.Tensor:
    """The readout's logits ``(B, S, P·C)`` for standardized cells ``(B, S, F)`` and weights from
    :func:`logistic_readout`, clipped to ``[-clip, clip]``."""
    return (Z @ W[:, :-1] + W[:, -1:]).clamp(-clip, clip)
