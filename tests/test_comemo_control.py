"""The memory-isolating control's summary: per-seed paired differences by third, t-intervals over seeds, targets."""

from __future__ import annotations

import math

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
