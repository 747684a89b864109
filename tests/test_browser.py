"""Drive the demo hub in headless Chromium: every tab, every bundled example, no error shown.

Starts ``python -m apps`` (what ``make demo`` serves) on a free port, opens it with Playwright in Debian's
Chromium, and for each registered app clicks its example button (``#<key>-example``) and waits for its status
output (``#<key>-status``) to show the app's expected text. Then it waits until every image, plot, gallery and video
that the example fills (read from the hub's Gradio config) has rendered in the tab, checks that each shows
something (an image of more than one colour, a video with frames), and only then takes the "after" screenshot.
Every tab's visible text must also be drawn with real glyphs, not the empty boxes of a missing font (the NCAL tab
shows Chinese: Debian's ``fonts-noto-cjk``, which ``.ci/run`` installs). Screenshots go to ``artifacts/screenshots/``.
"""

from __future__ import annotations

import json
import os
import re
import urllib.request
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
RENDER_TIMEOUT_MS = 60_000  # after the status says done, the outputs' images must appear within this
MEDIA_TYPES = ("image", "plot", "gallery", "video")  # Gradio output components that show pictures
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
def hub_config(hub_url):
    """The served app's Gradio config: its components and event dependencies."""
    with urllib.request.urlopen(hub_url + "config", timeout=60) as r:
        return json.loads(r.read().decode())


def media_outputs(config: dict, key: str) -> list[str]:
    """Types of the picture outputs (image, plot, gallery, video) that clicking ``#<key>-example`` fills.

    Follows the dependencies the button triggers and those chained after them (``.then``).
    """
    comps = {c["id"]: c for c in config["components"]}
    buttons = {i for i, c in comps.items() if c.get("props", {}).get("elem_id") == f"{key}-example"}
    deps = config["dependencies"]
    chosen = {d["id"] for d in deps if any(t[0] in buttons for t in d["targets"])}
    grew = True
    while grew:  # add the dependencies chained after a chosen one
        more = {d["id"] for d in deps if d.get("trigger_after") in chosen} - chosen
        chosen |= more
        grew = bool(more)
    outputs = sorted({o for d in deps if d["id"] in chosen for o in d["outputs"]})
    return [comps[o]["type"] for o in outputs if comps[o]["type"] in MEDIA_TYPES]


# Runs in the page: scroll unloaded pictures into view (Gradio loads images lazily), and report every <img> and
# <video> of the tab: loaded or not, size, and how many distinct colours a 64x64 sample of an image has.
_MEDIA_JS = """(key) => {
    const root = document.querySelector('#tab-' + key);
    if (!root) return null;
    const out = [];
    for (const el of root.querySelectorAll('img, video')) {
        if (el.tagName === 'IMG') {
            const ok = el.complete && el.naturalWidth > 0;
            if (!ok) { el.scrollIntoView({block: 'center'}); out.push({tag: 'img', loaded: false}); continue; }
            let colours = -1;
            try {
                const c = document.createElement('canvas'); c.width = 64; c.height = 64;
                const g = c.getContext('2d'); g.drawImage(el, 0, 0, 64, 64);
                const px = g.getImageData(0, 0, 64, 64).data; const seen = new Set();
                for (let i = 0; i < px.length; i += 4) seen.add((px[i] << 16) | (px[i + 1] << 8) | px[i + 2]);
                colours = seen.size;
            } catch (e) { colours = -2; }
            out.push({tag: 'img', loaded: true, w: el.naturalWidth, h: el.naturalHeight, colours: colours});
        } else {
            const ok = el.readyState >= 1 && el.videoWidth > 0;
            if (!ok) el.scrollIntoView({block: 'center'});
            out.push({tag: 'video', loaded: ok, w: el.videoWidth, h: el.videoHeight, duration: el.duration || 0});
        }
    }
    return out;
}"""


