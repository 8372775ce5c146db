"""Every output tells the same story with the same numbers.

For every distinct trace set (the fixtures and the public field traces), the analysis is rendered once as
each output a user reads: the terminal summary, the Markdown summary, the HTML report, ``rules explain``,
``classify`` and ``whatif`` (the lead finding's replayed fix). The values are read back out of the rendered
texts and compared with the document's value formatted by :mod:`traceinspect.units`: the step time, each
class's time per step and share of the step time, each finding's saving and its share, each top kernel's
(name, class, calls) and share, and the headline finding.
"""

from __future__ import annotations

import io
import re
import shutil
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from tests.conftest import FIXTURES, REAL_TRACES, real_trace
from traceinspect.render import kernel_labels
from traceinspect.render.story import gap_share, saving_share, saving_text, share_of_step, story
from traceinspect.render.terminal import KERNEL_LABEL_WIDTH
from traceinspect.units import fmt_count, fmt_pct, fmt_pct_signed, fmt_us, fmt_us_signed

# every distinct fixture set (the drift copies are rank files of sets listed here; generate/ is the generator)
FIXTURE_SETS = sorted(d.name for d in FIXTURES.iterdir() if d.is_dir() and d.name not in ("generate", "drift",
                                                                                          "rule-tests"))
FIXTURE_SETS += sorted(f"rule-tests/{d.name}" for d in (FIXTURES / "rule-tests").iterdir() if d.is_dir())
SGLANG_DECODE = "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"
SGLANG_CAPTURE = "tracelens__inference__sglang_decode__capture_traces__bs_32_rank0.json.gz"
REAL_FILES = [
    "hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz",
    "pytorch__kineto__tb_plugin__samples__resnet50_num_workers_0__worker0.pt.trace.json.gz",
    "tracelens__b200__eager_trace.json.gz",
    "tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
    SGLANG_CAPTURE,
    SGLANG_DECODE,
    "tracelens__inference__sglang_prefilldecode__sglang_Qwen3-8B_prefilldecode.json.gz",
    "tracelens__inference__vllm_decode_full__graph_execution.json.gz",
]
SETS = ([f"fixture:{n}" for n in FIXTURE_SETS] + [f"real:{n}" for n in REAL_FILES]
        + ["real:param__dlrm_8rank", "real:sglang-decode-with-capture"])
SEVERITIES = ("CRITICAL", "WARNING", "INFO")


def _paths(set_id: str, tmp: Path) -> list[str]:
    kind, _, name = set_id.partition(":")
    if kind == "fixture":
        d = FIXTURES / name
        if not d.is_dir():
            pytest.skip(f"fixture {name} is not present")
        return [str(d)]
    if name == "sglang-decode-with-capture":
        decode, capture = real_trace(SGLANG_DECODE), real_trace(SGLANG_CAPTURE)
        d = tmp / "sglang-decode"
        (d / "graph_capture_profile").mkdir(parents=True)
        shutil.copy(decode, d / decode.name)
        shutil.copy(capture, d / "graph_capture_profile" / "cuda_graph_capture-bs_32-TP-0.json.gz")
        return [str(d)]
    return [str(real_trace(name))]


def _console() -> Console:
    return Console(file=io.StringIO(), record=True, width=4000, highlight=False, soft_wrap=False,
                   color_system=None)


