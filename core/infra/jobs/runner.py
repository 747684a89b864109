"""The batch-job runner: items, the job protocol, its configuration, the manifest, worker processes and
:func:`run_job`."""

from __future__ import annotations

import contextlib
import csv
import logging
import multiprocessing as mp
import os
import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from core.infra.jobs.files import _HOST, FileLock, _unlink, atomic_write, remove_temps
from core.infra.jobs.settings import settings_diff, settings_fingerprint

logger = logging.getLogger(__name__)


BASE_FIELDS = ("path", "status", "output", "settings", "seconds", "host", "error")
FINISHED = ("done", "empty", "exists")


@dataclass(frozen=True)
class Item:
    """One unit of work: a unique ``key`` (names its lock and manifest row; usually its outputs) and its input."""

    key: str
    path: str


class Job(Protocol):
    """What :func:`run_job` needs from a batch job. ``process`` may run in a worker process: keep the job picklable."""

    key_field: str  # manifest column holding the item key ("slide_id", "video")
    extra_fields: tuple[str, ...]  # further manifest columns that ``process`` fills

    def outputs(self, item: Item) -> list[str]:
        """Output files of ``item``, final output last (the item is done when it exists with matching settings)."""

    def settings(self, item: Item) -> dict[str, dict]:
        """Settings each output (by path) must have been made with; JSON-serialisable. Called only when needed."""

    def stored_settings(self, path: str) -> dict | None:
        """Settings stored in an existing output, or None when it holds no record."""

    def process(self, item: Item) -> dict:
        """Write the missing outputs of ``item``; return manifest fields (``status`` defaults to ``done``).

        A job may also define ``setup()``: a worker process calls it once before its first item (e.g. to build a
        model), outside the per-item time limit.
        """


@dataclass(kw_only=True)
class JobConfig:
    """How a job runs."""

    out: str  # folder of the manifest, failures.log and locks/
    shard: tuple[int, int] = (0, 1)  # (I, N): this process takes items I, I+N, ... (job arrays)
    skip_errors: bool = False  # record a failed item and go on (otherwise stop at the first failure)
    overwrite: bool = False  # redo outputs made with other settings (otherwise refuse before any work)
    time_limit: float | None = None  # seconds per item; set = items run in a worker process that is killed past it
    stale_after: float = 600.0  # a lock whose heartbeat is this old is stale, whatever its host (clock skew margin)
    heartbeat: float = 30.0  # seconds between heartbeat refreshes of a held lock
    progress: bool = True  # tqdm bar over the items
    desc: str = "items"  # progress bar label

    def __post_init__(self) -> None:
        i, n = self.shard
        if not (n >= 1 and 0 <= i < n):
            raise ValueError(f"shard ({i}/{n}) must satisfy 0 <= I < N")
        if self.time_limit is not None and not self.time_limit > 0:
            raise ValueError(f"time_limit ({self.time_limit}) must be > 0 seconds, or None for no limit")
        if not self.heartbeat > 0 or not self.stale_after > self.heartbeat:
            raise ValueError(f"heartbeat ({self.heartbeat}) must be > 0 and below stale_after ({self.stale_after})")


class SettingsMismatch(ValueError):
    """Existing outputs were made with other settings than this run's."""


class ItemTimeout(TimeoutError):
    """An item ran past the time limit; its worker process was killed."""


# ---------------------------------------------------------------------------------------------- manifest


def manifest_path(out: str | os.PathLike, shard: tuple[int, int]) -> str:
    """``OUT/manifest.csv``, or ``OUT/manifest_<I>of<N>.csv`` for a shard of a job array."""
    i, n = shard
    return os.path.join(os.fspath(out), "manifest.csv" if n == 1 else f"manifest_{i}of{n}.csv")


class _Manifest:
    def __init__(self, path: str, key_field: str, fields: Sequence[str]):
        self.path, self.key_field, self.fields = path, key_field, list(fields)
        # beside the manifest, not in locks/: no item key (a file name) can name the same lock
        self._lock = FileLock(path + ".lock", stale_after=30.0, heartbeat=None)

    def read(self) -> dict[str, dict]:
        if not os.path.exists(self.path):
            return {}
        with open(self.path, newline="") as f:
            return {r[self.key_field]: r for r in csv.DictReader(f) if self.key_field in r}

    def update(self, rows: dict[str, dict]) -> dict[str, dict]:
        """Merge ``rows`` into the file (under its lock) and return all rows."""
        with self._lock:
            remove_temps([self.path])  # a writer killed mid-write; writers hold this lock
            merged = self.read()
            for key, r in rows.items():  # "locked" is news only until the holder records its result
                if not (r.get("status") == "locked" and merged.get(key, {}).get("status") in FINISHED):
                    merged[key] = r
            with atomic_write(self.path) as tmp:
                with open(tmp, "w", newline="") as f:
                    w = csv.DictWriter(f, fieldnames=self.fields, extrasaction="ignore")
                    w.writeheader()
                    for key in sorted(merged):
                        w.writerow({k: merged[key].get(k, "") for k in self.fields})
        return merged