# Runs in the page: which characters of the visible text under `sel` (text nodes and the values of inputs) Chromium
# draws with no glyph. A missing glyph is drawn as the font's "missing glyph" box (.notdef), the same box that an
# unassigned code point gets, since no font has a glyph for one. So each distinct non-ASCII character is drawn on a
# canvas in its element's font and compared, pixel by pixel and by advance width, with U+0378 (unassigned) in the
# same font: identical means the character has no glyph. Canvas text goes through the same font matching and
# fallback as the page's text. (The DevTools call CSS.getPlatformFontsForNode was not enough: it names the fonts that
# drew a node and their glyph counts, but a missing glyph counts as a glyph of the primary font, so tofu and real
# text look the same there.) Combining marks, format characters and spaces draw nothing and are skipped.
_GLYPHS_JS = r"""(sel) => {
    const root = document.querySelector(sel);
    if (!root) return null;
    const W = 96, H = 64;
    const canvas = Object.assign(document.createElement('canvas'), {width: W, height: H});
    const g = canvas.getContext('2d', {willReadFrequently: true});
    const draw = (font, ch) => {
        g.clearRect(0, 0, W, H);
        g.font = font; g.fillStyle = '#000'; g.textBaseline = 'middle'; g.fillText(ch, 8, H / 2);
        return {w: g.measureText(ch).width, px: g.getImageData(0, 0, W, H).data};
    };
    const same = (a, b) => a.w === b.w && a.px.every((v, i) => v === b.px[i]);
    const items = [];
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let n = walker.nextNode(); n; n = walker.nextNode()) {
        const el = n.parentElement;
        if (el && n.data.trim() && el.checkVisibility({visibilityProperty: true})) items.push([el, n.data]);
    }
    for (const el of root.querySelectorAll('input, textarea'))
        if (el.value && el.checkVisibility({visibilityProperty: true})) items.push([el, el.value]);
    const refs = new Map(), seen = new Set(), checked = new Set(), missing = [];
    for (const [el, text] of items) {
        const cs = getComputedStyle(el);
        const font = `${cs.fontStyle} ${cs.fontWeight} 32px ${cs.fontFamily}`;
        if (!refs.has(font)) refs.set(font, draw(font, '\u0378'));
        for (const ch of text) {  // code points, not UTF-16 units
            if (ch.codePointAt(0) < 128 || /[\p{M}\p{Cf}\p{Z}\s]/u.test(ch) || seen.has(font + ch)) continue;
            seen.add(font + ch);
            checked.add(ch);
            if (same(draw(font, ch), refs.get(font)))
                missing.push({char: ch, code: 'U+' + ch.codePointAt(0).toString(16).toUpperCase().padStart(4, '0'),
                              text: text.trim().slice(0, 60), font: cs.fontFamily});
        }
    }
    return {checked: [...checked].join(''), missing: missing};
}"""


def _glyph_report(page, sel: str = "body") -> dict:
    """``{"checked": the distinct non-ASCII characters looked at, "missing": [one entry per character drawn
    without a glyph: its code point, its text and font]}``."""
    report = page.evaluate(_GLYPHS_JS, sel)
    assert report is not None, f"no element {sel!r} on the page"
    return report


def _assert_glyphs_drawn(page, where: str) -> str:
    """Fail, naming the characters and their text, when visible text is drawn with missing glyphs; return the
    characters checked."""
    report = _glyph_report(page)
    by_text: dict[str, str] = {}  # text -> its characters without a glyph
    for m in report["missing"]:
        if m["char"] not in by_text.get(m["text"], ""):
            by_text[m["text"]] = by_text.get(m["text"], "") + m["char"]
    assert not by_text, (
        f"{where}: {len({m['char'] for m in report['missing']})} distinct characters are drawn as empty boxes, no "
        f"installed font has them (for Chinese install Debian's fonts-noto-cjk, as .ci/run does). Text: "
        + "; ".join(f"{t!r} lacks {c}" for t, c in list(by_text.items())[:10])
    )
    return report["checked"]


def _wait_for_media(page, key: str, expected: list[str]) -> list[dict]:
    """Wait until the tab holds at least one loaded picture per expected output (videos as videos); return them."""
    want_videos = expected.count("video")
    want_images = len(expected) - want_videos
    page.wait_for_function(
        "([key, js, nImg, nVid]) => { const m = eval(js)(key); if (!m) return false;"
        " const img = m.filter(e => e.tag === 'img' && e.loaded).length;"
        " const vid = m.filter(e => e.tag === 'video' && e.loaded).length;"
        " return img >= nImg && vid >= nVid && m.every(e => e.loaded); }",
        arg=[key, _MEDIA_JS, want_images, want_videos],
        timeout=RENDER_TIMEOUT_MS,
    )
    return page.evaluate(_MEDIA_JS, key)


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
    _assert_glyphs_drawn(page, "Overview")
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


