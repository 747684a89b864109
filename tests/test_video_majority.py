"""The ∞-Video benchmark's trivial baseline: majority answers come from development videos only."""

import json

from benchmarks.video_majority import majority_answers, score


def _video(qtypes, answers, marks):
    return {"qtypes": qtypes, "answers": answers, "runs": {"m": {"marks": marks}}}


def test_majority_from_dev_and_paired_difference(tmp_path):
    dev = {"videos": {"1024/a.mp4": _video(["first", "count"], ["red", 1], [0, 0]),
                      "1024/b.mp4": _video(["first", "count"], ["red", 2], [0, 0]),
                      "1024/c.mp4": _video(["first", "count"], ["blue", 2], [0, 0])}}
    (tmp_path / "dev.json").write_text(json.dumps(dev))
    maj = majority_answers([tmp_path / "dev.json"])
    assert maj == {"first": "red", "count": "2"}
    # Reported videos whose own majority differs ("blue"): the baseline must not see them.
    result = {"methods": ["m"], "videos": {"1024/x.mp4": _video(["first", "count"], ["blue", 2], [1, 1]),
                                           "1024/y.mp4": _video(["first", "count"], ["blue", 3], [1, 0])}}
    rows = {r["method"]: r for r in score(result, maj)}
    assert rows["majority"]["accuracy"] == 0.25  # only x's count (2) is right
    assert rows["m"]["accuracy"] == 0.75 and abs(rows["m"]["minus_majority"] - 0.5) < 1e-12
    assert rows["m"]["ci_lo"] < 0.5 < rows["m"]["ci_hi"]
