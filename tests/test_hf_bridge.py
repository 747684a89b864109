"""``"longctx"`` as a transformers attention implementation, against ``"eager"`` on the same weights (fp32).

For each family (Llama, Qwen2, Mistral with a sliding window, Gemma 2 with sliding layers and soft-capping,
Qwen2-VL, InternVL, InstructBLIP-Video) built tiny from a config: prefill logits within 1e-5, 32 greedy decode
steps with the cache give identical tokens; padded batches (left and right) match at the real positions; LoRA
gradients match; masks stay compact (packed sequences, static caches: no dense mask); dropout falls back per call
with a warning that names the reason. Keyword-carrying families (sinks, indices, ...): ``tests/test_hf_served.py``.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers")
import core.hf as H  # noqa: E402
from core.hf import backend as B  # noqa: E402
from tests import _hf_tiny as T  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
H.register()


class Spy:
    """Counts the core.attention calls the backend makes and the patterns it passes."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = B.attention

        def spy(q, k, v, **kw):
            self.calls.append({"causal": kw.get("causal"), "window": kw.get("window"), "softcap": kw.get("softcap"),
                               "bias": kw.get("attn_bias") is not None, "backend": kw.get("backend", "auto"),
                               "segments": kw.get("segment_ids") is not None})
            return real(q, k, v, **kw)

        monkeypatch.setattr(B, "attention", spy)


def _logits(model, impl, inputs, **kw):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model(**inputs, **kw).logits


