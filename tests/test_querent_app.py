"""Querent tab: served through Gradio, a bundled slide is analysed end to end with the shipped models."""

from __future__ import annotations

import os

import numpy as np
import pytest

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from tests._hub_server import served_ui  # noqa: E402
pytest.importorskip("openslide")

from pathology.inference import DEFAULT_SLIDE_MODEL, bundled_samples  # noqa: E402

pytestmark = pytest.mark.skipif(
    not (os.path.exists(DEFAULT_SLIDE_MODEL) and bundled_samples()),
    reason="the demo slide model or bundled samples are not built (python -m pathology.train_demo)",
)


@pytest.fixture(scope="module")
def analyses():
    """Each bundled sample analysed once with the shipped models, shared by the tests below."""
    from pathology.inference import analyze_slide

    return {path: analyze_slide(path) for path in bundled_samples()}


@pytest.fixture(scope="module")
def served():
    with served_ui("apps.querent.ui") as url:
        yield url


def test_analyse_bundled_slide(served):
    from PIL import Image

    client = gradio_client.Client(served, verbose=False)
    name = os.path.basename(bundled_samples()[0])
    overview, heat, pred, status = client.predict(name, None, None, api_name="/querent_run")
    assert "Done" in status and "patches" in status
    assert "Prediction" in pred
    probs = [float(t.split(": ")[1]) for t in pred.split("(")[1].rstrip(")").split(", ")]
    assert abs(sum(probs) - 1) < 1e-3
    a = np.asarray(Image.open(overview))
    b = np.asarray(Image.open(heat))
    assert a.shape == b.shape and a.ndim == 3 and not np.array_equal(a, b)


def test_bad_upload_is_a_clear_error(served, tmp_path):
    bad = tmp_path / "not_a_slide.svs"
    bad.write_bytes(os.urandom(2048))
    client = gradio_client.Client(served, verbose=False)
    with pytest.raises(Exception, match="not a slide"):
        client.predict(None, gradio_client.handle_file(str(bad)), None, api_name="/querent_run")


def test_regions_for_a_clicked_patch(analyses):
    from pathology.inference import regions_overlay

    a = analyses[bundled_samples()[0]]
    assert a.n_patches > 0 and a.attention.shape == (a.n_patches,)
    assert abs(a.attention.sum() - 1) < 1e-4
    i = int(np.random.default_rng().integers(a.n_patches))
    x, y = (a.coords[i] + a.patch_size_level0 / 2) / a.downsample
    img, text = regions_overlay(a, x, y)
    assert img.shape == a.heatmap.shape and f"patch {i} " in text
    r = int(a.region_of_patch[i])
    assert r in a.chosen[:, r]  # every region attends to itself


def test_shipped_model_reads_the_bundled_samples_right(analyses):
    """Golden check of the shipped weights through today's pipeline: each bundled sample's file name says its label."""
    assert {os.path.basename(p) for p in analyses} >= {"sample_lesion.tiff", "sample_normal.tiff"}
    for path, a in analyses.items():
        want = "lesion" if "lesion" in os.path.basename(path) else "no lesion"
        got = a.class_names[int(np.argmax(a.probabilities))]
        assert got == want, (path, a.probabilities)
        assert max(a.probabilities) > 0.9, (path, a.probabilities)