def test_glyph_check_tells_tofu_from_text(browser):
    """The missing-glyph check flags a character no font has and passes characters every font here has."""
    context = browser.new_context()
    try:
        p = context.new_page()
        p.set_content('<p id="ok">caf\u00e9 \u221e-Video \u2013 \u00d7</p><p id="bad">x\u0379y</p>'
                      '<input id="field" value="\u0380">')
        assert _glyph_report(p, "#ok") == {"checked": "\u00e9\u221e\u2013\u00d7", "missing": []}
        bad = _glyph_report(p, "#bad")
        assert [m["code"] for m in bad["missing"]] == ["U+0379"] and bad["missing"][0]["text"] == "x\u0379y"
        assert [m["code"] for m in _glyph_report(p, "body")["missing"]] == ["U+0379", "U+0380"]
    finally:
        context.close()


def test_media_outputs_reads_the_config():
    """The picture outputs are found from the config (a wrong lookup would silently expect nothing)."""
    config = {
        "components": [
            {"id": 1, "type": "button", "props": {"elem_id": "x-example"}},
            {"id": 2, "type": "image", "props": {}},
            {"id": 3, "type": "markdown", "props": {"elem_id": "x-status"}},
            {"id": 4, "type": "video", "props": {}},
            {"id": 5, "type": "plot", "props": {}},
            {"id": 6, "type": "button", "props": {"elem_id": "y-example"}},
        ],
        "dependencies": [
            {"id": 0, "targets": [[1, "click"]], "outputs": [2, 3], "trigger_after": None},
            {"id": 1, "targets": [], "outputs": [4], "trigger_after": 0},
            {"id": 2, "targets": [[6, "click"]], "outputs": [5], "trigger_after": None},
        ],
    }
    assert media_outputs(config, "x") == ["image", "video"]
    assert media_outputs(config, "y") == ["plot"]
    assert media_outputs(config, "z") == []


@pytest.mark.parametrize("spec", APPS, ids=lambda s: s.key)
def test_app_tab_runs_its_example(page, hub_config, spec):
    _dismiss_toasts(page)
    page.get_by_role("tab", name=spec.title, exact=True).click()
    button = page.locator(f"#{spec.key}-example")
    button.wait_for(state="visible", timeout=60_000)
    _shot(page, f"{spec.key}-before")
    button.click()
    status = page.locator(f"#{spec.key}-status")
    # Wait until the status shows the expected text, or until Gradio shows an error (then fail at once).
    expected = media_outputs(hub_config, spec.key)
    media: list[dict] = []
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
        if outcome == "done":
            media = _wait_for_media(page, spec.key, expected)
    finally:
        page.locator(f"#{spec.key}-status").scroll_into_view_if_needed()
        _shot(page, f"{spec.key}-after")
    assert outcome == "done", f"{spec.title} example failed: {_visible_errors(page)} / status: {status.inner_text()!r}"
    images = [m for m in media if m["tag"] == "img"]
    videos = [m for m in media if m["tag"] == "video"]
    assert len(videos) >= expected.count("video") and len(images) >= len(expected) - expected.count("video"), (
        f"{spec.title}: expected pictures for {expected}, the tab shows {media}"
    )
    for m in images:
        assert m["w"] > 1 and m["h"] > 1 and m["colours"] > 1, f"{spec.title}: an output image is blank or empty: {m}"
    for m in videos:
        assert m["w"] > 0 and m["h"] > 0 and m["duration"] > 0, f"{spec.title}: the output video has no frames: {m}"
    assert re.search(re.escape(spec.example_expect), status.inner_text())
    checked = _assert_glyphs_drawn(page, spec.title)
    if spec.key == "ncal":  # its example fills the text box and the class names with Chinese: the check saw them
        assert re.search(r"[\u4e00-\u9fff]", checked), f"NCAL: no Chinese character was checked ({checked!r})"
    assert not _visible_errors(page), _visible_errors(page)
    assert not page.page_errors, page.page_errors


