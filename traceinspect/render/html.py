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

from traceinspect import __version__
from traceinspect.fileio import write_text_atomic
from traceinspect.render import fmt_pct, fmt_us, kernel_label, launching_ops, short_name
from traceinspect.render.palette import (
    IDLE_STROKE,
    PATH_COLORS,
    class_color,
    severity_color,
    text_color,
)
from traceinspect.render.whatif import all_fixed_line, group_note, variant_lines
from traceinspect.tables import factorize_text

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

TEMPLATES = Path(__file__).parent / "templates"
_URL = re.compile(r"https?://[^\s<>\"')\]]+")

# Timeline sampling budget: blocks drawn per lane (a lane is one stream of one rank). Kernels closer than
# half a pixel are merged into one block; when a lane still has more blocks, the merge distance grows.
TIMELINE_WIDTH = 1120
LANE_BLOCK_BUDGET = 900
TOTAL_BLOCK_BUDGET = 12_000  # over all lanes: keeps a TP8 report with several streams per rank small
TITLE_NAME_WIDTH = 90


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
        if isinstance(v, (int, np.integer)) or (float(v).is_integer() and abs(v) < 1e15):
            return f"{int(v):,}"
        if abs(float(v)) >= 1000:
            return f"{float(v):,.0f}"
        return f"{float(v):.4g}"
    return str(v)


def _fmt_bytes(v: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:,.0f} {unit}" if unit == "B" else f"{v:,.1f} {unit}"
        v /= 1024
    return f"{v:,.1f} TiB"


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


def _headline(doc: dict[str, Any], findings: list[dict[str, Any]], step_us: float | None) -> Headline:
    if findings:
        f = findings[0]
        saving = f.get("est_saving_us_per_step")
        title = str(f.get("title") or f.get("rule") or "finding")
        if _isnum(saving):
            of = f" ({fmt_pct(saving / step_us)} of the {fmt_us(step_us)} {doc['steps']['phase']} step)" \
                if _isnum(step_us) and step_us else ""
            detail = f"Estimated saving: {fmt_us(float(saving))} per step{of}."
        else:
            detail = "Estimated saving: not available (the rule gives no estimate)."
        sev = str(f.get("severity") or "info")
        others = []
        for i, o in enumerate(findings[1:], start=1):
            sv = o.get("est_saving_us_per_step")
            others.append({"anchor": f"f-{i}", "severity": str(o.get("severity") or "info"),
                           "color": severity_color(str(o.get("severity") or "info")),
                           "title": str(o.get("title") or o.get("rule") or ""),
                           "saving": fmt_us(float(sv)) if _isnum(sv) else None})
        return Headline(sev, severity_color(sev), title, detail, str(f.get("rule") or ""), "f-0", others)
    classes = doc.get("classes") or {}
    if classes:
        top, v = max(classes.items(), key=lambda kv: kv[1].get("share") or 0)
        text = (f"No findings. The largest class is {top}: {fmt_pct(v.get('share'))} of GPU kernel time, "
                f"{fmt_us(v.get('us_per_step'))} per step.")
    else:
        text = "No findings, and no classified kernel time."
    return Headline("none", "#2e7d32", text, "")


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
            share = us / total if total else 0
            tip = f"{r.get('label')} · {c}: {fmt_us(us)} per step ({fmt_pct(share)} of kernel time)"
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
        out.append(el("rect", {"x": x, "y": 0, "width": w, "height": h, "fill": fill},
                      el("title", None, f"{c}: {fmt_us(us)} per step ({fmt_pct(us / total)})")))
        label = f"{c} {fmt_pct(us / total, 0)}"
        if w > 7 * len(label) + 10:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg",
                                   "font-size": "12.5"}, label))
        elif w > 7 * 4 + 6:
            out.append(el("text", {"x": x + 4, "y": h / 2 + 4.5, "fill": text_color(fill), "class": "seg"},
                          fmt_pct(us / total, 0)))
        x += w
    if idle_us > 0:
        w = idle_us / total * width
        out.append(el("rect", {"x": x + 0.5, "y": 0.5, "width": max(w - 1, 0.0), "height": h - 1,
                               "fill": "url(#glance-hatch)", "stroke": IDLE_STROKE},
                      el("title", None, f"GPU idle inside the step: {fmt_us(idle_us)} ({fmt_pct(idle_us / total)})")))
        if w > 70:
            out.append(el("text", {"x": x + 6, "y": h / 2 + 4.5, "class": "seg", "fill": "#444"},
                          f"idle {fmt_pct(idle_us / total, 0)}"))
    defs = el("defs", None, el("pattern", {"id": "glance-hatch", "width": 6, "height": 6,
                                           "patternUnits": "userSpaceOnUse", "patternTransform": "rotate(45)"},
                               el("rect", {"width": 6, "height": 6, "fill": "#ffffff"}),
                               el("line", {"x1": 0, "y1": 0, "x2": 0, "y2": 6, "stroke": "#c8c8c8",
                                           "stroke-width": 2})))
    return _svg(width, h, "where a step's GPU time goes", defs, *out)


