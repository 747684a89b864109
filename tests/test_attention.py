"""Every attention backend against the reference: outputs, gradients, masks, validation, memory bounds.

Tolerances follow the flash-attention tests: the truth is the reference in float64; a backend's error
against it must stay within a small multiple of the error PyTorch itself makes in the tested dtype
(the fp32 reference for fp32, plain low-precision math for fp16/bf16).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from core import attention as attn_mod
from core.attention import BACKENDS, attention, auto_rule, choose_backend, prepare_inputs
from core.attention_chunked import chunked_attention

ROOT = Path(__file__).resolve().parents[1]
# chunked: default chunks (fused CPU block kernel); -small: ragged chunks; -plain: ragged chunks with the
# plain PyTorch block math (the path other devices take); -rows: one query per chunk.
CPU_BACKENDS = ["sdpa", "chunked", "chunked-small", "chunked-plain", "chunked-rows"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny tensors: one intra-op thread (conftest)


def run_backend(name: str, q, k, v, **kw):
    """Call ``attention`` for a backend label; the chunked variants use tiny, ragged chunks."""
    if name == "chunked-small":
        return attention(q, k, v, backend="chunked", q_chunk_size=48, k_chunk_size=37, **kw)
    if name == "chunked-rows":
        return attention(q, k, v, backend="chunked", q_chunk_size=1, k_chunk_size=256, **kw)
    if name == "chunked-plain":
        a = prepare_inputs(q, k, v, **kw)
        return chunked_attention(a.q, a.k, a.v, causal=a.causal, key_padding_mask=a.key_padding_mask,
                                 attn_bias=a.attn_bias, scale=a.scale, q_chunk_size=48, k_chunk_size=37, fused=False)
    return attention(q, k, v, backend=name, **kw)


@dataclass(frozen=True)
class Case:
    B: int
    Hq: int
    Hkv: int
    Sq: int
    Sk: int
    D: int
    Dv: int | None = None
    causal: bool = False
    padding: str | None = None  # None, "random", "full-row" (one batch entry fully padded)
    bias: tuple[int, ...] | None = None  # bias shape, dims of size 1 broadcast; "full" via explicit shape

    def __str__(self) -> str:
        return (
            f"B{self.B}H{self.Hq}/{self.Hkv}q{self.Sq}k{self.Sk}D{self.D}"
            f"{'v' + str(self.Dv) if self.Dv else ''}{'-causal' if self.causal else ''}"
            f"{'-pad_' + self.padding if self.padding else ''}"
            f"{'-bias' + 'x'.join(map(str, self.bias)) if self.bias else ''}"
        )


CASES = [
    Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=1, D=16),
    Case(B=1, Hq=1, Hkv=1, Sq=1, Sk=1, D=16, causal=True),
    Case(B=2, Hq=2, Hkv=2, Sq=113, Sk=113, D=32, causal=True),
    Case(B=1, Hq=2, Hkv=1, Sq=1023, Sk=1023, D=64, causal=True),
    Case(B=2, Hq=4, Hkv=2, Sq=128, Sk=256, D=64, padding="random", bias=(2, 4, 128, 256)),
    Case(B=2, Hq=4, Hkv=1, Sq=257, Sk=113, D=32, causal=True, padding="random"),  # rows before the frontier see nothing
    Case(B=1, Hq=2, Hkv=2, Sq=1, Sk=1023, D=16, causal=True, bias=(1, 1, 1, 1023)),
    Case(B=2, Hq=2, Hkv=1, Sq=64, Sk=64, D=8, padding="full-row", bias=(2, 1, 64, 1)),
    Case(B=1, Hq=4, Hkv=2, Sq=100, Sk=150, D=32, Dv=16, causal=True, bias=(4, 100, 150)),
    Case(B=3, Hq=3, Hkv=3, Sq=256, Sk=256, D=16, bias=(3, 1, 1, 256)),
]


def make_inputs(c: Case, dtype: torch.dtype):
    """Fresh random q, k, v (and mask, bias) as leaf tensors of ``dtype``."""
    q = torch.randn(c.B, c.Hq, c.Sq, c.D, dtype=dtype)
    k = torch.randn(c.B, c.Hkv, c.Sk, c.D, dtype=dtype)
    v = torch.randn(c.B, c.Hkv, c.Sk, c.Dv or c.D, dtype=dtype)
    mask = None
    if c.padding is not None:
        mask = torch.rand(c.B, c.Sk) < 0.3
        if c.padding == "full-row":
            mask[0] = True
    bias = torch.randn(c.bias, dtype=dtype) if c.bias is not None else None
    return q, k, v, mask, bias


def leaves(q, k, v, bias, dtype):
    out = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
    out.append(bias.detach().to(dtype).requires_grad_(True) if bias is not None else None)
    return out


def fwd_bwd(fn, q, k, v, mask, bias, causal, grad_out):
    out = fn(q, k, v, causal=causal, key_padding_mask=mask, attn_bias=bias)
    inputs = [t for t in (q, k, v, bias) if t is not None]
    grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
    return out.detach(), [g.detach() for g in grads]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def reference(q, k, v, **kw):
    return attention(q, k, v, backend="reference", **kw)


# Every case on every backend, except one-row chunks (a slow Python loop) on the long cases.
FP32_PARAMS = [
    pytest.param(case, backend, id=f"{case}-{backend}")
    for case in CASES
    for backend in CPU_BACKENDS
    if not (backend == "chunked-rows" and case.Sq * case.Sk > 300 * 300)
]


@pytest.mark.parametrize("case, backend", FP32_PARAMS)
def test_fp32_output_and_gradients_match_reference(case, backend):
    q, k, v, mask, bias = make_inputs(case, torch.float64)
    grad_out = torch.randn(case.B, case.Hq, case.Sq, case.Dv or case.D, dtype=torch.float64)
    q64, k64, v64, b64 = leaves(q, k, v, bias, torch.float64)
    truth, truth_grads = fwd_bwd(reference, q64, k64, v64, mask, b64, case.causal, grad_out)
    q32, k32, v32, b32 = leaves(q, k, v, bias, torch.float32)
    base, base_grads = fwd_bwd(reference, q32, k32, v32, mask, b32, case.causal, grad_out)
    q32, k32, v32, b32 = leaves(q, k, v, bias, torch.float32)
    got, got_grads = fwd_bwd(lambda *a, **kw: run_backend(backend, *a, **kw), q32, k32, v32, mask, b32,
                             case.causal, grad_out)
    assert got.dtype == torch.float32 and got.shape == truth.shape
    names = ["out", "dq", "dk", "dv", "dbias"]
    for name, t, b, g in zip(names, [truth, *truth_grads], [base, *base_grads], [got, *got_grads]):
        assert torch.isfinite(g).all(), f"{name} has non-finite values"
        floor = 2e-6 * (1.0 + t.abs().max().item())
        err, ref_err = max_err(g, t), max_err(b, t)
        assert err <= 4 * ref_err + floor, f"{name}: error {err:.3g} vs PyTorch fp32 error {ref_err:.3g}"


def test_fully_masked_rows_are_zero_with_zero_gradients():
    """Rows with no visible key (causal with S_q > S_k, fully padded batch entries) give exact zeros."""
    B, H, Sq, Sk, D = 2, 2, 40, 24, 16
    mask = torch.zeros(B, Sk, dtype=torch.bool)
    mask[1] = True
    for backend in ["reference", *CPU_BACKENDS]:
        q, k, v = (torch.randn(B, H, s, D, requires_grad=True) for s in (Sq, Sk, Sk))
        out = run_backend(backend, q, k, v, causal=True, key_padding_mask=mask)
        hidden = torch.zeros(B, 1, Sq, 1, dtype=torch.bool)
        hidden[:, :, : Sq - Sk] = True  # bottom-right aligned: query i sees keys j <= i - (Sq - Sk)
        hidden[1] = True
        assert torch.equal(out.masked_select(hidden), torch.zeros_like(out.masked_select(hidden))), backend
        assert out.masked_select(~hidden).abs().sum() > 0, backend
        out.sum().backward()
        assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
        assert q.grad.masked_select(hidden).abs().max() == 0, backend
        assert k.grad[1].abs().max() == 0 and v.grad[1].abs().max() == 0, backend


def naive_low_precision(q, k, v, *, causal, key_padding_mask, attn_bias, scale=None):
    """Attention computed entirely in the input dtype: PyTorch's own low-precision error."""
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
    if attn_bias is not None:
        s = s + attn_bias.to(s.dtype)
    Sq, Sk = q.shape[2], k.shape[2]
    if causal:
        hide = torch.arange(Sk)[None, :] > torch.arange(Sq)[:, None] + (Sk - Sq)
        s = s.masked_fill(hide, float("-inf"))
    if key_padding_mask is not None:
        s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.matmul(p, v)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["sdpa", "chunked", "chunked-small", "chunked-plain"])
