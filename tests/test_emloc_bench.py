"""benchmarks.emloc_bench end to end on a tiny host: every policy gets rows, the summary is written, reruns resume."""

from __future__ import annotations

import json

import pytest
import torch

from apps.emloc import EMLoCHost, HostConfig

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_bench_tiny_run_and_resume(tmp_path, capsys):
    from benchmarks.emloc_bench import BASELINES, main

    torch.manual_seed(0)
    EMLoCHost(HostConfig(dim=32, depth=2, num_heads=4, num_kv_heads=2)).save(tmp_path / "h.safetensors")
    out = tmp_path / "b.json"
    argv = ["--model", str(tmp_path / "h.safetensors"), "--demos", "8", "--seeds", "0,1", "--episodes", "1",
            "--queries", "4", "--keep", "0.25,0.5", "--chunk-demos", "4", "--memory-demos", "8", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(out.read_text())
    policies = {r["policy"] for r in summary["table"]}
    assert policies == {"full", "emloc", *BASELINES}
    em = next(r for r in summary["table"] if r["policy"] == "emloc")
    assert len(em["js_per_layer"]) == 2 and all(j <= 0.005 + 1e-9 for j in em["js_per_layer"])
    assert em["seeds"] == 2
    snap = [r for r in summary["table"] if r["policy"] == "snapkv" and r["keep"] == 0.25]
    assert snap and abs(snap[0]["fraction"] - 0.25) < 0.03
    t = summary["targets"][0]
    assert t["K"] == 8 and 0 < t["emloc_fraction"] <= 1
    rows = out.with_suffix(".rows.jsonl").read_text().splitlines()
    assert main(argv) == 0  # resumed: nothing recomputed
    assert out.with_suffix(".rows.jsonl").read_text().splitlines() == rows
