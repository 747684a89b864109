"""One way for every command to fail: a bad input is one line on stderr and exit code 2, never a traceback.

Every CLI module ends in ``raise SystemExit(run_cli(main))``. :func:`run_cli` calls ``main(argv)`` and maps what
comes out of it:

- a returned int: the exit code (``None``, or a result object a ``main`` returns to Python callers: 0);
- the project's input errors — ``ValueError`` (with :class:`UsageError`), ``FileNotFoundError``,
  ``NotADirectoryError``, ``IsADirectoryError``, ``FileExistsError``, ``PermissionError`` — and a ``SystemExit``
  whose code is a message: ``error: <message>`` on stderr, exit code **2** (bad usage or input);
- :class:`PartialFailure` (a run that did part of its work, e.g. some inputs of a batch failed): its message,
  exit code **1**;
- ``KeyboardInterrupt``: ``interrupted``, exit code 130;
- anything else is a bug and keeps its traceback (exit code 1).

``--debug`` anywhere in the arguments (removed before ``main`` sees them), or ``LONGCTX_DEBUG=1`` in the
environment, re-raises instead, with the full traceback. argparse's own usage errors already exit 2 with one line.

A command that takes several inputs (images, slides, rows) keeps what succeeded: :class:`InputTally` prints one
line per bad input and the command goes on with the others; ``main`` then returns :meth:`InputTally.finish`: 0
(all answered), 1 (some answered, the others reported) or 2 (none could be used).

Options are checked when they are parsed, before any work: the argparse types below (:func:`positive_int`,
:func:`nonnegative_int`, :func:`finite_float`, :func:`positive_float`, :func:`nonnegative_float`, :func:`fraction`,
:func:`open_fraction`, :func:`port`, :func:`nonempty_path`, :func:`nonempty_path_obj`) raise
``argparse.ArgumentTypeError``, so a value out of range is argparse's usage error (exit 2), e.g.
``argument --batch: must be >= 1, got 0``.

Every count has an upper bound, checked when parsed: :func:`positive_int` and :func:`nonnegative_int` refuse more
than :data:`MAX_COUNT` (10^9: no option of the project means that many steps, rows, files or patches, and a typo
such as ``--steps 100000000000000`` would otherwise run for days or end in ``MemoryError``). Options whose value
sizes memory or output have their own, tighter caps: :func:`capped_int` (a documented cap, e.g. an episode's
length), :func:`memory_capped_int` (the largest value whose estimated memory fits in half of this machine's RAM) and
:func:`worker_count` (at most 4 processes per CPU core). A run that still exhausts memory is one line, exit 2
(``error: out of memory ...``), not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["UsageError", "PartialFailure", "InputTally", "print_error", "run_cli", "add_run_options", "configure_run",
           "LOG_LEVELS", "DEBUG_ENV", "INPUT_ERRORS", "MAX_COUNT", "MAX_WORKERS_PER_CORE",
           "positive_int", "nonnegative_int", "capped_int", "memory_capped_int", "worker_count", "thread_count",
           "check_memory", "seed_int",
           "total_memory_bytes", "finite_float", "positive_float", "nonnegative_float", "fraction",
           "open_fraction", "port", "nonempty_path", "nonempty_path_obj"]

#: Environment variable that shows tracebacks (``LONGCTX_DEBUG=1``).
DEBUG_ENV = "LONGCTX_DEBUG"


class UsageError(ValueError):
    """A bad option, value or input file, found by the command itself (exit code 2)."""


class PartialFailure(RuntimeError):
    """The command did part of its work: some inputs failed and were reported, the others were answered (exit 1)."""


#: Errors that mean "the input was wrong", not "the program is wrong".
INPUT_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError, FileExistsError, PermissionError)


def _one_line(message: object) -> str:
    text = " ".join(str(message).split())
    return text if text.startswith("error:") else f"error: {text}"


def run_cli(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run ``main(argv)`` (``argv`` defaults to ``sys.argv[1:]``) and return its exit code (see module docs)."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "") not in ("", "0") or "--debug" in args
    args = [a for a in args if a != "--debug"]
    try:
        code = main(args)
    except SystemExit as exit_:
        if debug or exit_.code is None or isinstance(exit_.code, int):
            raise
        _error_line(_one_line(exit_.code))
        return 2
    except PartialFailure as err:
        if debug:
            raise
        _error_line(_one_line(err))
        return 1
    except INPUT_ERRORS as err:
        if debug:
            raise
        where = f"{err.filename}: " if getattr(err, "filename", None) and str(err.filename) not in str(err) else ""
        _error_line(_one_line(f"{where}{err}"))
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        _error_line("interrupted")
        return 130
    except (MemoryError, RuntimeError) as err:
        if debug or not _out_of_memory(err):
            raise
        _error_line(_one_line(f"out of memory ({type(err).__name__}: {str(err)[:200]}): the options ask for more memory "
                              "than this machine has; lower the sizes (batch, image, context, model) and retry"))
        return 2
    # an int is the exit code; any other return value (a result some mains also return to Python callers) means 0
    return code if isinstance(code, int) and not isinstance(code, bool) else 0


class InputTally:
    """The inputs of a multi-input command: :meth:`ok` for each one answered, :meth:`fail` for each one that could
    not be (one line on stderr naming it and why), :meth:`finish` for the exit code ``main`` returns.

    Args:
        noun: what one input is called in the summary line (``"image"``, ``"slide"``, ``"row"``).
    """

    def __init__(self, noun: str) -> None:
        self.noun = noun
        self.done = 0
        self.failed: list[str] = []

    def ok(self, n: int = 1) -> None:
        self.done += n

    def fail(self, name: object, err: BaseException | str, *, accepted: str | None = None) -> None:
        """Report ``name`` on stderr as ``error: <name>: <why> (accepted: ...)``; an error that is not one of
        :data:`INPUT_ERRORS` also shows its type, and its traceback is logged at DEBUG level."""
        why = str(err) or type(err).__name__
        if isinstance(err, BaseException) and not isinstance(err, INPUT_ERRORS):
            logger.debug("%s failed", name, exc_info=err)
            why = f"{type(err).__name__}: {why}"
        line = why if str(name) in why else f"{name}: {why}"
        if accepted:
            line += f" (accepted: {accepted})"
        print_error(line)
        self.failed.append(str(name))

    def finish(self, *, all_or_nothing: bool = False) -> int:
        """The exit code: 0 when every input was answered; 1 when some failed and the others were answered; 2
        when none was answered (or, with ``all_or_nothing``, when any failed: inputs that only make sense together,
        such as the images of one prompt). A non-zero code comes with a summary line on stderr."""
        n = self.done + len(self.failed)
        if not self.failed and self.done:
            return 0
        if not n:
            print_error(f"no {self.noun} to process")
            return 2
        if all_or_nothing or not self.done:
            print_error(f"{len(self.failed)} of {n} {self.noun}s could not be used (see above); nothing was answered")
            return 2
        print_error(f"{len(self.failed)} of {n} {self.noun}s failed (see above), {self.done} answered")
        return 1


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_run_options(p: argparse.ArgumentParser, *, threads: bool = True, log_level: str = "INFO") -> None:
    """``--threads`` (torch CPU threads, a positive int) and ``--log-level``, which :func:`configure_run` applies."""
    if threads:
        p.add_argument("--threads", type=thread_count, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default=log_level,
                   help=f"logging level (default {log_level})")


def configure_run(args: argparse.Namespace) -> None:
    """The usual start of a CLI run: logging at ``args.log_level`` (with times and logger names) and, when
    ``args.threads`` is given, ``torch.set_num_threads``."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if getattr(args, "threads", None):
        import torch

        torch.set_num_threads(args.threads)


