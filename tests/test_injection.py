"""Report safety across formats: a trace set whose kernel names, CPU op names, device name and model name
carry script, HTML, Markdown, XML and terminal-markup injection is analysed, and every output (the HTML
report, the Markdown summary, the analysis JSON, the merged Perfetto trace, the gate's JUnit XML and the
terminal summary) shows those strings as inert text."""

from __future__ import annotations

import gzip
import html as htmllib
import io
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from conftest import fixture_dir, run_cli
from test_rules import GOOD as GOOD_RULE

VARIANT = "kv-full-cast-eager"
# appended to names (classification patterns search names, so the kernels keep their classes)
PAYLOAD = (' <script>alert("k")</script><img src=x onerror=alert(1)><svg onload=alert(3)> **b** _i_ `c` '
           "[l](javascript:alert(2)) | p ]]><evil/><!-- & &amp; {{7*7}} ${x} %s \x1b[31m\x00\u2028 [bold red]R[/]")
MODEL = '<script>alert("model")</script>**m**|[x](javascript:y)'
DEVICE = 'NVIDIA H200 <img src=x onerror=alert("dev")>'
# the reference set: the same names with a harmless suffix (an op name with any suffix loses its FLOP and
# byte model in both sets alike, so the two analyses differ only in the text they carry)
BENIGN = (" benign", "tiny-model benign", "NVIDIA H200 benign")


def _evil_set(dst: Path, payload: str = PAYLOAD, model: str = MODEL, device: str = DEVICE) -> Path:
    src = fixture_dir(VARIANT)
    dst.mkdir(parents=True)
    for r in (0, 1):
        with gzip.open(src / f"fixture-TP-{r}.trace.json.gz", "rt") as f:
            doc = json.load(f)
        for e in doc["traceEvents"]:
            if e.get("cat") in ("kernel", "cpu_op") and isinstance(e.get("name"), str):
                e["name"] += payload
        for p in doc.get("deviceProperties", []):
            p["name"] = device
        (dst / f"fixture-TP-{r}.trace.json").write_text(json.dumps(doc))
    si = json.loads((src / "server_info.json").read_text())
    si["served_model_name"] = model
    (dst / "server_info.json").write_text(json.dumps(si))
    return dst


class _Tags(HTMLParser):
    """Start tags, attribute names and script blocks of an HTML document."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[str] = []
        self.attrs: set[tuple[str, str]] = set()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for k, v in attrs:
            self.attrs.add((tag, k))
            if k in ("href", "src", "xlink:href") and v:
                self.hrefs.append(v)


def _strings(obj: object) -> list[str]:
    """Every string in a JSON value."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for k, v in obj.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


_MD_LINK = re.compile(r"(?<!\\)\[[^\]]*(?<!\\)\]\(")  # [text]( with neither bracket escaped


def _tags(text: str) -> _Tags:
    p = _Tags()
    p.feed(text)
    return p


@pytest.fixture(scope="module")
def outputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inject")
    evil = _evil_set(root / "evil")
    out: dict[str, Path] = {}
    for name, src in (("clean", _evil_set(root / "benign", *BENIGN)), ("evil", evil)):
        d = root / f"out-{name}"
        d.mkdir()
        r = run_cli("report", str(src), "-o", str(d / "r.html"), "--markdown", str(d / "r.md"), "--json",
                    str(d / "a.json"), "--perfetto", str(d / "p.json"))
        assert r.returncode == 0, r.stderr
        out[name] = d
    return out


