"""Tests of the continuous-time memory (core.continuous)."""

from __future__ import annotations

import math

import pytest
import torch

from core.attention import attention
from core.continuous import (
    BoxBasis,
    ContinuousMemory,
    ContinuousMemoryConfig,
    GaussianBasis,
    attention_density,
    continuous_attention,
    continuous_attention_with_density,
    density_histogram,
    evaluate_signal,
    make_basis,
    mix_attention,
    ridge_fit,
    sticky_positions,
    trapezoid_grid,
)


def _random_sines(D: int, gen: torch.Generator):
    """Parameters of a random low-frequency signal: a few sines with random phases and amplitudes."""
    freqs = torch.randint(1, 4, (3, D), generator=gen).float()
    phase = torch.rand(3, D, generator=gen) * 2 * math.pi
    amp = torch.randn(3, D, generator=gen)
    return freqs, phase, amp


def _eval_sines(params, t: torch.Tensor) -> torch.Tensor:
    freqs, phase, amp = params
    return (amp[None] * torch.sin(2 * math.pi * freqs[None] * t[:, None, None] + phase[None])).sum(1)  # (T, D)


def _smooth_signal(t: torch.Tensor, D: int, gen: torch.Generator) -> torch.Tensor:
    return _eval_sines(_random_sines(D, gen), t)


@pytest.mark.parametrize("kind,num_basis", [("box", 128), ("gaussian", 48)])
def test_ridge_fit_reconstructs_smooth_signal(kind, num_basis):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    L, D = 1000, 5
    t = torch.linspace(0, 1, L)
    params = _random_sines(D, gen)
    x = _eval_sines(params, t)
    basis = make_basis(kind, num_basis)
    coef = ridge_fit(x, t, basis, ridge=1e-3)
    assert coef.shape == (num_basis, D)
    t_test = torch.rand(300, generator=gen)
    x_test = _eval_sines(params, t_test)
    rel = (evaluate_signal(coef, t_test, basis) - x_test).norm() / x_test.norm()
    assert rel < (0.05 if kind == "box" else 0.02), rel
    # A much coarser basis cannot reconstruct it as well: the check discriminates.
    coarse = make_basis(kind, 4)
    rel_coarse = (evaluate_signal(ridge_fit(x, t, coarse, ridge=1e-3), t_test, coarse) - x_test).norm() / x_test.norm()
    assert rel_coarse > 2 * rel


def test_ridge_fit_matches_closed_form_and_batches():
    L, N, D = 37, 11, 3
    x = torch.randn(2, L, D, dtype=torch.float64)
    t = torch.rand(L, dtype=torch.float64)
    basis = GaussianBasis(N, width=0.1)
    coef = ridge_fit(x, t, basis, ridge=0.5)
    F = basis(t)
    for b in range(2):
        expected = x[b].T @ F.T @ torch.linalg.inv(F @ F.T + 0.5 * torch.eye(N, dtype=torch.float64))  # B = X F^T (F F^T + lI)^-1
        torch.testing.assert_close(coef[b], expected.T)


def test_box_basis_partitions_unit_interval():
    N = 7
    t = torch.rand(500)
    t[:3] = torch.tensor([0.0, 1.0, 3 / 7])
    psi = BoxBasis(N)(t)
    torch.testing.assert_close(psi.sum(0), torch.ones(500))
    assert psi[0, 0] == 1 and psi[N - 1, 1] == 1 and psi[3, 2] == 1
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        BoxBasis(N)(torch.tensor([1.5]))


def test_trapezoid_grid_integrates():
    t, logw = trapezoid_grid(101)
    w = logw.exp()
    assert torch.isclose(w.sum(), torch.tensor(1.0))
    assert torch.isclose((w * t**2).sum(), torch.tensor(1 / 3), atol=1e-4)
    with pytest.raises(ValueError, match="num_points"):
        trapezoid_grid(1)


