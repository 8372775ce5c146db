"""The HTML report: one self-contained file (inline CSS, inline SVG charts drawn here, a few lines of
inline JS for table sorting), rendered with jinja2 (autoescape on). It makes no network request when
viewed, so it opens anywhere, offline, years later.

Every string that comes from a trace (kernel and op names, paths, server_info values) reaches the page
only through jinja2's autoescape or :func:`el`, which escapes text and attribute values; the analysis
JSON embedded in the page goes through :func:`script_json`.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import numpy as np
import pandas as pd
from markupsafe import Markup, escape

from traceinspect.fileio import write_text_atomic
from traceinspect.render import (
    fmt_bytes,
    fmt_count,
    fmt_pct,
    fmt_us,
    kernel_label,
    kernel_labels,
    short_name,
)
from traceinspect.render.palette import (
    IDLE_STROKE,
    PATH_COLORS,
    class_color,
    severity_color,
    text_color,
)
from traceinspect.render.story import Open, saving_share, saving_text, step_share, story
from traceinspect.render.whatif import all_fixed_line, group_note, variant_lines
from traceinspect.tables import factorize_text
from traceinspect.version import __version__

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

TEMPLATES = Path(__file__).parent / "templates"
_URL = re.compile(r"https?://[^\s<>\"')\]]+")

TIMELINE_WIDTH = 1120
# kernels a report timeline carries (over all lanes): keeps the report of a long multi-rank step small
TIMELINE_KERNEL_BUDGET = 150_000


# --------------------------------------------------------------------------------------------- escaping

def el(tag: str, attrs: dict[str, Any] | None = None, *children: Any) -> Markup:
    """One SVG/HTML element. Attribute values and text children are escaped; only :class:`Markup`
    children (other elements) pass through. ``tag`` and attribute names come from this module."""
    parts = [f"<{tag}"]
    for k, v in (attrs or {}).items():
        if v is None or v is False:
            continue
        parts.append(f' {k.rstrip("_").replace("_", "-")}="{escape(_num(v) if isinstance(v, float) else v)}"')
    if not children:
        parts.append("/>")
        return Markup("".join(parts))
    parts.append(">")
    parts.extend(str(escape(c)) for c in children if c is not None)
    parts.append(f"</{tag}>")
    return Markup("".join(parts))


def _num(v: float) -> str:
    """A coordinate with at most one decimal and no trailing zeros (keeps the SVG small)."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def script_json(obj: Any) -> Markup:
    """JSON that is safe inside a ``<script>`` element: no ``</script>``, no HTML comment openers, no
    line separators that end a JavaScript string."""
    text = json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, default=str, separators=(",", ":"))
    for raw, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e"),
                     ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(raw, esc)
    return Markup(text)


def _finite(v: Any) -> Any:
    """A copy of a JSON-like value with NaN/inf (not valid JSON) as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


# --------------------------------------------------------------------------------------------- helpers

def _get(d: Any, *keys: str, default: Any = None) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _isnum(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)


def _fmt_value(key: str, v: Any) -> str:
    """A scalar evidence value as text, using the key's unit suffix (``_us``, ``share``, ``_bytes``)."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if _isnum(v):
        k = key.lower()
        if k.endswith("_us") or k.endswith("us_per_step") or k == "us":
            return fmt_us(float(v))
        if "share" in k or k.endswith("_frac") or k.endswith("fraction"):
            return fmt_pct(float(v)) if abs(float(v)) <= 1.5 else f"{float(v):,.3g}"
        if k.startswith("pct_") or k.endswith("_pct"):
            return f"{float(v):.1f}%"
        if "bytes" in k:
            return _fmt_bytes(float(v))
        if k.endswith("per_step") or k.startswith("calls") or k in ("layers", "shapes", "names", "gaps"):
            return fmt_count(float(v))
        if isinstance(v, (int, np.integer)) or (float(v).is_integer() and abs(v) < 1e15):
            return f"{int(v):,}"
        if abs(float(v)) >= 1000:
            return f"{float(v):,.0f}"
        return f"{float(v):.4g}"
    return str(v)


_fmt_bytes = fmt_bytes  # one unit system everywhere (decimal MB/GB, see traceinspect.units)


def _bar_axis(n_rows: int, vmax: float, left: int, right: int, bar_h: int, gap: int,
              top: int) -> tuple[list[Markup], float, float]:
    """Grid lines and the time axis of a horizontal bar chart: (svg parts, px per us, height)."""
    plot_w = TIMELINE_WIDTH - left - right
    height = top + n_rows * (bar_h + gap) + 30
    ticks = _nice_ticks(0, vmax)
    scale = plot_w / max(vmax, ticks[-1])
    out: list[Markup] = []
    for t in ticks:
        x = left + t * scale
        out.append(el("line", {"x1": x, "x2": x, "y1": top - 4, "y2": height - 24, "class": "grid"}))
        out.append(el("text", {"x": x, "y": height - 10, "text-anchor": "middle", "class": "axis"},
                      _tick_label(t, ticks[-1])))
    out.append(el("text", {"x": left - 8, "y": height - 10, "text-anchor": "end", "class": "axis"},
                  _axis_unit(ticks[-1], True)))
    return out, scale, height


