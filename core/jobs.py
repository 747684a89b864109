"""One batch-job runner for the batch CLIs (``pathology.batch``, ``video.batch``): items, shards, locks that hold
across hosts, atomic writes, a manifest, a per-item time limit and a settings fingerprint on every output.

A job is an object with four methods (see :class:`Job`): the output files of an item (the last one is the item's
final output), the settings each output must have been made with, the settings stored in an existing output,
and ``process(item)``, which writes the outputs (atomically, with their settings) and returns manifest fields.
:func:`run_job` does the rest:

- **shards**: ``shard=(I, N)`` takes items ``I, I+N, ...`` of the list (keys must be unique over the whole list);
- **skip what is done**: an item whose final output exists with the same settings is not redone;
- **settings fingerprint**: an existing output made with other settings (or with no record of them) is never
  reused silently: by default the run refuses before any work, naming the differing settings
  (:class:`SettingsMismatch`); with ``overwrite=True`` those outputs are redone;
- **locks**: ``OUT/locks/<key>.lock``, created atomically (hard link of a complete temp file, ``O_CREAT|O_EXCL``
  where links are not supported) and holding host, pid, start time and a heartbeat refreshed by a thread while
  the item runs. A lock is stale when its process is gone (same host) or its heartbeat is older than
  ``stale_after`` seconds (any host), and is then broken by an atomic rename, so two takers cannot both win;
- **temp files**: outputs are written to ``.<name>.*.tmp*`` beside them and renamed; whoever holds an item's lock
  removes leftover temps of that item's outputs (their writer was killed, on any host);
- **time limit**: with ``time_limit`` set, items run one at a time in a worker process (start method ``spawn``,
  its own process group); an item past the limit has the whole group killed (a stuck decoder included), is
  recorded as failed, and the next item gets a fresh worker;
- **manifest**: ``OUT/manifest.csv`` (``manifest_<I>of<N>.csv`` per shard), one row per item: status (``done``,
  ``empty``, ``exists`` — found finished —, ``failed``, ``locked``), final output, settings
  fingerprint, seconds, host, error. Each write merges into the file under a short lock, so workers sharing a
  shard do not erase each other's rows. Tracebacks go to ``OUT/failures.log``;
- **failures**: a failed item (exception or time limit) is recorded; the run stops unless ``skip_errors``.
"""

from __future__ import annotations

import argparse
import csv
import glob
import hashlib
import json
import logging
import math
import multiprocessing as mp
import os
import pickle
import signal
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

logger = logging.getLogger(__name__)

__all__ = ["Item", "Job", "JobConfig", "SettingsMismatch", "ItemTimeout", "FileLock", "run_job", "canonical_settings",
           "settings_fingerprint", "settings_diff", "file_identity", "atomic_target", "atomic_write", "remove_temps",
           "parse_shard", "manifest_path", "batch_parser", "add_job_arguments", "job_config_from_args"]

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


# ------------------------------------------------------------------------------------- settings fingerprint


def canonical_settings(settings: Any) -> Any:
    """``settings`` as plain JSON values: tuples become lists, integral floats ints (``1.0`` and ``1`` agree)."""
    if isinstance(settings, dict):
        return {str(k): canonical_settings(v) for k, v in settings.items()}
    if isinstance(settings, (list, tuple)):
        return [canonical_settings(v) for v in settings]
    if isinstance(settings, bool) or settings is None or isinstance(settings, (str, int)):
        return settings
    if isinstance(settings, float):
        if not math.isfinite(settings):
            raise ValueError(f"settings hold a non-finite number ({settings}); only finite numbers are accepted")
        return int(settings) if settings.is_integer() else settings
    raise ValueError(f"settings hold a {type(settings).__name__} ({settings!r}); accepted: dict, list, tuple, str, "
                     "int, float, bool, None")


def _settings_json(settings: dict) -> str:
    return json.dumps(canonical_settings(settings), sort_keys=True, separators=(",", ":"))


def settings_fingerprint(settings: dict) -> str:
    """Stable 16-hex-digit hash of a settings dict (SHA-256 of its sorted, canonical JSON)."""
    return hashlib.sha256(_settings_json(settings).encode()).hexdigest()[:16]


def settings_diff(stored: dict | None, wanted: dict) -> list[str]:
    """Human-readable differences ``"key: stored -> wanted"`` (nested keys dotted); empty when they agree."""
    if stored is None:
        return ["no settings record (written by an older version or another tool)"]

    def flat(d: Any, prefix: str = "") -> dict[str, Any]:
        if not isinstance(d, dict):
            return {prefix: d}
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out

    a, b = flat(canonical_settings(stored)), flat(canonical_settings(wanted))
    missing = object()
    return [f"{k}: {json.dumps(a.get(k)) if k in a else '(absent)'} -> {json.dumps(b.get(k)) if k in b else '(absent)'}"
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)]


