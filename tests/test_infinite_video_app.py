"""∞-Video tab: served through Gradio, a question about the bundled video is answered end to end."""

from __future__ import annotations

import pytest

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from tests._hub_server import served_ui  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with served_ui("apps.infinite_video.ui") as url:
        yield url


def test_answer_with_density_and_peak_frames(served):
    import random

    from video.synthetic import ANSWERS, COLOURS

    client = gradio_client.Client(served, verbose=False)
    colour = random.choice(COLOURS)
    status, plot, gallery, probs = client.predict(
        "synthetic_2048.mp4", None, "exists", colour, "blue", "infinite", api_name="/infinite_video_run"
    )
    assert "Done" in status and "2048 of 2048 frames" in status and "True answer" in status
    answer = status.split("**A:** ")[1].split(" ")[0]
    assert answer in ANSWERS
    assert plot is not None
    assert 1 <= len(gallery) <= 4
    p = [row[1] for row in probs["data"]]
    assert len(p) == 5 and all(0 <= x <= 1 for x in p) and p == sorted(p, reverse=True)


def test_uniform_method_has_no_density_and_bad_input_is_clear(served):
    client = gradio_client.Client(served, verbose=False)
    status, plot, gallery, _ = client.predict(
        "synthetic_2048.mp4", None, "first", "red", "blue", "uniform", api_name="/infinite_video_run"
    )
    assert "Done" in status and "32 of 2048 frames" in status and not gallery
    with pytest.raises(Exception, match="two different colours"):
        client.predict("synthetic_2048.mp4", None, "order", "red", "red", "infinite", api_name="/infinite_video_run")
    with pytest.raises(Exception, match="not in the list of choices|unknown bundled video"):
        client.predict("nope.mp4", None, "first", "red", "blue", "infinite", api_name="/infinite_video_run")