@dataclass
class TimelineInfo:
    svg: Markup = field(default_factory=Markup)
    caption: str = ""
    reason: str | None = None
    kernels: int = 0
    blocks: int = 0


def representative_steps(a: Analysis) -> tuple[int | None, dict[int, int]]:
    """The aligned step position whose TP step time is closest to the median, and the row of that step
    in ``a.steps`` for each rank."""
    sel = a.selected.copy()
    if not len(sel):
        return None, {}
    sel["pos"] = sel.groupby("rank").cumcount()
    n = a.steps_per_rank()
    sel = sel[sel["pos"] < n]
    per_pos = sel.groupby("pos")["span_us"].max()
    if not len(per_pos):
        return None, {}
    med = float(np.median(per_pos.to_numpy()))
    pos = int((per_pos - med).abs().idxmin())
    rows = sel[sel["pos"] == pos]
    return pos, {int(r): int(i) for i, r in zip(rows.index, rows["rank"], strict=True)}


def _blocks(ts: np.ndarray, end: np.ndarray, cls: np.ndarray, names: np.ndarray, merge_us: float,
            mixed: bool) -> list[dict[str, Any]]:
    """Merge a lane's kernels (sorted by start) into drawable blocks."""
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for t, e, c, nm in zip(ts, end, cls, names, strict=True):
        if cur is not None and t - cur["end"] <= merge_us and (mixed or c == cur["cls"]):
            cur["end"] = max(cur["end"], e)
            cur["n"] += 1
            cur["by"][c] = cur["by"].get(c, 0.0) + (e - t)
            continue
        cur = {"ts": t, "end": e, "cls": c, "n": 1, "name": nm, "by": {c: e - t}}
        out.append(cur)
    for b in out:
        if b["n"] > 1:
            b["cls"] = max(b["by"].items(), key=lambda kv: kv[1])[0]
    return out


