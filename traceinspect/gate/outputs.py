"""Gate and diff outputs: JUnit XML, GitHub Actions annotations and step summary, Markdown, JSON.

Every trace-derived string (kernel and class names, finding titles, paths) is escaped for the
format it lands in; files are written atomically (temporary file, then rename).
"""

from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceinspect.gate.stats import DEFAULT_ALPHA, needs_text, samples_needed

if TYPE_CHECKING:
    from traceinspect.gate.core import GateResult
    from traceinspect.gate.diff import Diff

# Characters XML 1.0 cannot hold at all, even escaped.
_XML_INVALID = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")
STATUS_MARK = {"pass": "✅ pass", "warn": "⚠️ warn", "fail": "❌ fail", "error": "⛔ error"}


# ---------------------------------------------------------------------------------------------- JSON
def gate_json(result: GateResult) -> str:
    return json.dumps(result.to_json(), indent=2, allow_nan=False, default=str) + "\n"


def diff_json(diff: Diff) -> str:
    return json.dumps(diff.to_json(), indent=2, allow_nan=False, default=str) + "\n"


# --------------------------------------------------------------------------------------------- JUnit
def _xml_text(s: Any) -> str:
    return _XML_INVALID.sub("\ufffd", str(s))


def junit_xml(result: GateResult) -> str:
    """JUnit XML with one testcase per check: fail -> <failure>, error -> <error>, warn -> passes
    with the warning in <system-out>."""
    checks = result.checks
    n_fail = sum(c.status == "fail" for c in checks)
    n_err = sum(c.status == "error" for c in checks)
    suites = ET.Element("testsuites", name="traceinspect", tests=str(len(checks)), failures=str(n_fail),
                        errors=str(n_err))
    suite = ET.SubElement(suites, "testsuite", name="traceinspect.gate", tests=str(len(checks)),
                          failures=str(n_fail), errors=str(n_err), skipped="0", time="0")
    props = ET.SubElement(suite, "properties")
    settings = {"verdict": result.verdict(), "status": result.status, "exit_code": result.exit_code,
                **result.settings}
    if result.diff is not None:
        settings["baseline"] = result.diff.base_label
        settings["candidate"] = result.diff.cand_label
    for k, v in settings.items():
        if v is None:
            continue
        ET.SubElement(props, "property", name=_xml_text(k),
                      value=_xml_text(", ".join(map(str, v)) if isinstance(v, list) else v))
    for c in checks:
        tc = ET.SubElement(suite, "testcase", classname=f"traceinspect.gate.{c.kind}", name=_xml_text(c.id),
                           time="0")
        if c.status == "fail":
            el = ET.SubElement(tc, "failure", message=_xml_text(c.message), type=c.kind)
            el.text = _xml_text(c.message)
        elif c.status == "error":
            el = ET.SubElement(tc, "error", message=_xml_text(c.message), type="unusable-input")
            el.text = _xml_text(c.message)
        else:
            out = ET.SubElement(tc, "system-out")
            out.text = _xml_text(("warning: " if c.status == "warn" else "") + c.message)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


# ------------------------------------------------------------------------------------ GitHub Actions
def gh_escape_data(s: Any) -> str:
    """Escape a workflow-command message."""
    return str(s).replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def gh_escape_property(s: Any) -> str:
    """Escape a workflow-command property value (title=, file=)."""
    return gh_escape_data(s).replace(":", "%3A").replace(",", "%2C")


def github_annotations(result: GateResult) -> list[str]:
    """``::error`` for failures and unusable input, ``::warning`` for warnings, and the verdict line last:
    a ``::notice`` when the gate passes, an ``::error`` when it does not."""
    lines = []
    for c in result.checks:
        level = {"fail": "error", "error": "error", "warn": "warning"}.get(c.status)
        if level:
            lines.append(f"::{level} title={gh_escape_property('traceinspect gate: ' + c.id)}::"
                         f"{gh_escape_data(c.message)}")
    level = {0: "notice", 1: "error", 2: "error"}[result.exit_code]
    lines.append(f"::{level} title={gh_escape_property('traceinspect gate')}::{gh_escape_data(result.verdict())}")
    return lines


def append_step_summary(markdown: str, env: dict[str, str] | None = None) -> Path | None:
    """Append Markdown to ``$GITHUB_STEP_SUMMARY`` when it is set; return the path written."""
    target = (env if env is not None else os.environ).get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    with open(target, "a", encoding="utf-8") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return Path(target)