def test_html_report_shows_injection_as_text(outputs: dict[str, Path]) -> None:
    clean = (outputs["clean"] / "r.html").read_text()
    evil = (outputs["evil"] / "r.html").read_text()
    ct, et = _tags(clean), _tags(evil)
    # the injected names add no element and no attribute the clean report does not have
    assert set(et.tags) <= set(ct.tags), set(et.tags) - set(ct.tags)
    assert et.attrs <= ct.attrs, et.attrs - ct.attrs
    assert et.tags.count("script") == ct.tags.count("script")
    assert not any(h.lower().lstrip().startswith("javascript:") for h in et.hrefs), et.hrefs
    # the only data: links are the page's own CSV downloads, their text percent-encoded
    data = [h for h in et.hrefs if h.lower().lstrip().startswith("data:")]
    assert all(h.startswith("data:text/csv;charset=utf-8,") and not re.search(r"[<>\"' ]", h) for h in data)
    for raw in ("<script>alert", "<img src=x", "<svg onload", "<evil/>", "<!-- &"):
        assert raw not in evil, raw
    # ... and they are there, as text: the full name in the embedded JSON, a shortened one in the tables
    blob = re.search(r'<script type="application/json" id="traceinspect-analysis">(.*?)</script>', evil, re.S)
    assert blob and any(v.endswith(PAYLOAD) for v in _strings(json.loads(blob.group(1))))
    visible = htmllib.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<script\b.*?</script>", " ", evil, flags=re.S)))
    assert "[bold red]R[/]" in visible and MODEL in visible and DEVICE in visible


def test_markdown_summary_escapes_injection(outputs: dict[str, Path]) -> None:
    md = (outputs["evil"] / "r.md").read_text()
    clean = (outputs["clean"] / "r.md").read_text()
    for raw in ("<script", "<img", "<svg", "<evil", "<!--", "**m**", "**b**", "`c`"):
        assert raw not in md, raw
    assert not _MD_LINK.search(md.replace("<sub>", "")), _MD_LINK.search(md)
    assert "&lt;script&gt;alert" in md and "\\*\\*m\\*\\*" in md
    # table rows keep the column count of their header (no unescaped pipe from a name)
    def cols(line: str) -> int:
        return len(re.findall(r"(?<!\\)\|", line))

    for text in (md, clean):
        header = None
        for line in text.splitlines():
            if line.startswith("|") and header is None:
                header = cols(line)
            elif line.startswith("|"):
                assert cols(line) == header, line
            else:
                header = None
    assert md.count("\n|") == clean.count("\n|")  # same tables, same rows


def test_analysis_json_and_perfetto_round_trip_the_names(outputs: dict[str, Path]) -> None:
    doc = json.loads((outputs["evil"] / "a.json").read_text())
    assert doc["run"]["model"] == MODEL and doc["run"]["device"] == DEVICE
    assert all(k["name"].endswith(PAYLOAD) for k in doc["top_kernels"])
    raw = (outputs["evil"] / "p.json").read_bytes()
    trace = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    names = {e.get("name") for e in trace["traceEvents"] if isinstance(e, dict)}
    assert any(isinstance(n, str) and n.endswith(PAYLOAD) for n in names)
    assert "</script>" not in raw.decode("utf-8", "replace") or b"traceEvents" in raw  # plain JSON, not HTML


def test_gate_junit_is_well_formed_with_injected_names(outputs: dict[str, Path], tmp_path: Path) -> None:
    base, cand = outputs["clean"] / "a.json", outputs["evil"] / "a.json"
    junit, md = tmp_path / "j.xml", tmp_path / "g.md"
    r = run_cli("gate", str(base), str(cand), "--junit", str(junit), "--markdown", str(md), "--allow-mismatch",
                "--no-config")
    assert r.returncode in (0, 1), r.stderr  # pass or fail on regressions; never unusable input
    text = junit.read_text()
    root = ET.fromstring(text)  # well-formed XML (control characters a name carries are replaced)
    assert root.find(".//evil") is None and "<evil/>" not in text and "<script>" not in text
    values = [el.text or "" for el in root.iter()] + [v for el in root.iter() for v in el.attrib.values()]
    hit = [v for v in values if "alert(" in v]
    assert hit, "the injected device or model name appears in some check"
    assert any(MODEL in v or DEVICE in v for v in values)
    gm = md.read_text()
    assert "<script" not in gm and "<img" not in gm and not _MD_LINK.search(gm), gm


