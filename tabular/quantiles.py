"""The predictive distribution of a TabICL regression model, read off its ``Q`` predicted quantiles.

The decoder of a regression checkpoint emits ``Q`` values (999 for the published one) at the levels
``alpha_j = j / (Q + 1)``, ``j = 1 .. Q``. As the official package does:

- crossing quantiles are fixed by sorting them;
- ``mean`` is the average of the sorted quantiles, ``variance`` their unbiased variance;
- the quantile function ``Q(alpha)`` interpolates linearly between the levels and, outside
  ``[alpha_1, alpha_Q]``, continues with exponential tails ``Q(a) = beta_L ln(a) + c_L`` (left) and
  ``Q(a) = -beta_R ln(1 - a) + c_R`` (right), through the end quantiles, with ``beta`` the least-squares slope of
  the ``k = min(20, Q // 4)`` end quantiles against ``ln(alpha)`` (``ln(1 - alpha)``), its absolute value clipped to
  ``[0.01, 100]``.

Layouts: quantiles ``(..., Q)``; ``icdf(alphas (A,))`` gives ``(..., A)``.
"""

from __future__ import annotations

import torch

__all__ = ["OUTPUT_TYPES", "QuantileDistribution", "DEFAULT_ALPHAS"]

#: What :meth:`tabular.TabICLRegressor.predict` can return.
OUTPUT_TYPES = ("mean", "median", "quantiles", "raw_quantiles")
#: Levels of ``output_type="quantiles"`` when none are given (the official default).
DEFAULT_ALPHAS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

_TOL = 1e-6  # floor of probabilities and level gaps inside logs and divisions
_BETA_RANGE = (0.01, 100.0)  # clip of the tails' scale
_TAIL_POINTS = 20  # end quantiles each tail's slope is fitted on (at most Q // 4)


class QuantileDistribution:
    """A distribution from predicted quantiles ``(..., Q)`` (sorted on construction)."""

    def __init__(self, quantiles: torch.Tensor) -> None:
        Q = quantiles.shape[-1]
        if Q < 2:
            raise ValueError(f"a quantile distribution needs at least 2 quantiles, got {Q}")
        self.quantiles = torch.sort(quantiles, dim=-1).values
        self.levels = torch.linspace(0.0, 1.0, Q + 2, device=quantiles.device, dtype=quantiles.dtype)[1:-1]
        self.beta_left, self.beta_right = self._tail_scales()

    @property
    def mean(self) -> torch.Tensor:
        """``(...)``: the average of the sorted quantiles."""
        return self.quantiles.mean(dim=-1)

    @property
    def variance(self) -> torch.Tensor:
        """``(...)``: the unbiased variance of the sorted quantiles."""
        return self.quantiles.var(dim=-1)

    def _tail_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``beta_L, beta_R`` ``(...)``: least-squares slopes of the end quantiles on the log levels."""
        k = min(_TAIL_POINTS, self.quantiles.shape[-1] // 4)
        out = []
        for q, x, sign in ((self.quantiles[..., :k], torch.log(self.levels[:k].clamp(min=_TOL)), 1.0),
                           (self.quantiles[..., -k:], torch.log((1 - self.levels[-k:]).clamp(min=_TOL)), -1.0)):
            xc = x - x.mean()
            cov = ((q - q.mean(dim=-1, keepdim=True)) * xc).mean(dim=-1)
            beta = sign * cov / (xc**2).mean().clamp(min=_TOL)
            out.append(beta.abs().clamp(*_BETA_RANGE))
        return out[0], out[1]

    def icdf(self, alphas: torch.Tensor) -> torch.Tensor:
        """Quantile function at levels ``alphas (A,)`` in (0, 1) -> ``(..., A)``."""
        q, lv = self.quantiles, self.levels
        batch = q.shape[:-1]
        a = alphas.to(q.dtype).reshape((1,) * len(batch) + (-1,)).expand(*batch, -1)
        a_lo, a_hi = float(lv[0]), float(lv[-1])
        q_lo, q_hi = q[..., :1], q[..., -1:]
        # Linear interpolation between the levels.
        seg = (torch.searchsorted(lv[:-1].contiguous(), a.contiguous(), right=True) - 1).clamp(0, q.shape[-1] - 2)
        lo, hi = lv[:-1][seg], lv[1:][seg]
        q0, q1 = q[..., :-1].gather(-1, seg), q[..., 1:].gather(-1, seg)
        t = ((a - lo) / (hi - lo).clamp(min=_TOL)).clamp(0.0, 1.0)
        inner = torch.where(a >= a_hi, q_hi.expand_as(a), q0 + t * (q1 - q0))
        # Exponential tails through the end quantiles.
        bl, br = self.beta_left[..., None], self.beta_right[..., None]
        log = lambda v: torch.log(torch.tensor(v, device=q.device, dtype=q.dtype))  # noqa: E731
        left = bl * torch.log(a.clamp(min=_TOL)) + (q_lo - bl * log(max(a_lo, _TOL)))
        right = -br * torch.log((1 - a).clamp(min=_TOL)) + (q_hi + br * log(1 - min(a_hi, 1 - _TOL)))
        return torch.where(a < a_lo, left, torch.where(a > a_hi, right, inner))