# --------------------------------------------------------------------------------------- worker process


def _worker_main(conn, job_bytes: bytes) -> None:  # runs in the worker process
    if hasattr(os, "setsid"):
        os.setsid()  # own process group: a kill takes its children (decoder threads, DataLoader workers) too
    try:
        job = pickle.loads(job_bytes)
        if callable(getattr(job, "setup", None)):
            job.setup()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which stops the run
        conn.send(("error", pickle.dumps(RuntimeError(f"worker setup failed: {type(e).__name__}: {e}")),
                   traceback.format_exc()))
        return
    conn.send(("ready", None, ""))
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        try:
            conn.send(("ok", job.process(item), ""))
        except BaseException as e:  # noqa: BLE001 - sent back to the parent, which records it
            tb = traceback.format_exc()
            try:
                payload = pickle.dumps(e)
            except Exception:  # noqa: BLE001 - an exception that does not pickle is sent as text
                payload = pickle.dumps(RuntimeError(f"{type(e).__name__}: {e}"))
            conn.send(("error", payload, tb))


class _Worker:
    """A worker process running one item at a time; killed (with its process group) past the time limit."""

    def __init__(self, job: Job, time_limit: float, start_limit: float = 900.0):
        self.job_bytes = pickle.dumps(job)
        self.time_limit = time_limit
        self.start_limit = start_limit  # seconds a worker may take to start (imports, setup): not the item's time
        self.proc = self.conn = None

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, self.job_bytes), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(self.start_limit):
            self.close()
            raise RuntimeError(f"the worker process did not start within {self.start_limit:g} s")
        self._receive("starting the worker")

    def _receive(self, what: str):
        try:
            kind, payload, tb = self.conn.recv()
        except (EOFError, OSError):
            self.proc.join(5)
            code = self.proc.exitcode
            self.close()
            raise RuntimeError(f"the worker process died while {what} (exit code {code})") from None
        if kind == "error":
            exc = pickle.loads(payload)
            if hasattr(exc, "add_note"):
                exc.add_note(f"in the worker process:\n{tb}")
            raise exc
        return payload

    def ensure_started(self) -> None:
        if self.proc is None or not self.proc.is_alive():
            self.close()
            self._start()

    def run(self, item: Item) -> dict:
        self.ensure_started()
        self.conn.send(item)
        if not self.conn.poll(self.time_limit):
            self.close()
            raise ItemTimeout(f"{item.key} ran past the time limit of {self.time_limit:g} s; its process was killed")
        return self._receive(f"processing {item.key}")

    def close(self) -> None:
        if self.proc is not None:
            if self.proc.is_alive():
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (OSError, AttributeError):
                    self.proc.kill()
            self.proc.join(10)
            self.conn.close()
        self.proc = self.conn = None


# -------------------------------------------------------------------------------------------- the runner


def _mismatches(job: Job, item: Item, wanted: dict[str, dict] | None) -> tuple[dict[str, dict], dict[str, list[str]]]:
    """(the wanted settings, {existing output: its differences}) for one item."""
    existing = [p for p in job.outputs(item) if os.path.exists(p)]
    if not existing:
        return wanted or {}, {}
    wanted = wanted if wanted is not None else job.settings(item)
    bad = {}
    for p in existing:
        stored = job.stored_settings(p)
        if stored is None or settings_fingerprint(stored) != settings_fingerprint(wanted[p]):
            bad[p] = settings_diff(stored, wanted[p])
    return wanted, bad


def _refusal(bad: dict[str, list[str]], total: int) -> SettingsMismatch:
    first, diffs = next(iter(bad.items()))
    return SettingsMismatch(
        f"{len(bad)} existing output(s) of {total} item(s) were made with other settings, e.g. {first}: "
        f"{'; '.join(diffs[:6])}. Nothing is reused silently: rerun with --overwrite to redo them, or choose a "
        "new output folder")


