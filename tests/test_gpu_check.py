"""``benchmarks.gpu_check`` on the CPU: steps 1 (env) and 6 (dispatch) run, the GPU steps are recorded as
skipped, the report is written (and written again as each step ends); time boxes kill a step and keep the
rest; the pure parts (targets, JUnit counts, the numerics case matrix) against hand-made inputs."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.attention_gpu import evaluate_targets
from benchmarks.gpu_check_steps import EXTRA_CASES, NUMERICS_SHAPES, numerics_cases

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of gpu_check (a GPU runs it all)")


def _report(out):
    return json.loads((out / "gpu_check.json").read_text())


def test_cpu_run_writes_env_dispatch_and_the_skipped_steps(tmp_path, capsys):
    out = tmp_path / "check"
    assert gpu_check.main([str(out)]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    rep = _report(out)
    env = rep["steps"]["env"]
    assert env["status"] == "ok" and env["result"]["cuda_available"] is False
    assert env["result"]["torch"] == torch.__version__ and "triton" in env["result"]
    for name in gpu_check.GPU_STEPS:
        assert rep["steps"][name] == {"status": "skipped", "reason": "no CUDA device"}
    assert sorted(rep["skipped"]) == sorted(gpu_check.GPU_STEPS)
    disp = rep["steps"]["dispatch"]
    assert disp["status"] == "ok", disp
    choices = {c["case"]: c["choice_on_cuda"] for c in disp["cases"]}
    assert choices["decode S_q=1, 128K keys, GQA 4:1, padding"] == "sdpa"
    assert choices["prefill bf16 causal 8K, D 128"] == "triton"
    assert choices["fp32 causal 64K, D 64"] == "sdpa"
    assert all(c["ok"] for c in disp["cases"]) and len(disp["cases"]) >= 8
    budget, tile = disp["fallbacks"]
    assert budget["ok"] and budget["ran"] == ["chunked"] and budget["err"] < 1e-4
    assert tile == {"case": "triton tile that does not fit the GPU", "status": "skipped", "reason": "needs a CUDA device"}
    assert (out / disp["log"]).exists() and "finished_utc" in rep
    summary = (out / "summary.md").read_text()
    assert "| dispatch | ok |" in summary and "| numerics | skipped |" in summary


def test_a_step_past_its_time_box_is_killed_and_the_report_kept(tmp_path):
    out = tmp_path / "check"
    assert gpu_check.main([str(out), "--steps", "env,dispatch", "--box", "dispatch=0.3"]) == 0
    rep = _report(out)
    disp = rep["steps"]["dispatch"]
    assert disp["status"] == "timeout" and disp["box_s"] == 0.3 and disp["returncode"] != 0
    assert rep["steps"]["pytest"] == {"status": "skipped", "reason": "not selected (--steps)"}
    assert rep["steps"]["env"]["status"] == "ok"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown steps"):
        gpu_check.main([str(tmp_path), "--steps", "env,warp"])
    with pytest.raises(SystemExit, match="seconds must be a number"):
        gpu_check.main([str(tmp_path), "--box", "bench=soon"])


def test_numerics_matrix_is_complete_and_split_without_overlap():
    shards = [numerics_cases(i, gpu_check.NUMERICS_SHARDS) for i in range(gpu_check.NUMERICS_SHARDS)]
    flat = [c for s in shards for c in s]
    assert len(flat) == len(set(flat)) == 2 * 2 * 2 * (len(NUMERICS_SHAPES) + 1 + len(EXTRA_CASES))
    assert {c[3] for c in flat} == {"odd S", "S_q < S_k", "S_q > S_k", "S_q = 1", "GQA 8:1", "padded row", "block-sparse",
                                    *EXTRA_CASES}
    assert all(len({(c[0], c[1]) for c in s}) == 1 for s in shards)  # one (dtype, D) per process


def test_junit_counts_and_failures(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.test_kernels" name="test_a"/>'
        '<testcase classname="tests.test_kernels" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_kernels" name="test_c"><skipped/></testcase>'
        '<testcase classname="tests.test_kernels" name="test_d"/></testsuite></testsuites>'
    )
    got = gpu_check._junit_summary(xml)
    assert got["passed"] == 2 and got["failures"] == 1 and got["skipped"] == 1
    assert got["failed_tests"] == ["tests.test_kernels::test_b"]


def test_targets_from_measured_rows():
    """Forward ratio from the fwd rows, backward from (fwd+bwd) - fwd, block-sparse against the faster dense."""
    common = {"dtype": "bf16", "D": 128, "B": 1, "H": 16, "causal": False}
    dense = [
        {**common, "S": 4096, "mode": "fwd", "triton_ms": 1.0, "sdpa_flash_ms": 0.9,
         "triton_tflops": 100.0, "sdpa_flash_tflops": 125.0, "triton_vs_sdpa_flash": 0.8},
        {**common, "S": 4096, "mode": "fwd+bwd", "triton_ms": 4.0, "sdpa_flash_ms": 3.0},
        {**common, "S": 1024, "mode": "fwd", "triton_vs_sdpa_flash": 0.1},  # below 4K: not a target row
    ]  # fmt: skip
    sparse = [
        {"S": 65536, "density": 0.10, "mode": "fwd", "block": 64, "block_sparse_ms": 2.0,
         "triton_dense_ms": 9.0, "sdpa_flash_dense_ms": 8.0},
        {"S": 65536, "density": 0.10, "mode": "fwd", "block": 128, "block_sparse_ms": 1.5,
         "triton_dense_ms": 9.0, "sdpa_flash_dense_ms": 8.0},
    ]  # fmt: skip
    t = evaluate_targets(dense, sparse)
    assert t["fwd_min_ratio"] == 0.8 and t["fwd_met"] is True
    assert t["bwd_min_ratio"] == pytest.approx((3.0 - 0.9) / (4.0 - 1.0)) and t["bwd_met"] is True
    assert t["sparse_speedup_by_block"] == {64: 4.0, 128: pytest.approx(8.0 / 1.5)}
    assert t["sparse_met"] is True and t["sparse_S"] == 65536
    assert len(t["table"]) == 1 and t["table"][0]["bwd ratio"] == pytest.approx(0.7)
    slow = evaluate_targets([{**dense[0], "triton_vs_sdpa_flash": 0.5}], sparse[:1])
    assert slow["fwd_met"] is False and slow["bwd_met"] is None and slow["sparse_met"] is False


@pytest.mark.slow
def test_gpu_step_code_runs_on_the_cpu_interpreter(tmp_path):
    """Steps 3 and 4 only run where a GPU is lent, rarely: their code runs here on tiny fp16 shapes in Triton's
    interpreter (--dry-run), so a Python error there cannot wait for the GPU. Both children run at once."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    procs = {}
    for step in ("numerics", "int64"):
        part = tmp_path / f"{step}.json"
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", step, "--part", str(part), "--dry-run"]
        procs[step] = (part, subprocess.Popen(cmd, cwd=gpu_check.ROOT, env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
    for step, (part, proc) in procs.items():
        log, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, log[-3000:]
        rec = json.loads(part.read_text())
        assert rec["cases"] and all(c["ok"] for c in rec["cases"]), json.dumps(rec, indent=1)[:3000]
    numerics = json.loads((tmp_path / "numerics.json").read_text())
    assert {c["case"] for c in numerics["cases"]} == {*NUMERICS_SHAPES, "block-sparse", *EXTRA_CASES}
    assert numerics["interpreted"]
    padded = [c for c in numerics["cases"] if c["case"] == "padded row"]
    assert padded and all(c["padded_row_zero"] for c in padded)
    int64 = json.loads((tmp_path / "int64.json").read_text())
    assert [c["kernel"] for c in int64["cases"]] == ["flash", "block_sparse"]
    assert all(len(c["batches"]) == 3 for c in int64["cases"]) and int64["ok"]
