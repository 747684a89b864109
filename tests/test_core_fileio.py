"""``core.infra.fileio``: atomic writes keep the old file on failure, leave no temp files, and make readable files."""

from __future__ import annotations

import json
import stat

import pytest

from core.infra.fileio import atomic_path, torch_save_atomic, write_json_atomic, write_text_atomic


def test_writes_are_complete_and_readable_by_others(tmp_path):
    a = write_text_atomic(tmp_path / "sub" / "a.txt", "hello")
    b = write_json_atomic(tmp_path / "b.json", {"x": 1})
    c = torch_save_atomic({"w": 1}, tmp_path / "c.pt")
    assert a.read_text() == "hello" and json.loads(b.read_text()) == {"x": 1} and c.stat().st_size > 0
    for p in (a, b, c):  # mkstemp's 0600 would hide results from other users of a shared checkout
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert sorted(q.name for q in tmp_path.rglob("*") if q.is_file()) == ["a.txt", "b.json", "c.pt"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    p = write_text_atomic(tmp_path / "r.json", "old")
    with pytest.raises(RuntimeError), atomic_path(p) as tmp:
        with open(tmp, "w") as f:
            f.write("half")
        raise RuntimeError("killed")
    with pytest.raises(TypeError):
        write_json_atomic(p, {"x": object()})
    assert p.read_text() == "old" and [q.name for q in tmp_path.iterdir()] == ["r.json"]
