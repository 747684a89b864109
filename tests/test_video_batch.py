"""Tests of the batch CLI (video.batch): outputs, manifest, resume after a kill, shards, locks, errors."""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import time

import numpy as np
import pytest
import torch

from core.infra.jobs import SettingsMismatch, settings_fingerprint
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

    def killed_on_third(iv_, path, out_file, **kw):
        calls.append(path.name)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the job is killed while processing v1 (after broken.mp4 and v0)
        return real(iv_, path, out_file, **kw)

    monkeypatch.setattr(batch, "process_video", killed_on_third)
    with pytest.raises(KeyboardInterrupt):
        batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4", "v0.mp4", "v1.mp4"]
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["v0.mp4.safetensors"]
    assert not list(out.glob(".*")) and not list(out.glob("**/*.lock"))  # no partial or lock file left

    calls.clear()
    monkeypatch.setattr(batch, "process_video", lambda *a, **kw: (calls.append(a[1].name), real(*a, **kw))[1])
    rows = batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4", "v1.mp4", "v2.mp4"]  # v0 (finished before the kill) is not redone
    assert {r["status"] for n, r in rows.items() if n.startswith("v")} <= {"done", "exists"}
    assert rows["broken.mp4"]["status"] == "failed" and "cannot read" in rows["broken.mp4"]["error"]
    assert "notes.txt" not in rows
    m = _manifest(out / "manifest.csv")
    assert set(m) == {"v0.mp4", "v1.mp4", "v2.mp4", "broken.mp4"}

    from safetensors import safe_open

    with safe_open(str(out / "v2.mp4.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        meta = f.metadata()
        coef = f.get_tensor("layer0.coef")
        outs = f.get_tensor("chunk_outputs")
    assert {"chunk_outputs", "chunk_times", "layer0.coef", "layer1.coef", "layer0.density"} <= keys
    assert coef.shape == (8, 16) and outs.shape == (-(-56 // 16), 4, 16)
    assert meta["num_frames"] == "56" and meta["method"] == "infinite"
    settings = json.loads(meta["settings"])
    assert settings["reader"]["chunk_size"] == 16 and settings["model"]["config"]["encoder"] == "tiny"
    assert meta["settings_fingerprint"] == settings_fingerprint(settings) == m["v2.mp4"]["settings"]

    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    calls.clear()
    batch.run_batch(videos, out, iv=iv, skip_errors=True)
    assert calls == ["broken.mp4"]  # only the failure is retried
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes


def test_errors_stop_without_skip_errors(tmp_path, videos, iv):
    with pytest.raises(ValueError, match="cannot read"):
        batch.run_batch(videos, tmp_path / "o", iv=iv, shard=(0, 1), skip_errors=False)
    m = _manifest(tmp_path / "o" / "manifest.csv")
    assert m["broken.mp4"]["status"] == "failed"


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
    (out / "locks").mkdir(parents=True)
    target = batch.list_videos(videos, (1, 2))
    lock = {"host": socket.gethostname(), "pid": os.getppid(), "start": 0, "heartbeat": time.time(), "token": "x"}
    (out / "locks" / f"{target[0].name}.lock").write_text(json.dumps(lock))  # a live worker holds it
    (out / "locks" / f"{target[1].name}.lock").write_text(json.dumps({**lock, "pid": 999999999}))  # a dead one's
    rows = batch.run_batch(videos, out, iv=iv, shard=(1, 2), skip_errors=True)
    assert rows[target[0].name]["status"] == "locked" and not (out / f"{target[0].name}.safetensors").exists()
    assert rows[target[1].name]["status"] in ("done", "failed")
    assert (out / "manifest_1of2.csv").exists() and os.listdir(out / "locks") == [f"{target[0].name}.lock"]


def test_cli_help_and_bad_shard(capsys):
    with pytest.raises(SystemExit) as e:
        batch.main(["--help"])
    text = capsys.readouterr().out
    assert e.value.code == 0 and "--shard" in text and "--time-limit" in text and "refuses" in text
    with pytest.raises(SystemExit) as e:
        batch.main(["--videos", ".", "--out", ".", "--shard", "1/1"])
    assert e.value.code == 2 and "I/N" in capsys.readouterr().err


def test_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        batch.list_videos(tmp_path / "nope")


def test_rerun_with_other_settings_refuses_or_redoes_and_same_stems_do_not_collide(tmp_path, videos, iv):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(videos / "v0.mp4", src / "a.mp4")
    shutil.copy(videos / "v1.mp4", src / "a.mkv")  # same stem, other container: its own output
    out = tmp_path / "out"
    rows = batch.run_batch(src, out, iv=iv)
    assert {n: r["status"] for n, r in rows.items()} == {"a.mkv": "done", "a.mp4": "done"}
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["a.mkv.safetensors", "a.mp4.safetensors"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}

    other = InfiniteVideo(iv.model, InfiniteVideoConfig(**{**vars(iv.config), "chunk_size": 8}), device="cpu")
    with pytest.raises(SettingsMismatch, match=r"reader\.chunk_size: 16 -> 8.*--overwrite"):
        batch.run_batch(src, out, iv=other)
    other_method = InfiniteVideo(iv.model, InfiniteVideoConfig(**{**vars(iv.config), "method": "chunks"}),
                                 device="cpu")
    with pytest.raises(SettingsMismatch, match=r"reader\.method"):
        batch.run_batch(src, out, iv=other_method)
    weights = VideoQAModel(iv.model.config)  # same architecture, other weights (one parameter moved)
    weights.load_state_dict(iv.model.state_dict())
    with torch.no_grad():
        next(weights.parameters()).add_(0.01)
    with pytest.raises(SettingsMismatch, match=r"model\.weights_sha256"):
        batch.run_batch(src, out, iv=InfiniteVideo(weights.eval(), iv.config, device="cpu"))
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes  # nothing touched

    rows = batch.run_batch(src, out, iv=other, overwrite=True)
    assert {r["status"] for r in rows.values()} == {"done"}
    from safetensors import safe_open

    with safe_open(str(out / "a.mp4.safetensors"), framework="pt") as f:
        assert json.loads(f.metadata()["settings"])["reader"]["chunk_size"] == 8
        assert f.get_tensor("chunk_outputs").shape[0] == -(-40 // 8)
    # the same settings again: kept, nothing redone
    mtimes = {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")}
    batch.run_batch(src, out, iv=other)
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.safetensors")} == mtimes


def test_time_limit_records_a_stalled_video_as_failed(tmp_path, videos, iv):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(videos / "v0.mp4", src / "v0.mp4")
    out = tmp_path / "out"
    rows = batch.run_batch(src, out, iv=iv, time_limit=0.001, skip_errors=True)  # no video ingests in 1 ms
    assert rows["v0.mp4"]["status"] == "failed" and "time limit" in rows["v0.mp4"]["error"]
    assert not list(out.glob("*.safetensors")) and not list(out.glob(".*"))
    rows = batch.run_batch(src, out, iv=iv, time_limit=120)  # in a worker process, within the limit
    assert rows["v0.mp4"]["status"] == "done" and (out / "v0.mp4.safetensors").exists()
