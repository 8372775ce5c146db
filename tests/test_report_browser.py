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
    path = write_html(doc, tmp_path / f"{variant}.html")
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
        table.locator("th", has_text="calls").first.click()
        calls = [int(c.replace(",", "")) for c in table.locator("tbody tr td:nth-child(5)").all_inner_texts()]
        assert calls == sorted(calls, reverse=True)
        embedded = json.loads(page.locator("#traceinspect-analysis").text_content())
        assert embedded["schema"] == doc["schema"]
    finally:
        page.close()


def test_injected_kernel_name_renders_as_text(browser, tmp_path: Path) -> None:
    from traceinspect.pipeline import analyze
    from traceinspect.render.html import write_html

    d, _, _ = _evil_set(tmp_path)
    a = analyze(str(d))
    path = write_html(a.to_json(), tmp_path / "evil.html")
    page, seen = open_report(browser, path, shot="report-injection.png")
    try:
        assert seen["dialog"] == [], "a script from the trace ran"
        assert seen["console"] == [] and seen["pageerror"] == [] and seen["network"] == [], seen
        cell = page.locator("#kernel-table td.kname", has_text=EVIL_KERNEL)
        assert cell.count() >= 1 and cell.first.inner_text() == EVIL_KERNEL
        # only the report's own script elements exist: the analysis JSON, the timeline data (and the replayed
        # after-fix timeline's), the code
        types = page.eval_on_selector_all("script", "els => els.map(e => e.type || 'js')")
        after = page.locator("#timeline-after-data").count()
        assert sorted(types) == ["application/json"] * (2 + after) + ["js"], types
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


# ----------------------------------------------------------------------------- timeline and tables

def _png_rgb(data: bytes) -> tuple[int, int, list[bytes]]:
    """Decode an 8-bit RGB/RGBA PNG (what Chromium writes) with the standard library: (width, height,
    rows of RGB bytes)."""
    import struct
    import zlib

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, w = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and ctype in (2, 6), (depth, ctype)
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw = zlib.decompress(idat)
    stride = w * bpp
    rows, prev = [], bytearray(stride)
    for y in range(h):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b = prev[i]
            c = prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + ((a + b) >> 1)) & 255
            elif f == 4:
                p_ = a + b - c
                pa, pb, pc = abs(p_ - a), abs(p_ - b), abs(p_ - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line) if bpp == 3 else bytes(v for j, v in enumerate(line) if j % 4 != 3))
        prev = line
    return w, h, rows


@pytest.fixture(scope="module")
def eager_report(tmp_path_factory):
    from traceinspect.render.html import write_html

    a = _analysis(_present("kv-full-cast-eager"))
    doc = a.to_json()
    path = write_html(doc, tmp_path_factory.mktemp("tl") / "eager.html")
    return a, doc, path


def test_timeline_shows_the_idle_of_a_long_eager_step(browser, eager_report) -> None:
    """The painted busy fraction of each rank's lane, measured on a screenshot, is the JSON's busy time
    of that step over its span, within 5 points: idle time shows as empty lane."""
    _, doc, path = eager_report
    page, seen = open_report(browser, path)
    try:
        assert seen["console"] == [] and seen["pageerror"] == [] and seen["network"] == [], seen
        root = page.locator("#timeline-main")
        ARTIFACTS.mkdir(exist_ok=True)
        png = root.locator("canvas").screenshot(path=str(ARTIFACTS / "timeline-eager.png"))
        w, h, rows = _png_rgb(png)
        geo = page.evaluate("() => { const t = document.getElementById('timeline-main').timeline;"
                            " return {L: t.L, R: t.R, TOP: t.TOP, GAP: t.GAP, LH: t.LH,"
                            " lanes: t.data.lanes.map(l => l.rank), marks: t.data.marks, span: t.data.span,"
                            " dpr: window.devicePixelRatio}; }")
        assert geo["dpr"] == 1
        bg = bytes.fromhex("eef0f3")
        tl = {r["rank"]: r for r in doc["timeline"]["ranks"]}
        marks = {m["rank"]: m for m in geo["marks"]}
        plot_w = w - geo["L"] - geo["R"]
        fracs: list[float] = []
        for i, rank in enumerate(geo["lanes"]):
            expect = tl[rank]["busy_us"] / tl[rank]["span_us"]
            m = marks[rank]
            x0 = geo["L"] + round(m["start"] / geo["span"] * plot_w) + 1
            x1 = geo["L"] + round(m["end"] / geo["span"] * plot_w) - 1
            y0 = geo["TOP"] + i * (geo["LH"] + geo["GAP"])
            painted = total = 0
            for y in range(y0, y0 + geo["LH"]):
                row = rows[y]
                for x in range(x0, x1):
                    total += 1
                    painted += row[3 * x:3 * x + 3] != bg
            frac = painted / total
            assert abs(frac - expect) <= 0.05, (rank, frac, expect)
            fracs.append(frac)
        # the step has much idle time: a lane drawn solid would have failed the check above
        assert min(fracs) < 0.5 and max(fracs) < 0.8, fracs
    finally:
        page.close()


