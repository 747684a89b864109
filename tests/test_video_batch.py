"""Tests of the batch CLI (video.batch): outputs, manifest, resume after a kill, shards, locks, errors."""

from __future__ import annotations

import csv
import os

import numpy as np
import pytest

from video import batch
from video.infinite import InfiniteVideo, InfiniteVideoConfig
from video.model import VideoQAConfig, VideoQAModel
from video.synthetic import iter_frames, make_spec, write_video


@pytest.fixture(scope="module")
def videos(tmp_path_factory):
    root = tmp_path_factory.mktemp("videos")
    seed = int(np.random.SeedSequence().entropy % 2**30)
    for i in range(3):
        write_video(root / f"v{i}.mp4", iter_frames(make_spec(40 + 8 * i, seed=seed + i, size=32)), fps=25)
    (root / "broken.mp4").write_text("not a video")
    (root / "notes.txt").write_text("ignored: not a video extension")
    return root


@pytest.fixture(scope="module")
def iv():
    model = VideoQAModel(VideoQAConfig(dim=16, num_heads=2, num_layers=2, num_queries=4, encoder_dim=16,
                                       encoder_width=8, input_size=16))
    cfg = InfiniteVideoConfig(chunk_size=16, num_basis=8, num_samples=32, num_points=64)
    return InfiniteVideo(model.eval(), cfg, device="cpu")


def _manifest(path):
    with open(path, newline="") as f:
        return {r["video"]: r for r in csv.DictReader(f)}


def test_batch_writes_memories_and_manifest_and_resumes(tmp_path, videos, iv, monkeypatch):
    out = tmp_path / "out"
    real = batch.process_video
    calls = []

    def killed_on_third(iv_, path, out_file):
        calls.append(path.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the job is killed while processing v1 (after broken.mp4 and v0)
        return real(iv_, path, out_file)

    monkeypatch.setattr(batch, "process_video", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4", "v0.mp4", "v1.mp4"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["v0.safetensors"]
    assert not list(out.glob(".*")) and not list(out.glob("*.lock"))  # no partial or lock file left

    calls.clear()
    monkeypatch.setattr(batch, "process_video", lambda *a: (calls.append(a[1].name), real(*a))[1])
    rows = batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4", "v1.mp4", "v2.mp4"]  # v0 (finished before the kill) is not redone
    assert {r["status"] for n, r in rows.items() if n.startswith("v")} <= {"done", "exists"}
    assert rows["broken.mp4"]["status"] == "error" and "cannot read" in rows["broken.mp4"]["error"]
    assert "notes.txt" not in rows
    m = _manifest(out / "manifest.csv")
    assert set(m) == {"v0.mp4", "v1.mp4", "v2.mp4", "broken.mp4"}

    from safetensors import safe_open

    with safe_open(str(out / "v2.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        coef = f.get_tensor("layer0.coef")
        outs = f.get_tensor("chunk_outputs")
    assert {"chunk_outputs", "chunk_times", "layer0.coef", "layer1.coef", "layer0.density"} <= keys
    assert coef.shape == (8, 16) and outs.shape == (-(-56 // 16), 4, 16)
    assert meta["num_frames"] == "56" and meta["method"] == "infinite"

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    calls.clear()
    batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4"]  # only the failure is retried
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes


def test_errors_stop_without_skip_errors(tmp_path, videos, iv):
    with pytest.raises(ValueError, match="cannot read"):
        batch.run_batch(videos, tmp_path / "o", iv=iv, shard=(0, 1), skip_errors=False)
    m = _manifest(tmp_path / "o" / "manifest.csv")
    assert m["broken.mp4"]["status"] == "error"


def test_shards_split_the_videos_and_locks(tmp_path, videos, iv):
    parts = [batch.list_videos(videos, (i, 3)) for i in range(3)]
    names = sorted(p.name for part in parts for p in part)
    assert names == sorted(p.name for p in batch.list_videos(videos))
    assert len(set(names)) == len(names) == 4
    with pytest.raises(ValueError, match="I/N"):
        batch.parse_shard("3/3")
    with pytest.raises(ValueError, match="I/N"):
        batch.parse_shard("two")
    out = tmp_path / "locks"
    out.mkdir()
    target = batch.list_videos(videos, (1, 2))
    (out / f"{target[0].stem}.lock").write_text(str(os.getppid()))  # a live worker holds it
    (out / f"{target[1].stem}.lock").write_text("999999999")  # a dead worker's stale lock
    rows = batch.run_batch(videos, out, iv=iv, shard=(1, 2), skip_errors=True)
    assert target[0].name not in rows and target[1].name in rows
    assert (out / "manifest_1of2.csv").exists()


def test_cli_help_and_bad_shard(capsys):
    with pytest.raises(SystemExit) as e:
        batch.main(["--help"])
    assert e.value.code == 0 and "--shard" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="I/N"):
        batch.main(["--videos", ".", "--out", ".", "--shard", "1/1"])


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        batch.list_videos(tmp_path / "nope")
