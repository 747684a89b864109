"""The small model's memory-path layout (reference placement, every token queries, shared norm), the old layout of
earlier files, and the memory key/value cache in generation."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from apps.comemo.batch import build_batch
from apps.comemo.infer import generate_answer
from apps.comemo.model import LEGACY_MEMORY, CoMemoConfig, CoMemoModel, VisionConfig
from apps.comemo.synthetic import corpus_texts, make_sample
from apps.comemo.tokenizer import train_tokenizer
from core.layers import GatedCrossAttentionBlock

SMALL = dict(dim=32, depth=4, num_heads=2, cross_every=2, vision=VisionConfig(tile=16, patch=4, dim=16, depth=1, num_heads=2))


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(corpus_texts(), vocab_size=320)


def _model(tok, **kw):
    torch.manual_seed(0)
    return CoMemoModel(CoMemoConfig(variant="comemo", vocab_size=tok.vocab_size, **{**SMALL, **kw})).eval()


def test_layouts_place_and_normalise_as_configured(tok):
    ref = _model(tok)
    assert sorted(ref.decoder.cross) == ["1", "3"]  # (i + 1) % 2 == 0
    assert all(b.shared_norm and isinstance(b.norm_context, torch.nn.Identity) for b in ref.decoder.cross.values())
    old = _model(tok, **LEGACY_MEMORY)
    assert sorted(old.decoder.cross) == ["0", "2"] and not any(b.shared_norm for b in old.decoder.cross.values())
    assert CoMemoConfig(**SMALL).cross_layers == [1, 3] and CoMemoConfig(**SMALL, **LEGACY_MEMORY).cross_layers == [0, 2]
    assert CoMemoConfig(variant="lvlm-1d", **SMALL).cross_layers == []
    with pytest.raises(ValueError, match="memory_queries"):
        CoMemoConfig(memory_queries="images")
    with pytest.raises(ValueError, match="no memory block"):
        CoMemoConfig(depth=2, cross_every=4)


def test_files_without_the_layout_keys_load_with_the_old_layout(tok, tmp_path):
    cfg = json.loads(_model(tok, **LEGACY_MEMORY).cfg.to_json())
    for k in LEGACY_MEMORY:
        cfg.pop(k)
    assert CoMemoConfig.from_json(json.dumps(cfg)).cross_placement == "first"
    from apps.comemo.api import CoMemo

    shipped = CoMemo.load()  # retrained in the reference layout, which its file names
    assert (shipped.model.cfg.cross_placement, shipped.model.cfg.memory_queries, shipped.model.cfg.memory_norm) == (
        "reference", "all", "shared")
    assert shipped.model.cfg.cross_layers == [1, 3]


def test_every_token_queries_the_memory(tok):
    m = _model(tok)
    for b in m.decoder.cross.values():
        b.attn_gate.data.fill_(1.0)
    ex = [([s for s in make_sample("needle", 2, 3, tile=16).images], "which image shows a digit ?", "image 1 shows 3")]
    batch = build_batch(ex, tok, m.cfg)
    kw = m.decoder_inputs(batch)
    assert "memory_attn_bias" not in kw
    seen = []
    hook = m.decoder.cross["1"].register_forward_hook(lambda mod, a, out: seen.append(out - a[0]))
    with torch.no_grad():
        m(batch)
    hook.remove()
    slots = batch.image_slot[0] >= 0
    assert bool((seen[0][0][slots].abs().sum(-1) > 0).all())  # image slots get a memory update too
    m.cfg.memory_queries = "text"
    assert "memory_attn_bias" in m.decoder_inputs(batch)


def test_shared_norm_block_reads_memory_through_the_query_norm():
    torch.manual_seed(0)
    blk = GatedCrossAttentionBlock(16, 2, norm_context="shared", norm="rms", gate_init=1.0)
    x, mem = torch.randn(2, 5, 16), torch.randn(2, 7, 16) * 3
    k, v = blk.memory_kv(mem)
    k2, v2 = blk.attn.project_kv(blk.norm1(mem))
    assert torch.equal(k, k2) and torch.equal(v, v2)
    torch.testing.assert_close(blk(x, mem), blk(x, memory_kv=(k, v)))
    with pytest.raises(ValueError, match="context_dim == dim"):
        GatedCrossAttentionBlock(16, 2, context_dim=8, norm_context="shared")


@pytest.mark.parametrize("layout", [{}, LEGACY_MEMORY])
def test_generation_computes_memory_keys_once(tok, layout):
    m = _model(tok, **layout)
    for b in m.decoder.cross.values():
        b.attn_gate.data.fill_(0.7)
        b.ff_gate.data.fill_(0.3)
    calls = []
    for b in m.decoder.cross.values():
        orig = b.memory_kv
        b.memory_kv = lambda *a, _o=orig, **k: (calls.append(1), _o(*a, **k))[1]
    s = make_sample("needle", 3, 5, tile=16)
    rng = np.random.default_rng(0)
    images = s.images + [rng.integers(0, 255, (16, 48, 3), dtype=np.uint8)]  # a 1x3 image: tiles + thumbnail
    a = generate_answer(m, tok, images, s.question, max_new_tokens=6)
    n_cached = len(calls)
    b = generate_answer(m, tok, images, s.question, max_new_tokens=6, cache_memory=False)
    assert a["tokens"] == b["tokens"] and len(a["tokens"]) > 1
    steps = len(b["tokens"]) + (0 if len(b["tokens"]) == 6 else 1)  # stops after </s>
    assert n_cached == len(m.decoder.cross)  # once for the whole answer
    assert len(calls) - n_cached >= len(m.decoder.cross) * min(steps, 2)  # once per step without the cache
    assert all(not blk.cache_memory_kv and blk._kv_cache is None for blk in m.decoder.cross.values())


def test_frozen_gates_twin_trains_exactly_like_the_context_only_models(tmp_path):
    """With one tile per image RoPE-DHR ids are the 1-D ids, and a memory block whose gates stay 0 adds exactly 0:
    the control arm (comemo --freeze-gates) and lvlm-1d / lvlm-dhr see the same losses, step for step."""
    from apps.comemo.train import main

    tiny = ["--dim", "32", "--depth", "2", "--heads", "2", "--cross-every", "1", "--tile", "16", "--vision-dim", "16",
            "--vision-depth", "1", "--batch-size", "2", "--max-images", "3", "--val-samples", "2", "--no-progress",
            "--device", "cpu", "--stage", "3", "--steps", "3", "--tasks", "needle", "--seed", "4", "--val-every", "100"]
    losses = {}
    for name, extra in (("lvlm-1d", ["--variant", "lvlm-1d"]), ("lvlm-dhr", ["--variant", "lvlm-dhr"]),
                        ("frozen", ["--variant", "comemo", "--freeze-gates"]), ("comemo", ["--variant", "comemo"])):
        assert main([*tiny, *extra, "--out", str(tmp_path / name)]) == 0
        rows = [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows]
        if name == "frozen":
            assert all(v == 0.0 for r in rows for v in r["gates"].values())
    assert losses["lvlm-1d"] == losses["lvlm-dhr"] == losses["frozen"]
    assert losses["comemo"][0] == losses["frozen"][0] and losses["comemo"][1:] != losses["frozen"][1:]
