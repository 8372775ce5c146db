"""A load sweep (``traceinspect.sweep/1``) and a comparison of two, on the terminal and as one HTML page
with its charts: throughput, step time and latencies, per-expert M, power and clocks against the
concurrency, and the GPU time by class per level."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from markupsafe import Markup, escape
from rich.console import Console
from rich.markup import escape as rich_escape
from rich.table import Table

from traceinspect.fileio import write_text_atomic
from traceinspect.render.palette import class_color
from traceinspect.render.svg import coord, el, nice_ticks, svg
from traceinspect.units import fmt_pct, fmt_us, is_number

DASH = "-"


def _num(v: Any, spec: str = ",.0f", unit: str = "") -> str:
    return f"{format(v, spec)}{unit}" if is_number(v) else DASH


def _ms(v: Any) -> str:
    return fmt_us(v * 1000.0) if is_number(v) else DASH


def _pair(d: Any) -> str:
    if not isinstance(d, dict):
        return DASH
    return f"{_ms(d.get('p50'))} / {_ms(d.get('p99'))}"


def level_rows(doc: dict[str, Any]) -> list[list[str]]:
    """The level table's cells (terminal and HTML show the same text)."""
    rows = []
    for lv in doc.get("levels", []):
        m = lv.get("per_expert_m")
        rows.append([
            str(lv.get("concurrency")), _num(lv.get("running_requests"), "d"), lv.get("capped_by") or DASH,
            _num(lv.get("output_tokens_per_s"), ",.1f"), _num(lv.get("request_per_s"), ",.2f"),
            _pair(lv.get("tpot_ms")), _pair(lv.get("itl_ms")),
            fmt_us(lv["step_us"]) if is_number(lv.get("step_us")) else DASH,
            fmt_pct(lv["step_between_share"]) if is_number(lv.get("step_between_share")) else DASH,
            _num(m, ",.1f") if is_number(m) else DASH,
            (_num(lv.get("power_w"), ",.0f", " W") + (f" / {_num(lv.get('power_limit_w'), ',.0f')}"
                                                     if is_number(lv.get("power_limit_w")) else "")),
            _num(lv.get("sm_clock_mhz"), ",.0f", " MHz"),
            lv.get("status", DASH) + (f": {lv['error']}" if lv.get("error") else ""),
        ])
    return rows


HEAD = ["concurrency", "running", "capped by", "output tok/s", "req/s", "TPOT p50/p99", "ITL p50/p99", "step",
        "between", "M/expert", "power", "SM clock", "status"]


def notes(doc: dict[str, Any]) -> list[str]:
    """The sweep's conclusions in sentences: the knee, the model, GPU power, warnings."""
    out = []
    k = doc.get("knee")
    if k:
        out.append(f"knee: {k['text']}")
    else:
        ok = [lv for lv in doc.get("levels", []) if is_number(lv.get("output_tokens_per_s"))]
        out.append("knee: none: throughput still grows at the highest level measured" if len(ok) > 1 else
                   "knee: needs two measured levels")
    m = doc.get("model") or {}
    if m.get("experts") and m.get("top_k"):
        out.append(f"per-expert M = running requests x top-k {m['top_k']} / {m['experts']} experts ({m['source']})")
    else:
        out.append(f"per-expert M: {m.get('note') or 'unknown: no model config'}")
    between = [lv for lv in doc.get("levels", []) if is_number(lv.get("step_between_share"))]
    if between:
        top = max(between, key=lambda lv: lv["concurrency"])
        out.append(f"between decode steps (scheduler and host work outside the forward): "
                   f"{fmt_pct(top['step_between_share'])} of the decode cycle at {top['concurrency']}: batching "
                   "decode steps (--num-continuous-decode-steps) can save at most that")
    for lv in doc.get("levels", []):
        if lv.get("power_note"):
            out.append(f"at {lv['concurrency']}: {lv['power_note']}")
    if doc.get("gpu_note"):
        out.append(doc["gpu_note"])
    out += [f"warning: {w}" for w in doc.get("warnings", [])]
    return out


def class_rows(doc: dict[str, Any], top: int = 8) -> tuple[list[str], list[list[str]]]:
    levels = [lv for lv in doc.get("levels", []) if isinstance(lv.get("classes"), dict)]
    totals: dict[str, float] = {}
    for lv in levels:
        for c, v in lv["classes"].items():
            if is_number(v):
                totals[c] = totals.get(c, 0.0) + v
    classes = [c for c, _ in sorted(totals.items(), key=lambda kv: -kv[1])][:top]
    rows = [[str(lv["concurrency"])] + [fmt_pct(lv["classes"].get(c)) if is_number(lv["classes"].get(c)) else DASH
                                        for c in classes] for lv in levels]
    return classes, rows


