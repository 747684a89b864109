"""One way for every command to fail: a bad input is one line on stderr and exit code 2, never a traceback.

Every CLI module ends in ``raise SystemExit(run_cli(main))``. :func:`run_cli` calls ``main(argv)`` and maps what
comes out of it:

- a return value: the exit code (``None`` is 0);
- the project's input errors — ``ValueError`` (with :class:`UsageError`), ``FileNotFoundError``,
  ``NotADirectoryError``, ``IsADirectoryError``, ``FileExistsError``, ``PermissionError`` — and a ``SystemExit``
  whose code is a message: ``error: <message>`` on stderr, exit code **2** (bad usage or input);
- :class:`PartialFailure` (a run that did part of its work, e.g. some inputs of a batch failed): its message,
  exit code **1**;
- ``KeyboardInterrupt``: ``interrupted``, exit code 130;
- anything else is a bug and keeps its traceback (exit code 1).

``--debug`` anywhere in the arguments (removed before ``main`` sees them), or ``LONGCTX_DEBUG=1`` in the
environment, re-raises instead, with the full traceback. argparse's own usage errors already exit 2 with one line.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

__all__ = ["UsageError", "PartialFailure", "run_cli", "DEBUG_ENV", "INPUT_ERRORS"]

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
        print(_one_line(exit_.code), file=sys.stderr)
        return 2
    except PartialFailure as err:
        if debug:
            raise
        print(_one_line(err), file=sys.stderr)
        return 1
    except INPUT_ERRORS as err:
        if debug:
            raise
        where = f"{err.filename}: " if getattr(err, "filename", None) and str(err.filename) not in str(err) else ""
        print(_one_line(f"{where}{err}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    return 0 if code is None else int(code)
