"""Where a consolidation samples the old signal (the sampling half of :mod:`core.continuous`).

Evenly spaced positions, or "sticky" draws from the last attention density: the density's mass per bin of
``[0, 1]`` (:func:`density_histogram`), then ``M`` draws by inverse CDF from uniform numbers, so a run is a
fixed function of the density and the generator's stream (a test can replay it), or replayed from given
bin indices (:func:`positions_from_bins`).
"""

from __future__ import annotations

import torch

__all__ = ["density_histogram", "uniform_positions", "draw_bins", "positions_from_bins", "sticky_positions"]


def density_histogram(density_BT: torch.Tensor, t_T: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Probability mass of each of ``num_bins`` equal bins of ``[0, 1]`` under a density sampled at ``t_T``.

    The density is integrated with the trapezoid rule on the sample points (each point's mass goes to
    the bin it falls in, the last point to the last bin). Returns ``(B, num_bins)`` rows summing to 1.
    """
    if num_bins < 1:
        raise ValueError(f"num_bins must be >= 1, got {num_bins}")
    T = t_T.numel()
    if density_BT.dim() != 2 or density_BT.shape[1] != T:
        raise ValueError(f"density must be (B, {T}), got shape {tuple(density_BT.shape)}")
    if (density_BT < 0).any() or not torch.isfinite(density_BT).all():
        raise ValueError("density must be finite and non-negative")
    w = torch.full((T,), 1.0 / max(T - 1, 1), dtype=torch.float32, device=density_BT.device)
    if T > 1:
        w[0] = w[-1] = 0.5 / (T - 1)
    mass_BT = density_BT.float() * w
    idx = (t_T.to(density_BT.device).float() * num_bins).floor().long().clamp_(0, num_bins - 1)
    hist = torch.zeros(density_BT.shape[0], num_bins, dtype=torch.float32, device=density_BT.device)
    hist.index_add_(1, idx, mass_BT)
    total = hist.sum(dim=1, keepdim=True)
    if (total <= 0).any():
        raise ValueError("density has zero mass")
    return hist / total


def uniform_positions(num_samples: int, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """``num_samples`` evenly spaced positions in ``(0, 1)`` (centres of equal bins), sorted."""
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return (torch.arange(num_samples, device=device, dtype=dtype) + 0.5) / num_samples


def draw_bins(prob_BK: torch.Tensor, u_BM: torch.Tensor) -> torch.Tensor:
    """Categorical draws by inverse CDF: bin ``k`` for each uniform ``u`` in ``[cdf_{k-1}, cdf_k)``.

    Args:
        prob_BK: probabilities ``(B, K)`` (rows are normalised here; a bin without mass is never drawn).
        u_BM: uniform numbers in ``[0, 1)``, ``(B, M)``.

    Returns:
        Bin indices ``(B, M)`` long.
    """
    if prob_BK.dim() != 2 or u_BM.dim() != 2 or u_BM.shape[0] != prob_BK.shape[0]:
        raise ValueError(f"need probabilities (B, K) and uniforms (B, M), got {tuple(prob_BK.shape)} and {tuple(u_BM.shape)}")
    p = prob_BK.float().cpu()
    cdf = p.cumsum(dim=1)
    cdf = cdf / cdf[:, -1:]
    bins = torch.searchsorted(cdf, u_BM.float().cpu().contiguous(), right=True)
    # u just below 1 may pass a cdf that rounds below 1: take the last bin with mass
    last = (p > 0).long().cumsum(dim=1).argmax(dim=1, keepdim=True)
    return torch.minimum(bins, last)


def positions_from_bins(bins_BM: torch.Tensor, num_bins: int, offset_BM: torch.Tensor | None, *,
                        sort: bool = True) -> torch.Tensor:
    """Positions ``(bins + offset) / num_bins`` in ``[0, 1]``; ``offset`` None = the bin's centre; ``sort`` keeps
    the resampled signal in time order."""
    b = bins_BM.float()
    pos = (b + (0.5 if offset_BM is None else offset_BM.to(b.device))) / num_bins
    return pos.sort(dim=1).values if sort else pos


def sticky_positions(
    hist_BK: torch.Tensor,
    num_samples: int,
    *,
    generator: torch.Generator | None = None,
    jitter: bool = True,
    sort: bool = True,
    all_bins: bool = True,
    bins: torch.Tensor | None = None,
) -> torch.Tensor:
    """Draw ``num_samples`` positions per row from a histogram over ``K`` bins of ``[0, 1]``.

    Each draw picks bin ``k`` with probability ``hist[k]`` (by inverse CDF from ``torch.rand`` of the
    generator: first ``(B, M)`` numbers for the bins, then ``(B, M)`` for the place inside them), then a
    position inside it: uniform in the bin with ``jitter``, else the bin's centre.

    Args:
        hist_BK: bin masses ``(B, K)``.
        num_samples: ``M``.
        generator: the random stream.
        jitter: a uniform place inside the bin (else its centre).
        sort: sort the positions ascending (the resampled signal keeps its time order).
        all_bins: every bin can be drawn. ``False`` reproduces the released code's flaw: the first bin's mass
            is dropped and each draw of bin ``k >= 1`` lands in bin ``k - 1``.
        bins: replay ``(B, M)`` bin indices instead of drawing them (into the ``K`` bins, or the ``K - 1``
            bins after the first without ``all_bins``).

    Returns:
        ``(B, num_samples)`` positions in ``(0, 1]``.
    """
    if hist_BK.dim() != 2:
        raise ValueError(f"histogram must be (B, K), got shape {tuple(hist_BK.shape)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    B, K = hist_BK.shape
    prob = hist_BK if all_bins else hist_BK[:, 1:]
    if prob.shape[1] < 1 or (prob.sum(dim=1) <= 0).any():
        raise ValueError("the histogram has no mass to draw from")
    u = torch.rand(B, num_samples, generator=generator)
    if bins is None:
        bins = draw_bins(prob, u)
    elif tuple(bins.shape) != (B, num_samples) or bins.min() < 0 or bins.max() >= prob.shape[1]:
        raise ValueError(f"bins must be ({B}, {num_samples}) indices in [0, {prob.shape[1]}), got shape "
                         f"{tuple(bins.shape)}")
    # 1 - U with U in [0, 1) gives offsets in (0, 1]: the position stays inside its bin and above 0
    offset = 1.0 - torch.rand(B, num_samples, generator=generator) if jitter else None
    return positions_from_bins(bins.cpu(), K, offset, sort=sort).to(hist_BK.device)
