"""Basis functions over time and the ridge fit of a sequence onto them (the signal half of
:mod:`core.continuous`).

``L`` vectors at positions ``t_i`` in ``[0, 1]`` become ``N`` coefficients per feature: ``F[j, i] = psi_j(t_i)``,
``B^T = X^T F^T (F F^T + lambda I)^-1``; :func:`evaluate_signal` reads ``x(t) = B^T psi(t)`` back and
:func:`trapezoid_grid` gives the integration points and weights continuous attention uses.
"""

from __future__ import annotations

import torch

__all__ = ["BoxBasis", "GaussianBasis", "make_basis", "BASIS_KINDS", "ridge_fit", "evaluate_signal", "trapezoid_grid"]


def _check_positions(t: torch.Tensor) -> None:
    if t.dim() != 1:
        raise ValueError(f"positions must be a 1-D tensor, got shape {tuple(t.shape)}")
    if t.numel() and (not torch.isfinite(t).all() or t.min() < 0 or t.max() > 1):
        raise ValueError(f"positions must lie in [0, 1], got range [{t.min().item()}, {t.max().item()}]")


class BoxBasis:
    """``N`` box functions of width ``1/N`` tiling ``[0, 1]``: ``psi_j(t) = 1`` on ``[j/N, (j+1)/N)``.

    The point ``t = 1`` belongs to the last box, so the boxes partition the closed interval.
    """

    kind = "box"

    def __init__(self, num_basis: int) -> None:
        if num_basis < 1:
            raise ValueError(f"num_basis must be >= 1, got {num_basis}")
        self.num_basis = num_basis

    def index(self, t: torch.Tensor) -> torch.Tensor:
        """The box each position falls in (long, same shape as ``t``); positions are not checked."""
        return (t * self.num_basis).floor().long().clamp_(0, self.num_basis - 1)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Evaluate at positions ``t`` (``(T,)`` in ``[0, 1]``); returns ``(N, T)``."""
        _check_positions(t)
        idx = self.index(t)  # (T,)
        out = torch.zeros(self.num_basis, t.numel(), dtype=t.dtype, device=t.device)
        out[idx, torch.arange(t.numel(), device=t.device)] = 1.0
        return out


class GaussianBasis:
    """``N`` Gaussian bumps ``psi_j(t) = exp(-(t - mu_j)^2 / (2 sigma^2))`` with centres evenly on ``[0, 1]``.

    Args:
        num_basis: number of functions ``N``.
        width: standard deviation ``sigma``; default ``1 / N`` (neighbouring bumps overlap at ~0.6).
    """

    kind = "gaussian"

    def __init__(self, num_basis: int, width: float | None = None) -> None:
        if num_basis < 1:
            raise ValueError(f"num_basis must be >= 1, got {num_basis}")
        self.num_basis = num_basis
        self.width = float(width) if width is not None else 1.0 / num_basis
        if not self.width > 0:
            raise ValueError(f"width must be > 0, got {width}")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """Evaluate at positions ``t`` (``(T,)`` in ``[0, 1]``); returns ``(N, T)``."""
        _check_positions(t)
        if self.num_basis == 1:
            mu = torch.full((1,), 0.5, dtype=t.dtype, device=t.device)
        else:
            mu = torch.linspace(0, 1, self.num_basis, dtype=t.dtype, device=t.device)
        return torch.exp(-((t[None, :] - mu[:, None]) ** 2) / (2 * self.width**2))  # (N, T)


BASIS_KINDS = ("box", "gaussian")


def make_basis(kind: str, num_basis: int, **kwargs) -> BoxBasis | GaussianBasis:
    """Build a basis by name: ``"box"`` or ``"gaussian"``."""
    if kind == "box":
        return BoxBasis(num_basis)
    if kind == "gaussian":
        return GaussianBasis(num_basis, **kwargs)
    raise ValueError(f"unknown basis kind {kind!r}; choose one of {list(BASIS_KINDS)}")


def ridge_fit(x_BLD: torch.Tensor, t_L: torch.Tensor, basis, *, ridge: float = 0.5) -> torch.Tensor:
    """Fit coefficients ``B`` so that ``x(t_i) ~= B^T psi(t_i)``.

    Args:
        x_BLD: signal, ``(B, L, D)`` (or ``(L, D)``), one vector per position.
        t_L: positions in ``[0, 1]``: ``(L,)`` shared by every row, or ``(B, L)`` one set per row.
        basis: a basis (callable ``t -> (N, T)``).
        ridge: the ridge penalty ``lambda`` (>= 0; 0 only works when ``F F^T`` is invertible).

    Returns:
        Coefficients ``(B, N, D)`` (or ``(N, D)``), in float32 or the input's wider float dtype.

    A box basis takes a closed form: ``F F^T`` is diagonal (the number of points in each box), so
    ``B_j = sum_{t_i in box j} x_i / (count_j + lambda)``, one scatter-add instead of a linear solve.
    Other bases solve the ``N x N`` system by Cholesky (``lambda > 0``) or LU, all rows at once.
    """
    squeeze = x_BLD.dim() == 2
    if squeeze:
        x_BLD = x_BLD[None]
    if x_BLD.dim() != 3:
        raise ValueError(f"x must be (B, L, D) or (L, D), got shape {tuple(x_BLD.shape)}")
    Bsz, L, _ = x_BLD.shape
    if not (t_L.dim() == 1 and t_L.numel() == L) and not (t_L.dim() == 2 and tuple(t_L.shape) == (Bsz, L)):
        raise ValueError(f"positions must be ({L},) or ({Bsz}, {L}), got shape {tuple(t_L.shape)}")
    if ridge < 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    _check_positions(t_L.reshape(-1))
    dtype = torch.promote_types(x_BLD.dtype, torch.float32)
    coef_BND = _ridge_fit(x_BLD.to(dtype), t_L.to(device=x_BLD.device, dtype=dtype), basis, ridge)
    return coef_BND[0] if squeeze else coef_BND


def _ridge_fit(x_BLD: torch.Tensor, t: torch.Tensor, basis, ridge: float) -> torch.Tensor:
    """:func:`ridge_fit` without checks: ``x (B, L, D)`` float, ``t (L,)`` or ``(B, L)`` in ``[0, 1]``."""
    B, L, D = x_BLD.shape
    N = basis.num_basis
    if isinstance(basis, BoxBasis):
        # row b's box j is entry b * N + j of one flat (B * N) table: a single index_add_ for every row
        idx = (basis.index(t).expand(B, L) + N * torch.arange(B, device=x_BLD.device)[:, None]).reshape(-1)
        sums = torch.zeros(B * N, D, dtype=x_BLD.dtype, device=x_BLD.device).index_add_(0, idx, x_BLD.reshape(B * L, D))
        denom = torch.bincount(idx, minlength=B * N).to(x_BLD.dtype) + ridge
        if (denom <= 0).any():
            raise ValueError("ridge = 0 needs a point in every box (F F^T is singular); use ridge > 0")
        return (sums / denom[:, None]).reshape(B, N, D)
    if t.dim() == 1:
        F = basis(t)[None]  # (1, N, L)
    else:
        F = basis(t.reshape(-1)).reshape(N, B, L).transpose(0, 1)  # (B, N, L)
    G = F @ F.transpose(1, 2) + ridge * torch.eye(N, dtype=x_BLD.dtype, device=x_BLD.device)  # (1|B, N, N)
    rhs = F @ x_BLD  # (B, N, D): F X per row
    # B = (F F^T + lambda I)^-1 F X  (the transpose of X F^T (F F^T + lambda I)^-1; G is symmetric)
    if ridge > 0:
        chol, info = torch.linalg.cholesky_ex(G)
        if not bool((info == 0).all()):  # numerically not positive definite: fall back to LU
            return torch.linalg.solve(G.expand(B, N, N), rhs)
        return torch.cholesky_solve(rhs, chol.expand(B, N, N))
    return torch.linalg.solve(G.expand(B, N, N), rhs)


def evaluate_signal(coef_BND: torch.Tensor, t_T: torch.Tensor, basis) -> torch.Tensor:
    """Reconstruct ``x(t) = B^T psi(t)`` at positions ``t_T``; returns ``(B, T, D)`` (or ``(T, D)``)."""
    psi_NT = basis(t_T.to(device=coef_BND.device, dtype=coef_BND.dtype))
    if coef_BND.dim() == 2:
        return psi_NT.T @ coef_BND
    return torch.einsum("nt,bnd->btd", psi_NT, coef_BND)


def trapezoid_grid(num_points: int, *, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Integration points on ``[0, 1]`` and the log of their trapezoid weights.

    Returns:
        ``(t_T, logw_T)``: ``T = num_points`` evenly spaced points including both ends, and
        ``log w_i`` with ``w = 1/(T-1)`` inside and half that at both ends (``sum w = 1``).
    """
    if num_points < 2:
        raise ValueError(f"num_points must be >= 2 for the trapezoid rule, got {num_points}")
    t = torch.linspace(0, 1, num_points, device=device, dtype=dtype)
    w = torch.full((num_points,), 1.0 / (num_points - 1), device=device, dtype=dtype)
    w[0] = w[-1] = 0.5 / (num_points - 1)
    return t, w.log()