def _nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(n, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    ticks = []
    t = first
    while t <= hi + 1e-9 * step:
        ticks.append(round(t, 10))
        t += step
    return ticks


def _tick_label(v: float, top: float | None = None) -> str:
    """A µs tick value; in ms when the axis reaches 10 ms (``top``), so one axis uses one unit."""
    if abs(top if top is not None else v) >= 10_000:
        return f"{v / 1000:g}"
    return f"{v:g}"


def _axis_unit(top: float, per_step: bool = False) -> str:
    unit = "ms" if top >= 10_000 else "µs"
    return f"{unit}/step" if per_step else unit


def _svg(width: float, height: float, label: str, *children: Any) -> Markup:
    return el("svg", {"xmlns": "http://www.w3.org/2000/svg", "viewBox": f"0 0 {_num(width)} {_num(height)}",
                      "width": _num(width), "height": _num(height), "role": "img", "aria-label": label,
                      "class": "chart", "font-size": "11"}, *children)


def _legend_html(classes: Iterable[str], extra: dict[str, float] | None = None,
                 color: Any = None) -> Markup:
    items = []
    for c in classes:
        share = (extra or {}).get(c)
        fill = (color or class_color)(c)
        items.append(el("span", {"class": "lg"}, el("i", {"style": f"background:{fill}"}, ""),
                        c + (f" {fmt_pct(share)}" if share is not None else "")))
    return Markup("".join(items))


# --------------------------------------------------------------------------------------------- headline

@dataclass
class Headline:
    severity: str
    color: str
    text: str
    detail: str
    rule: str | None = None
    anchor: str | None = None
    others: list[dict[str, Any]] = field(default_factory=list)
    open: list[Open] = field(default_factory=list)
    basis: str = ""


def _headline(doc: dict[str, Any], findings: list[dict[str, Any]]) -> Headline:
    """The banner: the lead finding of :func:`~traceinspect.render.story.story` (the one every output
    leads with), the others after it, and the classes or rules the findings leave open."""
    st = story(doc)
    if st.lead is not None:
        f = st.lead
        title = str(f.get("title") or f.get("rule") or "finding")
        detail = (f"Estimated saving: {st.saving}." if st.saving
                  else "Estimated saving: not available (the rule gives no estimate).")
        sev = str(f.get("severity") or "info")
        others = []
        for i, o in enumerate(findings[1:], start=1):
            others.append({"anchor": f"f-{i}", "severity": str(o.get("severity") or "info"),
                           "color": severity_color(str(o.get("severity") or "info")),
                           "title": str(o.get("title") or o.get("rule") or ""),
                           "saving": saving_text(o, doc)})
        return Headline(sev, severity_color(sev), title, detail, str(f.get("rule") or ""), "f-0", others,
                        st.open, st.basis)
    return Headline("none", "#2e7d32", st.quiet, "", open=st.open, basis=st.basis)


# --------------------------------------------------------------------------------------------- charts

def class_breakdown_svg(doc: dict[str, Any]) -> tuple[Markup, list[str]]:
    """Stacked horizontal bar per rank: kernel time per class per step, then GPU idle in the step."""
    ranks = doc.get("ranks") or []
    order = [c for c, _ in sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("share") or 0))]
    rows = []
    for r in ranks:
        cl = r.get("classes") or {}
        segs = [(c, float(cl[c]["us_per_step"])) for c in order if c in cl and _isnum(cl[c].get("us_per_step"))]
        idle = r.get("idle_us")
        rows.append((r, segs, float(idle) if _isnum(idle) else 0.0))
    vmax = max((sum(s for _, s in segs) + idle for _, segs, idle in rows), default=0.0)
    if not rows or vmax <= 0:
        return Markup(""), order
    left, right, bar_h, gap, top = 78, 215, 22, 8, 8
    out, scale, height = _bar_axis(len(rows), vmax, left, right, bar_h, gap, top)
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
            if w > 34:
                out.append(el("text", {"x": x + w / 2, "y": y + bar_h / 2 + 4, "text-anchor": "middle",
                                       "fill": text_color(fill), "class": "seg"}, fmt_pct(share, 0)))
            x += w
        if idle > 0:
            w = idle * scale
            out.append(el("rect", {"x": x, "y": y + 0.5, "width": max(w - 0.5, 0.0), "height": bar_h - 1,
                                   "fill": "url(#idle-hatch)", "stroke": IDLE_STROKE, "stroke-width": 1},
                          el("title", None, f"{r.get('label')} · GPU idle inside the step: {fmt_us(idle)} "
                                            f"(median)")))
            x += w
        step = _get(r, "step_us", "median")
        out.append(el("text", {"x": x + 6, "y": y + bar_h / 2 + 4, "class": "lab"},
                      f"{fmt_us(total)} busy" + (f" · step {fmt_us(step)}" if _isnum(step) else "")))
    defs = el("defs", None, el("pattern", {"id": "idle-hatch", "width": 6, "height": 6,
                                           "patternUnits": "userSpaceOnUse", "patternTransform": "rotate(45)"},
                               el("rect", {"width": 6, "height": 6, "fill": "#ffffff"}),
                               el("line", {"x1": 0, "y1": 0, "x2": 0, "y2": 6, "stroke": "#c8c8c8",
                                           "stroke-width": 2})))
    return _svg(TIMELINE_WIDTH, height, "decode-step time by class per rank", defs, *out), order


def glance_svg(doc: dict[str, Any]) -> Markup:
    """One bar for the header: where a step's GPU time goes (mean over ranks), biggest class first."""
    classes = sorted(((c, v.get("us_per_step")) for c, v in (doc.get("classes") or {}).items()
                      if _isnum(v.get("us_per_step")) and v["us_per_step"] > 0), key=lambda x: -x[1])
    idle = [r.get("idle_us") for r in doc.get("ranks") or [] if _isnum(r.get("idle_us"))]
    idle_us = float(np.mean(idle)) if idle else 0.0
    total = sum(us for _, us in classes) + idle_us
    if total <= 0:
        return Markup("")
    width, h = TIMELINE_WIDTH, 30
    out: list[Markup] = []
    x = 0.0
    for c, us in classes:
        w = us / total * width
        fill = class_color(c)
        share = step_share(us, doc) or 0.0
        out.append(el("rect", {"x": x, "y": 0, "width": w, "height": h, "fill": fill},
                      el("title", None, f"{c}: {fmt_us(us)} per step ({fmt_pct(share)} of the step time)")))
        label = f"{c} {fmt_pct(share, 0)}"
        if w > 7 * len(label) + 10:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg",
                                   "font-size": "12.5"}, label))
        elif w > 7 * 4 + 6:
            out.append(el("text", {"x": x + 4, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg"},
                          fmt_pct(share, 0)))
        x += w
    if idle_us > 0:
        w = idle_us / total * width
        out.append(el("rect", {"x": x + 0.5, "y": 0.5, "width": max(w - 1, 0.0), "height": h - 1,
                               "fill": "url(#glance-hatch)", "stroke": IDLE_STROKE},
                      el("title", None, f"GPU idle inside the step: {fmt_us(idle_us)} "
                                        f"({fmt_pct(step_share(idle_us, doc))} of the step time)")))
        if w > 70:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "class": "seg", "fill": "#444"},
                          f"idle {fmt_pct(step_share(idle_us, doc), 0)}"))
    defs = el("defs", None, el("pattern", {"id": "glance-hatch", "width": 6, "height": 6,
                                           "patternUnits": "userSpaceOnUse", "patternTransform": "rotate(45)"},
                               el("rect", {"width": 6, "height": 6, "fill": "#ffffff"}),
                               el("line", {"x1": 0, "y1": 0, "x2": 0, "y2": 6, "stroke": "#c8c8c8",
                                           "stroke-width": 2})))
    return _svg(width, h, "where a step's GPU time goes", defs, *out)