def timeline_svg(a: Analysis, budget: int = LANE_BLOCK_BUDGET,
                 replayed: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
                 span_us: float | None = None) -> TimelineInfo:
    """Kernel lanes (one per stream of each rank) of one representative step, coloured by class, on a
    shared time axis so gaps and late ranks show. ``replayed`` (kernel rows, starts, ends) draws the
    same step as a replay placed it; ``span_us`` widens the axis (to share it with another timeline)."""
    pos, rows = representative_steps(a)
    if pos is None or not rows:
        return TimelineInfo(reason="no analysed step")
    k = a.kernels[a.kernels["step"].isin(list(rows.values()))]
    if replayed is not None:
        kidx, st, en = replayed
        k = k[k.index.isin(kidx)].copy()
        k["ts"] = pd.Series(st, index=kidx).reindex(k.index).to_numpy()
        k["end"] = pd.Series(en, index=kidx).reindex(k.index).to_numpy()
    if not len(k):
        return TimelineInfo(reason="the representative step has no kernels" if replayed is None else
                            "the representative step was not replayed")
    t0, t1 = float(k["ts"].min()), float(k["end"].max())
    span = max(t1 - t0, span_us or 0.0, 1e-3)
    labels = {r.rank: r.label for r in a.trace.ranks}
    lanes: list[tuple[int, Any, pd.DataFrame]] = []
    for rank in sorted(rows):
        kr = k[k["rank"] == rank]
        streams = kr.groupby("stream")["dur"].sum().sort_values(ascending=False).index.tolist()
        for s in streams:
            lanes.append((rank, s, kr[kr["stream"] == s].sort_values("ts")))
    budget = min(budget, max(TOTAL_BLOCK_BUDGET // max(len(lanes), 1), 50))
    left, right, lane_gap, top = 92, 14, 4, 22
    lane_h = 26 if len(lanes) <= 4 else 20 if len(lanes) <= 8 else 16
    plot_w = TIMELINE_WIDTH - left - right
    px_us = span / plot_w
    height = top + len(lanes) * (lane_h + lane_gap) + 34
    out: list[Markup] = []
    ticks = _nice_ticks(0, span, 8)
    for t in ticks:
        x = left + t / px_us
        out.append(el("line", {"x1": x, "x2": x, "y1": top - 4, "y2": height - 28, "class": "grid"}))
        out.append(el("text", {"x": x, "y": height - 14, "text-anchor": "middle", "class": "axis"},
                      _tick_label(t, ticks[-1])))
    out.append(el("text", {"x": left - 6, "y": height - 14, "text-anchor": "end", "class": "axis"},
                  _axis_unit(ticks[-1])))
    n_blocks = 0
    prev_rank = None
    for i, (rank, stream, kl) in enumerate(lanes):
        y = top + i * (lane_h + lane_gap)
        label = (labels.get(rank, str(rank)) if rank != prev_rank else "") + f"  s{stream}"
        if rank != prev_rank and i:
            out.append(el("line", {"x1": 4, "x2": TIMELINE_WIDTH - right, "y1": y - lane_gap / 2,
                                   "y2": y - lane_gap / 2, "class": "sep"}))
        prev_rank = rank
        out.append(el("text", {"x": left - 6, "y": y + lane_h / 2 + 4, "text-anchor": "end", "class": "lab"},
                      label))
        out.append(el("rect", {"x": left, "y": y, "width": plot_w, "height": lane_h, "class": "lane"}))
        ts = kl["ts"].to_numpy(dtype=np.float64)
        end = kl["end"].to_numpy(dtype=np.float64)
        cls = kl["cls"].astype(str).to_numpy()
        names = kl["name"].astype(str).to_numpy()
        merge, mixed = px_us * 0.5, False
        blocks = _blocks(ts, end, cls, names, merge, mixed)
        while len(blocks) > budget:
            merge, mixed = merge * 2, True
            blocks = _blocks(ts, end, cls, names, merge, mixed)
        n_blocks += len(blocks)
        for b in blocks:
            x = left + (b["ts"] - t0) / px_us
            w = max((b["end"] - b["ts"]) / px_us, 0.6)
            dur = b["end"] - b["ts"]
            if b["n"] == 1:
                tip = f"{kernel_label(b['name'], TITLE_NAME_WIDTH)}\n{b['cls']} · {fmt_us(dur)}"
            else:
                busy = sum(b["by"].values())
                tip = (f"{b['n']} kernels, mostly {b['cls']}: {fmt_us(busy)} busy in {fmt_us(dur)}\n"
                       f"first: {kernel_label(b['name'], TITLE_NAME_WIDTH)}")
            out.append(el("rect", {"x": x, "y": y + 1, "width": w, "height": lane_h - 2,
                                   "fill": class_color(b["cls"])}, el("title", None, tip)))
    # step boundary markers: each rank's first kernel start is where its step begins on the GPU
    step_rows = a.steps.loc[list(rows.values())]
    if replayed is not None:
        step_rows = step_rows.assign(gpu_start=[float(k.loc[k["rank"] == r, "ts"].min()) for r in step_rows["rank"]])
    for _, s in step_rows.iterrows():
        if _isnum(s["gpu_start"]):
            x = left + (float(s["gpu_start"]) - t0) / px_us
            out.append(el("path", {"d": f"M{_num(x)} {top - 9}l-4 -6h8z", "class": "mark"},
                          el("title", None, f"{labels.get(int(s['rank']), s['rank'])} step starts "
                                            f"+{fmt_us(float(s['gpu_start']) - t0)}")))
    svg = _svg(TIMELINE_WIDTH, height, "kernel timeline of one representative step"
               + (" as replayed with the fix" if replayed is not None else ""), *out)
    steps_total = a.steps_per_rank()
    caption = (f"Step {pos + 1} of {steps_total} analysed per rank (its time is closest to the median), "
               f"{len(k):,} kernels over {fmt_us(t1 - t0)}.")
    if n_blocks < len(k):
        caption += (f" Sampled for size: kernels less than half a pixel apart are drawn as one block "
                    f"({n_blocks:,} blocks; hover for counts).")
    return TimelineInfo(svg=svg, caption=caption, kernels=len(k), blocks=n_blocks)


def after_timeline(a: Analysis) -> tuple[TimelineInfo | None, TimelineInfo | None, str]:
    """The representative step measured and as the replay of the top finding's fix places it, on one
    time axis; (None, None, reason) when there is nothing to show."""
    top = a.findings[0] if a.findings else None
    pred = getattr(top, "prediction", None) if top is not None else None
    if pred is None or pred.run is None or a.replay is None:
        return None, None, "no finding with a replayed fix"
    m = a.replay.model
    pos, rows = representative_steps(a)
    if pos is None:
        return None, None, "no analysed step"
    mask = m.g_pos == pos
    if not mask.any():
        return None, None, "the representative step was not among the replayed steps"
    k = a.kernels[a.kernels["step"].isin(list(rows.values()))]
    span = float(k["end"].max() - k["ts"].min()) if len(k) else None
    after = timeline_svg(a, replayed=(m.g_kidx[mask], pred.run.g_start[mask], pred.run.g_end[mask]), span_us=span)
    label = str(next((fx.get("label") for fx in top.fixes if fx.get("predicted_step_us") is not None), top.rule))
    return timeline_svg(a, span_us=span), after, label


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

def _finding_view(i: int, f: dict[str, Any], step_us: float | None, labels: dict[Any, str]) -> dict[str, Any]:
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
        "saving_of_step": fmt_pct(saving / step_us) if _isnum(saving) and _isnum(step_us) and step_us else None,
        "share": _impact_share(ev),
        "impact": fmt_us(float(ev["impact_us_per_step"])) if _isnum(ev.get("impact_us_per_step")) else None,
        "share_of": str(ev.get("share_of") or "").split(" (")[0],
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


def _impact_share(ev: dict[str, Any]) -> str | None:
    """The impact over the rule's basis (GPU time or step time); ``share`` itself is the replayed saving's."""
    imp = ev.get("impact_us_per_step")
    base = ev.get("kernel_us_per_step") if str(ev.get("share_of") or "").startswith("GPU") else ev.get("step_us")
    return fmt_pct(imp / base) if _isnum(imp) and _isnum(base) and base else None


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


def _short_float(v: float) -> str:
    """12.0 -> '12', 12.25 -> '12.2' (one decimal only when there is one)."""
    text = f"{v:,.1f}"
    return text[:-2] if text.endswith(".0") else text


def _class_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c, v in sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("share") or 0)):
        rows.append({"cls": c, "color": class_color(c), "us": v.get("us_per_step"), "us_t": fmt_us(v.get("us_per_step")),
                     "share": v.get("share"), "share_t": fmt_pct(v.get("share")),
                     "calls": v.get("calls_per_step"),
                     "calls_t": _short_float(v["calls_per_step"]) if _isnum(v.get("calls_per_step")) else "n/a"})
    return rows


