"""Triton kernel cases that run in Triton's interpreter (CPU), fp32 and fp16, small sizes.

Interpreter mode is decided when triton and the kernel modules are imported, for the whole process, so
these cases run in their own process: ``tests/test_kernels.py`` starts
``TRITON_INTERPRET=1 python -m pytest tests/_kernel_cases.py`` (run that command by hand to debug one case).
Kernel outputs are allocated filled with NaN, so an element a kernel forgets to write fails the comparison.
bf16 is not tested here: the interpreter computes bf16 dots wrongly (see the GPU tests).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("run with TRITON_INTERPRET=1 (tests/test_kernels.py does)", allow_module_level=True)

import kernels.block_sparse as bs_mod  # noqa: E402  (imported after the interpreter check on purpose)
import kernels.flash_attention as fa  # noqa: E402
from core.attention import attention  # noqa: E402
from core.blocksparse import block_sparse_attention as core_block_sparse  # noqa: E402
from core.blocksparse import select_blocks  # noqa: E402
from tests._kernel_utils import (  # noqa: E402
    INT32_SPAN,
    FarBuffer,
    assert_close_to_ref,
    check_block_sparse,
    check_dense,
    check_dense_extras,
    fwd_bwd,
    inputs,
    lowp_peer,
    nan_empty,
)


@pytest.fixture(autouse=True)
def _poison_outputs(monkeypatch):
    assert fa.is_interpreted(), "kernels were not defined in interpreter mode"
    monkeypatch.setattr(fa, "_empty", nan_empty)
    monkeypatch.setattr(bs_mod, "_empty", nan_empty)


# (B, Hq, Hkv, Sq, Sk, D, causal, pad): odd and round lengths, Sq != Sk both ways, GQA, padding.
@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,causal,pad",
    [
        pytest.param(1, 1, 1, 113, 113, 32, True, False, id="causal-113-d32"),
        pytest.param(2, 2, 1, 17, 113, 16, True, True, id="gqa-causal-pad-17x113-d16"),
        pytest.param(1, 2, 1, 113, 17, 64, True, False, id="mqa-causal-113x17-d64"),  # rows with no key
        pytest.param(2, 1, 1, 64, 40, 64, False, True, id="pad-64x40-d64"),
        pytest.param(1, 1, 1, 1, 1, 16, True, False, id="one-token"),
    ],
)
def test_flash_attention_fp32_matches_reference(B, Hq, Hkv, Sq, Sk, D, causal, pad):
    check_dense(fa, B, Hq, Hkv, Sq, Sk, D, causal, pad, torch.float32)


@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,causal,pad",
    [
        pytest.param(2, 2, 1, 80, 80, 32, True, True, id="gqa-causal-pad-80-d32"),
        pytest.param(1, 2, 2, 33, 70, 64, False, False, id="33x70-d64"),
    ],
)
def test_flash_attention_fp16_within_pytorch_error(B, Hq, Hkv, Sq, Sk, D, causal, pad):
    check_dense(fa, B, Hq, Hkv, Sq, Sk, D, causal, pad, torch.float16)


def test_flash_attention_custom_scale_and_strided_inputs():
    # Non-contiguous q/k/v (a transposed (B, S, H, D) layout), D = 48 (not a power of two), a value head
    # dim different from D, a non-default scale.
    q = torch.randn(1, 40, 2, 48).transpose(1, 2)
    k = torch.randn(1, 50, 2, 48).transpose(1, 2)
    v = torch.randn(1, 50, 2, 16).transpose(1, 2)
    out = fa.flash_attention(q, k, v, scale=0.3, causal=True)
    ref = attention(q, k, v, scale=0.3, causal=True, backend="reference")
    assert out.shape == (1, 2, 40, 16)
    assert_close_to_ref(out, ref, what="out")


@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,block,causal,pad",
    [
        pytest.param(2, 2, 1, 70, 113, 32, 32, True, True, id="gqa-causal-pad-70x113-b32"),
        pytest.param(1, 2, 2, 50, 50, 16, 20, False, False, id="block20-50"),
    ],
)
def test_block_sparse_all_blocks_equals_dense(B, Hq, Hkv, Sq, Sk, D, block, causal, pad):
    check_block_sparse(bs_mod, B, Hq, Hkv, Sq, Sk, D, block, causal, pad, torch.float32, "all")


@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,block,causal,pad,dtype",
    [
        pytest.param(2, 2, 1, 113, 113, 32, 32, True, True, torch.float32, id="fp32-gqa-causal-pad-113"),
        pytest.param(1, 2, 2, 64, 97, 64, 32, False, False, torch.float16, id="fp16-64x97-b32"),
    ],
)
def test_block_sparse_random_subset_equals_masked_reference(B, Hq, Hkv, Sq, Sk, D, block, causal, pad, dtype):
    check_block_sparse(bs_mod, B, Hq, Hkv, Sq, Sk, D, block, causal, pad, dtype, 3)


def test_block_sparse_with_selected_blocks_matches_core():
    """The kernel agrees with core's PyTorch path on an index from core's own top-k selection."""
    q, k, v, _ = inputs(1, 2, 2, 96, 96, 32, torch.float32)
    idx = select_blocks(q, k, block_size=16, topk=2, causal=True)
    out = bs_mod.block_sparse_attention(q, k, v, idx, block_size=16, causal=True)
    ref = core_block_sparse(q, k, v, idx, block_size=16, causal=True, backend="torch")
    assert_close_to_ref(out, ref, what="out")
    assert math.isfinite(out.sum().item())


# ------------------------------------------------------------------------------ offsets past 2**31 elements


@pytest.fixture
def far():
    """A FarBuffer in fp16 whose 4-D views the kernels also get as their outputs (poisoned with NaN)."""
    try:
        buf = FarBuffer(torch.float16)
    except MemoryError as e:
        pytest.skip(f"address space: {e}")
    yield buf
    del buf


@pytest.mark.parametrize("kernel", ["flash", "block_sparse"])
def test_offsets_past_int32_reach_the_last_batch(kernel, far, monkeypatch):
    """Every q/k/v/dO input and every O/dQ/dK/dV output lies in a buffer where batch entry 2 starts more than
    2**31 elements after entry 0: base offsets computed in int32 wrap (and read or write the wrong place), so
    the last batch entry's outputs and gradients must still match the reference computed on compact copies."""
    B, Hq, Hkv, S, D, block = 3, 2, 1, 40, 16, 16

    def far_empty(shape, *, like, dtype=None):
        if len(shape) == 4 and (dtype or like.dtype) == torch.float16:
            return far.view(tuple(shape), fill=float("nan"))
        return nan_empty(shape, like=like, dtype=dtype)

    q0, k0, v0, _ = inputs(B, Hq, Hkv, S, S, D, torch.float16)
    do0 = torch.randn(B, Hq, S, D, dtype=torch.float16)
    q, k, v, do = (far.view(tuple(t.shape), like=t.detach()) for t in (q0, k0, v0, do0))
    assert far.last_batch_offset(q) >= INT32_SPAN and q.stride(0) < INT32_SPAN
    nq = math.ceil(S / block)
    # Each query block: its diagonal block (so every causal row sees a key) and one random earlier block.
    diag = torch.arange(nq).expand(B, Hq, nq)
    earlier = torch.randint(0, nq, (B, Hq, nq)) % diag.clamp(min=1)
    first = torch.where(diag > 0, earlier, diag)
    second = torch.where(diag > 0, diag, -1)
    idx = torch.stack([first, second], dim=-1)  # (B, Hq, NQ, 2): ascending ids, then -1
    keep = None
    if kernel == "flash":
        def run(a, b, c):
            return fa.flash_attention(a, b, c, causal=True)
    else:
        from core.blocksparse import block_index_to_mask

        keep = block_index_to_mask(idx, block_size=block, sq=S, sk=S)

        def run(a, b, c):
            return bs_mod.block_sparse_attention(a, b, c, idx, block_size=block, causal=True)
    bias = None if keep is None else torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))

    monkeypatch.setattr(fa, "_empty", far_empty)
    monkeypatch.setattr(bs_mod, "_empty", far_empty)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    out = run(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    assert out.data_ptr() >= far.buf.data_ptr() and out.stride(0) == FarBuffer.BATCH_STRIDE  # a far output

    ref, ref_grads = fwd_bwd(
        lambda a, b, c: attention(a.float(), b.float(), c.float(), causal=True, attn_bias=bias, backend="reference"),
        q0, k0, v0, do0,
    )  # fmt: skip
    peer, peer_grads = fwd_bwd(lambda a, b, c: lowp_peer(a, b, c, causal=True, key_padding_mask=None, attn_bias=bias),
                               q0, k0, v0, do0)  # fmt: skip
    for name, got, r, p in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), (peer, *peer_grads)):
        got = got.detach()  # a view of the far buffer, which later kernels wrote to
        assert_close_to_ref(got[-1], r[-1], p[-1], what=f"{name} of the last batch entry")
        assert_close_to_ref(got, r, p, what=name)


