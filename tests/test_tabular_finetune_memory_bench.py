"""benchmarks.tabular_finetune_memory: one small case in this process."""

from __future__ import annotations

import pytest

from benchmarks.tabular_finetune_memory import WEIGHTS, _case
from tabular.finetune import RESERVE_MB, VIEWS, row_bytes

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_case_reports_growth_per_row_next_to_the_estimate():
    res = _case(str(WEIGHTS / "tabicl_small.safetensors"), features=6, rows=96, threads=1)
    assert res["status"] == "ok" and res["embed_dim"] == 32 and res["views"] == VIEWS
    assert res["peak_growth_mb"] >= 0
    assert res["measured_kb_per_row"] == pytest.approx(res["peak_growth_mb"] * 1024 / (VIEWS * 96))
    assert res["row_bytes_kb"] == pytest.approx(row_bytes(32, 6) / 1024)
    # What rows_for_budget plans with: the per-row estimate for the rows plus the reserve for fixed costs.
    assert res["peak_growth_mb"] <= VIEWS * 96 * res["row_bytes_kb"] / 1024 + RESERVE_MB
