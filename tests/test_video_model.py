"""Tests of the video QA model, encoders, and the InfiniteVideo reading strategies."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.continuous import ContinuousMemory, ContinuousMemoryConfig
from video.encoders import TinyFrameEncoder, build_frame_encoder
from video.infinite import METHODS, InfiniteVideo, InfiniteVideoConfig, _moviechat_merge, parse_question
from video.model import VideoQAConfig, VideoQAModel, time_embedding
from video.synthetic import ANSWERS, iter_frames, make_spec, write_video
from video.train import load_model, make_batch, save_weights


@pytest.fixture(scope="module")
def small_model():
    torch.manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    return VideoQAModel(VideoQAConfig(dim=32, num_heads=2, num_layers=2, num_queries=4, encoder_dim=32,
                                      encoder_width=8)).eval()


def test_encoder_registry(tmp_path):
    enc = build_frame_encoder("tiny", dim=24, input_size=32)
    out = enc(torch.randint(0, 255, (5, 3, 48, 40), dtype=torch.uint8))
    assert out.shape == (5, enc.num_tokens, 24) and torch.isfinite(out).all()
    path = tmp_path / "enc.safetensors"
    from safetensors.torch import save_file

    save_file(enc.state_dict(), str(path))
    enc2 = build_frame_encoder("tiny", weights=path, dim=24, input_size=32)
    x = torch.randint(0, 255, (2, 3, 32, 32), dtype=torch.uint8)
    torch.testing.assert_close(enc2(x), enc(x))
    with pytest.raises(ValueError, match="unknown frame encoder"):
        build_frame_encoder("resnet50")
    with pytest.raises(ValueError, match="weights=PATH"):
        build_frame_encoder("timm:resnet18")
    with pytest.raises(FileNotFoundError, match="not found"):
        build_frame_encoder("open_clip:ViT-B-32", weights=tmp_path / "missing.pt")


def test_time_embedding_distinguishes_times():
    t = torch.rand(50)
    e = time_embedding(t, 32)
    assert e.shape == (50, 32)
    d = torch.cdist(e, e)
    close = (t[:, None] - t[None]).abs() < 1e-4
    assert (d[~close] > 1e-3).all()


def test_model_forward_and_a_few_steps_reduce_loss(small_model):
    model = VideoQAModel(VideoQAConfig(dim=16, num_heads=2, num_layers=1, num_queries=4, encoder_dim=16,
                                       encoder_width=8))
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    frames, times, q, ans, _ = make_batch(rng, 4, 8)
    logits = model(frames, times, q, num_chunks=2)
    assert q.shape == (4, 20, 3) and logits.shape == (4, 20, len(ANSWERS))
    # several questions per clip give the same logits as asking them one at a time
    torch.testing.assert_close(model(frames, times, q[:, 3], num_chunks=2), logits[:, 3], rtol=1e-4, atol=1e-5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(model(frames, times, q, num_chunks=2).reshape(-1, len(ANSWERS)),
                                                 ans.reshape(-1), ignore_index=-100)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.7 * first
    # every parameter but the training-only frame tagger (unused without tags) gets a finite gradient
    assert all(p.grad is not None and torch.isfinite(p.grad).all()
               for n, p in model.named_parameters() if not n.startswith("frame_tagger"))
    with pytest.raises(ValueError, match="num_chunks"):
        model(frames, times, q, num_chunks=3)


def test_memory_hook_alpha_one_is_plain_qformer_and_memory_is_fixed_size(small_model):
    tok = torch.randn(1, 8, 4, 32)
    mems = [ContinuousMemory(ContinuousMemoryConfig(num_basis=16, num_samples=32, num_points=100)) for _ in range(2)]
    plain = small_model.read_chunk(tok)
    torch.testing.assert_close(small_model.read_chunk(tok, memories=mems, alpha=1.0), plain)
    assert all(m.is_empty for m in mems)
    record = []
    mixed = small_model.read_chunk(tok, memories=mems, alpha=0.5, record=record)
    assert not torch.allclose(mixed, plain, atol=1e-4)
    assert len(record) == 2 and record[0].shape == (1, 100)
    sizes = {m.nbytes() for m in mems}
    for _ in range(3):
        small_model.read_chunk(torch.randn(1, 8, 4, 32), memories=mems, alpha=0.5)
    assert {m.nbytes() for m in mems} == sizes and mems[0].num_chunks == 4


def test_moviechat_merge_keeps_capacity_and_merges_similar_neighbours():
    D = 8
    base = torch.randn(3, D)
    # frames 0-3 near base 0, 4-5 near base 1, 6-9 near base 2
    feats = torch.cat([base[0].expand(4, D), base[1].expand(2, D), base[2].expand(4, D)]) + 0.01 * torch.randn(10, D)
    tok = feats[:, None, :].repeat(1, 2, 1)
    times = torch.linspace(0, 1, 10)
    tokens, f, t, w = _moviechat_merge(None, tok, times, capacity=3)
    assert tokens.shape == (3, 2, D) and w.tolist() == [4, 2, 4]
    torch.testing.assert_close(t, torch.stack([times[:4].mean(), times[4:6].mean(), times[6:].mean()]))
    state = _moviechat_merge((tokens, f, t, w), tok[:2], times[:2], capacity=4)
    assert len(state[2]) == 4 and state[3].sum() == 12


def test_parse_question():
    assert parse_question("count", "red").tolist() == [[2, 1, 0]]
    assert parse_question("order", 1, "blue").tolist() == [[3, 2, 3]]
    with pytest.raises(ValueError, match="unknown question type"):
        parse_question("why")
    with pytest.raises(ValueError, match="colour"):
        parse_question("exists")
    with pytest.raises(ValueError, match="unknown colour"):
        parse_question("exists", "purple")


def test_save_load_roundtrip(tmp_path, small_model):
    path = tmp_path / "m.safetensors"
    save_weights(small_model, path, {"note": "test"})
    loaded = load_model(path)
    assert loaded.config == small_model.config
    for (k, a), (_, b) in zip(small_model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a, b, msg=k)
    assert (tmp_path / "m.json").exists()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    spec = make_spec(100, seed=int(np.random.SeedSequence().entropy % 2**31), size=32)
    path = tmp_path_factory.mktemp("vid") / "clip.mp4"
    write_video(path, iter_frames(spec, 64), fps=25)
    return path, spec


@pytest.mark.parametrize("method", METHODS)
def test_infinite_video_methods_end_to_end(clip, small_model, method):
    path, spec = clip
    cfg = InfiniteVideoConfig(method=method, chunk_size=25, num_basis=16, num_samples=64, num_points=200, num_frames=16)
    iv = InfiniteVideo(small_model, cfg, device="cpu")
    mem = iv.ingest(path)
    assert mem.num_frames == 100 and mem.peak_frames_held <= 25
    n_chunks = {"uniform": 1, "moviechat": 1}.get(method, 4)
    assert mem.chunk_outputs.shape == (n_chunks, 4, 32)
    ans, probs = iv.answer(mem, "first")
    assert ans in ANSWERS and abs(sum(probs.values()) - 1) < 1e-4
    if method.startswith("infinite"):
        assert len(mem.coefficients) == 2 and mem.coefficients[0].shape == (16, 32)
        times, mass = iv.density_over_time(mem, num_bins=20)
        assert times.shape == mass.shape == (20,) and abs(mass.sum() - 1) < 1e-6
        assert times[-1] < mem.duration
    else:
        with pytest.raises(ValueError, match="no continuous memory"):
            iv.density_over_time(mem)
    if method == "uniform":
        assert mem.frames_read == 16


def test_all_questions_cover_every_colour_with_true_answers():
    from video.synthetic import COLOURS
    from video.train import all_questions

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    spec = make_spec(32, seed=int(rng.integers(1 << 30)), size=32, event_length=(1, 3), num_events=(1, 8))
    qs = all_questions(spec, rng)
    assert len(qs) == 20
    order = [e.colour for e in sorted(spec.events, key=lambda e: e.start)]
    counts = [q for q in qs if q and q.qtype == "count"]
    assert [q.arg1 for q in counts] == list(range(len(COLOURS)))
    assert [q.answer for q in counts] == [str(order.count(c)) for c in range(len(COLOURS))]
    exists = [q for q in qs if q and q.qtype == "exists"]
    assert [q.answer for q in exists] == ["yes" if c in order else "no" for c in range(len(COLOURS))]
    assert (qs[15] is None) == (len(set(order)) < 2)
    for q in qs[16:18]:  # next: the colour of the event after the first one of arg1
        assert (q is None) == (len(order) < 2)
        if q is not None:
            assert q.qtype == "next" and q.answer == COLOURS[order[order.index(q.arg1) + 1]]
    for q in qs[18:]:  # after: does arg1 occur after the last arg2
        assert (q is None) == (len(set(order)) < 2)
        if q is not None:
            last_b = max(i for i, c in enumerate(order) if c == q.arg2)
            assert q.qtype == "after" and q.answer == ("yes" if q.arg1 in order[last_b + 1:] else "no")


def test_density_over_time_maps_memory_positions_to_chunks():
    """Mass at memory position s lands in the chunk that consolidation placed there."""
    from video.infinite import VideoMemory

    T, tau, C = 1001, 0.75, 4
    s = torch.linspace(0, 1, T)
    bounds = [(c / C, (c + 1) / C) for c in range(C)]
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    k = int(rng.integers(0, C))  # chunk k from the end occupies (tau^(k+1), tau^k] (the first: (0, tau^(C-1)])
    hi, lo = tau**k, (tau ** (k + 1) if k < C - 1 else 0.0)
    mid = (hi + lo) / 2
    dens = torch.exp(-((s - mid) ** 2) / (2 * 0.002**2))
    mem = VideoMemory(path="x", method="infinite", num_frames=400, duration=16.0, frames_read=400,
                      chunk_outputs=torch.zeros(C, 1, 1), chunk_times=torch.zeros(C), chunk_bounds=bounds,
                      densities=[dens, dens], tau=tau)
    times, mass = InfiniteVideo.density_over_time(mem, num_bins=40)
    chunk = C - 1 - k
    in_chunk = (times >= bounds[chunk][0] * 16) & (times < bounds[chunk][1] * 16)
    assert mass[in_chunk].sum() > 0.99
    # the middle of the chunk's memory span maps to the middle of the chunk in time
    assert abs(times[mass.argmax()] - (bounds[chunk][0] + bounds[chunk][1]) / 2 * 16) < 16 / C / 4


def test_answer_aggregates(small_model):
    """'last' reads only the last chunk's queries, 'mean' their average: a fixed-size read-out that ignores
    chunk times; 'attention' reads every chunk with its time."""
    C, Q, D = 3, 4, 32
    out = torch.randn(2, C, Q, D)
    times = torch.sort(torch.rand(2, C), dim=1).values
    qs = torch.tensor([[0, 0, 0], [2, 3, 0]])
    with torch.no_grad():
        last = small_model.answer(out, qs, times, aggregate="last")
        only_last = small_model.answer(out[:, -1:], qs, torch.rand(2, 1), aggregate="mean")
        torch.testing.assert_close(last, only_last)
        mean = small_model.answer(out, qs, times, aggregate="mean")
        torch.testing.assert_close(mean, small_model.answer(out.mean(1, keepdim=True), qs, times[:, :1], aggregate="last"))
        assert not torch.allclose(mean, last)
        full = small_model.answer(out, qs, times, aggregate="attention")
        assert not torch.allclose(last, full)
        assert not torch.allclose(full, small_model.answer(out, qs, times.flip(1), aggregate="attention"))
        out2 = out.clone()
        out2[:, :-1] = torch.randn(2, C - 1, Q, D)  # earlier chunks do not matter to 'last'
        torch.testing.assert_close(small_model.answer(out2, qs, times, aggregate="last"), last)
    with pytest.raises(ValueError, match="aggregate"):
        small_model.answer(out, qs, times, aggregate="max")
    with pytest.raises(ValueError, match="aggregate"):
        InfiniteVideoConfig(aggregate="max")
