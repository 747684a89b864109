"""core.decoder: cached decoding, position ids, cache layout (per-head pruning), probes, save/load, generate."""

from __future__ import annotations

import pytest
import torch

from core.attention import attention
from core.decoder import (
    Decoder,
    DecoderConfig,
    KVCache,
    cached_attention,
    probe_attention,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BACKENDS = ("reference", "sdpa", "chunked")


def make_model(seed: int = 0, **kw) -> Decoder:
    torch.manual_seed(seed)
    cfg = dict(vocab_size=61, dim=32, depth=3, num_heads=4, num_kv_heads=2)
    cfg.update(kw)
    model = Decoder(DecoderConfig(**cfg)).eval()
    for p in model.parameters():  # random, not-small weights: differences must show
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def ids(B=2, S=11, seed=1, vocab=61):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, S), generator=g)


@torch.no_grad()
def test_config_validation():
    with pytest.raises(ValueError, match="num_kv_heads"):
        DecoderConfig(dim=32, num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="must divide dim"):
        DecoderConfig(dim=30, num_heads=4)
    with pytest.raises(ValueError, match="unknown attention backend"):
        DecoderConfig(backend="flash")
    with pytest.raises(ValueError, match="cross_every"):
        DecoderConfig(cross_every=-1)
    assert DecoderConfig(depth=9, cross_every=4).cross_layers == [0, 4, 8]
    model = make_model()
    with pytest.raises(ValueError, match="exactly one"):
        model(ids(), inputs_embeds=torch.randn(2, 11, 32))
    with pytest.raises(ValueError, match="position_ids"):
        model(ids(), position_ids=torch.arange(5))


@torch.no_grad()
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cached_decode_equals_full_recompute(num_kv_heads):
    model = make_model(num_kv_heads=num_kv_heads)
    x = ids(S=12)
    full = model(x, use_cache=False).logits
    out = model(x[:, :5])
    steps = [out.logits]
    for t in range(5, 12):
        out = model(x[:, t : t + 1], cache=out.cache)
        steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    assert out.cache.lengths() == [12, 12, 12]
    assert out.cache.next_pos.tolist() == [12, 12]


@torch.no_grad()
def test_prefill_after_cache_equals_one_long_prefill():
    model = make_model()
    x = ids(S=13)
    pos = torch.tensor([0, 1, 2, 3, 4, 9, 10, 11, 12, 20, 21, 22, 23])  # gaps: positions, not slot indices
    full = model(x, position_ids=pos)
    a = model(x[:, :4], position_ids=pos[:4])
    b = model(x[:, 4:9], position_ids=pos[4:9], cache=a.cache)
    c = model(x[:, 9:], position_ids=pos[9:], cache=b.cache)
    torch.testing.assert_close(torch.cat([a.logits, b.logits, c.logits], 1), full.logits, atol=1e-5, rtol=1e-5)
    for lf, lc in zip(full.cache.layers, c.cache.layers):
        torch.testing.assert_close(lc.k, lf.k, atol=1e-5, rtol=1e-5)
        assert torch.equal(lc.pos, lf.pos)
    assert c.cache.next_pos.tolist() == [24, 24]
    # the earlier cache is a value: extending it did not change it
    assert a.cache.lengths() == [4, 4, 4]


