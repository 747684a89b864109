"""``core.attention_indexed``: attention over the keys (or key blocks) an index lists per query, against a float64
truth that turns the index into a dense keep mask written out here; outputs and gradients."""

from __future__ import annotations

import pytest
import torch

from core.attention_indexed import blocks_to_keys, indexed_attention
from tests.test_attention_sinks_segments import keep_mask, leaves, truth

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def selected(idx: torch.Tensor, Sk: int, Hq: int) -> torch.Tensor:
    """Bool ``(B, H_q, S_q, S_k)``: key listed in the query's row (``idx``: ``(B, H_i, S_q, K)``)."""
    B, Hi, Sq, K = idx.shape
    keep = torch.zeros(B, Hi, Sq, Sk, dtype=torch.bool)
    for b, h, i, s in torch.nonzero(idx >= 0).tolist():
        keep[b, h, i, int(idx[b, h, i, s])] = True
    return keep.repeat_interleave(Hq // Hi, dim=1)


@pytest.mark.parametrize("heads", ["shared", "per-kv-head"])
@pytest.mark.parametrize("causal,window,sinks", [(True, None, False), (True, 6, True), (False, 5, False)])
def test_indexed_attention_matches_the_masked_truth(heads, causal, window, sinks):
    B, Hq, Hkv, Sq, Sk, K = 2, 4, 2, 11, 19, 7
    q, k, v = leaves(B, Hq, Hkv, Sq, Sk, 8, seed=4)
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(-1, Sk + 2, (B, 1 if heads == "shared" else Hkv, Sq, K), generator=g)  # -1, repeats, >= S_k
    pad = torch.zeros(B, Sk, dtype=torch.bool)
    pad[1, :4] = True
    seg = torch.tensor([[0] * 10 + [1] * 9, [0] * 19])
    s = torch.randn(Hq, requires_grad=True) if sinks else None
    keep = keep_mask(B, Sq, Sk, causal=causal, window=window, pad=pad, qseg=seg[:, Sk - Sq :], kseg=seg)
    keep = keep & selected(idx.clamp(max=Sk).masked_fill(idx >= Sk, -1), Sk, Hq)
    ref = truth(q, k, v, keep, None if s is None else s.view(1, Hq, 1))
    out = indexed_attention(q, k, v, idx, causal=causal, window=window, key_padding_mask=pad,
                            q_segment_ids=seg[:, Sk - Sq :], segment_ids=seg,
                            sinks=None if s is None else s.view(1, Hq, 1),
                            q_chunk_size=4)  # fmt: skip
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    grad = torch.randn(ref.shape, dtype=torch.float64)
    wrt = [q, k, v] + ([s] if s is not None else [])
    for a, b in zip(torch.autograd.grad(out, wrt, grad.float()), torch.autograd.grad(ref, wrt, grad)):
        torch.testing.assert_close(a.double(), b.double(), atol=1e-4, rtol=1e-4)
    assert (truth(q, k, v, keep_mask(B, Sq, Sk, causal=causal, window=window, pad=pad)) - ref).abs().max() > 1e-2


def test_blocks_to_keys_and_validation():
    blocks = torch.tensor([[[[0, 2, -1]]]])  # (1, 1, 1, 3): blocks 0 and 2 of size 4, over 10 keys
    assert blocks_to_keys(blocks, 4, 10).tolist() == [[[[0, 1, 2, 3, 8, 9, -1, -1, -1, -1, -1, -1]]]]
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 9, 8)
    with pytest.raises(ValueError, match=r"indices must be \(B, H_i, S_q, K\) with H_i in \(1, 2\)"):
        indexed_attention(q, kv, kv, torch.zeros(1, 4, 5, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="integer tensor"):
        indexed_attention(q, kv, kv, torch.zeros(1, 1, 5, 3))
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        blocks_to_keys(blocks, 0, 10)
