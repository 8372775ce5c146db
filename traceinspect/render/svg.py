"""Escaped markup for the HTML report: :func:`el` builds every SVG/HTML element the report draws (text and
attribute values escaped), :func:`script_json` embeds JSON in a ``<script>`` element, and the axis,
legend and value helpers the charts share."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from typing import Any

from markupsafe import Markup, escape

from traceinspect.render.palette import class_color
from traceinspect.units import fmt_pct, is_number

WIDTH = 1120  # px: the width of every chart and of the timeline


def el(tag: str, attrs: dict[str, Any] | None = None, *children: Any) -> Markup:
    """One SVG/HTML element. Attribute values and text children are escaped; only :class:`Markup`
    children (other elements) pass through. ``tag`` and attribute names come from this package."""
    parts = [f"<{tag}"]
    for k, v in (attrs or {}).items():
        if v is None or v is False:
            continue
        parts.append(f' {k.rstrip("_").replace("_", "-")}="{escape(coord(v) if isinstance(v, float) else v)}"')
    if not children:
        parts.append("/>")
        return Markup("".join(parts))
    parts.append(">")
    parts.extend(str(escape(c)) for c in children if c is not None)
    parts.append(f"</{tag}>")
    return Markup("".join(parts))


def coord(v: float) -> str:
    """A coordinate with at most one decimal and no trailing zeros (keeps the SVG small)."""
    s = f"{v:.1f}"
    return s[:-2] if s.endswith(".0") else s


def script_json(obj: Any) -> Markup:
    """JSON that is safe inside a ``<script>`` element: no ``</script>``, no HTML comment openers, no
    line separators that end a JavaScript string."""
    try:  # most documents hold no NaN or infinity: only those are copied with them made null
        text = json.dumps(obj, ensure_ascii=False, allow_nan=False, default=str, separators=(",", ":"))
    except ValueError:
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


def get(d: Any, *keys: str, default: Any = None) -> Any:
    """``d[k1][k2]...``, or ``default`` where a level is missing or not an object."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


isnum = is_number  # the render modules' name for it


def bar_axis(n_rows: int, vmax: float, left: int, right: int, bar_h: int, gap: int,
             top: int) -> tuple[list[Markup], float, float]:
    """Grid lines and the time axis of a horizontal bar chart: (svg parts, px per us, height)."""
    plot_w = WIDTH - left - right
    height = top + n_rows * (bar_h + gap) + 30
    ticks = nice_ticks(0, vmax)
    scale = plot_w / max(vmax, ticks[-1])
    out: list[Markup] = []
    for t in ticks:
        x = left + t * scale
        out.append(el("line", {"x1": x, "x2": x, "y1": top - 4, "y2": height - 24, "class": "grid"}))
        out.append(el("text", {"x": x, "y": height - 10, "text-anchor": "middle", "class": "axis"},
                      tick_label(t, ticks[-1])))
    out.append(el("text", {"x": left - 8, "y": height - 10, "text-anchor": "end", "class": "axis"},
                  axis_unit(ticks[-1], True)))
    return out, scale, height


def nice_ticks(lo: float, hi: float, n: int = 6) -> list[float]:
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


def tick_label(v: float, top: float | None = None) -> str:
    """A µs tick value; in ms when the axis reaches 10 ms (``top``), so one axis uses one unit."""
    if abs(top if top is not None else v) >= 10_000:
        return f"{v / 1000:g}"
    return f"{v:g}"


def axis_unit(top: float, per_step: bool = False) -> str:
    unit = "ms" if top >= 10_000 else "µs"
    return f"{unit}/step" if per_step else unit


def svg(width: float, height: float, label: str, *children: Any) -> Markup:
    """An inline ``<svg>`` chart."""
    return el("svg", {"xmlns": "http://www.w3.org/2000/svg", "viewBox": f"0 0 {coord(width)} {coord(height)}",
                      "width": coord(width), "height": coord(height), "role": "img", "aria-label": label,
                      "class": "chart", "font-size": "11"}, *children)


def legend_html(classes: Iterable[str], extra: dict[str, float | None] | None = None, color: Any = None,
                basis: str = "") -> Markup:
    """A colour legend: one swatch per class, with its share where ``extra`` gives one, and what the
    shares are of (``basis``, e.g. 'shares of the step time') before them."""
    items = [el("span", {"class": "lg lg-basis"}, basis)] if basis and extra else []
    for c in classes:
        share = (extra or {}).get(c)
        fill = (color or class_color)(c)
        items.append(el("span", {"class": "lg"}, el("i", {"style": f"background:{fill}"}, ""),
                        c + (f" {fmt_pct(share)}" if share is not None else "")))
    return Markup("".join(items))