# ------------------------------------------------------------------------------------------ Markdown
def md_escape(s: Any) -> str:
    """Escape a string for a Markdown table cell: HTML-significant characters become entities,
    Markdown syntax is backslash-escaped, line breaks become spaces."""
    from traceinspect.render.markdown import md

    return md(_XML_INVALID.sub("", str(s)))


def _us(v: float | None) -> str:
    from traceinspect.render import fmt_us

    return fmt_us(v)


def _sus(v: float | None) -> str:
    from traceinspect.units import fmt_us_signed

    return fmt_us_signed(v)


def _pct(v: float | None) -> str:
    """A change given in percent (4.2 for +4.2%), signed; never '-0.0%'."""
    from traceinspect.units import fmt_pct_signed

    return "n/a" if v is None else fmt_pct_signed(v / 100)


def _val(v: Any, missing: str = "unknown") -> Any:
    """A run fact or setting as shown: ``missing`` ('unknown'; a server setting one side lacks: 'absent')
    where there is none, never 'None' or blank."""
    return missing if v is None or v == "" else v


def _shape(g: dict[str, Any]) -> str:
    """M x N x K (x batch / groups) of a GEMM row, or why it is unknown."""
    if g.get("m") is None:
        return f"unknown shape ({g.get('reason') or 'no reason given'})"
    s = f"{g['m']}x{g['n']}x{g['k']}"
    if g.get("batch") not in (None, 1):
        s += f" batch {g['batch']}"
    if g.get("groups") not in (None, 1):
        s += f" groups {g['groups']}"
    return s


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def diff_markdown(diff: Diff, heading: str = "##") -> str:
    """The diff as Markdown sections."""
    lines = [f"{heading} traceinspect diff", "",
             f"Baseline: {md_escape(diff.base_label)}  ", f"Candidate: {md_escape(diff.cand_label)}", ""]
    ctx_rows = [[md_escape(r["label"]), md_escape(_val(r["base"])), md_escape(_val(r["cand"])),
                 "" if r["same"] else ("unknown" if r["same"] is None else "**changed**")]
                for r in diff.context if r["compat"] or r["same"] is False]
    lines += _table(["run", "baseline", "candidate", ""], ctx_rows) + [""]
    s = diff.step
    lines += [f"{heading}# Step time", ""]
    rows = [["median step", _us(s.base), _us(s.cand), _sus(s.delta), _pct(s.pct)]]
    t = diff.throughput
    if t is not None:
        rows.append([f"tokens/s (batch {diff.batch['base']:g} -> {diff.batch['cand']:g})", _rate(t.base),
                     _rate(t.cand), "n/a" if t.delta is None else ("+" if t.delta >= 0 else "") + _rate(t.delta), _pct(t.pct)])
    lines += _table(["metric", "baseline", "candidate", "delta", "change"], rows) + [""]
    if t is None:
        lines += [md_escape(throughput_text(diff)), ""]
    lines += [f"{heading}# GPU time per step by class (mean per rank)", ""]
    if diff.classes_note:
        lines += [md_escape(diff.classes_note), ""]
    else:
        lines += _table(["class", "baseline", "candidate", "delta", "change"],
                        [[md_escape(m.metric[6:]), _us(m.base), _us(m.cand), _sus(m.delta),
                          _pct(m.pct) if m.pct is not None else ("new" if m.base == 0 and m.cand else "n/a")]
                         for m in diff.classes]) + [""]
    lines += [f"{heading}# GEMM efficiency per shape", ""]
    if diff.gemm_note:
        lines += [md_escape(diff.gemm_note), ""]
    elif not diff.gemm:
        lines += ["No GEMM shapes in either run.", ""]
    else:
        rows = []
        for g in diff.gemm[:30]:
            tf = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
            pk = lambda v: "n/a" if v is None else f"{v:.1f}%"  # noqa: E731
            rows.append([md_escape(_shape(g)), md_escape(g.get("cls")), md_escape(g.get("op")),
                         md_escape(g.get("dtype")), md_escape(g["status"]), _us(g["base_us_per_step"]),
                         _us(g["cand_us_per_step"]), tf(g["base_tflops"]), tf(g["cand_tflops"]),
                         _pct(g["tflops_pct"]), pk(g["base_pct_peak"]), pk(g["cand_pct_peak"])])
        lines += _table(["shape", "class", "op", "dtype", "in", "time per step base", "time per step cand", "TFLOPS base",
                         "TFLOPS cand", "change", "% peak base", "% peak cand"], rows)
        if len(diff.gemm) > 30:
            lines.append(f"\n{len(diff.gemm) - 30} more shape(s) in the JSON output.")
        lines.append("")
    lines += [f"{heading}# Findings", ""]
    f = diff.findings
    if diff.findings_note:
        lines += [md_escape(diff.findings_note), ""]
    else:
        rows = [["added", md_escape(x.get("severity")), md_escape(x.get("rule")), md_escape(x.get("title") or "")]
                for x in f["added"]]
        rows += [["removed", md_escape(x.get("severity")), md_escape(x.get("rule")), md_escape(x.get("title") or "")]
                 for x in f["removed"]]
        rows += [["changed", md_escape(x["cand"].get("severity")), md_escape(x["rule"]),
                  md_escape("; ".join(x["changes"]))] for x in f["changed"]]
        rows += [["unchanged", md_escape(x["cand"].get("severity")), md_escape(x["rule"]),
                  md_escape(x["cand"].get("title") or "")] for x in f["unchanged"]]
        lines += (_table(["change", "severity", "rule", "title"], rows) if rows else ["No findings in either run."])
        lines.append("")
    lines += _server_config_md(diff, heading)
    for n in diff.notes:
        lines.append(f"- {md_escape(n)}")
    return "\n".join(lines).rstrip() + "\n"