@dataclass
class TimelineInfo:
    """A timeline for the report: its data (drawn in the page by ``Timeline`` in the report's script),
    a caption, or the reason there is none."""

    data: dict[str, Any] = field(default_factory=dict)
    caption: str = ""
    reason: str | None = None
    kernels: int = 0
    lanes: int = 0

    @property
    def json(self) -> Markup:
        return script_json(self.data)


def _shapes_of(a: Analysis, k: pd.DataFrame) -> np.ndarray:
    """Input shapes of each kernel's launching CPU op as text ('' when none is linked)."""
    ops = a.trace.cpu_ops
    out = np.full(len(k), "", dtype=object)
    if not len(ops) or "input_dims" not in ops.columns or "op_idx" not in k.columns:
        return out
    idx = k["op_idx"].to_numpy()
    ok = (idx >= 0) & (idx < len(ops))
    dims = ops["input_dims"].to_numpy(dtype=object)
    cache: dict[int, str] = {}
    for j in np.flatnonzero(ok):
        i = int(idx[j])
        if i not in cache:
            v = dims[i]
            cache[i] = "" if v is None or (isinstance(v, float) and v != v) else short_name(
                json.dumps(v, default=str) if not isinstance(v, str) else v, 160)
        out[j] = cache[i]
    return out


def timeline_payload(a: Analysis, kernels: pd.DataFrame, t0: float | None = None, title: str = "",
                     budget: int = TIMELINE_KERNEL_BUDGET) -> dict[str, Any]:
    """The data a report timeline draws: one lane per (rank, stream), each kernel's start and duration
    relative to ``t0`` (µs), its class, name and launching op's shapes (as indices into shared lists).
    ``kernels`` needs rank, stream, ts, end, cls and name columns (op_idx for shapes); pass kernels
    with other times (a what-if) to draw another timeline of the same kind."""
    k = kernels.sort_values(["rank", "stream", "ts"], kind="stable")
    if len(k) > budget:  # the longest kernels carry the picture; say so in the caption
        k = k.nlargest(budget, "dur").sort_values(["rank", "stream", "ts"], kind="stable")
    t0 = float(k["ts"].min()) if t0 is None else float(t0)
    span = max(float(k["end"].max()) - t0, 1e-3)
    labels = {r.rank: r.label for r in a.trace.ranks}
    cls_codes, cls_names = factorize_text(k["cls"])
    name_codes, names = factorize_text(k["name"])
    shp = _shapes_of(a, k)
    shp_codes, shapes = pd.factorize(pd.Series(shp, dtype=object))
    ts = np.round(k["ts"].to_numpy(dtype=np.float64) - t0, 3)
    dur = np.round(k["end"].to_numpy(dtype=np.float64) - k["ts"].to_numpy(dtype=np.float64), 3)
    ranks, streams = k["rank"].to_numpy(), k["stream"].to_numpy()
    lanes = []
    order = k.groupby(["rank", "stream"], sort=False)["dur"].sum().reset_index()
    order = order.sort_values(["rank", "dur"], ascending=[True, False])
    for rank, stream in zip(order["rank"].tolist(), order["stream"].tolist(), strict=True):
        m = (ranks == rank) & (streams == stream)
        lanes.append({"rank": int(rank), "stream": int(stream), "label": f"{labels.get(int(rank), rank)} s{stream}",
                      "ts": ts[m].tolist(), "dur": dur[m].tolist(), "cls": cls_codes[m].tolist(),
                      "name": name_codes[m].tolist(), "shape": shp_codes[m].tolist()})
    cls_list = [str(c) for c in cls_names]
    return {"title": title, "span": round(span, 3), "lanes": lanes, "classes": cls_list,
            "colors": [class_color(c) for c in cls_list], "names": [str(n) for n in names],
            "shapes": [str(x) for x in shapes], "kernels": len(k)}


def timeline_svg(a: Analysis, budget: int = TIMELINE_KERNEL_BUDGET) -> TimelineInfo:
    """The timeline of one representative step: kernel lanes (one per stream of each rank) on one clock,
    drawn in the page as the busy fraction of every pixel column, so idle time shows at any zoom."""
    pos, rows = a.representative_step()
    if pos is None or not rows:
        return TimelineInfo(reason="no analysed step")
    k = a.kernels[a.kernels["step"].isin(list(rows.values()))]
    if not len(k):
        return TimelineInfo(reason="the representative step has no kernels")
    data = timeline_payload(a, k, budget=budget)
    t0 = float(k["ts"].min())
    labels = {r.rank: r.label for r in a.trace.ranks}
    marks = []
    for _, s in a.steps.loc[list(rows.values())].iterrows():
        if _isnum(s["gpu_start"]):
            marks.append({"rank": int(s["rank"]), "label": labels.get(int(s["rank"]), str(s["rank"])),
                          "start": round(float(s["gpu_start"]) - t0, 3), "end": round(float(s["gpu_end"]) - t0, 3)})
    data["marks"] = marks
    caption = (f"Step {pos + 1} of {a.steps_per_rank()} analysed per rank (its time is closest to the median), "
               f"{len(k):,} kernels over {fmt_us(data['span'])}.")
    if data["kernels"] < len(k):
        caption += f" Only the {data['kernels']:,} longest kernels are drawn (a size budget)."
    return TimelineInfo(data=data, caption=caption, kernels=len(k), lanes=len(data["lanes"]))


def after_timeline(a: Analysis) -> tuple[TimelineInfo | None, str]:
    """The representative step as the replay of the top finding's fix places it, on the measured step's
    time axis; (None, reason) when there is nothing to show."""
    top = a.findings[0] if a.findings else None
    pred = getattr(top, "prediction", None) if top is not None else None
    if top is None or pred is None or pred.run is None or a.replay is None:
        return None, "no finding with a replayed fix"
    m = a.replay.model
    pos, rows = a.representative_step()
    mask = m.g_pos == pos if pos is not None else np.zeros(m.n_ops, dtype=bool)
    if not mask.any():
        return None, "the representative step was not among the replayed steps"
    k = a.kernels[a.kernels["step"].isin(list(rows.values()))]
    t0, span = float(k["ts"].min()), float(k["end"].max() - k["ts"].min())
    after = k[k.index.isin(m.g_kidx[mask])].copy()
    after["ts"] = pd.Series(pred.run.g_start[mask], index=m.g_kidx[mask]).reindex(after.index).to_numpy()
    after["end"] = pd.Series(pred.run.g_end[mask], index=m.g_kidx[mask]).reindex(after.index).to_numpy()
    after["dur"] = after["end"] - after["ts"]
    t0 = min(t0, float(after["ts"].min()))
    data = timeline_payload(a, after, t0=t0)
    data["span"] = round(max(span, data["span"]), 3)  # the measured step's axis, so the saving shows
    labels = {r.rank: r.label for r in a.trace.ranks}
    data["marks"] = [{"rank": int(r), "label": labels.get(int(r), str(r)),
                      "start": round(float(g["ts"].min()) - t0, 3), "end": round(float(g["end"].max()) - t0, 3)}
                     for r, g in after.groupby("rank")]
    label = str(next((fx.get("label") for fx in top.fixes if fx.get("predicted_step_us") is not None), top.rule))
    rep, new = pred.replayed_step_us, pred.predicted_step_us
    caption = (f"{top.rule}: {label}. Step {pos + 1} as the replay places it with the fix applied, on the measured "
               f"step's time axis; the TP step goes from {fmt_us(rep)} replayed to {fmt_us(new)} predicted (medians "
               "over the replayed steps).")
    return TimelineInfo(data=data, caption=caption, kernels=len(after), lanes=len(data["lanes"])), label


