"""apps.emloc as a user gets it: the shipped default host (golden outputs, size, card), and the hub tab's function."""

from __future__ import annotations

import json

import numpy as np
import pytest

from apps.emloc.model import DEFAULT_WEIGHTS, EMLoCHost

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_shipped_host_golden_size_and_card():
    from apps.emloc.ship import GOLDEN_PATH, golden_outputs

    assert DEFAULT_WEIGHTS.stat().st_size <= 20 * 2**20
    model = EMLoCHost.load()  # no path: the shipped default
    stored = json.loads(GOLDEN_PATH.read_text())
    got = golden_outputs(model)
    np.testing.assert_allclose(got["full_logits"], stored["full_logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["emloc_logits"], stored["emloc_logits"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(got["emloc_keep_ratios"], stored["emloc_keep_ratios"], atol=1e-6, rtol=0)
    prov = json.loads(DEFAULT_WEIGHTS.with_suffix(".json").read_text())
    assert prov["fingerprint"] == model.fingerprint()
    card = DEFAULT_WEIGHTS.with_suffix(".md").read_text()
    assert card.startswith("---\nlicense:") and prov["command"] in card


def test_shipped_host_learns_in_context_on_the_golden_episode():
    stored = json.loads((DEFAULT_WEIGHTS.with_name("host_golden.json")).read_text())
    pred = np.array(stored["label_ids"])[np.argmax(stored["full_logits"], axis=1)]
    # 48 demos of 5 held-out classes: the stored outputs are those of a host that reads labels from the context
    assert (pred == np.array(stored["query_labels"])).mean() >= 0.75


def test_tab_function_and_refusals():
    from apps.emloc.ui import run_episode

    keep_img, map_img, table, status = run_episode(16, 0.005, 3)
    for img in (keep_img, map_img):
        assert img.ndim == 3 and img.shape[2] == 3 and len(np.unique(img.reshape(-1, 3), axis=0)) > 2
    assert status.startswith("Done") and "| full | 100% |" in table and "EMLoC (δ = 0.005)" in table
    for bad, msg in (((16, 0, 0), "δ must be"), ((16, -1, 0), "δ must be"), ((1, 0.005, 0), "number of demonstrations"),
                     ((10_000, 0.005, 0), "number of demonstrations"), (("x", 0.005, 0), "whole number")):
        with pytest.raises(ValueError, match=msg):
            run_episode(*bad)