class Rendered:
    """One trace set's analysis and every output of it, rendered once."""

    def __init__(self, set_id: str, tmp: Path) -> None:
        from traceinspect.commands.classify import classified_analysis, render_classify
        from traceinspect.commands.rules import render_explain
        from traceinspect.pipeline import Options, analyze
        from traceinspect.render.html import render_html
        from traceinspect.render.markdown import render_markdown
        from traceinspect.render.terminal import render

        paths = _paths(set_id, tmp)
        self.a = analyze(paths, Options(command="traceinspect analyze"))
        self.doc = self.a.to_json()
        con = _console()
        render(self.doc, con)
        self.terminal = con.export_text()
        self.markdown = render_markdown(self.doc)
        self.html = render_html(self.doc)
        con = _console()
        render_explain(self.a, self.a.rule_set, self.a.to_json(report=False), con)
        self.explain = con.export_text()
        ca, step_us, rank_steps = classified_analysis(tuple(paths), Options(command="traceinspect classify"))
        con = _console()
        self.classify_rows = render_classify(ca, step_us, rank_steps, con, limit=0)
        self.classify = con.export_text()
        self.whatif = self._whatif()

    def _whatif(self) -> tuple[dict[str, Any], str] | None:
        """``whatif --fix`` of the lead finding's replayed variant: (the finding, the printed text)."""
        from traceinspect.commands.whatif import _fix_edits, whatif_lines
        from traceinspect.whatif import replayer

        lead = story(self.doc).lead
        if lead is None or lead.get("estimate_source") != "replay" or lead.get("est_saving_us_per_step") is None:
            return None
        variant = next((fx["variant"] for fx in lead.get("fixes") or [] if fx.get("predicted_step_us") is not None),
                       None)
        if variant is None:
            return None
        edits, label = _fix_edits(self.a, variant)
        rp = replayer(self.a)
        p = rp.predict(edits, label=label)
        out = p.to_json()
        out["fixes"], out["model"] = [variant], rp.describe()
        return lead, "\n".join(whatif_lines(out, [label]))


