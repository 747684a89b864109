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

Beyond bad values, nothing a command writes may destroy what ships or what the user gave it, and numbers are
bounded (``core.infra.guard``, the caps of ``core.infra.cli``):

- every count option refuses an oversized value (10^13, and its own cap + 1) when parsed;
- every output option pointed inside a shipped ``weights/`` folder is refused (another package's always; the
  command's own package's unless the command makes that package's shipped files), before any work;
- every output option given the same path as one of the command's inputs is refused, the input unchanged;
- degenerate data (non-finite features or weights, one-class labels, conflicting duplicate ids, ragged rows,
  text where numbers belong) and the listed unsafe or unbounded invocations are refused with the file, column or
  row named, each under a time cap;
- shipped files (the whole module) and input files (each case) are hashed before and after: any change fails.
"""

from __future__ import annotations

import argparse
import ast
import functools
import hashlib
import importlib
import json
import shutil
import signal
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
# Ship commands' --dest is the shipped weights file.
DEST_IS_FILE = {"apps.emloc.ship", "apps.comemo.ship"}
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
OVERSIZED = "10000000000000"  # 1e13: no count of the project means that many (core.infra.cli.MAX_COUNT)
GOOD_NUMBER = {"positive_int": "1", "positive_float": "1", "nonnegative_int": "0", "nonnegative_float": "0",
               "fraction": "0.5", "open_fraction": "0.5", "port": "7860", "int": "0", "float": "1"}

# (module, argv) -> why it is expected to fail; each is a known defect that needs more than a small fix.
XFAIL: dict[tuple[str, tuple[str, ...]], str] = {}


# -- discovery -------------------------------------------------------------------------------------------------------


def _discover() -> list[tuple[str, str, str, dict]]:
    """(module, target module, target function, partial keywords) of every ``raise SystemExit(run_cli(...))`` and
    of every ``main`` that returns ``run_cli(_main, argv)`` (the ship commands)."""
    found = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            src = f.read_text(encoding="utf-8")
            if "return run_cli(_main, argv)" in src:
                found.append((".".join(f.relative_to(ROOT).with_suffix("").parts),) * 2 + ("main", {}))
                continue
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
    name = getattr(t, "kind", None) or getattr(t, "__name__", None)
    if name in BAD_NUMBERS:
        return name
    return None


def _path_role(mod: str, action) -> str | None:
    """'in-file', 'in-folder', 'out-file', 'out-folder' or None (not a path)."""
    opt = action.option_strings[0] if action.option_strings else action.dest
    if (mod, opt) in NOT_A_PATH or action.choices or action.nargs == 0 or _kind(action):
        return None
    if opt in OUTPUT_FOLDERS:
        if (opt == "--out" and mod in OUT_IS_FILE) or (opt == "--dest" and mod in DEST_IS_FILE):
            return "out-file"
        return "out-folder"
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
                if kind in ("positive_int", "nonnegative_int"):  # every count is bounded
                    values.append(OVERSIZED)
                    if getattr(a.type, "cap", None) is not None:
                        values.append(str(a.type.cap + 1))
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


# -- outputs that would destroy what ships or what the user gave ---------------------------------------------------

# Commands that make their own package's shipped files (their output may lie in that package's weights/ folder).
PRODUCERS = {("rl.policies", "--out"), ("rl.references", "--out"), ("pathology.train_demo", "--out"),
             ("rl.ship", "--out"), ("apps.ncal.ship", "--out"), ("apps.emloc.ship", "--dest"),
             ("apps.comemo.ship", "--dest")}
WEIGHTS_OF = {"apps": "apps/emloc/weights", "rl": "rl/weights", "video": "video/weights",
              "pathology": "pathology/weights", "tabular": "tabular/weights", "core": "rl/weights"}
INPUT_TEXT = "an input file of the user; it must survive.\n"


def _own_weights(mod: str) -> str | None:
    parts = mod.split(".")
    folder = ROOT.joinpath(*parts[:2]) / "weights" if parts[0] == "apps" else ROOT / parts[0] / "weights"
    return str(folder.relative_to(ROOT)) if folder.is_dir() else None


def _damage_cases():
    cases = []
    for mod, target, name, kw in CLIS:
        if _is_launcher(mod):
            continue
        parser = _parser_of(_main_of(target, name, kw))
        actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
        group = [g for g in parser._mutually_exclusive_groups if g.required]

        def argv_with(values: dict) -> list[str]:
            argv = []
            for a in actions:
                opt = a.option_strings[0] if a.option_strings else None
                key = opt or a.dest
                if key in values:
                    argv += ([opt] if opt else []) + [values[key]]
                elif a.required:
                    argv += _filler(mod, a)
            if mod in ALTERNATIVES and not any(a in g._group_actions for g in group for a in actions
                                               if (a.option_strings[0] if a.option_strings else a.dest) in values):
                argv += list(ALTERNATIVES[mod])
            return argv

        roles = {(a.option_strings[0] if a.option_strings else a.dest): _path_role(mod, a) for a in actions}
        outs = [(k, r) for k, r in roles.items() if r in ("out-file", "out-folder")]
        ins = [(k, r) for k, r in roles.items() if r in ("in-file", "in-folder")]
        top = mod.split(".")[0]
        for opt, role in outs:
            leaf = "x.safetensors" if (mod, opt) in PRODUCERS and role == "out-file" else \
                "x.json" if role == "out-file" else "x"
            others = [WEIGHTS_OF["video" if top != "video" else "rl"]]
            own = _own_weights(mod)
            if own and (mod, opt) not in PRODUCERS:
                others.append(own)
            for w in others:
                cases.append(pytest.param(mod, argv_with({opt: str(ROOT / w / leaf)}), "shipped weights",
                                          id=f"{mod}:{opt} into {w}"))
            for iopt, irole in ins:
                if (role == "out-file") != (irole == "in-file"):
                    continue
                same = "fixtures/input.bin" if irole == "in-file" else "fixtures/inputs"
                if (mod, iopt) in NOT_A_PATH:
                    continue
                cases.append(pytest.param(mod, argv_with({opt: same, iopt: same}), "also an input",
                                          id=f"{mod}:{opt} = {iopt}"))
    return cases


class _TimeCap(BaseException):
    """Raised in the command by SIGALRM: it ran past its time cap (an unbounded run)."""


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _run_capped(mod: str, argv: list[str], seconds: int = 60) -> tuple[int, str]:
    """``run_cli`` of ``mod`` with ``argv`` in this process, stopped (test failure) after ``seconds``."""
    target, name, kw = MAINS[mod]
    main = _main_of(target, name, kw)

    def stop(*_):
        raise _TimeCap()

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        code = run_cli(main, argv)
    except SystemExit as exit_:
        code = exit_.code
    except _TimeCap:
        pytest.fail(f"{mod} {argv}: still running after {seconds} s (an unbounded run)")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return code, ""


@pytest.fixture
def inputs_dir(workdir):
    (workdir / "fixtures" / "input.bin").write_text(INPUT_TEXT, encoding="utf-8")
    (workdir / "fixtures" / "inputs").mkdir()
    (workdir / "fixtures" / "inputs" / "kept.txt").write_text(INPUT_TEXT, encoding="utf-8")
    return workdir


@pytest.mark.parametrize("mod,argv,says", _damage_cases())
def test_cli_refuses_outputs_into_shipped_folders_or_onto_inputs(mod, argv, says, inputs_dir, shipped_weights,
                                                                 capsys):
    before = _hashes(inputs_dir / "fixtures")
    code, _ = _run_capped(mod, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == 2, f"{mod} {argv}: exit {code}\n{err}"
    # a ship command's run folder equal to its destination is refused as a run inside the destination
    named = says in err or (says == "also an input" and "the shipping destination" in err)
    assert err.strip().splitlines()[-1].startswith("error:") and named, err
    assert _hashes(inputs_dir / "fixtures") == before, f"{mod} {argv}: an input file changed"


# -- degenerate data, unsafe and unbounded invocations (each named; each under a time cap) ------------------------


def _nan_copy(src: Path, dst: Path, *, key_index: int = 0) -> None:
    """``src`` safetensors copied to ``dst`` with one floating tensor set to NaN."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    sd = load_file(str(src))
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    key = sorted(k for k, v in sd.items() if v.is_floating_point())[key_index]
    sd[key] = torch.full_like(sd[key], float("nan"))
    save_file(sd, str(dst), metadata=meta)


def _features(folder: Path, name: str, feats) -> None:
    import h5py
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    n = len(feats)
    with h5py.File(folder / f"{name}.h5", "w") as f:
        c = f.create_dataset("coords", data=np.stack([np.arange(n) % 8, np.arange(n) // 8], 1) * 256)
        c.attrs["patch_size_level0"] = 256
        f.create_dataset("features", data=np.asarray(feats, np.float32))


def _cohort(root: Path, labels: str, *, nan_slide: str | None = None) -> list[str]:
    import numpy as np

    rng = np.random.default_rng(0)
    for i in range(6):
        f = rng.normal(size=(12, 8))
        if f"s{i}" == nan_slide:
            f[:] = np.nan
        _features(root / "feats", f"s{i}", f)
    (root / "labels.csv").write_bytes(labels.encode("utf-8") if isinstance(labels, str) else labels)
    return ["--features", str(root / "feats"), "--labels", str(root / "labels.csv"), "--out", str(root / "out"),
            "--epochs", "1", "--folds", "2", "--no-progress"]


LABELS = "slide_id,label,time,event\n" + "".join(f"s{i},{i % 2},{3 + i},1\n" for i in range(6))


def _case_pathology(kind):
    def make(root: Path):
        if kind == "nan":
            return _cohort(root, LABELS, nan_slide="s3"), "s3.h5"
        if kind == "one-class":
            return _cohort(root, LABELS.replace(",1,", ",0,")), "two classes"
        if kind == "duplicate":
            return _cohort(root, LABELS + "s2,1,9,1\n"), "different values"
        if kind == "ragged":
            return _cohort(root, LABELS + "s9,1\n"), "line 8"
        if kind == "nan-label":
            return _cohort(root, LABELS.replace("s4,0,", "s4,nan,")), "line 6"
        if kind == "not-utf8":
            return _cohort(root, LABELS.encode() + "s7,\xe9t\xe9,1,1\n".encode("latin-1")), "UTF-8"
        argv = _cohort(root, LABELS.replace("s1,1,4,", "s1,1,four,"))
        return argv + ["--task", "survival"], "column 'time' line 3"
    return make


def _case_tabular(kind):
    def make(root: Path):
        rows = ["a,b,target"] + [f"{i},{i % 3}.5,{i % 3}" for i in range(30)]
        if kind == "inf":
            rows[5] = "inf,1.5,1"
            says = "column 'a'"
        elif kind == "ragged":
            rows[5] = "4,1.5"
            says = "line 6"
        else:
            rows, says = rows, "not finite"
        (root / "t.csv").write_text("\n".join(rows) + "\n")
        argv = ["--csv", str(root / "t.csv"), "--n-estimators", "1"]
        if kind == "nan-weights":
            _nan_copy(ROOT / "tabular/weights/tabicl_small.safetensors", root / "nan.safetensors")
            argv += ["--checkpoint", str(root / "nan.safetensors")]
        return argv, says
    return make


def _case_rl_nan(root: Path):
    _nan_copy(ROOT / "rl/weights/dm_hopper.safetensors", root / "p.safetensors")
    shutil.copy(ROOT / "rl/weights/dm_hopper.json", root / "p.json")
    return ["--checkpoint", str(root / "p.safetensors"), "--episodes", "1"], "not finite"


def _case_querent_nan(root: Path):
    _nan_copy(ROOT / "pathology/weights/querent_lesion.safetensors", root / "m.safetensors")
    shutil.copy(ROOT / "pathology/weights/querent_lesion.json", root / "m.json")
    shutil.copy(ROOT / "pathology/samples/sample_lesion.tiff", root / "s.tiff")
    return [str(root / "s.tiff"), "--out", str(root / "out"), "--model", str(root / "m.safetensors")], "not finite"


def _ncal_copy(root: Path) -> Path:
    d = root / "ckpt"
    shutil.copytree(ROOT / "apps/ncal/weights/tmwpl", d)
    return d


def _case_ncal_misfit(root: Path):
    import torch
    from safetensors.torch import load_file, save_file

    d = _ncal_copy(root)
    sd = load_file(str(d / "model.safetensors"))
    key = next(k for k, v in sd.items() if v.ndim == 2)
    sd[key] = torch.zeros(sd[key].shape[0] + 1, sd[key].shape[1])
    save_file(sd, str(d / "model.safetensors"))
    return ["--checkpoint", str(d), "--text", "hello"], "does not fit"


def _case_ncal_tokenizer(root: Path):
    d = _ncal_copy(root)
    text = (d / "tokenizer.json").read_text(encoding="utf-8")
    (d / "tokenizer.json").write_text(text[: len(text) // 2], encoding="utf-8")
    return ["--checkpoint", str(d), "--text", "hello"], "tokenizer.json"


def _case_jsonl_onto_itself(flag_in: str):
    def make(root: Path):
        lines = [json.loads(ln) for ln in (ROOT / "apps/ncal/data/TMWPL_test.jsonl").read_text().splitlines()[:3]]
        (root / "x.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines))
        out = ["--out", str(root / "x.jsonl")]
        if flag_in == "--data":
            return ["--checkpoint", "tmwpl", "--data", str(root / "x.jsonl"), *out], "also an input"
        return ["--demos", str(root / "x.jsonl"), *out], "also an input"
    return make


def _case_rl_config(root: Path):
    d = root / "run"
    d.mkdir()
    shutil.copy(ROOT / "rl/weights/dm_hopper.safetensors", d / "model.safetensors")
    shutil.copy(ROOT / "rl/weights/dm_hopper.json", d / "config.json")
    return ["--checkpoint", str(d), "--json", str(d / "config.json"), "--episodes", "1"], "also an input"


def _fixed(argv, says):
    def make(root: Path):
        return [a.replace("ROOT", str(ROOT)) for a in argv], says
    return make


# (module, case builder (temp folder -> (argv, what the error names)), exit code); each is a finding of a sweep
DEGENERATE = [
    ("pathology.train", _case_pathology("nan"), 2),
    ("pathology.train", _case_pathology("one-class"), 2),
    ("pathology.train", _case_pathology("duplicate"), 2),
    ("pathology.train", _case_pathology("ragged"), 2),
    ("pathology.train", _case_pathology("nan-label"), 2),
    ("pathology.train", _case_pathology("not-utf8"), 2),
    ("pathology.train", _case_pathology("text-survival"), 2),
    ("tabular.compare", _case_tabular("inf"), 2),
    ("tabular.compare", _case_tabular("ragged"), 2),
    ("tabular.compare", _case_tabular("nan-weights"), 2),
    ("rl.evaluate", _case_rl_nan, 2),
    ("pathology.predict", _case_querent_nan, 2),
    ("apps.ncal.predict", _case_ncal_misfit, 2),
    ("apps.ncal.predict", _case_ncal_tokenizer, 2),
    ("apps.ncal.evaluate", _case_jsonl_onto_itself("--data"), 2),
    ("apps.emloc.compress", _case_jsonl_onto_itself("--demos"), 2),
    ("rl.evaluate", _case_rl_config, 2),
    ("apps.emloc.compress", _fixed(["--demos", "ROOT/apps/ncal/data/TMWPL_test.jsonl", "--out",
                                    "ROOT/apps/emloc/weights/host.safetensors"], "shipped weights"), 2),
    ("apps.ncal.evaluate", _fixed(["--checkpoint", "tmwpl", "--data", "tmwpl", "--out",
                                   "ROOT/apps/ncal/weights/tmwpl/golden.json"], "shipped weights"), 2),
    ("rl.ship", _fixed(["--run", "ROOT/rl/weights", "--name", "dm_hopper", "--command", "x"], "destination"), 2),
    ("apps.ncal.ship", _fixed(["--run", "ROOT/apps/ncal/weights/tmwpl", "--name", "tmwpl"], "destination"), 2),
    ("rl.train", _fixed(["--algo", "dt", "--dataset", "x.npz", "--steps", "2", "--out", "ROOT/rl/weights"],
                        "shipped weights"), 2),
    ("pathology.batch", _fixed(["--slides", "ROOT/pathology/samples", "--out", "o", "--encoder-kwargs",
                                '{"no_such_option": 1}'], "--encoder-kwargs"), 2),
]


@pytest.mark.parametrize("mod,make,want", DEGENERATE, ids=[f"{m}:{i}" for i, (m, *_) in enumerate(DEGENERATE)])
def test_cli_refuses_degenerate_data_and_unbounded_runs(mod, make, want, workdir, shipped_weights, capsys):
    argv, says = make(workdir)
    before = _hashes(workdir)
    code, _ = _run_capped(mod, argv)
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert code == want, f"{mod} {argv}: exit {code}\n{err}"
    assert says in err, f"{mod} {argv}: the message does not name {says!r}\n{err}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("error:") or (": error: " in last and "usage:" in err), err
    after = _hashes(workdir)
    assert {k: v for k, v in after.items() if k in before} == before, f"{mod} {argv}: an input file changed"


# The unbounded invocations a sweep found (a run, a MemoryError, 586 forked workers): each must be refused when its
# options are parsed. The parser is stopped right after a parse that accepts them, so a regression fails here
# instead of forking, allocating or writing without end.
BOUNDS = [
    ("rl.generate", ["--env", "Hopper-v5", "--quality", "random", "--steps", "100000000000000", "--out", "d.npz"],
     "--steps"),
    ("rl.train", ["--algo", "dt", "--dataset", "x.npz", "--steps", "2", "--out", "o", "--context", "1000000000"],
     "--context"),
    ("rl.train", ["--algo", "dt", "--dataset", "x.npz", "--steps", "2", "--out", "o", "--context", "1001"], "--context"),
    ("pathology.synthetic", ["--out", "o", "--size", "100000000"], "--size"),
    ("video.synthetic", ["--out", "o", "--size", "1000000"], "--size"),
    ("video.synthetic", ["--out", "o", "--n", "1000000000000"], "--n"),
    ("tabular.compare", ["--dataset", "iris", "--n-estimators", "1000000000"], "--n-estimators"),
    ("pathology.batch", ["--slides", "s", "--out", "o", "--workers", "100000"], "--workers"),
    ("pathology.batch", ["--slides", "s", "--out", "o", "--slide-mpp", "1e-9"], "--slide-mpp"),
    ("pathology.batch", ["--slides", "s", "--out", "o", "--mpp", "1e-6"], "--mpp"),
    ("video.batch", ["--videos", "v", "--out", "o", "--fps", "1e9"], "--fps"),
]


@pytest.mark.parametrize("mod,argv,flag", BOUNDS, ids=[f"{m}:{' '.join(a[-2:])}" for m, a, _ in BOUNDS])
def test_cli_refuses_unbounded_values_when_parsed(mod, argv, flag, workdir, monkeypatch, capsys):
    target, name, kw = MAINS[mod]
    orig = argparse.ArgumentParser.parse_known_args

    def stop_after(self, *a, **k):
        result = orig(self, *a, **k)
        raise _Parsed(self, result[0])

    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop_after)
    try:
        run_cli(_main_of(target, name, kw), argv)
    except _Parsed:
        pytest.fail(f"{mod} {argv}: accepted when parsed")
    except SystemExit as exit_:
        assert exit_.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "Traceback" not in err, err
