"""core.infra.cli.run_cli: one line and exit 2 for bad input, 1 for partial failure, tracebacks only for bugs or on
request; and every user-facing CLI module ends in it."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from core.infra.cli import DEBUG_ENV, PartialFailure, UsageError, run_cli

ROOT = Path(__file__).resolve().parents[1]


def _main(exc=None, code=None, seen=None):
    def main(argv):
        if seen is not None:
            seen.append(list(argv))
        if exc is not None:
            raise exc
        return code

    return main


@pytest.mark.parametrize("exc, want", [
    (UsageError("--steps must be >= 1, got 0"), "error: --steps must be >= 1, got 0"),
    (ValueError("bad\nvalue"), "error: bad value"),
    (FileNotFoundError(2, "No such file or directory", "runs/x.pt"), "error: [Errno 2] No such file or directory: 'runs/x.pt'"),
    (SystemExit("--resume given but runs/last.pt does not exist"), "error: --resume given but runs/last.pt does not exist"),
])  # fmt: skip
def test_input_errors_are_one_line_and_exit_2(exc, want, capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run_cli(_main(exc), []) == 2
    err = capsys.readouterr().err
    assert err.strip() == want and "Traceback" not in err


def test_partial_failure_bugs_interrupts_and_return_codes(capsys, monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert run_cli(_main(PartialFailure("2 of 5 images failed (see above)")), []) == 1
    assert capsys.readouterr().err.strip() == "error: 2 of 5 images failed (see above)"
    assert run_cli(_main(KeyboardInterrupt()), []) == 130
    assert run_cli(_main(code=None), []) == 0 and run_cli(_main(code=3), []) == 3
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        run_cli(_main(ZeroDivisionError()), [])
    with pytest.raises(SystemExit) as e:  # argparse's own exit code passes through
        run_cli(_main(SystemExit(2)), [])
    assert e.value.code == 2


def test_debug_shows_the_traceback_and_is_not_passed_on(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    seen = []
    with pytest.raises(UsageError):
        run_cli(_main(UsageError("x"), seen=seen), ["--n", "3", "--debug"])
    assert seen == [["--n", "3"]]
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ValueError):
        run_cli(_main(ValueError("y")), [])


def _cli_modules() -> list[Path]:
    """Package modules with a ``main`` and a ``__main__`` block (the user-facing CLIs)."""
    found = []
    for pkg in ("core", "video", "pathology", "tabular", "rl", "apps"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if 'if __name__ == "__main__"' in text and "def main(" in text or path.name == "__main__.py":
                found.append(path)
    return found


def test_every_cli_module_ends_in_run_cli():
    mods = _cli_modules()
    assert len(mods) >= 30 and ROOT / "rl" / "train.py" in mods
    missing = []
    for path in mods:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        if "run_cli" not in calls:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"end these CLIs in `raise SystemExit(run_cli(main))` (core.infra.cli): {missing}"


def test_a_real_cli_reports_bad_input_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "tabular.pretrain", "--steps", "0", "--out", "x"],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: argument --steps: must be >= 1, got 0" in proc.stderr.strip().splitlines()[-1]


def test_a_main_that_returns_a_result_object_exits_0():
    assert run_cli(_main(code={"accuracy": 0.5}), []) == 0
    assert run_cli(_main(code=True), []) == 0
