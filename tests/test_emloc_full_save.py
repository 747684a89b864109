"""A ``full`` EMLoC memory (nothing pruned: every layer holds the same position ids) saves and reloads; saving it
used to fail with safetensors' shared-tensor error."""

from __future__ import annotations

import pytest
import torch

from apps.emloc import CompressedContext, EMLoCHost, HostConfig, compress
from apps.emloc.data import make_episode
from core.kv_cache import KVCache, LayerKV

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@torch.no_grad()
def test_full_memory_round_trip(tmp_path):
    torch.manual_seed(0)
    m = EMLoCHost(HostConfig(dim=32, depth=3, num_heads=4, num_kv_heads=2)).eval()
    ep = make_episode(3, num_demos=6, num_queries=2, split="eval")
    ctx = compress(m, (ep.demo_images, ep.demo_labels), policy="full")
    assert ctx.keep_fraction() == 1.0
    path = ctx.save(tmp_path / "full.safetensors")
    back = CompressedContext.load(path, m, settings={"policy": "full"})
    assert back.cache.lengths() == ctx.cache.lengths()
    for a, b in zip(back.cache.layers, ctx.cache.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)
    assert torch.equal(back.logits(ep.query_images), ctx.logits(ep.query_images))


def test_cache_with_shared_tensors_saves_each_once(tmp_path):
    pos = torch.arange(5)[None]  # (B, S), one tensor for both layers
    layers = [LayerKV(torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4), pos, None) for _ in range(2)]
    cache = KVCache(layers=layers, next_pos=torch.tensor([5]))
    back = KVCache.load(cache.save(tmp_path / "c.safetensors"))
    for a, b in zip(back.layers, cache.layers):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v) and torch.equal(a.pos, b.pos)
    assert layers[0].pos is layers[1].pos  # the cache itself is left as it was
