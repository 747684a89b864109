"""Attention calls that carry extra keywords or patterns are served by the core, against ``"eager"`` (fp32, tiny random
models built from configs): GPT-OSS's sinks (``s_aux``), Inkling 2's per-row ``sinks``, ModernBERT's bidirectional windows and ``deterministic``,
Llama 4's chunked attention, DeepSeek-V3.2's ``indices``, MiniMax-M3's ``block_indices`` and Gemma 3's image tokens
(bidirectional groups inside causal and sliding layers); no call falls back to
eager and no dense mask is built (DeepSeek-V3.2's own indexer reads the mask densely: counted apart). What cannot be
served falls back for that call only; ``output_attentions`` is served."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")
import core.hf as H  # noqa: E402
from core.hf import backend as B  # noqa: E402
from core.hf import masks as M  # noqa: E402
from tests import _hf_tiny as T  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
H.register()


class Calls:
    """What the backend did: core calls (and their keywords), indexed calls, fallbacks, dense masks built."""

    def __init__(self, monkeypatch):
        self.core, self.indexed, self.fallbacks, self.dense, self.dense_getitem = [], [], [], 0, 0
        real_attention, real_indexed, real_fallback = B.attention, B.indexed_attention, B._fallback
        real_sdpa_mask, real_dense = M.sdpa_mask, M.dense_mask

        def attention(q, k, v, **kw):
            self.core.append(kw)
            return real_attention(q, k, v, **kw)

        def indexed(q, k, v, idx, **kw):
            self.indexed.append(kw)
            return real_indexed(q, k, v, idx, **kw)

        def fallback(reason, *args):
            self.fallbacks.append(reason)
            return real_fallback(reason, *args)

        def sdpa_mask(**kw):
            self.dense += 1
            return real_sdpa_mask(**kw)

        def dense(m):
            self.dense_getitem += 1
            return real_dense(m)

        monkeypatch.setattr(B, "attention", attention)
        monkeypatch.setattr(B, "indexed_attention", indexed)
        monkeypatch.setattr(B, "_fallback", fallback)
        monkeypatch.setattr(M, "sdpa_mask", sdpa_mask)
        monkeypatch.setattr(M, "dense_mask", dense)


def _run(model, impl, **inputs):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs).logits


@pytest.mark.parametrize("family", list(T.SERVED_FAMILIES))
def test_served_families_match_eager_without_fallbacks(family, monkeypatch):
    model, inputs = T.SERVED_FAMILIES[family]()
    ids = inputs.pop("input_ids")
    mask = torch.ones_like(ids)
    if family.startswith("modernbert"):
        mask[1, -7:] = 0  # an encoder: padding at the end
    else:
        mask[1, :5] = 0  # decoders: left padding
    ref = _run(model, "eager", input_ids=ids, attention_mask=mask, **inputs)
    calls = Calls(monkeypatch)
    got = _run(model, "longctx", input_ids=ids, attention_mask=mask, **inputs)
    real = mask.bool()  # rows that see no key differ by convention (eager spreads them over the masked keys)
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    assert calls.fallbacks == [] and calls.dense == 0
    assert calls.dense_getitem == (2 if family.startswith("deepseek") else 0)  # its indexer slices the mask
    served = calls.core + calls.indexed
    if family.startswith("gpt-oss"):
        assert all(kw["sinks"] is not None for kw in served) and {kw["window"] for kw in served} == {6, None}
    if family.startswith("inkling2"):  # per-row sinks (B, H, S, 1) and a position bias on both layers
        assert len(served) == 2 and all(kw["sinks"] is not None and kw["attn_bias"] is not None for kw in served)
    if family.startswith("modernbert"):  # local_attention 8: |q - kv| <= 4, core window 5, not causal
        assert {(kw["causal"], kw["window"]) for kw in served} == {(False, 5), (False, None)}
    if family.startswith("llama4"):
        assert sum(kw["segment_ids"] is not None for kw in served) == 3  # the three chunked layers
    if family.startswith("gemma3"):  # both decoder layers: the image's 4 tokens see each other
        decoder = [kw for kw in served if kw.get("causal")]
        assert len(decoder) == 2 and all(kw["group_ids"] is not None for kw in decoder)
        assert {kw["window"] for kw in decoder} == {6, None}
    if family.startswith(("deepseek", "minimax")):
        assert len(calls.indexed) == (2 if family.startswith("deepseek") else 1) and calls.core is not None


@pytest.mark.parametrize("family", ["gpt-oss-sinks", "llama4-chunked", "deepseek-v32-indices", "minimax-m3-block-indices"])
def test_served_families_decode_like_eager(family, monkeypatch):
    """Greedy decoding with the cache (queries after a prefix: sinks, chunk segments and selections at offsets)."""
    model, inputs = T.SERVED_FAMILIES[family](S=12)
    kw = dict(**inputs, max_new_tokens=10, min_new_tokens=10, do_sample=False)
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(**kw)
        calls = Calls(monkeypatch)
        model.set_attn_implementation("longctx")
        got = model.generate(**kw)
    assert torch.equal(got, want)
    assert calls.fallbacks == [] and calls.dense == 0


def test_output_attentions_is_served_per_call(monkeypatch):
    """``output_attentions``: the output from the core, the probabilities recomputed for that call (sinks
    included), equal to eager's; no fallback."""
    model, inputs = T.gpt_oss()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(**inputs, output_attentions=True)
    calls = Calls(monkeypatch)
    model.set_attn_implementation("longctx")
    with torch.no_grad():
        got = model(**inputs, output_attentions=True)
    assert calls.fallbacks == [] and len(calls.core) == 2
    for a, b in zip(got.attentions, ref.attentions, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_an_unknown_argument_falls_back_for_that_call_only(caplog):
    """A keyword the core does not know runs that call on the model's own eager attention (with a warning); the
    module's next call without it is served by the core again."""
    model, inputs = T.gpt_oss()
    attn = model.model.layers[1].self_attn
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mask = M.LongctxMask(causal=True, window=None, key_padding=None, q_length=7, kv_length=7)
    B._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="core.hf.backend"):
        odd, _ = B.longctx_attention(attn, q, k, v, mask, scaling=0.25, s_aux=attn.sinks, future_argument=1)
    assert any("'future_argument'" in r.getMessage() and "(only)" in r.getMessage() for r in caplog.records)
    served, _ = B.longctx_attention(attn, q, k, v, mask, scaling=0.25, s_aux=attn.sinks)
    torch.testing.assert_close(odd, served, atol=1e-6, rtol=0)  # the eager math of the same call

    class Bare(torch.nn.Module):  # no modeling file with an eager function: refuse rather than drop the argument
        is_causal = True

    with pytest.raises(ValueError, match="'future_argument'.*attn_implementation='eager'"):
        B.longctx_attention(Bare(), q, q, q, None, future_argument=torch.zeros(2))
