"""∞-Video's memory on a real Q-former, checked against an independent float64 implementation of the equations.

A tiny random InstructBLIP-Video reads a multi-chunk video with α < 1 and sticky memories. Hooks of the test record,
at every chunk and cross-attention layer, the layer's inputs (queries' hidden states, frame tokens), its ordinary
attention output, and the mixed context that reaches the layer's output projection. The test keeps its own memory in
float64, written here from the equations (box ridge fit, consolidation with old samples on ``(0, tau]`` and the new
chunk on ``(tau, 1]``, sticky draws by inverse CDF from the memory's seeded stream, Gibbs attention by the trapezoid
rule), and checks the mixed context at every chunk and layer, then the LLM input (the mean over chunks).

Breakage each check catches (applied by hand, see the issue's closing note): query heads scrambled, keys from the
value projection, τ ignored, the sticky density ignored, the new chunk placed before the old signal, the mean over
chunks replaced by the last chunk.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("decord")

from tests.test_video_hf import random_video, save_tiny_instructblip_video  # noqa: E402

ALPHA, TAU, M, BINS, T, RIDGE = 0.5, 0.6, 512, 128, 1000, 0.5  # tau off its default: ignoring it shows
CHUNK, N, FRAMES = 8, 8, 36  # 5 chunks, the last one padded (repeats its last frame)
QUESTIONS = ["what colour is the square", "how many"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("ibv64")
    return save_tiny_instructblip_video(d / "tiny"), random_video(d / "v.mp4", FRAMES, seed=7)


# -- the equations, in float64 --------------------------------------------------------------------------------------
def box(t: np.ndarray, n: int) -> np.ndarray:
    return np.clip(np.floor(t * n).astype(int), 0, n - 1)


def fit(values: np.ndarray, pos: np.ndarray, n: int) -> np.ndarray:
    """Box ridge fit: ``c_j = sum of the values placed in box j / (count_j + lambda)``. values (P, D), pos (P,)."""
    idx = box(pos, n)
    out = np.zeros((n, values.shape[1]))
    np.add.at(out, idx, values)
    return out / (np.bincount(idx, minlength=n)[:, None] + RIDGE)


class Memory64:
    """One layer's memory for one batch row, as the equations say."""

    def __init__(self, seed: int, rows: int):
        self.gen = torch.Generator().manual_seed(seed)  # the memory's own stream: uniforms for bins, then offsets
        self.coef = [None] * rows
        self.density = None  # (rows, T)

    def update(self, x_KFD: np.ndarray) -> None:
        K, F, _ = x_KFD.shape
        centres = (np.arange(F) + 0.5) / F
        if self.coef[0] is None:
            self.coef = [fit(x_KFD[k], centres, N) for k in range(K)]
            return
        t = np.linspace(0, 1, T)
        w = np.full(T, 1 / (T - 1))
        w[0] = w[-1] = 0.5 / (T - 1)
        u = torch.rand(K, M, generator=self.gen).double().numpy()
        v = torch.rand(K, M, generator=self.gen).double().numpy()
        u_pos = TAU * (np.arange(M) + 0.5) / M  # where the old samples go
        new_pos = TAU + (1 - TAU) * centres  # where the new chunk goes
        for k in range(K):
            mass = np.bincount(box(t, BINS), weights=self.density[k] * w, minlength=BINS)
            cdf = np.cumsum(mass / mass.sum())
            b = np.minimum(np.searchsorted(cdf, u[k], side="right"), BINS - 1)
            s = np.sort((b + 1 - v[k]) / BINS)  # a uniform place inside each drawn bin, in time order
            old = self.coef[k][box(s, N)]  # the old signal at the drawn positions
            self.coef[k] = fit(np.concatenate([old, x_KFD[k]]), np.concatenate([u_pos, new_pos]), N)

    def read(self, q_KHSd: np.ndarray, Wk, bk, Wv, bv) -> np.ndarray:
        """Gibbs attention ``∫ p(t) V(t) dt`` with ``p ∝ exp(q.K(t)/sqrt(d))``, trapezoid rule on T points."""
        t = np.linspace(0, 1, T)
        logw = np.log(np.r_[0.5, np.ones(T - 2), 0.5] / (T - 1))
        K, H, S, d = q_KHSd.shape
        out = np.zeros_like(q_KHSd)
        dens = np.zeros((K, T))
        for k in range(K):
            x_TD = self.coef[k][box(t, N)]
            keys = (x_TD @ Wk.T + bk).reshape(T, H, d)
            vals = (x_TD @ Wv.T + bv).reshape(T, H, d)
            for h in range(H):
                s = q_KHSd[k, h] @ keys[:, h].T / math.sqrt(d) + logw  # (S, T)
                p = np.exp(s - s.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                out[k, h] = p @ vals[:, h]
                dens[k] += (p / np.exp(logw)).sum(0)
            dens[k] /= H * S
        self.density = dens
        return out


# -- recording the real model --------------------------------------------------------------------------------------
def _read(folder, video, **cfg):
    from video.hf import HFVideoConfig, InfiniteVideoLM, cross_attentions

    lm = InfiniteVideoLM.from_hf(folder, config=HFVideoConfig(method="infinite", chunk_size=CHUNK, alpha=ALPHA, tau=TAU,
                                                              seed=5, **cfg), device="cpu", dtype="float32")
    cores = cross_attentions(lm.qformer)
    parents = [m for m in lm.qformer.modules() if getattr(m, "has_cross_attention", False)]
    seen = {i: [] for i in range(len(cores))}
    handles = []
    for i, (core, parent) in enumerate(zip(cores, parents)):
        def before(mod, args, kwargs, out, i=i):  # registered before the memory's hook: sees the ordinary attention
            seen[i].append({"hidden": kwargs.get("hidden_states", args[0] if args else None).double(),
                            "enc": kwargs["encoder_hidden_states"].double(),
                            "short": (out[0] if isinstance(out, tuple) else out).double()})

        def mixed(mod, args, i=i):
            seen[i][-1]["mixed"] = args[0].double()
        handles.append(core.register_forward_hook(before, with_kwargs=True))
        handles.append(parent.crossattention.output.register_forward_pre_hook(mixed))
    chunk_feats = []
    handles.append(lm.projection.register_forward_hook(lambda m, a, o: chunk_feats.append(o.double())))
    res = lm.ingest(video, QUESTIONS)
    for h in handles:
        h.remove()
    return lm, cores, seen, chunk_feats, res


def test_mixed_cross_attention_equals_the_float64_equations_at_every_chunk_and_layer(tiny):
    folder, video = tiny
    lm, cores, seen, _, res = _read(folder, video)
    K = len(QUESTIONS)
    assert res.num_chunks == math.ceil(FRAMES / CHUNK) >= 4
    worst = 0.0
    for i, core in enumerate(cores):
        H, d = core.num_attention_heads, core.attention_head_size
        Wq, bq = core.query.weight.double().detach().numpy(), core.query.bias.double().detach().numpy()
        Wk, bk = core.key.weight.double().detach().numpy(), core.key.bias.double().detach().numpy()
        Wv, bv = core.value.weight.double().detach().numpy(), core.value.bias.double().detach().numpy()
        mem = Memory64(seed=5 + i, rows=K)
        assert len(seen[i]) == res.num_chunks
        for c, rec in enumerate(seen[i]):
            R, Q, E = rec["short"].shape
            F = R // K
            frames = rec["enc"].mean(1).reshape(K, F, -1).numpy()  # one vector per frame
            mem.update(frames)
            q = rec["hidden"].numpy() @ Wq.T + bq  # (R, Q, E)
            q = q.reshape(K, F, Q, H, d).transpose(0, 3, 1, 2, 4).reshape(K, H, F * Q, d)
            long = mem.read(q, Wk, bk, Wv, bv)  # (K, H, F*Q, d)
            long = long.reshape(K, H, F, Q, d).transpose(0, 2, 3, 1, 4).reshape(R, Q, E)
            want = ALPHA * rec["short"].numpy() + (1 - ALPHA) * long
            got = rec["mixed"].numpy()
            err = np.abs(got - want).max() / max(1.0, np.abs(want).max())
            worst = max(worst, err)
            assert err < 2e-4, f"layer {i} chunk {c}: max relative error {err:.3g}"
            # the memory term matters: the mixed output is far from the ordinary attention alone
            assert np.abs(got - rec["short"].numpy()).max() > 1e-2
    assert worst > 0  # compared something


def test_llm_input_is_the_mean_over_chunks(tiny):
    folder, video = tiny
    _, _, _, chunk_feats, res = _read(folder, video)
    K = len(QUESTIONS)
    per_chunk = [f.reshape(K, -1, f.shape[-1]) for f in chunk_feats]  # (K, F*Q, D) per chunk
    assert len(per_chunk) == res.num_chunks >= 4
    want = torch.stack(per_chunk).mean(0)
    torch.testing.assert_close(res.features.double(), want, atol=1e-5, rtol=1e-5)
    assert (per_chunk[-1] - want).abs().max() > 1e-3  # the last chunk alone is not the mean


def test_defaults_fill_every_basis_function_and_a_mismatch_warns(tiny):
    from core.continuous import empty_basis_functions
    from video.hf import HFVideoConfig
    from video.infinite import InfiniteVideoConfig

    hf = HFVideoConfig()
    assert hf.chunk_size == 16 and empty_basis_functions(hf.memory_config(hf.chunk_size), hf.chunk_size) == (0, 0)
    small = InfiniteVideoConfig()
    assert empty_basis_functions(small.memory_config(), small.chunk_size) == (0, 0)
    # the configuration the review found (4-frame chunks, 64 boxes): 60 of 64 empty after the first chunk
    assert empty_basis_functions(HFVideoConfig(num_basis=64).memory_config(4), 4) == (60, 12)
    from video.hf import InfiniteVideoLM

    folder, video = tiny
    with pytest.warns(UserWarning, match=r"num_basis <= chunk_size \(num_basis=4"):
        lm = InfiniteVideoLM.from_hf(folder, config=HFVideoConfig(chunk_size=4, num_basis=64, alpha=0.5), device="cpu",
                                     dtype="float32")
        lm.ingest(video, QUESTIONS[:1])