@pytest.mark.parametrize("case", [CASES[2], CASES[4], CASES[5], CASES[8]], ids=str)
def test_low_precision_forward_matches_reference(case, backend, dtype):
    q, k, v, mask, bias = make_inputs(case, torch.float64)
    kw = dict(causal=case.causal, key_padding_mask=mask)
    truth = reference(q, k, v, attn_bias=bias, **kw)
    lq, lk, lv = q.to(dtype), k.to(dtype), v.to(dtype)
    lb = bias.to(dtype) if bias is not None else None
    base_err = max_err(naive_low_precision(lq, lk, lv, attn_bias=lb, **kw), truth)
    got = run_backend(backend, lq, lk, lv, attn_bias=lb, **kw)
    assert got.dtype == dtype
    err = max_err(got, truth)
    assert err <= 2 * base_err + 1e-3, f"error {err:.3g} vs PyTorch {dtype} error {base_err:.3g}"


def test_bias_broadcast_is_not_expanded_and_gets_reduced_gradient():
    """A bias broadcast along batch, heads and queries keeps its own shape for its gradient."""
    B, H, S, D = 2, 4, 70, 8
    q, k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)
    bias = torch.randn(1, 1, 1, S, requires_grad=True)
    g_ref = torch.autograd.grad(reference(q, k, v, attn_bias=bias).square().sum(), bias)[0]
    out = attention(q, k, v, attn_bias=bias, backend="chunked", q_chunk_size=16, k_chunk_size=16)
    g = torch.autograd.grad(out.square().sum(), bias)[0]
    assert g.shape == bias.shape
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "plain"])
def test_chunked_gradients_with_a_constant_bias(fused):
    """A bias without grad (a fixed mask-like bias) on the fused and the plain backward."""
    c = Case(B=2, Hq=4, Hkv=2, Sq=90, Sk=130, D=16, causal=True, padding="random", bias=(2, 4, 90, 1))
    q, k, v, mask, bias = make_inputs(c, torch.float64)
    bias = torch.cat([bias, torch.randn(2, 4, 90, 129, dtype=torch.float64)], dim=-1)
    grad_out = torch.randn(c.B, c.Hq, c.Sq, c.D, dtype=torch.float64)
    def run(fn):
        leaf = leaves(q, k, v, None, torch.float64)[:3]
        out = fn(*leaf, causal=True, key_padding_mask=mask, attn_bias=bias)
        return [out.detach(), *torch.autograd.grad(out, leaf, grad_out)]

    def chunked(q, k, v, **kw):
        a = prepare_inputs(q, k, v, **kw)
        return chunked_attention(a.q, a.k, a.v, causal=a.causal, key_padding_mask=a.key_padding_mask,
                                 attn_bias=a.attn_bias, scale=a.scale, q_chunk_size=32, k_chunk_size=32, fused=fused)

    for w, g in zip(run(reference), run(chunked)):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "plain"])
