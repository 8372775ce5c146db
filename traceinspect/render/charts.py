"""The report's inline SVG charts, each drawn from the analysis document: the glance bar, time by class per
rank, GEMM efficiency (M versus % of peak), collective wait versus transfer, and the critical path."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from markupsafe import Markup

from traceinspect.render import short_name
from traceinspect.render.palette import IDLE_STROKE, PATH_COLORS, class_color, text_color
from traceinspect.render.story import share_of_step, step_share
from traceinspect.render.svg import WIDTH, bar_axis, coord, el, get, isnum, svg
from traceinspect.units import fmt_pct, fmt_us

# --------------------------------------------------------------------------------------------- charts

def class_breakdown_svg(doc: dict[str, Any]) -> tuple[Markup, list[str]]:
    """Stacked horizontal bar per rank: kernel time per class per step, then GPU idle in the step."""
    ranks = doc.get("ranks") or []
    order = [c for c, _ in sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("share") or 0))]
    rows = []
    for r in ranks:
        cl = r.get("classes") or {}
        segs = [(c, float(cl[c]["us_per_step"])) for c in order if c in cl and isnum(cl[c].get("us_per_step"))]
        idle = r.get("idle_us")
        rows.append((r, segs, float(idle) if isnum(idle) else 0.0))
    vmax = max((sum(s for _, s in segs) + idle for _, segs, idle in rows), default=0.0)
    if not rows or vmax <= 0:
        return Markup(""), order
    left, right, bar_h, gap, top = 78, 215, 22, 8, 8
    out, scale, height = bar_axis(len(rows), vmax, left, right, bar_h, gap, top)
    for i, (r, segs, idle) in enumerate(rows):
        y = top + i * (bar_h + gap)
        out.append(el("text", {"x": left - 8, "y": y + bar_h / 2 + 4, "text-anchor": "end", "class": "lab"},
                      str(r.get("label", r.get("rank")))))
        x = float(left)
        total = sum(s for _, s in segs)
        for c, us in segs:
            w = us * scale
            fill = class_color(c)
            share = step_share(us, doc) or 0.0
            tip = f"{r.get('label')} · {c}: {fmt_us(us)} per step ({fmt_pct(share)} of the step time)"
            kids = [el("title", None, tip)]
            out.append(el("rect", {"x": x, "y": y, "width": max(w, 0.0), "height": bar_h, "fill": fill}, *kids))
            if w > 42:
                out.append(el("text", {"x": x + w / 2, "y": y + bar_h / 2 + 4, "text-anchor": "middle",
                                       "fill": text_color(fill), "class": "seg"}, fmt_pct(share)))
            x += w
        if idle > 0:
            w = idle * scale
            out.append(el("rect", {"x": x, "y": y + 0.5, "width": max(w - 0.5, 0.0), "height": bar_h - 1,
                                   "fill": "url(#idle-hatch)", "stroke": IDLE_STROKE, "stroke-width": 1},
                          el("title", None, f"{r.get('label')} · GPU idle inside the step: {fmt_us(idle)} "
                                            f"(median)")))
            x += w
        step = get(r, "step_us", "median")
        out.append(el("text", {"x": x + 6, "y": y + bar_h / 2 + 4, "class": "lab"},
                      f"{fmt_us(total)} busy" + (f" · step {fmt_us(step)}" if isnum(step) else "")))
    defs = el("defs", None, el("pattern", {"id": "idle-hatch", "width": 6, "height": 6,
                                           "patternUnits": "userSpaceOnUse", "patternTransform": "rotate(45)"},
                               el("rect", {"width": 6, "height": 6, "fill": "#ffffff"}),
                               el("line", {"x1": 0, "y1": 0, "x2": 0, "y2": 6, "stroke": "#c8c8c8",
                                           "stroke-width": 2})))
    return svg(WIDTH, height, "decode-step time by class per rank", defs, *out), order


def glance_svg(doc: dict[str, Any]) -> Markup:
    """One bar for the header: where a step's GPU time goes (mean over ranks), biggest class first."""
    classes = sorted(((c, v.get("us_per_step")) for c, v in (doc.get("classes") or {}).items()
                      if isnum(v.get("us_per_step")) and v["us_per_step"] > 0), key=lambda x: -x[1])
    idle = [r.get("idle_us") for r in doc.get("ranks") or [] if isnum(r.get("idle_us"))]
    idle_us = float(np.mean(idle)) if idle else 0.0
    total = sum(us for _, us in classes) + idle_us
    if total <= 0:
        return Markup("")
    width, h = WIDTH, 30
    out: list[Markup] = []
    x = 0.0
    for c, us in classes:
        w = us / total * width
        fill = class_color(c)
        share = share_of_step(doc["classes"][c], doc) or 0.0
        out.append(el("rect", {"x": x, "y": 0, "width": w, "height": h, "fill": fill},
                      el("title", None, f"{c}: {fmt_us(us)} per step ({fmt_pct(share)} of the step time)")))
        label = f"{c} {fmt_pct(share)}"
        if w > 7 * len(label) + 10:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg",
                                   "font-size": "12.5"}, label))
        elif w > 7 * 5 + 6:
            out.append(el("text", {"x": x + 4, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg"},
                          fmt_pct(share)))
        x += w
    if idle_us > 0:
        w = idle_us / total * width
        out.append(el("rect", {"x": x + 0.5, "y": 0.5, "width": max(w - 1, 0.0), "height": h - 1,
                               "fill": "url(#glance-hatch)", "stroke": IDLE_STROKE},
                      el("title", None, f"GPU idle inside the step: {fmt_us(idle_us)} "
                                        f"({fmt_pct(step_share(idle_us, doc))} of the step time)")))
        if w > 70:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "class": "seg", "fill": "#444"},
                          f"idle {fmt_pct(step_share(idle_us, doc))}"))
    defs = el("defs", None, el("pattern", {"id": "glance-hatch", "width": 6, "height": 6,
                                           "patternUnits": "userSpaceOnUse", "patternTransform": "rotate(45)"},
                               el("rect", {"width": 6, "height": 6, "fill": "#ffffff"}),
                               el("line", {"x1": 0, "y1": 0, "x2": 0, "y2": 6, "stroke": "#c8c8c8",
                                           "stroke-width": 2})))
    return svg(width, h, "where a step's GPU time goes", defs, *out)