def file_identity(path: str | os.PathLike) -> dict:
    """Identity of a file's content for settings: size and SHA-256 of all its bytes (not its path or time, so a
    copied or moved file keeps it). Reads the whole file: call it once per run."""
    with open(path, "rb") as f:
        return {"size": os.fstat(f.fileno()).st_size, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}


# -------------------------------------------------------------------------------------------- atomic writes

_HOST = socket.gethostname()


def atomic_target(path: str | os.PathLike, suffix: str = "") -> str:
    """A temp path beside ``path`` (``.<name>.<host>.<pid>.<rand>.tmp<suffix>``), unique across hosts."""
    d, b = os.path.split(os.fspath(path))
    return os.path.join(d, f".{b}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{suffix}")


@contextmanager
def atomic_write(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yield a temp path to write; on success it is renamed onto ``path``, on error removed.

    ``suffix`` keeps an extension some writers need (``".png"``). The file gets mode 0644 (not mkstemp's 0600).
    """
    tmp = atomic_target(path, suffix)
    try:
        yield tmp
        os.chmod(tmp, 0o644)
        os.replace(tmp, os.fspath(path))
    finally:
        _unlink(tmp)


def remove_temps(paths: Sequence[str]) -> list[str]:
    """Remove temp files (``.<name>.*.tmp*``) of these outputs; returns what was removed.

    Call it only while holding the lock of the item the outputs belong to: then no live writer owns them.
    """
    removed = []
    for path in paths:
        d, b = os.path.split(os.fspath(path))
        for tmp in glob.glob(os.path.join(glob.escape(d), f".{glob.escape(b)}.*.tmp*")):
            if _unlink(tmp):
                removed.append(tmp)
    return removed


def _unlink(path: str) -> bool:
    try:
        os.remove(path)
        return True
    except FileNotFoundError:
        return False


# ------------------------------------------------------------------------------------------------- locks


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class FileLock:
    """An exclusive lock file that holds across hosts on a shared file system.

    The file appears whole or not at all (a complete temp file hard-linked to the lock's name, which fails if the
    name exists; ``O_CREAT|O_EXCL`` where links are unsupported) and holds ``host``, ``pid``, ``start``,
    ``heartbeat`` and a random ``token``. While held, a thread rewrites the heartbeat every ``heartbeat`` seconds.
    Stale: its process is gone (same host), or its heartbeat is older than ``stale_after`` seconds (any host;
    the margin covers clock skew between hosts), or it is unreadable and older than that.
    """

    def __init__(self, path: str | os.PathLike, *, stale_after: float = 600.0, heartbeat: float | None = 30.0):
        self.path = os.fspath(path)
        self.stale_after = stale_after
        self.heartbeat = heartbeat
        self.token = ""
        self._stop: threading.Event | None = None

    @property
    def held(self) -> bool:
        return bool(self.token)

    def _info(self, start: float) -> dict:
        return {"host": _HOST, "pid": os.getpid(), "start": start, "heartbeat": time.time(), "token": self.token}

    def _create(self, info: dict) -> bool:
        tmp = atomic_target(self.path)
        with open(tmp, "w") as f:
            json.dump(info, f)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:  # no hard links on this file system
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
            return True
        finally:
            _unlink(tmp)

    def read(self, path: str | None = None) -> dict | None:
        """The lock's content, or None if it is missing or unreadable."""
        try:
            with open(path or self.path) as f:
                info = json.load(f)
            return info if isinstance(info, dict) else None
        except (OSError, ValueError):
            return None

    def is_stale(self, info: dict | None, mtime: float) -> bool:
        now = time.time()
        if info is None:
            return now - mtime > self.stale_after
        if info.get("host") == _HOST and not _pid_alive(int(info.get("pid", -1))):
            return True
        return now - max(float(info.get("heartbeat", 0)), mtime) > self.stale_after

    def _break_if_stale(self) -> bool:
        """Remove the lock if stale; True if it is gone (removed here or by another process)."""
        try:
            mtime = os.path.getmtime(self.path)
        except FileNotFoundError:
            return True
        info = self.read()
        if not self.is_stale(info, mtime):
            return False
        # Move it aside atomically, then check that what was moved is what was judged: a lock taken meanwhile
        # by another process is put back (link fails if yet another took the name).
        grave = atomic_target(self.path, ".broken")
        try:
            os.rename(self.path, grave)
        except FileNotFoundError:
            return True
        moved = self.read(grave)
        if (moved or {}).get("token") != (info or {}).get("token"):
            try:
                os.link(grave, self.path)
            except OSError:
                pass
            _unlink(grave)
            return False
        _unlink(grave)
        logger.info("took over a stale lock %s (%s)", self.path, info)
        return True

    def _clear_dead_temps(self) -> None:
        """Remove temps of this lock (``.<name>.<host>.<pid>.<rand>.tmp[.broken]``) left by killed processes."""
        d, b = os.path.split(self.path)
        for tmp in glob.glob(os.path.join(glob.escape(d), f".{glob.escape(b)}.*.tmp*")):
            rest = os.path.basename(tmp)[len(b) + 2:].removesuffix(".broken").removesuffix(".tmp")
            host, pid, _ = (rest.rsplit(".", 2) + ["", ""])[:3] if rest.count(".") >= 2 else ("", "", "")
            try:
                old = time.time() - os.path.getmtime(tmp) > self.stale_after
            except FileNotFoundError:
                continue
            if old or (host == _HOST and pid.isdigit() and not _pid_alive(int(pid))):
                _unlink(tmp)

    def acquire(self) -> bool:
        """Take the lock (breaking a stale one); False if another live process holds it."""
        if self.held:
            return True
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._clear_dead_temps()
        self.token = uuid.uuid4().hex
        info = self._info(time.time())
        for _ in range(3):
            if self._create(info):
                self._start_heartbeat(info["start"])
                return True
            if not self._break_if_stale():
                break
        self.token = ""
        return False

    def clear_if_stale(self) -> None:
        """Remove the lock if stale (e.g. its process was killed after writing the output, before unlocking)."""
        self._break_if_stale()

    def _start_heartbeat(self, start: float) -> None:
        if not self.heartbeat:
            return
        self._stop = threading.Event()
        threading.Thread(target=self._beat, args=(self._stop, self.token, start), daemon=True,
                         name=f"heartbeat:{os.path.basename(self.path)}").start()

    def _beat(self, stop: threading.Event, token: str, start: float) -> None:
        while not stop.wait(self.heartbeat):
            if (self.read() or {}).get("token") != token:
                logger.warning("lock %s was taken over by another process (this one looked stale)", self.path)
                return
            with atomic_write(self.path) as tmp:
                with open(tmp, "w") as f:
                    json.dump({**self._info(start), "token": token}, f)

    def release(self) -> None:
        if self._stop is not None:
            self._stop.set()
            self._stop = None
        if self.held:
            if (self.read() or {}).get("token") == self.token:
                _unlink(self.path)
            self.token = ""

    def __enter__(self) -> FileLock:
        deadline = time.monotonic() + self.stale_after + 5
        while not self.acquire():  # a short-held lock (the manifest's): wait for it
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not take the lock {self.path!r} within {self.stale_after + 5:g} s")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.release()


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
    if cfg.progress:
        from tqdm import tqdm

        it_iter = tqdm(mine, desc=cfg.desc, unit="item")
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
        if worker is not None:
            worker.close()
    return manifest.update(pending)


# ------------------------------------------------------------------------------------------------- CLI


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N`` (for ``--shard``)."""
    try:
        i, n = (int(v) for v in str(text).strip().split("/"))
    except ValueError:
        raise ValueError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return i, n


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        return parse_shard(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds_arg(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not v > 0 or not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return v


def batch_parser(prog: str, doc: str) -> argparse.ArgumentParser:
    """The parser of a batch CLI: the first paragraph of its module docstring as description, the rest as epilog."""
    head, _, rest = doc.strip().partition("\n\n")
    return argparse.ArgumentParser(prog=prog, description=head, epilog=rest,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def add_job_arguments(p: argparse.ArgumentParser, *, item: str = "item") -> None:
    """The batch-job options every batch CLI shares: ``--shard``, ``--skip-errors``, ``--overwrite``,
    ``--time-limit``, ``--stale-after``."""
    g = p.add_argument_group("batch job")
    g.add_argument("--shard", type=_shard_arg, default=(0, 1), metavar="I/N",
                   help=f"process {item}s I, I+N, I+2N, ... of the sorted list (0-based; for job arrays)")
    g.add_argument("--skip-errors", action="store_true",
                   help=f"record a failed {item} (error or time limit) in the manifest and go on")
    g.add_argument("--overwrite", action="store_true",
                   help="redo outputs made with other settings. Without it a rerun whose settings differ from those "
                        "stored in the existing outputs refuses before any work and names the differences "
                        "(finished outputs with the same settings are always kept)")
    g.add_argument("--time-limit", type=_seconds_arg, default=None, metavar="SECONDS",
                   help=f"per-{item} time limit: each {item} runs in a worker process that is killed past it and the "
                        f"{item} is recorded as failed (default: no limit, {item}s run in this process)")
    g.add_argument("--stale-after", type=_seconds_arg, default=600.0, metavar="SECONDS",
                   help="a lock (OUT/locks/) whose heartbeat is older than this is taken over, on any host; a lock "
                        "of this host whose process is gone is taken over at once (default 600)")


def job_config_from_args(args: argparse.Namespace, out: str, *, progress: bool = True,
                         desc: str = "items") -> JobConfig:
    """A :class:`JobConfig` from the options of :func:`add_job_arguments`."""
    return JobConfig(out=out, shard=args.shard, skip_errors=args.skip_errors, overwrite=args.overwrite,
                     time_limit=args.time_limit, stale_after=args.stale_after,
                     heartbeat=min(30.0, args.stale_after / 4), progress=progress, desc=desc)
