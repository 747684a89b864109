"""``benchmarks.video_realsize`` end to end at tiny sizes (the real-size run itself is in benchmarks/results)."""

from __future__ import annotations

import json

import pytest

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
