"""Multi-input commands keep partial success: the good inputs are answered and written, each bad one is named on one
line of stderr, the exit code is 1 (2 when nothing could be used); an output path that cannot be written is
refused with exit code 2 before any work runs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from core.infra.cli import run_cli

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _error_lines(err: str) -> list[str]:
    """The ``error:`` lines of stderr (progress bars redraw with carriage returns)."""
    return [line for line in re.split(r"[\r\n]", err) if line.startswith("error:")]


def _assert_named(err: str, names: list[str], n_errors: int | None = None) -> None:
    assert "Traceback" not in err
    lines = _error_lines(err)
    for name in names:
        assert sum(name in line for line in lines) == 1, (name, lines)
    if n_errors is not None:
        assert len(lines) == n_errors, lines


def _no_call(name: str):
    def spy(*args, **kwargs):
        raise AssertionError(f"{name} ran: the command should have stopped before it")

    return spy


# ----------------------------------------------------------------------------------------------- output checks


def test_check_writable_refuses_what_cannot_be_written(tmp_path):
    from core.infra.fileio import check_writable

    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    for path, folder, msg in [
        ("", False, "is empty"),
        ("  ", True, "is empty"),
        (tmp_path / "adir", False, "is a folder"),
        (tmp_path / "afile", True, "is a file"),
        (tmp_path / "afile" / "sub" / "r.json", False, "is a file, not a folder"),
        ("/dev/null", False, "not a regular file"),
        ("/proc/longctx-results.json", False, "cannot be written"),
    ]:
        with pytest.raises(ValueError, match=msg):
            check_writable(path, what="--json", folder=folder)
    new = tmp_path / "new" / "sub" / "r.json"
    assert check_writable(new, what="--json") == new
    assert check_writable(tmp_path / "afile", what="--json") == tmp_path / "afile"  # replacing a file is fine
    assert check_writable(tmp_path / "out", what="--out", folder=True) == tmp_path / "out"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]  # the check creates nothing


# ----------------------------------------------------------------------------------------------- apps.emloc


@pytest.fixture(scope="module")
def emloc_memory(tmp_path_factory):
    from apps.emloc import EMLoCHost, HostConfig, compress
    from apps.emloc.data import make_episode

    root = tmp_path_factory.mktemp("emloc_partial")
    torch.manual_seed(0)
    host = EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).eval()
    host.save(root / "host.safetensors")
    ep = make_episode(7, num_demos=8, num_queries=2, split="eval")
    compress(host, (ep.demo_images, ep.demo_labels), delta=0.01, chunk_demos=4).save(root / "memory.safetensors")
    return root, ep


def test_emloc_predict_answers_the_good_images_and_names_the_bad(emloc_memory, tmp_path, capsys):
    from PIL import Image

    from apps.emloc.cli import predict_main

    root, ep = emloc_memory
    good_npy, good_png = tmp_path / "q0.npy", tmp_path / "q1.png"
    np.save(good_npy, ep.query_images[0].numpy())
    Image.fromarray((ep.query_images[1].clamp(0, 1).numpy() * 255).astype(np.uint8)).save(good_png)
    corrupt, missing, empty = tmp_path / "corrupt.png", tmp_path / "missing.png", tmp_path / "empty_folder"
    corrupt.write_bytes(b"not a png")
    empty.mkdir()
    base = ["--memory", str(root / "memory.safetensors"), "--model", str(root / "host.safetensors"),
            "--batch-size", "2"]
    images = [good_npy, corrupt, missing, empty, good_png]
    assert run_cli(predict_main, base + ["--images", *map(str, images)]) == 1
    res = capsys.readouterr()
    out = [json.loads(line) for line in res.out.splitlines()]
    assert [o["image"] for o in out] == [str(good_npy), str(good_png)]
    assert all(o["label"] in ep.label_ids.tolist() and abs(sum(o["scores"].values()) - 1) < 1e-3 for o in out)
    _assert_named(res.err, [str(corrupt), str(missing), str(empty)], n_errors=4)  # 3 inputs + the summary
    assert "accepted:" in _error_lines(res.err)[0]

    assert run_cli(predict_main, base + ["--images", str(corrupt), str(missing)]) == 2  # nothing could be read
    res = capsys.readouterr()
    assert res.out == ""
    _assert_named(res.err, [str(corrupt), str(missing)])


def test_emloc_compress_refuses_a_bad_out_before_compressing(emloc_memory, tmp_path, monkeypatch, capsys):
    import apps.emloc.cli as cli

    root, _ = emloc_memory
    demos = tmp_path / "demos" / "3"
    demos.mkdir(parents=True)
    np.save(demos / "a.npy", np.random.default_rng(0).random((8, 8)))
    monkeypatch.setattr(cli, "compress", _no_call("compress"))
    (tmp_path / "taken").mkdir()
    assert run_cli(cli.compress_main, ["--demos", str(tmp_path / "demos"), "--out", str(tmp_path / "taken"),
                                       "--model", str(root / "host.safetensors")]) == 2
    _assert_named(capsys.readouterr().err, ["--out"], n_errors=1)


# ----------------------------------------------------------------------------------------------- pathology


def test_pathology_predict_writes_the_good_slides_and_names_the_bad(tmp_path, capsys):
    from pathology.predict import main

    sample = ROOT / "pathology" / "samples" / "sample_normal.tiff"
    first, same_name = tmp_path / "a" / sample.name, tmp_path / "b" / sample.name
    for p in (first, same_name):
        p.parent.mkdir()
        shutil.copyfile(sample, p)
    corrupt, missing = tmp_path / "corrupt.tiff", tmp_path / "missing.svs"
    corrupt.write_bytes(b"not a slide at all")
    out = tmp_path / "out" / "pred"  # a missing folder on the way is created
    slides = [first, corrupt, same_name, missing]
    code = run_cli(main, [*map(str, slides), "--out", str(out)])
    err = capsys.readouterr().err
    res = json.loads((out / "sample_normal.json").read_text())
    assert res["slide"] == str(first)  # the second file of the same name did not replace the first's outputs
    assert set(res["probabilities"]) == {"no lesion", "lesion"} and res["n_patches"] > 0
    assert sorted(p.name for p in out.iterdir()) == ["sample_normal.json", "sample_normal_heatmap.png",
                                                     "sample_normal_overview.png"]
    assert code == 1
    _assert_named(err, [str(corrupt), str(missing), str(same_name)], n_errors=4)

    assert run_cli(main, [str(corrupt), str(missing), "--out", str(tmp_path / "out2")]) == 2  # none could be read
    _assert_named(capsys.readouterr().err, [str(corrupt), str(missing)])


def test_pathology_predict_refuses_a_bad_out_before_any_slide(tmp_path, monkeypatch, capsys):
    import pathology.inference as inference
    from pathology.predict import main

    monkeypatch.setattr(inference, "analyze_slide", _no_call("analyze_slide"))
    monkeypatch.setattr(inference, "load_slide_model", _no_call("load_slide_model"))
    (tmp_path / "afile").write_text("x")
    sample = str(ROOT / "pathology" / "samples" / "sample_normal.tiff")
    for out in ("", str(tmp_path / "afile"), str(tmp_path / "afile" / "sub")):
        assert run_cli(main, [sample, "--out", out]) == 2
        _assert_named(capsys.readouterr().err, ["--out"], n_errors=1)


# ----------------------------------------------------------------------------------------------- apps.comemo


def test_comemo_predict_names_every_bad_image_and_answers_nothing(tmp_path, capsys):
    from PIL import Image

    from apps.comemo.predict import main

    good = tmp_path / "good.png"
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (32, 32, 3), dtype=np.uint8)).save(good)
    text, missing = tmp_path / "text.png", tmp_path / "missing.png"
    text.write_text("hello")
    # one prompt: an answer without one of its images would answer another question
    assert run_cli(main, ["--question", "which image shows a digit ?",
                          "--images", str(good), str(text), str(missing)]) == 2
    res = capsys.readouterr()
    assert res.out == ""
    _assert_named(res.err, [str(text), str(missing)], n_errors=3)
    assert str(good) not in res.err


# ----------------------------------------------------------------------------------------------- apps.ncal


def test_ncal_predict_classifies_the_good_rows_and_names_the_bad(tmp_path, capsys):
    from apps.ncal.predict import classify, main

    test_split = (ROOT / "apps" / "ncal" / "data" / "PMTD_test.jsonl").read_text(encoding="utf-8")
    rows = [json.loads(line) for line in test_split.splitlines()[:2]]
    p = tmp_path / "rows.jsonl"
    p.write_text(json.dumps(rows[0], ensure_ascii=False) + "\n"
                 + '{"dialog_content": "好的。"}\n'  # line 2: no dialog_history
                 + "not json\n"  # line 3
                 + "\n"  # blank lines are skipped
                 + json.dumps(rows[1], ensure_ascii=False) + "\n", encoding="utf-8")
    assert run_cli(main, ["--checkpoint", "pmtd", "--rows", str(p), "--json"]) == 1
    res = capsys.readouterr()
    out = json.loads(res.out)
    assert len(out) == 4 and out[1] is None and out[2] is None  # one entry per row, null where it failed
    want = classify("pmtd", rows)
    for got, exp in zip((out[0], out[3]), want):
        assert got.keys() == exp.keys() and all(abs(got[c] - exp[c]) < 1e-6 for c in got)
    _assert_named(res.err, ["rows.jsonl line 2", "rows.jsonl line 3"], n_errors=3)

    assert run_cli(main, ["--checkpoint", "pmtd", "--text", "老师好。", "--text", "   ", "--json"]) == 1
    res = capsys.readouterr()
    out = json.loads(res.out)
    assert out[1] is None and abs(sum(out[0].values()) - 1) < 1e-4
    _assert_named(res.err, ["--text 2"], n_errors=2)


def test_ncal_evaluate_refuses_a_bad_out_before_evaluating(tmp_path, monkeypatch, capsys):
    import apps.ncal.evaluate as ev

    monkeypatch.setattr(ev, "evaluate_checkpoint", _no_call("evaluate_checkpoint"))
    (tmp_path / "adir").mkdir()
    for out in (str(tmp_path / "adir"), ""):
        assert run_cli(ev.main, ["--checkpoint", "pmtd", "--data", "pmtd", "--out", out]) == 2
        _assert_named(capsys.readouterr().err, ["--out"], n_errors=1)


# ----------------------------------------------------------------------------------------------- rl.evaluate


def _shipped_policy() -> str:
    from rl.evaluate import shipped_policies

    return str(shipped_policies()["dm_hopper"])


def test_rl_evaluate_refuses_a_bad_json_before_evaluating(tmp_path, monkeypatch, capsys):
    import rl.evaluate as ev

    monkeypatch.setattr(ev, "evaluate_returns", _no_call("evaluate_returns"))
    monkeypatch.setattr(ev, "rollout", _no_call("rollout"))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    base = ["--checkpoint", _shipped_policy(), "--episodes", "1", "--target-return", "100"]
    for opt, path in [("--json", str(tmp_path / "adir")), ("--json", str(tmp_path / "afile" / "r.json")),
                      ("--json", ""), ("--video", str(tmp_path / "adir"))]:
        assert run_cli(ev.main, base + [opt, path]) == 2
        _assert_named(capsys.readouterr().err, [opt], n_errors=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]


def test_rl_evaluate_keeps_the_targets_that_succeeded(tmp_path, monkeypatch, capsys):
    import rl.evaluate as ev

    real = ev.evaluate_returns

    def flaky(model, env_id, *, target_return, **kw):
        if target_return == 200.0:
            raise RuntimeError("MuJoCo simulation became unstable")
        return real(model, env_id, target_return=target_return, **kw)

    monkeypatch.setattr(ev, "evaluate_returns", flaky)
    out = tmp_path / "new" / "eval.json"
    args = ["--checkpoint", _shipped_policy(), "--episodes", "1", "--batch", "1", "--json", str(out),
            "--target-return", "100", "--target-return", "200"]
    assert run_cli(ev.main, args) == 1
    res = capsys.readouterr()
    _assert_named(res.err, ["target 200"], n_errors=2)
    rec = json.loads(out.read_text())
    assert [r["target_return"] for r in rec["results"]] == [100.0] and len(rec["results"][0]["returns"]) == 1
    assert rec["failed"] == [{"target_return": 200.0, "error": "MuJoCo simulation became unstable"}]
    assert "target 100" in res.out