def test_timeline_zoom_hover_table_sort_filter_and_csv_download(browser, eager_report, tmp_path: Path) -> None:
    a, doc, path = eager_report
    from traceinspect.render.tables import report_tables, to_csv

    page, seen = open_report(browser, path)
    try:
        root = page.locator("#timeline-main")
        span = float(root.get_attribute("data-v1"))
        root.locator("button[data-act=in]").click()
        root.locator("button[data-act=in]").click()
        v0, v1 = float(root.get_attribute("data-v0")), float(root.get_attribute("data-v1"))
        assert v1 - v0 == pytest.approx(span / 4, rel=1e-6)
        box = root.locator("canvas").bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + 30)
        page.mouse.wheel(0, -300)
        # the wheel event is handled when the page gets to it: wait for the zoom (30 s only bounds a hang)
        page.wait_for_function("w => { const d = document.getElementById('timeline-main').dataset; "
                               "return parseFloat(d.v1) - parseFloat(d.v0) < w; }", arg=v1 - v0, timeout=30_000)
        assert float(root.get_attribute("data-v1")) - float(root.get_attribute("data-v0")) < (v1 - v0)
        root.locator("canvas").dblclick()
        assert float(root.get_attribute("data-v1")) == pytest.approx(span)
        # hover the longest kernel of the first lane: the tip names it, its class, duration and shapes
        target = page.evaluate("""() => { const t = document.getElementById('timeline-main').timeline, l = t.data.lanes[0];
            let j = 0; l.dur.forEach((d, i) => { if (d > l.dur[j]) j = i; });
            return {x: t.xOf(l.ts[j] + l.dur[j] / 2), y: t.TOP + t.LH / 2, name: t.data.names[l.name[j]],
                    cls: t.data.classes[l.cls[j]], dur: l.dur[j]}; }""")
        page.mouse.move(box["x"] + target["x"], box["y"] + target["y"])
        tip = root.locator(".ti-tip")
        assert tip.is_visible()
        text = tip.inner_text()
        assert target["name"] in text and target["cls"] in text and "shapes:" in text
        from traceinspect.units import fmt_us

        assert fmt_us(target["dur"]).replace(" ", "\u00a0") in text.replace(" ", "\u00a0")
        # tables: sort by calls, filter by a class, download the CSV and compare it with --csv's
        table = page.locator("#kernel-table")
        table.locator("th", has_text="calls").first.click()
        calls = [int(c.replace(",", "")) for c in table.locator("tbody tr td:nth-child(5)").all_inner_texts()]
        assert calls == sorted(calls, reverse=True)
        page.locator("input.tfilter[data-for=kernel-table]").fill("kv_cast")
        visible = table.locator("tbody tr:visible")
        assert visible.count() >= 1 and all("kv_cast" in t for t in visible.all_inner_texts())
        with page.expect_download() as dl:
            page.locator("a.csv[download='kernels.csv']").click()
        got = Path(dl.value.path()).read_text()
        assert got == to_csv(report_tables(doc)["kernels"])
        assert got.splitlines()[0].startswith("name,cls,launched_by,calls")
        assert seen["network"] == [] and seen["console"] == [] and seen["pageerror"] == [], seen
    finally:
        page.close()


def test_after_fix_timeline_beside_the_measured_one(browser, tmp_path: Path) -> None:
    """The top finding's replayed fix is drawn as a second timeline on the measured step's axis, shorter
    by the replayed saving, and the all-fixed step is shown under the findings."""
    from traceinspect.render.html import write_html

    a = _analysis(_present("kv-full-cast-graph"))
    doc = a.to_json()
    path = write_html(doc, tmp_path / "after.html")
    page, seen = open_report(browser, path, shot="report-after-fix.png")
    try:
        assert seen["console"] == [] and seen["pageerror"] == [] and seen["network"] == [], seen
        assert page.locator("#timeline-after canvas").is_visible()
        geo = page.evaluate("() => { const m = document.getElementById('timeline-main').timeline.data,"
                            " f = document.getElementById('timeline-after').timeline.data;"
                            " return {ms: m.span, fs: f.span, mend: Math.max(...m.marks.map(x => x.end)),"
                            " fend: Math.max(...f.marks.map(x => x.end))}; }")
        assert geo["fs"] == pytest.approx(geo["ms"], rel=1e-3)  # one time axis
        assert geo["fend"] < 0.7 * geo["mend"]  # the gather-then-cast replay ends much earlier
        assert "All findings fixed together" in page.locator("#all-fixed").inner_text()
        assert "gather-then-cast" in page.locator("#f-0").inner_text()
    finally:
        page.close()


@pytest.mark.parametrize("variant", ["moe-small-m-eager", "kv-full-cast-graph"])
def test_roofline_chart_plots_every_kernel_row_with_shapes(browser, variant: str, tmp_path: Path) -> None:
    """One point per GEMM and attention row with a roofline floor and FLOPs, each with its name on hover,
    under the roofs of the dtypes present."""
    from traceinspect.render.html import write_html

    doc = _analysis(_present(variant)).to_json()
    rows = [r for key in ("gemm", "attention") for r in doc[key]
            if r.get("floor_us") is not None and r.get("intensity") and r.get("tflops")]
    assert rows
    path = write_html(doc, tmp_path / f"roofline-{variant}.html")
    page, seen = open_report(browser, path)
    try:
        assert seen["console"] == [] and seen["pageerror"] == [], seen
        chart = page.locator("#roofline-chart svg.chart")
        assert chart.is_visible()
        pts = chart.locator("circle.roof-pt")
        assert pts.count() == len(rows)
        titles = [t for t in chart.locator("circle.roof-pt title").all_text_contents()]
        assert all("FLOP/byte" in t and "of roofline" in t for t in titles)
        dtypes = {r["dtype"] for r in rows if r.get("dtype") in (doc["gpu"].get("peak_tflops") or {})}
        assert chart.locator("path.roof").count() == len(dtypes) >= 1
        # the table beside it: one row per kernel row with a floor (GEMM, attention, memory), at most 40
        n = sum(1 for key in ("gemm", "attention", "memory_bound") for r in doc[key] if r.get("floor_us") is not None)
        assert page.locator("#roofline-table tbody tr").count() == min(n, 40)
    finally:
        page.close()
