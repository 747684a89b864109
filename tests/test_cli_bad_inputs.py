"""Every command refuses bad input cleanly: each CLI's ``main()`` runs in-process (through ``run_cli``) with bad
inputs made in a temp folder, and must exit non-zero with one ``error:`` line (or argparse's usage error), never a
traceback, write nothing outside ``--out`` and leave every shipped weights file byte-identical.

The CLIs are the modules ending in ``raise SystemExit(run_cli(...))``; each one's bad invocations are built from its
own argparse parser (captured by stopping ``parse_known_args``), so a new CLI or a new option is covered by default:

- numeric options and choices: values that must be refused when parsed (the contract of ``core.infra.cli``);
  the parser is stopped right after a parse that accepts them, so no such case can start work;
- file and folder options: a missing path, an empty string, a folder where a file belongs (a file where a folder
  belongs), a 25-byte text file where a model/dataset/image/slide/video is expected;
- the command with no arguments when some are required.

The demo launchers (``apps/__main__.py``, ``apps/*/__main__.py``) only get a bad ``--port`` and a bad ``--host``,
which must be refused before any demo is built.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib
from pathlib import Path

import pytest

from core.infra import cli as cli_mod
from core.infra.cli import DEBUG_ENV, run_cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("apps", "rl", "video", "pathology", "tabular", "core")
TEXT = "this is not a real file.\n"  # 25 bytes
assert len(TEXT) == 25

# Options that name a path although their argparse type is a plain string (or none).
INPUT_PATHS = {"--model", "--checkpoint", "--labels", "--features", "--splits", "--encoder-weights", "--weights",
               "--images", "--memory", "--demos", "--csv", "--run", "--init-from", "--policy", "--dataset",
               "--data", "--rows", "--test", "--videos", "--slides", "slides", "--root", "--bench", "--readme"}
# Values of these options that are names, not paths (shipped checkpoints and datasets, bundled weights names).
NOT_A_PATH = {("apps.ncal.train", "--dataset"), ("apps.ncal.train", "--test"), ("rl.train", "--dataset"),
              ("rl.tune", "--weights"), ("rl.routing_stats", "--dataset"), ("rl.tune", "--dataset")}
FOLDER_INPUTS = {"--run", "--videos", "--slides", "--features", "--root", "--demos", "--checkpoint"}
OUTPUT_FILES = {"--json", "--video", "--export"}
OUTPUT_FOLDERS = {"--out", "--dest", "--work", "--samples"}
# --out that is a file, not a folder.
OUT_IS_FILE = {"rl.generate", "rl.references", "pathology.train_demo", "apps.emloc.compress", "apps.ncal.evaluate"}
# One member of a required group of alternatives, given when the case tests none of them.
ALTERNATIVES = {"apps.ncal.predict": ("--text", "hello"), "tabular.compare": ("--dataset", "iris")}
# Plain-int options that must be >= 1 (0 or -1 is meaningless there).
MUST_BE_POSITIVE = {"--steps", "--batch-size", "--batch", "--episodes", "--samples", "--segments", "--max-new-tokens",
                    "--chunk-demos", "--n-estimators", "--val-samples", "--val-tables", "--val-max-rows", "--threads",
                    "--tile", "--images", "--max-images", "--min-images"}

BAD_NUMBERS = {"positive_int": ["0", "-1", "nan", "abc"], "positive_float": ["0", "-1", "nan", "abc"],
               "nonnegative_int": ["-1", "nan", "abc"], "nonnegative_float": ["-1", "nan", "abc"],
               "fraction": ["-1", "2", "nan", "abc"], "open_fraction": ["0", "1", "nan", "abc"],
               "port": ["0", "-1", "65536", "abc"], "int": ["abc", "1.5"], "float": ["abc", "nan"]}
GOOD_NUMBER = {"positive_int": "1", "positive_float": "1", "nonnegative_int": "0", "nonnegative_float": "0",
               "fraction": "0.5", "open_fraction": "0.5", "port": "7860", "int": "0", "float": "1"}

# (module, argv) -> why it is expected to fail; each is a known defect that needs more than a small fix.
XFAIL: dict[tuple[str, tuple[str, ...]], str] = {}


# -- discovery -------------------------------------------------------------------------------------------------------


def _discover() -> list[tuple[str, str, str, dict]]:
    """(module, target module, target function, partial keywords) of every ``raise SystemExit(run_cli(...))``."""
    found = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            src = f.read_text(encoding="utf-8")
            if "raise SystemExit(run_cli(" not in src:
                continue
            tree = ast.parse(src)
            imports = {a.asname or a.name: (n.module, a.name) for n in ast.walk(tree)
                       if isinstance(n, ast.ImportFrom) for a in n.names}  # fmt: skip
            mod = ".".join(f.relative_to(ROOT).with_suffix("").parts)
            for n in ast.walk(tree):
                if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and n.exc.args \
                        and isinstance(n.exc.args[0], ast.Call) and getattr(n.exc.args[0].func, "id", "") == "run_cli":
                    arg, kw = n.exc.args[0].args[0], {}
                    if isinstance(arg, ast.Call):  # functools.partial(main, app="...")
                        kw = {k.arg: ast.literal_eval(k.value) for k in arg.keywords}
                        arg = arg.args[0]
                    target = imports.get(arg.id, (mod, arg.id))
                    found.append((mod, target[0], target[1], kw))
                    break
    return found


CLIS = _discover()


def _main_of(target: str, name: str, kw: dict):
    fn = getattr(importlib.import_module(target), name)
    return functools.partial(fn, **kw) if kw else fn


class _Parsed(Exception):
    def __init__(self, parser, namespace=None):
        self.parser, self.namespace = parser, namespace


def _parser_of(main) -> argparse.ArgumentParser:
    """The parser ``main`` builds, captured when it starts parsing (nothing after that runs)."""
    orig = argparse.ArgumentParser.parse_known_args

    def capture(self, *a, **k):
        raise _Parsed(self)

    argparse.ArgumentParser.parse_known_args = capture
    try:
        main([])
    except _Parsed as got:
        return got.parser
    finally:
        argparse.ArgumentParser.parse_known_args = orig
    raise AssertionError(f"{main} parsed no arguments")


def _is_launcher(mod: str) -> bool:
    parts = mod.split(".")
    return parts[0] == "apps" and parts[-1] == "__main__" and len(parts) <= 3


def _kind(action) -> str | None:
    t = action.type
    name = getattr(t, "__name__", None)
    if name in BAD_NUMBERS:
        return name
    return None


def _path_role(mod: str, action) -> str | None:
    """'in-file', 'in-folder', 'out-file', 'out-folder' or None (not a path)."""
    opt = action.option_strings[0] if action.option_strings else action.dest
    if (mod, opt) in NOT_A_PATH or action.choices or action.nargs == 0 or _kind(action):
        return None
    if opt in OUTPUT_FOLDERS:
        return "out-file" if opt == "--out" and mod in OUT_IS_FILE else "out-folder"
    if opt in OUTPUT_FILES or (mod == "apps.ncal.evaluate" and opt == "--out"):
        return "out-file"
    tname = getattr(action.type, "__name__", "")
    if opt in INPUT_PATHS or tname in ("Path", "nonempty_path", "nonempty_path_obj"):
        return "in-folder" if opt in FOLDER_INPUTS else "in-file"
    return None


def _filler(mod: str, action) -> list[str]:
    """A plausible value for an option the case does not test (outputs go under out/)."""
    opt = action.option_strings[0] if action.option_strings else None
    role = _path_role(mod, action)
    if action.choices:
        val = str(list(action.choices)[0])
    elif _kind(action):
        val = GOOD_NUMBER[_kind(action)]
    elif role == "out-file":
        val = "out/result.npz" if mod == "rl.generate" else "out/result.json"
    elif role == "out-folder":
        val = "out" if opt in ("--out", "--dest") else f"out/{opt.lstrip('-')}"
    elif opt == "--variant":
        val = "comemo"
    else:
        val = {"in-file": "fixtures/text.bin", "in-folder": "fixtures/folder"}.get(role, "x")
    return [opt, val] if opt else [val]


def _cases():
    cases = []
    for mod, target, name, kw in CLIS:
        main = _main_of(target, name, kw)
        if _is_launcher(mod):
            for argv in (["--port", "0"], ["--port", "65536"], ["--port", "http"], ["--host", ""],
                         ["--host", "no.such.host.invalid"]):
                cases.append((mod, "launcher", argv))
            continue
        parser = _parser_of(main)
        actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        required = [a for a in actions if a.required]
        if required:
            cases.append((mod, "run", []))

        def with_fillers(action, value, mode):
            argv = []
            for other in actions:
                if other is action:
                    continue
                role = _path_role(mod, other)
                if other.required or (role and role.startswith("out") and other.option_strings
                                      and other.option_strings[0] in ("--out", "--dest", "--samples", "--export")):
                    argv += _filler(mod, other)
            own = [action.option_strings[0], value] if action.option_strings else [value]
            group = [g for g in parser._mutually_exclusive_groups if g.required]
            if mod in ALTERNATIVES and not any(action in g._group_actions for g in group):
                argv += list(ALTERNATIVES[mod])
            return (mod, mode, own + argv)

        for a in actions:
            opt = a.option_strings[0] if a.option_strings else a.dest
            kind = _kind(a)
            if kind:
                values = list(BAD_NUMBERS[kind])
                if kind == "int" and opt in MUST_BE_POSITIVE:
                    values += ["0", "-1"]
                cases += [with_fillers(a, v, "parse") for v in values]
            elif a.choices and a.nargs != 0:
                cases.append(with_fillers(a, "no-such-choice", "parse"))
            role = _path_role(mod, a)
            if role == "in-file":
                bad = ["fixtures/missing.bin", "", "fixtures/folder", "fixtures/text.bin"]
            elif role == "in-folder":
                bad = ["fixtures/missing", "", "fixtures/text.bin"]
            elif role == "out-file":
                bad = ["", "fixtures/folder"]
            elif role == "out-folder":
                bad = ["", "fixtures/text.bin"]
            else:
                bad = []
            cases += [with_fillers(a, v, "run") for v in bad]
    params = []
    for mod, mode, argv in cases:
        reason = XFAIL.get((mod, tuple(argv)))
        marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
        params.append(pytest.param(mod, mode, argv, marks=marks, id=f"{mod}:{' '.join(argv)[:80] or '<none>'}"))
    return params


CASES = _cases()
MAINS = {mod: (target, name, kw) for mod, target, name, kw in CLIS}


# -- fixtures --------------------------------------------------------------------------------------------------------


def _weights_hashes() -> dict[str, str]:
    out = {}
    for pkg in PACKAGES:
        for d in (ROOT / pkg).rglob("weights"):
            for f in sorted(d.rglob("*")):
                if f.is_file():
                    out[str(f.relative_to(ROOT))] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def shipped_weights():
    """Every file under the packages' weights/ folders, hashed before and after the whole module."""
    before = _weights_hashes()
    assert before, "no shipped weights found"
    yield before
    after = _weights_hashes()
    assert after == before, f"shipped weights changed: {sorted(set(before.items()) ^ set(after.items()))}"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    fx = tmp_path / "fixtures"
    (fx / "folder").mkdir(parents=True)
    (fx / "text.bin").write_text(TEXT, encoding="utf-8")
    return tmp_path


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


