"""What the apps need from a real model (core.hf): cache surgery, explicit positions, probes, inserted modules,
local loading. Tiny random transformers models built from configs; no weights anywhere."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")
import core.hf as H  # noqa: E402
from core.hf import backend as B  # noqa: E402
from core.hf import probes as P  # noqa: E402
from core.layers import GatedCrossAttentionBlock  # noqa: E402
from tests import _hf_tiny as T  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
H.register()


def _longctx(builder, **kw):
    model, inputs = builder(**kw)
    model.set_attn_implementation("longctx")
    return model, inputs


def _prefill(model, ids):
    with torch.no_grad():
        out = H.prefill(model, input_ids=ids)
    return out.past_key_values, out.logits


def _continue(model, cache, new, start):
    pos = torch.arange(start, start + new.shape[1]).expand(new.shape[0], -1)
    with torch.no_grad():
        return H.prefill(model, input_ids=new, position_ids=pos, cache=cache).logits


# --- cache surgery --------------------------------------------------------------------------------------------


def test_uniform_prune_equals_eager_on_the_full_cache_with_pruned_positions_masked():
    model, inputs = _longctx(T.qwen2, B=2, S=24)
    ids = inputs["input_ids"]
    cache, _ = _prefill(model, ids)
    keep = torch.randperm(24)[:14].sort().values
    pruned = H.prune_cache(cache, keep)
    assert [k.shape[2] for k, _ in H.cache_tensors(pruned)] == [14, 14]
    new = T._ids(2, 6, seed=5)
    got = _continue(model, pruned, new, 24)
    # eager on the full cache, the pruned positions hidden by an explicit 4-D mask
    model.set_attn_implementation("eager")
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=True).past_key_values
    hidden = torch.ones(24, dtype=torch.bool)
    hidden[keep] = False
    m4 = torch.zeros(2, 1, 6, 30)
    m4[..., :24] = m4[..., :24].masked_fill(hidden, torch.finfo(torch.float32).min)
    m4[..., 24:] = m4[..., 24:].masked_fill(torch.ones(6, 6, dtype=torch.bool).triu(1), torch.finfo(torch.float32).min)
    pos = torch.arange(24, 30).expand(2, -1)
    with torch.no_grad():
        ref = model(input_ids=new, position_ids=pos, past_key_values=full, attention_mask=m4).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with torch.no_grad():  # and the pruning mattered
        unpruned = model(input_ids=new, position_ids=pos, past_key_values=model(input_ids=ids).past_key_values).logits
    assert (unpruned - ref).abs().max() > 1e-3


def _per_head_keep(B, Hkv, S, counts, seed):
    g = torch.Generator().manual_seed(seed)
    keep = torch.zeros(B, Hkv, S, dtype=torch.bool)
    for b in range(B):
        for h in range(Hkv):
            keep[b, h, torch.randperm(S, generator=g)[: counts[(b + h) % len(counts)]]] = True
    return keep


@pytest.mark.parametrize("counts", [(11,), (7, 15, 11)], ids=["equal-per-head", "unequal-per-head"])
def test_per_layer_per_head_prune_equals_masking_the_full_cache(counts):
    model, inputs = _longctx(T.qwen2, B=2, S=24)
    ids = inputs["input_ids"]
    cache, _ = _prefill(model, ids)
    keeps = [_per_head_keep(2, 2, 24, counts, seed=10 + i) for i in range(2)]
    keeps[1] = keeps[1][..., :].clone()
    compact = H.prune_cache(cache, keeps)
    masked = H.prune_cache(cache, keeps, compact=False)
    kinds = {type(layer).__name__ for layer in compact.layers}
    assert kinds == ({"DynamicLayer"} if len(counts) == 1 else {"HiddenKeysLayer"})
    assert all(isinstance(layer, H.HiddenKeysLayer) for layer in masked.layers)
    if len(counts) == 1:
        assert [k.shape[2] for k, _ in H.cache_tensors(compact)] == [11, 11]
    new = T._ids(2, 5, seed=6)
    a, b = _continue(model, compact, new, 24), _continue(model, masked, new, 24)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    with torch.no_grad():  # heads really keep different tokens: sharing the first head's set changes the answer
        shared = H.prune_cache(_prefill(model, ids)[0], [k[:, :1].expand(-1, 2, -1) for k in keeps])
        assert (_continue(model, shared, new, 24) - a).abs().max() > 1e-4
    first = a[:, -1].argmax(-1)
    ta = H.greedy_decode(model, compact, first, torch.full((2,), 29), 16)
    tb = H.greedy_decode(model, masked, first, torch.full((2,), 29), 16)
    assert torch.equal(ta, tb)


def test_hidden_keys_are_honoured_by_the_attention_function_and_its_fallback():
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 9, 16), torch.randn(2, 2, 9, 16)
    hidden = torch.rand(2, 2, 9) < 0.4
    hidden[..., -5:] = False
    setattr(k, B.HIDDEN_ATTR, hidden)

    class M(torch.nn.Module):
        is_causal = True
        num_key_value_groups = 2  # as transformers' attention modules say it (its sdpa function reads it)

    mod = M().eval()
    mask = B.LongctxMask(causal=True, window=None, key_padding=None, q_length=5, kv_length=9)
    got, _ = B.longctx_attention(mod, q, k, v, mask, scaling=0.25)
    keep = torch.ones(5, 9, dtype=torch.bool).tril(4)[None, None] & ~hidden.repeat_interleave(2, 1)[:, :, None, :]
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    ref = torch.softmax((q @ kk.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf")), -1) @ vv
    torch.testing.assert_close(got, ref.transpose(1, 2), atol=1e-5, rtol=0)
    served, weights = B.longctx_attention(mod, q, k, v, mask, scaling=0.25, output_attentions=True)
    torch.testing.assert_close(served, ref.transpose(1, 2), atol=1e-5, rtol=0)
    assert (weights.masked_fill(keep, 0) == 0).all() and torch.allclose(weights.sum(-1), torch.ones(()))
    mod.train()  # dropout in training: the sdpa fallback, on a dense mask that holds the hidden keys
    fb, _ = B.longctx_attention(mod, q, k, v, mask, scaling=0.25, dropout=1e-12)
    torch.testing.assert_close(fb, ref.transpose(1, 2), atol=1e-5, rtol=0)


def test_saved_cache_reloads_bit_identically_and_is_refused_for_another_model(tmp_path):
    model, inputs = _longctx(T.qwen2, B=2, S=24)
    ids = inputs["input_ids"]
    cache, _ = _prefill(model, ids)
    keeps = [_per_head_keep(2, 2, 24, (7, 15), seed=1), torch.arange(0, 24, 2)]
    pruned = H.prune_cache(cache, keeps)
    path = tmp_path / "prefix.safetensors"
    H.save_cache(pruned, path, model, metadata={"next_position": 24, "policy": "test"})
    loaded, meta = H.load_cache(path, model)
    assert meta == {"next_position": 24, "policy": "test"}
    for a, b in zip(pruned.layers, loaded.layers):
        assert type(a) is type(b)
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        if isinstance(a, H.HiddenKeysLayer):
            assert torch.equal(a.hidden, b.hidden)
    new = T._ids(2, 4, seed=7)
    again, _ = H.load_cache(path, model)
    assert torch.equal(_continue(model, loaded, new, 24), _continue(model, H.prune_cache(cache, keeps), new, 24))
    other, _ = T.qwen2()  # same config, other random weights
    with pytest.raises(H.CacheMismatchError, match="another model"):
        H.load_cache(path, other)
    with pytest.raises(FileNotFoundError):
        H.load_cache(tmp_path / "missing.safetensors", model)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a saved longctx cache"):
        H.load_cache(tmp_path / "other.safetensors", model)
    assert again is not loaded


def test_sliding_window_cache_saves_and_continues():
    model, inputs = _longctx(T.mistral, B=1, S=20)
    cache, _ = _prefill(model, inputs["input_ids"])
    assert any(getattr(layer, "is_sliding", False) for layer in cache.layers)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        H.save_cache(cache, f"{d}/c.safetensors", model)
        loaded, _ = H.load_cache(f"{d}/c.safetensors", model)
    new = T._ids(1, 3, seed=8)
    assert torch.equal(_continue(model, loaded, new, 20), _continue(model, cache, new, 20))
    with pytest.raises(ValueError, match="sliding-window"):
        H.prune_cache(_prefill(model, inputs["input_ids"])[0], torch.arange(5))


def test_prune_rejects_bad_keep_specs():
    model, inputs = _longctx(T.qwen2, B=2, S=12)
    cache, _ = _prefill(model, inputs["input_ids"])
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        H.prune_cache(cache, torch.tensor([0, 12]))
    with pytest.raises(ValueError, match="3 entries"):
        H.prune_cache(cache, [torch.arange(3)] * 3)
    with pytest.raises(ValueError, match="per-head"):
        H.prune_cache(cache, torch.zeros(3, 2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="integer or bool"):
        H.prune_cache(cache, torch.zeros(4))


# --- explicit positions ---------------------------------------------------------------------------------------


def test_qwen2_vl_explicit_mrope_ids_through_prefill_and_decode():
    model, inputs = _longctx(T.qwen2_vl)
    pos, nxt = H.mrope_position_ids(model, inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                    image_grid_thw=inputs["image_grid_thw"])  # fmt: skip
    assert pos.shape == (3,) + inputs["input_ids"].shape
    assert not torch.equal(pos[1], pos[2]), "the image's height and width axes should differ"
    assert int(nxt) == int(pos.max()) + 1
    with torch.no_grad():
        own = model(**inputs).logits
        explicit = model(**inputs, position_ids=pos).logits
        shifted = model(**inputs, position_ids=pos + 11).logits  # RoPE is relative: a uniform shift changes nothing
        gap = pos.clone()
        gap[..., 9:] += 7  # a gap after the image does change the answer
        gapped = model(**inputs, position_ids=gap).logits
        want = model.generate(**inputs, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    torch.testing.assert_close(explicit, own, atol=1e-6, rtol=0)
    torch.testing.assert_close(shifted, own, atol=1e-4, rtol=0)
    assert (gapped - own).abs().max() > 1e-3
    with torch.no_grad():
        out = H.prefill(model, **inputs, position_ids=pos)
    first = out.logits[:, -1].argmax(-1)
    rest = H.greedy_decode(model, out.past_key_values, first, nxt, 11)
    S = inputs["input_ids"].shape[1]
    assert torch.equal(torch.cat([first[:, None], rest], 1), want[:, S:])


def test_gaps_in_explicit_ids_are_positions_not_packed_sequences():
    model, inputs = _longctx(T.llama, B=1, S=20)
    ids = inputs["input_ids"]
    gap = torch.cat([torch.arange(10), torch.arange(30, 40)])[None]
    with torch.no_grad():
        got = H.prefill(model, input_ids=ids, position_ids=gap).logits
        packed = model(input_ids=ids, position_ids=torch.cat([torch.arange(10), torch.arange(10)])[None]).logits
        model.set_attn_implementation("eager")
        ref = model(input_ids=ids, position_ids=gap, attention_mask=torch.ones_like(ids)).logits
        plain = model(input_ids=ids).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    assert (got[:, 10:] - plain[:, 10:]).abs().max() > 1e-3  # the gap moved the second half
    assert (got[:, 10:] - packed[:, 10:]).abs().max() > 1e-3  # and it still sees the first half


# --- probes ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen2", "gemma2-sliding-softcap"])
def test_probes_match_eager_attention_weights_and_hidden_states(family):
    model, inputs = _longctx(T.FAMILIES[family], B=2, S=18)
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    stack = H.decoder_layers(model)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        with H.probe(model, layers=[0, -1], last_queries=5) as rec:
            assert P.active()
            probed = model(input_ids=ids, attention_mask=mask).logits
    assert not P.active() and all(not layer._forward_hooks for layer in stack)
    assert torch.equal(probed, plain)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
    last = len(stack) - 1
    assert sorted(rec.attention) == [0, last] and len(rec.attention[0]) == 1
    for layer in (0, last):
        torch.testing.assert_close(rec.attention[layer][0], ref.attentions[layer][:, :, -5:], atol=1e-5, rtol=0)
    real = mask.bool()  # pad rows differ by convention (eager spreads them over every key, the core gives zeros)
    torch.testing.assert_close(rec.hidden[0][0][real], ref.hidden_states[1][real], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="longctx"):
        with H.probe(model, layers=[0]):
            pass
    with torch.no_grad(), H.probe(model, layers=[0], attention=False) as rec2:  # hidden states: any implementation
        model(input_ids=ids)
    assert rec2.hidden[0][0].shape == (2, 18, 64)


# --- inserted modules -----------------------------------------------------------------------------------------


def test_inserted_gated_cross_attention_is_an_exact_noop_at_gate_zero_and_reverts():
    model, inputs = _longctx(T.qwen2, B=2, S=16)
    ids = inputs["input_ids"]
    keys_before = list(model.state_dict())
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        want = model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    made = H.insert_before(model, lambda i: H.ContextInsert(GatedCrossAttentionBlock(64, 4, context_dim=32)),
                           layers=[0, -1])  # fmt: skip
    assert sorted(made) == [0, 1] and sorted(H.inserted_modules(model)) == [0, 1]
    memory = torch.randn(1, 7, 32)
    for ins in made.values():
        ins.context = memory
    stack = H.decoder_layers(model)
    assert stack[0].self_attn is stack[0].layer.self_attn and stack[0].hidden_size == 64  # reach the wrapped layer
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)
        assert torch.equal(model.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False), want)
    with pytest.raises(ValueError, match="already"):
        H.insert_before(model, {0: torch.nn.Identity()})
    with pytest.raises(ValueError, match="out of range"):
        H.insert_before(model, {5: torch.nn.Identity()})
    block = made[1].module
    with torch.no_grad():
        block.attn_gate.fill_(0.5)
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.eval()
    assert block.attn_gate.grad is not None and block.attn_gate.grad.abs() > 0
    with torch.no_grad():
        assert (model(input_ids=ids).logits - ref).abs().max() > 1e-4  # an open gate changes the model
    removed = H.revert(model)
    assert sorted(removed) == [0, 1] and list(model.state_dict()) == keys_before
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)


# --- loading --------------------------------------------------------------------------------------------------


def _tokenizer(special):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["a cat sat on the mat", "the dog ran", "long context models"] * 4,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=special))  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


def test_load_from_a_local_folder(tmp_path):
    model, inputs = T.qwen2(B=1, S=12)
    folder = tmp_path / "tiny-qwen2"
    model.save_pretrained(folder)
    _tokenizer(["<unk>", "<pad>", "</s>"]).save_pretrained(folder)
    loaded = H.load(folder, dtype="float32", device="cpu")
    m, tok = loaded
    assert type(m).__name__ == "Qwen2ForCausalLM" and m.config._attn_implementation == "longctx"
    assert not m.training and tok is loaded.tokenizer and len(tok("the cat")["input_ids"]) >= 2
    with torch.no_grad():
        torch.testing.assert_close(m(**inputs).logits, model(**inputs).logits, atol=1e-5, rtol=0)
    eager = H.load(folder, kind="causal-lm", attn="eager", processor=False)
    assert eager.model.config._attn_implementation == "eager" and eager.processor is None
    assert H.load(folder, dtype=torch.bfloat16).model.dtype == torch.bfloat16


def test_load_refuses_hub_ids_and_bad_folders(tmp_path):
    with pytest.raises(ValueError, match="hub id.*download"):
        H.load("Qwen/Qwen2-VL-2B-Instruct")
    with pytest.raises(FileNotFoundError, match="no model folder"):
        H.load(tmp_path / "absent")
    # a mistyped relative path is a missing folder (with the near miss), not "a hub id"
    (tmp_path / "runs" / "qwen2vl-tiny").mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(FileNotFoundError, match="no model folder.*did you mean runs/qwen2vl-tiny"):
            H.load("runs/qwen2vl-tiyn")
    finally:
        os.chdir(cwd)
    if not torch.cuda.is_available():  # a missing GPU is one line, before the weights are read
        from core.infra.cli import UsageError

        with pytest.raises(UsageError, match="no CUDA GPU"):
            H.load(tmp_path / "runs" / "qwen2vl-tiny", device="cuda")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        H.load(empty)
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(FileNotFoundError, match="no weights"):
        H.load(empty)
    (empty / "model.safetensors").write_bytes(b"")
    (empty / "config.json").write_text(json.dumps({"model_type": "not-a-model", "architectures": ["NotAModel"]}))
    with pytest.raises(ValueError, match="does not know model_type 'not-a-model'"):
        H.load(empty)
    (empty / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="not valid JSON"):
        H.load(empty)
    with pytest.raises(ValueError, match="is a file"):
        H.load(empty / "config.json")
    (empty / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    with pytest.raises(ValueError, match="kind"):
        H.load(empty, kind="seq2seq")
    with pytest.raises(ValueError, match="dtype"):
        H.load(empty, dtype="float8")
