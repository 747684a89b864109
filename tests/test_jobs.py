"""The batch-job runner (core.infra.jobs): settings fingerprints, skip/resume, refusal or redo on other settings, shards,
cross-host locks with heartbeats, temp-file cleanup, the merged manifest, and the per-item time limit."""

from __future__ import annotations

import argparse
import csv
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from core.infra import jobs
from core.infra.jobs import runner
from core.infra.jobs import FileLock, Item, JobConfig, SettingsMismatch, run_job, settings_diff, settings_fingerprint


class ToyJob:
    """Writes ``<out>/<key>.json`` holding its settings and a value derived from the input file.

    Items whose input text starts with ``fail`` raise; ``sleep`` items start a grandchild process (its pid written
    to ``<out>/<key>.child``), leave a temp file and sleep; ``slow`` items sleep a little.
    """

    key_field = "name"
    extra_fields = ("value",)

    def __init__(self, out, scale: float = 1.0, log: str | None = None):
        self.out = str(out)
        self.scale = scale
        self.log = log  # a file each call appends its key to (calls from several processes)
        self.calls: list[str] = []

    def outputs(self, item):
        return [os.path.join(self.out, f"{item.key}.json")]

    def settings(self, item):
        return {self.outputs(item)[0]: {"scale": self.scale, "kind": "toy"}}

    def stored_settings(self, path):
        with open(path) as f:
            return json.load(f).get("settings")

    def process(self, item):
        self.calls.append(item.key)
        if self.log:
            with open(self.log, "a") as f:
                f.write(f"{item.key} {os.getpid()}\n")
        text = open(item.path).read()
        if text.startswith("fail"):
            raise ValueError(f"cannot use {item.path}: {text}")
        if text.startswith("sleep"):
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            with open(os.path.join(self.out, f"{item.key}.child"), "w") as f:
                f.write(str(child.pid))
            with open(jobs.atomic_target(self.outputs(item)[0]), "w") as f:
                f.write("partial")
            time.sleep(600)
        if text.startswith("slow"):
            time.sleep(0.3)
        value = len(text) * self.scale
        with jobs.atomic_write(self.outputs(item)[0]) as tmp:
            with open(tmp, "w") as f:
                json.dump({"settings": self.settings(item)[self.outputs(item)[0]], "value": value}, f)
        return {"value": value}


def _inputs(tmp_path, texts: dict[str, str]) -> list[Item]:
    src = tmp_path / "in"
    src.mkdir(exist_ok=True)
    items = []
    for k, t in texts.items():
        (src / f"{k}.txt").write_text(t)
        items.append(Item(key=k, path=str(src / f"{k}.txt")))
    return items


def _manifest(path):
    with open(path, newline="") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ------------------------------------------------------------------------------------------- fingerprints


def test_fingerprint_is_stable_and_names_differences():
    a = {"mpp": 0.5, "encoder": {"name": "default", "widths": (8, 16)}, "size": 256}
    b = {"size": 256.0, "encoder": {"widths": [8, 16], "name": "default"}, "mpp": 0.5}  # same, other order/types
    assert settings_fingerprint(a) == settings_fingerprint(b) and len(settings_fingerprint(a)) == 16
    c = {**a, "mpp": 1.0}
    assert settings_fingerprint(c) != settings_fingerprint(a)
    assert settings_diff(a, b) == []
    assert settings_diff(a, c) == ["mpp: 0.5 -> 1"]
    assert settings_diff(a, {**a, "encoder": {"name": "timm:x", "widths": (8, 16)}}) == [
        'encoder.name: "default" -> "timm:x"']
    assert "no settings record" in settings_diff(None, a)[0]
    with pytest.raises(ValueError, match="non-finite"):
        settings_fingerprint({"x": float("nan")})
    with pytest.raises(ValueError, match="accepted"):
        settings_fingerprint({"x": object()})


def test_file_identity_follows_content_not_place(tmp_path):
    a = tmp_path / "w.bin"
    a.write_bytes(os.urandom(3 << 20))
    b = tmp_path / "sub" / "w_copy.bin"
    b.parent.mkdir()
    b.write_bytes(a.read_bytes())
    assert jobs.file_identity(a) == jobs.file_identity(b) and jobs.file_identity(a)["size"] == 3 << 20
    data = bytearray(a.read_bytes())
    data[-1] ^= 1  # a change past the first megabytes
    b.write_bytes(bytes(data))
    assert jobs.file_identity(b) != jobs.file_identity(a)


