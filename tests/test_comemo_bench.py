"""The CoMemo benchmark runs end to end on a tiny setting and reports every quantity it promises."""

from __future__ import annotations

import json

import pytest

from benchmarks.comemo_bench import issue_targets, main, recorded_training

TINY_TRAIN = ("--dim 32 --depth 2 --heads 2 --cross-every 1 --tile 16 --vision-dim 16 --vision-depth 1 "
              "--batch-size 2 --val-samples 2 --device cpu")


def test_bench_tiny(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["--runs", str(tmp_path / "runs"), "--variants", "lvlm-1d", "comemo", "--train-steps", "1",
                 "--train-args", TINY_TRAIN, "--max-images", "2", "--images", "1", "3", "--tasks", "needle", "detail",
                 "--per-count", "3", "--max-new-tokens", "4", "--out", str(out), "--no-progress",
                 "--plot", str(tmp_path / "c.png"), "--variant-args", "lvlm-1d=--mlp-ratio 7"]) == 0
    res = json.loads(out.read_text())
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert set(res["variants"]) == {"lvlm-1d", "comemo"}
    for name, v in res["variants"].items():
        assert set(v["accuracy"]) == {"needle", "detail"} and set(v["accuracy"]["needle"]) == {"1", "3"}
        assert all(0 <= a <= 1 for d in v["accuracy"].values() for a in d.values())
        assert v["samples"]["needle"]["3"] == 3 and v["samples"]["detail"] == {"1": 3}
        dec = v["needle_accuracy_by_decile"]["3"]
        assert len(dec) == 10 and sum(x is not None for x in dec) == 3  # positions 0, 1, 2 of 3 -> deciles 0, 3, 6
        assert v["needle_samples_by_third"]["3"] == [1, 1, 1]  # positions 0, 1, 2 of 3: one per third
        assert [r[0] for r in v["needle_records"]["3"]] == [0, 1, 2]
        assert [r[1] for r in v["needle_records"]["3"]] == [int(x) for x in v["needle_accuracy_by_third"]["3"]]
        assert all(x in (0, 1) for x in v["needle_accuracy_by_third"]["3"])
        # the digit part is right whenever the whole answer is
        assert all(d >= a for d, a in zip(v["needle_digit_accuracy_by_third"]["3"], v["needle_accuracy_by_third"]["3"]))
        mass = v["attention_mass_by_decile"]["3"]
        assert all(m is None or 0 < m <= 1 for m in mass)
        assert v["seconds_per_answer"] > 0 and v["parameters"] > 0
    assert res["variants"]["comemo"]["gates"] and not res["variants"]["lvlm-1d"]["gates"]
    assert res["variants"]["comemo"]["parameters"] > res["variants"]["lvlm-1d"]["parameters"]
    table = capsys.readouterr().out
    assert "| variant |" in table and "needle@3" in table and "needle@3 middle" in table and "majority answer" in table
    base = res["majority_baseline"]
    assert set(base["accuracy"]) == {"needle", "detail"} and base["tile"] == 16
    assert all(1 / 3 <= a <= 1 for d in base["accuracy"].values() for a in d.values())
    assert base["accuracy"]["needle"]["1"] == base["needle_digit"]["1"]  # one image: only the digit varies
    assert base["accuracy"]["needle"]["3"] <= base["needle_digit"]["3"]  # the top answer's digit is at most the top digit
    t = res["targets"]
    one, co = res["variants"]["lvlm-1d"], res["variants"]["comemo"]
    assert t["longest"] == 3
    assert t["comemo_middle_gain"] == co["needle_accuracy_by_third"]["3"][1] - one["needle_accuracy_by_third"]["3"][1]
    assert t["dhr_beyond_training"] is None  # no lvlm-dhr in this run
    rec = recorded_training(tmp_path / "runs" / "lvlm-1d" / "model.safetensors")
    assert rec["mlp_ratio"] == 7 and recorded_training(tmp_path / "runs" / "comemo" / "model.safetensors")["mlp_ratio"] == 4
    # a second run with the same training arguments reuses the trained folders (no retraining): the results match
    first = res["variants"]["comemo"]["accuracy"]
    same = ["--runs", str(tmp_path / "runs"), "--variants", "comemo", "--train-steps", "1", "--train-args", TINY_TRAIN,
            "--max-images", "2", "--images", "1", "3", "--tasks", "needle", "detail", "--per-count", "3",
            "--max-new-tokens", "4", "--out", str(out), "--no-progress"]
    assert main(same) == 0
    assert json.loads(out.read_text())["variants"]["comemo"]["accuracy"] == first
    # other training arguments: the old folder is not reused (refused, or retrained with --overwrite)
    other = [a if a != TINY_TRAIN else TINY_TRAIN + " --seed 5" for a in same]
    with pytest.raises(SystemExit, match="trained with other arguments: seed: 0 .recorded. vs 5 .requested."):
        main(other)
    assert main(other + ["--overwrite"]) == 0
    assert recorded_training(tmp_path / "runs" / "comemo" / "model.safetensors")["seed"] == 5
    with pytest.raises(SystemExit, match="VARIANT=ARGS"):
        main(same + ["--variant-args", "nope=--seed 1"])


def test_issue_targets_compare_the_right_cells():
    def v(thirds, needle):
        return {"needle_accuracy_by_third": thirds, "accuracy": {"needle": needle}}

    res = issue_targets({
        "lvlm-1d": v({"8": [0.9, 0.5, 0.9], "32": [0.8, 0.2, 0.7]}, {"8": 0.8, "16": 0.3, "32": 0.2}),
        "lvlm-dhr": v({"8": [1, 1, 1], "32": [0.5, 0.5, 0.5]}, {"8": 0.9, "16": 0.6, "32": 0.4}),
        "comemo": v({"8": [1, 1, 1], "32": [0.85, 0.45, 0.69]}, {"8": 1.0, "16": 0.5, "32": 0.6}),
    }, max_images=8)
    assert res["longest"] == 32
    assert abs(res["comemo_middle_gain"] - 0.25) < 1e-9
    assert [round(x, 6) for x in res["comemo_end_gaps"]] == [0.05, -0.01]
    assert res["dhr_beyond_training"]["counts"] == [16, 32]
    assert abs(res["dhr_beyond_training"]["lvlm-dhr"] - 0.5) < 1e-9 and abs(res["dhr_beyond_training"]["lvlm-1d"] - 0.25) < 1e-9
    assert issue_targets({"comemo": v({}, {})}, max_images=8)["longest"] is None