def _top_kernel_rows(doc: dict[str, Any], ops: dict[str, str]) -> list[dict[str, Any]]:
    rows = []
    for i, k in enumerate(doc.get("top_kernels") or []):
        op = ops.get(str(k.get("name", "")), "")
        rows.append({"i": i + 1, "name": str(k.get("name", "")), "short": kernel_label(str(k.get("name", "")), 72),
                     "op": op, "op_short": short_name(op, 34) if op else "–",
                     "cls": str(k.get("cls", "")), "color": class_color(str(k.get("cls", ""))),
                     "calls": k.get("calls"), "us": k.get("us"), "us_t": fmt_us(k.get("us")),
                     "mean": k.get("mean_us"), "mean_t": fmt_us(k.get("mean_us")),
                     "share": k.get("share"), "share_t": fmt_pct(k.get("share"))})
    return rows


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
    for r in mem[:20]:
        if not isinstance(r, dict):
            continue
        calls = r.get("calls") or 0
        us = r.get("us")
        fam = str(r.get("family") or "")
        dtypes = r.get("dtypes")
        rows.append({
            "name": fam, "short": kernel_label(fam, 70), "cls": str(r.get("cls") or ""),
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
                        (label, f"{moe[key]} (server_info {src})"))
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
    doc = doc if doc is not None else a.to_json()
    steps = doc.get("steps") or {}
    step_us = steps.get("median_us")
    # the judge's order (largest estimated saving first): the headline is the first finding
    findings = [dict(f) for f in doc.get("findings") or []]
    _add_rule_text(a, findings)
    breakdown, order = class_breakdown_svg(doc)
    timeline = timeline_svg(a)
    before_tl, after_tl, after_label = after_timeline(a)
    tl_classes = sorted({str(c) for c in factorize_text(a.kernels["cls"])[1]}) if len(a.kernels) else []
    gemm, gemm_reason, gemm_classes, gemm_note = gemm_scatter_svg(doc)
    coll, coll_reason = collectives_svg(doc)
    cpath, cpath_reason, cpath_classes = critical_path_svg(doc)
    busy = [r.get("gpu_busy_us") for r in doc.get("ranks") or [] if _isnum(r.get("gpu_busy_us"))]
    idle = [r.get("idle_us") for r in doc.get("ranks") or [] if _isnum(r.get("idle_us"))]
    top_cls = max((doc.get("classes") or {}).items(), key=lambda kv: kv[1].get("share") or 0, default=None)
    keynums = [
        (f"{steps.get('phase', 'decode')} step (median)", fmt_us(step_us), f"p90 {fmt_us(steps.get('p90_us'))}"),
        ("GPU busy per step", fmt_us(float(np.median(busy))) if busy else "n/a",
         f"idle {fmt_us(float(np.median(idle)))}" if idle else ""),
        ("largest class", top_cls[0] if top_cls else "n/a",
         f"{fmt_pct(top_cls[1].get('share'))} of kernel time" if top_cls else ""),
        ("findings", str(len(findings)),
         ", ".join(f"{n} {s}" for s in ("critical", "warning", "info")
                   if (n := sum(1 for f in findings if f.get("severity") == s)))),
    ]
    return {
        "doc": doc,
        "title": f"traceinspect report · {_get(doc, 'run', 'model') or 'unknown model'}",
        "generated": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "headline": _headline(doc, findings, step_us),
        "keynums": keynums,
        "glance_svg": glance_svg(doc),
        "meta": _meta_rows(doc),
        "files": _files_view(doc),
        "findings": [_finding_view(i, f, step_us, {r.get("rank"): r.get("label") for r in doc.get("ranks") or []})
                     for i, f in enumerate(findings)],
        "breakdown_svg": breakdown,
        "breakdown_legend": _legend_html(order, {c: (doc["classes"][c].get("share")) for c in order}),
        "class_rows": _class_rows(doc),
        "timeline": timeline,
        "after_timeline": after_tl, "after_before": before_tl, "after_label": after_label,
        "after_rule": str(a.findings[0].rule) if a.findings else "",
        "all_fixed": all_fixed_line(doc),
        "timeline_legend": _legend_html([c for c in order if c in tl_classes] +
                                        [c for c in tl_classes if c not in order]),
        "gemm_svg": gemm, "gemm_reason": gemm_reason, "gemm_note": gemm_note, "gemm_legend": _legend_html(gemm_classes),
        "coll_svg": coll, "coll_reason": coll_reason, "coll_notes": _coll_notes(doc),
        "cpath_svg": cpath, "cpath_reason": cpath_reason,
        "cpath_legend": _legend_html(cpath_classes, color=_path_color), "cpath_notes": _cpath_notes(doc),
        "memory": _memory_view(doc)[0], "memory_reason": _memory_view(doc)[1],
        "moe": _moe_view(doc)[0], "moe_reason": _moe_view(doc)[1],
        "top_kernels": _top_kernel_rows(doc, launching_ops(a.kernels)),
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