def _error_line(text: str) -> None:
    """The final line of a failed command, on stderr and on a line of its own: progress bars the command left open
    (it stopped inside their loop) are closed first, so the line is not drawn onto a bar's."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ()) or ()):
        try:
            bar.close()
        except Exception:  # noqa: BLE001 - a bar that cannot close must not hide the error
            pass
    sys.stderr.flush()
    print(text, file=sys.stderr)


def print_error(line: str) -> None:
    """``error: <line>`` on stderr, on one line (between a progress bar's redraws when one is running)."""
    tqdm = sys.modules.get("tqdm")  # a progress bar on stderr: print between its redraws, not into it
    if tqdm is not None:
        tqdm.tqdm.write(_one_line(line), file=sys.stderr)
    else:
        print(_one_line(line), file=sys.stderr)


# argparse types: each takes the option's text and returns its value, or raises ``argparse.ArgumentTypeError``
# (argparse then prints ``argument --NAME: <message>`` after the usage and exits 2).


def _parse(text: str, kind: type) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


#: The largest value any count option accepts (see the module docs).
MAX_COUNT = 10**9


def _check_max(value: int, cap: int, why: str) -> int:
    if value > cap:
        raise argparse.ArgumentTypeError(f"must be <= {cap} ({why}), got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer in 1..:data:`MAX_COUNT` (batch sizes, steps, epochs, counts)."""
    value = _parse(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return _check_max(value, MAX_COUNT, "the cap on any count")


def nonnegative_int(text: str) -> int:
    """An integer in 0..:data:`MAX_COUNT` (where 0 means something: no warm-up, no evaluation, the default)."""
    value = _parse(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return _check_max(value, MAX_COUNT, "the cap on any count")


def finite_float(text: str) -> float:
    """Any finite number, of either sign (target returns, offsets): ``nan`` and ``inf`` are refused."""
    return _parse(text, float)


def positive_float(text: str) -> float:
    """A finite number > 0 (learning rates, frame rates, minutes)."""
    value = _parse(text, float)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value:g}")
    return value


def nonnegative_float(text: str) -> float:
    """A finite number >= 0 (weight decay, loss weights)."""
    value = _parse(text, float)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value:g}")
    return value


def fraction(text: str) -> float:
    """A number in [0, 1]."""
    value = _parse(text, float)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value:g}")
    return value


def open_fraction(text: str) -> float:
    """A number strictly between 0 and 1 (a held-out share that must leave something on both sides)."""
    value = _parse(text, float)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1), got {value:g}")
    return value