def test_terminal_summary_does_not_interpret_markup(outputs: dict[str, Path]) -> None:
    from rich.console import Console

    from traceinspect.render.terminal import render

    doc = json.loads((outputs["evil"] / "a.json").read_text())
    buf = io.StringIO()
    render(doc, console=Console(file=buf, width=200, color_system=None))  # type: ignore[arg-type]
    out = buf.getvalue()
    assert "[bold red]R[/]" in out  # rich markup in a kernel name is printed, not applied
    assert "\x1b" not in out and "\x00" not in out  # no terminal escape sequences from trace data
    assert MODEL.split("**")[0] in out



# ----------------------------------------------------------------------------- rule files



def _rule_cases(sentinel: Path) -> dict[str, str]:
    s = str(sentinel)
    g = GOOD_RULE
    return {
        "import": g.replace('"share >= min_share"', f"\"__import__('os').system('touch {s}') == 0\""),
        "dunder attribute": g.replace("us_per_step * 0.5", "us_per_step.__class__.__mro__"),
        "subclasses": g.replace('"share >= min_share"', '"().__class__.__bases__[0].__subclasses__()"'),
        "open a file": g.replace('"share >= min_share"', "\"open('/etc/passwd').read() != ''\""),
        "format string attribute": g.replace("{share:.1%}", "{share.__class__.__init__.__globals__}"),
        "nested format spec": g.replace("{share:.1%}", "{share:{share}}"),
        "python yaml tag": f"rules:\n  - !!python/object/apply:os.system ['touch {s}']\n",
        "yaml alias bomb": "a: &a [x, x, x, x]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nrules: [*c]\n",
        "deep nesting": g.replace('"share >= min_share"', '"' + "(" * 300 + "share" + ")" * 300 + ' > 0"'),
        "lambda": g.replace('"share >= min_share"', '"(lambda: 1)() == 1"'),
        "catastrophic regex": g.replace("kernels: {class: dtype_cast}", "kernels: {name: '(a+)+$'}"),
        "huge file": g + "#" + "x" * (2 << 20) + "\n",
    }


def test_malicious_rule_files_via_the_cli(tmp_path: Path) -> None:
    """``analyze --rules DIR`` with a hostile rule file: exit 2 with one line naming the file, before the
    traces are read; nothing is executed (the sentinel file is never created) and nothing is read."""
    import os
    import subprocess
    import sys


    sentinel = tmp_path / "pwned"
    trace = fixture_dir(VARIANT)
    procs = {}
    for i, (name, text) in enumerate(_rule_cases(sentinel).items()):
        d = tmp_path / f"rules{i}"
        d.mkdir()
        (d / "evil.yaml").write_text(text)
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "traceinspect", "analyze", str(trace), "--rules", str(d), "-q", "--no-cache"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=dict(os.environ))
    for name, p in procs.items():
        out, err = p.communicate(timeout=240)
        assert p.returncode == 2, (name, p.returncode, out[-500:], err[-2000:])
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("traceinspect: error: "), (name, err)
        assert "evil.yaml" in lines[0] and "Traceback" not in err, (name, err)
        assert "root:" not in err and "root:" not in out  # no file content leaks into messages
    assert not sentinel.exists()


def test_huge_exponent_in_a_rule_is_bounded(tmp_path: Path) -> None:
    """A rule whose estimate is ``9 ** 9 ** 9 ** 9`` loads, evaluates quickly to 'cannot decide', and the
    analysis completes."""

    d = tmp_path / "rules"
    d.mkdir()
    (d / "big.yaml").write_text(GOOD_RULE.replace("class: dtype_cast", "class: kv_cast")
                                .replace("us_per_step * 0.5", "us_per_step ** 9 ** 9 ** 9"))
    out = tmp_path / "a.json"
    r = run_cli("analyze", str(fixture_dir(VARIANT)), "--rules", str(d), "--only", "my-rule", "--json", str(out),
                "-q")
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    fired = [f for f in doc["findings"] if f["rule"] == "my-rule"]
    assert len(fired) == 1 and fired[0]["est_saving_us_per_step"] is None, fired  # fires; saving undecided
