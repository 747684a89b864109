"""Sliding windows and logit soft-capping in ``core.attention``: every backend that takes them against a
float64 brute-force truth built independently here (dense scores, explicit band mask), outputs and gradients."""

from __future__ import annotations

import math

import pytest
import torch

from core.attention import attention, auto_rule, choose_backend, prepare_inputs
from core.attention_chunked import chunked_attention

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def truth(q, k, v, *, window=None, softcap=None, pad=None, bias=None):
    """Causal (bottom-right) attention in float64 with an explicit band mask; rows with no key give zeros."""
    q, k, v = (t.double() for t in (q, k, v))
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    Sq, Sk = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    keep = torch.zeros(Sq, Sk, dtype=torch.bool)
    for i in range(Sq):
        pos = i + Sk - Sq
        lo = 0 if window is None else pos - window + 1
        keep[i, max(lo, 0): pos + 1] = True
    keep = keep[None, None]
    if pad is not None:
        keep = keep & ~pad[:, None, None, :]
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def chunked(q, k, v, **kw):
    a = prepare_inputs(q, k, v, causal=True, **{n: kw[n] for n in ("window", "softcap", "key_padding_mask", "attn_bias")
                                              if n in kw})
    return chunked_attention(a.q, a.k, a.v, causal=True, key_padding_mask=a.key_padding_mask, attn_bias=a.attn_bias,
                             scale=a.scale, q_chunk_size=kw.get("qc"), k_chunk_size=kw.get("kc"),
                             fused=kw.get("fused"), window=a.window, softcap=a.softcap)


CASES = [
    # (Sq, Sk, window, qc, kc, fused)
    (50, 50, 7, 16, 13, None),
    (50, 50, 7, 16, 13, False),
    (33, 80, 20, 8, 16, None),  # queries after a cached prefix
    (1, 64, 5, None, None, None),  # decode step
    (64, 64, 64, 16, 16, None),  # window = length: plain causal
    (64, 64, 1, 16, 16, False),  # each query sees only itself
]


@pytest.mark.parametrize("Sq,Sk,window,qc,kc,fused", CASES)
def test_chunked_window_matches_truth_with_gradients(Sq, Sk, window, qc, kc, fused):
    q = torch.randn(2, 4, Sq, 16, requires_grad=True)
    k = torch.randn(2, 2, Sk, 16, requires_grad=True)
    v = torch.randn(2, 2, Sk, 16, requires_grad=True)
    pad = torch.zeros(2, Sk, dtype=torch.bool)
    pad[1, :5] = True  # left padding on one row
    out = chunked(q, k, v, window=window, key_padding_mask=pad, qc=qc, kc=kc, fused=fused)
    ref = truth(q, k, v, window=window, pad=pad)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    g = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g)
    rq, rk, rv = torch.autograd.grad(ref, (q, k, v), g.double())
    for a, b in ((dq, rq), (dk, rk), (dv, rv)):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 9])
def test_softcap_chunked_and_reference_match_truth_with_gradients(window):
    q = torch.randn(1, 2, 40, 8, requires_grad=True) * 4  # large scores: the cap bites
    k = torch.randn(1, 2, 40, 8, requires_grad=True)
    v = torch.randn(1, 2, 40, 8, requires_grad=True)
    q.retain_grad()
    bias = torch.randn(1, 2, 40, 40)
    ref = truth(q, k, v, window=window, softcap=2.5, bias=bias)
    g = torch.randn(ref.shape, dtype=torch.float64)
    want = torch.autograd.grad(ref, (k, v), g)
    for out in (
        chunked(q, k, v, window=window, softcap=2.5, attn_bias=bias, qc=16, kc=12),
        attention(q, k, v, causal=True, window=window, softcap=2.5, attn_bias=bias, backend="reference"),
        attention(q, k, v, causal=True, window=window, softcap=2.5, attn_bias=bias),  # auto
    ):
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
        got = torch.autograd.grad(out, (k, v), g.float())
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)
    # the cap changes the answer: a backend ignoring it would fail above
    assert (truth(q, k, v, window=window, bias=bias) - ref).abs().max() > 1e-2


def test_sdpa_window_matches_truth_and_refuses_softcap():
    q, k, v = torch.randn(2, 4, 30, 8), torch.randn(2, 1, 30, 8), torch.randn(2, 1, 30, 8)
    out = attention(q, k, v, causal=True, window=4, backend="sdpa")
    torch.testing.assert_close(out.double(), truth(q, k, v, window=4), atol=2e-5, rtol=1e-5)
    one = attention(q[:, :, -1:], k, v, causal=True, window=4, backend="sdpa")  # decode: window still applies
    torch.testing.assert_close(one.double(), truth(q[:, :, -1:], k, v, window=4), atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, k, v, causal=True, softcap=3.0, backend="sdpa")


def test_window_and_softcap_validation_and_dispatch():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="window"):
        attention(q, q, q, causal=True, window=0)
    with pytest.raises(ValueError, match="softcap"):
        attention(q, q, q, causal=True, softcap=-1.0)
    a = prepare_inputs(q, q, q, causal=True, softcap=30.0)
    assert choose_backend(a) == "reference"
    assert choose_backend(a, memory_budget=0) == "chunked"
    common = dict(head_dim=64, value_dim=64, has_bias=False, score_bytes=1 << 40, q_len=4096)
    assert auto_rule(device_type="cuda", dtype=torch.float16, **common) == "triton"
    # the Triton kernel takes windows, caps and sinks; segment ids go to SDPA's masks or the chunked backend
    for extra in ({"has_window": True}, {"has_softcap": True}, {"has_sinks": True}, {"has_window": True, "q_len": 1}):
        assert auto_rule(device_type="cuda", dtype=torch.float16, **{**common, **extra}) == "triton", extra
    assert auto_rule(device_type="cuda", dtype=torch.float16, has_segments=True, **common) == "chunked"
    assert auto_rule(device_type="cuda", dtype=torch.float16, has_segments=True, sdpa_fused=True, **common) == "sdpa"
    for extra in ({"has_softcap": True}, {"has_sinks": True}):  # without Triton: never sdpa
        assert auto_rule(device_type="cuda", dtype=torch.float16, triton_ok=False, sdpa_fused=True,
                         **{**common, **extra}) == "chunked"  # fmt: skip


def test_cpu_masked_causal_goes_to_chunked_from_the_threshold():
    from core.attention import CPU_MASKED_CHUNKED_MIN_PAIRS

    side = int(CPU_MASKED_CHUNKED_MIN_PAIRS**0.5)
    for S, pad, causal, want in ((side, True, True, "chunked"), (side - 1, True, True, "sdpa"),
                                 (side, False, True, "sdpa"),  # no mask needed: SDPA's fused causal kernel
                                 (side, True, False, "sdpa")):  # fmt: skip
        q = torch.empty(1, 1, S, 8)
        kpm = torch.zeros(1, S, dtype=torch.bool) if pad else None
        assert choose_backend(prepare_inputs(q, q, q, causal=causal, key_padding_mask=kpm)) == want, (S, pad, causal)
    q = torch.empty(1, 1, side, 8)
    assert choose_backend(prepare_inputs(q, q, q, causal=True, window=16)) == "chunked"
