"""``"longctx"`` as a transformers attention implementation, against ``"eager"`` on the same weights (fp32).

For each family (Llama, Qwen2, Mistral with a sliding window, Gemma 2 with sliding layers and soft-capping,
Qwen2-VL, InternVL, InstructBLIP-Video) built tiny from a config: prefill logits within 1e-5, 32 greedy decode
steps with the cache give identical tokens; padded batches (left and right) match at the real positions; LoRA
gradients match; what the core cannot serve falls back with a warning that names the reason.
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
                               "bias": kw.get("attn_bias") is not None, "backend": kw.get("backend", "auto")})
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
    from transformers.masking_utils import (
        bidirectional_mask_function,
        causal_mask_function,
        or_masks,
        sdpa_mask,
        sliding_window_causal_mask_function,
    )

    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False
    cases = [
        (causal_mask_function, ("causal", None), dict(q_length=5, kv_length=12, q_offset=7)),
        (sliding_window_causal_mask_function(4), ("causal", 4), dict(q_length=12, kv_length=12, q_offset=0)),
        (sliding_window_causal_mask_function(4), ("causal", 4), dict(q_length=1, kv_length=4, q_offset=11,
                                                                      kv_offset=8)),  # fmt: skip
        (bidirectional_mask_function, ("full", None), dict(q_length=12, kv_length=12, q_offset=0)),
        (causal_mask_function, ("causal", None), dict(q_length=4, kv_length=12, q_offset=2)),  # static-cache tail
        (or_masks(causal_mask_function, lambda b, h, q, kv: kv == 0), None, dict(q_length=12, kv_length=12,
                                                                                  q_offset=0)),  # fmt: skip
    ]
    for fn, pattern, sizes in cases:
        assert B.recognise(fn) == pattern
        m = B.longctx_mask(batch_size=2, mask_function=fn, attention_mask=pad, **sizes)
        want = sdpa_mask(batch_size=2, mask_function=fn, attention_mask=pad, allow_is_causal_skip=False, **sizes)
        compact = isinstance(m, B.LongctxMask)
        assert torch.equal(m.to_bool(2, torch.device("cpu")) if compact else m, want), (pattern, sizes)
        assert compact == (pattern is not None and sizes.get("q_offset", 0) - sizes.get("kv_offset", 0)
                           == sizes["kv_length"] - sizes["q_length"])  # fmt: skip


def test_dense_patterns_are_exact_packed_sequences_and_static_cache():
    model, inputs = T.llama(B=1, S=16)
    ids = inputs["input_ids"]
    packed = torch.cat([torch.arange(6), torch.arange(10)])[None]  # two sequences in one row, no attention mask
    ref = _logits(model, "eager", {"input_ids": ids}, position_ids=packed)
    got = _logits(model, "longctx", {"input_ids": ids}, position_ids=packed)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    kw = dict(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        model.set_attn_implementation("eager")
        want = model.generate(**kw)
        model.set_attn_implementation("longctx")
        assert torch.equal(model.generate(**kw), want)


def test_fallbacks_warn_once_and_stay_exact(caplog):
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
    assert any("output_attentions" in r.getMessage() for r in caplog.records)
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


def test_an_argument_the_core_cannot_serve_goes_to_the_models_own_eager(caplog):
    """GPT-OSS passes attention sinks (``s_aux``): the core has none, so its own eager math runs, with a warning."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(**{**T.LLM, "num_hidden_layers": 2}, head_dim=16, num_local_experts=2, num_experts_per_tok=1,
                       sliding_window=6, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    model = T._finish(GptOssForCausalLM(cfg))
    torch.nn.init.normal_(model.model.layers[0].self_attn.sinks, std=2.0)  # sinks that matter
    ids = T._ids(2, 14)
    ref = _logits(model, "eager", {"input_ids": ids})
    B._WARNED.clear()
    with caplog.at_level(logging.WARNING, logger="core.hf.backend"):
        got = _logits(model, "longctx", {"input_ids": ids})
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert any("'s_aux'" in r.getMessage() for r in caplog.records)

    class Bare(torch.nn.Module):  # no modeling file with an eager function: refuse rather than drop the argument
        is_causal = True

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="'s_aux'.*attn_implementation='eager'"):
        B.longctx_attention(Bare(), q, q, q, None, s_aux=torch.zeros(2))
