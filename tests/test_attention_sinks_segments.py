"""Attention sinks, segment ids, bidirectional windows and the whole-call fused mode of ``core.attention``: every
backend that takes them against a float64 truth built here independently (dense scores, a keep mask written out
pair by pair, the sink as one more softmax column of value zero, as GPT-OSS's eager attention does), outputs and
gradients."""

from __future__ import annotations

import math

import pytest
import torch

from core import attention_fused
from core.attention import attention, choose_backend, prepare_inputs

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def keep_mask(B, Sq, Sk, *, causal=False, window=None, pad=None, qseg=None, kseg=None, grp=None) -> torch.Tensor:
    """Bool ``(B, 1, Sq, Sk)`` written out pair by pair from the documented semantics (``grp``: key group ids,
    queries take those of their positions)."""
    keep = torch.zeros(B, 1, Sq, Sk, dtype=torch.bool)
    for b in range(B):
        for i in range(Sq):
            p = i + Sk - Sq
            for j in range(Sk):
                same_group = grp is not None and int(grp[b, p]) >= 0 and int(grp[b, p]) == int(grp[b, j])
                ok = not (causal and j > p and not same_group)
                if window is not None:
                    ok = ok and (p - j < window) and (causal or j - p < window)
                if pad is not None:
                    ok = ok and not bool(pad[b, j])
                if qseg is not None:
                    ok = ok and int(qseg[b, i]) == int(kseg[b, j])
                keep[b, 0, i, j] = ok
    return keep