# ------------------------------------------------------------------------------------------------ runner


def test_run_skips_done_refuses_other_settings_and_redoes_with_overwrite(tmp_path):
    items = _inputs(tmp_path, {"a": "aaa", "b": "bb", "c": "c"})
    out = tmp_path / "out"
    job = ToyJob(out)
    rows = run_job(job, items, JobConfig(out=str(out), progress=False))
    assert job.calls == ["a", "b", "c"]
    assert {k: r["status"] for k, r in rows.items()} == {"a": "done", "b": "done", "c": "done"}
    fp = settings_fingerprint({"scale": 1.0, "kind": "toy"})
    assert {r["settings"] for r in rows.values()} == {fp} and rows["a"]["value"] == "3.0"
    assert _manifest(out / "manifest.csv")["b"]["output"] == "b.json"

    # same settings: nothing is redone
    job = ToyJob(out)
    run_job(job, items, JobConfig(out=str(out), progress=False))
    assert job.calls == []

    # other settings: refused before any work, naming the setting and the way out
    (out / "c.json").unlink()
    job = ToyJob(out, scale=2.0)
    with pytest.raises(SettingsMismatch, match=r"2 existing output\(s\).*scale: 1 -> 2.*--overwrite"):
        run_job(job, items, JobConfig(out=str(out), progress=False))
    assert job.calls == []  # not even the missing item was done
    assert _manifest(out / "manifest.csv")["a"]["status"] == "done"  # the outputs are unchanged, so is their row

    # overwrite: the old outputs are redone with the new settings
    rows = run_job(job, items, JobConfig(out=str(out), progress=False, overwrite=True))
    assert job.calls == ["a", "b", "c"]
    assert json.loads((out / "a.json").read_text())["value"] == 6.0
    assert {r["status"] for r in rows.values()} == {"done"}
    assert {r["settings"] for r in rows.values()} == {settings_fingerprint({"scale": 2.0, "kind": "toy"})}

    # an output that holds no settings record is not reused either
    (out / "b.json").write_text(json.dumps({"value": 1}))
    with pytest.raises(SettingsMismatch, match="no settings record"):
        run_job(ToyJob(out, scale=2.0), items, JobConfig(out=str(out), progress=False))


def test_failures_stop_or_are_recorded_and_shards_partition(tmp_path):
    items = _inputs(tmp_path, {"a": "x", "b": "fail here", "c": "y", "d": "z"})
    out = tmp_path / "out"
    job = ToyJob(out)
    with pytest.raises(ValueError, match="cannot use"):
        run_job(job, items, JobConfig(out=str(out), progress=False))
    assert job.calls == ["a", "b"]
    m = _manifest(out / "manifest.csv")
    assert m["b"]["status"] == "failed" and "ValueError: cannot use" in m["b"]["error"]
    assert "fail here" in (out / "failures.log").read_text()

    seen = []
    for i in range(3):
        job = ToyJob(tmp_path / "sh")
        rows = run_job(job, items, JobConfig(out=str(tmp_path / "sh"), shard=(i, 3), skip_errors=True,
                                             progress=False))
        assert set(job.calls) == {it.key for it in items[i::3]}
        seen += job.calls
        assert (tmp_path / "sh" / f"manifest_{i}of3.csv").exists() and set(rows) == set(job.calls)
    assert sorted(seen) == ["a", "b", "c", "d"]

    with pytest.raises(ValueError, match="share the key 'a'"):
        run_job(ToyJob(out), items + [Item(key="a", path="other/a.bin")], JobConfig(out=str(out), progress=False))
    with pytest.raises(ValueError, match="shard"):
        JobConfig(out=str(out), shard=(3, 3))