@pytest.fixture(scope="module", params=SETS)
def r(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Rendered:
    return Rendered(request.param, tmp_path_factory.mktemp("set"))


# ----------------------------------------------------------------------------------------- text readers


def _rich_tables(text: str) -> dict[str, list[list[str]]]:
    """The rows of each rich table of a console's plain text, by the table's title (the line before it)."""
    out: dict[str, list[list[str]]] = {}
    title, rows = None, None
    prev = ""
    for line in text.splitlines():
        if line.startswith("┏"):
            title, rows = prev.strip(), []
            out[title] = rows
        elif line.startswith("└"):
            title, rows = None, None
        elif rows is not None and line.startswith("│"):
            rows.append([c.strip() for c in line.split("│")[1:-1]])
        prev = line
    return out


def _table(tables: dict[str, list[list[str]]], start: str) -> list[list[str]]:
    found = [rows for title, rows in tables.items() if title.startswith(start)]
    assert len(found) == 1, f"one table titled {start!r}: {list(tables)}"
    return found[0]


_MD_ESC = re.compile(r"\\(.)")


def _md_text(s: str) -> str:
    s = _MD_ESC.sub(r"\1", s.strip())
    return s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")


def _md_rows(md: str, heading: str) -> list[list[str]]:
    """The body rows of the first Markdown table after the heading line ``heading``."""
    lines = md.splitlines()
    i = lines.index(heading)
    rows: list[list[str]] = []
    for ln in lines[i + 1:]:
        if ln.startswith("#"):
            break
        if ln.startswith("|") and not ln.startswith("|---"):
            rows.append([_md_text(c) for c in re.split(r"(?<!\\)\|", ln)[1:-1]])
    return rows[1:]  # (the header row)


class _Node:
    def __init__(self, tag: str, attrs: dict[str, str]) -> None:
        self.tag, self.attrs, self.children = tag, attrs, []  # type: ignore[var-annotated]

    INLINE = frozenset({"b", "i", "span", "a", "code", "em", "strong", "sub", "sup", "small"})

    def raw(self) -> str:
        return "".join(c if isinstance(c, str) else c.raw() if c.tag in self.INLINE else f" {c.raw()} "
                       for c in self.children)

    def text(self) -> str:
        return " ".join(self.raw().split())

    def all(self, tag: str | None = None, cls: str | None = None, id_: str | None = None) -> list[_Node]:
        out = []
        for c in self.children:
            if isinstance(c, _Node):
                if ((tag is None or c.tag == tag) and (cls is None or cls in c.attrs.get("class", "").split())
                        and (id_ is None or c.attrs.get("id") == id_)):
                    out.append(c)
                out += c.all(tag, cls, id_)
        return out


class _Tree(HTMLParser):
    VOID = {"br", "img", "input", "meta", "link", "hr", "col", "source", "wbr"}

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.root = _Node("root", {})
        self.stack = [self.root]
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = _Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        if self.stack[-1].tag not in ("script", "style"):
            self.stack[-1].children.append(data)


# ----------------------------------------------------------------------------------------- the facts


def _lead(doc: dict[str, Any]) -> dict[str, Any] | None:
    return story(doc).lead


def test_step_time(r: Rendered) -> None:
    doc = r.doc
    want = fmt_us(doc["steps"]["median_us"])
    term = re.search(r"GPU span\): median (.+?), p90", r.terminal)
    assert term and term.group(1) == want
    md = re.search(r"^\| \w+ step \| median (.+?), p90", r.markdown, re.M)
    assert md and _md_text(md.group(1)) == want
    tree = _Tree(r.html).root
    meta = [dd.text() for dd in tree.all("dd") if dd.text().startswith("median ")]
    assert meta and re.match(r"median (.+?), p90", meta[0]).group(1) == want  # type: ignore[union-attr]
    first = tree.all(cls="keynums")[0].all(cls="v")[0].text()
    assert first == want
    basis = re.search(r"step time: median (.+?) per step", r.terminal)
    assert basis and basis.group(1) == want
    cl = re.search(r"step time: median (.+?) per step", r.classify)
    assert cl and cl.group(1) == want
    if r.whatif is not None:
        tp = re.search(r"^  TP step\s+(\S+ \S+)", r.whatif[1], re.M)
        assert tp and tp.group(1) == fmt_us(doc["replay"]["measured_step_us"]) == want


def test_classes(r: Rendered) -> None:
    doc = r.doc
    want = {c: (fmt_us(v["us_per_step"]), fmt_pct(share_of_step(v, doc)), fmt_count(v["calls_per_step"]))
            for c, v in doc["classes"].items()}
    rows = _table(_rich_tables(r.terminal), "GPU time by class")
    assert {row[0]: tuple(row[1:4]) for row in rows} == want
    md = {row[0]: (row[1], row[2]) for row in _md_rows(r.markdown, "#### GPU time by class (mean per rank per step)")}
    for c, (us, share) in md.items():
        if not c.endswith(("more class", "more classes")):
            assert (us, share) == want[c][:2], c
    tree = _Tree(r.html).root
    table = tree.all("table", id_="class-table")[0]
    html = {tr.all("td")[0].text(): tuple(td.text() for td in tr.all("td")[1:4]) for tr in table.all("tr")[1:]}
    assert html == want
    legend = {}
    for span in tree.all("span", cls="lg"):
        m = re.fullmatch(r"(\S+) (-?[\d.]+%)", span.text())
        if m and m.group(1) in want:
            legend[m.group(1)] = m.group(2)
    assert legend == {c: w[1] for c, w in want.items() if c in legend} and set(legend) == set(want)


def test_findings(r: Rendered) -> None:
    doc = r.doc
    findings = story(doc).findings
    want = [(f["rule"], saving_text(f, doc) or "n/a") for f in findings]  # in the one order of every output
    # terminal: each finding and the line of its saving
    term: list[list[str]] = []
    lines = r.terminal.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.startswith("Findings (")), len(lines))
    current = False
    for ln in lines[start + 1:]:
        m = re.match(r"^(CRITICAL|WARNING|INFO)\s+(\S+): ", ln)
        if m:
            term.append([m.group(2), "n/a"])
            current = True
        elif current and ln.strip().startswith("est. saving "):
            term[-1][1] = ln.strip()[len("est. saving "):]
        elif not ln.startswith(" "):
            current = False
    assert [tuple(x) for x in term] == want
    if findings:
        md = [(re.search(r"\(([^()]+)\)$", row[1]).group(1), row[2])  # type: ignore[union-attr]
              for row in _md_rows(r.markdown, f"#### Findings ({len(findings)})") if not row[1].startswith("…")]
        assert md == want[:8]
    tree = _Tree(r.html).root
    cards = []
    for card in tree.all("article", cls="card"):
        rule = card.all("span", cls="rule")[0].text()
        facts = card.all("div", cls="facts")[0].text()
        m = re.match(r"est\. saving (.+?) per step \((.+?) of the step time\)", facts)
        cards.append((rule, f"{m.group(1)} per step ({m.group(2)} of the step time)" if m else "n/a"))
    assert cards == want
    explain: set[tuple[str, str]] = set()
    fired: set[str] = set()
    current = None
    for ln in r.explain.splitlines():
        m = re.match(r"^(\w+)\s+(\S+)", ln)
        if m and m.group(1) in ("fired", "silent", "undecided", "skipped", "error"):
            current = m.group(2) if m.group(1) == "fired" else None
            if current:
                fired.add(current)
        elif current and ln.strip().startswith("est. saving "):
            explain.add((current, ln.strip()[len("est. saving "):]))
    assert fired == {rule for rule, _ in want}
    assert explain == {(rule, s) for rule, s in want if s != "n/a"}


