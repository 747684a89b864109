"""Tests of the bounded-interface reading methods (MovieChat sizes, shared feeding, source maps), the new
question types, training with the memory in the loop, and the resumable ∞-Video benchmark."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from video.infinite import InfiniteVideo, InfiniteVideoConfig, VideoMemory, _moviechat_feed, _moviechat_frames
from video.model import VideoQAConfig, VideoQAModel
from video.synthetic import COLOURS, Event, VideoSpec, make_question, make_questions, make_spec


def _spec(colours: list[int]) -> VideoSpec:
    events = tuple(Event(colour=c, start=10 * i, length=3, x=0, y=0, side=8) for i, c in enumerate(colours))
    return VideoSpec(num_frames=10 * len(colours) + 10, size=32, fps=25.0, seed=0, events=events)


def test_next_and_after_questions():
    red, green, blue, yellow = 0, 1, 2, 3
    spec = _spec([blue, red, green, red, blue, yellow])
    assert make_question(spec, "next", red).answer == "green"
    assert make_question(spec, "next", blue).answer == "red"
    assert make_question(spec, "after", yellow, blue).answer == "yes"  # yellow comes after the last blue
    assert make_question(spec, "after", red, blue).answer == "no"  # reds only before the last blue
    assert make_question(spec, "after", blue, yellow).answer == "no"
    with pytest.raises(ValueError, match="no event follows"):
        make_question(spec, "next", yellow)
    with pytest.raises(ValueError, match="needs colour"):
        make_question(spec, "next", COLOURS.index("cyan"))
    with pytest.raises(ValueError, match="needs colour"):
        make_question(spec, "after", red, COLOURS.index("magenta"))
    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    types = {q.qtype for _ in range(20) for q in make_questions(make_spec(512, seed=int(rng.integers(1 << 30))), rng)}
    assert {"next", "after"} <= types


def test_moviechat_keeps_its_published_sizes():
    """A full short-term buffer is merged to `merge` frames and moved on; the long-term memory stays bounded."""
    cfg = InfiniteVideoConfig(method="moviechat", moviechat_short=5, moviechat_merge=2, moviechat_long=6)
    D, n = 4, 23
    tok = torch.randn(n, 3, D)
    times = torch.linspace(0, 1, n)
    state = None
    for s in range(0, n, 7):  # chunks of 7 frames
        state = _moviechat_feed(state, tok[s:s + 7], times[s:s + 7], cfg)
    # 23 frames = 4 full buffers (20 frames -> 8 long-term frames, merged to 6) + 3 in the short-term buffer
    assert len(state["long"][2]) == 6 and len(state["short"][2]) == 3
    assert float(state["long"][3].sum()) == 20 and float(state["short"][3].sum()) == 3
    frames, t = _moviechat_frames(state)
    assert frames.shape == (9, 3, D) and (t[1:] >= t[:-1]).all()
    with pytest.raises(ValueError, match="MovieChat"):
        InfiniteVideoConfig(moviechat_short=4, moviechat_merge=4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    return VideoQAModel(VideoQAConfig(dim=32, num_heads=2, num_layers=2, num_queries=4, encoder_dim=32,
                                      encoder_width=8, readout="last")).eval()


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    from video.synthetic import iter_frames, write_video

    spec = make_spec(150, seed=int(np.random.SeedSequence().entropy % 2**31), size=32)
    path = tmp_path_factory.mktemp("vid") / "clip.mp4"
    write_video(path, iter_frames(spec, 64), fps=25)
    return path, spec


@pytest.mark.parametrize("method", ["uniform", "infinite", "moviechat"])
def test_feeding_a_shared_stream_equals_ingest(model, clip, method):
    """The benchmark decodes once and feeds every method; that must give what ingest gives."""
    from video.io import VideoStream

    path, _ = clip
    cfg = InfiniteVideoConfig(method=method, chunk_size=32, num_basis=16, num_samples=64, num_points=200,
                              num_frames=16, moviechat_short=6, moviechat_long=12)
    iv = InfiniteVideo(model, cfg, device="cpu")
    want = iv.ingest(path)
    stream = VideoStream(path, chunk_size=32)
    state = iv.start(path, stream.info.num_frames, stream.info.duration, stream.indices)
    for chunk in stream:
        iv.feed(state, iv.encode(chunk.frames, chunk.indices, stream.info.num_frames), chunk.indices)
    got = iv.finish(state)
    assert got.frames_read == want.frames_read
    torch.testing.assert_close(got.chunk_outputs, want.chunk_outputs, rtol=1e-4, atol=1e-5)
    assert iv.aggregate == "last"
    assert iv.answer(got, "first")[0] == iv.answer(want, "first")[0]


def test_memory_source_maps_reach_the_start_of_the_video(model, clip):
    """With sticky memories the source map spans the whole video, ends at the last chunk, and the density
    mapped through it sums to 1 over the video."""
    path, _ = clip
    iv = InfiniteVideo(model, InfiniteVideoConfig(method="infinite", chunk_size=25, num_basis=16, num_samples=64,
                                                  num_points=200), device="cpu")
    mem = iv.ingest(path)
    assert len(mem.sources) == 2
    for src in mem.sources:
        assert (src[1:] >= src[:-1] - 1e-6).all()
        assert src[0] < 25 / 150 and src[-1] > 1 - 25 / 150
    times, mass = iv.density_over_time(mem, num_bins=30)
    assert abs(mass.sum() - 1) < 1e-6
    # a density peaked at one point puts its mass at that point's source time
    k = 37
    dens = torch.zeros(200)
    dens[k] = 1.0
    fake = VideoMemory(path="x", method="infinite", num_frames=150, duration=6.0, frames_read=150,
                       chunk_outputs=mem.chunk_outputs, chunk_times=mem.chunk_times, chunk_bounds=mem.chunk_bounds,
                       densities=[dens], sources=[mem.sources[0]])
    times, mass = InfiniteVideo.density_over_time(fake, num_bins=30)
    assert mass.argmax() == min(int(float(mem.sources[0][k]) * 30), 29)


def test_training_with_the_memory_in_the_loop(model):
    from core.continuous import ContinuousMemoryConfig
    from video.train import make_batch

    rng = np.random.default_rng(np.random.SeedSequence().entropy)
    frames, times, q, ans, _ = make_batch(rng, 2, 32)
    cfg = ContinuousMemoryConfig(num_basis=16, num_samples=64, num_points=100)
    model.train()
    try:
        logits = model(frames, times, q, num_chunks=4, aggregate="last", memory=cfg, alpha=0.5)
        plain = model(frames, times, q, num_chunks=4, aggregate="last")
        assert logits.shape == plain.shape and not torch.allclose(logits, plain, atol=1e-4)
        model.zero_grad()
        logits[:, :, 0].sum().backward()
        # the first chunks reach a 'last' read-out only through the memory: their frames get gradients
        g = model.queries.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
        assert model.frame_proj.weight.grad.abs().sum() > 0
    finally:
        model.zero_grad()
        model.eval()


def test_benchmark_statistics():
    from benchmarks.video_bench import paired, wilson

    lo, hi = wilson(8, 10)
    assert 0.44 < lo < 0.5 and 0.94 < hi < 0.97  # the Wilson interval of 8/10
    assert wilson(0, 10)[0] == pytest.approx(0.0, abs=1e-12)
    p = paired([1, 1, 0, 1], [0, 1, 0, 0])
    assert p["diff"] == 0.5 and p["a_only"] == 2 and p["b_only"] == 0 and p["ci_lo"] < 0.5 < p["ci_hi"]


def test_benchmark_runs_and_resumes(tmp_path, model):
    from benchmarks import video_bench
    from video.synthetic import QUESTION_TYPES
    from video.train import save_weights

    weights = tmp_path / "m.safetensors"
    save_weights(model, weights, {"note": "test"})
    out = tmp_path / "r.json"
    argv = ["--lengths", "96", "--videos", "2", "--weights", str(weights), "--skip-peak", "--chunk-size", "32",
            "--num-basis", "16", "--data", str(tmp_path / "data"), "--out", str(out)]
    assert video_bench.main(argv) == 0
    res = json.loads(out.read_text())
    assert res["settings"]["aggregate"] == "mean" and res["settings"]["balanced"] == 3 and len(res["videos"]) == 2
    methods = {r["method"] for r in res["accuracy"]}
    assert methods == {"uniform", "chunks", "infinite", "infinite_nosticky", "moviechat", "majority"}
    assert set(res["majority"]["96"]) <= set(QUESTION_TYPES)  # counted on development questions
    for v in res["videos"].values():
        n = len(v["qtypes"])
        assert n >= 7 and all(len(r["marks"]) == n for r in v["runs"].values())
        assert v["runs"]["uniform"]["frames_read"] == 16
    assert out.with_suffix(".png").exists() and "Paired" in out.with_suffix(".md").read_text()
    # a rerun finds every video done and reads nothing
    calls = []
    orig = video_bench.run_video
    video_bench.run_video = lambda *a, **k: calls.append(1) or orig(*a, **k)
    try:
        assert video_bench.main(argv) == 0
        assert not calls
        assert video_bench.main(argv[:3] + ["3"] + argv[4:]) == 0  # one more video: only it is read
        assert len(calls) == 1
    finally:
        video_bench.run_video = orig
    with pytest.raises(SystemExit, match="other settings"):
        video_bench.main(argv + ["--alpha", "0.5"])
    # NAME@ALPHA: a memory method at another alpha on the same decoded video, paired with its non-sticky twin
    out2 = tmp_path / "r2.json"
    argv2 = [*argv[:-1], str(out2), "--methods", "chunks,infinite@0.75,infinite_nosticky@0.75,infinite@1", "--aggregate",
             "last"]
    assert video_bench.main(argv2) == 0
    res = json.loads(out2.read_text())
    marks = {m: [x for v in res["videos"].values() for x in v["runs"][m]["marks"]] for m in res["methods"]}
    assert marks["infinite@1"] == marks["chunks"]  # alpha 1 is the chunk baseline
    pairs = {(r["a"], r["b"]) for r in res["paired"] if "qtype" not in r or r.get("qtype") in (None, "–")}
    assert ("infinite@0.75", "infinite_nosticky@0.75") in pairs and ("infinite@0.75", "majority") in pairs
    with pytest.raises(SystemExit, match="alpha"):
        video_bench.main([*argv2[:-3], "infinite@2"])


def test_balanced_questions_spread_the_answers():
    from collections import Counter, defaultdict

    from video.synthetic import BALANCED_RANGES, AnswerBalancer, make_spec

    bal, counts = AnswerBalancer(3, seed=5), defaultdict(Counter)
    specs = [make_spec(1024, seed=100 + i, size=32) for i in range(40)]
    per_video = [bal.questions(s) for s in specs]
    for qs in per_video:
        for q in qs:
            counts[q.qtype][q.answer] += 1
    for qtype, answers in BALANCED_RANGES.items():
        c = [counts[qtype][a] for a in answers]
        assert max(c) - min(c) <= 1, (qtype, counts[qtype])  # uniform over the range, within one question
        assert set(counts[qtype]) <= set(answers)
    assert sum(counts["exists"].values()) >= 100 and sum(counts["count"].values()) >= 30
    # sequential: the first videos' questions do not depend on the later ones
    again = AnswerBalancer(3, seed=5)
    assert [again.questions(s) for s in specs[:10]] == per_video[:10]
    for q in per_video[0]:  # every answer is the true one
        from video.synthetic import make_question

        assert make_question(specs[0], q.qtype, q.arg1, q.arg2).answer == q.answer


def test_init_from_copies_what_fits(tmp_path):
    from video.train import init_from, main, save_weights

    small = dict(dim=16, num_heads=2, num_layers=1, num_queries=2, encoder_dim=16, encoder_width=8)
    old = VideoQAModel(VideoQAConfig(num_question_types=5, **small))
    save_weights(old, tmp_path / "old.safetensors", {})
    new = VideoQAModel(VideoQAConfig(**small))  # 7 question types
    partial = init_from(new, tmp_path / "old.safetensors")
    assert partial == ["q_type.weight"]
    torch.testing.assert_close(new.q_type.weight[:5], old.q_type.weight)
    assert not torch.equal(new.q_type.weight[5:], torch.zeros_like(new.q_type.weight[5:]))
    torch.testing.assert_close(new.queries, old.queries)
    with pytest.raises(SystemExit, match="divide"):
        main(["--out", str(tmp_path / "run"), "--clip-lengths", "16,24", "--chunk-counts", "1,16"])