# ------------------------------------------------------------------------------ windows, soft caps, sinks


@pytest.mark.parametrize(
    "B,Hq,Hkv,Sq,Sk,D,causal,pad,window,softcap,sinks",
    [
        pytest.param(2, 2, 1, 70, 70, 32, True, True, 13, None, None, id="causal-window13-gqa-pad"),
        pytest.param(1, 2, 2, 40, 57, 16, False, True, 9, None, None, id="bidirectional-window9-40x57"),
        pytest.param(1, 2, 1, 50, 50, 16, True, False, 20, 2.0, None, id="causal-window-softcap"),
        pytest.param(1, 1, 1, 33, 33, 16, False, False, None, 1.5, None, id="softcap-full"),
        pytest.param(2, 4, 2, 45, 45, 16, True, True, None, None, "head", id="sinks-per-head-causal-pad-gqa4:2"),
        pytest.param(1, 2, 2, 30, 47, 16, False, False, 6, 2.5, "row", id="sinks-per-row-softcap-biwindow"),
        pytest.param(1, 2, 1, 1, 40, 16, True, False, 7, None, "head", id="decode-window-sinks"),
    ],
)
def test_flash_attention_window_softcap_sinks_fp32(B, Hq, Hkv, Sq, Sk, D, causal, pad, window, softcap, sinks):
    check_dense_extras(fa, B, Hq, Hkv, Sq, Sk, D, torch.float32, causal=causal, pad=pad, window=window,
                       softcap=softcap, sinks=sinks)  # fmt: skip