@torch.no_grad()
def test_position_ids_are_honoured():
    model = make_model()
    x = ids(S=9)
    base = model(x).logits
    explicit = model(x, position_ids=torch.arange(9)).logits
    assert torch.equal(base, explicit)
    # RoPE is relative: shifting every position by a constant leaves the logits unchanged ...
    shifted = model(x, position_ids=torch.arange(9) + 37).logits
    torch.testing.assert_close(shifted, base, atol=1e-4, rtol=1e-4)
    # ... while a gap, or RoPE-DHR-style repeated ids, changes them
    gap = model(x, position_ids=torch.tensor([0, 1, 2, 3, 10, 11, 12, 13, 14])).logits
    assert (gap[:, 4:] - base[:, 4:]).abs().max() > 1e-2
    torch.testing.assert_close(gap[:, :4], base[:, :4], atol=1e-5, rtol=1e-5)  # causal: earlier tokens unaffected
    shared = model(x, position_ids=torch.tensor([0, 1, 1, 1, 1, 2, 3, 4, 5])).logits
    assert (shared[:, 2:] - base[:, 2:]).abs().max() > 1e-2
    # per-row position ids: row 1 shifted only
    per_row = model(x, position_ids=torch.stack([torch.arange(9), torch.arange(9) + 100])).logits
    torch.testing.assert_close(per_row, base, atol=1e-4, rtol=1e-4)
    # continuing after a cache defaults to next_pos; explicit positions override it
    a = model(x[:, :4], position_ids=torch.arange(4) + 50)
    assert a.cache.next_pos.tolist() == [54, 54]
    b = model(x[:, 4:], cache=a.cache)
    torch.testing.assert_close(b.logits, base[:, 4:], atol=1e-4, rtol=1e-4)
    assert b.cache.layers[0].pos[0].tolist() == list(range(50, 59))


@torch.no_grad()
def test_inputs_embeds_equal_token_ids():
    model = make_model()
    x = ids()
    torch.testing.assert_close(model(inputs_embeds=model.embed(x)).logits, model(x).logits, atol=0, rtol=0)


@torch.no_grad()
def test_layer_equals_core_self_attention_block():
    """Without a cache, a decoder layer is SelfAttentionBlock.forward(causal=True, rope=...)."""
    model = make_model()
    x_BSD = torch.randn(2, 7, 32)
    pos = torch.arange(7)[None].expand(2, -1)
    rope = model.rope(pos)
    block = model.layers[1]
    ours, _, _ = model._layer(block, x_BSD, rope, pos, None, None, None)
    torch.testing.assert_close(ours, block(x_BSD, causal=True, rope=rope), atol=1e-6, rtol=1e-6)


def _pruned_cache(model, x, seed=3):
    """A cache of ``x`` pruned per KV head (different slots per head and layer) plus shared on one layer."""
    out = model(x)
    g = torch.Generator().manual_seed(seed)
    B, S = x.shape
    Hkv = model.config.num_kv_heads
    per_head = torch.stack([torch.stack([torch.randperm(S, generator=g)[:5] for _ in range(Hkv)]) for _ in range(B)])
    shared = torch.tensor([0, 2, 3, 7])
    return out.cache, out.cache.select([per_head, None, shared]), per_head


@torch.no_grad()
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_give_equal_logits(backend):
    model = make_model(num_kv_heads=2)
    x = ids(S=14)
    ref_model = make_model(num_kv_heads=2)
    ref_model.backend = "reference"
    model.backend = backend
    for layer in model.layers:  # small chunks so the chunked backend really walks several blocks
        layer.attn.attention_options = {"q_chunk_size": 3, "k_chunk_size": 4} if backend == "chunked" else {}
    torch.testing.assert_close(model(x).logits, ref_model(x).logits, atol=1e-5, rtol=1e-5)
    # prefill after a pruned per-head cache (folded heads + key padding masks)
    _, pruned, _ = _pruned_cache(ref_model, x[:, :9])
    ref = ref_model(x[:, 9:], cache=pruned)
    got = model(x[:, 9:], cache=pruned)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-5, rtol=1e-5)
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 0] = True
    torch.testing.assert_close(
        model(x[:, 9:], cache=pruned, padding_mask=pad).logits[:, 1:],
        ref_model(x[:, 9:], cache=pruned, padding_mask=pad).logits[:, 1:], atol=1e-5, rtol=1e-5,
    )