# -- tests -----------------------------------------------------------------------------------------------------------


def test_every_cli_is_found():
    assert len(CLIS) >= 36, [m for m, *_ in CLIS]
    assert len(CASES) > 5 * len(CLIS)


@pytest.mark.parametrize("mod,mode,argv", CASES)
def test_cli_refuses_bad_input(mod, mode, argv, workdir, shipped_weights, monkeypatch, capsys):
    target, name, kw = MAINS[mod]
    main = _main_of(target, name, kw)
    if mode == "launcher":
        import apps.hub as hub

        def built(*a, **k):
            raise AssertionError("a demo was built before --host/--port were checked")

        monkeypatch.setattr(hub, "build_hub", built)
        monkeypatch.setattr(hub, "build_single", built)
    if mode == "parse":  # a value the parser accepts stops the run right there: it must be refused when parsed
        orig = argparse.ArgumentParser.parse_known_args

        def stop_after(self, *a, **k):
            result = orig(self, *a, **k)
            raise _Parsed(self, result[0])

        monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_after)
    before = _files(workdir)
    try:
        code = run_cli(main, argv)
    except _Parsed:
        pytest.fail(f"{mod} {argv}: accepted when parsed")
    except SystemExit as exit_:  # argparse's usage error
        code = exit_.code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code not in (0, None), f"{mod} {argv}: exit code {code} for bad input\n{err}"
    lines = err.strip().splitlines()
    assert lines, f"{mod} {argv}: exit {code} with nothing on stderr"
    last = lines[-1]
    assert last.startswith("error:") or (": error: " in last and any(ln.startswith("usage:") for ln in lines)), err
    new = {p for p in _files(workdir) - before if p != "out" and not p.startswith("out/")}
    assert not new, f"{mod} {argv}: wrote outside --out: {sorted(new)}"