def gemm_scatter_svg(doc: dict[str, Any]) -> tuple[Markup, str | None, list[str], str]:
    """M (log scale) vs achieved % of peak, bubble area = time per step, colour = class. Returns the
    SVG, the reason when there is none, the classes shown, and a note on what could not be placed."""
    points, note = _gemm_points(doc)
    if isinstance(points, str):
        return Markup(""), points, [], note
    left, right, top, bottom = 64, 20, 14, 40
    width, height = TIMELINE_WIDTH, 300
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
                           "transform": f"rotate(-90 14 {_num(top + ph / 2)})"}, "% of dense peak (log)"))
    ranked = sorted(points, key=lambda p: -p["us"])
    labels: list[Markup] = []
    placed: list[tuple[float, float]] = []
    for i, p in enumerate(ranked):
        r = 3 + 20 * math.sqrt(p["us"] / tmax)
        tip = (f"{p['label']}\n{p['cls']} · {p['dtype']} · {p['shape']}\n{p['pct']:.2g}% of peak"
               + (f" ({p['tflops']:.1f} TFLOP/s)" if _isnum(p.get("tflops")) else "")
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
    return _svg(width, height, "GEMM efficiency: M versus percent of peak", *out), None, classes, note


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
    per = max(int(_get(doc, "steps", "count") or 1), 1) * max(len(doc.get("ranks") or []), 1)
    points: list[dict[str, Any]] = []
    lost_us, total_us = 0.0, 0.0
    reasons: dict[str, float] = {}
    for g in gemm:
        if not isinstance(g, dict):
            continue
        us = g.get("us")
        us = float(us) if _isnum(us) else 0.0
        total_us += us
        m, pct = g.get("m"), g.get("pct_peak")
        groups = g.get("groups") if _isnum(g.get("groups")) and g.get("groups") > 1 else 1
        if not (_isnum(m) and _isnum(pct) and m > 0):
            lost_us += us
            why = str(g.get("reason") or ("no recorded shape" if not _isnum(m) else "no peak for this dtype"))
            reasons[why] = reasons.get(why, 0.0) + us
            continue
        dims = "×".join(str(g.get(x)) for x in ("m", "n", "k"))
        shape = f"M×N×K {dims}" + (f", {groups} groups" if groups > 1 else "") + (
            f", batch {g['batch']}" if _isnum(g.get("batch")) and g["batch"] > 1 else "")
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
    straggler = _get(coll, "straggler", "rank")
    rows = []
    for r in per_rank:
        wait = _first(r, "wait_us_per_step", "wait_us")
        xfer = _first(r, "transfer_us_per_step", "transfer_us")
        if not (_isnum(wait) and _isnum(xfer)):
            continue
        rows.append((str(r.get("label") or labels.get(r.get("rank")) or f"rank {r.get('rank')}"), float(wait),
                     float(xfer), r.get("late_arrivals"), r.get("arrivals"), r.get("rank") == straggler))
    if not rows:
        return Markup(""), "wait and transfer time could not be split for any rank"
    vmax = max(w + t for _, w, t, *_ in rows) or 1.0
    left, right, bar_h, gap, top = 78, 330, 20, 8, 8
    out, scale, height = _bar_axis(len(rows), vmax, left, right, bar_h, gap, top)
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
        if _isnum(late):
            tail += f" · last to arrive {int(late)}" + (f" of {int(arrivals)}" if _isnum(arrivals) else "×")
        if is_straggler:
            tail += " · straggler"
        out.append(el("text", {"x": left + (wait + xfer) * scale + 6, "y": y + bar_h / 2 + 4, "class": "lab"},
                      tail))
    return _svg(TIMELINE_WIDTH, height, "collective wait versus transfer per rank", *out), None


def critical_path_svg(doc: dict[str, Any]) -> tuple[Markup, str | None, list[str]]:
    """One stacked bar: what the critical path of a step is made of (mean over aligned steps)."""
    cp = doc.get("critical_path")
    if not isinstance(cp, dict) or not cp:
        return Markup(""), "the analysis has no critical-path section", []
    if cp.get("applicable") is False:
        return Markup(""), str(cp.get("reason") or "the critical path could not be built"), []
    comp = cp.get("composition") or {}
    segs = [(c, float(v["us_per_step"]), v.get("share")) for c, v in comp.items()
            if isinstance(v, dict) and _isnum(v.get("us_per_step")) and v["us_per_step"] > 0]
    if not segs:
        return Markup(""), "the critical path is empty", []
    segs.sort(key=lambda x: -x[1])
    total = sum(us for _, us, _ in segs)
    left, right, bar_h, top = 78, 14, 26, 4
    plot_w = TIMELINE_WIDTH - left - right
    out: list[Markup] = [el("text", {"x": left - 8, "y": top + bar_h / 2 + 4, "text-anchor": "end",
                                     "class": "lab"}, "path")]
    x = float(left)
    for c, us, share in segs:
        w = us / total * plot_w
        fill = _path_color(c)
        out.append(el("rect", {"x": x, "y": top, "width": w, "height": bar_h, "fill": fill},
                      el("title", None, f"{c}: {fmt_us(us)} per step on the critical path "
                                        f"({fmt_pct(share)})")))
        label = f"{c} {fmt_pct(share, 0)}"
        if w > 6.2 * len(label) + 10:
            out.append(el("text", {"x": x + 5, "y": top + bar_h / 2 + 4, "fill": text_color(fill),
                                   "class": "seg"}, label))
        elif w > 6.2 * 4 + 6:
            out.append(el("text", {"x": x + 3, "y": top + bar_h / 2 + 4, "fill": text_color(fill),
                                   "class": "seg"}, fmt_pct(share, 0)))
        x += w
    return _svg(TIMELINE_WIDTH, top + bar_h + 6, "critical path composition", *out), None, [c for c, _, _ in segs]


def _path_color(c: str) -> str:
    return PATH_COLORS.get(c, class_color(c))


# --------------------------------------------------------------------------------------------- context

def _finding_view(i: int, f: dict[str, Any], doc: dict[str, Any], labels: dict[Any, str]) -> dict[str, Any]:
    sev = str(f.get("severity") or "info")
    saving = f.get("est_saving_us_per_step")
    refs = []
    for r in f.get("references") or []:
        if isinstance(r, dict):
            text, url = str(r.get("title") or r.get("url") or ""), str(r.get("url") or "")
        else:
            text = str(r)
            m = _URL.search(text)
            url = m.group(0) if m else ""
        # only web links are clickable; anything else (javascript:, data:) is shown as text
        refs.append({"url": url if url.startswith(("https://", "http://")) else None, "title": text})
    ranks = f.get("ranks")
    ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
    return {
        "id": f"f-{i}", "n": i + 1, "rule": str(f.get("rule") or ""), "severity": sev,
        "color": severity_color(sev), "title": str(f.get("title") or f.get("rule") or ""),
        "message": str(f.get("message") or ""),
        "saving": fmt_us(float(saving)) if _isnum(saving) else None,
        "saving_of_step": fmt_pct(saving_share(f, doc)) if _isnum(saving) else None,
        # the impact's share of the step (``share`` itself is the replayed saving's)
        "share": fmt_pct(step_share(ev.get("impact_us_per_step"), doc)) if _isnum(ev.get("impact_us_per_step"))
        else None,
        "impact": fmt_us(float(ev["impact_us_per_step"])) if _isnum(ev.get("impact_us_per_step")) else None,
        "ranks": ", ".join(str(labels.get(r, r)) for r in ranks) if isinstance(ranks, list) and ranks else
        ("all" if ranks is None else str(ranks)),
        "evidence": _evidence_view(f.get("evidence") or {}),
        "remediation": str(f.get("remediation") or "").strip(),
        "why": str(f.get("why") or "").strip(),
        "references": refs,
        "variants": variant_lines(f),
        "group_note": group_note(f),
        "child": bool((f.get("group") or {}).get("parent")),
    }


def _evidence_view(ev: Any) -> list[dict[str, Any]]:
    """Evidence as rows for the template: scalars, small tables (lists of dicts) and nested dicts."""
    if not isinstance(ev, dict):
        return [{"key": "evidence", "kind": "text", "value": str(ev)}]
    rows: list[dict[str, Any]] = []
    for key, v in ev.items():
        key = str(key)
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            cols: list[str] = []
            for x in v[:50]:
                cols.extend(str(c) for c in x if str(c) not in cols)
            body = [[_cell(c, x.get(c)) for c in cols] for x in v[:50]]
            rows.append({"key": key, "kind": "table", "cols": cols, "rows": body, "more": max(len(v) - 50, 0)})
        elif isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            rows.append({"key": key, "kind": "table", "cols": ["key", "value"],
                         "rows": [[{"text": str(k2)}, _cell(str(k2), x)] for k2, x in v.items()], "more": 0})
        elif isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
            rows.append({"key": key, "kind": "text", "value": ", ".join(_fmt_value(key, x) for x in v[:50])
                         + (f", … ({len(v) - 50} more)" if len(v) > 50 else "")})
        elif isinstance(v, (dict, list)):
            rows.append({"key": key, "kind": "code", "value": json.dumps(v, indent=1, default=str)[:4000]})
        else:
            cell = _cell(key, v, "value")
            rows.append({"key": key, "kind": "text", "wide": len(cell.get("full") or cell["value"]) > 34, **cell})
    # long values get a full row of the evidence grid, after the short ones
    return sorted(rows, key=lambda r: bool(r.get("wide")))


def _cell(key: str, v: Any, field_: str = "text") -> dict[str, Any]:
    text = _fmt_value(key, v) if not isinstance(v, (dict, list)) else json.dumps(v, default=str)
    if len(text) > 90:
        return {field_: kernel_label(text, 90), "full": text}
    return {field_: text}


def _meta_rows(doc: dict[str, Any]) -> list[tuple[str, str, bool]]:
    run, steps = doc.get("run") or {}, doc.get("steps") or {}
    gpu = doc.get("gpu") if isinstance(doc.get("gpu"), dict) else {}

    def val(v: Any, unknown: str = "unknown") -> str:
        return unknown if v is None or v == "" else str(v)

    found = ", ".join(f"{k} {v}" for k, v in sorted((steps.get("found") or {}).items()))
    src = steps.get("source")
    src = ", ".join(src) if isinstance(src, list) else src
    dev = val(run.get("device"))
    if run.get("compute_capability"):
        dev += f" (sm {run['compute_capability']})"
    rows: list[tuple[str, str, bool]] = [
        ("Model", val(run.get("model")), False),
        ("Device", dev, False),
        ("TP size", val(run.get("tp_size")) + (f" ({run.get('ranks')} rank files)" if run.get("ranks") else ""),
         False),
        ("KV cache dtype", val(run.get("kv_cache_dtype"), "unknown (no server_info)"), False),
        ("Batch (median bs)", f"{run['batch_median']:g}" if _isnum(run.get("batch_median")) else
         val(run.get("batch_median")), False),
        ("Attention backend", val(run.get("attention_backend")), False),
        ("KV pool tokens", f"{run['kv_pool_tokens']:,}" if _isnum(run.get("kv_pool_tokens")) else
         val(run.get("kv_pool_tokens")), False),
        ("CUDA graph", "yes (kernels replayed from graphs)" if run.get("cuda_graph") else "no (eager launches)",
         False),
        (f"{str(steps.get('phase', 'decode')).capitalize()} step",
         f"median {fmt_us(steps.get('median_us'))}, p90 {fmt_us(steps.get('p90_us'))} (slowest rank's GPU span)",
         False),
        ("CUDA runtime / driver", f"{_cuda_version(run.get('cuda_runtime_version'))} / "
                                  f"{_cuda_version(run.get('cuda_driver_version'))}", False),
        ("Steps", f"{steps.get('count')} {steps.get('phase')} steps per rank analysed; found (all ranks): "
                  f"{found or 'none'}; edge steps excluded: {steps.get('excluded_edge')}; step source: {src}", True),
    ]
    if gpu:
        if gpu.get("name"):
            peaks = gpu.get("peak_tflops") if isinstance(gpu.get("peak_tflops"), dict) else {}
            specs = ", ".join(f"{k} {v:g}" for k, v in peaks.items() if _isnum(v))
            bw = gpu.get("mem_bw_gbps")
            text = (f"{gpu['name']}: dense peak TFLOP/s {specs or 'unknown'}; memory "
                    + (f"{bw:,.0f} GB/s" if _isnum(bw) else "bandwidth unknown"))
            if gpu.get("matched_by") or gpu.get("source"):
                text += f" ({gpu.get('matched_by') or gpu.get('source')})"
        else:
            text = f"none: {gpu.get('reason') or 'the device is not in the GPU spec table'}"
        rows.append(("GPU spec used", text, True))
    tool = doc.get("tool") or {}
    rows.append(("Tool", f"{tool.get('name', 'traceinspect')} {tool.get('version', __version__)} "
                         f"(JSON schema {doc.get('schema')})", True))
    return rows


def _cuda_version(v: Any) -> str:
    """CUDA's integer version (12080) as 12.8; other text as it is."""
    if v is None or v == "":
        return "unknown"
    text = str(v)
    if text.isdigit() and len(text) >= 4:
        n = int(text)
        return f"{n // 1000}.{(n % 1000) // 10}"
    return text


def _files_view(doc: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for f in _get(doc, "source", "files", default=[]) or []:
        out.append({"label": str(f.get("label", "")), "path": str(f.get("path", "")),
                    "sha256": str(f.get("sha256", "")), "size": _fmt_bytes(float(f.get("size_bytes") or 0)),
                    "rank_source": str(f.get("rank_source", ""))})
    si = _get(doc, "source", "server_info")
    if si:
        out.append({"label": "server_info", "path": str(si), "sha256": "", "size": "", "rank_source": ""})
    return out


def _class_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c, v in sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("us_per_step") or 0)):
        share = step_share(v.get("us_per_step"), doc)
        rows.append({"cls": c, "color": class_color(c), "us": v.get("us_per_step"), "us_t": fmt_us(v.get("us_per_step")),
                     "share": share, "share_t": fmt_pct(share),
                     "calls": v.get("calls_per_step"),
                     "calls_t": fmt_count(v["calls_per_step"]) if _isnum(v.get("calls_per_step")) else "n/a"})
    return rows


