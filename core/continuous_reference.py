"""The released ∞-Video memory arithmetic, as a switch (``ContinuousMemoryConfig(reference=True)``).

Written from the equations of the released ``long_term_attention_gibbs.py`` (deep-spin/Infinite-Video), so that
:class:`core.continuous.ContinuousMemory` can reproduce its numbers; the project's own placement differs on
purpose (see :mod:`core.continuous`). What the release computes, all in float32:

- **Basis.** Box ``j`` is ``[mu_j - w/2, mu_j + w/2)`` with ``mu_j`` the centre of ``[j/N, (j+1)/N]`` and
  ``w = 1/N``: half-open, so ``t = 1`` lies in no box. Gaussians are normalised densities
  ``phi((t - mu_j) / sigma) / sigma``, centres evenly on ``[0, 1]``.
- **Fit with padding.** The ``P`` fit positions are extended by about ``P/2`` evenly spaced positions on each
  side (reaching ``[-1/2, 3/2]``); they enter the Gram matrix only: ``A = (F_all F_all^T + lambda I)^-1 F``,
  ``coef = A x``. The first chunk's ``L`` frames sit at ``(i + 1/2) / L``.
- **Consolidation.** The ``M`` old samples sit at ``tau m / M`` and the ``L`` new frames at
  ``tau + (1 - tau) j / L`` (``m, j >= 1``: right edges, the last frame at exactly ``t = 1``). Evenly spaced
  old samples are read at ``m / M`` (the last at ``t = 1``).
- **Sticky draws.** The previous read's Gibbs density is evaluated at the ``K + 1`` bin edges (the outer two
  nudged to ``-1e-6`` and ``1 + 1e-6``), normalised by the trapezoid rule over them, integrated cumulatively;
  the masses of bins ``1..K-1`` (not bin 0) summed over heads and queries give the draw probabilities, and a
  draw of entry ``b`` (bin ``b + 1``'s mass) is read at the left edge of bin ``b``, in draw order.
- **Projections on coefficients.** Keys and values are the layer's projections applied to the coefficients,
  ``K(t) = psi(t)^T f_K(coef)`` (a bias is multiplied by ``sum_j psi_j(t)``).

The project's fixes are separate switches of the configuration: ``keep_last_frame`` (the last box is closed,
so ``t = 1`` is kept), ``all_bins`` (every bin is drawn from, at its own place), ``sort_draws``.
"""

from __future__ import annotations

import math

import torch

__all__ = ["ReferenceBoxBasis", "ReferenceGaussianBasis", "reference_basis", "first_fit_matrix", "later_fit_matrix",
           "even_sample_positions", "bin_edges", "draw_probabilities"]


class ReferenceBoxBasis:
    """Box functions as the release evaluates them (half-open; ``closed_last`` also puts ``t = 1`` in the last)."""

    kind = "box"

    def __init__(self, num_basis: int, *, closed_last: bool = False) -> None:
        self.num_basis, self.closed_last = num_basis, closed_last
        width = torch.ones(num_basis) / num_basis
        edges = torch.linspace(0, 1, num_basis + 1)
        mu = (edges[:-1] + edges[1:]) / 2
        self.lower, self.upper = mu - width / 2, mu + width / 2  # (N,) float32, as the release rounds them

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        """``(P,)`` positions (any real values) -> ``(N, P)`` float32."""
        t = t.float().reshape(1, -1)
        lo, up = self.lower.to(t.device)[:, None], self.upper.to(t.device)[:, None]
        inside = (t >= lo) & (t < up)
        if self.closed_last:  # t = 1 (to float rounding) belongs to the last box
            inside[-1] |= (t[0] >= lo[-1, 0]) & (t[0] <= 1.0 + 5e-7)
        return inside.float()


class ReferenceGaussianBasis:
    """Normalised Gaussian densities ``phi((t - mu_j) / sigma) / sigma``, ``mu`` evenly on ``[0, 1]``."""

    kind = "gaussian"

    def __init__(self, num_basis: int, width: float) -> None:
        self.num_basis, self.width = num_basis, float(width)
        self.mu = torch.linspace(0, 1, num_basis)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        z = (t.float().reshape(1, -1) - self.mu.to(t.device)[:, None]) / self.width
        return 1.0 / math.sqrt(2 * math.pi) * torch.exp(-0.5 * z**2) / self.width


def reference_basis(kind: str, num_basis: int, *, width: float | None = None, keep_last_frame: bool = False):
    """The release's box or Gaussian basis (Gaussian width default ``1 / N``)."""
    if kind == "box":
        return ReferenceBoxBasis(num_basis, closed_last=keep_last_frame)
    if kind == "gaussian":
        return ReferenceGaussianBasis(num_basis, width if width is not None else 1.0 / num_basis)
    raise ValueError(f"unknown basis kind {kind!r}; choose 'box' or 'gaussian'")