@pytest.mark.parametrize("family", list(T.FAMILIES))
@pytest.mark.parametrize("backend", ["auto", "chunked"])
def test_prefill_and_greedy_decode_match_eager(family, backend, monkeypatch):
    model, inputs = T.FAMILIES[family]()
    ref = _logits(model, "eager", inputs)
    with torch.no_grad():
        want = model.generate(**inputs, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    spy = Spy(monkeypatch)
    if backend == "chunked":  # several query/key chunks per call: the online softmax merges blocks
        H.set_attention_options(model, backend="chunked", q_chunk_size=4, k_chunk_size=5)
    got = _logits(model, "longctx", inputs)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert spy.calls, "no attention call went through core.attention"
    assert not any(c["bias"] for c in spy.calls), "a compact mask was expected, a dense bias was built"
    if backend == "chunked":
        assert {c["backend"] for c in spy.calls} == {"chunked"}
    if family.startswith(("mistral", "gemma2")):
        assert {c["window"] for c in spy.calls if c["causal"]} >= {model.config.sliding_window}
    if family.startswith("gemma2"):
        assert {c["softcap"] for c in spy.calls} == {model.config.attn_logit_softcapping}
    with torch.no_grad():
        tokens = model.generate(**inputs, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    assert tokens.shape[1] == inputs["input_ids"].shape[1] + 32
    assert torch.equal(tokens, want)


@pytest.mark.parametrize("family", T.TEXT_ONLY)
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_match_eager(family, side):
    model, inputs = T.FAMILIES[family](B=3, S=20)
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    for row, n in ((1, 6), (2, 13)):
        if side == "left":
            mask[row, :n] = 0
        else:
            mask[row, -n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ref = _logits(model, "eager", {"input_ids": ids, "attention_mask": mask})
    got = _logits(model, "longctx", {"input_ids": ids, "attention_mask": mask})
    real = mask.bool()
    torch.testing.assert_close(got[real], ref[real], atol=1e-5, rtol=0)
    if side == "left":  # batched generation pads on the left
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        with torch.no_grad():
            model.set_attn_implementation("eager")
            want = model.generate(**kw)
            model.set_attn_implementation("longctx")
            assert torch.equal(model.generate(**kw), want)


def test_lora_gradients_match_eager():
    peft = pytest.importorskip("peft")
    model, inputs = T.qwen2(B=2, S=20)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                           init_lora_weights=False)  # fmt: skip  (random B: the adapters change the output)
    model = peft.get_peft_model(model, lora)
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    # Pad rows see no key: eager spreads them uniformly over every key (future ones too), transformers' sdpa and
    # core.attention give zeros. So no label is predicted from a pad position (the first real token's is dropped).
    labels = ids.masked_fill(mask == 0, -100)
    labels[1, 4] = -100

    def grads(impl, **opts):
        model.base_model.model.set_attn_implementation(impl)
        H.set_attention_options(model, **opts)
        model.zero_grad()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    loss_e, g_e = grads("eager")
    assert len(g_e) == 2 * 4 * 2 and all(g.abs().sum() > 0 for g in g_e.values())
    for opts in ({}, {"backend": "chunked", "q_chunk_size": 8, "k_chunk_size": 6}):
        loss_l, g_l = grads("longctx", **opts)
        torch.testing.assert_close(loss_l, loss_e, atol=1e-6, rtol=0)
        for name in g_e:
            torch.testing.assert_close(g_l[name], g_e[name], atol=1e-5, rtol=1e-4, msg=name)


def test_masks_stay_compact_and_match_transformers_dense_masks():
    """Every pattern transformers composes for causal, sliding (causal and bidirectional), chunked (Llama 4) and
    packed attention, at dynamic- and static-cache offsets, stays compact and equals transformers' dense mask; an
    image overlay (``or_masks``) is built densely."""
    from transformers.masking_utils import (
        and_masks,
        bidirectional_mask_function,
        blockwise_overlay,
        causal_mask_function,
        chunked_causal_mask_function,
        or_masks,
        packed_sequence_compatibility_function,
        remap_positions_for_packed_sequence,
        sdpa_mask,
        sliding_window_bidirectional_mask_function,
        sliding_window_causal_mask_function,
        sliding_window_overlay,
    )

    pad = torch.ones(2, 12, dtype=torch.bool)
    images = torch.tensor([[-1, -1, 0, 0, 0, 0, -1, -1, 1, 1, 1, -1], [-1, -1, -1, -1, 3, 3, 3, 3, 3, -1, -1, -1]])
    pad[1, :3] = False
    left = torch.tensor([0, 3])
    packed_pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]])
    packed_ids = torch.tensor([[0] * 4 + [1] * 6 + [2] * 2, [0] * 12])
    full = dict(q_length=12, kv_length=12, q_offset=0)
    cases = [  # (mask function, compact, (causal, window, has segments), sizes, padding)
        (causal_mask_function, True, (True, None, False), dict(q_length=5, kv_length=12, q_offset=7), pad),
        (causal_mask_function, True, (True, None, False), dict(q_length=2, kv_length=6, q_offset=6, kv_offset=2),
         pad),  # a key window that starts past the mask's first column: padding read at absolute key indices
        (sliding_window_causal_mask_function(4), True, (True, 4, False), full, pad),
        (sliding_window_causal_mask_function(4), True, (True, 4, False),
         dict(q_length=1, kv_length=4, q_offset=11, kv_offset=8), pad),
        (bidirectional_mask_function, True, (False, None, False), full, pad),
        (sliding_window_bidirectional_mask_function(3), True, (False, 4, False), full, pad),
        (causal_mask_function, True, (True, None, False), dict(q_length=4, kv_length=12, q_offset=2), pad),  # static
        (sliding_window_causal_mask_function(3), True, (True, 3, False), dict(q_length=1, kv_length=12, q_offset=6),
         pad),  # static cache, decode step
        (chunked_causal_mask_function(4, left), True, (True, None, True), full, pad),
        (chunked_causal_mask_function(4, left), True, (True, None, True), dict(q_length=3, kv_length=12, q_offset=9),
         pad),  # queries after a prefix
        (packed_sequence_compatibility_function(causal_mask_function, packed_pos, packed_ids), True, (True, None, True),
         full, None),
        (packed_sequence_compatibility_function(sliding_window_causal_mask_function(2), packed_pos, packed_ids), True,
         (True, 2, True), full, None),
        (or_masks(causal_mask_function, blockwise_overlay(images)), True, (True, None, False), full, pad),  # images
        (or_masks(causal_mask_function, blockwise_overlay(images)), True, (True, None, False),
         dict(q_length=5, kv_length=12, q_offset=7), pad),  # queries after a prefix
        (and_masks(sliding_window_overlay(3), or_masks(causal_mask_function, blockwise_overlay(images))), True,
         (True, 3, False), full, pad),  # Gemma 3's sliding layers
        (or_masks(sliding_window_causal_mask_function(3), blockwise_overlay(images)), False, None, full, pad),
        (or_masks(causal_mask_function, lambda b, h, q, kv: kv == 0), False, None, full, pad),  # unknown overlay
        (remap_positions_for_packed_sequence(causal_mask_function, packed_pos), False, None, full, None),  # unpaired
        (and_masks(remap_positions_for_packed_sequence(causal_mask_function, packed_pos), causal_mask_function), False,
         None, full, None),  # remapped positions without the packed segments
        (causal_mask_function, False, None, dict(q_length=4, kv_length=12, q_offset=10), pad),  # past the keys
    ]  # fmt: skip
    for fn, compact, pattern, sizes, padding in cases:
        p = B.recognise(fn)
        if pattern is not None:
            assert (p.causal, p.window, bool(p.segments)) == pattern, (pattern, sizes)
        m = B.longctx_mask(batch_size=2, mask_function=fn, attention_mask=padding, **sizes)
        want = sdpa_mask(batch_size=2, mask_function=fn, attention_mask=padding, allow_is_causal_skip=False, **sizes)
        assert isinstance(m, B.LongctxMask) == compact, (pattern, sizes)
        got = m.to_bool(2, torch.device("cpu")) if compact else m
        assert torch.equal(got, want.expand_as(got)), (pattern, sizes)