def test_locked_items_are_skipped_and_leftover_temps_removed(tmp_path):
    items = _inputs(tmp_path, {"a": "x", "b": "y", "c": "z"})
    out = tmp_path / "out"
    (out / "locks").mkdir(parents=True)
    live = {"host": socket.gethostname(), "pid": os.getppid(), "start": time.time(), "heartbeat": time.time(),
            "token": "t1"}
    (out / "locks" / "a.lock").write_text(json.dumps(live))  # a live worker holds a
    (out / "locks" / "b.lock").write_text(json.dumps({**live, "pid": _dead_pid()}))  # b's worker is gone
    (out / ".b.json.otherhost.123.tmp").write_text("partial")  # b's killed writer, on any host
    (out / ".c.json.h.1.x.tmp").write_text("partial")
    job = ToyJob(out)
    rows = run_job(job, items, JobConfig(out=str(out), progress=False))
    assert job.calls == ["b", "c"] and rows["a"]["status"] == "locked"
    assert sorted(os.listdir(out / "locks")) == ["a.lock"]
    assert not [f for f in os.listdir(out) if ".tmp" in f]
    # another worker on the same shard writes its row later: the manifest merges, keeping both
    runner._Manifest(str(out / "manifest.csv"), "name", ["name", "status"]).update({"a": {"name": "a", "status": "done"}})
    m = _manifest(out / "manifest.csv")
    assert m["a"]["status"] == "done" and m["b"]["status"] == "done"
    # a worker that found it locked and writes later does not hide the result
    late = runner._Manifest(str(out / "manifest.csv"), "name", ["name", "status"])
    late.update({"a": {"name": "a", "status": "locked"}})
    assert _manifest(out / "manifest.csv")["a"]["status"] == "done"


def _run_toy(out, items, log, gate):
    gate.wait(60)  # both processes start together
    run_job(ToyJob(out, log=log), items, JobConfig(out=str(out), progress=False))