def gemm_scatter_svg(doc: dict[str, Any]) -> tuple[Markup, str | None, list[str], str]:
    """M (log scale) vs achieved % of peak, bubble area = time per step, colour = class. Returns the
    SVG, the reason when there is none, the classes shown, and a note on what could not be placed."""
    points, note = _gemm_points(doc)
    if isinstance(points, str):
        return Markup(""), points, [], note
    left, right, top, bottom = 64, 20, 14, 40
    width, height = WIDTH, 300
    pw, ph = width - left - right, height - top - bottom
    ms = [p["m"] for p in points]
    lo = math.floor(math.log10(max(min(ms), 1)))
    hi = max(math.ceil(math.log10(max(max(ms), 1))), lo + 1)
    # log y from a decade below the least efficient GEMM to 100% (decode GEMMs often run at 0.1-10%)
    ylo = min(math.floor(math.log10(max(min(p["pct"] for p in points), 1e-3))), 0)
    yhi = max(2, math.ceil(math.log10(max(max(p["pct"] for p in points), 1e-3))))
    tmax = max(p["us"] for p in points) or 1.0

    def xs(m: float) -> float:
        return left + (math.log10(max(m, 1)) - lo) / (hi - lo) * pw

    def ys(v: float) -> float:
        return top + ph - (math.log10(max(v, 10.0 ** ylo)) - ylo) / (yhi - ylo) * ph

    out: list[Markup] = []
    for e in range(lo, hi + 1):
        x = left + (e - lo) / (hi - lo) * pw
        out.append(el("line", {"x1": x, "x2": x, "y1": top, "y2": top + ph, "class": "grid"}))
        out.append(el("text", {"x": x, "y": top + ph + 16, "text-anchor": "middle", "class": "axis"},
                      f"{10 ** e:,}"))
    for e in range(ylo, yhi + 1):
        y = ys(10.0 ** e)
        out.append(el("line", {"x1": left, "x2": left + pw, "y1": y, "y2": y,
                               "class": "grid", "stroke": "#c9cdd3" if e == 2 else None}))
        out.append(el("text", {"x": left - 6, "y": y + 4, "text-anchor": "end", "class": "axis"},
                      f"{10.0 ** e:g}%"))
    out.append(el("text", {"x": left + pw / 2, "y": height - 6, "text-anchor": "middle", "class": "axis"},
                  "M: rows per GEMM (per expert for grouped MoE GEMMs), log scale"))
    out.append(el("text", {"x": 14, "y": top + ph / 2, "text-anchor": "middle", "class": "axis",
                           "transform": f"rotate(-90 14 {coord(top + ph / 2)})"}, "% of dense peak (log)"))
    ranked = sorted(points, key=lambda p: -p["us"])
    labels: list[Markup] = []
    placed: list[tuple[float, float]] = []
    for i, p in enumerate(ranked):
        r = 3 + 20 * math.sqrt(p["us"] / tmax)
        tip = (f"{p['label']}\n{p['cls']} · {p['dtype']} · {p['shape']}\n{p['pct']:.2g}% of peak"
               + (f" ({p['tflops']:.1f} TFLOP/s)" if isnum(p.get("tflops")) else "")
               + f" · {fmt_us(p['us'])} per step per rank · {p['calls']} calls")
        col = class_color(p["cls"])
        cx, cy = xs(p["m"]), ys(p["pct"])
        out.append(el("circle", {"cx": cx, "cy": cy, "r": r, "fill": col,
                                 "fill-opacity": 0.5, "stroke": col, "stroke-width": 1.2},
                      el("title", None, tip)))
        if i < 3:  # name the three GEMMs that take the most time, without overlapping labels
            text = f"{short_name(p['label'], 28)} {p['dtype']} M={p['m']:g}: {p['pct']:.2g}%"
            lx, ly = cx + r + 4, cy + 4
            while any(abs(ly - y0) < 13 and abs(lx - x0) < 6.2 * len(text) for x0, y0 in placed):
                ly += 13
            placed.append((lx, ly))
            labels.append(el("text", {"x": lx, "y": ly, "class": "lab halo", "font-size": "10.5"}, text))
    out.extend(labels)
    classes = sorted({p["cls"] for p in points})
    return svg(width, height, "GEMM efficiency: M versus percent of peak", *out), None, classes, note