class DenseMasks:
    """Counts the dense masks the ``"longctx"`` mask function builds."""

    def __init__(self, monkeypatch):
        from core.hf import masks as M

        self.n = 0
        real = M.sdpa_mask

        def spy(**kw):
            self.n += 1
            return real(**kw)

        monkeypatch.setattr(M, "sdpa_mask", spy)


@pytest.mark.parametrize("family", ["llama", "mistral-sliding"])
def test_packed_sequences_are_served_with_segment_ids(family, monkeypatch):
    """Packed sequences (``position_ids`` restart, no attention mask, ``use_cache=False``: transformers detects the
    packing only without a cache) run as segment ids in the core: no dense mask, logits equal eager's."""
    model, inputs = T.FAMILIES[family](B=2, S=16)
    ids = inputs["input_ids"]
    packed = torch.stack([torch.cat([torch.arange(6), torch.arange(10)]), torch.cat([torch.arange(11), torch.arange(5)])])
    ref = _logits(model, "eager", {"input_ids": ids}, position_ids=packed, use_cache=False)
    dense, spy = DenseMasks(monkeypatch), Spy(monkeypatch)
    got = _logits(model, "longctx", {"input_ids": ids}, position_ids=packed, use_cache=False)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert dense.n == 0, "a dense mask was built"
    assert spy.calls and all(c["segments"] for c in spy.calls)
    # the packing matters: one sequence over all 16 tokens gives other logits
    assert (_logits(model, "eager", {"input_ids": ids}, use_cache=False) - ref).abs().max() > 1e-3


def test_a_layer_holding_other_keys_than_the_mask_is_bottom_right_causal():
    """A per-layer pruned cache (EMLoC) gives layers other key counts than the one the mask was made for: each
    layer attends causally over the keys it holds, aligned bottom-right; none is cut to the mask's length."""
    from transformers.masking_utils import causal_mask_function

    torch.manual_seed(0)
    mask = B.longctx_mask(1, 4, 7, q_offset=3, mask_function=causal_mask_function)  # made for a 7-key layer
    module = torch.nn.Module()
    for n_keys in (5, 7, 12):  # fewer, as many, more keys than the mask's
        q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, n_keys, 8), torch.randn(1, 2, n_keys, 8)
        out, _ = B.longctx_attention(module, q, k, v, mask, scaling=8 ** -0.5)
        keep = torch.arange(n_keys)[None] <= torch.arange(n_keys - 4, n_keys)[:, None]
        ref = ((q @ k.transpose(-1, -2)) * 8 ** -0.5).masked_fill(~keep, float("-inf")).softmax(-1) @ v
        torch.testing.assert_close(out, ref.transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_static_cache_generation_builds_no_dense_mask(monkeypatch):
    model, inputs = T.llama(B=1, S=16)
    kw = dict(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(**kw)
        dense = DenseMasks(monkeypatch)
        model.set_attn_implementation("longctx")
        assert torch.equal(model.generate(**kw), want)
    assert dense.n == 0


def test_dropout_falls_back_per_call_with_one_warning_and_output_attentions_is_served(caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(**T.LLM, attention_dropout=0.5))
    ids = T._ids(2, 12)
    B._WARNED.clear()
    model.set_attn_implementation("longctx")
    model.train()
    with caplog.at_level(logging.WARNING, logger="core.hf.backend"):
        for _ in range(2):
            out = model(input_ids=ids).logits
    assert torch.isfinite(out).all()
    assert sum("dropout" in r.getMessage() for r in caplog.records) == 1
    model.eval()
    caplog.clear()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="core.hf.backend"):
        got = model(input_ids=ids, output_attentions=True)
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, output_attentions=True)
    assert not caplog.records  # served: no fallback
    assert len(got.attentions) == 2 and got.attentions[0] is not None
    for a, b in zip(got.attentions, ref.attentions):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=0)


