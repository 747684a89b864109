"""Helpers shared by the benchmark scripts: timing, peak-memory measurement, isolated runs, JSON, tables.

Peak memory method (``PeakRSS``): on Linux the kernel keeps a per-process high-water mark of the resident
set (``VmHWM`` in ``/proc/self/status``); writing ``5`` to ``/proc/self/clear_refs`` resets it to the current
RSS. A case resets the mark after its inputs exist, runs, and reports ``VmHWM - VmRSS(before)``: the extra
memory the case itself took from the OS at its peak (tensors, allocator caches, workspace). Each case runs
in a fresh subprocess (:func:`run_isolated`) so no earlier case's caches hide or inflate its peak. Where
``clear_refs`` is not writable the mark falls back to ``ru_maxrss`` (peak since process start), which
over-states small cases; the JSON records which method was used.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from core.infra.fileio import write_json_atomic  # moved down to core: rl and the benchmarks both use it

__all__ = [
    "PeakRSS",
    "time_call",
    "run_isolated",
    "write_json_atomic",
    "read_json",
    "format_table",
    "env_info",
    "parse_size",
    "portable_args",
]


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class PeakRSS:
    """Peak resident-set growth of this process between ``start()`` and ``peak_mb()`` (see module docs)."""

    def __init__(self) -> None:
        self.method = "VmHWM after clear_refs"
        self.base_kb = 0

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.method = "ru_maxrss (peak since process start)"
        self.base_kb = _status_kb("VmRSS") or 0

    def peak_mb(self) -> float:
        if self.method.startswith("VmHWM"):
            hwm = _status_kb("VmHWM")
            if hwm is not None:
                return max(0.0, (hwm - self.base_kb) / 1024)
        maxrss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return max(0.0, (maxrss_kb - self.base_kb) / 1024)


def time_call(
    fn: Callable[[], Any], *, reps: int, warmup: int = 1, slow_s: float = 5.0, clock: str = "wall"
) -> dict[str, Any]:
    """Median time of ``fn()`` on ``clock``: ``"wall"`` (``perf_counter``) or ``"cpu"`` (``process_time``:
    CPU seconds of this process, all threads — with one thread, the wall time it would take on an idle core,
    robust to other processes sharing the machine). Both clocks are recorded; ``median_s`` uses ``clock``.

    The first call is always timed. When it takes longer than ``slow_s`` (on ``clock``) it is the only
    measurement (large sizes); otherwise ``warmup`` untimed calls (the first call counts as one) are
    followed by ``reps`` timed calls.
    """
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")

    def once() -> tuple[float, float]:
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - w0, time.process_time() - c0

    pick = 0 if clock == "wall" else 1
    first = once()
    if first[pick] > slow_s or reps <= 0:
        runs = [first]
    else:
        for _ in range(max(0, warmup - 1)):
            fn()
        runs = [once() for _ in range(reps)]
    return {
        "median_s": statistics.median(r[pick] for r in runs),
        "wall_s": statistics.median(r[0] for r in runs),
        "cpu_s": statistics.median(r[1] for r in runs),
        "clock": clock,
        "times_s": [r[pick] for r in runs],
        "first_call_s": first[pick],
        "reps": len(runs),
    }


def run_isolated(argv: Sequence[str], *, timeout_s: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv`` in a fresh process; its last stdout line must be a JSON object, which is returned.

    A timeout, a crash or unparsable output comes back as ``{"status": "error", "reason": ...}``.
    """
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, env={**os.environ, **(env or {})}
        )
    except subprocess.TimeoutExpired:
        return {"status": "error", "reason": f"timed out after {timeout_s:.0f} s"}
    wall = time.perf_counter() - t0
    lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        kind = "killed (likely out of memory)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
        return {"status": "error", "reason": f"{kind}: {' | '.join(tail)[-400:]}"}
    try:
        out = json.loads(lines[-1])
    except json.JSONDecodeError:
        return {"status": "error", "reason": f"unparsable output: {lines[-1][:200]}"}
    out.setdefault("process_wall_s", wall)
    return out


def read_json(path: str | os.PathLike) -> Any | None:
    """The JSON at ``path``, or ``None`` when the file does not exist."""
    path = Path(path)
    if not path.exists():
        return None
    with open(path) as f:
        return json.load(f)


def read_parts(paths: Sequence[str | os.PathLike]) -> list[Any]:
    """The result files a ``--merge`` joins, in order; stops with the list of the missing ones."""
    parts = [read_json(p) for p in paths]
    missing = [str(p) for p, d in zip(paths, parts) if d is None]
    if missing:
        raise SystemExit(f"result files not found: {missing}")
    return parts


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A Markdown table of ``rows`` restricted to ``columns`` (floats shown with 3 significant digits)."""

    def cell(x: Any) -> str:
        if x is None:
            return "–"
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"
        return str(x)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


_REPO = Path(__file__).resolve().parents[1]


def _portable_path(text: str) -> str:
    """An absolute path as recorded in a result: relative to the repository, else only its file name."""
    p = Path(text)
    if not p.is_absolute():
        return text
    try:
        return str(p.resolve().relative_to(_REPO))
    except ValueError:
        return p.name


def portable_args(args: Any) -> dict[str, Any]:
    """``vars(args)`` for a results file: paths (also lists and comma-separated lists of them) without this machine's
    directories, so that a committed result does not name where it was run."""
    out = {}
    for k, v in vars(args).items():
        if isinstance(v, (list, tuple)) and all(isinstance(x, (str, Path)) for x in v):
            v = [_portable_path(str(x)) if isinstance(x, Path) or os.sep in x else x for x in v]
        elif isinstance(v, Path):
            v = _portable_path(str(v))
        elif isinstance(v, str) and os.sep in v:
            v = ",".join(_portable_path(part) for part in v.split(","))
        out[k] = v
    return out


def env_info() -> dict[str, Any]:
    """Machine and library facts recorded beside every result."""
    import torch

    try:
        load = os.getloadavg()
    except OSError:
        load = None
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_at_start": load,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def parse_size(text: str) -> int:
    """``"4K"`` -> 4096, ``"1024"`` -> 1024; ``ValueError`` names the bad value."""
    t = text.strip().upper()
    try:
        if t.endswith("K"):
            return int(float(t[:-1]) * 1024)
        if t.endswith("M"):
            return int(float(t[:-1]) * 1024 * 1024)
        return int(t)
    except ValueError:
        raise ValueError(f"bad size {text!r}: use an integer or a K/M suffix like 4K") from None
