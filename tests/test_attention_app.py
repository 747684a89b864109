"""Attention-core tab: served through Gradio, a run returns the block map, errors and backend timings."""

from __future__ import annotations

import math
import re

import pytest

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from tests._hub_server import served_ui  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with served_ui("apps.attention.ui") as url:
        yield url


def test_run_reports_map_errors_and_timings(served):
    import random

    seed = random.randint(0, 10_000)
    S, bs, k = 384, 32, 3
    client = gradio_client.Client(served, verbose=False)
    status, plot, table, errors = client.predict(S, bs, k, True, seed, api_name="/attention_run")
    assert status.startswith("Done") and f"S={S}" in status
    # Causal, 12 blocks, top-3: density is at most 3/12 and at least the forced share.
    density = float(re.search(r"density ([0-9.]+)%", status).group(1)) / 100
    nk = math.ceil(S / bs)
    assert 0 < density <= k / nk + 1e-9
    max_err = float(re.search(r"max abs error ([0-9.e+-]+)", errors).group(1))
    rel_err = float(re.search(r"relative error \(Frobenius\) ([0-9.e+-]+)", errors).group(1))
    assert 0 < max_err < 10 and 0 < rel_err < 1  # sparse differs from dense, but is not garbage
    backends = {row[0]: row[1] for row in table["data"]}
    for name in ("block-sparse: selection", "block-sparse: attention", "reference", "sdpa"):
        assert backends[name] is not None and float(backends[name]) > 0, name
    assert plot is not None


def test_all_blocks_selected_matches_dense(served):
    """k >= number of key blocks: block-sparse is dense attention, so the error is at rounding level."""
    client = gradio_client.Client(served, verbose=False)
    status, _, _, errors = client.predict(256, 64, 64, False, 1, api_name="/attention_run")
    assert "density 100.0%" in status
    max_err = float(re.search(r"max abs error ([0-9.e+-]+)", errors).group(1))
    assert max_err < 1e-4


def test_example_button_api(served):
    client = gradio_client.Client(served, verbose=False)
    status, *_ = client.predict(api_name="/attention_example")
    assert "Done" in status


def test_bad_block_size_is_a_clear_error(served):
    client = gradio_client.Client(served, verbose=False)
    with pytest.raises(Exception, match="48"):  # the error names the rejected value
        client.predict(256, 48, 4, False, 0, api_name="/attention_run")