def test_flash_attention_window_softcap_sinks_fp16():
    check_dense_extras(fa, 1, 2, 1, 48, 48, 32, torch.float16, causal=True, pad=True, window=11, softcap=3.0,
                       sinks="head")  # fmt: skip


def test_core_routes_softcap_and_window_calls_to_the_kernel(monkeypatch):
    """``core.attention``'s ``triton`` backend passes the window, cap and sinks through to the kernel (its device
    checks aside: the interpreter stands in for CUDA), and ``auto`` picks it for such CUDA calls."""
    import core.attention as ca

    seen = {}
    real = fa.flash_attention

    def spy(*args, **kw):
        seen.update(kw)
        return real(*args, **kw)

    monkeypatch.setattr(fa, "flash_attention", spy)
    q, k, v, _ = inputs(1, 2, 1, 20, 20, 16, torch.float32)
    sinks = torch.randn(2)
    a = ca.prepare_inputs(q, k, v, causal=True, window=5, softcap=2.0, sinks=sinks)
    out = ca.triton_kernel_call(a)
    assert seen["window"] == 5 and seen["softcap"] == 2.0 and seen["sinks"] is not None
    ref = attention(q.float(), k.float(), v.float(), causal=True, window=5, softcap=2.0, sinks=sinks,
                    backend="reference")  # fmt: skip
    assert_close_to_ref(out, ref, what="out")
    assert ca.choose_backend(ca.prepare_inputs(q.half(), k.half(), v.half(), causal=True, window=5, softcap=2.0,
                                               sinks=sinks), device_type="cuda") == "triton"  # fmt: skip