def test_chunked_skips_key_chunks_hidden_by_causality(monkeypatch, fused):
    """With causal masking, key chunks after a query chunk's frontier are never computed."""
    from core import attention_blocks, attention_fused

    seen = []
    real_block, real_scores = attention_fused.fused_block, attention_blocks.Blocks.scores

    def spy_block(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1):
        seen.append((i0, j0))
        return real_block(bl, fwd, q_rows, kc, vc, i0, i1, j0, j1)

    def spy_scores(self, q_rows, i0, i1, j0, j1):
        seen.append((i0, j0))
        return real_scores(self, q_rows, i0, i1, j0, j1)

    monkeypatch.setattr(attention_fused, "fused_block", spy_block)
    monkeypatch.setattr(attention_blocks.Blocks, "scores", spy_scores)
    S, c = 256, 64
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    a = prepare_inputs(q, k, v, causal=True)
    out = chunked_attention(a.q, a.k, a.v, causal=True, key_padding_mask=None, attn_bias=None, scale=a.scale,
                            q_chunk_size=c, k_chunk_size=c, fused=fused)
    n = S // c
    assert sorted(seen) == [(i * c, j * c) for i in range(n) for j in range(i + 1)]
    torch.testing.assert_close(out, reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_chunked_gqa_does_not_repeat_keys(monkeypatch):
    """Grouped-query attention must not call repeat_interleave / expand K, V to H_q heads."""
    def boom(*args, **kwargs):
        raise AssertionError("K/V repeated")

    q, k, v = torch.randn(1, 8, 50, 16), torch.randn(1, 2, 60, 16), torch.randn(1, 2, 60, 16)
    expected = reference(q, k, v)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave", boom)
    out = attention(q, k, v, backend="chunked", q_chunk_size=16, k_chunk_size=16)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bias_that_hides_a_whole_row_gives_zeros():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    bias = torch.randn(1, 1, 6, 9)
    bias[..., 2, :] = float("-inf")
    for backend in ["reference", *CPU_BACKENDS]:
        out = run_backend(backend, q, k, v, attn_bias=bias)
        assert torch.isfinite(out).all(), backend
        assert out[:, :, 2].abs().max() == 0, backend
        assert out[:, :, 3].abs().max() > 0, backend


# ----------------------------------------------------------------------------------------------------
# auto rule and the triton entry


def test_auto_rule_follows_the_documented_order():
    common = dict(head_dim=64, value_dim=64, score_bytes=1 << 20, memory_budget=None)
    assert auto_rule(device_type="cuda", dtype=torch.bfloat16, has_bias=False, **common) == "triton"
    assert auto_rule(device_type="cuda", dtype=torch.float16, has_bias=False, **common) == "triton"
    assert auto_rule(device_type="cuda", dtype=torch.float32, has_bias=False, **common) == "sdpa"
    assert auto_rule(device_type="cuda", dtype=torch.float16, has_bias=True, **common) == "sdpa"
    assert auto_rule(device_type="cuda", dtype=torch.float16, has_bias=False, triton_ok=False, **common) == "sdpa"
    assert auto_rule(device_type="cpu", dtype=torch.float16, has_bias=False, **common) == "sdpa"
    for d in (8, 256):
        assert auto_rule(device_type="cuda", dtype=torch.float16, has_bias=False,
                         **{**common, "head_dim": d, "value_dim": d}) == "sdpa"
    big = attn_mod.DEFAULT_MEMORY_BUDGET + 4
    assert auto_rule(device_type="cpu", dtype=torch.float32, has_bias=False, head_dim=64, value_dim=64,
                     score_bytes=big) == "chunked"
    assert auto_rule(device_type="cpu", dtype=torch.float32, has_bias=False, head_dim=64, value_dim=64,
                     score_bytes=big, memory_budget=big) == "sdpa"
    assert auto_rule(device_type="cuda", dtype=torch.float32, has_bias=True, head_dim=64, value_dim=64,
                     score_bytes=5, memory_budget=4) == "chunked"


def test_auto_dispatch_uses_memory_budget_per_call(monkeypatch):
    calls = []
    for name in ("sdpa", "chunked"):
        real = BACKENDS[name]
        monkeypatch.setitem(BACKENDS, name, lambda a, real=real, name=name: calls.append(name) or real(a))
    q, k, v = torch.randn(2, 2, 33, 16), torch.randn(2, 2, 45, 16), torch.randn(2, 2, 45, 16)
    dense = 2 * 2 * 33 * 45 * 4
    a = prepare_inputs(q, k, v)
    assert attn_mod.dense_score_bytes(a) == dense
    assert choose_backend(a) == "sdpa"
    assert choose_backend(a, memory_budget=dense) == "sdpa"
    assert choose_backend(a, memory_budget=dense - 1) == "chunked"
    expected = reference(q, k, v, causal=True)
    out_small = attention(q, k, v, causal=True, memory_budget=dense - 1)
    out_default = attention(q, k, v, causal=True)
    assert calls == ["chunked", "sdpa"]
    torch.testing.assert_close(out_small, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out_default, expected, rtol=1e-5, atol=1e-5)


def _meta(B, Hq, Hkv, Sq, Sk, D, dtype=torch.bfloat16, **kw):
    """Validated inputs of meta tensors: shapes and dtypes only, no memory (any size can be asked about)."""
    q = torch.empty(B, Hq, Sq, D, device="meta", dtype=dtype)
    k = torch.empty(B, Hkv, Sk, D, device="meta", dtype=dtype)
    v = torch.empty(B, Hkv, Sk, kw.pop("Dv", D), device="meta", dtype=dtype)
    return prepare_inputs(q, k, v, **kw)


def test_decode_goes_to_sdpa_on_cuda_and_prefill_to_triton():
    """S_q = 1 (and up to DECODE_MAX_QUERIES) would give Triton one program per (batch, head): SDPA instead."""
    if not attn_mod.triton_installed():
        pytest.skip("triton is not installed: auto never picks it")
    cuda = dict(device_type="cuda")
    pad = torch.zeros(8, 131072, dtype=torch.bool, device="meta")
    for sq in (1, attn_mod.DECODE_MAX_QUERIES):
        a = _meta(8, 32, 8, sq, 131072, 128, causal=True, key_padding_mask=pad)
        assert choose_backend(a, **cuda) == "sdpa", sq
    assert choose_backend(_meta(8, 32, 8, attn_mod.DECODE_MAX_QUERIES + 1, 131072, 128, causal=True), **cuda) == "triton"
    assert choose_backend(_meta(1, 32, 8, 4096, 4096, 128, causal=True), **cuda) == "triton"
    # Decode whose SDPA path is not fused (D = 20) and whose scores exceed the budget: Triton after all.
    a = _meta(64, 32, 32, 1, 1 << 20, 20)
    assert choose_backend(a, **cuda) == "triton"
    assert choose_backend(a, device_type="cuda", allow_triton=False) == "chunked"
    # On the CPU (meta here) the rule is the memory rule, as before.
    assert choose_backend(_meta(8, 32, 8, 1, 131072, 128, causal=True)) == "sdpa"


def test_long_fp32_and_biased_inputs_on_cuda_use_sdpa_fused_kernels():
    """Where SDPA's memory-efficient kernel applies, long fp32 or biased CUDA inputs go to sdpa (O(S) memory),
    not to the Python chunked loop; what sdpa would materialize (its masks) still counts against the budget."""
    S = 65536
    fp32 = _meta(1, 8, 8, S, S, 64, dtype=torch.float32, causal=True)
    assert attn_mod.dense_score_bytes(fp32) > attn_mod.DEFAULT_MEMORY_BUDGET and attn_mod.sdpa_mask_bytes(fp32) == 0
    assert choose_backend(fp32, device_type="cuda") == "sdpa"
    assert choose_backend(fp32) == "chunked"  # CPU: SDPA's math kernel would build the scores
    # GQA fp32 with padding: the mask is (B, 1, 1, S_k), small; sdpa expands K/V heads itself.
    pad = torch.zeros(2, S, dtype=torch.bool, device="meta")
    gqa = _meta(2, 8, 2, S, S, 64, dtype=torch.float32, key_padding_mask=pad)
    assert attn_mod.sdpa_mask_bytes(gqa) == 2 * S * (1 + 2 * 4)
    assert choose_backend(gqa, device_type="cuda") == "sdpa"
    # A small bias row (B, H, 1, S_k) on bf16: Triton takes no bias, SDPA's memory-efficient kernel does.
    bias = torch.empty(1, 8, 1, S, device="meta", dtype=torch.bfloat16)
    biased = _meta(1, 8, 8, S, S, 128, attn_bias=bias)
    assert choose_backend(biased, device_type="cuda") == "sdpa"
    # Causal with S_q != S_k: sdpa would build an S_q x S_k mask, over the budget -> chunked (fp32) / triton.
    chunk = _meta(1, 8, 8, 16384, S, 64, dtype=torch.float32, causal=True)
    assert attn_mod.sdpa_mask_bytes(chunk) == 16384 * S * (1 + 2 * 4) > attn_mod.DEFAULT_MEMORY_BUDGET
    assert choose_backend(chunk, device_type="cuda") == "chunked"
    assert choose_backend(_meta(1, 8, 8, 16384, S, 64, causal=True), device_type="cuda") == "triton"
    # Head dims SDPA's fused kernels do not take (not a multiple of 8): the memory rule.
    odd = _meta(1, 8, 8, S, S, 20, dtype=torch.float32)
    assert choose_backend(odd, device_type="cuda") == "chunked"


def test_sdpa_mask_shapes_match_what_sdpa_builds():
    """sdpa_mask_bytes counts the mask _sdpa hands to SDPA: none for plain / square causal / one-query causal."""
    assert attn_mod.sdpa_mask_bytes(_meta(2, 4, 4, 64, 64, 32, causal=True)) == 0
    assert attn_mod.sdpa_mask_bytes(_meta(2, 4, 4, 1, 64, 32, causal=True)) == 0  # one query sees every key
    assert attn_mod.sdpa_mask_bytes(_meta(2, 4, 4, 33, 64, 32, causal=True)) == 33 * 64 * (1 + 2 * 2)
    pad = torch.zeros(2, 64, dtype=torch.bool, device="meta")
    assert attn_mod.sdpa_mask_bytes(_meta(2, 4, 4, 33, 64, 32, causal=True, key_padding_mask=pad)) == 2 * 33 * 64 * 5


def test_one_query_causal_sdpa_equals_reference():
    """sdpa drops the causal mask for S_q = 1 (bottom-right aligned, it sees every key): same result."""
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 37, 16), torch.randn(2, 2, 37, 16)
    pad = torch.rand(2, 37) < 0.3
    for kw in ({"causal": True}, {"causal": True, "key_padding_mask": pad}):
        torch.testing.assert_close(attention(q, k, v, backend="sdpa", **kw), reference(q, k, v, **kw))


