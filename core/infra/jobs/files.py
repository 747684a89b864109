"""Atomic writes (a temp file beside the target, then rename) and the cross-host file lock of the batch-job
runner."""

from __future__ import annotations

import glob
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from core.infra.fileio import set_file_mode

logger = logging.getLogger(__name__)


# -------------------------------------------------------------------------------------------- atomic writes

_HOST = socket.gethostname()


def atomic_target(path: str | os.PathLike, suffix: str = "") -> str:
    """A temp path beside ``path`` (``.<name>.<host>.<pid>.<rand>.tmp<suffix>``), unique across hosts."""
    d, b = os.path.split(os.fspath(path))
    return os.path.join(d, f".{b}.{_HOST}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp{suffix}")


@contextmanager
def atomic_write(path: str | os.PathLike, suffix: str = "") -> Iterator[str]:
    """Yield a temp path to write; on success it is renamed onto ``path``, on error removed.

    ``suffix`` keeps an extension some writers need (``".png"``). The file gets the mode the user's umask gives new files (not 0600).
    """
    tmp = atomic_target(path, suffix)
    try:
        yield tmp
        set_file_mode(tmp)  # the user's umask (mkstemp and safetensors make 0600)
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