def _server_config_md(diff: Diff, heading: str) -> list[str]:
    """The server-config section: at most SERVER_CONFIG_SHOWN keys that differ, and how many more."""
    lines = [f"{heading}# Server configuration", ""]
    if diff.server_config_note:
        return lines + [md_escape(diff.server_config_note), ""]
    if not diff.server_config:
        return lines + ["The same in both runs.", ""]
    rows = diff.server_config[:SERVER_CONFIG_SHOWN]
    lines += [md_escape(server_config_summary(diff)), ""]
    lines += _table(["key", "baseline", "candidate"],
                    [[md_escape(r["key"]), *map(md_escape, _short_pair(r["base"], r["cand"]))] for r in rows])
    if len(diff.server_config) > len(rows):
        lines.append(f"\nand {len(diff.server_config) - len(rows)} more (the JSON output lists them all)")
    return lines + [""]


def gate_markdown(result: GateResult) -> str:
    """The gate verdict, its checks, and the diff, as Markdown (also the GitHub step summary)."""
    mark = {0: "✅ PASS", 1: "❌ FAIL", 2: "⛔ ERROR"}[result.exit_code]
    lines = [f"## traceinspect gate: {mark}", "", md_escape(result.verdict()), ""]
    if not result.comparable:  # why, and the server-config keys that differ; nothing was judged
        lines += _table(["status", "check", "detail"], [[STATUS_MARK[c.status], md_escape(c.id), md_escape(c.message)]
                                                         for c in result.checks if c.status == "error"]) + [""]
        if result.diff is not None:
            lines += _server_config_md(result.diff, "##")
        return "\n".join(lines).rstrip() + "\n"
    shown = [c for c in result.checks if c.status != "pass"] or []
    passed = [c for c in result.checks if c.status == "pass"]
    rows = [[STATUS_MARK[c.status], md_escape(c.id), md_escape(c.message)] for c in shown + passed]
    lines += _table(["status", "check", "detail"], rows) + [""]
    s = result.settings
    if s:
        lines.append(
            f"Thresholds: {md_escape(', '.join(s.get('thresholds', [])) or 'none')}; floor {md_escape(s.get('floor'))}; "
            f"noise: {md_escape(s.get('noise_test'))} at alpha {md_escape(s.get('alpha'))}; "
            f"fail on new findings at or above: {md_escape(s.get('fail_on'))}.")
        lines.append("")
    if result.diff is not None:
        lines.append(diff_markdown(result.diff, heading="###"))
    return "\n".join(lines).rstrip() + "\n"


# ------------------------------------------------------------------------------------------ terminal
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def plain(s: Any) -> str:
    """A trace-derived string made safe for a terminal: control characters (escape sequences) dropped."""
    return _CONTROL.sub("", " ".join(str(s).split()))


def _cols(rows: list[list[str]], indent: str = "  ") -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


SERVER_CONFIG_SHOWN = 10  # server-config keys listed in the text and Markdown outputs (the JSON has them all)