TABLE_ROWS = 400  # rows of a table the page shows (its CSV download has all)


def _csv_uri(df: pd.DataFrame) -> str:
    from urllib.parse import quote

    from traceinspect.render.tables import to_csv

    return "data:text/csv;charset=utf-8," + quote(to_csv(df), safe="")


def _cell_num(v: Any, text: str, cls: str = "n") -> dict[str, Any]:
    return {"t": text, "v": float(v) if _isnum(v) else None, "cls": cls}


def _data_tables(a: Analysis, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernels, GEMM-shape and CPU-op tables as template rows, each with its CSV as a data URL."""
    from traceinspect.render.tables import report_tables

    tables = report_tables(a, doc)
    out = []
    kt = tables["kernels"]
    head = kt.head(TABLE_ROWS)
    labels = kernel_labels(head["name"].tolist(), 72)
    rows = []
    for i, r in enumerate(head.itertuples(index=False), start=1):
        rows.append([_cell_num(i, str(i)), {"t": labels[r.name], "cls": "kname", "title": r.name, "v": None},
                     {"t": short_name(r.launched_by, 34) if r.launched_by else "–", "cls": "op",
                      "title": r.launched_by if len(r.launched_by) > 34 else None, "v": None},
                     {"t": r.cls, "cls": "cls", "color": class_color(r.cls), "v": None},
                     _cell_num(r.calls, str(int(r.calls))), _cell_num(r.calls_per_step, fmt_count(r.calls_per_step)),
                     _cell_num(r.total_us, fmt_us(r.total_us)), _cell_num(r.mean_us, fmt_us(r.mean_us)),
                     _cell_num(r.us_per_step, fmt_us(r.us_per_step)), _cell_num(r.share_of_step, fmt_pct(r.share_of_step))])
    out.append({"id": "kernel-table", "title": "Kernels", "file": "kernels.csv", "csv": _csv_uri(kt),
                "total": len(kt), "shown": len(head), "rows": rows, "empty": "no kernels in the analysed steps",
                "cols": [{"h": "#", "num": True}, {"h": "kernel"}, {"h": "launched by"}, {"h": "class"},
                         {"h": "calls", "num": True}, {"h": "calls/step", "num": True}, {"h": "total", "num": True},
                         {"h": "mean", "num": True}, {"h": "per step", "num": True},
                         {"h": "share of step", "num": True}]})
    gt = tables["gemm"]
    rows = []
    for r in gt.head(TABLE_ROWS).itertuples(index=False):
        shape = "×".join(str(int(x)) if _isnum(x) else "?" for x in (r.m, r.n, r.k))
        rows.append([{"t": str(r.op or ""), "cls": "kname", "v": None},
                     {"t": str(r.cls or ""), "cls": "cls", "color": class_color(str(r.cls or "")), "v": None},
                     {"t": str(r.dtype or "?"), "v": None}, {"t": shape, "v": None, "cls": "mono"},
                     _cell_num(r.m, f"{r.m:g}" if _isnum(r.m) else "?"),
                     _cell_num(r.groups, f"{r.groups:g}" if _isnum(r.groups) else ""),
                     _cell_num(r.calls, f"{int(r.calls):,}" if _isnum(r.calls) else ""),
                     _cell_num(r.us_per_step, fmt_us(r.us_per_step)), _cell_num(r.mean_us, fmt_us(r.mean_us)),
                     _cell_num(r.tflops, f"{r.tflops:,.1f}" if _isnum(r.tflops) else "n/a"),
                     _cell_num(r.pct_peak, f"{r.pct_peak:.2g}%" if _isnum(r.pct_peak) else "n/a"),
                     {"t": str(r.reason or r.shape_source or ""), "cls": "note", "v": None}])
    out.append({"id": "gemm-table", "title": "GEMM shapes", "file": "gemm.csv", "csv": _csv_uri(gt),
                "total": len(gt), "shown": min(len(gt), TABLE_ROWS), "rows": rows,
                "empty": "no GEMM kernels in the analysed steps",
                "cols": [{"h": "op"}, {"h": "class"}, {"h": "dtype"}, {"h": "M×N×K"}, {"h": "M", "num": True},
                         {"h": "groups", "num": True}, {"h": "calls", "num": True}, {"h": "per step", "num": True},
                         {"h": "mean", "num": True}, {"h": "TFLOP/s", "num": True}, {"h": "% of peak", "num": True},
                         {"h": "shape source / note"}]})
    ot = tables["ops"]
    rows = []
    for r in ot.head(TABLE_ROWS).itertuples(index=False):
        rows.append([{"t": short_name(r.op, 60), "cls": "kname", "title": r.op if len(r.op) > 60 else None, "v": None},
                     _cell_num(r.kernels, f"{int(r.kernels):,}"), _cell_num(r.calls, f"{int(r.calls):,}"),
                     _cell_num(r.calls_per_step, fmt_count(r.calls_per_step)), _cell_num(r.total_us, fmt_us(r.total_us)),
                     _cell_num(r.us_per_step, fmt_us(r.us_per_step)), _cell_num(r.share_of_step, fmt_pct(r.share_of_step)),
                     {"t": r.classes, "cls": "note", "v": None}])
    out.append({"id": "op-table", "title": "CPU ops", "file": "ops.csv", "csv": _csv_uri(ot),
                "total": len(ot), "shown": min(len(ot), TABLE_ROWS), "rows": rows,
                "empty": "no kernels in the analysed steps",
                "cols": [{"h": "op"}, {"h": "kernel names", "num": True}, {"h": "calls", "num": True},
                         {"h": "calls/step", "num": True}, {"h": "total", "num": True}, {"h": "per step", "num": True},
                         {"h": "share of step", "num": True}, {"h": "classes (most time first)"}]})
    return out


def _coverage_view(doc: dict[str, Any]) -> dict[str, Any]:
    cov = doc.get("coverage") or {}
    unknown = cov.get("unknown_share")
    return {
        "classified": fmt_pct(1 - unknown) if _isnum(unknown) else "n/a",
        "unknown": fmt_pct(unknown),
        "graph": fmt_pct(cov.get("graph_replay_share")),
        "cpu_op": fmt_pct(cov.get("cpu_op_linked_share")),
        "runtime": fmt_pct(cov.get("runtime_linked_share")),
        "outside": f"{cov.get('kernels_outside_steps', 0):,}",
        "analysed": f"{cov.get('kernels_analysed', 0):,}",
        "top_unknown": [{"name": str(u.get("name", "")), "short": kernel_label(str(u.get("name", "")), 90),
                         "us": fmt_us(u.get("us")), "calls": u.get("calls")} for u in cov.get("top_unknown") or []],
    }


def _memory_view(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of the memory-bound kernel table (achieved bandwidth), or the reason there are none."""
    mem = doc.get("memory_bound")
    if mem is None:
        return [], "the analysis has no memory_bound section"
    if isinstance(mem, dict):
        if mem.get("available") is False or mem.get("applicable") is False:
            return [], str(mem.get("reason") or "not measured")
        mem = mem.get("rows") or []
    if not isinstance(mem, list) or not mem:
        return [], "no memory-bound kernel with known bytes moved (needs recorded shapes)"
    per = max(int(_get(doc, "steps", "count") or 1), 1) * max(len(doc.get("ranks") or []), 1)
    rows = []
    labels = kernel_labels([str(r.get("family") or "") for r in mem[:20] if isinstance(r, dict)], 70)
    for r in mem[:20]:
        if not isinstance(r, dict):
            continue
        calls = r.get("calls") or 0
        us = r.get("us")
        fam = str(r.get("family") or "")
        dtypes = r.get("dtypes")
        rows.append({
            "name": fam, "short": labels.get(fam, kernel_label(fam, 70)), "cls": str(r.get("cls") or ""),
            "color": class_color(str(r.get("cls") or "")),
            "dtypes": ", ".join(str(d) for d in dtypes) if isinstance(dtypes, list) else str(dtypes or ""),
            "calls": calls,
            "bytes_call": _fmt_bytes(float(r["bytes"]) / calls) if _isnum(r.get("bytes")) and calls else "n/a",
            "us": us / per if _isnum(us) else None, "us_t": fmt_us(us / per) if _isnum(us) else "n/a",
            "gbps": f"{r['gbps']:,.0f}" if _isnum(r.get("gbps")) else "n/a",
            "pct": r.get("pct_bw"), "pct_t": f"{r['pct_bw']:.0f}%" if _isnum(r.get("pct_bw")) else "n/a",
            "note": str(r.get("reason") or ""),
        })
    return rows, None


def _isfloat(s: Any) -> bool:
    try:
        float(s)
    except (TypeError, ValueError):
        return False
    return True


def _moe_view(doc: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None]:
    moe = doc.get("moe")
    if not isinstance(moe, dict):
        return [], "the analysis has no moe section"
    if moe.get("available") is False or moe.get("applicable") is False:
        return [], str(moe.get("reason") or "not measured")
    pem = moe.get("per_expert_m") if isinstance(moe.get("per_expert_m"), dict) else {}
    rows = []
    if pem:
        v = pem.get("value")
        rng = (f" (min {pem.get('min'):g}, max {pem.get('max'):g})" if _isnum(pem.get("min")) and
               _isnum(pem.get("max")) else "")
        rows.append(("Tokens per expert per GEMM (M)", (f"{v:g}{rng}" if _isnum(v) else "not decided")
                     + f" — source: {pem.get('source') or 'unknown'}"))
        if pem.get("reason"):
            rows.append(("How", str(pem["reason"])))
        dist = pem.get("distribution")
        if isinstance(dist, dict) and dist:
            items = sorted(dist.items(), key=lambda kv: -kv[1])[:12]
            rows.append(("M distribution (calls)", ", ".join(
                f"M={float(k):g}: {v}" if _isfloat(k) else f"M={k}: {v}" for k, v in items)))
    for key, label in (("experts", "Experts"), ("topk", "Top-k"), ("tokens", "Tokens per step (median)")):
        if moe.get(key) is not None:
            src = moe.get(f"{key}_key")
            rows.append((label, f"{moe[key]:g}" if _isnum(moe[key]) else str(moe[key])) if not src else
                        (label, f"{moe[key]} ({src})"))
    if not rows:
        return [], "no MoE layers found"
    return rows, None


def _add_rule_text(a: Analysis, findings: list[dict[str, Any]]) -> None:
    """Add each finding's rule ``why`` and ``references`` (kept on the rule, not in the JSON)."""
    if not findings or all("why" in f for f in findings):
        return
    rules = getattr(a, "rule_set", None)
    if rules is None:
        try:
            from traceinspect.judge import load_rule_set

            opts = a.options
            rules = load_rule_set(extra=opts.rules, only=opts.only, disable=opts.disable)
        except Exception:  # the report still renders without the rule texts
            return
    for f in findings:
        rule = rules.get(str(f.get("rule")))
        if rule is not None:
            f.setdefault("why", getattr(rule, "why", ""))
            f.setdefault("references", list(getattr(rule, "references", []) or []))


def _coll_notes(doc: dict[str, Any]) -> list[str]:
    coll = doc.get("collectives")
    if not isinstance(coll, dict) or coll.get("applicable") is False:
        return []
    notes = []
    st = coll.get("straggler") or {}
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or []}
    if _isnum(st.get("rank")):
        notes.append(f"Straggler: {labels.get(st['rank'], st['rank'])} arrives last at "
                     f"{fmt_pct(st.get('late_share'))} of collectives and causes "
                     f"{fmt_us(st.get('wait_caused_us_per_step'))} of waiting per step on the other ranks.")
    elif st.get("reason"):
        notes.append(f"No straggler ({st['reason']}).")
    for bk in coll.get("by_kind") or []:
        if isinstance(bk, dict) and bk.get("kind"):
            notes.append(f"{bk['kind']}: {bk.get('instances_per_step', 0):.3g} per step, transfer "
                         f"{fmt_us(bk.get('transfer_us_median'))} median"
                         + (f", {_fmt_bytes(float(bk['bytes_median']))}" if _isnum(bk.get("bytes_median")) else "")
                         + (f", bus bandwidth {bk['busbw_gbps_median']:.1f} GB/s"
                            if _isnum(bk.get("busbw_gbps_median")) else "") + ".")
    notes.extend(str(n) for n in coll.get("notes") or [])
    return notes


