"""benchmarks.tabular_readouts: each readout alone against logistic regression on a small real table."""

from __future__ import annotations

import json

import pytest

from benchmarks.tabular_readouts import main
from tabular.model import TabICL, tabicl_tiny
from tabular.weights_io import save_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_readouts_are_scored_against_logistic_regression_on_the_same_cells(tmp_path):
    ck = tmp_path / "tiny.safetensors"
    save_model(TabICL(tabicl_tiny()), ck)
    out = tmp_path / "r.json"
    assert main(["--checkpoint", str(ck), "--datasets", "iris", "--repeats", "2", "--out", str(out)]) == 0
    rows = {r["readout"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == ["LR cells", "LR rows", "logistic cells argmax", "logistic cells calibrated",
                            "ridge rows argmax", "ridge rows calibrated"]
    assert rows["LR cells"]["gap_to_lr"] == 0.0 and len(rows["LR cells"]["accuracy_per_split"]) == 2
    # the logistic readout is logistic regression on those cells: on iris it is far above chance and near LR
    assert rows["logistic cells argmax"]["accuracy"] > 0.85
    assert abs(rows["logistic cells argmax"]["gap_to_lr"]) < 0.05
    with pytest.raises(SystemExit, match="unknown datasets"):
        main(["--checkpoint", str(ck), "--datasets", "nope", "--out", str(out)])
    with pytest.raises(SystemExit, match="not found"):
        main(["--checkpoint", str(tmp_path / "absent.safetensors"), "--out", str(out)])
