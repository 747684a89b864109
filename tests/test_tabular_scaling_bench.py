"""benchmarks.tabular_scaling: the memory slope it reports, a small case with its progress file, merging runs."""

from __future__ import annotations

import json
import logging

import pytest

from benchmarks.tabular_scaling import _case, _merge, build_parser, slope

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_slope_of_a_line_and_of_noisy_points():
    s = slope([1_000, 10_000, 100_000], [105.0, 150.0, 600.0])  # 100 MB + 5 MB per 1K rows
    assert s["mb_per_1k_rows"] == pytest.approx(5.0) and s["intercept_mb"] == pytest.approx(100.0)
    assert s["r2"] == pytest.approx(1.0) and s["points"] == 3
    noisy = slope([1_000, 10_000, 100_000], [105.0, 190.0, 600.0])
    assert noisy["r2"] < 1.0


def test_a_case_records_each_predicted_view_in_its_progress_file(tmp_path):
    prog = tmp_path / "p.jsonl"
    level = logging.getLogger("tabular.estimator").level
    res = _case(300, 5, n_estimators=2, threads=1, memory_mb=512, test_rows=40, progress=prog)
    assert res["status"] == "ok" and res["rows"] == 300 and res["folds"] == 1 and res["cached_contexts"] >= 1
    assert 0.0 <= res["accuracy"] <= 1.0 and res["peak_rss_mb"] > 0
    steps = [json.loads(line) for line in prog.read_text().splitlines()]
    first = [s["msg"] for s in steps if s["phase"] == "first predict"]
    assert first[0] == "fit done" and first[-1].startswith("predict 40 rows: 2/2 views, fold 1/1")
    repeat = [s["msg"] for s in steps if s["phase"] == "repeat predict"]
    assert repeat and all("context cached" in m for m in repeat)  # the second call reads the kept context
    assert logging.getLogger("tabular.estimator").level == level  # the progress handler is removed after the case
    assert res["contexts_not_kept"] == 0
    full = _case(300, 5, n_estimators=2, threads=1, memory_mb=0.5, test_rows=40)  # no room for a context
    assert full["status"] == "ok" and full["cached_contexts"] == 0 and full["contexts_not_kept"] >= 1


def test_merging_runs_with_different_settings_is_refused(tmp_path):
    def run(threads, rows):
        return {"env": {"time_utc": "t"}, "args": {"n_estimators": 4, "memory_mb": 4096.0, "test_rows": 1000,
                                                   "threads": threads},
                "cases": [{"status": "ok", "rows": rows, "features": 20, "peak_rss_mb": rows / 100, "folds": 1,
                           "predict_peak_growth_mb": rows / 200, "cache_mb": 1.0, "cached_contexts": 1,
                           **dict.fromkeys(("fit_s", "fit_cpu_s", "predict_s", "predict_cpu_s", "repeat_predict_s",
                                            "repeat_predict_cpu_s"), 1.0)}]}

    a, b, c = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "c.json"
    a.write_text(json.dumps(run(1, 1000)))
    b.write_text(json.dumps(run(2, 10000)))
    c.write_text(json.dumps(run(1, 10000)))
    out = tmp_path / "m.json"
    with pytest.raises(ValueError, match="differ in threads"):
        _merge(build_parser().parse_args(["--merge", str(a), str(b), "--out", str(out)]))
    assert _merge(build_parser().parse_args(["--merge", str(a), str(c), "--out", str(out)])) == 0
    merged = json.loads(out.read_text())
    assert [r["rows"] for r in merged["cases"]] == [1000, 10000]
    assert merged["peak_mb_per_1k_rows"]["20"]["peak_rss (all)"]["mb_per_1k_rows"] == pytest.approx(10.0)
    assert out.with_suffix(".md").exists()
