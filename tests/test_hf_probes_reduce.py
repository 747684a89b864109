"""core.hf.probes.received_attention (blockwise, the rows a caller needs) against the full probability matrix of
attention_probabilities, with every mask the attention function passes; and probe(reduce=...) hands each call over."""

from __future__ import annotations

import pytest
import torch

from core.hf.probes import attention_probabilities, received_attention


@pytest.mark.parametrize("causal, window, pad, bias", [(True, None, False, False), (True, 5, True, False),
                                                       (False, None, True, True), (True, None, False, True)])
def test_received_attention_equals_summed_probabilities(causal, window, pad, bias):
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 13, 29, 8
    q = torch.randn(B, Hq, Sq, D, generator=g)
    k = torch.randn(B, Hkv, Sk, D, generator=g)
    kp = (torch.rand(B, Sk, generator=g) < 0.2) if pad else None
    b = torch.randn(B, Hq, Sq, Sk, generator=g) if bias else None
    pattern = dict(causal=causal, window=window, key_padding=kp, bias=b, scale=None, softcap=None)
    full = attention_probabilities(q, k, last_queries=None, **pattern)  # (B, Hq, Sq, Sk)
    rows = torch.tensor([0, 3, 4, 11, 12])
    got = received_attention(q, k, rows=rows, block=2, **pattern)
    torch.testing.assert_close(got, full[:, :, rows].sum(2), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(received_attention(q, k, block=5, **pattern), full.sum(2), atol=1e-5, rtol=1e-6)
