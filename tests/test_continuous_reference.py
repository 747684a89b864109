"""Parity with the released ∞-Video memory (``long_term_attention_gibbs.py``), and the project's three fixes.

The fixtures (``tests/fixtures/video/memory_*.safetensors``) are the release's own numbers on fixed inputs, made by
``tools/reference/video/memory_parity.py`` (see the README there). ``ContinuousMemoryConfig(reference=True)`` with the
release's sticky draws replayed reproduces: the fit after every chunk, the resampled old signal, the sticky draw
probabilities, the Gibbs density and the context vector, within 1e-5.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from core.continuous import ContinuousMemory, ContinuousMemoryConfig, read_memory

FIX = Path(__file__).resolve().parent / "fixtures" / "video"
META = json.loads((FIX / "memory_parity.json").read_text())
CASES = sorted(META["cases"])
TOL = 1e-5


def _load(name: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(FIX / f"memory_{name}.safetensors"))


def _config(meta: dict, **fixes) -> ContinuousMemoryConfig:
    return ContinuousMemoryConfig(num_basis=meta["num_basis"], basis=meta["basis"], gaussian_width=meta["gaussian_width"],
                                  ridge=meta["ridge"], tau=meta["tau"], num_samples=meta["num_samples"],
                                  sticky=meta["sticky"], num_bins=meta["num_bins"], num_points=meta["num_points"],
                                  reference=True, **fixes)  # fmt: skip


def _replay(name: str, **fixes):
    """Run the memory on the fixture's inputs with its draws; yield per chunk what the release saved and ours."""
    meta, fx = META["cases"][name], _load(name)
    H, d, Q = meta["heads"], meta["head_dim"], meta["queries"]
    lin = {}
    for p in ("key", "value"):
        lin[p] = torch.nn.Linear(meta["width"], H * d)
        with torch.no_grad():
            lin[p].weight.copy_(fx[f"{p}.weight"])
            lin[p].bias.copy_(fx[f"{p}.bias"])

    def kv(c):  # (1, n, 1024) -> (1, H, n, d) keys and values, as the release views them
        return tuple(lin[p](c).view(1, c.shape[1], H, d).transpose(1, 2) for p in ("key", "value"))

    mem = ContinuousMemory(_config(meta, **fixes), seed=0)
    with torch.no_grad():
        for c in range(meta["chunks"]):
            bins = fx.get(f"chunk{c}.draws")
            mem.update(fx[f"chunk{c}.frames"], bins=bins)
            q = fx[f"chunk{c}.queries"].view(1, Q, H, d).transpose(1, 2)
            ctx, dens = read_memory(mem, q, kv, scale=1.0 / math.sqrt(d))
            yield c, fx, mem, ctx.transpose(1, 2).reshape(1, Q, H * d), dens


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    err = (a.float() - b.float()).abs().max().item()
    scale = max(1.0, b.abs().max().item())
    assert err <= TOL * scale, f"{what}: max |ours - release| = {err:.3g} (scale {scale:.3g})"


def test_the_fixtures_name_the_release_and_cover_what_the_issue_asks():
    assert META["release"] == "deep-spin/Infinite-Video" and len(META["commit"]) == 40
    kinds = {META["cases"][c]["basis"] for c in CASES}
    assert kinds == {"box", "gaussian"}
    assert all(META["cases"][c]["chunks"] >= 3 for c in CASES)
    assert {META["cases"][c]["sticky"] for c in CASES} == {True, False}


@pytest.mark.parametrize("name", CASES)
def test_reference_switch_reproduces_the_release(name):
    seen = 0
    for c, fx, mem, ctx, dens in _replay(name):
        _close(mem.coef, fx[f"chunk{c}.coef"], f"{name} chunk {c} fit")
        _close(ctx, fx[f"chunk{c}.context"], f"{name} chunk {c} context")
        _close(dens[0], fx[f"chunk{c}.density"].mean(dim=(1, 2))[0], f"{name} chunk {c} Gibbs density")
        if c > 0:
            _close(mem.samples[..., :fx[f"chunk{c}.old_signal"].shape[-1]], fx[f"chunk{c}.old_signal"],
                   f"{name} chunk {c} consolidated old signal")
        if f"chunk{c}.draw_probs" in fx:
            _close(mem.draw_probabilities, fx[f"chunk{c}.draw_probs"], f"{name} chunk {c} sticky draw probabilities")
        seen += 1
    assert seen == META["cases"][name]["chunks"]


def test_the_project_path_is_not_the_reference():
    """Without the switch the fit differs (the project's placement): the parity test above is not vacuous."""
    name = "box_sticky"
    meta, fx = META["cases"][name], _load(name)
    cfg = _config(meta)
    cfg.reference = False
    mem = ContinuousMemory(ContinuousMemoryConfig(**{k: v for k, v in vars(cfg).items() if k not in
                                                     ("sort_draws", "all_bins", "keep_last_frame")}), seed=0)
    mem.update(fx["chunk0.frames"])
    mem.update(fx["chunk1.frames"])
    assert (mem.coef - fx["chunk1.coef"]).abs().max() > 1e-2