def render_terminal(doc: dict[str, Any], console: Console | None = None) -> None:
    con = console or Console(highlight=False, soft_wrap=False, width=None if Console().is_terminal else 160)
    con.print(f"[bold]traceinspect sweep[/bold] {rich_escape(str(doc.get('url')))}  "
              f"input {doc['load']['input']}, output {doc['load']['output']} tokens, window {doc['load']['window_s']:g} s")
    t = Table(title="Levels (this client's clock; step time from each level's trace)", title_justify="left")
    rows = level_rows(doc)
    # columns no level has a value for (no trace captured, no GPU sampled) are left out here
    keep = [i for i, h in enumerate(HEAD) if h in ("concurrency", "status") or any(r[i] not in (DASH, f"{DASH} W")
                                                                                  for r in rows)]
    for i in keep:
        t.add_column(HEAD[i], justify="left" if HEAD[i] in ("capped by", "status") else "right")
    for row in rows:
        t.add_row(*(rich_escape(row[i]) for i in keep))
    con.print(t)
    classes, rows = class_rows(doc)
    if rows:
        ct = Table(title="GPU time by class (share of the decode step)", title_justify="left")
        ct.add_column("concurrency", justify="right")
        for c in classes:
            ct.add_column(c, justify="right")
        for r in rows:
            ct.add_row(*(rich_escape(x) for x in r))
        con.print(ct)
    for line in notes(doc):
        con.print(rich_escape(line))


def render_compare_terminal(cmp: dict[str, Any], console: Console | None = None) -> None:
    con = console or Console(highlight=False, soft_wrap=False, width=None if Console().is_terminal else 160)
    verdict = ("different: " + ", ".join(f"{r['concurrency']} ({r['change']:+.1%})" for r in cmp["levels"]
                                          if r["significant"])
               if cmp["different"] else "no difference beyond noise")
    con.print(f"[bold]sweep compare[/bold]: {rich_escape(verdict)} (threshold {cmp['threshold_pct']:g}%, "
              f"alpha {cmp['alpha']:g})")
    t = Table(title_justify="left")
    for h in ("concurrency", "A tok/s", "B tok/s", "change", "significant", "why"):
        t.add_column(h, justify="left" if h == "why" else "right")
    for r in cmp["levels"]:
        t.add_row(str(r["concurrency"]), _num(r["a_tokens_per_s"], ",.1f"), _num(r["b_tokens_per_s"], ",.1f"),
                  f"{r['change']:+.1%}" if is_number(r["change"]) else DASH, "yes" if r["significant"] else "no",
                  rich_escape(r["reason"]))
    con.print(t)
    if cmp["config_diff"]:
        con.print("configuration keys that differ: " + rich_escape(", ".join(
            f"{k} ({v['a']!r} -> {v['b']!r})" for k, v in cmp["config_diff"].items())))
    else:
        con.print("configuration: the same")
    if cmp.get("levels_in_one_only"):
        con.print("levels measured in one sweep only: " + ", ".join(map(str, cmp["levels_in_one_only"])))


# -- HTML ----------------------------------------------------------------------------------------------

W, H, L, R, T, B = 540, 260, 64, 20, 24, 40