def test_headline(r: Rendered) -> None:
    doc = r.doc
    lead = _lead(doc)
    term = re.search(r"^(CRITICAL|WARNING|INFO) (\S+): (.*?)(?:; est\. saving (.*))?$", r.terminal, re.M)
    md_head = r.markdown.splitlines()[0]
    tree = _Tree(r.html).root
    head = tree.all("section", id_="headline")[0]
    if lead is None:
        assert story(doc).quiet in r.terminal
        assert md_head == "### traceinspect: no findings"
        assert not head.all("span", cls="rule")
        return
    saving = saving_text(lead, doc)
    assert term and term.group(2) == lead["rule"] and term.group(4) == saving
    assert _md_text(md_head) == f"### traceinspect: {lead.get('title') or lead.get('rule')}"
    md = re.search(r"^\*\*\w+\*\* `([^`]+)`: .*?(?: Estimated saving: \*\*(.+)\*\*\.)?$", r.markdown, re.M)
    assert md and md.group(1) == lead["rule"] and (_md_text(md.group(2)) if md.group(2) else None) == saving
    assert head.all("span", cls="rule")[0].text() == lead["rule"]
    detail = head.all("p", cls="detail")[0].text()
    assert detail.startswith(f"Estimated saving: {saving}." if saving else "Estimated saving: not available")
    if r.whatif is not None:
        f, text = r.whatif
        m = re.search(r"predicted change: (.+?) per step \((.+?) of the replayed step time\)", text)
        assert m and m.group(1) == fmt_us_signed(-f["est_saving_us_per_step"])
        assert m.group(2) == fmt_pct_signed(-(saving_share(f, doc) or 0.0))


def test_undecided_and_unexplained(r: Rendered) -> None:
    """A class no finding explains, or a rule that could not decide, has one share (of the step time) in the
    headline and in the list of what was not decided, in every output."""
    doc = r.doc
    texts = {"terminal": r.terminal, "markdown": _md_text(r.markdown), "html": _Tree(r.html).root.text()}
    for u in doc.get("unexplained") or []:
        want = (fmt_pct(gap_share(u, doc)), "the step time")
        for what, text in texts.items():
            found = re.findall(rf"\b{re.escape(str(u['cls']))} takes (\S+%) of (the step time|GPU time)", text)
            assert found and set(found) == {want}, (what, u["cls"], found)
    for u in doc.get("undecided") or []:
        want = (fmt_pct(gap_share(u, doc)), "the step time")
        rule = re.escape(str(u["rule"]))
        for what, text in texts.items():
            found = re.findall(rf"\b{rule} could not decide on (\S+%) of (the step time|GPU time)", text)
            found += re.findall(rf"Undecided: {rule} \(at stake: (\S+%) of (the step time|GPU time)\)", text)
            assert found and set(found) == {want}, (what, u["rule"], found)