def port(text: str) -> int:
    """A TCP port, 1..65535."""
    value = _parse(text, int)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 1..65535, got {value}")
    return value


def nonempty_path(text: str) -> str:
    """A path that is not empty or blank (an empty ``--out`` would mean the current folder); returned as given."""
    if not str(text).strip():  # str(): a caller's argv may hold a Path
        raise argparse.ArgumentTypeError(f"must be a path, got {str(text)!r}")
    return text


def nonempty_path_obj(text: str) -> Path:
    """:func:`nonempty_path` as a :class:`~pathlib.Path` (``Path("")`` would silently be the current folder)."""
    return Path(nonempty_path(text))


# -- upper bounds: counts, memory-sized values and worker processes (see the module docs) -------------------------

#: :func:`worker_count` accepts at most this many worker processes per CPU core.
MAX_WORKERS_PER_CORE = 4


def _bounded(minimum: int, cap: int, why: str, name: str) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = _parse(text, int)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return _check_max(value, cap, why)

    parse.__name__ = name
    parse.kind = "positive_int" if minimum >= 1 else "nonnegative_int"  # type: ignore[attr-defined]
    parse.cap = cap  # type: ignore[attr-defined]
    return parse


def capped_int(cap: int, *, why: str, minimum: int = 1) -> Callable[[str], int]:
    """An argparse type: an integer in ``minimum..cap``; ``why`` (the cap's reason) is shown in the refusal, e.g.
    ``capped_int(1000, why="the longest episode of the supported environments")``. The returned function carries
    ``.cap`` and ``.kind`` (``positive_int`` / ``nonnegative_int``) for the tests that probe every option."""
    if cap < minimum:
        raise ValueError(f"cap ({cap}) must be >= minimum ({minimum})")
    return _bounded(minimum, cap, why, f"int_upto_{cap}")