def test_attention_options_are_validated():
    model, _ = T.llama()
    with pytest.raises(ValueError, match="unknown attention options"):
        H.set_attention_options(model, chunk=3)
    assert H.set_attention_options(model, backend="reference") == 2
    assert H.set_attention_options(model) == 2
    # values are checked when set, not deep inside a later forward
    with pytest.raises(ValueError, match="'flash' is not an attention backend; accepted: auto, "):
        H.set_attention_options(model, backend="flash")
    for bad in ({"q_chunk_size": 0}, {"k_chunk_size": 2.5}, {"memory_budget": -1}):
        with pytest.raises(ValueError, match="must be a positive int"):
            H.set_attention_options(model, **bad)


def bf16_parity_errors(family: str, device: str) -> tuple[float, float]:
    """Teacher-forced prefill and 8 cached decode steps in bf16: (longctx's, bf16 eager's) max error against fp32
    eager on the same device."""
    model, inputs = T.FAMILIES[family]()
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    with torch.no_grad():
        steps = model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False)[:, -8:]

    def run(impl, dtype):
        model.to(dtype).set_attn_implementation(impl)
        x = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in inputs.items()}
        lm = model.language_model if family == "instructblip-video" else model  # its LM decodes on the cache
        pos, nxt = {}, None
        if family == "qwen2-vl":  # explicit M-RoPE ids, then text positions from the next free one
            mm = {k: x[k] for k in ("mm_token_type_ids", "image_grid_thw")}
            ids3, nxt = H.mrope_position_ids(model, x["input_ids"], **mm)
            pos = {"position_ids": ids3}
        with torch.no_grad():
            out = model(**x, **pos, use_cache=True)
            cache = getattr(out, "past_key_values", None) or out.language_model_outputs.past_key_values
            logits = [out.logits[:, -1].float()]
            for t in range(8):
                mask = torch.ones(steps.shape[0], cache.get_seq_length() + 1, dtype=torch.long, device=device)
                step_pos = {} if nxt is None else {"position_ids": (nxt + t).view(-1, 1)}
                out = lm(input_ids=steps[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True,
                         **step_pos)  # fmt: skip
                logits.append(out.logits[:, -1].float())
        return torch.stack(logits)

    truth = run("eager", torch.float32)
    err_eager = (run("eager", torch.bfloat16) - truth).abs().max()
    err_ours = (run("longctx", torch.bfloat16) - truth).abs().max()
    return float(err_ours), float(err_eager)


@pytest.mark.gpu
@pytest.mark.parametrize("family", list(T.FAMILIES))
def test_cuda_bf16_matches_eager_within_eagers_own_error(family):
    """On CUDA in bf16 (Triton/SDPA underneath): longctx's error against fp32 eager stays within 2x bf16 eager's
    own error against it, plus 0.02 (logits of a random tiny model are O(1))."""
    err_ours, err_eager = bf16_parity_errors(family, "cuda")
    assert err_ours <= 2 * err_eager + 0.02, (err_ours, err_eager)
