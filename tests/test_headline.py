"""One story in every output: on every fixture and every public real trace, the terminal summary, the
HTML banner and the Markdown summary lead with the same finding and the same saving, and the share and
size figures of each finding's message are the ones its evidence shows."""

from __future__ import annotations

import html as _html
import io
import re

import pytest
from conftest import FIXTURES, REAL_TRACES, real_trace

from traceinspect.errors import TraceInputError

BINARY_UNITS = re.compile(r"\b\d[\d,.]*\s?(?:KiB|MiB|GiB|TiB)\b")
STEP_SHARE = re.compile(r"(\d+(?:\.\d)?%) of the (?:[\d.,]+ [µm]s )?step time")
SIZE = re.compile(r"\b(\d[\d,.]*) (kB|MB|GB|TB)\b")
TAG = re.compile(r"<[^>]+>")


def _fixture_sets() -> list[str]:
    names = sorted(p.name for p in FIXTURES.iterdir() if (p / "manifest.json").is_file())
    rt = FIXTURES / "rule-tests"
    names += sorted(f"rule-tests/{p.name}" for p in rt.iterdir() if p.is_dir()) if rt.is_dir() else []
    return names


def _real_sets() -> list[str]:
    """Every trace under shared/real-traces: single files, and directories of rank files as one set."""
    if not REAL_TRACES.is_dir():
        return ["(real traces absent)"]
    out = [p.name for p in sorted(REAL_TRACES.glob("*.json.gz"))]
    for d in sorted(p for p in REAL_TRACES.rglob("*") if p.is_dir()):
        if any(c.is_file() and c.name.endswith((".json.gz", ".json")) for c in d.iterdir()):
            out.append(d.relative_to(REAL_TRACES).as_posix())
    return out


SETS = [f"fixtures/{n}" for n in _fixture_sets()] + [f"real/{n}" for n in _real_sets()]
_CACHE: dict[str, tuple[object, dict]] = {}


def _analysis(key: str):
    if key in _CACHE:
        return _CACHE[key]
    from traceinspect.analysis import analyze

    kind, name = key.split("/", 1)
    path = FIXTURES / name if kind == "fixtures" else real_trace(name)
    err = None
    for phase in ("decode", "all"):
        try:
            a = analyze(str(path), phase=phase, jobs=1)
        except TraceInputError as e:  # a trace the loader refuses, or one without steps of this phase
            err = e
            continue
        _CACHE[key] = (a, a.to_json())
        return _CACHE[key]
    pytest.skip(f"{name}: not analysable: {err.one_line() if err else ''}")


def _terminal(a, doc) -> str:
    from rich.console import Console

    from traceinspect.render.terminal import render

    buf = io.StringIO()
    render(doc, Console(file=buf, width=220, highlight=False, soft_wrap=True, color_system=None))
    return buf.getvalue()


def _text(fragment: str) -> str:
    return " ".join(_html.unescape(TAG.sub(" ", fragment)).split())


def _between(page: str, start: str, end: str) -> str:
    i = page.index(start)
    return page[i:page.index(end, i)]


@pytest.mark.parametrize("key", SETS)
def test_every_output_leads_with_the_same_finding(key: str) -> None:
    from traceinspect.render.html import render_html
    from traceinspect.render.markdown import render_markdown
    from traceinspect.render.story import saving_text, story

    a, doc = _analysis(key)
    st = story(doc)
    term = _terminal(a, doc)
    page = render_html(doc)
    md = render_markdown(doc)
    banner = _between(page, '<section class="headline"', "</section>")
    banner_text = _text(banner)
    md_lead = "\n".join(md.splitlines()[:3])
    for out in (term, page, md):
        assert not BINARY_UNITS.search(out), BINARY_UNITS.search(out)

    if st.lead is None:
        assert doc["findings"] == []
        assert st.quiet in term and st.quiet in banner_text and "no findings" in md_lead
        return
    lead = st.lead
    # the terminal's first severity line, the banner's rule and the Markdown head name the same finding
    first = next(line for line in term.splitlines() if re.match(r"^(CRITICAL|WARNING|INFO) ", line))
    assert first.split()[1].rstrip(":") == lead["rule"], first
    assert re.search(r'<span class="rule">([^<]*)</span>', banner).group(1) == lead["rule"]
    assert f"`{lead['rule']}`" in md_lead and lead["title"] in _html.unescape(md_lead).replace("\\", "")
    # ... with the same saving, in the same words and units
    if st.saving:
        assert st.saving in first and st.saving in banner_text and st.saving in _html.unescape(md_lead), st.saving
    # the lead is the most severe finding with the largest saving among those
    sev = {"critical": 0, "warning": 1, "info": 2}
    # (among the top-level findings: one that shares a parent's cause is listed under that parent)
    assert all(sev[lead["severity"]] <= sev[f["severity"]] for f in doc["findings"]
               if not (f.get("group") or {}).get("parent")), [(f["rule"], f.get("group")) for f in doc["findings"]]

    # every finding: its message's shares of the step and sizes are figures its card (facts and evidence) shows
    for i, f in enumerate(st.findings):
        card = _text(_between(page, f'<article class="card" id="f-{i}"', "</article>"))
        assert f["rule"] in card
        for pct in STEP_SHARE.findall(f["message"]):
            assert pct in card.replace(f["message"], ""), (f["rule"], pct, card)
        for num, unit in SIZE.findall(f["message"]):
            assert f"{num} {unit}" in card.replace(f["message"], ""), (f["rule"], num, unit)
        text = saving_text(f, doc)
        if text:
            assert text in term
            share = text.split("(")[-1].split(" of")[0]
            assert share in card