def _cpath_notes(doc: dict[str, Any]) -> list[str]:
    cp = doc.get("critical_path")
    if not isinstance(cp, dict) or cp.get("applicable") is not True:
        return []
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or []}
    notes = [f"Critical path of a step: {fmt_us(cp.get('total_us_median'))} (median over {cp.get('steps')} "
             f"aligned steps)."]
    b = cp.get("bounding_rank")
    if _isnum(b):
        notes.append(f"The path runs mostly on {labels.get(b, b)}" + (
            f" ({', '.join(f'{labels.get(int(r), r)}: {n} steps' for r, n in cp['bounding_rank_steps'].items())})"
            if isinstance(cp.get("bounding_rank_steps"), dict) and len(cp["bounding_rank_steps"]) > 1 else "")
            + ".")
    return notes


def build_context(a: Analysis, doc: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything the template shows, as plain values (charts as escaped SVG markup)."""
    from traceinspect.render.gaps import gap_items

    doc = doc if doc is not None else a.to_json()
    steps = doc.get("steps") or {}
    step_us = steps.get("median_us")
    # the one order of every output (severity, then estimated saving): the headline is the first finding
    findings = [dict(f) for f in story(doc).findings]
    _add_rule_text(a, findings)
    breakdown, order = class_breakdown_svg(doc)
    timeline = timeline_svg(a)
    after_tl, after_label = after_timeline(a)
    tl_classes = sorted({str(c) for c in factorize_text(a.kernels["cls"])[1]}) if len(a.kernels) else []
    gemm, gemm_reason, gemm_classes, gemm_note = gemm_scatter_svg(doc)
    coll, coll_reason = collectives_svg(doc)
    cpath, cpath_reason, cpath_classes = critical_path_svg(doc)
    busy = [r.get("gpu_busy_us") for r in doc.get("ranks") or [] if _isnum(r.get("gpu_busy_us"))]
    idle = [r.get("idle_us") for r in doc.get("ranks") or [] if _isnum(r.get("idle_us"))]
    top_cls = max((doc.get("classes") or {}).items(), key=lambda kv: kv[1].get("us_per_step") or 0, default=None)
    keynums = [
        (f"{steps.get('phase', 'decode')} step (median)", fmt_us(step_us), f"p90 {fmt_us(steps.get('p90_us'))}"),
        ("GPU busy per step", fmt_us(float(np.median(busy))) if busy else "n/a",
         f"idle {fmt_us(float(np.median(idle)))}" if idle else ""),
        ("largest class", top_cls[0] if top_cls else "n/a",
         f"{fmt_pct(step_share(top_cls[1].get('us_per_step'), doc))} of the step time" if top_cls else ""),
        ("findings", str(len(findings)),
         ", ".join(f"{n} {s}" for s in ("critical", "warning", "info")
                   if (n := sum(1 for f in findings if f.get("severity") == s)))),
    ]
    return {
        "doc": doc,
        "title": f"traceinspect report · {_get(doc, 'run', 'model') or 'unknown model'}",
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "headline": _headline(doc, findings),
        "keynums": keynums,
        "glance_svg": glance_svg(doc),
        "meta": _meta_rows(doc),
        "files": _files_view(doc),
        "findings": [_finding_view(i, f, doc, {r.get("rank"): r.get("label") for r in doc.get("ranks") or []})
                     for i, f in enumerate(findings)],
        "gaps": gap_items(doc),
        "breakdown_svg": breakdown,
        "breakdown_legend": _legend_html(order, {c: (doc["classes"][c].get("share")) for c in order}),
        "class_rows": _class_rows(doc),
        "timeline": timeline,
        "after_timeline": after_tl, "after_label": after_label,
        "all_fixed": all_fixed_line(doc),
        "timeline_legend": _legend_html([c for c in order if c in tl_classes] +
                                        [c for c in tl_classes if c not in order]),
        "gemm_svg": gemm, "gemm_reason": gemm_reason, "gemm_note": gemm_note, "gemm_legend": _legend_html(gemm_classes),
        "coll_svg": coll, "coll_reason": coll_reason, "coll_notes": _coll_notes(doc),
        "cpath_svg": cpath, "cpath_reason": cpath_reason,
        "cpath_legend": _legend_html(cpath_classes, color=_path_color), "cpath_notes": _cpath_notes(doc),
        "memory": _memory_view(doc)[0], "memory_reason": _memory_view(doc)[1],
        "moe": _moe_view(doc)[0], "moe_reason": _moe_view(doc)[1],
        "data_tables": _data_tables(a, doc),
        "coverage": _coverage_view(doc),
        "warnings": [str(w) for w in doc.get("warnings") or []],
        "command": str(_get(doc, "source", "command") or "(not recorded)"),
        "paths": [str(p) for p in _get(doc, "source", "paths", default=[]) or []],
        "json_blob": script_json(doc),
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


def render_html(a: Analysis, doc: dict[str, Any] | None = None) -> str:
    """The report as one self-contained HTML document."""
    return _env().get_template("report.html.j2").render(**build_context(a, doc))


def write_html(a: Analysis, path: str | Path, doc: dict[str, Any] | None = None) -> Path:
    """Render the report and write it atomically to ``path``."""
    write_text_atomic(path, render_html(a, doc))
    return Path(path)
