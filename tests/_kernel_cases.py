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
    assert_close_to_ref,
    check_block_sparse,
    check_dense,
    inputs,
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
