"""``benchmarks.video_realsize`` end to end at tiny sizes (the real-size run itself is in benchmarks/results)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")


@pytest.mark.slow  # two fresh processes each build a model (about 15 s on an idle core)
def test_realsize_benchmark_streams_in_fresh_processes_and_keeps_other_lengths(tmp_path):
    from benchmarks import video_realsize as V

    out = tmp_path / "r.json"
    assert V.main(["--tiny", "--frames", "40", "--out", str(out), "--device", "cpu"]) == 0
    res = json.loads(out.read_text())
    (case,) = res["cases"]
    assert case["status"] == "ok" and case["frames_read"] == 40 and case["chunks"] == 3  # 16 + 16 + 8 (padded)
    assert case["finite"] and case["features"] == [1, 16 * 32, 32] and case["memory_state_bytes"] > 0
    assert case["parameters"]["qformer"] > 0 and case["ms_per_frame_cpu"] > 0
    assert V.main(["--tiny", "--frames", "20", "--out", str(out), "--device", "cpu"]) == 0  # another length: kept
    assert [c["frames"] for c in json.loads(out.read_text())["cases"]] == [20, 40]
    assert "| 20 |" in out.with_suffix(".md").read_text()



@pytest.mark.parametrize("argv", [["--device", "gpu0"], ["--dtype", "int8"]])
def test_a_misspelt_device_or_dtype_is_refused_by_the_parser(argv):
    from benchmarks import video_realsize as V

    with pytest.raises(SystemExit) as e:
        V.build_parser().parse_args(["--tiny", *argv])
    assert e.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_a_missing_gpu_is_one_line_and_exit_2(tmp_path, capsys):
    from benchmarks import video_realsize as V
    from core.infra.cli import run_cli

    assert run_cli(V.main, ["--tiny", "--device", "cuda", "--out", str(tmp_path / "r.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no CUDA GPU" in err[0], err
    assert not (tmp_path / "r.json").exists()
