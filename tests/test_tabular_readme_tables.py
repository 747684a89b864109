"""benchmarks.tabular_readme: the experiment log's tables come from a result JSON, with its flags and missing cells."""

import json

import pytest

from benchmarks import tabular_readme


def _result(tmp_path):
    def row(table, model, acc, single=0, splits=3):
        return {"table": table, "model": model, "accuracy": acc, "splits": splits, "single_class_splits": single}

    data = {
        "args": {"splits": 3},
        "models": ["TabICL", "LogisticRegression", "RandomForest", "HistGradientBoosting"],
        "tables": [{"name": "a", "rows": 1500, "features": 4, "classes": 2, "majority_rate": 0.6,
                    "test_majority_rate": 0.61},
                   {"name": "b", "rows": 90, "features": 2, "classes": 3, "majority_rate": 0.4}],
        "per_table": [row("a", "TabICL", 0.80), row("a", "LogisticRegression", 0.85),
                      row("a", "RandomForest", 0.85), row("a", "HistGradientBoosting", 0.79),
                      row("b", "TabICL", 0.40, single=1), row("b", "LogisticRegression", 0.50),
                      row("b", "HistGradientBoosting", 0.90, splits=2)],  # unfinished: not a cell
        "aggregates": {
            "TabICL": {"mean_accuracy": 0.8, "mean_balanced_accuracy": 0.7, "mean_roc_auc": 0.9, "mean_log_loss": 0.4,
                       "mean_rank": 2.5, "normalized_accuracy": 0.2, "single_class_tables": ["b"]},
            "LogisticRegression": {"mean_accuracy": 0.85, "mean_balanced_accuracy": 0.8, "mean_roc_auc": 0.9,
                                   "mean_log_loss": 0.3, "mean_rank": 1.5, "normalized_accuracy": 1.0,
                                   "single_class_tables": []}},
        "complete_tables": ["a"],
    }
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    return path


def test_per_table_rows_flags_and_missing_cells(tmp_path, capsys):
    assert tabular_readme.main(["per-table", str(_result(tmp_path))]) == 0
    lines = capsys.readouterr().out.splitlines()
    a = next(x for x in lines if x.startswith("| a |"))
    b = next(x for x in lines if x.startswith("| b |"))
    # a: 1,500 rows, the test split's majority rate, the tie at 0.85 goes to the model listed first
    assert a == ("| a | 1,500 | 4 | 2 | 0.610 | 0.800 | 0.790 | 0.850 | LogisticRegression 0.850 | yes | **no** |")
    # b: single class flagged, the unfinished HistGradientBoosting is neither a cell nor a comparison
    assert b == "| b | 90 | 2 | 3 | 0.400 | 0.400† | – | 0.500 | LogisticRegression 0.500 | – | **no** |"


def test_aggregate_sorted_by_rank_and_names_its_tables(tmp_path, capsys):
    tabular_readme.main(["aggregate", str(_result(tmp_path))])
    out = capsys.readouterr().out.splitlines()
    assert out[2].startswith("| LogisticRegression | 0.850 |")
    assert out[3] == "| **TabICL** | 0.800 | 0.700 | 0.900 | 0.400 | 2.50 | 0.200 | 1 |"
    assert out[-1] == "(1 table: `a`)"


def test_not_a_result_json_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(SystemExit, match="not a benchmarks.tabular_bench result JSON"):
        tabular_readme.main(["aggregate", str(bad)])
