"""Pooling CoMemo benchmark runs over seeds: paired differences, intervals, targets, and refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.comemo_summary import load_runs, main, summarise


def _run(tmp_path, name, hits: dict, *, eval_seed=777, n=9):
    """A benchmark JSON whose variants answer per ``hits[variant](pos) -> (full, digit)`` at count ``n``."""
    variants = {v: {"needle_records": {str(n): [[p, *f(p)] for p in range(n) for _ in range(4)]}} for v, f in hits.items()}
    data = {"args": {"eval_seed": eval_seed, "per_count": 36, "images": [n], "max_images": 3, "train_args": name},
            "variants": variants}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def test_paired_differences_intervals_and_targets(tmp_path, capsys):
    mid = lambda p: 3 <= p < 6  # noqa: E731
    hits = {"lvlm-1d": lambda p: (0, 0 if mid(p) else 1), "comemo": lambda p: (0, 1), "lvlm-dhr": lambda p: (p % 2, 1)}
    paths = [_run(tmp_path, f"s{i}", hits) for i in range(3)]
    out = tmp_path / "sum.json"
    png = tmp_path / "sum.png"
    assert main([str(p) for p in paths] + ["--out", str(out), "--reps", "200", "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    s = json.loads(out.read_text())
    co = s["vs_baseline"]["comemo"]["9"]["digit"]
    assert [c["diff"] for c in co] == [0.0, 1.0, 0.0]
    assert co[1]["ci95"] == [1.0, 1.0]  # every paired sample differs by exactly 1
    assert s["variants"]["lvlm-1d"]["9"]["samples_by_third"] == [36, 36, 36]
    t = s["targets"]
    assert t["comemo_digit"]["middle_met"] and t["comemo_digit"]["ends_met"] and not t["comemo_full"]["middle_met"]
    assert t["dhr_beyond_training"]["met"] and t["dhr_beyond_training"]["counts"] == [9]
    assert "variant - lvlm-1d" in capsys.readouterr().out


def test_interval_covers_a_noisy_difference(tmp_path):
    rng = np.random.default_rng(0)
    draws = {}

    def noisy(v):
        return lambda p: (0, int(draws.setdefault((v, p, len(draws)), rng.random() < (0.7 if v == "comemo" else 0.5))))

    paths = [_run(tmp_path, f"s{i}", {"lvlm-1d": noisy("a"), "comemo": noisy("comemo")}) for i in range(3)]
    s = summarise(load_runs(paths), reps=300)
    for c in s["vs_baseline"]["comemo"]["9"]["digit"]:
        assert c["ci95"][0] <= c["diff"] <= c["ci95"][1] and c["ci95"][0] < c["ci95"][1]


def test_runs_on_other_streams_or_without_records_are_refused(tmp_path):
    a = _run(tmp_path, "a", {"lvlm-1d": lambda p: (1, 1)})
    b = _run(tmp_path, "b", {"lvlm-1d": lambda p: (1, 1)}, eval_seed=1)
    with pytest.raises(SystemExit, match="not the same evaluation stream"):
        load_runs([a, b])
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"args": {}, "variants": {"comemo": {"accuracy": {}}}}))
    with pytest.raises(SystemExit, match="no needle_records"):
        load_runs([old])


def test_runs_benchmarked_one_variant_at_a_time_are_merged_per_seed(tmp_path):
    mid = lambda p: 3 <= p < 6  # noqa: E731
    paths = []
    for i in range(2):
        other = _run(tmp_path, f"s{i}", {"comemo": lambda p: (0, 1)}).rename(tmp_path / f"s{i}_comemo.json")
        paths += [_run(tmp_path, f"s{i}", {"lvlm-1d": lambda p: (0, 0 if mid(p) else 1)}), other]
    runs = load_runs(paths)
    assert len(runs) == 2 and all(set(r["variants"]) == {"lvlm-1d", "comemo"} for r in runs)
    s = summarise(runs, reps=100)
    assert s["n_seeds"] == 2 and [c["diff"] for c in s["vs_baseline"]["comemo"]["9"]["digit"]] == [0.0, 1.0, 0.0]
    out = tmp_path / "merged.json"
    assert main([str(paths[0]), str(paths[1]), "--out", str(out), "--merge-only"]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["variants"]) == {"lvlm-1d", "comemo"} and merged["args"]["variants"] == ["lvlm-1d", "comemo"]
    assert "targets" in merged
    with pytest.raises(SystemExit, match="2 training seeds"):
        main([str(p) for p in paths] + ["--out", str(out), "--merge-only"])
    twice = _run(tmp_path, "s0", {"comemo": lambda p: (1, 1)}).rename(tmp_path / "twice.json")
    with pytest.raises(SystemExit, match="variant comemo of training seed"):
        load_runs([paths[1], twice])


def test_a_third_without_needles_is_reported_as_missing(tmp_path, capsys):
    """At 2 images no needle falls in the last third: no difference and no interval there, and no crash."""
    paths = [_run(tmp_path, f"s{i}", {"lvlm-1d": lambda p: (1, 1), "comemo": lambda p: (1, 1)}, n=2) for i in range(2)]
    out = tmp_path / "sum.json"
    assert main([str(p) for p in paths] + ["--out", str(out), "--reps", "50", "--plot", str(tmp_path / "p.png")]) == 0
    s = json.loads(out.read_text())
    assert s["variants"]["comemo"]["2"]["full_by_third"] == [1.0, 1.0, None]
    assert s["vs_baseline"]["comemo"]["2"]["full"][2] == {"diff": None, "ci95": None}
    assert "–" in capsys.readouterr().out