@pytest.mark.parametrize(
    "Sq, mask_kind, causal, folds",
    [
        (1, "padding", False, True),  # decode with a padding mask: the group folds into the query axis
        (1, "head-bias", False, True),  # decode with a per-head bias row (1, Hq, 1, Sk)
        (5, "padding", False, True),  # non-causal prefill with padding
        (7, "none", True, False),  # causal (is_causal, fp32): K/V expanded
        (5, "query-bias", False, False),  # a bias per query row: K/V expanded
    ],
)
def test_sdpa_gqa_mapping_for_cuda_kernels_matches_reference(Sq, mask_kind, causal, folds, monkeypatch):
    """On CUDA, fp32 or masked GQA calls cannot use SDPA's own GQA (flash only): the heads are folded into
    the query axis (no K/V copy) where the mask does not vary per query, else K/V are expanded. Checked on
    the CPU with the CUDA rules forced; the folded path must never expand K/V."""
    B, Hq, Hkv, Sk, D = 2, 8, 2, 37, 16
    q, k, v = torch.randn(B, Hq, Sq, D), torch.randn(B, Hkv, Sk, D), torch.randn(B, Hkv, Sk, D)
    kpm, bias, mask = None, None, None
    if mask_kind == "padding":
        kpm = torch.rand(B, Sk) < 0.3
        kpm[:, 0] = False
        mask = ~kpm[:, None, None, :]
    elif mask_kind == "head-bias":
        bias = torch.randn(1, Hq, 1, Sk)
        mask = bias
    elif mask_kind == "query-bias":
        bias = torch.randn(B, Hq, Sq, Sk)
        mask = bias
    if causal:  # square causal: SDPA's is_causal, no mask
        k, v = k[:, :, :Sq], v[:, :, :Sq]
    want = reference(q, k, v, causal=causal, key_padding_mask=kpm, attn_bias=bias)
    if folds:
        monkeypatch.setattr(attn_mod, "_expand_kv", lambda *a: pytest.fail("the folded path copied K/V"))
    out = attn_mod._sdpa_call(q, k, v, mask, is_causal=causal, scale=D**-0.5, groups=Hq // Hkv,
                              per_query_mask=causal, cuda_rules=True)  # fmt: skip
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_auto_falls_back_when_the_triton_kernel_declines(monkeypatch):
    """A ValueError from the kernel (a limit, a tile that does not fit the GPU) sends auto to the rule without
    Triton, with the same result."""
    calls = []

    def declining(a):
        calls.append("triton")
        raise ValueError("Triton _attn_fwd with {'BLOCK_M': 512} does not fit this GPU")

    monkeypatch.setitem(BACKENDS, "triton", declining)
    real_choose = attn_mod.choose_backend
    monkeypatch.setattr(attn_mod, "choose_backend",
                        lambda a, **kw: "triton" if kw.get("allow_triton", True) else real_choose(a, **kw))
    q, k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    out = attention(q, k, v, causal=True)
    assert calls == ["triton"]
    torch.testing.assert_close(out, reference(q, k, v, causal=True))
    out = attention(q, k, v, causal=True, memory_budget=0)  # the fallback obeys the budget: chunked
    torch.testing.assert_close(out, reference(q, k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_triton_backend_on_cpu_names_the_combination():
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match=r"triton.*cpu"):
        attention(q, q, q, backend="triton")
    a = prepare_inputs(q.half(), q.half(), q.half())
    assert choose_backend(a) != "triton"


# ----------------------------------------------------------------------------------------------------
# validation


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 8, 16), torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16), {}), r"q must have layout"),
        (lambda: (torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16).double(), torch.randn(2, 1, 8, 16), {}),
         r"share a dtype"),
        (lambda: (torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 8), torch.randn(2, 1, 8, 8), {}), r"head dim"),
        (lambda: (torch.randn(2, 3, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16), {}),
         r"key/value heads \(2\) must divide query heads \(3\)"),
        (lambda: (torch.randn(2, 1, 8, 16), torch.randn(1, 1, 8, 16), torch.randn(1, 1, 8, 16), {}), r"batch sizes"),
        (lambda: (torch.randn(2, 1, 8, 16), torch.randn(2, 1, 8, 16), torch.randn(2, 1, 7, 16), {}), r"must agree"),
        (lambda: (torch.randint(0, 3, (1, 1, 4, 4)),) * 3 + ({},), r"floating-point"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)), {"key_padding_mask": torch.zeros(2, 8)}),
         r"key_padding_mask must be bool"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)),
                  {"key_padding_mask": torch.zeros(2, 7, dtype=torch.bool)}), r"key_padding_mask must have shape"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)), {"attn_bias": torch.randn(3, 1, 8, 8)}),
         r"does not broadcast"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)), {"backend": "flash9"}), r"unknown attention backend"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)), {"backend": "chunked", "q_chunk_size": 0}),
         r"q_chunk_size"),
        (lambda: (*(torch.randn(2, 1, 8, 16) for _ in range(3)), {"memory_budget": -1}), r"memory_budget"),
    ],
    ids=["3d-q", "dtype-mismatch", "head-dim", "gqa-heads", "batch", "kv-length", "int-dtype", "mask-dtype",
         "mask-shape", "bias-shape", "unknown-backend", "chunk-size", "budget"],
)
def test_validation_errors_name_the_problem(make, match):
    q, k, v, kw = make()
    with pytest.raises(ValueError, match=match):
        attention(q, k, v, **kw)


