"""benchmarks.tabular_level_probe: the table follows its rule in every encoding; a run writes its rows."""

import json

import numpy as np
import pytest

from benchmarks import tabular_level_probe as probe


def test_rule_and_encodings():
    for enc in probe.ENCODINGS:
        X, y = probe.make_table(400, 4, 0, enc)
        assert X.shape == (400, 4) and set(np.unique(y)) == {0, 1, 2}
    X, y = probe.make_table(400, 4, 0, "codes")
    Xb, yb = probe.make_table(400, 4, 0, "bands")
    np.testing.assert_array_equal(y, yb)  # same labels in both views
    rule = np.where(X["p0"] == "C", 1, np.where(X["p2"] == "G", 2, 0))
    assert 0.9 < (rule == y).mean() < 1.0  # 5% of labels redrawn (a third of them land on the rule's class)
    band = np.floor(Xb["p0"].to_numpy() * 4)  # bands: code / 4 + U(0, 1/4)
    np.testing.assert_array_equal(band == 1, X["p0"].to_numpy() == "C")
    with pytest.raises(ValueError, match="width must be at least 3"):
        probe.make_table(10, 2, 0, "codes")
    with pytest.raises(ValueError, match="encoding must be one of"):
        probe.make_table(10, 3, 0, "ordinal")


def test_small_run_writes_rows(tmp_path):
    out = tmp_path / "p.json"
    assert probe.main(["--widths", "3", "--encodings", "codes,onehot", "--rows", "160", "--n-estimators", "1",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["encoding"] for r in data["rows"]] == ["codes", "onehot"]
    assert "LogisticRegression" in data["rows"][0] and "LogisticRegression" not in data["rows"][1]
    assert all(0 <= r["TabICL"] <= 1 for r in data["rows"]) and len(data["table"]) == 2
    # a stopped run: --summarize rebuilds the table from the rows found, fitting nothing
    out.write_text(json.dumps({k: v for k, v in data.items() if k != "table"} | {"rows": data["rows"][:1]}))
    assert probe.main(["--summarize", "--out", str(out)]) == 0
    again = json.loads(out.read_text())
    assert again["table"] == data["table"][:1] and again["rows"] == data["rows"][:1]


def test_bad_arguments_exit_with_usage():
    with pytest.raises(SystemExit):
        probe.main(["--widths", "2"])
    with pytest.raises(SystemExit):
        probe.main(["--encodings", "ordinal"])