def _padded_fit(basis, positions: torch.Tensor, trim: int, ridge: float) -> torch.Tensor:
    """``A = (F F^T + lambda I)^-1 F[:, trim:-trim]`` over all positions: ``(N, P - 2 trim)``."""
    F = basis(positions)  # (N, P)
    G = F.t() @ torch.linalg.inv(F @ F.t() + ridge * torch.eye(basis.num_basis))  # (P, N)
    rows = G[trim:G.shape[0] - trim]
    return rows.t().contiguous()


def first_fit_matrix(basis, length: int, ridge: float) -> torch.Tensor:
    """The fit of a first chunk of ``L`` frames: ``coef = A x``, ``A`` ``(N, L)``."""
    L = length
    if L < 2:
        raise ValueError(f"the released fit needs chunks of >= 2 frames, got {L}")
    if L % 2:
        shift = 1 / float(L)
        pos = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * L - 1)
        trim = (L - 1) // 2
    else:
        shift = 1 / float(2 * L)
        pos = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * L)
        trim = L // 2
    return _padded_fit(basis, pos, trim, ridge)


def later_fit_matrix(basis, length: int, num_samples: int, tau: float, ridge: float) -> torch.Tensor:
    """The fit of a consolidation: ``M`` old samples then ``L`` new frames, ``coef = A [x_old; x]``, ``A`` ``(N, M + L)``.

    The padding follows the release to the letter (its spacing uses ``2 L + M`` for an even ``L``); if the padding
    does not have ``(M + L) // 2`` positions on each side the released code cannot run either, and this raises.
    """
    L, M = length, num_samples
    tm_tau = torch.arange(1, M + 1).float() * tau / M
    tm_l = tau + (1 - tau) * (torch.arange(M + 1, L + M + 1).float() - M) / L
    if L % 2:
        shift = 1 / float(L + M)
        pad = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * (L + M) - 1)
    else:
        shift = 1 / float(2 * L + M)
        pad = torch.linspace(-0.5 + shift, 1.5 - shift, 2 * (L + M))
    pos = torch.cat([pad[pad < 0], tm_tau, tm_l, pad[pad > 1]])
    P = M + L
    trim = (P - 1) // 2 if P % 2 else P // 2
    if pos.numel() - 2 * trim != P:
        raise ValueError(f"the released padding gives {pos.numel() - P} positions for M={M}, L={L}, not {2 * trim}")
    return _padded_fit(basis, pos, trim, ridge)


def even_sample_positions(num_samples: int, tau: float) -> torch.Tensor:
    """Where evenly spaced consolidation reads the old signal: ``(tau m / M) / tau``, ``m = 1..M`` (float32)."""
    return torch.arange(1, num_samples + 1).float() * tau / num_samples / tau


def bin_edges(num_bins: int) -> torch.Tensor:
    """``K + 1`` edges of ``K`` equal bins of ``[0, 1]`` (float32); a reference draw of entry ``b`` sits at edge ``b``."""
    return torch.linspace(0, 1, num_bins + 1)


def draw_probabilities(query_BHQD: torch.Tensor, key_coef_BHND: torch.Tensor, basis, scale: float, num_bins: int,
                       *, all_bins: bool = False) -> torch.Tensor:
    """The release's sticky draw probabilities from the last read (queries and key coefficients).

    Returns:
        ``(B, K - 1)``: the masses of bins ``1..K-1`` (the release), or ``(B, K)`` with ``all_bins``; rows sum to 1.
    """
    t = bin_edges(num_bins).clone()
    t[0], t[-1] = -0.000001, 1.000001
    t = t.to(query_BHQD.device)
    psi_PN = basis(t).t()  # (K + 1, N)
    keys = torch.matmul(key_coef_BHND.float().transpose(-1, -2), psi_PN.t())  # (B, H, d, K + 1)
    scores = torch.matmul(query_BHQD.float() * scale, keys)  # (B, H, Q, K + 1)
    prob = torch.exp(scores) / torch.trapz(torch.exp(scores), t, dim=-1).unsqueeze(-1)
    cum = torch.cumulative_trapezoid(prob, t, dim=-1)  # (B, H, Q, K): mass of [t_0, t_k]
    mass = cum[..., 1:] - cum[..., :-1]  # bins 1..K-1
    if all_bins:
        mass = torch.cat([cum[..., :1], mass], dim=-1)
    p = mass.sum(dim=(1, 2))
    return p / p.sum(-1, keepdim=True)