def _short_pair(base: Any, cand: Any, width: int = 60) -> tuple[str, str]:
    """Two values of one server-config key, shortened where long: only the words that differ, each with the
    word before it (a launch command's changed arguments), the words both share becoming ``...``."""
    b, c = plain(_val(base, "absent")), plain(_val(cand, "absent"))
    if len(b) <= width and len(c) <= width:
        return b, c
    import difflib

    bw, cw = b.split(" "), c.split(" ")
    parts: tuple[list[str], list[str]] = ([], [])
    ops = difflib.SequenceMatcher(a=bw, b=cw, autojunk=False).get_opcodes()
    for tag, i1, i2, j1, j2 in ops:
        if tag == "equal":
            continue
        for words, lo, hi, out in ((bw, i1, i2, parts[0]), (cw, j1, j2, parts[1])):
            ctx = max(lo - 1, 0)
            out.append((" " if ctx == 0 else "... ") + " ".join(words[ctx:hi]).strip())

    more = " ..." if ops and ops[-1][0] == "equal" else ""

    def cut(segments: list[str]) -> str:
        text = " ".join(x.strip() for x in segments if x.strip()) + more
        return text if len(text) <= 3 * width else text[:3 * width - 3] + "..."

    return cut(parts[0]), cut(parts[1])


def server_config_summary(diff: Diff) -> str | None:
    """How many server-config keys differ, or why they were not compared; None when they are the same."""
    if diff.server_config_note:
        return f"server config: {diff.server_config_note}"
    rows = diff.server_config
    if not rows:
        return None
    one = sum(1 for r in rows if r.get("only_one_side"))
    split = f" ({len(rows) - one} set in both runs, {one} in one run only)" if one else ""
    return f"server config: {len(rows)} key(s) differ{split}"


def server_config_lines(diff: Diff, limit: int = SERVER_CONFIG_SHOWN) -> list[str]:
    """The server-config keys that differ, at most ``limit`` of them (keys both runs set first), then how many
    more; or why they could not be compared."""
    head = server_config_summary(diff)
    if head is None:
        return []
    if diff.server_config_note:
        return [f"  {plain(head)}"]
    lines = [f"  {head}:"]
    for r in diff.server_config[:limit]:
        b, c = _short_pair(r["base"], r["cand"])
        lines.append(f"    {plain(r['key'])}: {b} -> {c}")
    if len(diff.server_config) > limit:
        lines.append(f"    and {len(diff.server_config) - limit} more (the JSON output lists them all)")
    return lines


def diff_text(diff: Diff, show_all: bool = False) -> str:
    """The diff for a terminal (plain text)."""
    lines = [f"traceinspect diff: {plain(diff.base_label)} -> {plain(diff.cand_label)}"]
    for r in diff.context:
        if r["same"] is False:
            tag = "MISMATCH" if r["compat"] else "changed"
            lines.append(f"  {tag}: {r['label']}: {plain(_val(r['base']))} -> {plain(_val(r['cand']))}")
    lines += server_config_lines(diff)
    s = diff.step
    lines.append(f"  median step: {_us(s.base)} -> {_us(s.cand)} ({_sus(s.delta)}, {_pct(s.pct)})")
    lines.append(f"  {throughput_text(diff)}")
    lines.append("")
    if diff.classes_note:
        lines.append(f"  classes: {plain(diff.classes_note)}")
    else:
        rows = [["class (time per step)", "baseline", "candidate", "delta", "change"]]
        for m in diff.classes:
            if not show_all and m.delta is not None and abs(m.delta) < 0.05:
                continue
            change = _pct(m.pct) if m.pct is not None else ("new" if m.base == 0 and m.cand else "n/a")
            rows.append([plain(m.metric[6:]), _us(m.base), _us(m.cand), _sus(m.delta), change])
        lines += _cols(rows)
    lines.append("")
    if diff.gemm_note:
        lines.append(f"  GEMM: {plain(diff.gemm_note)}")
    elif diff.gemm:
        rows = [["GEMM M x N x K", "class", "dtype", "in", "TFLOPS base", "cand", "change"]]
        tf = lambda v: "n/a" if v is None else f"{v:.1f}"  # noqa: E731
        changed = [g for g in diff.gemm if g["status"] != "both"
                   or (g["tflops_pct"] is not None and abs(g["tflops_pct"]) >= 5)]
        shown = diff.gemm if show_all else changed
        for g in shown[:25]:
            rows.append([plain(_shape(g)), plain(g.get("cls")), plain(g.get("dtype")), g["status"],
                         tf(g["base_tflops"]), tf(g["cand_tflops"]), _pct(g["tflops_pct"])])
        if len(rows) > 1:
            lines += _cols(rows)
        if len(shown) > 25:
            lines.append(f"  ({len(shown) - 25} more shape(s) in the JSON output)")
        lines.append(f"  GEMM shapes: {len(diff.gemm)} compared, {len(changed)} changed by >= 5% or added/removed")
    lines.append("")
    if diff.findings_note:
        lines.append(f"  findings: {plain(diff.findings_note)}")
    else:
        f = diff.findings
        for x in f["added"]:
            lines.append(f"  + {plain(x.get('severity'))} {plain(x.get('rule'))}: {plain(x.get('title') or '')}")
        for x in f["removed"]:
            lines.append(f"  - {plain(x.get('severity'))} {plain(x.get('rule'))}: {plain(x.get('title') or '')}")
        for x in f["changed"]:
            lines.append(f"  ~ {plain(x['cand'].get('severity'))} {plain(x['rule'])}: {plain('; '.join(x['changes']))}")
        if show_all:
            for x in f["unchanged"]:
                lines.append(f"  = {plain(x['cand'].get('severity'))} {plain(x['rule'])}")
        n = {k: len(v) for k, v in f.items()}
        lines.append(f"  findings: {n['added']} added, {n['removed']} removed, {n['changed']} changed, "
                     f"{n['unchanged']} unchanged")
    for note in diff.notes:
        lines.append(f"  note: {plain(note)}")
    return "\n".join(lines) + "\n"