def test_continuous_attention_equals_explicit_quadrature():
    B, H, Q, T, D = 2, 4, 5, 64, 8
    q = torch.randn(B, H, Q, D)
    k = torch.randn(B, 2, T, D)
    v = torch.randn(B, 2, T, D)
    _, logw = trapezoid_grid(T)
    out = continuous_attention(q, k, v, logw)
    kk = k.repeat_interleave(2, 1)
    vv = v.repeat_interleave(2, 1)
    p = torch.exp(q @ kk.transpose(-1, -2) / math.sqrt(D))  # unnormalized Gibbs density at the points
    w = logw.exp()
    expected = (p * w) @ vv / (p * w).sum(-1, keepdim=True)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    dens = attention_density(q, k, logw)
    assert dens.shape == (B, T)
    torch.testing.assert_close((dens * w).sum(1), torch.ones(B))
    expected_dens = ((p * w) / (p * w).sum(-1, keepdim=True) / w).mean(dim=(1, 2))
    torch.testing.assert_close(dens, expected_dens, rtol=1e-4, atol=1e-5)


def test_sharp_density_equals_nearest_frame():
    """A very sharp Gibbs density over a box-basis memory returns the attended frame's value."""
    L, D = 24, 16
    frames = torch.randn(L, D)
    t_frames = (torch.arange(L) + 0.5) / L
    basis = BoxBasis(L)
    coef = ridge_fit(frames, t_frames, basis, ridge=1e-6)
    t_T, logw = trapezoid_grid(1000)
    x_T = evaluate_signal(coef, t_T, basis)  # (T, D): the signal at integration points
    target = int(torch.randint(0, L, (1,)))
    q = frames[target] * 200.0  # a sharp query aimed at one frame
    k = x_T[None, None]
    v = x_T[None, None]
    out = continuous_attention(q.view(1, 1, 1, D), k, v, logw, scale=1.0)
    # Discrete attention over the frames with the same sharp query.
    ref = attention(q.view(1, 1, 1, D), frames[None, None], frames[None, None], scale=1.0)
    nearest = frames[(frames @ q).argmax()]
    torch.testing.assert_close(out.view(D), nearest, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(ref.view(D), nearest, rtol=1e-3, atol=1e-3)
    dens = attention_density(q.view(1, 1, 1, D), k, logw, scale=1.0)[0]
    mass_in_box = (dens * logw.exp())[(t_T * L).floor().clamp(max=L - 1) == target].sum()
    assert mass_in_box > 0.99


def test_mix_attention():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    torch.testing.assert_close(mix_attention(a, b, 0.75), 0.75 * a + 0.25 * b)
    assert mix_attention(a, b, 1.0) is a
    assert mix_attention(a, None, 0.3) is a
    with pytest.raises(ValueError, match="alpha"):
        mix_attention(a, b, 1.5)


def test_consolidation_keeps_memory_size_fixed():
    cfg = ContinuousMemoryConfig(num_basis=32, num_samples=64, num_points=200)
    mem = ContinuousMemory(cfg, seed=1)
    D = 12
    sizes = []
    for n in range(6):
        mem.update(torch.randn(2, 16 + 7 * n, D))
        x_T, logw = mem.points()
        assert x_T.shape == (2, 200, D)
        mem.set_density(torch.rand(2, 200) + 0.1)
        sizes.append(mem.nbytes())
        assert mem.coef.shape == (2, 32, D)
    assert len(set(sizes)) == 1
    assert mem.num_frames == sum(16 + 7 * n for n in range(6))
    mem.reset()
    assert mem.is_empty and mem.nbytes() == 0
    with pytest.raises(ValueError, match="empty"):
        mem.points()


def test_consolidation_squeezes_old_memory_into_tau():
    """After one consolidation, (0, tau] holds the old chunk contracted and (tau, 1] the new one."""
    cfg = ContinuousMemoryConfig(basis="gaussian", num_basis=96, num_samples=400, tau=0.5, ridge=1e-3, sticky=False,
                                 num_points=400)
    mem = ContinuousMemory(cfg)
    D = 3
    t = (torch.arange(100) + 0.5) / 100
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    p_old, p_new = _random_sines(D, gen), _random_sines(D, gen)
    mem.update(_eval_sines(p_old, t)[None])
    mem.update(_eval_sines(p_new, t)[None])
    probe = torch.linspace(0.1, 0.9, 17)
    got_old = evaluate_signal(mem.coef[0], probe * 0.5, mem.basis)
    want_old = _eval_sines(p_old, probe)
    got_new = evaluate_signal(mem.coef[0], 0.5 + 0.5 * probe, mem.basis)
    want_new = _eval_sines(p_new, probe)
    assert (got_old - want_old).norm() / want_old.norm() < 0.1
    assert (got_new - want_new).norm() / want_new.norm() < 0.1
    # and the two halves are not interchangeable
    assert (got_old - want_new).norm() / want_new.norm() > 0.3


def test_sticky_positions_sorted_and_follow_density():
    K, M = 16, 20000
    hist = torch.rand(2, K) ** 3
    hist[0, 0] = hist[0].sum()  # the first bin (half the mass) must be reachable
    hist[1, 5] = 0.0  # an empty bin is never drawn
    hist = hist / hist.sum(1, keepdim=True)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    pos = sticky_positions(hist, M, generator=gen)
    assert pos.shape == (2, M)
    assert (pos[:, 1:] >= pos[:, :-1]).all(), "positions must be sorted"
    assert (pos > 0).all() and (pos <= 1).all()
    counts = torch.stack([torch.bincount((p * K).ceil().long() - 1, minlength=K) for p in pos]).float() / M
    torch.testing.assert_close(counts, hist, atol=0.015, rtol=0)
    assert counts[0, 0] > 0.4 and counts[1, 5] == 0
    # Without jitter positions are the bin centres.
    centres = sticky_positions(hist, 50, generator=gen, jitter=False)
    assert torch.allclose((centres * K - 0.5).round(), centres * K - 0.5, atol=1e-5)


def test_density_histogram_and_sticky_memory_use_it():
    t_T, logw = trapezoid_grid(257)
    dens = torch.exp(-((t_T - 0.2) ** 2) / (2 * 0.02**2))[None]
    dens = dens / (dens * logw.exp()).sum()
    hist = density_histogram(dens, t_T, 10)
    torch.testing.assert_close(hist.sum(1), torch.ones(1))
    assert hist[0, 1] + hist[0, 2] > 0.9
    cfg = ContinuousMemoryConfig(num_basis=16, num_samples=1000, num_bins=10, num_points=257)
    mem = ContinuousMemory(cfg, seed=3)
    mem.update(torch.randn(1, 8, 4))
    mem.set_density(dens)
    s = mem.resample_positions(1)
    assert ((s > 0.1) & (s < 0.3)).float().mean() > 0.9
    cfg_u = ContinuousMemoryConfig(num_basis=16, num_samples=1000, num_bins=10, num_points=257, sticky=False)
    mem_u = ContinuousMemory(cfg_u)
    mem_u.update(torch.randn(1, 8, 4))
    mem_u.set_density(dens)
    s_u = mem_u.resample_positions(1)
    assert ((s_u > 0.1) & (s_u < 0.3)).float().mean() < 0.25


def test_config_validation():
    with pytest.raises(ValueError, match="tau"):
        ContinuousMemoryConfig(tau=1.0)
    with pytest.raises(ValueError, match="basis"):
        ContinuousMemoryConfig(basis="wavelet")
    with pytest.raises(ValueError, match="unknown basis"):
        make_basis("wavelet", 3)
    mem = ContinuousMemory(ContinuousMemoryConfig(num_basis=8, num_points=50))
    mem.update(torch.randn(1, 4, 6))
    with pytest.raises(ValueError, match="reset"):
        mem.update(torch.randn(1, 4, 7))
    with pytest.raises(ValueError, match="density"):
        mem.set_density(torch.rand(1, 49))


# -- the fast paths equal the plain formulas ----------------------------------------------------------------


def _dense_ridge(x_LD: torch.Tensor, t_L: torch.Tensor, basis, ridge: float) -> torch.Tensor:
    """``B = (F F^T + lambda I)^-1 F X`` written out, in float64."""
    F = basis(t_L.double())
    G = F @ F.T + ridge * torch.eye(F.shape[0], dtype=torch.float64)
    return torch.linalg.inv(G) @ F @ x_LD.double()


@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_ridge_fit_fast_paths_equal_the_formula_per_row(kind):
    """Box closed form (scatter-add) and batched Cholesky with one position set per row match the formula."""
    B, L, N, D = 3, 50, 13, 4
    x = torch.randn(B, L, D)
    t = torch.rand(B, L)
    basis = make_basis(kind, N)
    lam = float(torch.rand(()) + 0.1)
    coef = ridge_fit(x, t, basis, ridge=lam)
    for b in range(B):
        torch.testing.assert_close(coef[b].double(), _dense_ridge(x[b], t[b], basis, lam), rtol=1e-4, atol=1e-5)
    shared = ridge_fit(x, t[0], basis, ridge=lam)
    torch.testing.assert_close(shared[2].double(), _dense_ridge(x[2], t[0], basis, lam), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        ridge_fit(x, torch.rand(B + 1, L), basis)


def test_box_ridge_zero_needs_every_box_filled():
    with pytest.raises(ValueError, match="ridge"):
        ridge_fit(torch.randn(5, 2), torch.full((5,), 0.1), BoxBasis(4), ridge=0.0)
    t = (torch.arange(8) + 0.5) / 8
    x = torch.randn(8, 2)
    torch.testing.assert_close(ridge_fit(x, t, BoxBasis(4), ridge=0.0), x.reshape(4, 2, 2).mean(1))


@pytest.mark.parametrize("kind,sticky", [("box", True), ("box", False), ("gaussian", True), ("gaussian", False)])
def test_memory_update_equals_the_plain_consolidation(kind, sticky):
    """Cached maps / batched refits equal, row by row: sample the old signal at the sorted s_m, place the
    samples at evenly spaced u_m in (0, tau], the new frames on (tau, 1], refit."""
    cfg = ContinuousMemoryConfig(basis=kind, num_basis=24, num_samples=96, num_bins=16, num_points=120,
                                 sticky=sticky, ridge=float(torch.rand(()) * 0.9 + 0.1))
    seed = int(torch.randint(0, 2**30, (1,)))
    fast, ref = ContinuousMemory(cfg, seed=seed), ContinuousMemory(cfg, seed=seed)
    B, D = 2, 5
    for n in range(5):
        L = int(torch.randint(4, 40, (1,)))
        x = torch.randn(B, L, D)
        fast.update(x)
        c = (torch.arange(L, dtype=torch.float64) + 0.5) / L
        if ref.coef is None:
            ref.coef = torch.stack([_dense_ridge(x[b], c, ref.basis, cfg.ridge) for b in range(B)])
        else:
            s = ref.resample_positions(B).double()  # the same draws as the fast memory (same seed)
            rows = []
            for b in range(B):
                old = ref.basis(s[b]).T @ ref.coef[b]  # the old signal at s
                u = cfg.tau * (torch.arange(cfg.num_samples, dtype=torch.float64) + 0.5) / cfg.num_samples
                t_all = torch.cat([u, cfg.tau + (1 - cfg.tau) * c])  # old samples evenly on (0, tau], in order
                rows.append(_dense_ridge(torch.cat([old, x[b].double()]), t_all, ref.basis, cfg.ridge))
            ref.coef = torch.stack(rows)
        torch.testing.assert_close(fast.coef.double(), ref.coef, rtol=1e-4, atol=1e-4)
        dens = torch.rand(B, cfg.num_points) ** 4 + 1e-3
        fast.set_density(dens)
        ref.set_density(dens)
    x_T, _ = fast.points()
    t_T, _ = trapezoid_grid(cfg.num_points, dtype=torch.float64)
    torch.testing.assert_close(x_T.double(), evaluate_signal(ref.coef, t_T, ref.basis), rtol=1e-4, atol=1e-4)


def test_continuous_attention_with_density_equals_the_two_reads():
    B, H, Hkv, Q, T, D = 2, 4, 2, 3, 90, 8
    q, k, v = torch.randn(B, H, Q, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, 6)
    _, logw = trapezoid_grid(T)
    out, dens = continuous_attention_with_density(q, k, v, logw)
    torch.testing.assert_close(out, continuous_attention(q, k, v, logw), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dens, attention_density(q, k, logw), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="logw"):
        continuous_attention_with_density(q, k, v, logw[:-1])


@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_project_points_equals_projecting_every_point(kind):
    """An affine layer applied on the coefficients equals the layer applied to the signal at every point."""
    mem = ContinuousMemory(ContinuousMemoryConfig(basis=kind, num_basis=16, num_points=150), seed=0)
    D = 6
    mem.update(torch.randn(2, 20, D))
    lin_k, lin_v = torch.nn.Linear(D, 8), torch.nn.Linear(D, 4)
    with torch.no_grad():
        lin_k.bias.normal_()
        (k, v), logw = mem.project_points(lambda c: (lin_k(c)[:, None], lin_v(c)[:, None]))
        x_T, logw_ref = mem.points()
        torch.testing.assert_close(k[:, 0], lin_k(x_T), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(v[:, 0], lin_v(x_T), rtol=1e-4, atol=1e-5)
    assert torch.equal(logw, logw_ref)


# -- sticky memories: samples drawn from the attention density, placed evenly -----------------------------


def _peaked_density(T: int, centre: float, width: float, floor: float = 1e-4) -> torch.Tensor:
    t_T, logw = trapezoid_grid(T)
    dens = torch.exp(-((t_T - centre) ** 2) / (2 * width**2)) + floor
    return (dens / (dens * logw.exp()).sum())[None]  # (1, T), integrates to 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sticky_update_leaves_no_basis_function_without_support(seed):
    """A peaked density draws nearly every sample from one span; every box still gets samples and keeps
    a non-zero, signal-sized value (placing the samples at tau * s_m left most boxes exactly 0)."""
    cfg = ContinuousMemoryConfig(num_basis=64, num_samples=512, num_bins=128, num_points=500, sticky=True)
    mem = ContinuousMemory(cfg, seed=seed)
    D = 4
    gen = torch.Generator().manual_seed(seed)
    mem.update(torch.randn(1, 64, D, generator=gen) + 3.0)  # values around 3, far from 0
    mem.set_density(_peaked_density(cfg.num_points, centre=0.3 + 0.1 * seed, width=0.01))
    hist = mem._histogram()
    assert (hist[0] > 0.05).sum() <= 8, "the density must be peaked for this test to mean anything"
    mem.update(torch.randn(1, 32, D, generator=gen) + 3.0)
    norms = mem.coef[0].norm(dim=1)  # (N,)
    assert (norms > 1.0).all(), f"boxes without support: {(norms <= 1.0).nonzero().flatten().tolist()}"
    # the samples' fit positions cover every box of (0, tau]
    u = cfg.tau * (torch.arange(cfg.num_samples) + 0.5) / cfg.num_samples
    boxes = torch.unique(mem.basis.index(u))
    assert boxes.tolist() == list(range(int(cfg.tau * cfg.num_basis)))


@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_constant_signal_stays_constant_through_sticky_updates(kind):
    cfg = ContinuousMemoryConfig(basis=kind, num_basis=32, num_samples=256, num_bins=64, num_points=400,
                                 ridge=1e-3, sticky=True)
    mem = ContinuousMemory(cfg, seed=int(torch.randint(0, 2**30, (1,))))
    c = torch.randn(5)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    for n in range(20):
        mem.update(c.expand(1, 16 + n, 5).clone())
        # a different peaked density every time: sampling must only ever see the constant
        mem.set_density(_peaked_density(cfg.num_points, float(torch.rand((), generator=gen)), 0.02))
    x_T, _ = mem.points()
    inner = slice(20, -20) if kind == "gaussian" else slice(None)  # a Gaussian fit sags at the ends
    err = (x_T[0, inner] - c).norm(dim=-1).max() / c.norm()
    assert err < 0.02, f"relative deviation from the constant: {err:.4f}"


def _reconstruction_errors(mem: ContinuousMemory, x_LD: torch.Tensor, span: tuple[int, int]) -> tuple[float, float]:
    """Mean squared error of the memory against the frames ``x_LD`` of its first chunk, inside and outside
    ``span`` (frame indices), each frame looked up at the integration point whose source is closest to it."""
    x_T, _ = mem.points()
    src = mem.source_times()[0]  # (T,) frame counts of the first chunk's frames are 0.5 .. L - 0.5
    L = x_LD.shape[0]
    frames = torch.arange(L) + 0.5
    point = (src[None, :] - frames[:, None]).abs().argmin(dim=1)  # (L,)
    err = ((x_T[0, point] - x_LD) ** 2).sum(-1)  # (L,)
    inside = torch.zeros(L, dtype=torch.bool)
    inside[span[0]:span[1]] = True
    return float(err[inside].mean()), float(err[~inside].mean())


@pytest.mark.parametrize("kind", ["box", "gaussian"])
def test_sticky_keeps_the_attended_span_and_compresses_the_rest(kind):
    """Against even resampling from the same memory: the attended span's error goes down, the rest's up."""
    base = dict(basis=kind, num_basis=64, num_samples=512, num_bins=128, num_points=1000, ridge=0.05)
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**30, (1,))))
    L, D = 64, 8  # one box per frame for the box basis: the first memory holds every frame
    x = torch.randn(L, D, generator=gen)  # detail at every frame
    new = torch.randn(1, 32, D, generator=gen)
    span = (20, 32)  # frames 20..31, memory positions ~0.31..0.5
    errs = {}
    for sticky in (True, False):
        mem = ContinuousMemory(ContinuousMemoryConfig(sticky=sticky, **base), seed=7)
        mem.update(x[None])
        mem.set_density(_peaked_density(1000, centre=(span[0] + span[1]) / 2 / L, width=0.04, floor=0.05))
        mem.update(new)
        errs[sticky] = _reconstruction_errors(mem, x, span)
    (att_s, rest_s), (att_e, rest_e) = errs[True], errs[False]
    # measured over seeds 0-4: attended 0.11-0.43x (box), 0.72-0.75x (Gaussian); the rest 2.2-2.8x
    assert att_s < 0.85 * att_e, f"attended span: sticky {att_s:.3f} vs even {att_e:.3f}"
    assert rest_s > 1.5 * rest_e, f"unattended frames: sticky {rest_s:.3f} vs even {rest_e:.3f}"


