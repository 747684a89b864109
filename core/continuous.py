"""Continuous-time memory: basis functions, ridge fit (:mod:`core.continuous_basis`), Gibbs continuous attention,
consolidation.

A sequence of ``L`` vectors ``x_1..x_L`` (one per frame, say) placed at positions ``t_i`` in ``[0, 1]``
is represented by ``N`` basis functions ``psi_j(t)`` and a coefficient matrix ``B`` (``N x D``):
``x(t) ~= B^T psi(t)``. The coefficients come from ridge regression

    F[j, i] = psi_j(t_i),    B^T = X^T F^T (F F^T + lambda I)^-1

so the memory has ``N x D`` numbers whatever ``L`` is.

Continuous attention (a Gibbs density over time) reads it: with keys ``K(t) = W_K x(t)`` and values
``V(t) = W_V x(t)``, ``p(t) ∝ exp(q . K(t) / sqrt(d))`` on ``[0, 1]`` and the context is
``∫ p(t) V(t) dt``. The integral is taken with the trapezoid rule on ``T`` points, which is exactly
ordinary softmax attention over the ``T`` evaluated points with an additive bias ``log w_i`` (the
trapezoid weights), so it runs through :func:`core.attention.attention` like every other attention.

Consolidation (the ∞-Video long-term memory): when a new chunk arrives, ``M`` positions ``s_1 <= .. <= s_M``
of the old signal are sampled, the old values ``x_old(s_m)`` are placed, in that order, at ``M`` evenly
spaced positions ``u_m = tau (m - 1/2) / M`` of ``(0, tau]``, the new chunk's vectors are placed evenly on
``(tau, 1]``, and ``B`` is refit. "Sticky" memories draw the ``s_m`` from the previous attention density
(a histogram over ``num_bins`` bins, categorical draws) instead of evenly: an attended span receives more
samples, and since every sample gets the same share of ``(0, tau]``, it is stretched over more basis
functions while the rest is compressed, never erased (every basis function of ``(0, tau]`` keeps samples).
This is the placement of the released ∞-Video code; sampling evenly reduces to squeezing ``x_old(t)`` to
``x_old(t / tau)``. Drawn positions are sorted (time order is preserved) and every bin, the first
included, can be drawn (:mod:`core.continuous_draws`; draws are an inverse CDF of the memory's seeded stream,
or replayed from given bins). ``ContinuousMemoryConfig(reference=True)`` reproduces the released code's
arithmetic instead (:mod:`core.continuous_reference`), its three known flaws each a switch of their own.

Every basis function should receive samples: a first chunk of ``L`` frames fills at most ``L`` boxes, so
``num_basis <= chunk size`` (:func:`check_basis_coverage` warns otherwise).

Because sticky consolidation warps the time axis, the memory also carries a *source map*: for each
integration point, the stream time (the caller's frame times, or frame counts) whose signal it holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from core import continuous_reference as _ref
from core.continuous_attention import (  # the reading half, re-exported
    attention_density,
    continuous_attention,
    continuous_attention_with_density,
    mix_attention,
    read_memory,
)
from core.continuous_basis import (  # the signal half, re-exported: core.continuous stays the one import
    BASIS_KINDS,
    BoxBasis,
    GaussianBasis,
    _ridge_fit,
    evaluate_signal,
    make_basis,
    ridge_fit,
    trapezoid_grid,
)
from core.continuous_draws import density_histogram, draw_bins, sticky_positions, uniform_positions  # re-exported

logger = logging.getLogger(__name__)

__all__ = [
    "BoxBasis",
    "GaussianBasis",
    "make_basis",
    "BASIS_KINDS",
    "ridge_fit",
    "evaluate_signal",
    "trapezoid_grid",
    "continuous_attention",
    "attention_density",
    "continuous_attention_with_density",
    "mix_attention",
    "density_histogram",
    "draw_bins",
    "sticky_positions",
    "uniform_positions",
    "ContinuousMemoryConfig",
    "ContinuousMemory",
    "read_memory",
    "empty_basis_functions",
    "check_basis_coverage",
]


def _interp_rows(values_BK: torch.Tensor, pos_BP: torch.Tensor) -> torch.Tensor:
    """Linear interpolation along rows: ``values[b]`` at fractional indices ``pos[b]`` (clamped to ``[0, K-1]``)."""
    K = values_BK.shape[1]
    pos = pos_BP.clamp(0, K - 1)
    lo = pos.floor().long().clamp_(max=K - 1)
    hi = (lo + 1).clamp_(max=K - 1)
    w = pos - lo.to(pos.dtype)
    return values_BK.gather(1, lo) * (1 - w) + values_BK.gather(1, hi) * w


@dataclass(kw_only=True)
class ContinuousMemoryConfig:
    """Settings of one continuous long-term memory (one per attention layer)."""

    num_basis: int = 256  # N basis functions: memory holds N x D numbers whatever the length
    basis: str = "box"  # "box" (as in the published ∞-Video code) or "gaussian"
    gaussian_width: float | None = None  # sigma of the Gaussian basis; None = 1/N
    ridge: float = 0.5  # lambda of the ridge fit (published default)
    tau: float = 0.75  # old memory is squeezed into (0, tau], the new chunk goes on (tau, 1]
    num_samples: int = 512  # M samples of the old signal per consolidation, placed evenly on (0, tau]
    sticky: bool = True  # draw the M sample positions from the last attention density instead of evenly
    num_bins: int = 128  # histogram bins of the density for sticky draws
    num_points: int = 1000  # trapezoid integration points of the continuous attention
    reference: bool = False  # reproduce the released code's arithmetic (core.continuous_reference): padded fits,
    # right-edge placement, half-open boxes, normalised Gaussians, projections on the coefficients, the density
    # at the bin edges. The three fixes below are its known flaws, each its own switch
    sort_draws: bool | None = None  # sort sticky draws so the resampled signal keeps its time order; None = not
    # reference (the release keeps draw order)
    all_bins: bool | None = None  # every density bin can be drawn, at its own place; None = not reference (the
    # release drops the first bin's mass and reads each draw one bin to the left)
    keep_last_frame: bool | None = None  # t = 1 belongs to the last box, so a chunk's last frame (placed there by
    # the release), the last even old sample and the last integration point are kept; None = not reference.
    # Only the reference placement puts anything at t = 1

    def __post_init__(self) -> None:
        if self.num_basis < 1:
            raise ValueError(f"num_basis must be >= 1, got {self.num_basis}")
        if self.basis not in BASIS_KINDS:
            raise ValueError(f"basis must be one of {list(BASIS_KINDS)}, got {self.basis!r}")
        if self.ridge < 0:
            raise ValueError(f"ridge must be >= 0, got {self.ridge}")
        if not 0.0 < self.tau < 1.0:
            raise ValueError(f"tau must lie in (0, 1), got {self.tau}")
        if self.num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {self.num_samples}")
        if self.num_bins < 1 or (self.reference and self.num_bins < 2):
            raise ValueError(f"num_bins must be >= 1 (>= 2 with reference), got {self.num_bins}")
        if self.num_points < 2:
            raise ValueError(f"num_points must be >= 2, got {self.num_points}")
        for name in ("sort_draws", "all_bins", "keep_last_frame"):
            if getattr(self, name) is None:
                setattr(self, name, not self.reference)
        if not self.reference and not self.keep_last_frame:
            raise ValueError("keep_last_frame=False needs reference=True: the project's placement puts no frame at t = 1")


class ContinuousMemory:
    """The ∞-Video long-term memory of one layer: ridge coefficients of a signal on ``[0, 1]``.

    Usage per video: :meth:`reset`, then for each chunk :meth:`update` with the chunk's vectors, read
    :meth:`points` (the signal at the integration points) to run :func:`continuous_attention`, and hand
    the resulting density to :meth:`set_density` so the next consolidation can use sticky positions.

    The state is ``coef`` (``(B, N, D)``), fixed in size, plus the last density and the source map
    (:meth:`source_times`), both ``(B, T)``.
    """

    def __init__(self, config: ContinuousMemoryConfig | None = None, *, seed: int | None = None) -> None:
        self.config = cfg = config or ContinuousMemoryConfig()
        kw = {"width": cfg.gaussian_width} if cfg.basis == "gaussian" else {}
        if cfg.reference:
            self.basis = _ref.reference_basis(cfg.basis, cfg.num_basis, width=cfg.gaussian_width,
                                              keep_last_frame=cfg.keep_last_frame)
        else:
            self.basis = make_basis(cfg.basis, cfg.num_basis, **kw)
        self._seed = seed
        # Tensors that depend only on the configuration (positions, basis values, the ridge solve for fixed
        # positions), built on first use per device and kept across reset(): see _cached.
        self._cache: dict = {}
        self.reset()

    def reset(self) -> None:
        """Forget everything (call at the start of each video)."""
        self.coef: torch.Tensor | None = None  # (B, N, D)
        self.density: torch.Tensor | None = None  # (B, T) last attention density at the integration points
        self.source: torch.Tensor | None = None  # (B, T) stream time held at each integration point
        self.last_read: tuple | None = None  # reference: (queries, key coefficients, scale) of the last read
        self.samples: torch.Tensor | None = None  # reference: (B, M, D) old values sampled by the last consolidation
        self.last_positions: torch.Tensor | None = None  # (B, M) where the last consolidation read the old signal
        self.num_chunks = 0
        self.num_frames = 0
        self._generator = torch.Generator()
        if self._seed is not None:
            self._generator.manual_seed(self._seed)
        else:
            self._generator.seed()

    @property
    def is_empty(self) -> bool:
        return self.coef is None

    def _cached(self, key: tuple, build):
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def grid(self, *, device=None, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The integration points and their log trapezoid weights."""
        return self._cached(("grid", str(device), dtype),
                            lambda: trapezoid_grid(self.config.num_points, device=device, dtype=dtype))

    def _grid_basis(self, device) -> torch.Tensor:
        """The basis at the integration points, ``(N, T)`` float32."""
        return self._cached(("psi_T", str(device)), lambda: self.basis(self.grid(device=device)[0]))

    def _new_positions(self, L: int, first: bool, device) -> torch.Tensor:
        """Where a chunk of ``L`` frames goes: frame centres on ``(0, 1)`` (first chunk) or on ``(tau, 1)``."""
        def build():
            c = (torch.arange(L, device=device, dtype=torch.float32) + 0.5) / L
            return c if first else self.config.tau + (1 - self.config.tau) * c
        return self._cached(("t_new", L, first, str(device)), build)

    def _fixed_maps(self, L: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Consolidation as matrices: the fit positions never change, only the values sampled from the old signal.

        The old samples always go to the evenly spaced ``u_m = tau (m - 1/2) / M`` and the new frames to
        the centres of ``(tau, 1]``, so ``A = (F F^T + lambda I)^-1 F`` is solved once per chunk length and
        ``coef' = A_old x_old(s) + A_new x`` with ``A_old = A[:, :M]`` (``N x M``), ``A_new = A[:, M:]``
        (``N x L``). For even resampling (``s = u / tau``) the old part is linear in the old coefficients:
        ``R_old = A_old psi(s)^T`` (``N x N``).

        Returns:
            ``(A_old, A_new, R_old)``.
        """
        def build():
            cfg = self.config
            s_M = uniform_positions(cfg.num_samples, device=device)
            t_all = torch.cat([cfg.tau * s_M, self._new_positions(L, False, device)])
            eye = torch.eye(t_all.numel(), device=device)[None]  # fitting the identity gives A^T
            A_NP = _ridge_fit(eye, t_all, self.basis, cfg.ridge)[0]  # (N, M + L): row p of the identity -> A[:, p]
            M = cfg.num_samples
            A_old = A_NP[:, :M].contiguous()
            return A_old, A_NP[:, M:].contiguous(), A_old @ self.basis(s_M).T
        return self._cached(("maps", L, str(device)), build)

    def resample_positions(self, batch: int, device=None, *, bins: torch.Tensor | None = None) -> torch.Tensor:
        """Positions ``(B, M)`` in ``(0, 1]`` at which the old signal is sampled for consolidation.

        ``bins`` replays sticky draws (see :func:`core.continuous_draws.sticky_positions`).
        """
        cfg = self.config
        if cfg.sticky and self.density is not None:
            return sticky_positions(self._histogram(), cfg.num_samples, generator=self._generator,
                                    sort=cfg.sort_draws, all_bins=cfg.all_bins, bins=bins).to(device)
        return uniform_positions(cfg.num_samples, device=device).expand(batch, -1)

    def _histogram(self) -> torch.Tensor:
        """:func:`density_histogram` of the recorded density, with the bin of each point and the weights cached."""
        cfg, dev = self.config, self.density.device

        def build():
            t_T, logw_T = self.grid(device=dev)
            return (t_T * cfg.num_bins).floor().long().clamp_(0, cfg.num_bins - 1), logw_T.exp()
        idx_T, w_T = self._cached(("hist", str(dev)), build)
        hist = torch.zeros(self.density.shape[0], cfg.num_bins, dtype=torch.float32, device=dev)
        hist.index_add_(1, idx_T, self.density * w_T)
        total = hist.sum(dim=1, keepdim=True)
        if (total <= 0).any():
            raise ValueError("density has zero mass")
        return hist / total

    def update(self, x_BLD: torch.Tensor, times_BL: torch.Tensor | None = None, *,
               bins: torch.Tensor | None = None) -> None:
        """Consolidate a new chunk ``(B, L, D)`` (one vector per frame) into the memory.

        Args:
            x_BLD: the chunk's vectors.
            times_BL: the stream time of each frame, ``(B, L)`` or ``(L,)``, increasing (e.g. its time in
                the video); only used for the source map (:meth:`source_times`). Default: frame counts,
                ``n + 1/2`` for the ``n``-th frame fed since :meth:`reset`.
            bins: ``(B, M)`` sticky draws to replay instead of drawing (indices into the bins that can be drawn:
                all ``num_bins``, or the ``num_bins - 1`` after the first without ``all_bins``).

        Old samples are placed evenly on ``(0, tau]`` whatever positions they were drawn at, so the fit
        positions depend only on ``L`` and the refit is two cached matrix products (:meth:`_fixed_maps`);
        evenly spaced resampling folds the sampling into the first matrix.
        """
        if x_BLD.dim() != 3 or x_BLD.shape[1] < 1:
            raise ValueError(f"chunk must be (B, L, D) with L >= 1, got shape {tuple(x_BLD.shape)}")
        cfg = self.config
        B, L, D = x_BLD.shape
        x = x_BLD.float()
        dev = x.device
        if times_BL is None:
            times_BL = self.num_frames + 0.5 + torch.arange(L, device=dev, dtype=torch.float32)
        times_BL = times_BL.to(device=dev, dtype=torch.float32)
        if times_BL.dim() == 1:
            times_BL = times_BL[None]
        if times_BL.shape[-1] != L or times_BL.shape[0] not in (1, B):
            raise ValueError(f"times must be ({L},) or ({B}, {L}) to match the chunk, got {tuple(times_BL.shape)}")
        times_BL = times_BL.expand(B, L)
        t_T = self.grid(device=dev)[0]
        if cfg.reference:
            self._update_reference(x, bins)
        elif self.coef is None:
            self.coef = _ridge_fit(x, self._new_positions(L, True, dev), self.basis, cfg.ridge)
            self.source = _interp_rows(times_BL, (t_T * L - 0.5).expand(B, -1))
        else:
            if self.coef.shape[0] != B or self.coef.shape[2] != D:
                raise ValueError(f"chunk {tuple(x_BLD.shape)} does not match the memory's (B, D) = "
                                 f"({self.coef.shape[0]}, {self.coef.shape[2]}); reset() between videos")
            A_old, A_new, R_old = self._fixed_maps(L, dev)
            M = cfg.num_samples
            if not (cfg.sticky and self.density is not None):
                s_BM = uniform_positions(M, device=dev).expand(B, -1)
                coef_old = torch.matmul(R_old, self.coef)
            else:
                s_BM = self.resample_positions(B, device=dev, bins=bins)
                # the old signal at s_m, placed at u_m = tau (m - 1/2) / M
                if isinstance(self.basis, BoxBasis):
                    idx = self.basis.index(s_BM)  # (B, M)
                    old_BMD = self.coef.gather(1, idx[..., None].expand(B, M, D))
                else:
                    psi_NBM = self.basis(s_BM.reshape(-1)).reshape(cfg.num_basis, B, M)
                    old_BMD = torch.einsum("nbm,bnd->bmd", psi_NBM, self.coef)
                coef_old = torch.matmul(A_old, old_BMD)
            self.coef = coef_old + torch.matmul(A_new, x)
            self.source = self._next_source(s_BM.sort(dim=1).values, times_BL, t_T)
            self.last_positions = s_BM
        if cfg.reference:
            if self.source is None:
                self.source = _interp_rows(times_BL, (t_T * L - 0.5).expand(B, -1))
            else:
                self.source = self._next_source(self.last_positions.sort(dim=1).values.clamp(0, 1), times_BL, t_T)
        self.num_chunks += 1
        self.num_frames += L

    def _update_reference(self, x_BLD: torch.Tensor, bins: torch.Tensor | None) -> None:
        """:meth:`update` with the released code's arithmetic (:mod:`core.continuous_reference`)."""
        cfg = self.config
        B, L, D = x_BLD.shape
        dev = x_BLD.device
        if self.coef is None:
            A = self._cached(("ref_first", L), lambda: _ref.first_fit_matrix(self.basis, L, cfg.ridge))
            self.coef = torch.matmul(A.to(dev), x_BLD)
            return
        if cfg.sticky and self.last_read is not None:
            q, kc, scale = self.last_read
            p = _ref.draw_probabilities(q, kc, self.basis, scale, cfg.num_bins, all_bins=cfg.all_bins)
            if bins is None:
                bins = _draw(p, cfg.num_samples, self._generator)
            elif tuple(bins.shape) != (B, cfg.num_samples) or bins.min() < 0 or bins.max() >= p.shape[1]:
                raise ValueError(f"bins must be ({B}, {cfg.num_samples}) indices in [0, {p.shape[1]}), got shape "
                                 f"{tuple(bins.shape)}")
            self.draw_probabilities = p
            s_BM = _ref.bin_edges(cfg.num_bins)[bins.cpu()].to(dev)  # draw b at the left edge of bin b
            if cfg.sort_draws:
                s_BM = s_BM.sort(dim=1).values
        else:
            s_BM = _ref.even_sample_positions(cfg.num_samples, cfg.tau).to(dev).expand(B, -1)
        psi_NBM = self.basis(s_BM.reshape(-1)).reshape(cfg.num_basis, B, -1)
        self.samples = torch.einsum("nbm,bnd->bmd", psi_NBM, self.coef)  # the old signal at s, in draw order
        A = self._cached(("ref_later", L),
                         lambda: _ref.later_fit_matrix(self.basis, L, cfg.num_samples, cfg.tau, cfg.ridge))
        self.coef = torch.matmul(A.to(dev), torch.cat([self.samples, x_BLD], dim=1))
        self.last_positions = s_BM

    def _next_source(self, s_BM: torch.Tensor, times_BL: torch.Tensor, t_T: torch.Tensor) -> torch.Tensor:
        """The source map after a consolidation that sampled the old signal at ``s_BM`` (sorted)."""
        cfg = self.config
        B, M = s_BM.shape
        L = times_BL.shape[1]
        T = t_T.numel()
        old = t_T <= cfg.tau  # (T,)
        # an old point t holds the sample placed there: index m = M t / tau - 1/2 among the sorted draws
        s_at = _interp_rows(s_BM, (t_T[old] / cfg.tau * M - 0.5).expand(B, -1))  # (B, T_old) old positions
        src_old = _interp_rows(self.source, s_at * (T - 1))  # the old map at those positions (grid spacing 1/(T-1))
        frac_new = (t_T[~old] - cfg.tau) / (1 - cfg.tau)
        src_new = _interp_rows(times_BL, (frac_new * L - 0.5).expand(B, -1))
        return torch.cat([src_old, src_new], dim=1)

    def source_times(self) -> torch.Tensor:
        """The source map ``(B, T)``: for each integration point, the stream time whose signal it holds.

        Non-decreasing along the points; frame counts unless :meth:`update` was given frame times.
        """
        if self.coef is None:
            raise ValueError("the memory is empty: call update() with a chunk first")
        return self.source

    def points(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The signal at the integration points ``(B, T, D)`` and the log weights ``(T,)``."""
        if self.coef is None:
            raise ValueError("the memory is empty: call update() with a chunk first")
        _, logw_T = self.grid(device=self.coef.device)
        psi_NT = self._grid_basis(self.coef.device)
        return torch.matmul(psi_NT.T, self.coef), logw_T

    def project_points(self, fn) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """An affine map of the signal at the integration points, computed on the ``N`` coefficients.

        ``fn`` maps vectors ``(B, n, D)`` to a tensor or tuple of tensors whose axis ``-2`` runs over the
        ``n`` inputs (e.g. an attention layer's key/value projection ``(B, H, n, d)``) and must be affine
        along it (``f(x) = W x + b``). Since ``x(t) = sum_j psi_j(t) c_j``,
        ``f(x(t)) = psi(t)^T (f(c) - f(0)) + f(0)``: ``fn`` sees ``N + 1`` vectors instead of ``T`` points.

        Returns:
            ``(outputs, logw_T)``: a tuple with each output evaluated at the ``T`` points, and the log weights.
        """
        if self.coef is None:
            raise ValueError("the memory is empty: call update() with a chunk first")
        B, N, D = self.coef.shape
        dev = self.coef.device
        if self.config.reference:  # the release: f on the coefficients, f(x(t)) read as psi(t)^T f(coef)
            out = fn(self.coef)
            psi_TN = self._grid_basis(dev).T
            return tuple(psi_TN.to(o.dtype) @ o for o in (out if isinstance(out, tuple) else (out,))), \
                self.grid(device=dev)[1]
        box = isinstance(self.basis, BoxBasis)
        # a box basis is one-hot at every point (x(t_i) = c_{box(t_i)}), so f(x(t_i)) = f(c_{box(t_i)}): a gather
        out = fn(self.coef if box else torch.cat([self.coef, self.coef.new_zeros(B, 1, D)], dim=1))
        outs = out if isinstance(out, tuple) else (out,)
        res = []
        for o in outs:
            if o.shape[-2] != N + (not box):
                raise ValueError(f"fn must keep its {N + (not box)} inputs on axis -2, got shape {tuple(o.shape)}")
            if box:
                idx_T = self._cached(("box_T", str(dev)), lambda: self.basis.index(self.grid(device=dev)[0]))
                res.append(o.index_select(-2, idx_T))
                continue
            psi_TN = self._cached(("psi_TN", str(dev)), lambda: self._grid_basis(dev).T.contiguous())
            f0 = o[..., N:, :]
            lead, E = o.shape[:-2], o.shape[-1]
            diff = (o[..., :N, :] - f0).movedim(-2, 0).reshape(N, -1)  # (N, prod(lead) * E): one 2-D product
            val = (psi_TN.to(o.dtype) @ diff).reshape(-1, *lead, E).movedim(0, -2)  # (..., T, E)
            res.append(val + f0)
        return tuple(res), self.grid(device=dev)[1]

    def set_density(self, density_BT: torch.Tensor, *, last_read: tuple | None = None) -> None:
        """Record the attention density ``(B, T)`` at the integration points (used by sticky resampling).

        With ``reference``, sticky draws need the density at other points: ``last_read`` = ``(queries (B, H, Q, d),
        key coefficients (B, H, N, d), scale)`` of the read (:func:`read_memory` passes it).
        """
        if density_BT.dim() != 2 or density_BT.shape[1] != self.config.num_points:
            raise ValueError(f"density must be (B, {self.config.num_points}), got {tuple(density_BT.shape)}")
        self.density = density_BT.detach().float()
        if last_read is not None:
            q, kc, scale = last_read
            self.last_read = (q.detach().float(), kc.detach().float(), float(scale))
        elif self.config.reference and self.config.sticky:
            raise ValueError("a reference memory's sticky draws need the read's queries and key coefficients: "
                             "set_density(density, last_read=(q, key_coef, scale)), as read_memory does")

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The coefficients (and the last density, if any) as tensors."""
        out = {}
        if self.coef is not None:
            out["coef"] = self.coef
        if self.density is not None:
            out["density"] = self.density
        if self.source is not None:
            out["source"] = self.source
        return out

    def nbytes(self) -> int:
        """Bytes held by the state (independent of how many frames went in)."""
        return sum(t.numel() * t.element_size() for t in self.state_dict().values())


def _draw(prob_BK: torch.Tensor, num_samples: int, generator: torch.Generator) -> torch.Tensor:
    return draw_bins(prob_BK, torch.rand(prob_BK.shape[0], num_samples, generator=generator))


def empty_basis_functions(config: ContinuousMemoryConfig, chunk_size: int) -> tuple[int, int]:
    """How many basis functions get no sample from a chunk of ``chunk_size`` frames: ``(first chunk, later chunks)``.

    Later chunks: the old samples and the new frames at their fixed fit positions. A box gets a sample when a
    position falls in it; a Gaussian when a position lies within one width of its centre.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    cfg, L, M = config, chunk_size, config.num_samples
    mem = ContinuousMemory(cfg, seed=0)
    if cfg.reference:
        first = (torch.arange(L) + 0.5) / L
        later = torch.cat([torch.arange(1, M + 1).float() * cfg.tau / M,
                           cfg.tau + (1 - cfg.tau) * torch.arange(1, L + 1).float() / L])
    else:
        first = mem._new_positions(L, True, "cpu")
        later = torch.cat([cfg.tau * uniform_positions(M), mem._new_positions(L, False, "cpu")])

    def empty(t: torch.Tensor) -> int:
        if cfg.basis == "box":
            return int((mem.basis(t).sum(dim=1) == 0).sum())
        width = mem.basis.width
        centres = torch.linspace(0, 1, cfg.num_basis) if cfg.num_basis > 1 else torch.full((1,), 0.5)
        return int(((t[None, :] - centres[:, None]).abs().min(dim=1).values > width).sum())
    return empty(first), empty(later)


def check_basis_coverage(config: ContinuousMemoryConfig, chunk_size: int, *, where: str = "") -> tuple[int, int]:
    """:func:`empty_basis_functions`, with a ``UserWarning`` naming the fix when any function is left empty."""
    first, later = empty_basis_functions(config, chunk_size)
    if first or later:
        import warnings

        N, L = config.num_basis, chunk_size
        warnings.warn(f"{where + ': ' if where else ''}{first} of {N} basis functions get no frame from the first "
                      f"chunk of {L} frames and {later} stay empty after each later chunk, so the memory reads them "
                      f"as zero vectors; use num_basis <= chunk_size (num_basis={L}: one function per frame of a "
                      f"chunk, as Video-LLaMA's 256 frames / 256 functions) or chunk_size >= num_basis "
                      f"(chunk_size={N})", UserWarning, stacklevel=3)
    return first, later