def test_fix_sorted_draws_keeps_time_order_and_only_reorders():
    name = "box_sticky"
    ref = {c: (mem.samples.clone() if mem.samples is not None else None, mem.coef.clone(), mem.last_positions)
           for c, _, mem, _, _ in _replay(name)}
    for c, fx, mem, _, _ in _replay(name, sort_draws=True):
        if c < 1:
            continue
        pos = mem.last_positions
        assert torch.equal(pos, pos.sort(dim=1).values)
        if c == 1:  # same draws, same old signal, sorted: the same multiset of samples
            assert torch.equal(pos, ref[c][2].sort(dim=1).values)
            a = mem.samples[0].sort(dim=0).values
            b = ref[c][0][0].sort(dim=0).values
            assert torch.allclose(a, b, atol=1e-6)
            assert (mem.coef - ref[c][1]).abs().max() > 1e-3  # placed in another order: another fit


def test_fix_all_bins_draws_the_first_bin_in_place():
    name = "box_sticky"
    meta, fx = META["cases"][name], _load(name)
    mems = {}
    for fix in (False, True):
        for c, _, mem, _, _ in _replay(name, all_bins=fix):
            if c == 1:
                mems[fix] = (mem.draw_probabilities.clone(), mem.last_positions.clone())
                break
    p_ref, pos_ref = mems[False]
    p_all, pos_all = mems[True]
    assert p_ref.shape == (1, meta["num_bins"] - 1) and p_all.shape == (1, meta["num_bins"])
    assert p_all[0, 0] > 0  # the first bin has mass and can be drawn
    torch.testing.assert_close(p_all[:, 1:] / p_all[:, 1:].sum(), p_ref, atol=1e-6, rtol=1e-5)
    # the same replayed index b: the release reads bin b + 1's mass at bin b's edge; the fix draws bin b's own mass
    assert torch.equal(pos_ref, pos_all)
    assert torch.equal(fx["chunk1.draws"], (pos_ref * meta["num_bins"]).round().long())


def test_fix_keep_last_frame_puts_t1_in_the_last_box():
    name = "box_even"
    meta = META["cases"][name]
    N, L, lam = meta["num_basis"], meta["length"], meta["ridge"]
    out = {}
    for fix in (False, True):
        for c, fx, mem, _, _ in _replay(name, keep_last_frame=fix):
            if c == 1:
                out[fix] = (mem.coef.clone(), fx, mem.samples.clone())
    (ref, fx, s_ref), (kept, _, s_kept) = out[False], out[True]
    _close(ref, fx["chunk1.coef"], "reference")
    # only two boxes change: the last (the new frame at t = 1) and the one at tau (where the last old sample, read at
    # t = 1, is placed)
    changed = (ref - kept).abs().amax(dim=-1)[0] > 1e-6
    assert changed.nonzero().flatten().tolist() == [int(meta["tau"] * N), N - 1]
    # the last box [1 - 1/N, 1] holds new frames at tau + (1 - tau) j / L; the release drops the one at t = 1
    x = fx["chunk1.frames"][0]
    j = torch.arange(1, L + 1)
    t = meta["tau"] + (1 - meta["tau"]) * j / L
    inside = t >= 1 - 1 / N - 1e-7
    torch.testing.assert_close(kept[0, -1], x[inside].sum(0) / (inside.sum() + lam), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ref[0, -1], x[inside & (t < 1 - 1e-7)].sum(0) / ((inside & (t < 1 - 1e-7)).sum() + lam),
                               atol=1e-5, rtol=1e-5)
    # and the last evenly spaced old sample (at t = 1) reads the last box instead of zero
    assert s_ref[0, -1].abs().max() == 0 and s_kept[0, -1].abs().max() > 0


def test_project_path_switches_sort_and_all_bins_apply_there_too():
    """In the project's own path the same two switches change the draws as documented (the third needs reference)."""
    base = dict(num_basis=16, num_samples=64, num_bins=8)
    hist = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.05]])
    from core.continuous import sticky_positions

    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    sorted_ = sticky_positions(hist, 64, generator=g())
    unsorted = sticky_positions(hist, 64, generator=g(), sort=False)
    assert torch.equal(sorted_, unsorted.sort(dim=1).values) and not torch.equal(sorted_, unsorted)
    flawed = sticky_positions(hist, 64, generator=g(), all_bins=False)
    assert (flawed >= 7 / 8).sum() == 0  # the last bin is never reached: every draw moved one bin to the left
    assert ((sorted_ < 1 / 8).float().mean() - 0.5).abs() < 0.2  # the first bin's mass is drawn
    with pytest.raises(ValueError, match="reference=True"):
        ContinuousMemoryConfig(**base, keep_last_frame=False)