def _gemm_points(doc: dict[str, Any]) -> tuple[list[dict[str, Any]] | str, str]:
    """Points for the GEMM scatter from the ``gemm`` section (or the reason there are none), and a note
    on the GEMM time that could not be placed (unknown shape or peak)."""
    gemm = doc.get("gemm")
    if gemm is None:
        return "the analysis has no GEMM efficiency section", ""
    if isinstance(gemm, dict):
        if gemm.get("available") is False or gemm.get("applicable") is False:
            return str(gemm.get("reason") or "GEMM efficiency could not be measured"), ""
        gemm = gemm.get("rows") or gemm.get("kernels") or []
    if not isinstance(gemm, list) or not gemm:
        return "no GEMM kernels in the analysed steps", ""
    per = max(int(get(doc, "steps", "count") or 1), 1) * max(len(doc.get("ranks") or []), 1)
    points: list[dict[str, Any]] = []
    lost_us, total_us = 0.0, 0.0
    reasons: dict[str, float] = {}
    for g in gemm:
        if not isinstance(g, dict):
            continue
        us = g.get("us")
        us = float(us) if isnum(us) else 0.0
        total_us += us
        m, pct = g.get("m"), g.get("pct_peak")
        groups = g.get("groups") if isnum(g.get("groups")) and g.get("groups") > 1 else 1
        if not (isnum(m) and isnum(pct) and m > 0):
            lost_us += us
            why = str(g.get("reason") or ("no recorded shape" if not isnum(m) else "no peak for this dtype"))
            reasons[why] = reasons.get(why, 0.0) + us
            continue
        dims = "×".join(str(g.get(x)) for x in ("m", "n", "k"))
        shape = f"M×N×K {dims}" + (f", {groups} groups" if groups > 1 else "") + (
            f", batch {g['batch']}" if isnum(g.get("batch")) and g["batch"] > 1 else "")
        points.append({"m": max(float(m) / groups, 1.0), "pct": float(pct), "us": us / per,
                       "cls": str(g.get("cls") or "other"), "label": str(g.get("op") or g.get("name") or "GEMM"),
                       "dtype": str(g.get("dtype") or "?"), "shape": shape, "tflops": g.get("tflops"),
                       "calls": int(g.get("calls") or 0)})
    note = ""
    if lost_us > 0 and total_us > 0:
        top = sorted(reasons.items(), key=lambda kv: -kv[1])[:3]
        note = (f"{fmt_pct(lost_us / total_us)} of GEMM time is not plotted: "
                + "; ".join(f"{why} ({fmt_pct(us / total_us)})" for why, us in top) + ".")
    if not points:
        return "no GEMM with a known shape and peak" + (f" ({note})" if note else ""), note
    return points, note


def _first(d: dict[str, Any], *keys: str) -> Any:
    for k in keys:
        if k in d and d[k] is not None:
            return d[k]
    return None