@torch.no_grad()
def test_cached_attention_per_head_mask_matches_dense_bias():
    torch.manual_seed(5)
    B, Hq, Hkv, Sk, Sq, D = 2, 4, 2, 10, 3, 8
    q, k, v = torch.randn(B, Hq, Sq, D), torch.randn(B, Hkv, Sk, D), torch.randn(B, Hkv, Sk, D)
    mask = torch.rand(B, Hkv, Sk) < 0.4
    mask[..., -Sq:] = False
    got = cached_attention(q, k, v, mask, backend="sdpa")
    bias = torch.zeros(B, Hq, Sq, Sk).masked_fill(mask.repeat_interleave(2, 1)[:, :, None, :], float("-inf"))
    want = attention(q, k, v, causal=True, attn_bias=bias, backend="reference")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # probes agree with the attention they describe: probs @ v == output rows
    qi = torch.tensor([0, 2])
    probs = probe_attention(q[:, :, qi], qi, k, mask, Sq)
    torch.testing.assert_close(probs @ v.repeat_interleave(2, 1), got[:, :, qi], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, Hq, 2))
    hidden = mask.repeat_interleave(2, 1)[:, :, None, :].expand_as(probs)
    assert torch.all(probs[hidden] == 0)
    assert torch.all(probs[:, :, 0, -2:] == 0)  # query 0 of 3 new tokens cannot see new tokens 1, 2


@torch.no_grad()
def test_per_head_select_layout():
    model = make_model()
    x = ids(S=9)
    full, pruned, per_head = _pruned_cache(model, x)
    l0 = pruned.layers[0]
    assert torch.equal(pruned.kept_counts()[0], torch.full((2, 2), 5))
    assert pruned.kept_counts()[2].tolist() == [[4, 4], [4, 4]] and pruned.layers[2].mask is None
    assert pruned.lengths()[1] == 9
    # every visible slot holds the key and the position of a chosen token
    for b in range(2):
        for h in range(2):
            vis = ~l0.mask[b, h] if l0.mask is not None else torch.ones(len(l0), dtype=torch.bool)
            assert sorted(l0.pos[b, vis].tolist()) == sorted(per_head[b, h].tolist())
            src = full.layers[0].k[b, h, l0.pos[b, vis]]
            assert torch.equal(l0.k[b, h, vis], src)
    # the union is kept in original order (filler slots of a smaller union sit at the end, masked)
    for b in range(2):
        u = int((~l0.mask[b]).any(0).sum())
        assert l0.pos[b, :u].tolist() == sorted(l0.pos[b, :u].tolist())
        assert torch.all(l0.mask[b, :, u:])
    assert pruned.layers[2].pos[0].tolist() == [0, 2, 3, 7]
    # per-head indices that agree across heads == shared indices
    keep = torch.tensor([1, 4, 5, 8])
    a = model(x[:, :2], cache=full.select([keep] * 3)).logits
    b = model(x[:, :2], cache=full.select([keep[None, None].expand(2, 2, -1)] * 3)).logits
    assert torch.equal(a, b)
    # keeping everything is no compression
    every = torch.arange(9)
    torch.testing.assert_close(model(x[:, :2], cache=full.select([every] * 3)).logits, model(x[:, :2], cache=full).logits, atol=0, rtol=0)
    assert (model(x[:, :2], cache=pruned).logits - model(x[:, :2], cache=full).logits).abs().max() > 1e-3
    # pruning changes what new tokens see, and their probes show the pruned slots at 0
    out = model(x[:, :2], cache=pruned, attn_queries=torch.tensor([1]))
    assert out.attentions[0].shape == (2, 4, 1, len(l0) + 2)
    hid = l0.mask.repeat_interleave(2, 1)  # (B, H_q, S)
    assert torch.all(out.attentions[0][:, :, 0, : len(l0)][hid] == 0)
    torch.testing.assert_close(out.attentions[1].sum(-1), torch.ones(2, 4, 1))
    with pytest.raises(ValueError, match="repeat"):
        full.select([torch.tensor([[[1, 1], [2, 3]]] * 2), None, None])
    with pytest.raises(ValueError, match="one index entry per layer"):
        full.select([keep])


