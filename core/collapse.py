"""Neural collapse: the simplex ETF, regularizers that pull class features towards it, and collapse metrics.

Model-agnostic: everything takes features ``h_ND`` (N examples, D dims) and integer labels ``y_N`` in
``[0, K)``.

- :func:`simplex_etf`: K unit vectors in D ≥ K−1 dims with pairwise cosine −1/(K−1).
- :func:`tc_loss` (Text-modality Collapse, NCAL): cap ‖h‖ ≤ 1, then the mean over pairs of examples of different
  classes of ``(hᵢᵀhⱼ + 1/(K−1))²``. Pairs are the batch with itself and with a :class:`FeatureBank` of recent
  (detached) features, so pairs are not limited to one micro-batch (the published code paired within a batch
  only, which at batch size 1–4 and a long tail rarely sees a tail class twice).
- :class:`ETFClassifier` + :func:`dot_regression_loss`: the fixed ETF classifier with the dot-regression loss
  (Yang et al. 2022, "Inducing neural collapse in imbalanced learning").
- Metrics: :func:`nc1` (within-class variability relative to between-class, ``tr(Σ_W Σ_B⁺)/K``), :func:`nc2`
  (Frobenius distance between the normalised Gram of the centred, unit class means and the ETF's), and
  :func:`class_mean_cosines` (the matrix a UI shows beside :func:`etf_gram`).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)

__all__ = [
    "simplex_etf",
    "etf_gram",
    "cap_norm",
    "tc_loss",
    "FeatureBank",
    "ETFClassifier",
    "dot_regression_loss",
    "class_means",
    "class_mean_cosines",
    "nc1",
    "nc2",
    "mean_offdiag_cosine",
]


def _check_labels(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int) -> None:
    if h_ND.ndim != 2:
        raise ValueError(f"features must be (N, D), got shape {tuple(h_ND.shape)}")
    if y_N.shape != (h_ND.shape[0],):
        raise ValueError(f"labels must be (N,) = ({h_ND.shape[0]},), got shape {tuple(y_N.shape)}")
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    if y_N.numel() and (int(y_N.min()) < 0 or int(y_N.max()) >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{int(y_N.min())}, {int(y_N.max())}]")


def etf_gram(num_classes: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """The ETF's Gram matrix ``(K, K)``: 1 on the diagonal, −1/(K−1) elsewhere."""
    K = num_classes
    if K < 2:
        raise ValueError(f"num_classes must be at least 2, got {K}")
    return (torch.eye(K, device=device, dtype=dtype) * K - 1) / (K - 1)


def simplex_etf(num_classes: int, dim: int, *, generator: torch.Generator | None = None, device=None,
                dtype=torch.float32) -> torch.Tensor:
    """A simplex equiangular tight frame: ``(K, D)`` unit rows with ``wᵢᵀwⱼ = −1/(K−1)`` for ``i ≠ j``.

    Built in float64 from the centred identity ``I − 11ᵀ/K`` (whose rows span a (K−1)-dim space), expressed in
    an orthonormal basis of that space, then rotated into ``D`` dims by a random orthonormal map (``generator``
    fixes it). Needs ``D ≥ K − 1``.
    """
    K, D = num_classes, dim
    if K < 2:
        raise ValueError(f"num_classes must be at least 2, got {K}")
    if D < K - 1:
        raise ValueError(f"dim ({D}) must be at least num_classes - 1 ({K - 1}) for a simplex ETF")
    C_KK = torch.eye(K, dtype=torch.float64) - 1.0 / K
    evals, evecs = torch.linalg.eigh(C_KK)  # eigenvalues 0 (once) and 1 (K-1 times), ascending
    B_KR = evecs[:, 1:]  # orthonormal basis of the centred space, R = K-1
    coords_KR = C_KK @ B_KR  # the centred one-hot vectors in that basis
    coords_KR = coords_KR / coords_KR.norm(dim=1, keepdim=True)
    g = torch.randn(D, K - 1, generator=generator, dtype=torch.float64)
    Q_DR, _ = torch.linalg.qr(g)  # orthonormal columns
    W_KD = coords_KR @ Q_DR.T
    return W_KD.to(device=device, dtype=dtype)