def collectives_svg(doc: dict[str, Any]) -> tuple[Markup, str | None]:
    """Per rank, collective time per step split into waiting for peers and transferring."""
    coll = doc.get("collectives")
    if not isinstance(coll, dict):
        return Markup(""), "the analysis has no collectives section"
    if coll.get("applicable") is False or coll.get("available") is False:
        return Markup(""), str(coll.get("reason") or "collectives could not be measured")
    per_rank = coll.get("per_rank")
    if isinstance(per_rank, dict):
        per_rank = [dict(v, rank=k) for k, v in per_rank.items()]
    if not per_rank:
        return Markup(""), str(coll.get("reason") or "no collective kernels in the analysed steps")
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or []}
    straggler = get(coll, "straggler", "rank")
    rows = []
    for r in per_rank:
        wait = _first(r, "wait_us_per_step", "wait_us")
        xfer = _first(r, "transfer_us_per_step", "transfer_us")
        if not (isnum(wait) and isnum(xfer)):
            continue
        rows.append((str(r.get("label") or labels.get(r.get("rank")) or f"rank {r.get('rank')}"), float(wait),
                     float(xfer), r.get("late_arrivals"), r.get("arrivals"), r.get("rank") == straggler))
    if not rows:
        return Markup(""), "wait and transfer time could not be split for any rank"
    vmax = max(w + t for _, w, t, *_ in rows) or 1.0
    left, right, bar_h, gap, top = 78, 330, 20, 8, 8
    out, scale, height = bar_axis(len(rows), vmax, left, right, bar_h, gap, top)
    for i, (label, wait, xfer, late, arrivals, is_straggler) in enumerate(rows):
        y = top + i * (bar_h + gap)
        out.append(el("text", {"x": left - 8, "y": y + bar_h / 2 + 4, "text-anchor": "end",
                               "class": "lab", "font-weight": "700" if is_straggler else None}, label))
        out.append(el("rect", {"x": left, "y": y, "width": wait * scale, "height": bar_h, "fill": PATH_COLORS["comm_wait"]},
                      el("title", None, f"{label}: waiting for peers {fmt_us(wait)} per step")))
        out.append(el("rect", {"x": left + wait * scale, "y": y, "width": xfer * scale, "height": bar_h,
                               "fill": class_color("comm")},
                      el("title", None, f"{label}: transfer {fmt_us(xfer)} per step")))
        tail = f"wait {fmt_us(wait)} · transfer {fmt_us(xfer)}"
        if isnum(late):
            tail += f" · last to arrive {int(late)}" + (f" of {int(arrivals)}" if isnum(arrivals) else "×")
        if is_straggler:
            tail += " · straggler"
        out.append(el("text", {"x": left + (wait + xfer) * scale + 6, "y": y + bar_h / 2 + 4, "class": "lab"},
                      tail))
    return svg(WIDTH, height, "collective wait versus transfer per rank", *out), None


def critical_path_svg(doc: dict[str, Any]) -> tuple[Markup, str | None, list[str]]:
    """One stacked bar: what the critical path of a step is made of (mean over aligned steps)."""
    cp = doc.get("critical_path")
    if not isinstance(cp, dict) or not cp:
        return Markup(""), "the analysis has no critical-path section", []
    if cp.get("applicable") is False:
        return Markup(""), str(cp.get("reason") or "the critical path could not be built"), []
    comp = cp.get("composition") or {}
    segs = [(c, float(v["us_per_step"]), v.get("share")) for c, v in comp.items()
            if isinstance(v, dict) and isnum(v.get("us_per_step")) and v["us_per_step"] > 0]
    if not segs:
        return Markup(""), "the critical path is empty", []
    segs.sort(key=lambda x: -x[1])
    total = sum(us for _, us, _ in segs)
    left, right, bar_h, top = 78, 14, 26, 4
    plot_w = WIDTH - left - right
    out: list[Markup] = [el("text", {"x": left - 8, "y": top + bar_h / 2 + 4, "text-anchor": "end",
                                     "class": "lab"}, "path")]
    x = float(left)
    for c, us, share in segs:
        w = us / total * plot_w
        fill = path_color(c)
        out.append(el("rect", {"x": x, "y": top, "width": w, "height": bar_h, "fill": fill},
                      el("title", None, f"{c}: {fmt_us(us)} per step on the critical path "
                                        f"({fmt_pct(share)} of the critical path)")))
        label = f"{c} {fmt_pct(share)}"
        if w > 6.2 * len(label) + 10:
            out.append(el("text", {"x": x + 5, "y": top + bar_h / 2 + 4, "fill": text_color(fill),
                                   "class": "seg"}, label))
        elif w > 6.2 * 5 + 6:
            out.append(el("text", {"x": x + 3, "y": top + bar_h / 2 + 4, "fill": text_color(fill),
                                   "class": "seg"}, fmt_pct(share)))
        x += w
    return svg(WIDTH, top + bar_h + 6, "critical path composition", *out), None, [c for c, _, _ in segs]


def path_color(c: str) -> str:
    return PATH_COLORS.get(c, class_color(c))