def test_two_workers_on_one_folder_share_the_items(tmp_path):
    """Two processes running the same job at once: every item is done once, the manifest keeps every row."""
    import multiprocessing as mp

    items = _inputs(tmp_path, {f"i{k:02d}": "slow" for k in range(12)})
    out, log = tmp_path / "out", str(tmp_path / "calls.log")
    ctx = mp.get_context("spawn")
    gate = ctx.Barrier(2)
    procs = [ctx.Process(target=_run_toy, args=(out, items, log, gate)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    calls = [line.split() for line in open(log).read().splitlines()]
    assert sorted(k for k, _ in calls) == sorted(it.key for it in items)  # each once, none twice
    assert len({pid for _, pid in calls}) == 2  # both worked (12 items of 0.3 s each, started together)
    m = _manifest(out / "manifest.csv")
    assert set(m) == {it.key for it in items} and {r["status"] for r in m.values()} <= {"done", "exists"}
    assert os.listdir(out / "locks") == []


def test_an_output_written_by_another_worker_between_two_checks(tmp_path, monkeypatch):
    """The race the two-worker test can hit: another worker finishes an item just after this one looked for its
    outputs. Simulated deterministically: the output appears right after the runner's per-item settings check."""
    items = _inputs(tmp_path, {"a": "x", "b": "x"})
    out = tmp_path / "out"
    other = ToyJob(out)
    real = runner._mismatches
    calls: dict[str, int] = {}

    def racing(job, item, wanted):
        res = real(job, item, wanted)
        calls[item.key] = calls.get(item.key, 0) + 1
        if item.key == "a" and calls["a"] == 2:  # the loop's check (the first call is the pass before any work)
            os.makedirs(out, exist_ok=True)
            other.process(item)  # the other worker writes a's output now
        return res

    monkeypatch.setattr(runner, "_mismatches", racing)
    mine = ToyJob(out)
    rows = run_job(mine, items, JobConfig(out=str(out), progress=False))
    assert mine.calls == ["b"] and rows["a"]["status"] == "exists" and rows["b"]["status"] == "done"


# ------------------------------------------------------------------------------------------------- locks


def test_lock_staleness_across_hosts_and_heartbeat(tmp_path):
    path = tmp_path / "locks" / "s.lock"
    lock = FileLock(path, stale_after=60, heartbeat=0.05)
    assert lock.acquire()
    info = json.loads(path.read_text())
    assert info["host"] == socket.gethostname() and info["pid"] == os.getpid()
    assert not FileLock(path, stale_after=60).acquire()  # held by a live process
    time.sleep(0.3)
    beat = json.loads(path.read_text())
    assert beat["heartbeat"] > info["heartbeat"] and beat["token"] == info["token"]  # refreshed while held
    lock.release()
    assert not path.exists()

    old = time.time() - 3600
    other = {"host": "another-host", "pid": os.getpid(), "start": old, "heartbeat": time.time(), "token": "x"}
    path.write_text(json.dumps(other))
    assert not FileLock(path, stale_after=60).acquire()  # another host, fresh heartbeat: its pid means nothing here
    path.write_text(json.dumps({**other, "heartbeat": old}))
    os.utime(path, (old, old))
    taker = FileLock(path, stale_after=60)
    assert taker.acquire()  # another host, heartbeat an hour old: stale
    assert json.loads(path.read_text())["token"] == taker.token
    # a holder that lost its lock (taken over meanwhile) does not remove the new holder's file on release
    loser = FileLock(path, stale_after=60)
    loser.token = "lost"
    loser.release()
    assert path.exists()
    taker.release()

    dead = _dead_pid()
    killed_mid_acquire = path.parent / f".s.lock.{socket.gethostname()}.{dead}.0a1b.tmp"
    live_acquiring = path.parent / f".s.lock.{socket.gethostname()}.{os.getppid()}.0a1c.tmp"
    for f in (killed_mid_acquire, live_acquiring):
        f.write_text("{}")
    lock = FileLock(path)
    assert lock.acquire()
    assert not killed_mid_acquire.exists() and live_acquiring.exists()
    lock.release()
    live_acquiring.unlink()
    path.write_text(json.dumps({**other, "host": socket.gethostname(), "pid": dead}))
    FileLock(path).clear_if_stale()  # this host, process gone
    assert not path.exists()
    path.write_text("{half")
    FileLock(path).clear_if_stale()  # unreadable but new: kept
    assert path.exists()
    os.utime(path, (old, old))
    FileLock(path).clear_if_stale()
    assert not path.exists()
    assert not [f for f in os.listdir(path.parent) if f.startswith(".")]  # no temp or moved-aside file left


def test_a_lock_taken_between_judging_and_breaking_is_put_back(tmp_path, monkeypatch):
    """Two takers judge the same stale lock; the second must not remove the lock the first one just created."""
    path = tmp_path / "s.lock"
    fresh = {"host": "another-host", "pid": 1, "start": 0, "heartbeat": 0, "token": "fresh"}
    path.write_text(json.dumps(fresh))
    old = time.time() - 3600
    os.utime(path, (old, old))
    real_read = FileLock.read

    def outdated(self, p=None):  # the content judged stale, read just before another taker replaced it
        return {**fresh, "token": "old"} if p is None else real_read(self, p)

    monkeypatch.setattr(FileLock, "read", outdated)
    assert not FileLock(path, stale_after=60)._break_if_stale()
    monkeypatch.undo()
    assert json.loads(path.read_text())["token"] == "fresh" and os.listdir(tmp_path) == ["s.lock"]


# ---------------------------------------------------------------------------------------------- time limit


def test_time_limit_kills_the_item_with_its_children_and_goes_on(tmp_path):
    items = _inputs(tmp_path, {"a": "slow", "b": "sleep", "c": "fail in worker", "d": "z"})
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="cannot use") as e:  # a worker's exception keeps its type
        run_job(ToyJob(out), items[2:], JobConfig(out=str(out), time_limit=30, progress=False))
    assert "in the worker process" in "".join(getattr(e.value, "__notes__", []))
    rows = run_job(ToyJob(out), items, JobConfig(out=str(out), time_limit=2, skip_errors=True, progress=False))
    assert rows["b"]["status"] == "failed" and "time limit of 2 s" in rows["b"]["error"]
    assert rows["a"]["status"] == rows["d"]["status"] == "done" and rows["c"]["status"] == "failed"
    assert (out / "a.json").exists() and (out / "d.json").exists() and not (out / "b.json").exists()
    assert not [f for f in os.listdir(out) if ".tmp" in f]  # the killed item's temp file is gone
    pid = int((out / "b.child").read_text())
    for _ in range(100):  # the item's own child process was killed with it (its process group)
        if not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"the timed-out item's child process {pid} still runs")


# -------------------------------------------------------------------------------------------------- CLI


def test_cli_arguments():
    p = argparse.ArgumentParser()
    jobs.add_job_arguments(p, item="video")
    a = p.parse_args(["--shard", "1/3", "--time-limit", "90", "--overwrite"])
    cfg = jobs.job_config_from_args(a, "o")
    assert cfg.shard == (1, 3) and cfg.time_limit == 90 and cfg.overwrite and not cfg.skip_errors
    for bad in (["--shard", "3/3"], ["--shard", "two"], ["--time-limit", "-1"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert "refuses" in p.format_help()
    with pytest.raises(ValueError, match="I/N"):
        jobs.parse_shard("1/0")
