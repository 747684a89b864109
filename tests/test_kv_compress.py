"""core.kv_compress: the policy registry, budgets, position ids after pruning, EMLoC's JS bound, reloads."""

from __future__ import annotations

import math

import pytest
import torch

from core.decoder import Decoder, DecoderConfig, KVCache
from core.kv_compress import (
    POLICIES,
    Chunk,
    EMLoCConfig,
    Observation,
    chunk_demonstrations,
    compress,
    emloc_compress,
    js_divergence,
    observe,
    pyramid_budgets,
    replay_logits,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BUDGETED = ("random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv")


def make_model(seed: int = 0, depth: int = 4, **kw) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(DecoderConfig(vocab_size=53, dim=32, depth=depth, num_heads=4, num_kv_heads=2, **kw)).eval()
    for p in model.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return model


def ids(B=2, S=40, seed=1):
    return torch.randint(0, 53, (B, S), generator=torch.Generator().manual_seed(seed))


def prefill(model, x, policy):
    """Prefill with the probes each policy expects."""
    window = "all" if policy == "h2o" else 6
    out, obs = observe(model, x, query_index=window)
    image = torch.zeros(x.shape, dtype=torch.bool)
    image[:, 4:30] = True
    obs.image_mask = image
    return out, obs


def options(policy):
    return {"generator": torch.Generator().manual_seed(0)} if policy == "random" else {}


@torch.no_grad()
def test_full_equals_no_compression_exactly():
    model = make_model()
    x = ids()
    out, obs = observe(model, x[:, :30])
    kept = compress(out.cache, "full", None, obs)
    q = x[:, 30:]
    assert torch.equal(model(q, cache=kept).logits, model(q, cache=out.cache).logits)
    assert kept.lengths() == out.cache.lengths()


@torch.no_grad()
@pytest.mark.parametrize("policy", BUDGETED)
def test_every_policy_keeps_exactly_its_budget(policy):
    model = make_model()
    x = ids()
    out, obs = prefill(model, x, policy)
    budget = 16
    kept = compress(out.cache, policy, budget, obs, **options(policy))
    counts = kept.kept_counts()
    if policy == "pyramidkv":
        budgets = pyramid_budgets(budget, 4, floor=6)
        assert sum(budgets) == budget * 4 and budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    elif policy == "fastv":
        budgets = [40, 40, budget, budget]  # layers below k_layer=2 stay whole
    else:
        budgets = [budget] * 4
    for c, b in zip(counts, budgets):
        assert torch.equal(c, torch.full((2, 2), b)), (policy, c.tolist(), b)
    # compressing again with a smaller budget works on the already pruned (per-head masked) cache
    if policy not in ("fastv",):
        again = compress(kept, policy if policy != "pyramidkv" else "snapkv", 8, obs_for(kept, obs, policy), **options(policy))
        for c, b in zip(again.kept_counts(), budgets):
            assert torch.equal(c, torch.full((2, 2), min(8, b)))  # min(budget, visible slots)


def obs_for(cache: KVCache, obs: Observation, policy: str) -> Observation:
    """Probes re-indexed onto a pruned cache's slots (its slot positions are the original token indices)."""
    if obs.attentions is None:
        return obs
    atts = [a.gather(-1, l.pos[:, None, None, :].expand(*a.shape[:3], -1)) for a, l in zip(obs.attentions, cache.layers)]
    return Observation(attentions=atts, query_index=obs.query_index, num_new=obs.num_new)


@torch.no_grad()
@pytest.mark.parametrize("policy", BUDGETED)
def test_position_ids_survive_pruning(policy):
    model = make_model()
    x = ids()
    out, obs = prefill(model, x, policy)
    kept = compress(out.cache, policy, 16, obs, **options(policy))
    for full, l in zip(out.cache.layers, kept.layers):
        vis = l.visible()
        for b in range(2):
            for h in range(2):
                p = l.pos[b, vis[b, h]]
                assert torch.equal(l.k[b, h, vis[b, h]], full.k[b, h, p])  # positions == original slots here
                assert torch.equal(l.v[b, h, vis[b, h]], full.v[b, h, p])
    assert kept.next_pos.tolist() == [40, 40]
    nxt = torch.tensor([[3], [4]])
    a = model(nxt, cache=kept).logits
    assert torch.equal(a, model(nxt, cache=kept, position_ids=torch.tensor([40])).logits)
    assert (a - model(nxt, cache=kept, position_ids=torch.tensor([min(kept.lengths())])).logits).abs().max() > 1e-3


def synthetic_cache(B=1, H=2, S=20, depth=3):
    from core.decoder import LayerKV

    layers = [
        LayerKV(torch.randn(B, H, S, 4), torch.randn(B, H, S, 4), torch.arange(S)[None].expand(B, -1).clone())
        for _ in range(depth)
    ]
    return KVCache(layers=layers, next_pos=torch.full((B,), S))


def test_policies_choose_what_they_should():
    cache = synthetic_cache()
    S = 20
    # streaming: sinks 0..3 and the last 4
    idx = POLICIES["streaming"](cache, 8, None, num_sinks=4)
    assert idx[0][0, 0].tolist() == [0, 1, 2, 3, 16, 17, 18, 19]
    # heavy hitters per KV head: head 0 (query heads 0, 1) likes slots 5, 7; head 1 (query heads 2, 3) 9, 11
    att = torch.full((1, 4, 3, S), 0.01)
    att[:, :2, :, [5, 7]] = 1.0
    att[:, 2:, :, [9, 11]] = 1.0
    obs = Observation(attentions=[att] * 3, query_index=torch.arange(17, 20), num_new=S)
    h2o = POLICIES["h2o"](cache, 4, obs, recent_ratio=0.5)
    assert h2o[0][0, 0].tolist() == [5, 7, 18, 19] and h2o[0][0, 1].tolist() == [9, 11, 18, 19]
    snap = POLICIES["snapkv"](cache, 5, obs, kernel_size=1)
    assert snap[1][0, 0].tolist() == [5, 7, 17, 18, 19] and snap[1][0, 1].tolist() == [9, 11, 17, 18, 19]
    pooled = POLICIES["snapkv"](cache, 4, obs, kernel_size=3)  # pooling spreads the votes to neighbours
    assert set(pooled[0][0, 0].tolist()) & {4, 6, 8} and 9 not in pooled[0][0, 0].tolist()
    # fastv: text kept; images ranked by layer k-1 attention
    image = torch.zeros(1, S, dtype=torch.bool)
    image[:, 2:14] = True
    obs.image_mask = image
    att_fv = torch.full((1, 4, 3, S), 0.01)
    att_fv[..., [5, 7]] = 1.0
    att_fv[..., [0, 15]] = 5.0  # text slots' attention does not matter: they are kept anyway
    obs.attentions = [att_fv, torch.rand(1, 4, 3, S), torch.rand(1, 4, 3, S)]
    fv = POLICIES["fastv"](cache, 10, obs, k_layer=1)
    assert fv[0] is None and len(fv) == 3
    assert fv[1][0, 0].tolist() == [0, 1, 5, 7, 14, 15, 16, 17, 18, 19]
    with pytest.raises(ValueError, match="text tokens"):
        POLICIES["fastv"](cache, 5, obs, k_layer=1)
    # random: seeded, budget-sized, different seeds differ
    r1 = POLICIES["random"](cache, 6, None, generator=torch.Generator().manual_seed(1))
    r2 = POLICIES["random"](cache, 6, None, generator=torch.Generator().manual_seed(1))
    r3 = POLICIES["random"](cache, 6, None, generator=torch.Generator().manual_seed(2))
    assert torch.equal(r1[0], r2[0]) and not torch.equal(r1[0], r3[0])
    assert r1[0].shape == (1, 2, 6)


def test_registry_errors():
    cache = synthetic_cache()
    with pytest.raises(ValueError, match="unknown KV compression policy"):
        compress(cache, "lru", 4)
    with pytest.raises(ValueError, match="needs Observation.attentions"):
        compress(cache, "snapkv", 4)
    with pytest.raises(ValueError, match="budget"):
        compress(cache, "streaming", 0)
    with pytest.raises(ValueError, match="budget=None"):
        compress(cache, "emloc", 4, None, model=None)
    obs = Observation(attentions=[torch.rand(1, 4, 3, 20)] * 3, query_index=torch.tensor([0, 1, 2]), num_new=20)
    with pytest.raises(ValueError, match="last tokens"):
        compress(cache, "snapkv", 8, obs)
    assert set(POLICIES) == {"full", "random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv", "emloc"}


def test_js_divergence():
    from scipy.spatial.distance import jensenshannon

    p, q = torch.randn(5, 11), torch.randn(5, 11)
    got = js_divergence(p, q)
    want = torch.tensor([jensenshannon(a, b) ** 2 for a, b in zip(p.softmax(-1).numpy(), q.softmax(-1).numpy())])
    torch.testing.assert_close(got, want.float(), atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(js_divergence(q, p), got)
    assert float(js_divergence(p, p).max()) < 1e-12
    far = torch.tensor([[100.0, -100.0]]), torch.tensor([[-100.0, 100.0]])
    assert abs(float(js_divergence(*far)) - math.log(2)) < 1e-6


@torch.no_grad()
def test_replay_reproduces_the_prefill():
    model = make_model()
    x = ids(B=1, S=25)
    mem = model(x[:, :10]).cache
    qi = torch.tensor([2, 7, 14])
    out, obs = observe(model, x[:, 10:], cache=mem, query_index=qi)
    S = len(out.cache.layers[0])
    hide = [(torch.arange(S)[None, :] > (10 + qi)[:, None])[None, None].expand(1, 2, -1, -1)] * 4
    logits = replay_logits(model, [(l.k, l.v) for l in out.cache.layers], hide, obs.query_embeds, obs.query_pos)
    torch.testing.assert_close(logits, obs.logits, atol=1e-5, rtol=1e-5)
    assert obs.query_pos[0].tolist() == [12, 17, 24]


def demos(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        L = int(torch.randint(8, 13, (1,), generator=g))
        ans = torch.zeros(L, dtype=torch.bool)
        ans[-2:] = True
        out.append((torch.randint(0, 53, (L,), generator=g), ans))
    return out


def position_causal_replay(model, cache: KVCache, obs: Observation) -> torch.Tensor:
    """Independent check: answer queries against a pruned cache, causality by position ids."""
    hide = []
    for l in cache.layers:
        later = l.pos[:, None, None, :] > obs.query_pos[:, None, :, None]  # (B, 1, Q, S)
        hide.append(~l.visible()[:, :, None, :] | later)
    return replay_logits(model, [(l.k, l.v) for l in cache.layers], hide, obs.query_embeds, obs.query_pos)


@torch.no_grad()
def test_emloc_js_stays_within_delta_on_every_chunk():
    model = make_model()
    chunks = chunk_demonstrations(demos(6), 2)
    cfg = EMLoCConfig(delta=0.005)
    mem, reports = None, []
    for chunk in chunks:
        qi = chunk.answer_mask.nonzero()[:, 0]
        out, obs = observe(model, chunk.input_ids, cache=mem, query_index=qi)
        from core.kv_compress import ChunkReport

        rep = ChunkReport(num_tokens=0, num_answer=0)
        new = compress(out.cache, "emloc", None, obs, model=model, config=cfg, report=rep)
        assert all(js <= cfg.delta for js in rep.js), rep.js
        js_final = js_divergence(obs.logits, position_causal_replay(model, new, obs)).mean()
        assert float(js_final) <= cfg.delta
        assert abs(float(js_final) - rep.js[0]) < 1e-5
        # answer tokens are kept in every layer and head; slots before the chunk untouched
        prior = out.cache.lengths()[0] - obs.num_new
        ans_pos = obs.query_pos[0]
        for l, r, k in zip(new.layers, rep.ratios, rep.kept):
            vis = l.visible()
            for h in range(2):
                assert set(ans_pos.tolist()) <= set(l.pos[0, vis[0, h]].tolist())
            chunk_vis = (l.pos[0] >= prior)[None] & vis[0]
            assert chunk_vis.sum(-1).tolist() == [k, k]
            assert k == (obs.num_new if r == 1.0 else max(2 * 2, math.ceil(r * obs.num_new)))
        reports.append(rep)
        mem = new
    assert any(r < 1.0 for rep in reports for r in rep.ratios)  # something was pruned
    result = emloc_compress(model, chunks, config=cfg)
    assert [r.ratios for r in result.reports] == [r.ratios for r in reports]
    for a, b in zip(result.cache.layers, mem.layers):
        assert torch.equal(a.pos, b.pos) and torch.equal(a.k, b.k)
    total = sum(len(d[0]) for d in demos(6))
    assert result.cache.next_pos.tolist() == [total]  # positions continued across chunks


@torch.no_grad()
def test_emloc_delta_controls_pruning():
    model = make_model(depth=3)
    chunks = chunk_demonstrations(demos(4, seed=3), 2)
    strict = emloc_compress(model, chunks, config=EMLoCConfig(delta=0.0))
    loose = emloc_compress(model, chunks, config=EMLoCConfig(delta=math.log(2), ratios=(0.2, 0.5)))
    for rep in loose.reports:
        assert rep.ratios == [0.2, 0.2, 0.2]
        assert rep.kept == [max(4, math.ceil(0.2 * rep.num_tokens))] * 3
    assert all(r == 1.0 for rep in strict.reports for r in rep.ratios)
    assert sum(strict.cache.lengths()) > sum(loose.cache.lengths())
    with pytest.raises(ValueError, match="no answer tokens"):
        emloc_compress(model, [Chunk(input_ids=ids(B=1, S=5), answer_mask=torch.zeros(5, dtype=torch.bool))])
    with pytest.raises(ValueError, match="ratios"):
        EMLoCConfig(ratios=(0.0, 0.5))


@torch.no_grad()
def test_emloc_keep_mask_names_the_always_kept_tokens():
    """A keep mask other than the answer tokens: exactly those tokens survive in every pruned layer and head,
    the answer positions are prunable, and the JS bound still holds."""
    model = make_model(depth=3)
    chunks = chunk_demonstrations(demos(4, seed=3), 2)
    masked = []
    for c in chunks:
        keep = torch.roll(c.answer_mask, 1)  # the token after each answer token (a label after its predictor)
        masked.append(Chunk(input_ids=c.input_ids, answer_mask=c.answer_mask, keep_mask=keep))
    res = emloc_compress(model, masked, config=EMLoCConfig(delta=math.log(2), ratios=(0.2,)))
    start = 0
    for c, rep in zip(masked, res.reports):
        n = c.input_ids.shape[1]
        kept_pos = set((start + c.keep_mask.nonzero()[:, 0]).tolist())
        assert all(j <= math.log(2) for j in rep.js) and rep.num_answer == int(c.keep_mask.sum())
        for l, r in zip(res.cache.layers, rep.ratios):
            vis = l.visible()
            for h in range(2):
                chunk_pos = {p for p in l.pos[0, vis[0, h]].tolist() if start <= p < start + n}
                assert kept_pos <= chunk_pos
                if r < 1.0:
                    assert len(chunk_pos) == max(len(kept_pos), math.ceil(r * n))
        start += n
    with pytest.raises(ValueError, match="keep_mask has"):
        c = masked[0]
        emloc_compress(model, [Chunk(input_ids=c.input_ids, answer_mask=c.answer_mask, keep_mask=c.keep_mask[:-1])])


@torch.no_grad()
def test_reloaded_compressed_prefix_gives_same_logits(tmp_path):
    model = make_model()
    result = emloc_compress(model, chunk_demonstrations(demos(4), 2))
    path = result.cache.save(tmp_path / "prefix.safetensors", metadata={"config": model.config_json()})
    loaded = KVCache.load(path)
    lengths = result.cache.lengths()
    for seed in (5, 6):  # the prefix is reused for every query, unchanged
        q = ids(B=1, S=6, seed=seed)
        a = model(q, cache=result.cache).logits
        b = model(q, cache=loaded).logits
        assert torch.equal(a, b)
        ga = model.generate(q, cache=result.cache, max_new_tokens=5).tokens
        gb = model.generate(q, cache=loaded, max_new_tokens=5).tokens
        assert torch.equal(ga, gb)
    assert result.cache.lengths() == lengths