@torch.no_grad()
def test_padding_mask_left_padded_batch():
    model = make_model()
    x = ids(B=1, S=6)
    single = model(x).logits
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), x], 1)
    batch = torch.cat([padded, torch.cat([x, x[:, :3]], 1)], 0)
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[0, :3] = True
    pos = torch.stack([torch.cat([torch.zeros(3, dtype=torch.long), torch.arange(6)]), torch.arange(9)])
    out = model(batch, padding_mask=pad, position_ids=pos)
    torch.testing.assert_close(out.logits[0, 3:], single[0], atol=1e-5, rtol=1e-5)
    assert out.cache.next_pos.tolist() == [6, 9]
    nxt = model(torch.tensor([[5], [5]]), cache=out.cache).logits
    torch.testing.assert_close(nxt[0], model(torch.cat([x, torch.tensor([[5]])], 1)).logits[0, -1:], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_gated_cross_attention_zero_gates_is_exact_identity():
    with_cross = make_model(cross_every=2, memory_dim=24)
    for blk in with_cross.cross.values():  # make_model's re-init touched only matrices: gates are still 0
        assert float(blk.attn_gate) == 0.0 and float(blk.ff_gate) == 0.0
    plain = make_model(cross_every=0)
    missing, unexpected = plain.load_state_dict(with_cross.state_dict(), strict=False)
    assert not missing and all(k.startswith("cross.") for k in unexpected)
    assert sorted(with_cross.cross.keys()) == ["0", "2"]
    x = ids()
    mem = torch.randn(2, 6, 24)
    a = with_cross(x, memory_BMD=mem).logits
    assert torch.equal(a, plain(x).logits)
    # opened gates: the memory and its position ids matter
    for blk in with_cross.cross.values():
        blk.attn_gate.fill_(0.7)
        blk.ff_gate.fill_(0.3)
    b = with_cross(x, memory_BMD=mem).logits
    c = with_cross(x, memory_BMD=mem, memory_position_ids=torch.tensor([0, 0, 5, 5, 9, 9])).logits
    assert (b - a).abs().max() > 1e-2 and (c - b).abs().max() > 1e-3
    # cached decoding with memory equals the full pass
    out = with_cross(x[:, :6], memory_BMD=mem)
    out2 = with_cross(x[:, 6:], cache=out.cache, memory_BMD=mem)
    torch.testing.assert_close(torch.cat([out.logits, out2.logits], 1), b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cross-attention"):
        plain(x, memory_BMD=mem)


@torch.no_grad()
def test_cache_save_load_roundtrip(tmp_path):
    model = make_model()
    x = ids(S=9)
    _, pruned, _ = _pruned_cache(model, x)
    path = pruned.save(tmp_path / "sub" / "prefix.safetensors", metadata={"config": model.config_json()})
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    loaded = KVCache.load(path)
    assert KVCache.load_metadata(path)["config"] == model.config_json()
    q = ids(S=3, seed=9)
    assert torch.equal(model(q, cache=loaded).logits, model(q, cache=pruned).logits)
    for a, b in zip(loaded.layers, pruned.layers):
        assert torch.equal(a.pos, b.pos) and (a.mask is None) == (b.mask is None)
    assert torch.equal(loaded.next_pos, pruned.next_pos)
    bad = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(ValueError, match="not a KV cache"):
        KVCache.load(bad)
    with pytest.raises(FileNotFoundError):
        KVCache.load(tmp_path / "missing.safetensors")


@torch.no_grad()
def test_generate_greedy_matches_recompute_and_stops():
    model = make_model()
    prompt = ids(S=4)
    gen = model.generate(prompt, max_new_tokens=6)
    seq = prompt
    for _ in range(6):
        nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], 1)
    assert torch.equal(gen.tokens, seq[:, 4:])
    assert gen.lengths.tolist() == [6, 6]
    assert gen.cache.lengths() == [9, 9, 9]
    # stop at the first token row 0 emits
    stop = int(gen.tokens[0, 1])
    first = [int((gen.tokens[b] == stop).nonzero()[0]) + 1 if (gen.tokens[b] == stop).any() else 6 for b in range(2)]
    g2 = model.generate(prompt, max_new_tokens=6, stop_token_ids=[stop], pad_token_id=60)
    assert g2.lengths.tolist() == first
    for b in range(2):
        n = first[b]
        assert torch.equal(g2.tokens[b, :n], gen.tokens[b, :n])
        assert torch.all(g2.tokens[b, n:] == 60)
    assert g2.tokens.shape[1] == max(first)