def test_the_story_is_one_order_and_places_what_no_finding_explains() -> None:
    """The order is severity first, then saving; unexplained classes and undecided rules from the
    analysis are shown beside the headline in all three outputs."""
    from traceinspect.render.html import render_html
    from traceinspect.render.markdown import render_markdown
    from traceinspect.render.story import ordered_findings

    fs = [{"rule": "a", "severity": "warning", "est_saving_us_per_step": 900.0},
          {"rule": "b", "severity": "critical", "est_saving_us_per_step": 10.0},
          {"rule": "c", "severity": "warning", "est_saving_us_per_step": None},
          {"rule": "d", "severity": "warning", "est_saving_us_per_step": 901.0}]
    assert [f["rule"] for f in ordered_findings(fs)] == ["b", "d", "a", "c"]

    a, doc = _analysis("fixtures/kv-full-cast-graph")
    doc = dict(doc, unexplained=[{"cls": "dtype_cast", "share": 0.69, "explain_with": "shapes of the casts"}],
               undecided=[{"rule": "kv-full-pool-cast", "share": 0.4, "missing": ["kv_pool_tokens"],
                           "how_to_supply": ["save server_info.json beside the traces"]}])
    term, page, md = _terminal(a, doc), render_html(doc), render_markdown(doc)
    banner = _text(_between(page, '<section class="headline"', "</section>"))
    head = term.split("Ranks (per step")[0]
    md_head = md.split("| | |")[0]
    for out in (head, banner, _html.unescape(md_head).replace("\\", "")):
        assert "Unexplained: dtype_cast" in out and "shapes of the casts" in out
        assert "Undecided: kv-full-pool-cast" in out and "save server_info.json beside the traces" in out
        assert "['" not in out  # lists read as phrases
    # the undecided share (of GPU time in the analysis) is shown as a share of the step time
    from traceinspect.render.story import gpu_to_step_share
    from traceinspect.units import fmt_pct

    kernel = sum(v["us_per_step"] for v in doc["classes"].values())
    assert gpu_to_step_share(0.4, doc) == pytest.approx(0.4 * kernel / doc["steps"]["median_us"])
    assert f"at stake: {fmt_pct(gpu_to_step_share(0.4, doc))} of the step time" in banner


def test_host_sync_estimate_never_exceeds_the_idle_it_removes() -> None:
    """A rule that removes GPU idle time (host-sync, launch-bound) claims at most the idle inside the step."""
    for key in SETS:
        if not key.startswith("fixtures/"):
            continue
        a, doc = _analysis(key)
        idle = max(r["idle_us"] for r in doc["ranks"])
        for f in doc["findings"]:
            if f["rule"] in ("host-sync", "launch-bound") and f["est_saving_us_per_step"] is not None:
                # the rule's own estimate is capped at the idle; the replayed saving may be larger (removing host
                # gaps also removes the collective waits they caused) but never more than the replayed step
                local = f["evidence"]["rule_estimate_us_per_step"]
                assert local <= idle + 0.5, (key, f["rule"], local, idle)
                assert f["est_saving_us_per_step"] <= f["evidence"]["replayed_step_us"], (key, f["rule"])
                assert "time(s)" not in f["message"] and not re.search(r"\b\d+\.0 (?:device|gaps|kernels)",
                                                                        f["message"])


def test_units_are_chosen_once() -> None:
    from traceinspect.units import fmt_bytes, fmt_count

    assert fmt_bytes(906e6) == "906 MB" and fmt_bytes(301989888) == "302 MB" and fmt_bytes(3.02e7) == "30.2 MB"
    assert fmt_bytes(1.5e9) == "1.5 GB" and fmt_bytes(999.6e6) == "1 GB" and fmt_bytes(512) == "512 B"
    assert fmt_count(1.0) == "1" and fmt_count(0.0) == "0" and fmt_count(1.5) == "1.5" and fmt_count(390.1) == "390"


def test_kernel_labels_stay_distinct() -> None:
    from traceinspect.render import kernel_label, kernel_labels

    cast = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
            "::{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(%s)#1}, std::array<char*,"
            " 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
            "at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int, %s)")
    a, b = cast % ("c10::BFloat16", "x"), cast % ("c10::Float8_e4m3fn", "x")
    assert "λ(BFloat16)" in kernel_label(a, 72) and len(kernel_label(a, 72)) <= 72
    labels = kernel_labels([a, b, a.replace("(int, x)", "(int, y)")], 72)
    assert len(set(labels.values())) == 3
    assert "Float8_e4m3fn" in labels[b]
    assert kernel_label("nvjet_sm90_tst_64x24_64x16_4x2_h_bz_NNT") == "nvjet_sm90_tst_64x24_64x16_4x2_h_bz_NNT"


def test_real_trace_sets_are_listed() -> None:
    """The parametrised sets include every file of shared/real-traces (they are looked up, not assumed)."""
    if not REAL_TRACES.is_dir():
        pytest.skip("real traces absent")
    real = [k for k in SETS if k.startswith("real/")]
    assert any(k.endswith("param__dlrm_8rank") for k in real)
    assert sum(1 for k in real if k.endswith(".json.gz")) >= 5
    assert all((REAL_TRACES / k[5:]).exists() for k in real)
