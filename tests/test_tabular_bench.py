"""benchmarks.tabular_bench: the targets it reports, and a one-split run with the fine-tuned variant."""

from __future__ import annotations

import json

import pytest

from benchmarks.tabular_bench import _targets, main, models

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _row(dataset, model, acc, rows=100):
    return {"dataset": dataset, "model": model, "accuracy": acc, "rows": rows}


def test_targets_are_reported_for_each_tabicl_variant():
    rows = [_row("a", "TabICL", 0.90), _row("a", "TabICL-ft", 0.95), _row("a", "LogisticRegression", 0.93),
            _row("a", "HistGradientBoosting", 0.92),
            _row("b", "TabICL", 0.80, 5000), _row("b", "TabICL-ft", 0.80, 5000),
            _row("b", "LogisticRegression", 0.9, 5000), _row("b", "HistGradientBoosting", 0.70, 5000)]
    t = _targets(rows)
    base, ft = t["by_model"]["TabICL"], t["by_model"]["TabICL-ft"]
    assert base["mean_vs_hgb"]["tabicl"] == pytest.approx(0.85) and base["mean_vs_hgb"]["met"]
    assert not base["small_vs_lr"]["met"] and ft["small_vs_lr"]["met"]  # "b" has 5,000 rows: not a small table
    assert ft["small_vs_lr"]["per_dataset"] == {"a": {"tabicl": 0.95, "lr": 0.93}}
    assert t["mean_vs_hgb"] == base["mean_vs_hgb"] and t["small_vs_lr"] == base["small_vs_lr"]  # top level: TabICL
    assert any("TabICL-ft >= LogisticRegression" in line and line.endswith("met") for line in t["lines"])
    assert "TabICL-ft" not in _targets([r for r in rows if r["model"] != "TabICL-ft"])["by_model"]


def test_finetuned_variant_runs_in_the_benchmark(tmp_path):
    assert "TabICL-ft" not in models(2, None, 0)
    assert models(2, None, 0, finetune_steps=7)["TabICL-ft"]().finetune_steps == 7
    out = tmp_path / "r.json"
    assert main(["--datasets", "iris", "--repeats", "1", "--n-estimators", "1", "--finetune-steps", "2",
                 "--models", "TabICL-ft", "LogisticRegression", "HistGradientBoosting", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert sorted(r["model"] for r in res["rows"]) == ["HistGradientBoosting", "LogisticRegression", "TabICL-ft"]
    assert res["args"]["finetune_steps"] == 2 and not res["failures"]
    assert "TabICL-ft" in res["targets"]["by_model"] and "TabICL" not in res["targets"]["by_model"]
