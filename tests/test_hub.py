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


def test_readme_apps_table_matches_registry():
    """The root README's apps table and the registry say the same thing (one source: `apps.REGISTRY`)."""
    from apps.readme_table import README, apps_table, write_readme

    table = apps_table()
    for s in REGISTRY:
        assert s.status in table, f"{s.key}: its status is missing from the generated table"
    assert write_readme(README, check=True), (
        "README.md's apps table differs from apps.REGISTRY; regenerate it with `python -m apps.readme_table`"
    )


def test_readme_table_rewrite_and_check(tmp_path):
    """The writer replaces exactly the marked part, reports a stale table, and refuses a README without markers."""
    from dataclasses import replace

    from apps.readme_table import END, START, render_readme, write_readme

    (tmp_path / "tabular").mkdir()
    (tmp_path / "tabular" / "README.md").write_text("# t\n")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{START}\n| stale |\n{END}\nafter\n")
    specs = [replace(get_app("tabicl"), status="a | piped\nstatus"), get_app("comemo")]
    assert not write_readme(readme, check=True, specs=specs)
    assert "stale" in readme.read_text(), "--check must not write"
    assert not write_readme(readme, specs=specs)
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{END}\nafter\n") and "stale" not in text
    assert "| [TabICL](tabular/README.md) |" in text, "an app whose README exists links to it"
    assert "| CoMemo |" in text and "`apps/comemo/` |" in text, "an app without a README is not linked"
    assert "a \\| piped status" in text, "pipes and line breaks must not break the table"
    assert write_readme(readme, check=True, specs=specs)
    with pytest.raises(ValueError, match="markers"):
        render_readme("no markers here", "| t |")


def test_readme_table_cli_check(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- apps-table:start -->\n<!-- apps-table:end -->\n")
    r = subprocess.run([sys.executable, "-m", "apps.readme_table", "--check", "--readme", str(readme)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 1 and "differs" in r.stderr
    r = subprocess.run([sys.executable, "-m", "apps.readme_table", "--readme", str(readme)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0
    r = subprocess.run([sys.executable, "-m", "apps.readme_table", "--check", "--readme", str(readme)], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_table_links_only_committed_readmes(tmp_path):
    """In a git checkout, an app README that is not yet tracked does not change the table."""
    from apps.readme_table import apps_table

    if subprocess.run(["git", "init", "-q", str(tmp_path)], capture_output=True).returncode != 0:
        pytest.skip("git is not available")
    (tmp_path / "tabular").mkdir()
    (tmp_path / "tabular" / "README.md").write_text("# t\n")
    specs = [get_app("tabicl")]
    assert "| TabICL |" in apps_table(specs, root=tmp_path), "an untracked README is not linked"
    subprocess.run(["git", "-C", str(tmp_path), "add", "tabular/README.md"], check=True, capture_output=True)
    assert "| [TabICL](tabular/README.md) |" in apps_table(specs, root=tmp_path), "a tracked README is linked"


def test_status_lines_are_short_and_results_sections_exist():
    """The overview shows one short status line per app and the README section its numbers are in: a renamed
    heading or a missing README fails here, not as an empty accordion in the hub."""
    from apps import STATUS_MAX
    from apps.hub import overview_markdown, results_section

    md = overview_markdown()
    for s in REGISTRY:
        assert len(s.status) <= STATUS_MAX, f"{s.key}: status of {len(s.status)} characters; move details to the README"
        assert "\n" not in s.status
        assert s.results, f"{s.key}: no results section named"
        section = results_section(s)
        assert section and section.count("\n") >= 3, f"{s.key}: {s.results} names no README section"
        assert s.results.split("#")[0] in md


def test_results_section_stops_at_the_next_heading(tmp_path):
    from dataclasses import replace

    from apps.hub import results_section

    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "README.md").write_text("# X\n## Use\nusage\n## Results\nr1\n### sub\nr2\n## Limits\nl\n")
    spec = replace(get_app("tabicl"), results="x/README.md#Results")
    text = results_section(spec, root=tmp_path)
    assert text.startswith("### Results") and "r1" in text and "r2" in text and "Limits" not in text and "usage" not in text
    assert results_section(replace(spec, results="x/README.md#Nope"), root=tmp_path) is None
    assert results_section(replace(spec, results="y/README.md#Results"), root=tmp_path) is None


def test_python_m_apps_hub_is_the_hub_command():
    r = subprocess.run([sys.executable, "-m", "apps.hub", "--help"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0 and "--port" in r.stdout and "--app" in r.stdout and "--model" in r.stdout


@pytest.mark.parametrize("argv, words", [
    (["--model", "x"], "needs --app"),
    (["--app", "attention", "--model", "README.md"], "takes no model"),
    (["--app", "tabicl", "--model", "no/such/file.ckpt"], "no such file"),
])
def test_model_option_is_checked_before_serving(argv, words):
    r = subprocess.run([sys.executable, "-m", "apps", *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("spec", [s for s in REGISTRY if s.own_model], ids=lambda s: s.key)
def test_own_model_fills_the_tab(spec, tmp_path):
    """Each app with a real-model path has an own-model field; ``--model`` (here build_single's ``model``) fills it."""
    pytest.importorskip("gradio")
    from apps.hub import build_single

    demo = build_single(spec.key, "/some/model/dir")
    fields = [b for b in demo.blocks.values() if getattr(b, "elem_id", None) == f"{spec.key}-own-model"]
    assert len(fields) == 1, f"{spec.key}: no #{spec.key}-own-model field"
    assert fields[0].value.endswith("/some/model/dir")