def line_chart(name: str, title: str, levels: list[int], series: list[tuple[str, list[Any], str]],
               unit: str, knee_at: int | None = None, hline: tuple[float, str] | None = None) -> Markup:
    """Values against the concurrency (one point per level, spaced evenly: the levels double)."""
    pts = [v for _, vals, _ in series for v in vals if is_number(v)]
    if hline is not None:
        pts.append(hline[0])
    if not levels or not pts:
        return el("figure", {"class": "chart-box", "data-chart": name}, el("figcaption", None, title),
                  el("p", {"class": "empty"}, "no measured values"))
    ticks = nice_ticks(0.0, max(pts) * 1.05 or 1.0, 5)
    top = max(ticks[-1], max(pts)) or 1.0
    pw, ph = W - L - R, H - T - B
    n = len(levels)

    def x(i: int) -> float:
        return L + (pw * (i + 0.5) / n)

    def y(v: float) -> float:
        return T + ph - ph * v / top

    parts: list[Markup] = []
    for t in ticks:
        parts.append(el("line", {"x1": L, "x2": W - R, "y1": y(t), "y2": y(t), "class": "grid"}))
        parts.append(el("text", {"x": L - 6, "y": y(t) + 4, "text-anchor": "end", "class": "axis"}, f"{t:,.6g}"))
    for i, c in enumerate(levels):
        parts.append(el("text", {"x": x(i), "y": H - B + 16, "text-anchor": "middle", "class": "axis"}, str(c)))
    parts.append(el("text", {"x": L + pw / 2, "y": H - 6, "text-anchor": "middle", "class": "axis"},
                    "concurrency (requests in flight)"))
    parts.append(el("text", {"x": 6, "y": T - 8, "class": "axis"}, unit))
    if knee_at is not None and knee_at in levels:
        kx = x(levels.index(knee_at))
        parts.append(el("line", {"x1": kx, "x2": kx, "y1": T, "y2": T + ph, "class": "knee"}))
        parts.append(el("text", {"x": kx + 4, "y": T + 12, "class": "axis"}, "knee"))
    if hline is not None:
        parts.append(el("line", {"x1": L, "x2": W - R, "y1": y(hline[0]), "y2": y(hline[0]), "class": "limit"}))
        parts.append(el("text", {"x": W - R, "y": y(hline[0]) - 4, "text-anchor": "end", "class": "axis"}, hline[1]))
    legend = []
    for label, vals, color in series:
        xy = [(x(i), y(v)) for i, v in enumerate(vals) if is_number(v)]
        if len(xy) > 1:
            parts.append(el("polyline", {"points": " ".join(f"{coord(a)},{coord(b)}" for a, b in xy),
                                         "fill": "none", "stroke": color, "stroke-width": "2"}))
        for (a, b), v in zip(xy, [v for v in vals if is_number(v)], strict=True):
            parts.append(el("circle", {"cx": a, "cy": b, "r": "4", "fill": color, "class": "point",
                                       "data-series": label}, el("title", None, f"{label}: {v:,.6g} {unit}")))
        legend.append(el("span", {"class": "key"}, el("i", {"style": f"background:{color}"}, " "), label))
    return el("figure", {"class": "chart-box", "data-chart": name}, el("figcaption", None, title),
              svg(W, H, title, *parts), el("div", {"class": "legend"}, *legend))


def class_chart(doc: dict[str, Any]) -> Markup:
    levels = [lv for lv in doc.get("levels", []) if isinstance(lv.get("classes"), dict)]
    title = "GPU time by class per level (share of the decode step)"
    if not levels:
        return el("figure", {"class": "chart-box", "data-chart": "classes"}, el("figcaption", None, title),
                  el("p", {"class": "empty"}, "no level was captured and analysed (--steps 0, or the capture failed)"))
    classes, _ = class_rows(doc, top=12)
    bar_h, gap, left = 22, 10, 70
    height = T + len(levels) * (bar_h + gap) + 10
    pw = W * 2 - left - R
    parts: list[Markup] = []
    for j, lv in enumerate(levels):
        y0 = T + j * (bar_h + gap)
        parts.append(el("text", {"x": left - 8, "y": y0 + bar_h - 6, "text-anchor": "end", "class": "axis"},
                        str(lv["concurrency"])))
        x0 = float(left)
        for c in classes:
            v = lv["classes"].get(c)
            if not is_number(v) or v <= 0:
                continue
            w = pw * min(float(v), 1.0)
            parts.append(el("rect", {"x": x0, "y": y0, "width": max(w, 0.5), "height": bar_h, "fill": class_color(c),
                                     "class": "seg"}, el("title", None, f"{c}: {fmt_pct(v)} at {lv['concurrency']}")))
            x0 += w
    legend = [el("span", {"class": "key"}, el("i", {"style": f"background:{class_color(c)}"}, " "), c) for c in classes]
    return el("figure", {"class": "chart-box wide", "data-chart": "classes"}, el("figcaption", None, title),
              svg(W * 2, height, title, *parts), el("div", {"class": "legend"}, *legend))


CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:24px;color:#1d232b;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
p.meta{color:#56606b;margin:0 0 12px}
table{border-collapse:collapse;font-size:13px}th,td{padding:4px 8px;border-bottom:1px solid #e3e6ea;text-align:right}
th{background:#f4f6f8}td.l,th.l{text-align:left}
.charts{display:flex;flex-wrap:wrap;gap:16px}
figure.chart-box{margin:0;border:1px solid #e3e6ea;border-radius:6px;padding:8px}
figcaption{font-weight:600;font-size:13px;margin-bottom:4px}
svg .grid{stroke:#e3e6ea}svg .axis{fill:#56606b;font-size:11px}svg .knee{stroke:#c0392b;stroke-dasharray:4 3}
svg .limit{stroke:#8e44ad;stroke-dasharray:6 3}
.legend{font-size:12px;color:#56606b}.key{margin-right:12px}.key i{display:inline-block;width:10px;height:10px;margin-right:4px}
ul.notes li{margin:4px 0}.failed{color:#c0392b}
"""


def render_sweep_html(doc: dict[str, Any]) -> str:
    levels = [lv["concurrency"] for lv in doc.get("levels", [])]
    get = lambda key: [lv.get(key) for lv in doc.get("levels", [])]  # noqa: E731
    sub = lambda key, part: [(lv.get(key) or {}).get(part) for lv in doc.get("levels", [])]  # noqa: E731
    knee_at = (doc.get("knee") or {}).get("concurrency")
    step_ms = [v / 1000.0 if is_number(v) else None for v in get("step_us")]
    limits = [v for v in get("power_limit_w") if is_number(v)]
    charts = [
        line_chart("throughput", "Output throughput", levels, [("output tok/s", get("output_tokens_per_s"), "#2e86de")],
                   "tok/s", knee_at),
        line_chart("step", "Step time and inter-token latency", levels,
                   [("step (trace, median)", step_ms, "#e67e22"), ("ITL p50", sub("itl_ms", "p50"), "#16a085"),
                    ("TPOT p50", sub("tpot_ms", "p50"), "#8e44ad")], "ms", knee_at),
        line_chart("per_expert_m", "Tokens per expert per step (M)", levels,
                   [("M per expert", get("per_expert_m"), "#27ae60")],
                   "tokens", knee_at),
        line_chart("power", "GPU power (mean per GPU)", levels, [("power", get("power_w"), "#c0392b")], "W", knee_at,
                   (max(limits), f"limit {max(limits):,.0f} W") if limits else None),
        line_chart("clocks", "SM and memory clocks", levels,
                   [("SM clock", get("sm_clock_mhz"), "#2c3e50"), ("memory clock", get("mem_clock_mhz"), "#7f8c8d")],
                   "MHz", knee_at),
    ]
    head = "".join(str(el("th", {"class": "l" if h in ("capped by", "status") else None}, h)) for h in HEAD)
    body = []
    for row, lv in zip(level_rows(doc), doc.get("levels", []), strict=True):
        cls = "failed" if lv.get("status") not in ("ok",) else None
        cells = "".join(str(el("td", {"class": "l" if i in (2, 12) else None}, c)) for i, c in enumerate(row))
        body.append(f'<tr class="{escape(cls or "")}" data-level="{escape(str(lv.get("concurrency")))}">{cells}</tr>')
    classes, crow = class_rows(doc)
    ctable = ""
    if crow:
        ctable = ("<h2>GPU time by class per level</h2><table><tr><th>concurrency</th>"
                  + "".join(str(el("th", None, c)) for c in classes) + "</tr>"
                  + "".join("<tr>" + "".join(str(el("td", None, x)) for x in r) + "</tr>" for r in crow) + "</table>")
    cfg = doc.get("server_config") or {}
    cfg_rows = "".join(f"<tr>{el('td', {'class': 'l'}, k)}"
                       f"{el('td', {'class': 'l'}, v if isinstance(v, str) else json.dumps(v))}</tr>"
                       for k, v in cfg.items())
    load = doc.get("load") or {}
    return (
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>{escape('traceinspect sweep ' + str(doc.get('url')))}</title><style>{CSS}</style></head><body>"
        f"<h1>Load sweep of {escape(str(doc.get('url')))}</h1>"
        f"<p class=\"meta\">{escape(str(load.get('input')))} input and {escape(str(load.get('output')))} output tokens per "
        f"request, {escape(str(load.get('window_s')))} s windows; started {escape(str(doc.get('started_at')))}; "
        f"traceinspect {escape(str((doc.get('tool') or {}).get('version')))}</p>"
        "<h2>Findings</h2><ul class=\"notes\">" + "".join(str(el("li", None, n)) for n in notes(doc)) + "</ul>"
        "<h2>Charts</h2><div class=\"charts\">" + "".join(str(c) for c in charts) + str(class_chart(doc)) + "</div>"
        f"<h2>Levels</h2><table id=\"levels\"><tr>{head}</tr>{''.join(body)}</table>"
        + ctable
        + f"<h2>Server configuration</h2><table>{cfg_rows}</table>"
        "</body></html>"
    )


def write_sweep_html(doc: dict[str, Any], path: str | Path) -> Path:
    write_text_atomic(path, render_sweep_html(doc))
    return Path(path)


__all__ = ["render_terminal", "render_compare_terminal", "render_sweep_html", "write_sweep_html"]
