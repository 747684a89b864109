"""The memory-isolating control's summary: per-seed paired differences by third, t-intervals over seeds, targets."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytest.importorskip("scipy")

from benchmarks.comemo_control import summarise, t_interval  # noqa: E402


def test_t_interval_matches_the_formula():
    vals = [0.1, 0.3, 0.2, 0.4, 0.0]
    mean, lo, hi = t_interval(vals)
    sd = math.sqrt(sum((v - 0.2) ** 2 for v in vals) / 4)
    assert mean == pytest.approx(0.2) and hi - mean == pytest.approx(2.776445 * sd / math.sqrt(5), rel=1e-5)
    assert lo == pytest.approx(2 * mean - hi) and t_interval([0.3]) is None


def _records(n, hits_by_third):
    """Needle records ``[position, exact, digit]``: 6 samples per third, the first ``k`` of a third right."""
    out = []
    for third, k in enumerate(hits_by_third):
        for j in range(6):
            pos = third * n // 3 + j
            out.append([pos, 0, int(j < k)])
    return out


def test_summary_pairs_arms_by_seed_and_reads_targets():
    n = 63
    results = {}
    for seed, (memory, frozen) in enumerate([((6, 5, 6), (6, 2, 6)), ((6, 4, 6), (6, 2, 6)), ((5, 5, 6), (6, 3, 6))]):
        results[("comemo", seed)] = {"needle_records": {str(n): _records(n, memory)}, "accuracy": {"needle": {}}}
        results[("frozen", seed)] = {"needle_records": {str(n): _records(n, frozen)}, "accuracy": {"needle": {}}}
    results[("comemo", 9)] = results[("comemo", 0)]  # no frozen twin for seed 9: not paired, not counted
    s = summarise(results, longest=n, trained=16)
    assert s["seeds"] == [0, 1, 2] and s["samples_per_third"] == [6, 6, 6]
    mid = s["over_seeds"]["digit"]["middle"]
    assert mid[0] == pytest.approx((3 + 2 + 2) / 3 / 6)
    assert mid[1] > 0 and s["targets"]["middle_gain_ge_0.10_with_interval_above_0"] is True
    first = s["over_seeds"]["digit"]["first"]
    assert first[0] == pytest.approx(-1 / 18)  # one seed loses one of six at the start
    assert s["targets"]["ends_within_2_points_or_better"] is False
    assert s["per_seed"]["digit"]["1"]["difference"] == pytest.approx([0.0, 2 / 6, 0.0])


def _pair_records(n, exact, digit):
    """``len(digit)`` records per count, evenly spread needles; the first ``exact`` / ``digit`` of them right."""
    k = 6
    return [[i * n // k, int(i < exact), int(i < digit)] for i in range(k)]


def test_dhr_vs_1d_differences_by_count_and_target_reading():
    from benchmarks.comemo_control import dhr_vs_1d

    results = {}
    # (exact, digit) hits of 6 per count: 8 is the trained count, 16 and 32 lie beyond it
    plan = {1: {"lvlm-1d": {8: (6, 6), 16: (0, 4), 32: (0, 2)}, "lvlm-dhr": {8: (5, 6), 16: (0, 5), 32: (1, 2)}},
            2: {"lvlm-1d": {8: (6, 6), 16: (0, 5), 32: (0, 3)}, "lvlm-dhr": {8: (6, 6), 16: (0, 3), 32: (0, 3)}},
            3: {"lvlm-1d": {8: (6, 6), 16: (0, 3), 32: (0, 1)}, "lvlm-dhr": {8: (6, 6), 16: (0, 4), 32: (0, 4)}}}
    for seed, arms in plan.items():
        for arm, counts in arms.items():
            results[(arm, seed)] = {"needle_records": {str(n): _pair_records(n, *h) for n, h in counts.items()},
                                    "accuracy": {"needle": {}}}
    results[("lvlm-dhr", 7)] = results[("lvlm-dhr", 1)]  # no lvlm-1d twin: not paired
    d = dhr_vs_1d(results, trained=8)
    assert d["seeds"] == [1, 2, 3]
    assert d["by_count"]["digit"]["16"]["per_seed"]["2"]["difference"] == pytest.approx(-2 / 6)
    assert d["by_count"]["exact"]["8"]["per_seed"]["1"]["difference"] == pytest.approx(-1 / 6)
    assert d["by_count"]["digit"]["32"]["over_seeds"][0] == pytest.approx((0 + 0 + 3) / 3 / 6)
    per = d["target"]["digit_beyond_trained"]["per_seed"]  # mean over 16 and 32 only, never over 8
    assert per == pytest.approx({"1": 0.5 / 6, "2": -1 / 6, "3": 2 / 6})
    assert d["target"]["digit_beyond_trained"]["counts"] == ["16", "32"]
    assert d["target"]["dhr_ge_1d_beyond_trained_length"] is True  # mean (0.5 - 1 + 2) / 18 >= 0
    assert d["by_third_at_longest"]["digit"]["count"] == "32"
    # lvlm-1d reading every digit: lvlm-dhr is behind beyond 8 in every seed, the reading flips
    for seed in plan:
        results[("lvlm-1d", seed)] = {"needle_records": {str(n): _pair_records(n, 6, 6) for n in (8, 16, 32)}}
    assert dhr_vs_1d(results, trained=8)["target"]["dhr_ge_1d_beyond_trained_length"] is False


def test_records_of_other_settings_or_grids_are_never_reused(tmp_path):
    import json

    from benchmarks.comemo_control import _all_results, _load_record, tag
    from core.infra.cli import UsageError

    assert tag("lvlm-dhr", (1, 1)) == "lvlm-dhr" and tag("lvlm-dhr", (1, 2)) == "lvlm-dhr_g1x2"
    settings = {"image_grid": "1x2", "steps": [20, 10, 100]}
    rec = {"settings": settings, "needle_records": {}, "accuracy": {"needle": {}}}
    (tmp_path / "lvlm-1d_g1x2_s1.json").write_text(json.dumps(rec))
    (tmp_path / "lvlm-1d_s2.json").write_text(json.dumps({"needle_records": {}}))  # one-tile record: other name
    assert list(_all_results(tmp_path, settings)) == [("lvlm-1d", 1)]
    with pytest.raises(UsageError, match="steps"):
        _load_record(tmp_path / "lvlm-1d_g1x2_s1.json", {**settings, "steps": [20, 10, 200]})
    with pytest.raises(UsageError, match="image_grid"):  # an older record (no settings) holds one tile per image
        _load_record(tmp_path / "lvlm-1d_s2.json", {"image_grid": "1x2"})


def test_records_made_from_other_start_weights_are_refused(tmp_path):
    """The default start is the shipped file, whose content can change under the same path: the checksum decides."""
    import json

    from benchmarks.comemo_control import _load_record
    from core.infra.cli import UsageError
    from core.infra.fileio import file_sha256 as _sha256

    w = tmp_path / "w.safetensors"
    w.write_bytes(b"first weights")
    settings = {"image_grid": "1x1", "init_from": str(w), "init_sha256": _sha256(w)}
    (tmp_path / "comemo_s1.json").write_text(json.dumps({"settings": settings}))
    assert _load_record(tmp_path / "comemo_s1.json", settings)["settings"] == settings
    w.write_bytes(b"retrained weights")
    with pytest.raises(UsageError, match="init_sha256"):
        _load_record(tmp_path / "comemo_s1.json", {**settings, "init_sha256": _sha256(w)})
    for f in (Path(__file__).parents[1] / "benchmarks" / "results").glob("comemo_*/*_s*.json"):  # the shipped records
        assert len(json.loads(f.read_text())["settings"]["init_sha256"]) == 64, f
