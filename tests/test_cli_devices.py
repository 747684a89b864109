"""Every real-model CLI takes ``--device auto|cpu|cuda|...`` and ``--dtype auto|...`` (core.infra.device): a device
this machine lacks is one line on stderr and exit 2, before any work (no torch traceback, no output written)."""

from __future__ import annotations

import importlib

import pytest
import torch

from core.infra.cli import run_cli

# module -> the least arguments its parser needs besides --device (paths need not exist: the device is checked first)
REAL_MODEL_CLIS = {
    "video.recipes.instructblip_video": ["--model", "m", "--videos", "v", "--questions", "q.json"],
    "apps.emloc.recipes.qwen2vl": ["--model", "m", "--data", "d.csv"],
    "apps.comemo.recipes.internvl": ["--model", "m", "--data", "d"],
    "apps.comemo.predict": ["--model", "m", "--images", "a.png", "--question", "q"],
    "tabular.predict": ["--checkpoint", "v2", "--train", "train.csv", "--test", "test.csv", "--target", "y"],
    "apps.ncal.train": ["--dataset", "tmwpl"],
    "apps.ncal.recipes.llm": ["--model", "m", "--dataset", "tmwpl"],
    "apps.ncal.evaluate": ["--checkpoint", "tmwpl", "--data", "tmwpl"],
    "apps.ncal.predict": ["--checkpoint", "tmwpl", "--text", "a question"],
    "apps.emloc.cli": ["--memory", "m/model.safetensors", "--images", "a.png", "--model", "m"],
    "video.batch": ["--model", "hf:m", "--videos", "d"],
}
# training and feature-extraction CLIs: --device only (they train in float32 / their own mixed precision)
DEVICE_ONLY_CLIS = {
    "apps.comemo.train": ["--variant", "comemo", "--stage", "1"],
    "tabular.pretrain": [],
    "apps.ncal.pretrain": [],
    "pathology.train": ["--features", "d", "--labels", "labels.csv"],
    "pathology.batch": ["--slides", "d"],
}
# `python -m apps.emloc.predict` runs apps.emloc.cli's predict entry (the module name shadows a function)
ENTRIES = {"apps.emloc.cli": ("predict_main", "build_predict_parser")}
WRITES_NO_OUT = {"apps.comemo.predict", "apps.ncal.predict", "apps.emloc.cli"}  # answers on stdout: no --out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
@pytest.mark.parametrize("module", sorted(REAL_MODEL_CLIS) + sorted(DEVICE_ONLY_CLIS))
def test_missing_gpu_is_one_line_exit_2(module, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # inputs that exist, so a command that checks its paths first still reaches the device check
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "data.jsonl").write_text('{"images": ["a.png"], "question": "q", "answer": "a"}\n')
    (tmp_path / "a.png").write_bytes(b"")
    main = getattr(importlib.import_module(module), ENTRIES.get(module, ("main",))[0])
    out = [] if module in WRITES_NO_OUT else ["--out", str(tmp_path / "out")]
    (tmp_path / "labels.csv").write_text("slide_id,label\na,0\n")
    argv = [*{**REAL_MODEL_CLIS, **DEVICE_ONLY_CLIS}[module], *out, "--device", "cuda"]
    assert run_cli(main, argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0] and "--device" in err[0], err
    assert not (tmp_path / "out").exists(), "nothing may be written before the device is checked"


@pytest.mark.parametrize("module", sorted(REAL_MODEL_CLIS))
def test_device_and_dtype_options_are_the_shared_ones(module):
    p = getattr(importlib.import_module(module), ENTRIES.get(module, (0, "build_parser"))[1])()
    actions = {a.dest: a for a in p._actions}
    assert actions["device"].default == "auto" and actions["dtype"].default == "auto"
    with pytest.raises(SystemExit):
        p.parse_args([*REAL_MODEL_CLIS[module], "--dtype", "int8"])


@pytest.mark.parametrize("module", sorted(DEVICE_ONLY_CLIS))
def test_training_clis_take_the_shared_device_option(module):
    p = getattr(importlib.import_module(module), ENTRIES.get(module, (0, "build_parser"))[1])()
    actions = {a.dest: a for a in p._actions}
    assert actions["device"].default == "auto"
    with pytest.raises(SystemExit):
        p.parse_args([*DEVICE_ONLY_CLIS[module], "--out", "o", "--device", "gpu0"])
