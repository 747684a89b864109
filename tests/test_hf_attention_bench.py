"""``benchmarks.hf_attention`` end to end at a tiny size: every implementation runs in its own process, the last-token
logits agree, ratios are filled in, bad arguments exit 2."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from benchmarks import hf_attention  # noqa: E402


def test_tiny_run_writes_rows_that_agree(tmp_path, capsys):
    out = tmp_path / "hf.json"
    assert hf_attention.main(["--sizes", "192", "--quick", "--threads", "1", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {(r["case"], r["impl"]) for r in rows} == {(c, i) for c in hf_attention.CASES for i in hf_attention.IMPLS}
    for r in rows:
        assert r["status"] == "ok", r
        assert r["max_abs_diff_vs_longctx"] < 1e-4  # the same model and inputs in every process
        assert r["median_s"] > 0 and r["peak_mb"] >= 0 and "last_logits" not in r
    ours = [r for r in rows if r["impl"] == "longctx"]
    assert all(r["time_ratio_longctx_over_this"] == 1 for r in ours)
    assert data["args"]["out"].endswith("hf.json") and "| 192 | 1 | padded | eager | ok |" in capsys.readouterr().out
    assert all(r["threads"] == 1 == r["torch_threads"] and r["load_before"] is not None for r in rows)


def test_thread_counts_each_run_and_ratios_stay_within_a_count(tmp_path):
    out = tmp_path / "hf.json"
    assert hf_attention.main(["--sizes", "128", "--cases", "padded", "--impls", "longctx", "--threads", "1,2",
                              "--repeats", "2", "--out", str(out)]) == 0  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [(r["threads"], r["impl"]) for r in rows] == [(1, "longctx"), (2, "longctx")]
    for r in rows:  # each thread count its own group: the ratio is against longctx at the same count
        assert r["torch_threads"] == r["threads"] and len(r["times_s"]) == 2
        assert r["time_ratio_longctx_over_this"] == 1


def test_eager_too_large_for_the_cap_is_skipped_with_its_reason(tmp_path):
    out = tmp_path / "hf.json"
    assert hf_attention.main(["--sizes", "64K", "--impls", "eager", "--cases", "padded", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["status"] == "skipped" and "over the 20 GiB cap" in row["reason"]


def test_bad_arguments_exit_2(tmp_path, capsys):
    for bad in (["--threads", "0"], ["--threads", "two"], ["--repeats", "0"]):
        with pytest.raises(SystemExit) as e:
            hf_attention.main([*bad, "--out", str(tmp_path / "x.json")])
        assert e.value.code == 2
    assert hf_attention.main(["--sizes", "4Q", "--out", str(tmp_path / "x.json")]) == 2
    assert hf_attention.main(["--impls", "flash", "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "bad size '4Q'" in err and "unknown case or implementation ['flash']" in err


def test_interleaved_timing_alternates_the_implementations_in_one_process():
    spec = {"impls": ["longctx", "sdpa"], "case": "padded", "S": 96, "device": "cpu", "dtype": "float32",
            "threads": 1, "repeats": 3}  # fmt: skip
    got = hf_attention.run_case(spec)["interleaved"]
    assert set(got) == {"longctx", "sdpa"}
    for r in got.values():
        assert len(r["times_s"]) == 3 and r["median_s"] == sorted(r["times_s"])[1] > 0