# ----------------------------------------------------------------------------------------------------
# memory: chunked forward + backward stays bounded where dense scores would take 512 MiB

_MEMORY_PROBE = textwrap.dedent(
    """
    import json, sys, torch
    from core.attention import attention
    lazy = sorted(m for m in sys.modules if m.startswith(("kernels", "triton")))

    def status(key):  # bytes; virtual sizes, unlike RSS, do not shrink when the OS evicts library pages
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def current():
        return status("VmSize")

    def peak():
        return status("VmPeak")

    # Increase = peak after the run - size before it: never below what the run allocated at once.
    torch.set_num_threads(1)
    B, H, S, D, C = 1, 1, 8192, 16, 512
    q, k, v = (torch.randn(B, H, S, D, requires_grad=True) for _ in range(3))
    small = [t[:, :, :256].detach().clone().requires_grad_(True) for t in (q, k, v)]
    attention(*small, causal=True, backend="chunked", q_chunk_size=C, k_chunk_size=C).sum().backward()
    from core.attention_chunked import chunked_attention
    result = {}
    for fused in (None, False):  # the fused CPU block kernel, then the plain block math
        for t in (q, k, v):
            t.grad = None
        before = current()
        out = chunked_attention(q, k, v, causal=True, key_padding_mask=None, attn_bias=None, scale=D ** -0.5,
                                q_chunk_size=C, k_chunk_size=C, fused=fused)
        (out * torch.randn_like(out)).sum().backward()
        result["fused" if fused is None else "plain"] = peak() - before
        del out
    grads_ok = all(bool(torch.isfinite(t.grad).all()) and float(t.grad.abs().sum()) > 0 for t in (q, k, v))
    # The same probe must see a dense backend: the reference at a quarter of the length.
    s = S // 4
    qs, ks, vs = (t[:, :, :s].detach().clone().requires_grad_(True) for t in (q, k, v))
    before = current()
    attention(qs, ks, vs, causal=True, backend="reference").sum().backward()
    dense_small = peak() - before
    print(json.dumps({**result, "dense_small": dense_small, "grads_ok": grads_ok, "lazy": lazy,
                      "dense_scores": B * H * S * S * 4, "dense_small_scores": B * H * s * s * 4}))
    """
)