def test_top_kernels(r: Rendered) -> None:
    doc = r.doc
    top = doc["top_kernels"]
    keys = [(k["name"], k["cls"]) for k in top]
    assert len(set(keys)) == len(keys), "one row per (name, class)"
    want = {(k["name"], k["cls"]): (fmt_count(k["calls"]), fmt_pct(share_of_step(k, doc))) for k in top}
    # terminal: the first 12, labelled as the summary labels them
    shown = top[:12]
    labels = kernel_labels([k["name"] for k in shown], KERNEL_LABEL_WIDTH)
    rows = _table(_rich_tables(r.terminal), "Top kernels")
    term = {(row[0], row[1]): (row[2], row[5]) for row in rows}
    assert term == {(labels[k["name"]], k["cls"]): want[(k["name"], k["cls"])] for k in shown}
    md_top = top[:5]
    labels = kernel_labels([k["name"] for k in md_top], 80)
    if md_top:
        md = {(row[0], row[2]): (row[3], row[4]) for row in _md_rows(r.markdown, "#### Top kernels")}
        assert md == {(labels[k["name"]], k["cls"]): want[(k["name"], k["cls"])] for k in md_top}
    tree = _Tree(r.html).root
    table = tree.all("table", id_="kernel-table")
    html = {}
    for tr in (table[0].all("tr")[1:] if table else []):
        td = tr.all("td")
        html[(td[1].attrs.get("title", ""), td[3].text())] = (td[4].text(), td[9].text())
    assert {k: v for k, v in html.items() if k in want} == want
    rows_cl = r.classify_rows
    labels = kernel_labels(rows_cl["name"].tolist(), 60)
    cl = {(row[0], row[1]): (row[4], row[7]) for row in _table(_rich_tables(r.classify), "Kernel classes")}
    for (name, cls), w in want.items():
        assert cl.get((labels[name], cls)) == w, (name, cls)


def test_no_minus_zero_or_parameter_names(r: Rendered) -> None:
    texts = {"terminal": r.terminal, "markdown": r.markdown, "html": _Tree(r.html).root.text(),
             "explain": "\n".join(ln for ln in r.explain.splitlines() if not ln.strip().startswith("- ")),
             "classify": r.classify, "whatif": r.whatif[1] if r.whatif else ""}
    for what, text in texts.items():
        assert not re.search(r"(?<![\w.])-0(?:\.0+)?(?: ?(?:µs|ms|%))", text), what
        assert "None" not in re.findall(r"\b\w+\b", text.replace("(None)", "")) or what == "html", what
    assert not re.search(r"source: \[", r.terminal)


def test_sets_cover_the_fixtures() -> None:
    """Every fixture set and every field trace is one of the sets compared."""
    assert {d.name for d in FIXTURES.iterdir() if d.is_dir()} - {n.split("/")[0] for n in FIXTURE_SETS} == {
        "generate", "drift"}
    if REAL_TRACES.is_dir():
        files = {p.name for p in REAL_TRACES.glob("*.json.gz")}
        assert files <= set(REAL_FILES)


def test_readme_example_is_the_current_output() -> None:
    """The finding the README quotes reads as ``analyze fixtures/kv-full-cast-graph`` prints it."""
    from traceinspect.pipeline import Options, analyze
    from traceinspect.render.terminal import render

    readme = (FIXTURES.parent / "README.md").read_text(encoding="utf-8")
    quoted = re.search(r"```\n(CRITICAL kv-full-pool-cast:.*?)```", readme, re.S)
    assert quoted is not None
    con = _console()
    render(analyze([str(FIXTURES / "kv-full-cast-graph")], Options(command="test")).to_json(report=False), con)
    lines = con.export_text().splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("CRITICAL kv-full-pool-cast: The KV cache"))
    assert " ".join(quoted.group(1).split()) == " ".join(" ".join(lines[i:i + 2]).split())