def throughput_text(diff: Diff) -> str:
    """Tokens/s of both runs, or why there is none."""
    t = diff.throughput
    if t is None:
        missing = [side for side in ("base", "cand") if diff.batch.get(side) is None]
        who = " and ".join({"base": "baseline", "cand": "candidate"}[m] for m in missing)
        return f"tokens/s: not compared (no batch in the {who}: the steps carry no bs=N annotation)"
    b, c = diff.batch["base"], diff.batch["cand"]
    at = f"batch {b:g}" + (f" -> {c:g}" if b != c else "")
    return f"tokens/s: {_rate(t.base)} -> {_rate(t.cand)} ({_pct(t.pct)}) at {at}"


def _rate(v: float | None) -> str:
    from traceinspect.gate.core import fmt_rate

    return fmt_rate(v)


CLASSES_SHOWN = 3  # class changes listed under the verdict without --verbose (besides the ones not passing)


def _check_line(c: Any, indent: str = "  ") -> str:
    return f"{indent}{c.status.upper():5}  {plain(c.id)}: {plain(c.message)}"


def gate_text(result: GateResult, verbose: bool = False) -> str:
    """The gate for a terminal: the verdict metrics (step, tokens/s), the class changes that explain them
    below, findings, and the verdict line last. Runs that are not comparable show only why, with the
    server-config keys that differ (capped)."""
    lines = []
    d = result.diff
    if d is not None:
        lines.append(f"traceinspect gate: {plain(d.base_label)} -> {plain(d.cand_label)}")
    if not result.comparable:
        lines += [_check_line(c) for c in result.checks if c.status == "error"]
        if d is not None:
            lines += server_config_lines(d)
        lines.append(plain(result.verdict()))
        return "\n".join(lines) + "\n"
    if d is not None:
        lines += server_config_lines(d)
        alpha = float(result.settings.get("alpha") or DEFAULT_ALPHA)
        nb, nc = len(d.step.base_samples or []), len(d.step.cand_samples or [])
        if min(nb, nc) < samples_needed(alpha):
            lines.append(f"  note: the step-time noise test has {nb} baseline and {nc} candidate per-step samples; "
                         f"{needs_text(alpha)}")
        if d.throughput is None:
            lines.append(f"  note: {throughput_text(d)}")
    shown = 0
    compat = [c for c in result.checks if c.kind == "compat" and (verbose or c.status != "pass")]
    metrics = [c for c in result.checks if c.kind == "regression"]
    classes = [c for c in result.checks if c.kind == "class"]
    findings = [c for c in result.checks if c.kind not in ("compat", "regression", "class")
                and (verbose or c.status != "pass")]
    if not verbose:  # the class changes that explain the verdict: those not passing, then the largest changes
        floor = float(result.settings.get("floor_us") or 0.0)
        big = sorted((c for c in classes if c.status == "pass" and abs(c.data.get("delta") or 0.0) > floor),
                     key=lambda c: -abs(c.data.get("delta") or 0.0))
        classes = [c for c in classes if c.status != "pass"] + big[:CLASSES_SHOWN]
    lines += [_check_line(c) for c in compat + metrics]
    if classes:
        per = "token" if any(c.data.get("per_token") for c in classes) else "step"
        lines.append(f"         explained by (GPU time per {per} by class, largest growth first):")
        lines += [_check_line(c, "    ") for c in classes]
    lines += [_check_line(c) for c in findings]
    shown = len(compat) + len(metrics) + len(classes) + len(findings)
    hidden = len(result.checks) - shown
    if hidden:
        lines.append(f"  ({hidden} more passing check(s); --verbose lists them)")
    lines.append(plain(result.verdict()))
    return "\n".join(lines) + "\n"
