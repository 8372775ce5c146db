"""A short Markdown summary for PR comments and CI step summaries (GitHub/GitLab flavoured).

Trace-derived strings (kernel names, model names, paths, finding text that quotes them) go through
:func:`md` (markdown and HTML metacharacters escaped, newlines folded) or :func:`md_code` (a code span
whose fence is longer than any backtick run inside).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from traceinspect.fileio import write_text_atomic
from traceinspect.render import fmt_count, fmt_pct, fmt_us, kernel_labels, short_name
from traceinspect.render.story import saving_text, share_of_step, step_share, story
from traceinspect.render.whatif import all_fixed_line, group_note, variant_lines
from traceinspect.units import is_number
from traceinspect.version import __version__

# CommonMark lets any ASCII punctuation be backslash-escaped; these are the ones that start or end
# inline markup: emphasis, code, links and images (no '[' means no link), headings, list items, table
# cells, strike-through, math, mentions. '<', '>' and '&' become entities (no HTML, no autolinks).
_MD_META = re.compile(r"([\\`*_\[\]#+|~@$])")
_WS = re.compile(r"\s+")
TOP_FINDINGS = 8
TOP_CLASSES = 8
TOP_KERNELS = 5


def md(text: Any) -> str:
    """Escape text for inline Markdown (also safe inside a table cell): HTML metacharacters become
    entities, markdown punctuation is backslash-escaped, whitespace runs become one space."""
    s = _WS.sub(" ", str(text)).strip()
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")
    return _MD_META.sub(r"\\\1", s)


_RULE_META = re.compile(r"([\\\[\]|~@$])")


def md_rule(text: Any) -> str:
    """Rule-authored text (remediation): like :func:`md` but keeping its `code spans` and emphasis."""
    s = _WS.sub(" ", str(text)).strip()
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    s = _RULE_META.sub(r"\\\1", s)
    return s if s.count("`") % 2 == 0 else s.replace("`", "\\`")


def md_code(text: Any) -> str:
    """Text as an inline code span (no escaping needed inside, except table pipes)."""
    s = _WS.sub(" ", str(text)).strip()
    run = max((len(m) for m in re.findall(r"`+", s)), default=0)
    fence = "`" * (run + 1)
    pad = " " if s.startswith("`") or s.endswith("`") or not s else ""
    # GFM splits table rows on '|' even inside code spans; '\|' there renders as '|'
    return f"{fence}{pad}{s.replace('|', chr(92) + '|')}{pad}{fence}"


def render_markdown(doc: dict[str, Any]) -> str:
    """The Markdown summary of an analysis document."""
    run, steps = doc.get("run") or {}, doc.get("steps") or {}
    step_us = steps.get("median_us")
    st = story(doc)
    findings = st.findings  # the one order: severity, then estimated saving
    out: list[str] = []

    if st.lead is not None:
        f = st.lead
        out.append(f"### traceinspect: {md(f.get('title') or f.get('rule'))}")
        line = f"**{md(str(f.get('severity', '')).upper())}** {md_code(f.get('rule'))}: {md(f.get('message') or '')}"
        if st.saving:
            line += f" Estimated saving: **{md(st.saving)}**."
        out.append(line)
    else:
        out.append("### traceinspect: no findings")
        out.append(md(st.quiet))
    for o in st.open:
        out.append(f"> **{md(o.kind)}**: {md(o.text)}")
    out.append("")
    out.append(f"<sub>{md(st.basis)}</sub>")
    out.append("")

    ranks = run.get("ranks")
    out += [
        "| | |",
        "|---|---|",
        f"| Model | {md(run.get('model') or 'unknown')} |",
        f"| Device | {md(run.get('device') or 'unknown')} × {md(ranks)} (TP {md(run.get('tp_size') or 'unknown')}) |",
        f"| KV cache dtype | {md(run.get('kv_cache_dtype') or 'unknown')} |",
        f"| Batch (median) | {f'{bm:g}' if is_number(bm := run.get('batch_median')) else md(bm or 'unknown')} |",
        f"| {md(str(steps.get('phase', 'decode')).capitalize())} step | median {md(fmt_us(step_us))}, "
        f"p90 {md(fmt_us(steps.get('p90_us')))} over {md(steps.get('count'))} steps per rank |",
        f"| CUDA graph | {'yes' if run.get('cuda_graph') else 'no'} |",
        "",
    ]

    if findings:
        out += [f"#### Findings ({len(findings)})", "",
                "| severity | finding | est. saving per step | ranks |", "|---|---|---:|---|"]
        for f in findings[:TOP_FINDINGS]:
            sv = md(saving_text(f, doc) or "n/a")
            rk = f.get("ranks")
            rk = ", ".join(md(r) for r in rk) if isinstance(rk, list) and rk else "all"
            child = " ↳ " if (f.get("group") or {}).get("parent") else ""
            out.append(f"| {md(f.get('severity'))} | {child}**{md(f.get('title') or f.get('rule'))}** "
                       f"({md(f.get('rule'))}) | {sv} | {rk} |")
        if len(findings) > TOP_FINDINGS:
            out.append(f"| | … and {len(findings) - TOP_FINDINGS} more (see the HTML report or JSON) | | |")
        out.append("")
        line = all_fixed_line(doc)
        if line:
            out += [f"**{md(line)}**", ""]
        out += ["<details><summary>Details and fixes</summary>", ""]
        for f in findings[:TOP_FINDINGS]:
            out.append(f"- **{md(f.get('title') or f.get('rule'))}**: {md(f.get('message') or '')}")
            for v in variant_lines(f):
                out.append(f"  - {md(v)}")
            note = group_note(f)
            if note:
                out.append(f"  - {md(note)}")
            if str(f.get("remediation") or "").strip():
                out.append(f"  Fix: {md_rule(f.get('remediation'))}")
        out += ["", "</details>", ""]

    from traceinspect.render.gaps import gap_items

    gaps = gap_items(doc)
    if gaps:
        out += [f"#### Not decided ({len(gaps)})", ""]
        for g in gaps:
            out.append(f"- **{md(g.kind)}**: {md(g.head)}")
            for m in g.missing:
                out.append(f"  - missing: {md(m)}")
            for h in g.how:
                out.append(f"  - {'supply' if g.kind == 'undecided' else 'explain'}: {md(h)}")
        out.append("")

    classes = sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("us_per_step") or 0))
    if classes:
        out += ["#### GPU time by class (mean per rank per step)", "",
                "| class | time per step | of the step time |",
                "|---|---:|---:|"]
        for c, v in classes[:TOP_CLASSES]:
            out.append(f"| {md(c)} | {md(fmt_us(v.get('us_per_step')))} | "
                       f"{md(fmt_pct(share_of_step(v, doc)))} |")
        rest = classes[TOP_CLASSES:]
        if rest:
            share = step_share(sum(v.get("us_per_step") or 0 for _, v in rest), doc)
            out.append(f"| {len(rest)} more {'class' if len(rest) == 1 else 'classes'} | | {md(fmt_pct(share))} |")
        out.append("")

    kernels = doc.get("top_kernels") or []
    if kernels:
        ops = launched_by(doc)
        out += ["#### Top kernels", "", "| kernel | launched by | class | calls | of the step time |",
                "|---|---|---|---:|---:|"]
        labels = kernel_labels([str(k.get("name", "")) for k in kernels[:TOP_KERNELS]], 80)
        for k in kernels[:TOP_KERNELS]:
            name = str(k.get("name", ""))
            op = ops.get((name, str(k.get("cls"))), "") or ops.get(name, "")
            out.append(f"| {md(labels[name])} | {md(short_name(op, 40)) if op else '–'} | "
                       f"{md(k.get('cls'))} | {md(fmt_count(k.get('calls')))} | {md(fmt_pct(share_of_step(k, doc)))} |")
        out.append("")

    from traceinspect.render.roofline import fmt_rate, fmt_share, no_floor_note, roofline_rows

    roof = roofline_rows(doc, 8)
    if roof:
        out += ["#### Roofline (per rank per step)", "",
                "| kind | kernel / shape | time | TFLOP/s | GB/s | % of bandwidth | floor | bound | % of roofline |",
                "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        for r in roof:
            out.append(f"| {md(r['kind'])} | {md(r['label'])} | {md(fmt_us(r['us']))} | "
                       f"{md(fmt_rate(r['tflops'], '').strip())} | {md(fmt_rate(r['gbps'], '').strip())} | "
                       f"{md(fmt_share(r['pct_bw']))} | {md(fmt_us(r['floor']))} | {md(r['bound'])} | "
                       f"{md(fmt_share(r['pct_roofline']))} |")
        out.append("")
    note = no_floor_note(doc)
    if note:
        out += [md(note), ""]

    cov = doc.get("coverage") or {}
    if is_number(cov.get("unknown_share")):
        out.append(f"Classified: {md(fmt_pct(1 - cov['unknown_share']))} of GPU time.")
    for w in (doc.get("warnings") or [])[:5]:
        out.append(f"> warning: {md(w)}")
    cmd = (doc.get("source") or {}).get("command")
    tool = doc.get("tool") or {}
    out.append("")
    out.append(f"<sub>traceinspect {md(tool.get('version', __version__))}"
               + (f" · {md_code(cmd)}" if cmd else "") + "</sub>")
    return "\n".join(out).rstrip() + "\n"


def launched_by(doc: dict[str, Any]) -> dict[Any, str]:
    """For each (kernel name, class), and for each kernel name, the CPU op that launches it most often (the
    document's kernel table)."""
    kt = (doc.get("report") or {}).get("kernels") if isinstance(doc.get("report"), dict) else None
    if not isinstance(kt, dict):
        return {}
    names, ops = kt.get("name") or [], kt.get("launched_by") or []
    classes = kt.get("cls") or [None] * len(names)
    out: dict[Any, str] = {}
    for n, c, o in zip(names, classes, ops, strict=False):
        if o:
            out[(str(n), str(c))] = str(o)
            out.setdefault(str(n), str(o))
    return out


def write_markdown(doc: dict[str, Any], path: str | Path) -> Path:
    """Write the Markdown summary atomically."""
    write_text_atomic(path, render_markdown(doc))
    return Path(path)