def test_chunked_backward_memory_is_bounded_and_kernels_load_lazily():
    res = subprocess.run([sys.executable, "-c", _MEMORY_PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout.strip().splitlines()[-1])
    # Importing core.attention must not import the Triton kernels (or triton itself).
    assert m["lazy"] == [], m["lazy"]
    assert m["grads_ok"]
    # The probe sees dense allocations: the reference at S/4 needs at least its score matrix.
    assert m["dense_small"] >= m["dense_small_scores"], m
    # Chunked forward+backward at S=8192 stays far below one dense score matrix (256 MiB), on both paths.
    assert m["fused"] < m["dense_scores"] / 8, m
    assert m["plain"] < m["dense_scores"] / 8, m


# ----------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_cuda_backends_match_reference(dtype):
    """On CUDA, auto picks triton for fp16/bf16 without bias; triton, sdpa and chunked match the reference."""
    c = Case(B=2, Hq=4, Hkv=2, Sq=257, Sk=300, D=64, causal=True, padding="random")
    q, k, v, mask, _ = make_inputs(c, torch.float64)
    truth = reference(q, k, v, causal=True, key_padding_mask=mask)
    q, k, v, mask = (t.cuda() for t in (q.to(dtype), k.to(dtype), v.to(dtype), mask))
    a = prepare_inputs(q, k, v, causal=True, key_padding_mask=mask)
    assert choose_backend(a) == ("triton" if attn_mod.triton_installed() else "sdpa")
    base_err = max_err(naive_low_precision(q.cpu(), k.cpu(), v.cpu(), causal=True, key_padding_mask=mask.cpu(),
                                           attn_bias=None), truth)
    backends = ["sdpa", "chunked", "auto"] + (["triton"] if attn_mod.triton_installed() else [])
    for backend in backends:
        out = attention(q, k, v, causal=True, key_padding_mask=mask, backend=backend)
        assert out.dtype == dtype and out.is_cuda
        err = max_err(out.cpu(), truth)
        assert err <= 2 * base_err + 1e-3, f"{backend}: error {err:.3g} vs PyTorch {dtype} error {base_err:.3g}"


@pytest.mark.gpu
def test_cuda_chunked_gradients_match_reference():
    c = Case(B=1, Hq=4, Hkv=2, Sq=200, Sk=333, D=32, causal=True, padding="random", bias=(1, 4, 1, 333))
    q, k, v, mask, bias = make_inputs(c, torch.float32)
    grad_out = torch.randn(c.B, c.Hq, c.Sq, c.D)
    rq, rk, rv, rb = leaves(q, k, v, bias, torch.float32)
    want, want_grads = fwd_bwd(reference, rq, rk, rv, mask, rb, True, grad_out)
    lq, lk, lv, lb = (t.detach().cuda().requires_grad_(True) for t in (q, k, v, bias))
    got, got_grads = fwd_bwd(lambda *a, **kw: run_backend("chunked-small", *a, **kw), lq, lk, lv, mask.cuda(), lb,
                             True, grad_out.cuda())
    for w, g in zip([want, *want_grads], [got, *got_grads]):
        torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "decode-gqa-padding", "fp32-causal", "bf16-bias-row"])