def test_source_map_follows_the_consolidations():
    """Even resampling squeezes the map: source'(t) = source(t / tau) on (0, tau]; new frames on (tau, 1]."""
    cfg = ContinuousMemoryConfig(num_basis=32, num_samples=256, num_points=401, sticky=False, tau=0.5)
    mem = ContinuousMemory(cfg)
    mem.update(torch.randn(1, 10, 3), times_BL=torch.linspace(0.0, 0.9, 10))
    src0 = mem.source_times()[0].clone()
    assert src0[0] == 0.0 and src0[-1] == pytest.approx(0.9) and (src0[1:] >= src0[:-1]).all()
    mem.update(torch.randn(1, 10, 3), times_BL=torch.linspace(1.0, 1.9, 10))
    src1 = mem.source_times()[0]
    t_T, _ = trapezoid_grid(401)
    old = t_T <= 0.5
    want_old = torch.from_numpy(__import__("numpy").interp((t_T[old] / 0.5).numpy(), t_T.numpy(), src0.numpy()))
    torch.testing.assert_close(src1[old], want_old.float(), atol=0.02, rtol=0)
    assert (src1[~old] >= 1.0).all() and src1[-1] == pytest.approx(1.9)
    # sticky: still a non-decreasing map of the same range
    mem_s = ContinuousMemory(ContinuousMemoryConfig(num_basis=32, num_samples=256, num_points=401, tau=0.5), seed=0)
    mem_s.update(torch.randn(1, 10, 3), times_BL=torch.linspace(0.0, 0.9, 10))
    mem_s.set_density(_peaked_density(401, 0.7, 0.05))
    mem_s.update(torch.randn(1, 10, 3), times_BL=torch.linspace(1.0, 1.9, 10))
    src_s = mem_s.source_times()[0]
    assert (src_s[1:] >= src_s[:-1] - 1e-6).all()
    # more of (0, tau] now holds the attended stretch (source ~0.63 around position 0.7) than under even sampling
    near = lambda s: ((s[old] > 0.5) & (s[old] < 0.75)).float().mean()
    assert near(src_s) > 1.5 * near(src1)
    with pytest.raises(ValueError, match="times"):
        mem_s.update(torch.randn(1, 10, 3), times_BL=torch.zeros(9))
