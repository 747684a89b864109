"""Model cards: every shipped weights file has its card (``<stem>.md``, or ``weights/<name>.md`` for a file in
``weights/<name>/``) equal to what ``core.infra.model_card`` makes of its JSON."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from core.infra.model_card import (
    NOT_RECORDED,
    REPO,
    card_path,
    discover_weights,
    provenance_path,
    render_card,
    weights_summary,
    write_cards,
)

SHIPPED = discover_weights(REPO)
NCAL = ("apps/ncal/weights/tmwpl/model.safetensors", "apps/ncal/weights/pmtd/model.safetensors",
        "apps/ncal/weights/mlm_encoder/encoder.safetensors")  # shipped as folders, carded like the rest


def _write_safetensors(path: Path, tensors: dict[str, tuple[list[int], str]]) -> None:
    """A safetensors file with zero-filled tensors of the given shapes and dtypes (F32 or I64)."""
    sizes = {"F32": 4, "I64": 8}
    header, offset = {}, 0
    for name, (shape, dtype) in tensors.items():
        n = sizes[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(offset))


def _package(root: Path, folder: str) -> Path:
    d = root / folder
    d.mkdir(parents=True, exist_ok=True)
    (d / "__init__.py").write_text("")
    return d


def test_shipped_weights_are_found():
    names = {p.relative_to(REPO).as_posix() for p in SHIPPED}
    assert {"tabular/weights/tabicl_medium.safetensors", "rl/weights/dm_hopper.safetensors", *NCAL} <= names
    assert all(p.suffix == ".safetensors" and "weights" in p.relative_to(REPO).parts for p in SHIPPED)


@pytest.mark.parametrize("weights", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_shipped_file_has_its_generated_card(weights):
    card = card_path(weights)
    assert card.is_file(), f"{card.relative_to(REPO)} is missing: run `python -m core.infra.model_card`"
    assert card.read_text(encoding="utf-8") == render_card(weights, root=REPO), (
        f"{card.relative_to(REPO)} differs from its JSON: run `python -m core.infra.model_card`"
    )


@pytest.mark.parametrize("weights", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_card_header_and_sections(weights):
    yaml = pytest.importorskip("yaml")
    text = render_card(weights, root=REPO)
    m = re.match(r"^---\n(.*?)\n---\n", text, re.S)
    assert m, "the card must start with a YAML header"
    header = yaml.safe_load(m.group(1))
    assert header["license"] == "mit" and header["library_name"] == "pytorch"
    for key in ("tags", "datasets", "metrics"):
        assert isinstance(header[key], list) and header[key], f"{key} must be a non-empty list"
    for section in ("## Intended use", "## Out-of-scope use", "## Training data", "## Training procedure", "## Evaluation", "## Limitations"):
        assert section in text, f"{weights.name}: card lacks {section!r}"
    info = weights_summary(weights)
    assert info["sha256"] in text and str(info["bytes"]) in text


@pytest.mark.parametrize("weights", SHIPPED, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_json_field_is_in_the_card(weights):
    """Nothing of the provenance is dropped: each top-level field (and each of a nested ``card``) is named."""
    record = json.loads(provenance_path(weights).read_text())
    text = render_card(weights, root=REPO)
    keys = [k for k in record if k != "card"] + [f"card.{k}" for k in record.get("card", {})]
    for key in keys:
        value = record[key] if "." not in key else record["card"][key.split(".", 1)[1]]
        named = f"**{key}**" in text
        shown = isinstance(value, str) and " ".join(value.split())[:60] in " ".join(text.split())
        assert named or shown, f"{weights.name}: field {key!r} of the JSON does not appear in the card"


def test_ncal_cards_are_generated_and_checked_like_the_rest(tmp_path):
    """The NCAL folders' cards come from the generator: --check passes on a copy of them, and reports a card
    made stale by an edited JSON or weights file, or a missing one."""
    for pkg in ("apps", "apps/ncal"):
        (tmp_path / pkg).mkdir(parents=True, exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    shutil.copytree(REPO / "apps/ncal/weights", tmp_path / "apps/ncal/weights")
    shutil.copy(REPO / "apps/ncal/README.md", tmp_path / "apps/ncal/README.md")
    cards = {tmp_path / "apps/ncal/weights" / f"{n}.md" for n in ("tmwpl", "pmtd", "mlm_encoder")}
    assert write_cards(tmp_path, check=True) == {c: "ok" for c in cards}, "NCAL cards differ from the generator's"
    prov = tmp_path / "apps/ncal/weights/tmwpl.json"
    record = json.loads(prov.read_text(encoding="utf-8"))
    record["held_out_metrics"]["accuracy"] = 0.9999
    prov.write_text(json.dumps(record, ensure_ascii=False), encoding="utf-8")
    (tmp_path / "apps/ncal/weights/pmtd.md").unlink()
    w = tmp_path / "apps/ncal/weights/mlm_encoder/encoder.safetensors"
    w.write_bytes(w.read_bytes() + b" ")  # same header, another file: size and SHA-256 change
    status = {c.name: s for c, s in write_cards(tmp_path, check=True).items()}
    assert status == {"tmwpl.md": "differs", "pmtd.md": "missing", "mlm_encoder.md": "differs"}
    r = subprocess.run([sys.executable, "-m", "core.infra.model_card", "--root", str(tmp_path), "--check"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "3 card(s) missing or stale" in r.stderr and "apps/ncal/weights/pmtd.md: missing" in r.stderr
    assert write_cards(tmp_path) == {c: "written" for c in cards}
    assert "| accuracy | 0.9999 |" in (tmp_path / "apps/ncal/weights/tmwpl.md").read_text(encoding="utf-8")


def test_folder_layout_is_found_and_carded(tmp_path):
    app = _package(tmp_path, "apps/x")
    _package(tmp_path, "apps")
    w = app / "weights" / "tmwpl" / "model.safetensors"
    _write_safetensors(w, {"w": ([2], "F32")})
    flat = app / "weights" / "flat.safetensors"
    _write_safetensors(flat, {"w": ([2], "F32")})
    assert discover_weights(tmp_path) == [flat, w]
    assert card_path(w) == app / "weights" / "tmwpl.md" and card_path(flat) == app / "weights" / "flat.md"
    assert provenance_path(w) == app / "weights" / "tmwpl.json" and provenance_path(flat) == flat.with_suffix(".json")
    (w.parent / "model.json").write_text(json.dumps({"name": "not the provenance"}))  # a file the app loads
    with pytest.raises(FileNotFoundError, match=r"tmwpl.json in .*weights"):
        render_card(w, root=tmp_path)
    provenance_path(w).write_text(json.dumps({"name": "T", "steps": 3}))
    flat.with_suffix(".json").write_text(json.dumps({"name": "F"}))
    assert write_cards(tmp_path, check=True) == {card_path(flat): "missing", card_path(w): "missing"}
    assert write_cards(tmp_path) == {card_path(flat): "written", card_path(w): "written"}
    text = card_path(w).read_text()
    assert text.startswith("---\n") and "\n# tmwpl\n" in text and "- **steps**: 3" in text
    assert "Weights `apps/x/weights/tmwpl/model.safetensors`; provenance [`tmwpl.json`](tmwpl.json)" in text
    assert weights_summary(w)["sha256"] in text
    provenance_path(w).write_text(json.dumps({"name": "T", "steps": 4}))
    assert write_cards(tmp_path, check=True)[card_path(w)] == "differs"
    # two files for one card: refused, not overwritten in turn
    _write_safetensors(w.parent / "other.safetensors", {"w": ([1], "F32")})
    with pytest.raises(ValueError, match="would share the card"):
        write_cards(tmp_path)


def test_tables_language_and_the_selection_section(tmp_path):
    _package(tmp_path, "apps")
    app = _package(tmp_path, "apps/newapp")
    w = app / "weights" / "clf" / "model.safetensors"
    _write_safetensors(w, {"w": ([3], "F32")})
    record = {
        "name": "C",
        "selection": "Chosen: **b**, by validation accuracy; the test split was not read.",
        "selection_candidates": {"columns": ["loss", "validation accuracy"], "rows": [["a", 61.5], ["b (chosen)", 70.25]]},
        "per_class": {"columns": ["class", "test recall"], "rows": [["x|y", 0.5], ["z", None]]},
        "odd": {"columns": ["a", "b"], "rows": [[1]]},  # a row short of a cell: not a table
        "model_card": {"language": "zh", "intended_use": "Demo."},
    }
    provenance_path(w).write_text(json.dumps(record))
    text = render_card(w, root=tmp_path)
    assert '\nlanguage: "zh"\nlibrary_name:' in text.split("\n---\n")[0]
    chosen = text.split("## How this model was chosen\n\n", 1)[1].split("\n## ", 1)[0]
    assert chosen.startswith("Chosen: **b**, by validation accuracy")
    assert "  | loss | validation accuracy |\n  |---|---|\n  | a | 61.5 |\n  | b (chosen) | 70.25 |" in chosen
    assert text.index("## Training procedure") < text.index("## How this model was chosen") < text.index("## Evaluation")
    evaluation = text.split("## Evaluation", 1)[1].split("## Limitations", 1)[0]
    assert "  | x\\|y | 0.5 |\n  | z | not recorded (null) |" in evaluation, "cells escaped, nulls named"
    other = text.split("## Other recorded fields", 1)[1]
    assert "**odd**" in other and "| a | b |" not in other and "- rows:" in other


def test_missing_fields_read_not_recorded_and_no_number_is_made_up(tmp_path):
    pkg = _package(tmp_path, "newpkg")
    w = pkg / "weights" / "tiny.safetensors"
    _write_safetensors(w, {"a": ([3, 5], "F32"), "b": ([7], "I64")})
    w.with_suffix(".json").write_text(json.dumps({"model": "Tiny"}))
    text = render_card(w, root=tmp_path)
    assert f"Command: {NOT_RECORDED}" in text
    assert f"- **steps**: {NOT_RECORDED}" in text and f"- **wall time**: {NOT_RECORDED}" in text
    assert f"## Training data\n\n- {NOT_RECORDED}" in text
    assert f"## Intended use\n\n{NOT_RECORDED}" in text, "an unknown package has no invented intended use"
    assert "metrics:\n- \"not recorded\"" in text
    assert "22 elements" in text and "2 tensors" in text, "parameter count from the file header (15 + 7)"
    body = text.split("SHA-256", 1)[0].replace("F32", "").replace("I64", "")  # dtype names are not numbers
    numbers = set(re.findall(r"\d+(?:\.\d+)?", body))
    allowed = {"22", "2", str(w.stat().st_size)}
    assert numbers <= allowed, f"numbers not taken from the JSON or the file: {numbers - allowed}"


def test_json_fields_are_rendered_and_not_met_targets_reach_the_limits(tmp_path):
    pkg = _package(tmp_path, "tabular")
    w = pkg / "weights" / "m.safetensors"
    _write_safetensors(w, {"w": ([4], "F32")})
    record = {
        "model": "M",
        "command": "python -m x --steps 3",
        "data": "synthetic things",
        "steps": 3,
        "wall_time_s": 12.5,
        "metrics": {"val_accuracy": 0.912345678, "auc": 0.5},
        "benchmark": {"command": "python -m bench", "targets": ["target A: met", "target B: NOT met (below on wine)"]},
        "odd_field": {"x": [1, 2]},
    }
    w.with_suffix(".json").write_text(json.dumps(record))
    text = render_card(w, root=tmp_path)
    assert "```bash\npython -m x --steps 3\n```" in text and "python -m bench" in text
    assert "- **data**: synthetic things" in text and "- **steps**: 3" in text and "12.5" in text
    assert "0.9123" in text, "floats are shortened to 4 decimals, never lengthened"
    assert "Target not met (`benchmark.targets[1]`): target B: NOT met (below on wine)" in text.split("## Limitations")[1]
    assert "## Other recorded fields" in text and "**odd_field**" in text
    assert "tabular-classification" in text, "the package's own tags apply"
    assert "## Intended use\n\nDefault checkpoint of `tabular.TabICLClassifier`" in text
    record["intended_use"] = "Only for the scaling benchmark."
    w.with_suffix(".json").write_text(json.dumps(record))
    text = render_card(w, root=tmp_path)
    assert "## Intended use\n\nOnly for the scaling benchmark." in text, "the JSON's own intended_use wins"
    assert "**intended_use**" not in text, "and is not repeated among the other fields"
    for metric in ("accuracy", "roc_auc"):
        assert f'- "{metric}"' in text.split("---")[1]


def test_discovery_globs_packages_only(tmp_path):
    _write_safetensors(_package(tmp_path, "alpha") / "weights" / "a.safetensors", {"w": ([1], "F32")})
    _package(tmp_path, "apps")
    _write_safetensors(_package(tmp_path, "apps/ncal") / "weights" / "n.safetensors", {"w": ([1], "F32")})
    _write_safetensors(tmp_path / "runs" / "weights" / "not_a_package.safetensors", {"w": ([1], "F32")})
    _write_safetensors(tmp_path / ".venv" / "weights" / "hidden.safetensors", {"w": ([1], "F32")})
    found = [p.relative_to(tmp_path).as_posix() for p in discover_weights(tmp_path)]
    assert found == ["alpha/weights/a.safetensors", "apps/ncal/weights/n.safetensors"]


def test_write_check_and_cli(tmp_path):
    pkg = _package(tmp_path, "alpha")
    w = pkg / "weights" / "a.safetensors"
    _write_safetensors(w, {"w": ([2, 2], "F32")})
    w.with_suffix(".json").write_text(json.dumps({"name": "A", "steps": 1}))
    assert write_cards(tmp_path, check=True) == {w.with_suffix(".md"): "missing"}
    cli = [sys.executable, "-m", "core.infra.model_card", "--root", str(tmp_path)]
    r = subprocess.run(cli + ["--check"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "missing or stale" in r.stderr
    r = subprocess.run(cli, cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert write_cards(tmp_path, check=True) == {w.with_suffix(".md"): "ok"}
    w.with_suffix(".json").write_text(json.dumps({"name": "A", "steps": 2}))
    assert write_cards(tmp_path, check=True) == {w.with_suffix(".md"): "differs"}, "a changed JSON makes the card stale"
    assert write_cards(tmp_path) == {w.with_suffix(".md"): "written"}
    _write_safetensors(w, {"w": ([2, 3], "F32")})
    assert write_cards(tmp_path, check=True) == {w.with_suffix(".md"): "differs"}, "changed weights make the card stale"


def test_bad_inputs_are_refused(tmp_path):
    pkg = _package(tmp_path, "alpha")
    w = pkg / "weights" / "a.safetensors"
    _write_safetensors(w, {"w": ([1], "F32")})
    with pytest.raises(FileNotFoundError, match="a.json"):
        render_card(w, root=tmp_path)
    w.with_suffix(".json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        render_card(w, root=tmp_path)
    w.with_suffix(".json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        render_card(w, root=tmp_path)
    bad = pkg / "weights" / "bad.safetensors"
    bad.write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match="not a safetensors file"):
        weights_summary(bad)


def test_app_weights_and_the_json_own_card_text(tmp_path):
    """Weights of an app (apps/<app>/weights) are carded too; the JSON's `model_card` object supplies the use text."""
    _package(tmp_path, "apps")
    app = _package(tmp_path, "apps/newapp")
    (app / "README.md").write_text("# new app\n")
    w = app / "weights" / "clf.safetensors"
    _write_safetensors(w, {"w": ([3], "F32")})
    own = {"intended_use": "Classify essays in the demo.", "out_of_scope": "Grading real students.", "tags": ["text-classification"], "datasets": ["essays (local)"]}
    w.with_suffix(".json").write_text(json.dumps({"model": "C", "model_card": own}))
    text = render_card(w, root=tmp_path)
    assert "## Intended use\n\nClassify essays in the demo." in text
    assert "## Out-of-scope use\n\nGrading real students." in text
    assert '- "newapp"' in text and '- "text-classification"' in text and '- "essays (local)"' in text
    assert "[the package README](../README.md)" in text
    assert "Weights `apps/newapp/weights/clf.safetensors`" in text