def test_cuda_auto_runs_sdpa_where_the_rule_says(kind, monkeypatch):
    """On CUDA: decode, fp32 and biased inputs run sdpa under auto (spied), match the reference, and SDPA's
    flash / memory-efficient kernels accept the call (SDPA limited to them raises if not)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ran = []
    real = BACKENDS["sdpa"]
    monkeypatch.setitem(BACKENDS, "sdpa", lambda a: ran.append("sdpa") or real(a))
    B, Hq, Hkv, Sq, Sk, D, dtype, kw = {
        "decode": (4, 8, 8, 1, 3000, 128, torch.bfloat16, {"causal": True}),
        "decode-gqa-padding": (4, 8, 2, 1, 3000, 64, torch.float16, {"causal": True, "pad": True}),
        "fp32-causal": (1, 4, 4, 1024, 1024, 64, torch.float32, {"causal": True}),
        "bf16-bias-row": (2, 4, 4, 300, 300, 64, torch.bfloat16, {"bias": True}),
    }[kind]
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype) for _ in range(2))
    kpm = (torch.rand(B, Sk, device="cuda") < 0.3) if kw.get("pad") else None
    bias = torch.randn(1, Hq, 1, Sk, device="cuda", dtype=dtype) if kw.get("bias") else None
    args = dict(causal=kw.get("causal", False), key_padding_mask=kpm, attn_bias=bias)
    a = prepare_inputs(q, k, v, **args)
    if kind != "fp32-causal":  # the small fp32 case fits the dense budget anyway; its facts say fused
        assert choose_backend(a) == "sdpa"
    assert attn_mod.dispatch_facts(a)["sdpa_fused"]
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        out = attention(q, k, v, **args)
    assert ran == ["sdpa"]
    want = reference(q.double(), k.double(), v.double(), key_padding_mask=kpm,
                     attn_bias=None if bias is None else bias.double(), causal=args["causal"])  # fmt: skip
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol)
