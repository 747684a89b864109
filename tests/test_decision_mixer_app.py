"""Decision Mixer tab: served through Gradio, an episode runs end to end with a shipped policy."""

from __future__ import annotations

from pathlib import Path

import pytest

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from tests._hub_server import served_ui  # noqa: E402


@pytest.fixture(scope="module")
def served():
    with served_ui("apps.decision_mixer.ui") as url:
        yield url


def test_run_episode_returns_video_plots_and_status(served):
    from rl.evaluate import shipped_policies

    names = sorted(shipped_policies())
    assert names, "no shipped policy in rl/weights"
    client = gradio_client.Client(served, verbose=False)
    video, ret_plot, map_plot, status = client.predict(names[0], "Hopper-v5", 3600.0, 20, 3, api_name="/decision_mixer_run")
    assert "Done" in status and "Hopper-v5" in status
    path = Path(video["video"] if isinstance(video, dict) else video)
    assert path.exists() and path.stat().st_size > 1000
    assert ret_plot is not None and map_plot is not None


def test_wrong_environment_is_a_clear_error(served):
    from rl.evaluate import shipped_policies

    name = sorted(shipped_policies())[0]
    client = gradio_client.Client(served, verbose=False)
    with pytest.raises(Exception, match="was trained on Hopper-v5"):
        client.predict(name, "Walker2d-v5", 3600.0, 20, 0, api_name="/decision_mixer_run")