def total_memory_bytes() -> int:
    """This machine's physical memory in bytes (16 GiB where the system does not tell)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 16 * 2**30


def memory_capped_int(bytes_per_unit: float, *, what: str, power: int = 1, minimum: int = 1, share: float = 0.5,
                      limit: int | None = None, limit_why: str = "") -> Callable[[str], int]:
    """An argparse type for a value whose memory grows as ``bytes_per_unit * value**power`` (an image side:
    ``power=2``): refused above the largest value whose estimate fits in ``share`` of :func:`total_memory_bytes`
    (and above :data:`MAX_COUNT`). ``what`` names the estimate in the refusal (``"an RGB slide at level 0"``).
    ``limit`` is a documented cap that applies as well (``limit_why`` says why), whichever is lower."""
    budget = share * total_memory_bytes()
    cap = int((budget / bytes_per_unit) ** (1.0 / power))
    cap = max(minimum, min(cap, MAX_COUNT))
    why = (f"{what} takes about {bytes_per_unit:g} bytes x value{'^' + str(power) if power > 1 else ''}; "
           f"the cap keeps it within {share:.0%} of this machine's {total_memory_bytes() / 2**30:.0f} GiB")
    if limit is not None and limit < cap:
        cap, why = max(minimum, limit), limit_why or "the documented cap"
    return _bounded(minimum, cap, why, f"memory_capped_{cap}")


def worker_count(text: str) -> int:
    """Worker processes (0: none, the work runs in the main process): at most :data:`MAX_WORKERS_PER_CORE` per CPU
    core of this machine."""
    cap = MAX_WORKERS_PER_CORE * (os.cpu_count() or 1)
    value = _parse(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return _check_max(value, cap, f"{MAX_WORKERS_PER_CORE} per CPU core, {os.cpu_count() or 1} cores here")


worker_count.kind = "nonnegative_int"  # type: ignore[attr-defined]


def thread_count(text: str) -> int:
    """CPU threads (``--threads``): 1 to :data:`MAX_WORKERS_PER_CORE` per CPU core of this machine."""
    value = _parse(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    cores = os.cpu_count() or 1
    return _check_max(value, MAX_WORKERS_PER_CORE * cores, f"{MAX_WORKERS_PER_CORE} per CPU core, {cores} cores here")


thread_count.kind = "positive_int"  # type: ignore[attr-defined]


def check_memory(estimate_bytes: float, *, what: str, options: str, share: float = 0.5) -> None:
    """``UsageError`` when options that together size a run (``options``, e.g. ``"--batch-size x --context"``)
    give an estimated ``estimate_bytes`` above ``share`` of this machine's memory; call it right after parsing,
    before any work. ``what`` names the estimate (``"the attention scores of one training batch"``)."""
    budget = share * total_memory_bytes()
    if estimate_bytes > budget:
        raise UsageError(f"{options}: {what} would take about {estimate_bytes / 2**30:.1f} GiB, above {share:.0%} of "
                         f"this machine's {total_memory_bytes() / 2**30:.0f} GiB; lower them")


def seed_int(text: str) -> int:
    """A random seed: an integer in 0..2**63-1 (what torch and numpy accept)."""
    value = _parse(text, int)
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must be a seed in 0..{2**63 - 1}, got {value}")
    return value


def _out_of_memory(err: BaseException) -> bool:
    """Whether ``err`` is an allocation that failed (Python's, or torch's on CPU or GPU)."""
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return True
    text = str(err)
    return "can't allocate memory" in text or ("out of memory" in text.lower() and "CUDA" in text)
