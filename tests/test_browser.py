"""Drive the demo hub in headless Chromium: every tab, every bundled example, no error shown.

Starts ``python -m apps`` (what ``make demo`` serves) on a free port, opens it with Playwright in Debian's
Chromium, and for each registered app clicks its example button (``#<key>-example``) and waits for its status
output (``#<key>-status``) to show the app's expected text. Screenshots go to ``artifacts/screenshots/``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from apps import REGISTRY
from tests._hub_server import REPO, running_hub

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("LONGCTX_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SHOTS = REPO / "artifacts" / "screenshots"
EXAMPLE_TIMEOUT_MS = 300_000
APPS = [s for s in REGISTRY if s.ui_module]


def _require_chromium():
    if Path(CHROMIUM).exists():
        return
    msg = f"Chromium not found at {CHROMIUM}: install Debian's `chromium` package (.ci/run does)"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)


@pytest.fixture(scope="module")
def hub_url(tmp_path_factory):
    pytest.importorskip("gradio")
    log = tmp_path_factory.mktemp("hub") / "hub.log"
    with running_hub(log_path=log) as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    _require_chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture(scope="module")
def page(browser, hub_url):
    """One page for the whole module: the hub is loaded once, then each test visits its tab."""
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    p = context.new_page()
    errors: list[str] = []
    p.on("pageerror", lambda e: errors.append(str(e)))
    # Gradio keeps a live connection open, so wait for the rendered app rather than for network idle.
    p.goto(hub_url, wait_until="domcontentloaded", timeout=180_000)
    p.get_by_role("tab", name="Overview").wait_for(timeout=180_000)
    p.page_errors = errors  # type: ignore[attr-defined]
    yield p
    context.close()


def _shot(page, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)


def _visible_errors(page) -> list[str]:
    toasts = page.locator(".toast-body.error")
    return [toasts.nth(i).inner_text() for i in range(toasts.count())]


def test_overview_tab(page):
    page.get_by_role("tab", name="Overview").click()
    table = page.locator("#overview-table")
    table.wait_for(timeout=30_000)
    text = table.inner_text()
    for spec in REGISTRY:
        assert spec.title in text, f"overview lacks {spec.title}"
    _shot(page, "overview")
    assert not _visible_errors(page)
    assert not page.page_errors, page.page_errors


def _dismiss_toasts(page) -> None:
    """Close toasts left by an earlier tab, so each tab is judged on its own errors."""
    closers = page.locator(".toast-close")
    for i in reversed(range(closers.count())):
        try:
            closers.nth(i).click(timeout=5_000)
        except Exception:  # a toast that closed on its own meanwhile
            pass
    try:
        page.locator(".toast-body").first.wait_for(state="detached", timeout=15_000)
    except Exception:
        page.reload(wait_until="domcontentloaded")
        page.get_by_role("tab", name="Overview").wait_for(timeout=180_000)


@pytest.mark.parametrize("spec", APPS, ids=lambda s: s.key)
def test_app_tab_runs_its_example(page, spec):
    _dismiss_toasts(page)
    page.get_by_role("tab", name=spec.title, exact=True).click()
    button = page.locator(f"#{spec.key}-example")
    button.wait_for(state="visible", timeout=60_000)
    _shot(page, f"{spec.key}-before")
    button.click()
    status = page.locator(f"#{spec.key}-status")
    # Wait until the status shows the expected text, or until Gradio shows an error (then fail at once).
    try:
        outcome = page.wait_for_function(
            """([sel, want]) => {
                const el = document.querySelector(sel);
                if (el && el.innerText.includes(want)) return "done";
                if (document.querySelector('.toast-body.error')) return "error";
                return false;
            }""",
            arg=[f"#{spec.key}-status", spec.example_expect],
            timeout=EXAMPLE_TIMEOUT_MS,
        ).json_value()
    finally:
        _shot(page, f"{spec.key}-after")
    assert outcome == "done", f"{spec.title} example failed: {_visible_errors(page)} / status: {status.inner_text()!r}"
    assert re.search(re.escape(spec.example_expect), status.inner_text())
    assert not _visible_errors(page), _visible_errors(page)
    assert not page.page_errors, page.page_errors