@pytest.fixture(scope="module")
def own_models(tmp_path_factory):
    """Tiny model folders and files of every app's real architecture (or training output), as a user brings them."""
    from tests._own_models import write_own_models

    return write_own_models(tmp_path_factory.mktemp("own_models"))


def _own_field_ids(page, key: str) -> tuple[str, str]:
    """(run button, status) of the tab's own-model path: its own button/status where it has them, else the tab's."""
    run = f"#{key}-own-run" if page.locator(f"#{key}-own-run").count() else f"#{key}-run"
    status = f"#{key}-own-status" if page.locator(f"#{key}-own-status").count() else f"#{key}-status"
    return run, status


def _fill(page, elem_id: str, value: str) -> None:
    """Type ``value`` into a Gradio text field and leave it (Gradio takes the value on blur/change: a click on a
    button right after ``fill`` can otherwise send the old value)."""
    box = page.locator(f"#{elem_id} textarea, #{elem_id} input").first
    box.fill(value)
    box.press("Tab")
    page.wait_for_timeout(300)
    assert box.input_value() == value


OWN_APPS = [s for s in APPS if s.own_model]


@pytest.mark.parametrize("spec", OWN_APPS, ids=lambda s: s.key)
def test_app_tab_runs_your_own_model(page, own_models, spec, tmp_path):
    """Each tab with a real-model path answers with a model folder or file the user brings, and refuses a wrong
    folder with one line."""
    if spec.key not in own_models:
        pytest.fail(f"{spec.key}: no tiny own model written for its tab (tests/_own_models.py)")
    _dismiss_toasts(page)
    page.get_by_role("tab", name=spec.title, exact=True).click()
    tab = page.locator(f"#tab-{spec.key}")
    tab.get_by_text("Your own model", exact=False).first.click()
    page.locator(f"#{spec.key}-own-model").wait_for(state="visible", timeout=30_000)
    inputs = own_models[spec.key]
    for field, value in inputs.items():
        if field == "files":  # an upload field: the file chooser's input
            page.locator(f"#{spec.key}-files input[type=file]").set_input_files(value)
            page.wait_for_timeout(1500)  # let the upload finish
        else:
            _fill(page, f"{spec.key}-own-model" if field == "model" else f"{spec.key}-{field}", value)
    run, status_sel = _own_field_ids(page, spec.key)
    page.locator(run).click()
    # a tab without its own status field still shows the example's "Done: ..." there: wait for a finished status
    # that names the user's model (Gradio's "processing" overlay gone), or an error toast
    outcome = page.wait_for_function(
        """([sel]) => {
            const el = document.querySelector(sel);
            const text = el ? el.innerText : "";
            const ours = text.toLowerCase().includes("your") || text.includes("Done: read");
            if (ours && text.includes("Done") && !text.includes("processing")) return "done";
            if (document.querySelector('.toast-body.error')) return "error";
            return false;
        }""", arg=[status_sel], timeout=EXAMPLE_TIMEOUT_MS).json_value()
    _shot(page, f"{spec.key}-own-model")
    status = page.locator(status_sel).inner_text()
    assert outcome == "done", f"{spec.title} with your own model failed: {_visible_errors(page)} / status: {status!r}"
    assert "your" in status.lower() or "Done: read" in status, f"{spec.title}: the status does not say which model ran"
    assert not page.page_errors, page.page_errors
    # a wrong folder: one line saying what is accepted
    wrong = tmp_path / "not_a_model"
    wrong.mkdir()
    _fill(page, f"{spec.key}-own-model", ("hf:" if spec.key == "infinite_video" else "") + str(wrong))
    page.locator(run).click()
    page.locator(".toast-body.error").first.wait_for(timeout=120_000)
    errors = _visible_errors(page)
    assert errors and all("Traceback" not in e for e in errors), errors
    assert any(str(wrong.name) in e or "not" in e.lower() for e in errors), errors
    _dismiss_toasts(page)
