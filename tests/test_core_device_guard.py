"""core.infra.device (one device/dtype convention) and core.infra.guard (the output guard)."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from core.infra.cli import UsageError, run_cli
from core.infra.device import add_device_options, device_from_args, resolve_device, resolve_dtype
from core.infra.guard import check_output, check_ship_run, shipped_owner, shipped_weights_dirs


def test_auto_device_and_dtype_follow_the_machine():
    dev = resolve_device("auto")
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("bf16", "cpu") is torch.bfloat16
    assert resolve_dtype(torch.float16) is torch.float16


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_missing_gpu_is_one_line_exit_2(capsys):
    with pytest.raises(UsageError, match="no CUDA GPU"):
        resolve_device("cuda")

    def main(argv):
        p = argparse.ArgumentParser()
        add_device_options(p)
        device_from_args(p.parse_args(argv))

    assert run_cli(main, ["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0]


def test_bad_spellings_are_refused():
    with pytest.raises(UsageError):
        resolve_device("gpu")
    with pytest.raises(UsageError):
        resolve_dtype("float8")
    p = argparse.ArgumentParser()
    add_device_options(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--dtype", "int8"])


def test_shipped_folders_are_found_and_refused(tmp_path):
    shipped = shipped_weights_dirs()
    assert {"rl", "tabular", "apps.ncal"} <= set(shipped)
    target = shipped["rl"] / "new.safetensors"
    assert shipped_owner(target) == "rl"
    with pytest.raises(UsageError, match="shipped weights of rl"):
        check_output(target)
    check_output(target, ship="rl")  # rl.ship may
    with pytest.raises(UsageError):
        check_output(target, ship="tabular")
    # a link into a shipped folder is followed
    link = tmp_path / "link"
    os.symlink(shipped["tabular"], link)
    with pytest.raises(UsageError, match="tabular"):
        check_output(link / "x.json")
    check_output(tmp_path / "out.json")


def test_output_equal_to_an_input_is_refused(tmp_path):
    data = tmp_path / "x.jsonl"
    data.write_text("{}\n")
    with pytest.raises(UsageError, match="also an input"):
        check_output(tmp_path / "." / "x.jsonl", inputs=[data])
    check_output(tmp_path / "y.jsonl", inputs=[data, None])


def test_ship_run_inside_destination_is_refused(tmp_path):
    dest = tmp_path / "weights" / "tmwpl"
    with pytest.raises(UsageError):
        check_ship_run(dest, dest)
    with pytest.raises(UsageError):
        check_ship_run(dest / "sub", dest)
    check_ship_run(tmp_path / "runs" / "a", dest)