def cap_norm(h_ND: torch.Tensor, max_norm: float = 1.0, eps: float = 1e-12) -> torch.Tensor:
    """Scale each row down to norm ``max_norm`` when it is longer (shorter rows are unchanged)."""
    n_N1 = h_ND.norm(dim=-1, keepdim=True).clamp_min(eps)
    return h_ND * (max_norm / n_N1).clamp(max=1.0)


def tc_loss(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int, *, bank_h_MD: torch.Tensor | None = None,
            bank_y_M: torch.Tensor | None = None, max_norm: float = 1.0) -> torch.Tensor:
    """Text-modality Collapse loss: mean over pairs of different classes of ``(hᵢᵀhⱼ + 1/(K−1))²``.

    Args:
        h_ND: features of the current batch (gradient flows into them).
        y_N: their labels in ``[0, K)``.
        num_classes: K.
        bank_h_MD, bank_y_M: optional earlier features (treated as constants) and labels; pairs are
            (batch, batch) with ``i < j`` and (batch, bank).
        max_norm: the norm cap applied to every feature (1 in NCAL). Bank features are capped too.

    Returns:
        A scalar; 0 (still attached to ``h_ND``) when there is no pair of different classes.
    """
    _check_labels(h_ND, y_N, num_classes)
    offset = 1.0 / (num_classes - 1)  # the ETF cosine is -offset
    h = cap_norm(h_ND, max_norm)
    dots_NN = h @ h.T
    diff_NN = (y_N[:, None] != y_N[None, :]) & torch.triu(torch.ones_like(dots_NN, dtype=torch.bool), diagonal=1)
    total = ((dots_NN + offset) ** 2 * diff_NN).sum()
    count = diff_NN.sum()
    if bank_h_MD is not None and bank_h_MD.shape[0] > 0:
        if bank_y_M is None or bank_y_M.shape != (bank_h_MD.shape[0],):
            raise ValueError("bank_y_M must give one label per bank feature")
        b = cap_norm(bank_h_MD.detach().to(h.dtype), max_norm)
        dots_NM = h @ b.T
        diff_NM = y_N[:, None] != bank_y_M[None, :].to(y_N.device)
        total = total + ((dots_NM + offset) ** 2 * diff_NM).sum()
        count = count + diff_NM.sum()
    return total / count.clamp_min(1) if int(count) else h_ND.sum() * 0.0


