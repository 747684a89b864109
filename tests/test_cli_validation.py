"""Commands validate before acting: numeric options are range-checked when parsed, an empty --out is refused,
--resume with nothing to resume is refused, batch CLIs tell "some inputs failed" (1) from bad usage (2), a failed
video write leaves no temp file, a missing model-card root and an unresolvable demo host are one-line errors."""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import numpy as np
import pytest

from core.infra.cli import DEBUG_ENV, run_cli

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_debug(monkeypatch):
    monkeypatch.delenv(DEBUG_ENV, raising=False)


def _usage_error(parse, argv, capsys) -> str:
    """argparse's usage error (exit 2) for ``argv``; returns its ``error:`` line."""
    with pytest.raises(SystemExit) as e:
        parse(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and "error: argument" in lines[-1], lines
    return lines[-1]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_shared_argparse_types_accept_their_range_and_name_what_is_wrong():
    from core.infra.cli import (finite_float, fraction, nonempty_path, nonempty_path_obj, nonnegative_float,
                                nonnegative_int, open_fraction, port, positive_float, positive_int)

    assert positive_int("3") == 3 and nonnegative_int("0") == 0 and port("65535") == 65535
    assert positive_float("1e-4") == 1e-4 and nonnegative_float("0") == 0.0 and finite_float("-2.5") == -2.5
    assert fraction("0") == 0.0 and fraction("1") == 1.0 and open_fraction("0.25") == 0.25
    assert nonempty_path("runs/a") == "runs/a" and nonempty_path_obj("runs/a") == Path("runs/a")
    bad = [(positive_int, "0", ">= 1"), (positive_int, "-2", ">= 1"), (positive_int, "1.5", "integer"),
           (nonnegative_int, "-1", ">= 0"), (positive_float, "0", "> 0"), (positive_float, "nan", "finite"),
           (positive_float, "inf", "finite"), (positive_float, "x", "number"), (nonnegative_float, "-0.1", ">= 0"), (finite_float, "nan", "finite"),
           (fraction, "1.01", "[0, 1]"), (fraction, "-0.5", "[0, 1]"), (open_fraction, "0", "(0, 1)"),
           (open_fraction, "1", "(0, 1)"), (port, "0", "1..65535"), (port, "65536", "1..65535"),
           (nonempty_path, "", "path"), (nonempty_path, "  ", "path"), (nonempty_path_obj, "", "path")]  # fmt: skip
    for fn, text, says in bad:
        with pytest.raises(argparse.ArgumentTypeError, match=rf"{__import__('re').escape(says)}"):
            fn(text)


# (module, option, bad value, what the message says): every one refused when parsed, before any work.
_BAD_OPTIONS = [
    ("pathology.train_encoder", "--steps", "0", ">= 1"),
    ("pathology.train_encoder", "--lr", "0", "> 0"),
    ("pathology.train_encoder", "--threads", "0", ">= 1"),
    ("pathology.train_encoder", "--save-every", "0", ">= 1"),
    ("rl.train", "--batch-size", "0", ">= 1"),
    ("rl.train", "--lr", "-1e-4", "> 0"),
    ("rl.train", "--eval-episodes", "-1", ">= 0"),
    ("rl.train", "--capacity", "1.5", "[0, 1]"),
    ("rl.generate", "--steps", "0", ">= 1"),
    ("rl.tune", "--val-fraction", "1", "(0, 1)"),
    ("rl.tune", "--batch-size", "0", ">= 1"),
    ("video.train", "--batch-size", "0", ">= 1"),
    ("video.train", "--alpha", "2", "[0, 1]"),
    ("video.synthetic", "--n", "0", ">= 1"),
    ("pathology.train", "--epochs", "0", ">= 1"),
    ("pathology.train", "--val-fraction", "-0.1", "[0, 1]"),
    ("pathology.train", "--threads", "-1", ">= 0"),
    ("pathology.train_demo", "--test-fraction", "0", "(0, 1)"),
    ("pathology.synthetic", "--mpp", "0", "> 0"),
    ("pathology.batch", "--batch-size", "0", ">= 1"),
    ("tabular.pretrain", "--lr", "0", "> 0"),
    ("tabular.pretrain", "--p-factor", "2", "[0, 1]"),
    ("apps.ncal.train", "--batch-size", "0", ">= 1"),
    ("apps.ncal.train", "--valid-frac", "1.5", "[0, 1]"),
    ("apps.ncal.pretrain", "--epochs", "0", "> 0"),
    ("apps.comemo.train", "--lr", "0", "> 0"),
    ("apps.comemo.train", "--dim", "0", ">= 1"),
    ("apps.emloc.train", "--batch-size", "0", ">= 1"),
    ("apps.emloc.train", "--eval-every", "0", ">= 1"),
    ("video.batch", "--chunk-size", "0", ">= 1"),
]


def test_numeric_options_are_range_checked_at_parse_time(tmp_path, capsys):
    """pathology.train_encoder --batch 0 used to train on nothing (loss nan), exit 0 and save a model and card."""
    from pathology.train_encoder import main

    out = tmp_path / "enc"
    small = ["--out", str(out), "--steps", "1", "--slides", "1", "--val-slides", "1", "--per-slide", "2",
             "--size", "512", "--input-size", "16", "--dim", "8", "--widths", "4,4,4,4,4"]  # fmt: skip
    line = _usage_error(main, [*small, "--batch", "0"], capsys)
    assert "argument --batch: must be >= 1, got 0" in line
    assert not out.exists()  # refused before the output folder, the tile bank or a model
    for module, option, value, says in _BAD_OPTIONS:
        parser = importlib.import_module(module).build_parser()
        line = _usage_error(parser.parse_args, [f"{option}={value}"], capsys)  # "=": a negative value is no option
        assert f"argument {option}: " in line and says in line, (module, line)


_OUT_PARSERS = [
    ("video.synthetic", "build_parser"), ("video.batch", "build_parser"), ("video.train", "build_parser"),
    ("pathology.train_encoder", "build_parser"), ("pathology.train", "build_parser"),
    ("pathology.train_demo", "build_parser"), ("pathology.synthetic", "build_parser"),
    ("pathology.batch", "build_parser"), ("rl.train", "build_parser"),
    ("rl.generate", "build_parser"), ("rl.tune", "build_parser"), ("rl.sac", "build_parser"),
    ("rl.policies", "build_parser"), ("rl.references", "build_parser"), ("rl.ship", "build_parser"),
    ("tabular.pretrain", "build_parser"), ("apps.ncal.train", "build_parser"), ("apps.ncal.pretrain", "build_parser"),
    ("apps.ncal.ship", "build_parser"), ("apps.comemo.train", "build_parser"),
    ("apps.comemo.vision_pretrain", "build_parser"), ("apps.comemo.synthetic", "build_parser"),
    ("apps.emloc.train", "build_parser"), ("apps.emloc.cli", "build_compress_parser"),
]  # fmt: skip
# (pathology.predict and apps.ncal.evaluate refuse an empty --out in main: tests/test_partial_success.py)


def test_an_empty_out_is_refused(tmp_path, monkeypatch, capsys):
    """video.synthetic --out '' and video.batch --out '' used to write into the current folder and exit 0."""
    from video import batch as video_batch
    from video import synthetic as video_synthetic

    monkeypatch.chdir(tmp_path)
    line = _usage_error(video_synthetic.main, ["--out", "", "--n", "1", "--frames", "64", "--size", "16"], capsys)
    assert "argument --out: must be a path" in line
    (tmp_path / "videos").mkdir()
    line = _usage_error(video_batch.main, ["--videos", str(tmp_path / "videos"), "--out", " "], capsys)
    assert "argument --out: must be a path" in line
    assert sorted(os.listdir(tmp_path)) == ["videos"]  # nothing written into the current folder
    for module, builder in _OUT_PARSERS:
        parser = getattr(importlib.import_module(module), builder)()
        line = _usage_error(parser.parse_args, ["--out", ""], capsys)
        assert "argument --out: must be a path" in line, (module, line)


def test_resume_with_nothing_to_resume_is_refused(tmp_path, capsys):
    """rl.train --resume and apps.emloc.train --resume used to start afresh when the run folder held no checkpoint."""
    from apps.emloc.train import main as emloc_main
    from rl.train import main as rl_main

    run = tmp_path / "rl"
    code = run_cli(rl_main, ["--algo", "dm", "--dataset", str(tmp_path / "missing.npz"), "--steps", "2",
                             "--out", str(run), "--resume"])  # fmt: skip
    assert code == 2 and not run.exists()
    assert _one_error_line(capsys) == f"error: --resume given but {run / 'checkpoint.pt'} does not exist"

    tiny = ["--steps", "1", "--batch-size", "1", "--demos", "4", "--dim", "32", "--depth", "1", "--heads", "4",
            "--kv-heads", "2", "--eval-every", "1", "--eval-episodes", "1"]  # fmt: skip
    run = tmp_path / "emloc"
    assert run_cli(emloc_main, ["--out", str(run), *tiny, "--resume"]) == 2 and not run.exists()
    assert _one_error_line(capsys) == f"error: --resume given but {run / 'last.pt'} does not exist"
    # and, like tabular.pretrain and apps.comemo.train, a run folder holding a run is not restarted silently
    run.mkdir()
    (run / "last.pt").write_bytes(b"a run's state")
    assert run_cli(emloc_main, ["--out", str(run), *tiny]) == 2
    assert "exists: pass --resume" in _one_error_line(capsys)
    assert sorted(os.listdir(run)) == ["last.pt"] and (run / "last.pt").read_bytes() == b"a run's state"


def test_a_failed_video_write_leaves_no_temp_file(tmp_path, capsys):
    """video.synthetic --fps 0 used to leave a 0-byte hidden temp file (a ZeroDivisionError after mkstemp)."""
    pytest.importorskip("av")
    from video.synthetic import main, write_video

    out = tmp_path / "data"
    line = _usage_error(main, ["--out", str(out), "--n", "1", "--frames", "64", "--size", "16", "--fps", "0"], capsys)
    assert "argument --fps: must be > 0" in line and not out.exists()

    frames = np.random.default_rng().integers(0, 256, size=(4, 8, 8, 3), dtype=np.uint8)
    for fps in (0, -1.0, float("nan"), 1e-4):
        with pytest.raises(ValueError, match="fps"):
            write_video(tmp_path / "a.mp4", [frames], fps=fps)
    assert os.listdir(tmp_path) == []  # no temp file, no video, no output folder

    def broken():
        yield frames
        raise RuntimeError("decoder died")

    with pytest.raises(RuntimeError, match="decoder died"):
        write_video(tmp_path / "b.mp4", broken(), fps=10)
    assert os.listdir(tmp_path) == []


def test_model_card_check_refuses_a_missing_root(tmp_path, capsys):
    """python -m core.infra.model_card --check --root /no/such/folder used to exit 0 (no weights found: all fine)."""
    from core.infra.model_card.cli import main

    root = tmp_path / "no" / "such" / "folder"
    assert run_cli(main, ["--check", "--root", str(root)]) == 2
    line = _one_error_line(capsys)
    assert str(root) in line and "not a folder" in line
    assert not (tmp_path / "no").exists()


class _FakeVideo:
    def __init__(self, *args, **kwargs):
        pass


def test_batch_exit_codes_tell_failed_inputs_from_bad_usage(tmp_path, monkeypatch, capsys):
    """pathology.batch used exit 2 for both bad usage and "some slides failed"; now 1 is some inputs failed and 2 bad
    usage or input (a missing input folder, outputs made with other settings), as in video.batch."""
    from core.infra.jobs import SettingsMismatch
    from pathology import batch as pbatch
    from video import batch as vbatch

    slides, videos = tmp_path / "slides", tmp_path / "videos"
    slides.mkdir()
    videos.mkdir()
    monkeypatch.setattr("video.infinite.InfiniteVideo", _FakeVideo)  # no model: the job itself is replaced below
    cases = [(pbatch, "run_batch", ["--slides", str(slides)], lambda rows: rows),
             (vbatch, "_run", ["--videos", str(videos)], lambda rows: {r["key"]: r for r in rows})]  # fmt: skip
    for mod, job, inputs, shape in cases:
        out = str(tmp_path / f"out_{mod.__name__.split('.')[0]}")
        argv = [*inputs, "--out", out]
        rows = [{"key": "a", "status": "done"}, {"key": "b", "status": "failed"}]
        monkeypatch.setattr(mod, job, lambda *a, _rows=shape(rows), **k: _rows)
        assert run_cli(mod.main, [*argv, "--skip-errors"]) == 1, mod.__name__  # some inputs failed
        done = shape([{"key": "a", "status": "done"}, {"key": "b", "status": "exists"}])
        monkeypatch.setattr(mod, job, lambda *a, _rows=done, **k: _rows)
        assert run_cli(mod.main, argv) == 0, mod.__name__

        def refuse(*a, **k):
            raise SettingsMismatch("1 existing output(s) of 1 item(s) were made with other settings")

        monkeypatch.setattr(mod, job, refuse)
        capsys.readouterr()
        assert run_cli(mod.main, argv) == 2, mod.__name__  # refused before any work: bad usage
        assert "made with other settings" in _one_error_line(capsys)

        def first_failure(*a, **k):
            raise RuntimeError("slide b: decoder died")

        monkeypatch.setattr(mod, job, first_failure)
        assert run_cli(mod.main, argv) == 1, mod.__name__  # stopped at a failed input (no --skip-errors)
        missing = [inputs[0], str(tmp_path / "nope"), "--out", out]
        capsys.readouterr()
        assert run_cli(mod.main, missing) == 2, mod.__name__
        assert "not found" in _one_error_line(capsys)
    for readme, noun in (("pathology/README.md", "slides"), ("video/README.md", "videos")):
        text = (ROOT / readme).read_text(encoding="utf-8")
        assert f"Exit codes: 0 all done, 1 some {noun} failed" in text and "2 bad usage or input" in text


def test_demo_host_and_port_are_checked_before_anything_is_built(monkeypatch, capsys):
    """python -m apps --host no.such.host.invalid used to build every demo, then fail with "Cannot find empty port"."""
    import apps.hub as hub

    def built(*a, **k):
        raise AssertionError("the demo was built before the address was checked")

    monkeypatch.setattr(hub, "build_hub", built)
    monkeypatch.setattr(hub, "build_single", built)
    assert run_cli(hub.main, ["--host", "no.such.host.invalid"]) == 2
    line = _one_error_line(capsys)
    assert "--host 'no.such.host.invalid' does not resolve" in line
    for bad in ("0", "65536", "http"):
        with pytest.raises(SystemExit) as e:
            hub.main(["--port", bad])
        assert e.value.code == 2
        assert "argument --port:" in capsys.readouterr().err
    assert run_cli(lambda argv: hub.main(argv, app="ncal"), ["--host", "no.such.host.invalid"]) == 2
    assert "does not resolve" in _one_error_line(capsys)