def truth(q, k, v, keep, sinks=None):
    """float64 softmax attention; ``sinks`` broadcastable to (B, H, Sq) join the softmax as a value-zero column."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~keep, float("-inf"))
    if sinks is not None:
        col = sinks.double().expand(q.shape[0], q.shape[1], q.shape[2]).unsqueeze(-1)
        p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


def leaves(B, Hq, Hkv, Sq, Sk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g).requires_grad_(True)
            for shape in ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D))]  # fmt: skip


def assert_same(out, ref, inputs, extra=(), atol=3e-5):
    """Output and gradients of every input (q, k, v and ``extra`` leaves) agree with the float64 truth."""
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-5)
    g = torch.randn(ref.shape, dtype=torch.float64)
    wrt = [*inputs, *extra]
    got = torch.autograd.grad(out, wrt, g.to(out.dtype), allow_unused=True)
    want = torch.autograd.grad(ref, wrt, g, allow_unused=True)
    for name, a, b in zip(["dq", "dk", "dv", *[f"d_extra{i}" for i in range(len(extra))]], got, want):
        assert a is not None and b is not None, name
        torch.testing.assert_close(a.double(), b.double(), atol=5 * atol, rtol=1e-4, msg=name)


# (options): chunked in whole-call mode (no chunk sizes), fused blocks, plain blocks, the reference
ENGINES = {
    "chunked-whole": dict(backend="chunked"),
    "chunked-blocks": dict(backend="chunked", q_chunk_size=8, k_chunk_size=6),
    "reference": dict(backend="reference"),
}


@pytest.mark.parametrize("engine", list(ENGINES))
@pytest.mark.parametrize("shape", ["per-head", "per-row"])
@pytest.mark.parametrize("causal,window", [(True, None), (True, 5), (False, None)])
def test_sinks_match_the_extra_softmax_column(engine, shape, causal, window):
    B, Hq, Hkv, S = 2, 4, 2, 23
    q, k, v = leaves(B, Hq, Hkv, S, S, 16)
    sinks = (torch.randn(Hq) if shape == "per-head" else torch.randn(B, Hq, S)).mul(2).requires_grad_(True)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :6] = True  # left padding: rows 0..5 of batch 1 see no key when causal (all weight on the sink)
    keep = keep_mask(B, S, S, causal=causal, window=window, pad=pad)
    ref = truth(q, k, v, keep, sinks.view(1, Hq, 1) if shape == "per-head" else sinks)
    out = attention(q, k, v, causal=causal, window=window, key_padding_mask=pad, sinks=sinks, **ENGINES[engine])
    assert_same(out, ref, (q, k, v), (sinks,))
    # the sinks change the answer: a backend ignoring them would fail above
    assert (truth(q, k, v, keep) - ref).abs().max() > 1e-2


def test_sinks_in_the_plain_engine_with_cached_prefix_and_a_4d_shape():
    """Plain block math (``fused=False``), queries after a cached prefix, sinks given as ``(B, H, S_q, 1)``."""
    from core.attention_chunked import chunked_attention

    B, Hq, Hkv, Sq, Sk = 1, 2, 1, 9, 20
    q, k, v = leaves(B, Hq, Hkv, Sq, Sk, 8)
    sinks = torch.randn(B, Hq, Sq, 1, requires_grad=True)
    a = prepare_inputs(q, k, v, causal=True, sinks=sinks)
    assert a.sinks.shape == (B, Hq, Sq)
    out = chunked_attention(a.q, a.k, a.v, causal=True, key_padding_mask=None, attn_bias=None, scale=a.scale,
                            q_chunk_size=4, k_chunk_size=7, fused=False, sinks=a.sinks)  # fmt: skip
    assert_same(out, truth(q, k, v, keep_mask(B, Sq, Sk, causal=True), sinks.squeeze(-1)), (q, k, v), (sinks,))


def test_sinks_validation_and_dispatch():
    q = torch.randn(1, 4, 6, 8)
    with pytest.raises(ValueError, match=r"sinks of shape \(3,\) must be \(H_q,\) = \(4,\)"):
        attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks must be a float tensor"):
        attention(q, q, q, sinks=torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="'sdpa' cannot apply attention sinks"):
        attention(q, q, q, sinks=torch.zeros(4), backend="sdpa")
    a = prepare_inputs(q, q, q, causal=True, sinks=torch.zeros(4))
    assert choose_backend(a) == "reference" and choose_backend(a, memory_budget=0) == "chunked"


SEGMENT_CASES = {
    # name: (causal, window, packed segment lengths per row or None for random ids)
    "packed-causal": (True, None, [[5, 9, 10], [24]]),
    "packed-causal-window": (True, 4, [[7, 17], [3, 3, 18]]),
    "packed-bidirectional": (False, None, [[10, 14], [1, 23]]),
    "random-ids": (False, None, None),  # unsorted ids: block skipping must stay exact
}


def _segments(lengths, B, S):
    if lengths is None:
        return torch.randint(0, 3, (B, S))
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


@pytest.mark.parametrize("case", list(SEGMENT_CASES))
@pytest.mark.parametrize("backend", ["chunked-whole", "chunked-blocks", "chunked-plain", "sdpa", "reference"])
def test_segment_ids_match_truth(case, backend):
    causal, window, lengths = SEGMENT_CASES[case]
    B, Hq, Hkv, S = 2, 2, 1, 24
    q, k, v = leaves(B, Hq, Hkv, S, S, 8, seed=1)
    seg = _segments(lengths, B, S)
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[0, -2:] = True
    ref = truth(q, k, v, keep_mask(B, S, S, causal=causal, window=window, pad=pad, qseg=seg, kseg=seg))
    opts = {"chunked-whole": dict(backend="chunked"), "chunked-blocks": dict(backend="chunked", q_chunk_size=8,
            k_chunk_size=8), "sdpa": dict(backend="sdpa"), "reference": dict(backend="reference")}  # fmt: skip
    if backend == "chunked-plain":
        from core.attention_chunked import chunked_attention

        a = prepare_inputs(q, k, v, causal=causal, window=window, key_padding_mask=pad, segment_ids=seg)
        out = chunked_attention(q, k, v, causal=causal, key_padding_mask=pad, attn_bias=None, scale=a.scale,
                                q_chunk_size=5, k_chunk_size=8, fused=False, window=window,
                                q_segment_ids=a.q_segment_ids, segment_ids=a.segment_ids)  # fmt: skip
    else:
        out = attention(q, k, v, causal=causal, window=window, key_padding_mask=pad, segment_ids=seg, **opts[backend])
    assert_same(out, ref, (q, k, v))


def test_segment_ids_skip_key_chunks_of_other_segments(monkeypatch):
    """Packed sequences: a query chunk computes only key chunks that hold its own segments."""
    from core import attention_blocks

    seen = []
    real = attention_fused.fused_block

    def spy(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1):
        seen.append((i0, j0))
        return real(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1)

    monkeypatch.setattr(attention_fused, "fused_block", spy)
    S, c = 64, 16
    q, k, v = (torch.randn(1, 1, S, 8) for _ in range(3))
    seg = torch.tensor([[0] * 16 + [1] * 32 + [2] * 16])  # chunks: 0 | 1 1 | 2
    out = attention(q, k, v, causal=True, segment_ids=seg, backend="chunked", q_chunk_size=c, k_chunk_size=c)
    assert sorted(seen) == [(0, 0), (16, 16), (32, 16), (32, 32), (48, 48)]
    torch.testing.assert_close(out.double(), truth(q, k, v, keep_mask(1, S, S, causal=True, qseg=seg, kseg=seg)),
                               atol=1e-5, rtol=1e-5)  # fmt: skip
    assert attention_blocks.Blocks  # the geometry the spy's blocks come from


def test_segment_validation():
    q = torch.randn(2, 1, 6, 8)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \(2, 6\)"):
        attention(q, q, q, segment_ids=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match="segment_ids must be an integer tensor"):
        attention(q, q, q, segment_ids=torch.zeros(2, 6))
    with pytest.raises(ValueError, match="q_segment_ids needs segment_ids"):
        attention(q, q, q, q_segment_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="'triton' has no segment ids"):
        attention(q, q, q, segment_ids=torch.zeros(2, 6, dtype=torch.long), backend="triton")


@pytest.mark.parametrize("backend", ["chunked-whole", "chunked-blocks", "sdpa", "reference"])
@pytest.mark.parametrize("Sq,Sk", [(30, 30), (7, 30)])
def test_bidirectional_window_matches_truth(backend, Sq, Sk):
    B, Hq, Hkv, W = 2, 4, 2, 4
    q, k, v = leaves(B, Hq, Hkv, Sq, Sk, 8, seed=2)
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[1, :3] = True
    opts = {"chunked-whole": dict(backend="chunked"), "chunked-blocks": dict(backend="chunked", q_chunk_size=4,
            k_chunk_size=3), "sdpa": dict(backend="sdpa"), "reference": dict(backend="reference")}  # fmt: skip
    out = attention(q, k, v, window=W, key_padding_mask=pad, **opts[backend])
    assert_same(out, truth(q, k, v, keep_mask(B, Sq, Sk, window=W, pad=pad)), (q, k, v))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("Hkv", [1, 2])
@pytest.mark.parametrize("Sq,Sk", [(40, 40), (13, 40), (1, 40)])
def test_whole_call_mode_runs_one_kernel_call_and_matches_truth(causal, Hkv, Sq, Sk, monkeypatch):
    """Causal and/or padded inputs without chunk sizes run whole (never the block loop): left padding with rows
    that see no key, a cached prefix, GQA."""
    def no_blocks(*args, **kwargs):
        raise AssertionError("the block loop ran")

    monkeypatch.setattr(attention_fused, "forward_blocks", no_blocks)
    monkeypatch.setattr(attention_fused, "backward_blocks", no_blocks)
    monkeypatch.setattr("core.attention_chunked.forward_blocks", no_blocks)
    monkeypatch.setattr("core.attention_chunked.backward_blocks", no_blocks)
    B, Hq = 3, 2
    q, k, v = leaves(B, Hq, Hkv, Sq, Sk, 16, seed=3)
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[1, :30] = True  # causal: queries before key 30 see nothing
    pad[2, :] = True  # a row with every key padded
    out = attention(q, k, v, causal=causal, key_padding_mask=pad, backend="chunked")
    ref = truth(q, k, v, keep_mask(B, Sq, Sk, causal=causal, pad=pad))
    assert_same(out, ref, (q, k, v))
    assert (out[2] == 0).all()


@pytest.mark.parametrize("backend", ["chunked-blocks", "chunked-plain", "sdpa", "reference"])
@pytest.mark.parametrize("window", [None, 5])
def test_group_ids_see_their_whole_group_inside_causal_attention(backend, window):
    """Bidirectional groups (image tokens) inside causal attention, with a window and padding."""
    from core.attention_chunked import chunked_attention

    B, Hq, Hkv, S = 2, 2, 1, 30
    q, k, v = leaves(B, Hq, Hkv, S, S, 8, seed=6)
    grp = torch.full((B, S), -1)
    grp[0, 4:13] = 0  # a 9-token image crossing chunk boundaries
    grp[0, 20:24] = 1
    grp[1, 10:14] = 7
    pad = torch.zeros(B, S, dtype=torch.bool)
    pad[1, :3] = True
    ref = truth(q, k, v, keep_mask(B, S, S, causal=True, window=window, pad=pad, grp=grp))
    if backend == "chunked-plain":
        out = chunked_attention(q, k, v, causal=True, key_padding_mask=pad, attn_bias=None, scale=8**-0.5,
                                q_chunk_size=4, k_chunk_size=8, fused=False, window=window, q_group_ids=grp,
                                group_ids=grp)  # fmt: skip
    else:
        opts = {"chunked-blocks": dict(backend="chunked", q_chunk_size=4, k_chunk_size=8)}.get(backend,
                                                                                                  {"backend": backend})
        out = attention(q, k, v, causal=True, window=window, key_padding_mask=pad, group_ids=grp, **opts)
    assert_same(out, ref, (q, k, v))
    assert (truth(q, k, v, keep_mask(B, S, S, causal=True, window=window, pad=pad)) - ref).abs().max() > 1e-2