class FeatureBank(nn.Module):
    """Ring buffer of the ``size`` most recent detached features and labels (buffers: saved with the model
    state, so a resumed run continues with the same bank).

    Args:
        size: features kept (0 disables the bank).
        dim: feature width.
    """

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        if size < 0:
            raise ValueError(f"bank size must be >= 0, got {size}")
        self.size = int(size)
        self.register_buffer("h_MD", torch.zeros(size, dim))
        self.register_buffer("y_M", torch.zeros(size, dtype=torch.long))
        self.register_buffer("count", torch.zeros((), dtype=torch.long))  # features written so far (the last `size` of each push)

    @torch.no_grad()
    def push(self, h_ND: torch.Tensor, y_N: torch.Tensor) -> None:
        if self.size == 0:
            return
        h_ND, y_N = h_ND.detach()[-self.size:], y_N.detach()[-self.size:]
        n = h_ND.shape[0]
        start = int(self.count) % self.size
        idx = (torch.arange(n, device=self.h_MD.device) + start) % self.size
        self.h_MD[idx] = h_ND.to(self.h_MD.dtype)
        self.y_M[idx] = y_N.to(self.y_M.device)
        self.count += n

    def get(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(features (M, D), labels (M,))`` currently held, M ≤ size."""
        m = min(int(self.count), self.size)
        return self.h_MD[:m], self.y_M[:m]


class ETFClassifier(nn.Module):
    """Fixed simplex-ETF classifier: logits ``scale · ĥ Wᵀ`` with ĥ the unit feature and W a frozen ETF.

    Args:
        dim: feature width (≥ K−1).
        num_classes: K.
        scale: logit temperature for probabilities (the ranking does not depend on it).
        seed: fixes the ETF's rotation.
    """

    def __init__(self, dim: int, num_classes: int, *, scale: float = 10.0, seed: int = 0) -> None:
        super().__init__()
        self.scale = float(scale)
        self.register_buffer("W_KD", simplex_etf(num_classes, dim, generator=torch.Generator().manual_seed(seed)))

    def forward(self, h_ND: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(h_ND, dim=-1) @ self.W_KD.to(h_ND.dtype).T


def dot_regression_loss(h_ND: torch.Tensor, y_N: torch.Tensor, W_KD: torch.Tensor) -> torch.Tensor:
    """Dot-regression loss (Yang et al. 2022): mean of ``½ (w_yᵀ ĥ − 1)²`` with ĥ the unit feature and w_y the
    (unit) ETF vector of the label."""
    _check_labels(h_ND, y_N, W_KD.shape[0])
    cos_N = (F.normalize(h_ND, dim=-1) * W_KD[y_N].to(h_ND.dtype)).sum(-1)
    return 0.5 * ((cos_N - 1.0) ** 2).mean()


def class_means(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(means (K, D), counts (K,))``; a class without examples has a zero mean and count 0."""
    _check_labels(h_ND, y_N, num_classes)
    counts_K = torch.bincount(y_N, minlength=num_classes).to(h_ND.dtype)
    sums_KD = torch.zeros(num_classes, h_ND.shape[1], dtype=h_ND.dtype, device=h_ND.device).index_add_(0, y_N, h_ND)
    return sums_KD / counts_K.clamp_min(1)[:, None], counts_K


def class_mean_cosines(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int, *, centre: bool = True) -> torch.Tensor:
    """Cosines ``(K, K)`` between class means centred on the mean of the class means (NaN rows for absent classes).

    ``centre=False``: cosines of the raw class means, the quantity TC pulls to −1/(K−1) (centred means of equal
    norm always average −1/(K−1) off the diagonal, so only their spread is informative)."""
    mu_KD, counts_K = class_means(h_ND.double(), y_N, num_classes)
    present = counts_K > 0
    c_KD = mu_KD - mu_KD[present].mean(0) if centre else mu_KD
    u_KD = F.normalize(c_KD, dim=-1)
    cos_KK = u_KD @ u_KD.T
    cos_KK[~present] = float("nan")
    cos_KK[:, ~present] = float("nan")
    return cos_KK


def nc1(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int) -> float:
    """NC1 = ``tr(Σ_W Σ_B⁺) / K'`` over the K' classes present (Papyan et al. 2020); 0 at full collapse.

    Σ_W: mean over examples of the outer product of (h − μ_y); Σ_B: mean over classes of (μ_k − μ_G)(μ_k − μ_G)ᵀ,
    μ_G the mean of the class means. Computed in float64.
    """
    h = h_ND.detach().double()
    mu_KD, counts_K = class_means(h, y_N, num_classes)
    present = counts_K > 0
    if int(present.sum()) < 2:
        raise ValueError("NC1 needs examples of at least 2 classes")
    w_ND = h - mu_KD[y_N]
    sw_DD = w_ND.T @ w_ND / h.shape[0]
    c_KD = mu_KD[present] - mu_KD[present].mean(0)
    sb_DD = c_KD.T @ c_KD / c_KD.shape[0]
    return float(torch.trace(sw_DD @ torch.linalg.pinv(sb_DD, hermitian=True)) / c_KD.shape[0])


def mean_offdiag_cosine(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int) -> float:
    """Mean cosine between the raw (uncentred) means of different classes present; −1/(K−1) at a simplex ETF."""
    cos_KK = class_mean_cosines(h_ND.detach(), y_N, num_classes, centre=False)
    present = ~torch.isnan(cos_KK.diagonal())
    G = cos_KK[present][:, present]
    k = G.shape[0]
    if k < 2:
        raise ValueError("needs examples of at least 2 classes")
    return float((G.sum() - G.diagonal().sum()) / (k * (k - 1)))


def nc2(h_ND: torch.Tensor, y_N: torch.Tensor, num_classes: int) -> float:
    """NC2 = ‖G/‖G‖_F − G_ETF/‖G_ETF‖_F‖_F with G the Gram of the centred, unit class means (classes present
    only, ETF of that many classes); 0 when the class means form a simplex ETF."""
    cos_KK = class_mean_cosines(h_ND.detach(), y_N, num_classes)
    present = ~torch.isnan(cos_KK.diagonal())
    k = int(present.sum())
    if k < 2:
        raise ValueError("NC2 needs examples of at least 2 classes")
    G = cos_KK[present][:, present]
    E = etf_gram(k, dtype=G.dtype)
    return float((G / G.norm() - E / E.norm()).norm())

