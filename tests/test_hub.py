"""The hub: registry, overview, no work at import, CLI, and a served page."""

from __future__ import annotations

import importlib
import subprocess
import sys
import urllib.request

import pytest

from apps import REGISTRY, get_app
from tests._hub_server import REPO, running_hub


def test_registry_keys_unique_and_lookup():
    keys = [s.key for s in REGISTRY]
    assert len(keys) == len(set(keys))
    assert {"attention", "tabicl", "querent", "infinite_video", "decision_mixer", "comemo", "emloc", "ncal"} <= set(keys)
    assert get_app("tabicl").title == "TabICL"
    with pytest.raises(ValueError, match="known apps"):
        get_app("nope")


def test_import_does_no_work():
    code = "import sys, apps, apps.hub; bad = [m for m in ('gradio', 'torch') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)"
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"importing apps pulled in heavy modules: {r.stdout} {r.stderr}"


def test_overview_lists_every_app_and_its_status():
    from apps.hub import overview_markdown

    md = overview_markdown()
    for s in REGISTRY:
        assert s.title in md and s.status in md


@pytest.mark.parametrize("spec", [s for s in REGISTRY if s.ui_module], ids=lambda s: s.key)
def test_each_ui_module_builds(spec):
    gr = pytest.importorskip("gradio")
    module = importlib.import_module(spec.ui_module)
    with gr.Blocks() as demo:
        module.build_ui()
    ids = {getattr(b, "elem_id", None) for b in demo.blocks.values()}
    assert f"{spec.key}-example" in ids and f"{spec.key}-status" in ids, f"{spec.key} lacks its example button or status output"


def test_app_without_demo_is_refused():
    pytest.importorskip("gradio")
    from apps.hub import build_single

    missing = [s for s in REGISTRY if s.ui_module is None]
    if not missing:
        pytest.skip("every app has a demo")
    with pytest.raises(ValueError, match="no demo yet"):
        build_single(missing[0].key)


def test_cli_help():
    r = subprocess.run([sys.executable, "-m", "apps", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--port" in r.stdout and "--host" in r.stdout


def test_hub_serves_overview(tmp_path):
    pytest.importorskip("gradio")
    with running_hub(log_path=tmp_path / "hub.log") as url:
        with urllib.request.urlopen(url + "config", timeout=30) as r:
            config = r.read().decode()
    assert "longctx" in config
    for s in REGISTRY:
        if s.ui_module:
            assert s.title in config
