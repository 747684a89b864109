"""rl.references: D4RL constants by default, measured -v5 constants on request, the measuring CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

import rl.references as ref

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_d4rl_default_and_unknown_source():
    assert ref.normalized_score("Hopper-v5", 3234.3) == pytest.approx(100.0)
    assert ref.normalized_score("Hopper-v5", -20.272305) == pytest.approx(0.0)
    np.testing.assert_allclose(ref.normalized_score("Walker2d-v5", np.array([1.629008, 4592.3])), [0.0, 100.0])
    with pytest.raises(ValueError, match="unknown reference source"):
        ref.reference_returns("Hopper-v5", "v2")


def test_measure_cli_writes_v5_entry_and_scores_use_it(tmp_path, monkeypatch):
    out = tmp_path / "refs.json"
    monkeypatch.setattr(ref, "V5_PATH", out)
    with pytest.raises(ValueError, match="no measured -v5 references"):
        ref.reference_returns("Hopper-v5", "v5")
    assert ref.main(["--env", "Hopper-v5", "--episodes", "2", "--seed", "7", "--out", str(out)]) == 0
    e = json.loads(out.read_text())["Hopper-v5"]
    assert e["random"]["episodes"] == 2 and len(e["expert"]["returns"]) == 2
    assert e["expert"]["snapshot"] and len(e["expert"]["policy_sha256"]) == 64
    # the shipped behaviour's expert snapshot hops; uniform random actions fall within a few dozen steps
    assert e["expert"]["mean_return"] > e["random"]["mean_return"] + 200
    lo, hi = ref.reference_returns("Hopper-v5", "v5")
    assert (lo, hi) == (e["random"]["mean_return"], e["expert"]["mean_return"])
    assert ref.normalized_score("Hopper-v5", hi, "v5") == pytest.approx(100.0)
    again = ref.measure_references("Hopper-v5", episodes=2, seed=7)
    assert again["random"]["returns"] == e["random"]["returns"] and again["expert"]["returns"] == e["expert"]["returns"]
    with pytest.raises(ValueError, match="no snapshot"):
        ref.measure_references("Hopper-v5", episodes=1, seed=0, snapshot="step9999999")
