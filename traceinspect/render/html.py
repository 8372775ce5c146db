"""The HTML report: one self-contained file (inline CSS, inline SVG charts, a few lines of inline JS for
the timeline and table sorting), rendered with jinja2 (autoescape on) from the analysis document alone, so
``traceinspect report analysis.json`` makes the same page as the traces it came from. It makes no network
request when viewed, so it opens anywhere, offline, years later.

Every string that comes from a trace (kernel and op names, paths, server_info values) reaches the page
only through jinja2's autoescape or :func:`~traceinspect.render.svg.el`, which escapes text and attribute
values; JSON embedded in the page goes through :func:`~traceinspect.render.svg.script_json`.

The page is put together here; its parts live beside it: ``svg`` (escaped markup, axes), ``charts``,
``timeline``, ``views`` (what each section shows) and ``datatables`` (the sortable tables).
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from markupsafe import Markup, escape

from traceinspect.fileio import write_text_atomic
from traceinspect.render.charts import (
    class_breakdown_svg,
    collectives_svg,
    critical_path_svg,
    gemm_scatter_svg,
    glance_svg,
    path_color,
)
from traceinspect.render.datatables import data_tables
from traceinspect.render.gaps import gap_items
from traceinspect.render.roofline import no_floor_note, roofline_svg, roofline_view
from traceinspect.render.story import share_of_step, story
from traceinspect.render.svg import el, get, isnum, legend_html, script_json
from traceinspect.render.timeline import TimelineInfo, after_timeline, timeline_svg
from traceinspect.render.views import (
    add_rule_text,
    class_rows,
    coll_notes,
    coverage_view,
    cpath_notes,
    files_view,
    finding_view,
    headline,
    memory_view,
    meta_rows,
    moe_view,
)
from traceinspect.render.whatif import all_fixed_line
from traceinspect.units import fmt_pct, fmt_us
from traceinspect.version import __version__

__all__ = ["TimelineInfo", "after_timeline", "build_context", "el", "render_html", "rule_text", "script_json",
           "timeline_svg", "write_html"]

TEMPLATES = Path(__file__).parent / "templates"


def build_context(doc: dict[str, Any]) -> dict[str, Any]:
    """Everything the template shows, as plain values (charts as escaped SVG markup), from the analysis
    document alone."""
    steps = doc.get("steps") or {}
    step_us = steps.get("median_us")
    # the one order of every output (severity, then estimated saving): the headline is the first finding
    findings = [dict(f) for f in story(doc).findings]
    add_rule_text(doc, findings)
    breakdown, order = class_breakdown_svg(doc)
    timeline = timeline_svg(doc)
    after_tl, after_label = after_timeline(doc)
    tl_classes = sorted(str(c) for c in doc.get("classes") or {})  # the classes of the analysed kernels
    gemm, gemm_reason, gemm_classes, gemm_note = gemm_scatter_svg(doc)
    roof, roof_reason = roofline_svg(doc)
    coll, coll_reason = collectives_svg(doc)
    cpath, cpath_reason, cpath_classes = critical_path_svg(doc)
    memory, moe = memory_view(doc), moe_view(doc)
    busy = [r.get("gpu_busy_us") for r in doc.get("ranks") or [] if isnum(r.get("gpu_busy_us"))]
    idle = [r.get("idle_us") for r in doc.get("ranks") or [] if isnum(r.get("idle_us"))]
    top_cls = max((doc.get("classes") or {}).items(), key=lambda kv: kv[1].get("us_per_step") or 0, default=None)
    keynums = [
        (f"{steps.get('phase', 'decode')} step (median)", fmt_us(step_us), f"p90 {fmt_us(steps.get('p90_us'))}"),
        ("GPU busy per step", fmt_us(float(np.median(busy))) if busy else "n/a",
         f"idle {fmt_us(float(np.median(idle)))}" if idle else ""),
        ("largest class", top_cls[0] if top_cls else "n/a",
         f"{fmt_pct(share_of_step(top_cls[1], doc))} of the step time" if top_cls else ""),
        ("findings", str(len(findings)),
         ", ".join(f"{n} {s}" for s in ("critical", "warning", "info")
                   if (n := sum(1 for f in findings if f.get("severity") == s)))),
    ]
    return {
        "doc": doc,
        "title": f"traceinspect report · {get(doc, 'run', 'model') or 'unknown model'}",
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "headline": headline(doc, findings),
        "keynums": keynums,
        "glance_svg": glance_svg(doc),
        "meta": meta_rows(doc),
        "files": files_view(doc),
        "findings": [finding_view(i, f, doc, {r.get("rank"): r.get("label") for r in doc.get("ranks") or []})
                     for i, f in enumerate(findings)],
        "gaps": gap_items(doc),
        "breakdown_svg": breakdown,
        "breakdown_legend": legend_html(order, {c: share_of_step(doc["classes"][c], doc) for c in order},
                                        basis="mean per rank, of the step time:"),
        "class_rows": class_rows(doc),
        "timeline": timeline,
        "after_timeline": after_tl, "after_label": after_label,
        "all_fixed": all_fixed_line(doc),
        "timeline_legend": legend_html([c for c in order if c in tl_classes] +
                                        [c for c in tl_classes if c not in order]),
        "gemm_svg": gemm, "gemm_reason": gemm_reason, "gemm_note": gemm_note, "gemm_legend": legend_html(gemm_classes),
        "roofline_svg": roof, "roofline_reason": roof_reason, "roofline_note": no_floor_note(doc),
        "roofline_rows": roofline_view(doc),
        "coll_svg": coll, "coll_reason": coll_reason, "coll_notes": coll_notes(doc),
        "cpath_svg": cpath, "cpath_reason": cpath_reason,
        "cpath_legend": legend_html(cpath_classes, color=path_color), "cpath_notes": cpath_notes(doc),
        "memory": memory[0], "memory_reason": memory[1], "moe": moe[0], "moe_reason": moe[1],
        "data_tables": data_tables(doc),
        "coverage": coverage_view(doc),
        "warnings": [str(w) for w in doc.get("warnings") or []],
        "command": str(get(doc, "source", "command") or "(not recorded)"),
        "paths": [str(p) for p in get(doc, "source", "paths", default=[]) or []],
        "json_blob": script_json(embedded(doc)),
        "version": __version__,
    }


_CODE_SPAN = re.compile(r"`([^`]+)`")


def rule_text(text: str) -> Markup:
    """Rule-authored text (remediation, why) escaped, with its `code spans` shown as code."""
    return Markup(_CODE_SPAN.sub(r"<code>\1</code>", str(escape(text))))


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["rule_text"] = rule_text
    return env


def embedded(doc: dict[str, Any]) -> dict[str, Any]:
    """The document the page embeds: all of it but the ``report`` section, which the page draws."""
    return {k: v for k, v in doc.items() if k != "report"}


def render_html(doc: dict[str, Any]) -> str:
    """The report as one self-contained HTML document, from the analysis document alone."""
    return _env().get_template("report.html.j2").render(**build_context(doc))


def write_html(doc: dict[str, Any], path: str | Path) -> Path:
    """Render the report and write it atomically to ``path``."""
    write_text_atomic(path, render_html(doc))
    return Path(path)
