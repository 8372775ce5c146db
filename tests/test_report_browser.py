"""The HTML report in headless Chromium: no console errors, no network request, the headline and every
finding visible, injected kernel names shown as text; a screenshot of each goes to test-artifacts/.

Needs Debian's ``chromium`` (``apt-get install -y chromium``) and Playwright's Python package
(``pip install playwright``; its own browser download is not used)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import ROOT
from test_report import EVIL_KERNEL, VARIANTS, _analysis, _evil_set, _present

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("TRACEINSPECT_CHROMIUM", "/usr/bin/chromium")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = ROOT / "test-artifacts"


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    exe = CHROMIUM if Path(CHROMIUM).is_file() else shutil.which("chromium")
    if not exe:
        pytest.skip(f"chromium not found at {CHROMIUM} (apt-get install -y chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=ARGS)
        yield b
        b.close()


def open_report(browser, path: Path, shot: str | None = None) -> tuple[object, dict[str, list[str]]]:
    """Load a report from disk with every request checked: only file: and data: URLs may load.
    Returns the page and what went wrong (console errors, page errors, network requests, dialogs)."""
    seen: dict[str, list[str]] = {"console": [], "pageerror": [], "network": [], "dialog": []}
    page = browser.new_page(viewport={"width": 1280, "height": 900})

    def route(r):
        url = r.request.url
        if url.startswith(("file:", "data:", "about:")):
            r.continue_()
        else:
            seen["network"].append(url)
            r.abort()

    page.route("**/*", route)
    page.on("console", lambda m: seen["console"].append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: seen["pageerror"].append(str(e)))
    page.on("request", lambda r: None if r.url.startswith(("file:", "data:", "about:"))
            else seen["network"].append(r.url))

    def dialog(d):
        seen["dialog"].append(d.message)
        d.dismiss()

    page.on("dialog", dialog)
    page.goto(path.resolve().as_uri(), wait_until="load")
    page.wait_for_timeout(150)
    if shot:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
    return page, seen


@pytest.mark.parametrize("variant", VARIANTS)
def test_report_in_chromium(browser, variant: str, tmp_path: Path) -> None:
    from traceinspect.render.html import write_html

    a = _analysis(_present(variant))
    doc = a.to_json()
    path = write_html(a, tmp_path / f"{variant}.html", doc)
    page, seen = open_report(browser, path, shot=f"report-{variant}.png")
    try:
        assert seen["network"] == [], seen["network"]
        assert seen["console"] == [] and seen["pageerror"] == [], seen
        assert seen["dialog"] == []
        head = page.locator("#headline")
        assert head.is_visible()
        findings = doc["findings"]
        if findings:
            assert findings[0]["title"] in head.inner_text()
        cards = page.locator("article.card")
        assert cards.count() == len(findings)
        for i, f in enumerate(findings):
            card = page.locator(f"#f-{i}")
            assert card.is_visible()
            text = card.inner_text()
            assert f["title"] in text and f["rule"] in text
        # the charts are drawn (inline SVG), one lane label per rank in the timeline
        assert page.locator("svg.chart").count() >= 3
        for r in doc["ranks"]:
            assert page.locator("#breakdown ~ svg.chart text", has_text=r["label"]).count() >= 1
        # the table sorter works: sorting by calls puts the largest count first
        table = page.locator("#kernel-table")
        table.locator("th", has_text="calls").click()
        calls = [int(c) for c in table.locator("tbody tr td:nth-child(5)").all_inner_texts()]
        assert calls == sorted(calls, reverse=True)
        embedded = json.loads(page.locator("#traceinspect-analysis").text_content())
        assert embedded["schema"] == doc["schema"]
    finally:
        page.close()


def test_injected_kernel_name_renders_as_text(browser, tmp_path: Path) -> None:
    from traceinspect.analysis import analyze
    from traceinspect.render.html import write_html

    d, _, _ = _evil_set(tmp_path)
    a = analyze(str(d))
    path = write_html(a, tmp_path / "evil.html")
    page, seen = open_report(browser, path, shot="report-injection.png")
    try:
        assert seen["dialog"] == [], "a script from the trace ran"
        assert seen["console"] == [] and seen["pageerror"] == [] and seen["network"] == [], seen
        cell = page.locator("#kernel-table td.kname", has_text=EVIL_KERNEL)
        assert cell.count() >= 1 and cell.first.inner_text() == EVIL_KERNEL
        # only the report's own two script elements exist
        assert page.locator("script").count() == 2
    finally:
        page.close()


def test_harness_catches_requests_errors_and_scripts(browser, tmp_path: Path) -> None:
    """The checks above can fail: a page that loads a remote image, logs an error and opens a dialog
    is caught on all three counts."""
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><img src="https://example.invalid/x.png">'
                   '<script>console.error("boom"); alert(1);</script></body></html>')
    page, seen = open_report(browser, bad)
    page.close()
    assert any(u.startswith("https://example.invalid/") for u in seen["network"])
    assert any("boom" in m for m in seen["console"])
    assert seen["dialog"] == ["1"]