@torch.no_grad()
def test_generate_sampling_seeded_and_top_k():
    model = make_model()
    prompt = ids(S=4)
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5)
    a = model.generate(prompt, generator=torch.Generator().manual_seed(7), **kw).tokens
    b = model.generate(prompt, generator=torch.Generator().manual_seed(7), **kw).tokens
    c = model.generate(prompt, generator=torch.Generator().manual_seed(8), **kw).tokens
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = model.generate(prompt, max_new_tokens=8).tokens
    top1 = model.generate(prompt, do_sample=True, top_k=1, generator=torch.Generator().manual_seed(1), max_new_tokens=8).tokens
    assert torch.equal(top1, greedy)
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(prompt, max_new_tokens=0)


@torch.no_grad()
def test_generate_after_cache_and_with_embeds():
    model = make_model()
    x = ids(S=8)
    prefix = model(x[:, :5]).cache
    after = model.generate(x[:, 5:], cache=prefix, max_new_tokens=4).tokens
    whole = model.generate(x, max_new_tokens=4).tokens
    assert torch.equal(after, whole)
    emb = model.generate(inputs_embeds=model.embed(x), max_new_tokens=4).tokens
    assert torch.equal(emb, whole)


@torch.no_grad()
def test_memory_attn_bias_hides_memory_tokens():
    model = make_model(cross_every=1, memory_dim=24)
    for blk in model.cross.values():
        blk.attn_gate.fill_(0.8)
        blk.ff_gate.fill_(0.5)
    x = ids(S=6)
    mem = torch.randn(2, 5, 24)
    mpos = torch.tensor([3, 3, 4, 9, 9])
    bias = torch.zeros(1, 1, 1, 5)
    bias[..., [1, 3]] = float("-inf")
    keep = torch.tensor([0, 2, 4])
    hidden = model(x, memory_BMD=mem, memory_position_ids=mpos, memory_attn_bias=bias).logits
    dropped = model(x, memory_BMD=mem[:, keep], memory_position_ids=mpos[keep]).logits
    torch.testing.assert_close(hidden, dropped, atol=1e-5, rtol=1e-5)
    assert (hidden - model(x, memory_BMD=mem, memory_position_ids=mpos).logits).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_gradients_flow_to_gates_and_embeddings(backend):
    model = make_model(cross_every=2, memory_dim=24).train()
    model.backend = backend
    for blk in model.cross.values():
        with torch.no_grad():
            blk.attn_gate.fill_(0.1)
    x = ids(S=8)
    logits = model(x[:, :-1], memory_BMD=torch.randn(2, 4, 24), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 61), x[:, 1:].reshape(-1))
    loss.backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    for blk in model.cross.values():
        assert blk.attn_gate.grad is not None and blk.attn_gate.grad.abs() > 0
        assert blk.attn.k_proj.weight.grad.abs().sum() > 0


@torch.no_grad()
@pytest.mark.parametrize("tie", [True, False])
def test_decoder_save_load(tmp_path, tie):
    model = make_model(tie_embeddings=tie, cross_every=2)
    path = model.save(tmp_path / "m" / "decoder.safetensors")
    loaded = Decoder.load(path, backend="reference")
    assert loaded.config.tie_embeddings is tie and loaded.backend == "reference"
    assert (loaded.lm_head.weight is loaded.embed.weight) is tie
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=1e-5, rtol=1e-5)
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]
    with pytest.raises(ValueError, match="not a decoder file"):
        Decoder.load(_foreign_file(tmp_path))


def _foreign_file(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    return path
