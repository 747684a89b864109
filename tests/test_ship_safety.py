"""No ``ship`` command can damage what ships: each one (rl, apps.emloc, apps.comemo, apps.ncal) refuses a corrupt,
truncated or foreign model, an incomplete run folder and a bad name with one line on stderr and exit code 2, and a
failure while it writes leaves the shipped files byte-identical; a valid candidate ships with its card.

Every command writes into a temp copy of its package's weights folder here; the real folder is hashed before and
after every test. The candidates are the shipped models with their weights slightly perturbed (so a shipped copy
differs from what it replaces), laid out as training runs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parents[1]
TEXT_MODEL = b"this is not a model file\n"  # 25 bytes


def _perturb(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {k: (v + 1e-3 * torch.randn(v.shape, generator=gen)).to(v.dtype) if v.is_floating_point() else v
            for k, v in tensors.items()}


def _perturbed_copy(src: Path, dst: Path) -> None:
    """``src`` with every float tensor nudged, keeping its header metadata (format, config)."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    save_file({k: v.contiguous() for k, v in _perturb(load_file(str(src))).items()}, str(dst), metadata=meta)


def _jsonl(path: Path, records: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _rl_run(run: Path) -> None:
    w = REPO / "rl" / "weights"
    info = json.loads((w / "dm_hopper.json").read_text())
    info.pop("card")
    (run / "config.json").write_text(json.dumps(info))
    _perturbed_copy(w / "dm_hopper.safetensors", run / "model.safetensors")
    _jsonl(run / "metrics.jsonl", [{"step": 100, "kind": "train", "loss": 0.2, "sec_per_1k_steps": 9.0},
                                   {"step": 100, "kind": "eval", "normalized_score": 12.0}])


def _emloc_run(run: Path) -> None:
    w = REPO / "apps" / "emloc" / "weights"
    prov = json.loads((w / "host.json").read_text())
    _perturbed_copy(w / "host.safetensors", run / "model.safetensors")
    torch.save({"args": prov["train_config"], "step": 7}, run / "last.pt")
    _jsonl(run / "metrics.jsonl", [{"step": 7, "eval_loss": 1.2, "eval_acc_shots_0-8": 0.4, "elapsed_s": 3.0}])


def _comemo_run(run: Path) -> None:
    w = REPO / "apps" / "comemo" / "weights"
    prov = json.loads((w / "comemo.json").read_text())
    _perturbed_copy(w / "comemo.safetensors", run / "model.safetensors")
    shutil.copyfile(w / "tokenizer.json", run / "tokenizer.json")
    args = {**prov["train_config"], "variant": prov["model_config"]["variant"]}
    torch.save({"args": args, "step": 7, "wall_time": 3.0}, run / "last.pt")
    _jsonl(run / "metrics.jsonl", [{"step": 7, "val_loss": 1.0, "val_token_acc": 0.5}])


def _ncal_run(run: Path) -> None:
    w = REPO / "apps" / "ncal" / "weights" / "tmwpl"
    for f in ("ncal.json", "tokenizer.json", "metrics.jsonl"):
        shutil.copyfile(w / f, run / f)
    _perturbed_copy(w / "model.safetensors", run / "model.safetensors")


def _encoder_run(run: Path) -> None:
    w = REPO / "apps" / "ncal" / "weights" / "mlm_encoder"
    for f in ("encoder.json", "tokenizer.json", "metrics.jsonl"):
        shutil.copyfile(w / f, run / f)
    _perturbed_copy(w / "encoder.safetensors", run / "encoder.safetensors")


@dataclass(kw_only=True)
class Case:
    """One ship command: how to build its candidate run and call it."""

    id: str
    module: str  # the command's module (its main is called in-process)
    weights: Path  # the package's real weights folder
    make_run: Callable[[Path], None]
    model_file: str  # the candidate weights in the run folder
    run_files: tuple[str, ...]  # what the run folder must hold
    argv: Callable[[Path, Path, str | None], list[str]]  # (run, destination weights folder, name) -> arguments
    shipped: str  # the shipped weights, relative to the weights folder
    foreign: Path  # a shipped safetensors of another model
    has_name: bool  # the command takes --name (else its --dest names the file)

    def main(self, argv: list[str]) -> int:
        import importlib

        return importlib.import_module(self.module).main(argv)


CASES = [
    Case(id="rl", module="rl.ship", weights=REPO / "rl" / "weights", make_run=_rl_run,
         model_file="model.safetensors", run_files=("config.json", "model.safetensors", "metrics.jsonl"),
         argv=lambda run, dest, name: ["--run", str(run), "--name", "dm_hopper" if name is None else name,
                                       "--command", "python -m rl.train ...", "--out", str(dest)],
         shipped="dm_hopper.safetensors", foreign=REPO / "rl" / "weights" / "behaviour_hopper.safetensors",
         has_name=True),
    Case(id="emloc", module="apps.emloc.ship", weights=REPO / "apps" / "emloc" / "weights", make_run=_emloc_run,
         model_file="model.safetensors", run_files=("model.safetensors", "last.pt", "metrics.jsonl"),
         argv=lambda run, dest, name: ["--run", str(run), "--command", "python -m apps.emloc.train ...",
                                       "--dest", str(dest / "host.safetensors") if name is None else name],
         shipped="host.safetensors", foreign=REPO / "apps" / "comemo" / "weights" / "comemo.safetensors",
         has_name=False),
    Case(id="comemo", module="apps.comemo.ship", weights=REPO / "apps" / "comemo" / "weights",
         make_run=_comemo_run, model_file="model.safetensors",
         run_files=("model.safetensors", "tokenizer.json", "last.pt", "metrics.jsonl"),
         argv=lambda run, dest, name: ["--run", str(run), "--command", "python -m apps.comemo.train ...",
                                       "--dest", str(dest / "comemo.safetensors") if name is None else name],
         shipped="comemo.safetensors", foreign=REPO / "apps" / "emloc" / "weights" / "host.safetensors",
         has_name=False),
    Case(id="ncal", module="apps.ncal.ship", weights=REPO / "apps" / "ncal" / "weights", make_run=_ncal_run,
         model_file="model.safetensors", run_files=("model.safetensors", "ncal.json", "tokenizer.json", "metrics.jsonl"),
         argv=lambda run, dest, name: ["--run", str(run), "--name", "tmwpl" if name is None else name,
                                       "--log-level", "WARNING"],
         shipped="tmwpl/model.safetensors", foreign=REPO / "apps" / "ncal" / "weights" / "pmtd" / "model.safetensors",
         has_name=True),
    Case(id="ncal-encoder", module="apps.ncal.ship", weights=REPO / "apps" / "ncal" / "weights",
         make_run=_encoder_run, model_file="encoder.safetensors",
         run_files=("encoder.safetensors", "encoder.json", "tokenizer.json", "metrics.jsonl"),
         argv=lambda run, dest, name: ["--encoder", str(run), "--log-level", "WARNING"],
         shipped="mlm_encoder/encoder.safetensors", foreign=REPO / "apps" / "ncal" / "weights" / "tmwpl" / "model.safetensors",
         has_name=False),
]
BY_ID = {c.id: c for c in CASES}


def _tree(folder: Path) -> dict[str, str]:
    """Every entry under ``folder`` (hidden ones too): file -> SHA-256, folder -> "dir"."""
    out = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        out[rel] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A valid candidate run folder per case, built once."""
    root = tmp_path_factory.mktemp("runs")
    out = {}
    for c in CASES:
        (root / c.id).mkdir()
        c.make_run(root / c.id)
        out[c.id] = root / c.id
    return out


@pytest.fixture
def shipcase(request, runs, tmp_path, monkeypatch):
    """(case, a fresh copy of its run, a temp copy of its weights folder); checks the real folder is untouched."""
    case = BY_ID[request.param]
    run = tmp_path / "run"
    shutil.copytree(runs[case.id], run)
    dest = tmp_path / "weights"
    shutil.copytree(case.weights, dest)
    if case.module == "apps.ncal.ship":
        import apps.ncal.ship as ncal_ship

        monkeypatch.setattr(ncal_ship, "WEIGHTS", dest)  # its default destination
    before = _tree(case.weights)
    yield case, run, dest
    assert _tree(case.weights) == before, f"the real {case.weights} changed"


def _refused(case: Case, argv: list[str], dest: Path, capsys) -> str:
    """Run the command, which must refuse: exit 2, one line on stderr, no traceback, ``dest`` untouched."""
    before = _tree(dest)
    rc = case.main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert _tree(dest) == before, "a refused ship changed the shipped files"
    return lines[0]


ALL = [c.id for c in CASES]


@pytest.mark.parametrize("shipcase", ALL, indirect=True)
@pytest.mark.parametrize("bad", ["text", "truncated", "foreign", "nan"])
def test_a_corrupt_or_foreign_model_is_refused(shipcase, bad, capsys):
    case, run, dest = shipcase
    model = run / case.model_file
    if bad == "text":
        model.write_bytes(TEXT_MODEL)
        assert model.stat().st_size == 25
    elif bad == "truncated":
        data = model.read_bytes()
        model.write_bytes(data[: len(data) // 2])
    elif bad == "foreign":
        shutil.copyfile(case.foreign, model)
    else:  # the right tensors and header, all NaN: it loads, but its outputs are not finite
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        with safe_open(str(model), framework="pt") as f:
            meta = f.metadata()
        tensors = load_file(str(model))
        save_file({k: torch.full_like(v, float("nan")) if v.is_floating_point() else v for k, v in tensors.items()},
                  str(model), metadata=meta)
    line = _refused(case, case.argv(run, dest, None), dest, capsys)
    assert case.model_file in line and "not a loadable" in line
    if bad == "nan":
        assert "not finite" in line


@pytest.mark.parametrize(("shipcase", "missing"), [(c.id, f) for c in CASES for f in c.run_files],
                         indirect=["shipcase"])
def test_an_incomplete_run_is_refused(shipcase, missing, capsys):
    case, run, dest = shipcase
    (run / missing).unlink()
    line = _refused(case, case.argv(run, dest, None), dest, capsys)
    assert f"missing {missing}" in line


@pytest.mark.parametrize("shipcase", ALL, indirect=True)
def test_a_missing_run_folder_is_refused(shipcase, capsys):
    case, run, dest = shipcase
    shutil.rmtree(run)
    assert "no such folder" in _refused(case, case.argv(run, dest, None), dest, capsys)


@pytest.mark.parametrize("shipcase", ["rl", "ncal"], indirect=True)
@pytest.mark.parametrize("name", ["", "a/b", "..", "../tmwpl"])
def test_a_bad_name_is_refused(shipcase, name, capsys):
    case, run, dest = shipcase
    line = _refused(case, case.argv(run, dest, name), dest, capsys)
    assert f"--name {name!r}" in line and "file stem" in line


@pytest.mark.parametrize("shipcase", ["emloc", "comemo"], indirect=True)
@pytest.mark.parametrize("target", ["", "{dest}", "{dest}/.safetensors", "{dest}/a/", "{dest}/host.json"])
def test_a_bad_destination_name_is_refused(shipcase, target, capsys):
    """These commands name the shipped file with --dest: an empty stem, a folder or another suffix is refused."""
    case, run, dest = shipcase
    line = _refused(case, case.argv(run, dest, target.format(dest=dest)), dest, capsys)
    assert line.startswith("error: --dest") and "NAME.safetensors" in line


@pytest.mark.parametrize("shipcase", ["rl"], indirect=True)
def test_rl_refuses_a_name_that_is_not_a_policy(shipcase, capsys):
    case, run, dest = shipcase
    line = _refused(case, case.argv(run, dest, "behaviour_hopper"), dest, capsys)
    assert "not a policy shipped by rl.ship" in line


@pytest.mark.parametrize("shipcase", ["ncal"], indirect=True)
@pytest.mark.parametrize("what", ["no-test-metrics", "encoder-name", "no-name"])
def test_ncal_refuses_an_unfinished_run_or_the_encoder_folder(shipcase, what, capsys):
    case, run, dest = shipcase
    argv = case.argv(run, dest, None)
    if what == "no-test-metrics":
        meta = json.loads((run / "ncal.json").read_text())
        (run / "ncal.json").write_text(json.dumps({**meta, "test": None}))
        expect = "no test metrics"
    elif what == "encoder-name":
        argv = case.argv(run, dest, "mlm_encoder")
        expect = "shipped encoder's folder"
    else:
        argv = ["--run", str(run)]
        expect = "--run needs --name"
    assert expect in _refused(case, argv, dest, capsys)


@pytest.mark.parametrize("shipcase", ALL, indirect=True)
def test_a_failure_while_writing_leaves_the_shipped_files(shipcase, monkeypatch):
    """The second rename into the weights folder fails (a full disk): what was renamed before it is put back."""
    case, run, dest = shipcase
    before = _tree(dest)
    real_replace = os.replace
    calls = []

    def failing_replace(src, dst, *a, **kw):
        if Path(dst).resolve().is_relative_to(dest.resolve()) and ".ship-" not in str(dst):
            calls.append(dst)
            if len(calls) == 2:
                raise OSError(28, "No space left on device")
        return real_replace(src, dst, *a, **kw)

    monkeypatch.setattr(os, "replace", failing_replace)
    argv = case.argv(run, dest, None)
    with pytest.raises(OSError, match="No space left"):
        case.main(argv)
    monkeypatch.undo()
    assert len(calls) >= 2  # the failing rename came after one that succeeded (and was undone)
    assert _tree(dest) == before, "a failed ship changed the shipped files"


@pytest.mark.parametrize("shipcase", ALL, indirect=True)
def test_a_valid_candidate_ships_with_its_card(shipcase, capsys):
    from core.infra.model_card import card_path, provenance_path, render_card

    case, run, dest = shipcase
    argv = case.argv(run, dest, None)
    if case.module == "apps.ncal.ship":
        argv += ["--out", str(dest)]
    before = _tree(dest)
    assert case.main(argv) == 0, capsys.readouterr().err
    after = _tree(dest)
    shipped = dest / case.shipped
    assert shipped.read_bytes() == (run / case.model_file).read_bytes()
    assert before[case.shipped] != after[case.shipped]  # the candidate differs from what it replaced
    assert isinstance(json.loads(provenance_path(shipped).read_text()), dict)
    assert card_path(shipped).read_text() == render_card(shipped)  # the card describes the new weights
    assert set(after) <= set(before), f"left behind: {set(after) - set(before)}"  # no temp files
    assert set(before) - set(after) <= {"tmwpl/selection.json"}  # shipped without --selection: the old choice goes
    changed = {k for k in after if after[k] != before[k]}
    assert {case.shipped, str(card_path(shipped).relative_to(dest))} <= changed


def test_staging_commits_together_and_rolls_back(tmp_path, monkeypatch):
    from core.infra.ship import Staging

    folder = tmp_path / "weights"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"old a")
    (folder / "b.json").write_text("old b")
    with pytest.raises(RuntimeError):  # an error while staging: nothing is renamed, the temp folder goes
        with Staging(folder) as stage:
            stage.write_text(folder / "a.bin", "new a")
            raise RuntimeError("boom")
    assert _tree(folder) == {"a.bin": hashlib.sha256(b"old a").hexdigest(), "b.json": hashlib.sha256(b"old b").hexdigest()}
    before = _tree(folder)

    real_replace = os.replace
    calls = []

    def failing_replace(src, dst, *a, **kw):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_replace(src, dst, *a, **kw)

    stage = Staging(folder)
    stage.write_text(folder / "a.bin", "new a")
    stage.write_text(folder / "sub" / "new.txt", "brand new")
    stage.remove(folder / "b.json")
    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        stage.commit()
    monkeypatch.undo()
    tree = _tree(folder)
    assert {k: v for k, v in tree.items() if v != "dir"} == before  # a.bin restored, sub/new.txt removed

    with Staging(folder) as stage:
        stage.write_text(folder / "a.bin", "new a")
        stage.write_text(folder / "sub" / "new.txt", "brand new")
        stage.remove(folder / "b.json")
    assert (folder / "a.bin").read_text() == "new a" and (folder / "sub" / "new.txt").read_text() == "brand new"
    assert not (folder / "b.json").exists() and not list(folder.glob(".ship-*"))


def test_staged_card_is_the_generators_card_in_place(tmp_path):
    """A card rendered from staged files reads exactly as the generator renders it once they are in place,
    package README link and repository-relative weights path included."""
    from core.infra.model_card import render_card
    from core.infra.ship import Staging

    root = tmp_path / "repo"
    (root / "pkg" / "weights").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "README.md").write_text("# pkg\n")
    w = root / "pkg" / "weights" / "m.safetensors"
    src = REPO / "rl" / "weights" / "dm_hopper.safetensors"
    with Staging(w.parent) as stage:
        stage.copy(src, w)
        stage.write_json(w.with_suffix(".json"), {"name": "m", "command": "make m"})
        card = stage.write_card(w, root=root)
    text = card.read_text()
    assert text == render_card(w, root=root)
    assert "`pkg/weights/m.safetensors`" in text and "../README.md" in text and "make m" in text


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "a\\b", ".hidden", "x" * 101, "a b"])
def test_check_name_refuses_unsafe_stems(name):
    from core.infra.ship import check_name

    with pytest.raises(ValueError, match="file stem"):
        check_name(name, flag="--name")
    assert check_name("dm_hopper-v2.1") == "dm_hopper-v2.1"


@pytest.mark.parametrize("shipcase", ["ncal"], indirect=True)
def test_ncal_provenance_rewrites_json_and_card_together(shipcase, capsys):
    from core.infra.model_card import render_card

    case, run, dest = shipcase
    before = _tree(dest)
    _refused(case, ["--provenance", "tmwpl", "../tmwpl", "--out", str(dest)], dest, capsys)  # checked before any write
    assert case.main(["--provenance", "tmwpl", "mlm_encoder", "--out", str(dest), "--log-level", "WARNING"]) == 0
    after = _tree(dest)
    assert set(after) == set(before)
    for name, weights in (("tmwpl", "tmwpl/model.safetensors"), ("mlm_encoder", "mlm_encoder/encoder.safetensors")):
        assert after[f"{name}.json"] == before[f"{name}.json"]  # the shipped JSON is what the folder says
        assert (dest / f"{name}.md").read_text() == render_card(dest / weights)