def run_job(job: Job, items: Sequence[Item], cfg: JobConfig) -> dict[str, dict]:
    """Run ``job`` over this shard's share of ``items``; returns the manifest rows by key (all shards' rows in
    this manifest). Raises :class:`SettingsMismatch` before any work when finished outputs were made with other
    settings (unless ``cfg.overwrite``), and the first failure unless ``cfg.skip_errors``."""
    seen: dict[str, str] = {}
    for it in items:
        if it.key in seen:
            raise ValueError(f"two inputs share the key {it.key!r} ({seen[it.key]!r} and {it.path!r}); their outputs "
                             "would collide: rename one or move it to another folder")
        seen[it.key] = it.path
    i, n = cfg.shard
    mine = list(items)[i::n]
    os.makedirs(os.path.join(cfg.out, "locks"), exist_ok=True)
    manifest = _Manifest(manifest_path(cfg.out, cfg.shard), job.key_field,
                         [job.key_field, *BASE_FIELDS, *job.extra_fields])
    prev = manifest.read()

    def row(it: Item, status: str, **fields) -> dict:
        out = job.outputs(it)[-1]
        return {job.key_field: it.key, "path": it.path, "status": status, "output": os.path.relpath(out, cfg.out),
                "host": _HOST, **fields}

    # Refuse before any work: finished outputs made with other settings are never reused silently. The manifest
    # is left as it is: it describes the outputs, which still hold what their settings say.
    wanted_by_key: dict[str, dict] = {}
    bad_all: dict[str, list[str]] = {}
    for it in mine:
        wanted, bad = _mismatches(job, it, None)
        if wanted:
            wanted_by_key[it.key] = wanted
        bad_all.update(bad)
    if bad_all and not cfg.overwrite:
        raise _refusal(bad_all, len(mine))

    worker = _Worker(job, cfg.time_limit) if cfg.time_limit else None
    it_iter: Any = mine
    bar = contextlib.ExitStack()
    if cfg.progress:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        it_iter = bar.enter_context(tqdm(mine, desc=cfg.desc, unit="item"))  # closed however the loop ends
        bar.enter_context(logging_redirect_tqdm())  # log lines (a failed item) between the bar's redraws, not onto it
    first_error: BaseException | None = None
    pending: dict[str, dict] = {}  # rows of items found finished, written with the next manifest update
    try:
        for it in it_iter:
            outs = job.outputs(it)
            final = outs[-1]
            lock = FileLock(os.path.join(cfg.out, "locks", f"{it.key}.lock"), stale_after=cfg.stale_after,
                            heartbeat=cfg.heartbeat)
            # Existence first: another worker may write the output between the two checks, and the settings of an
            # output seen to exist are then always looked up (checked the other way round, ``wanted`` could lack it).
            exists = os.path.exists(final)
            wanted, bad = _mismatches(job, it, wanted_by_key.get(it.key))
            if exists and final not in bad:
                lock.clear_if_stale()
                fp = settings_fingerprint(wanted[final])
                old = prev.get(it.key, {})
                if not (old.get("status") in FINISHED and old.get("settings") == fp):
                    pending[it.key] = row(it, "exists", settings=fp)  # written with the next change
                continue
            if not lock.acquire():
                logger.info("%s is locked by another process; skipping", it.key)
                manifest.update({**pending, it.key: row(it, "locked")})
                pending.clear()
                continue
            try:
                exists = os.path.exists(final)  # another worker may have written it before we took the lock
                wanted, bad = _mismatches(job, it, wanted_by_key.get(it.key))
                if exists and final not in bad:
                    pending[it.key] = row(it, "exists", settings=settings_fingerprint(wanted[final]))
                    continue
                if bad and not cfg.overwrite:
                    raise _refusal(bad, 1)
                for p, diffs in bad.items():
                    logger.warning("redoing %s (settings differ: %s)", p, "; ".join(diffs[:6]))
                    _unlink(p)
                remove_temps(outs)
                if worker is not None:
                    worker.ensure_started()  # its start (imports, setup) counts neither as the item's time nor limit
                t0 = time.perf_counter()
                fields = dict((worker.run(it) if worker is not None else job.process(it)) or {})
                seconds = round(time.perf_counter() - t0, 3)
                status = fields.pop("status", "done")
                fp = settings_fingerprint(job.settings(it)[final])
                new = row(it, status, settings=fp, seconds=seconds, error="", **fields)
            except SettingsMismatch:
                raise
            except Exception as e:  # noqa: BLE001 - every failure is recorded; re-raised unless skip_errors
                remove_temps(outs)
                msg = f"{type(e).__name__}: {e}"
                logger.error("failed on %s: %s", it.path, msg)
                with open(os.path.join(cfg.out, "failures.log"), "a") as f:
                    f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} {_HOST} {it.path}\n"
                            f"{''.join(traceback.format_exception(e))}\n")
                new = row(it, "failed", error=msg[:500])
                if not cfg.skip_errors:
                    first_error = e
            finally:
                lock.release()
            manifest.update({**pending, it.key: new})
            pending.clear()
            if first_error is not None:
                raise first_error
    finally:
        bar.close()
        if worker is not None:
            worker.close()
    return manifest.update(pending)


