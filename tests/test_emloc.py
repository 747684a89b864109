"""apps.emloc: episodes, host, exact resume of meta-training, compress / CompressedContext, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from apps.emloc import CompressedContext, EMLoCHost, HostConfig, compress
from apps.emloc.data import EVAL_DIGITS, EVAL_PROC_START, EpisodeConfig, make_episode
from apps.emloc.train import episode_batch, episode_loss
from core.kv_compress import js_divergence

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_host(seed: int = 0) -> EMLoCHost:
    torch.manual_seed(seed)
    m = EMLoCHost(HostConfig(dim=32, depth=3, num_heads=4, num_kv_heads=2)).eval()
    for p in m.decoder.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.2)
    return m


@pytest.fixture(scope="module")
def episode():
    return make_episode(3, num_demos=24, num_queries=6, split="eval")


def demos(ep):
    return ep.demo_images, ep.demo_labels


def test_episodes_are_deterministic_held_out_and_randomly_mapped():
    a = make_episode(5, num_demos=10, num_queries=3, split="eval")
    b = make_episode(5, num_demos=10, num_queries=3, split="eval")
    assert torch.equal(a.demo_images, b.demo_images) and torch.equal(a.query_labels, b.query_labels)
    for split in ("train", "eval"):
        for s in range(20):
            ep = make_episode(s, num_demos=10, num_queries=0, split=split)
            for kind, c in ep.classes:
                held = (c >= EVAL_PROC_START) if kind == "proc" else (c in EVAL_DIGITS)
                assert held == (split == "eval"), (split, kind, c)
            assert set(ep.demo_labels.tolist()) <= set(ep.label_ids.tolist())
    maps = {tuple(make_episode(s, num_demos=5, num_queries=0, split="train").label_ids.tolist()) for s in range(20)}
    assert len(maps) > 10  # label mappings change from episode to episode
    with pytest.raises(ValueError, match="split"):
        make_episode(0, num_demos=4, num_queries=0, split="test")


def test_episode_loss_counts_each_demo_label():
    m = tiny_host()
    imgs, labs = episode_batch([1, 2], num_demos=6, split="train", config=EpisodeConfig())
    loss, correct = episode_loss(m, imgs, labs)
    assert correct.shape == (2, 6) and torch.isfinite(loss)
    loss.backward()
    assert m.patch_proj.weight.grad is not None and m.patch_proj.weight.grad.abs().sum() > 0


def test_train_resumes_exactly(tmp_path):
    from apps.emloc.train import main

    common = ["--steps", "4", "--batch-size", "2", "--demos", "4", "--dim", "32", "--depth", "2", "--heads", "4",
              "--kv-heads", "2", "--eval-every", "2", "--eval-episodes", "2", "--log-every", "1", "--warmup", "2"]
    main(["--out", str(tmp_path / "a"), *common])
    main(["--out", str(tmp_path / "b"), *common[:1], "2", *common[2:], "--ckpt-every", "2"])
    main(["--out", str(tmp_path / "b"), *common, "--resume"])
    a = EMLoCHost.load(tmp_path / "a" / "model.safetensors")
    b = EMLoCHost.load(tmp_path / "b" / "model.safetensors")
    for (n, p), q in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(p, q), n
    steps = [json.loads(l)["step"] for l in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


@torch.no_grad()
def test_full_context_predicts_like_one_long_prefill(episode):
    m = tiny_host()
    ctx = compress(m, demos(episode), policy="full")
    assert ctx.keep_fraction() == 1.0
    x = m.embed_demos(episode.demo_images[None], episode.demo_labels[None])
    q = m.embed_images(episode.query_images[:1])  # (1, P, dim)
    ref = m.decoder(inputs_embeds=torch.cat([x, q], dim=1), use_cache=False).logits[0, -1, ctx.label_ids]
    torch.testing.assert_close(ctx.logits(episode.query_images[:1])[0], ref, rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_emloc_respects_delta_and_saves_and_refuses_other_model(episode, tmp_path):
    m = tiny_host()
    ctx = compress(m, demos(episode), delta=0.01, chunk_demos=8)
    assert len(ctx.reports) == 3
    assert all(js <= 0.01 + 1e-9 for r in ctx.reports for js in r.js)
    assert ctx.keep_fraction() < 1.0  # something was pruned
    kept = ctx.kept_map()
    assert kept.shape == (3, 2, 24 * 5)
    lab = torch.arange(24 * 5) % 5 == 4
    assert bool(kept[:, :, lab].all())  # label tokens (the demonstrations' answers) always kept, by default
    ans_ctx = compress(m, demos(episode), delta=0.01, chunk_demos=8, always_keep="answer")
    assert bool(ans_ctx.kept_map()[:, :, m.answer_mask(24)].all()) and ans_ctx.settings["always_keep"] == "answer"
    both = compress(m, demos(episode), delta=0.01, chunk_demos=8, always_keep="both").kept_map()
    assert bool(both[:, :, lab | m.answer_mask(24)].all())
    with pytest.raises(ValueError, match="always_keep must be"):
        compress(m, demos(episode), always_keep="labels")
    path = ctx.save(tmp_path / "mem.safetensors")
    back = CompressedContext.load(path, m, settings={"delta": 0.01, "always_keep": "label"})
    torch.testing.assert_close(back.logits(episode.query_images), ctx.logits(episode.query_images))
    assert back.settings["chunk_demos"] == 8
    with pytest.raises(ValueError, match="another model"):
        CompressedContext.load(path, tiny_host(seed=1))
    with pytest.raises(ValueError, match="other settings"):
        CompressedContext.load(path, m, settings={"delta": 0.005})
    with pytest.raises(FileNotFoundError):
        CompressedContext.load(tmp_path / "none.safetensors", m)


@torch.no_grad()
def test_budgeted_policies_keep_their_budget(episode):
    m = tiny_host()
    n = 24 * 5
    for policy in ("random", "streaming", "h2o", "snapkv", "pyramidkv"):
        ctx = compress(m, demos(episode), policy=policy, keep=0.25)
        mean_kept = sum(ctx.kept_tokens()) / len(ctx.kept_tokens())
        assert mean_kept == pytest.approx(round(0.25 * n), abs=1), policy
        assert ctx.predict(episode.query_images).shape == (6,)


def test_bad_input_is_refused_clearly(episode):
    m = tiny_host()
    imgs, labs = demos(episode)
    with pytest.raises(ValueError, match="no label"):
        compress(m, [(imgs[0], 1), (imgs[1], None)])
    with pytest.raises(ValueError, match="without labels"):
        compress(m, (imgs, torch.full((24,), float("nan"))))
    with pytest.raises(ValueError, match="one class only"):
        compress(m, (imgs, torch.full((24,), 3)))
    with pytest.raises(ValueError, match=r"\(K, 16, 16\)"):
        compress(m, (imgs[:, :8], labs))
    bad = imgs.clone()
    bad[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        compress(m, (bad, labs))
    for d in (0, -0.1):
        with pytest.raises(ValueError, match="delta must be a number > 0"):
            compress(m, (imgs, labs), delta=d)
    with pytest.raises(ValueError, match="budget of zero tokens"):
        compress(m, (imgs, labs), policy="snapkv", keep=0.001)
    with pytest.raises(ValueError, match="unknown policy"):
        compress(m, (imgs, labs), policy="nope")
    with pytest.raises(ValueError, match="labels must lie"):
        compress(m, (imgs, labs + 100))


def test_js_of_identical_logits_is_zero():
    x = torch.randn(3, 17)
    assert float(js_divergence(x, x).max()) < 1e-6


def test_image_summary_option_changes_tokens_and_round_trips(tmp_path):
    torch.manual_seed(0)
    m = EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2, image_summary=True)).eval()
    imgs, labs = episode_batch([4], num_demos=3, split="eval", config=EpisodeConfig())
    x = m.embed_demos(imgs, labs)
    assert x.shape == (1, 15, 32)
    lab_only = m.decoder.embed(labs)[0]
    assert not torch.allclose(x[0, 4::5], lab_only)  # label tokens carry their image
    m.save(tmp_path / "h.safetensors")
    back = EMLoCHost.load(tmp_path / "h.safetensors")
    assert back.config.image_summary and back.fingerprint() == m.fingerprint()
    torch.testing.assert_close(back.embed_demos(imgs, labs), x)


@torch.no_grad()
@pytest.mark.parametrize("delta", [0.02, 1e-6])
def test_suffix_observers_bound_js_on_every_chunk_by_an_independent_replay(episode, delta):
    """observers="suffix" (the reference's): each demo of a chunk re-encoded after the chunk; replayed here one demo
    at a time with the decoder itself, the mean JS at the answer positions stays within delta on every chunk."""
    m = tiny_host()
    ctx = compress(m, demos(episode), delta=delta, chunk_demos=8, observers="suffix")
    assert ctx.settings["observers"] == "suffix" and len(ctx.reports) == 3
    x = m.embed_demos(episode.demo_images[None], episode.demo_labels[None])
    P = m.config.tokens_per_demo
    T = 8 * P
    qi = m.config.tokens_per_image - 1
    mem_len = [0] * m.config.depth
    for c, rep in enumerate(ctx.reports):
        memory = ctx.cache.select([torch.arange(l)[None, None].expand(1, 2, -1) for l in mem_len]) if c else None
        own = torch.arange(c * T, (c + 1) * T)[None]  # the chunk's positions (a slice of the final cache keeps its
        whole = m.decoder(inputs_embeds=x[:, c * T : (c + 1) * T], position_ids=own, cache=memory).cache  # next_pos)
        kept = ctx.cache.select([torch.arange(l + k)[None, None].expand(1, 2, -1) for l, k in zip(mem_len, rep.kept)])
        js = []
        for d in range(8):
            suffix = x[:, c * T + d * P : c * T + (d + 1) * P]
            pos = (c + 1) * T + torch.arange(P)
            a = m.decoder(inputs_embeds=suffix, position_ids=pos[None], cache=whole, use_cache=False).logits[0, qi]
            b = m.decoder(inputs_embeds=suffix, position_ids=pos[None], cache=kept, use_cache=False).logits[0, qi]
            js.append(js_divergence(a, b))
        assert float(torch.stack(js).mean()) <= delta + 1e-7, (c, rep.js)
        mem_len = [l + k for l, k in zip(mem_len, rep.kept)]
    if delta == 1e-6:
        assert any(r == 1.0 for rep in ctx.reports for r in rep.ratios)  # the bound bites somewhere
    else:
        assert ctx.keep_fraction() < 0.9


@torch.no_grad()
@pytest.mark.parametrize("policy", ["random", "streaming", "h2o", "snapkv", "pyramidkv", "fastv"])
def test_protected_answers_are_kept_by_every_budgeted_policy_within_its_budget(episode, policy):
    """protect_answers: every demo's label token is kept first; the budget per layer and head is unchanged."""
    m = tiny_host()
    P = m.config.tokens_per_demo
    n = episode.demo_images.shape[0] * P
    labels = torch.arange(n) % P == m.config.tokens_per_image
    ctx = compress(m, demos(episode), policy=policy, keep=0.5, protect_answers=True, seed=3)
    plain = compress(m, demos(episode), policy=policy, keep=0.5, seed=3)
    km, kp = ctx.kept_map(), plain.kept_map()
    pruned = [i for i in range(m.config.depth) if not bool(kp[i].all())]
    assert pruned
    for i in pruned:
        if int(kp[i].sum(-1).min()) >= int(labels.sum()):  # PyramidKV's top layers may hold fewer slots than labels
            assert bool(km[i][:, labels].all()), (policy, i)  # every label token, every head
        else:
            assert int(km[i][:, labels].sum(-1).min()) == int(kp[i].sum(-1).min())  # labels fill the whole budget
        assert torch.equal(km[i].sum(-1), kp[i].sum(-1))  # the same budget
    if policy == "streaming":
        assert not bool(kp[pruned[0]][:, labels].all())  # without protection recency drops the early labels
