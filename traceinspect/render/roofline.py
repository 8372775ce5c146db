"""The roofline in the outputs: one row per kernel row with shapes (GEMM shape, attention kernel family,
memory-bound kernel family) with achieved TFLOP/s and GB/s, floor, bound and % of roofline, shared by the
terminal, Markdown and HTML outputs, and the HTML roofline chart (arithmetic intensity vs achieved
throughput, both log, the compute and memory roofs of the dtypes present)."""

from __future__ import annotations

import math
from typing import Any

from markupsafe import Markup

from traceinspect.render import kernel_label
from traceinspect.render.palette import class_color
from traceinspect.render.svg import WIDTH, coord, el, get, isnum, svg
from traceinspect.units import fmt_us

_KINDS = (("gemm", "GEMM"), ("attention", "attention"), ("memory_bound", "memory"))


def _per(doc: dict[str, Any]) -> int:
    return max(int(get(doc, "steps", "count") or 1), 1) * max(len(doc.get("ranks") or []), 1)


def _shape(kind: str, r: dict[str, Any]) -> str:
    if kind == "gemm":
        txt = f"{r.get('op') or 'GEMM'} {r.get('dtype') or ''} M={r.get('m')} N={r.get('n')} K={r.get('k')}"
        if isnum(r.get("batch")) and r["batch"] > 1:
            txt += f" batch {r['batch']}"
        if isnum(r.get("groups")) and r["groups"] > 1:
            txt += f" {r['groups']} groups"
        return txt
    if kind == "attention":
        if isnum(r.get("ctx")):
            return (f"{kernel_label(str(r.get('family')), 50)} {r.get('dtype') or ''} B={r.get('batch')} H={r.get('heads')} "
                    f"q={r.get('q_len')} ctx={r.get('ctx')} D={r.get('d')}/{r.get('dv')}")
        return kernel_label(str(r.get("family") or "attention"), 60)
    return kernel_label(str(r.get("family") or ""), 60) + (f" {'/'.join(r['dtypes'])}"
                                                             if isinstance(r.get("dtypes"), list) and r["dtypes"] else "")


def roofline_rows(doc: dict[str, Any], limit: int | None = None) -> list[dict[str, Any]]:
    """Kernel rows with a roofline (a floor), the longest first: kind, label, class, time per step, achieved
    TFLOP/s and GB/s, % of bandwidth, floor per step, bound, % of roofline, FLOP per byte."""
    per = _per(doc)
    out = []
    for key, kind in _KINDS:
        for r in doc.get(key) or []:
            if not isinstance(r, dict) or not isnum(r.get("floor_us")) or not isnum(r.get("us")):
                continue
            out.append({"kind": kind, "label": _shape(key, r), "cls": str(r.get("cls") or key), "us": r["us"] / per,
                        "tflops": r.get("tflops") if isnum(r.get("tflops")) else None,
                        "gbps": r.get("gbps") if isnum(r.get("gbps")) else None,
                        "pct_bw": r.get("pct_bw") if isnum(r.get("pct_bw")) else None,
                        "floor": r["floor_us"] / per, "bound": r.get("bound") or "n/a",
                        "pct_roofline": r.get("pct_roofline") if isnum(r.get("pct_roofline")) else None,
                        "intensity": r.get("intensity") if isnum(r.get("intensity")) else None,
                        "dtype": str(r.get("dtype") or "")})
    out.sort(key=lambda x: -x["us"])
    return out[:limit] if limit else out


def no_floor_note(doc: dict[str, Any]) -> str:
    """The time of GEMM and attention rows without a floor, and the first reason, or ''."""
    per = _per(doc)
    lost, why = 0.0, ""
    for key in ("gemm", "attention"):
        for r in doc.get(key) or []:
            if isinstance(r, dict) and not isnum(r.get("floor_us")) and isnum(r.get("us")):
                lost += r["us"] / per
                why = why or str(r.get("reason") or "")
    if lost <= 0:
        return ""
    return f"{fmt_us(lost)} per step of GEMM and attention time has no roofline floor" + (f" ({why})" if why else "")


def fmt_rate(v: float | None, unit: str) -> str:
    return "n/a" if v is None else f"{v:,.1f} {unit}" if v < 100 else f"{v:,.0f} {unit}"


def fmt_share(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.1f}%"


def roofline_svg(doc: dict[str, Any]) -> tuple[Markup, str | None]:
    """Arithmetic intensity (FLOP per byte, log) vs achieved TFLOP/s (log): one point per GEMM and
    attention row with a floor and FLOPs, and the roofs of the dtypes present. (SVG, reason when none.)"""
    gpu = doc.get("gpu") or {}
    bw = gpu.get("mem_bw_gbps")
    peaks = gpu.get("peak_tflops") or {}
    pts = [r for r in roofline_rows(doc) if r["kind"] != "memory" and r["intensity"] and r["tflops"]]
    if not pts:
        return Markup(""), "no GEMM or attention row with shapes and a roofline floor"
    dtypes = sorted({p["dtype"] for p in pts if isnum(peaks.get(p["dtype"]))})
    left, right, top, bottom = 70, 150, 14, 40
    width, height = WIDTH, 320
    pw, ph = width - left - right, height - top - bottom
    xs_ = [p["intensity"] for p in pts]
    ys_ = [p["tflops"] for p in pts] + [peaks[d] for d in dtypes]
    xlo, xhi = math.floor(math.log10(min(xs_))) - 1, math.ceil(math.log10(max(xs_))) + 1
    if bw and dtypes:  # the ridge points inside the chart
        xhi = max(xhi, math.ceil(math.log10(max(peaks[d] * 1e3 / bw for d in dtypes))) + 1)
    ylo, yhi = math.floor(math.log10(min(ys_))) - 1, math.ceil(math.log10(max(ys_)))
    yhi = max(yhi, ylo + 1)

    def xs(v: float) -> float:
        return left + (math.log10(v) - xlo) / (xhi - xlo) * pw

    def ys(v: float) -> float:
        return top + ph - (math.log10(max(v, 10.0 ** ylo)) - ylo) / (yhi - ylo) * ph

    out: list[Markup] = []
    for e in range(xlo, xhi + 1):
        x = xs(10.0 ** e)
        out.append(el("line", {"x1": x, "x2": x, "y1": top, "y2": top + ph, "class": "grid"}))
        out.append(el("text", {"x": x, "y": top + ph + 16, "text-anchor": "middle", "class": "axis"}, f"{10.0 ** e:g}"))
    for e in range(ylo, yhi + 1):
        y = ys(10.0 ** e)
        out.append(el("line", {"x1": left, "x2": left + pw, "y1": y, "y2": y, "class": "grid"}))
        out.append(el("text", {"x": left - 6, "y": y + 4, "text-anchor": "end", "class": "axis"}, f"{10.0 ** e:g}"))
    out.append(el("text", {"x": left + pw / 2, "y": height - 6, "text-anchor": "middle", "class": "axis"},
                  "arithmetic intensity: FLOP per byte moved (log)"))
    out.append(el("text", {"x": 14, "y": top + ph / 2, "text-anchor": "middle", "class": "axis",
                           "transform": f"rotate(-90 14 {coord(top + ph / 2)})"}, "achieved TFLOP/s (log)"))
    for d in dtypes:  # roof: min(peak, bandwidth x intensity)
        peak = float(peaks[d])
        xa, xb = 10.0 ** xlo, 10.0 ** xhi
        seg = []
        if bw:
            ridge = peak * 1e3 / float(bw)
            x0 = max(xa, 10.0 ** ylo * 1e3 / float(bw))
            if x0 < ridge:
                seg.append((x0, float(bw) * x0 / 1e3))
            seg.append((min(max(ridge, xa), xb), peak))
        else:
            seg.append((xa, peak))
        seg.append((xb, peak))
        path = " ".join(f"{'M' if i == 0 else 'L'}{coord(xs(x))},{coord(ys(y))}" for i, (x, y) in enumerate(seg))
        out.append(el("path", {"d": path, "fill": "none", "stroke": "#555", "stroke-width": 1.4, "class": "roof"},
                      el("title", None, f"{d} roof: {peak:,.0f} TFLOP/s dense peak"
                                        + (f", {float(bw):,.0f} GB/s memory bandwidth" if bw else ""))))
        out.append(el("text", {"x": left + pw + 6, "y": ys(peak) + 4, "class": "axis"}, f"{d} {peak:,.0f} TFLOP/s"))
    for p in pts:
        col = class_color(p["cls"])
        tip = (f"{p['label']}\n{p['kind']} · {p['cls']} · {p['bound']}-bound · {fmt_share(p['pct_roofline'])} of "
               f"roofline\n{fmt_rate(p['tflops'], 'TFLOP/s')} · {fmt_rate(p['gbps'], 'GB/s')} · "
               f"{p['intensity']:,.1f} FLOP/byte · {fmt_us(p['us'])} per step per rank, floor {fmt_us(p['floor'])}")
        out.append(el("circle", {"cx": xs(p["intensity"]), "cy": ys(p["tflops"]), "r": 5, "fill": col,
                                 "fill-opacity": 0.6, "stroke": col, "class": "roof-pt"}, el("title", None, tip)))
    return svg(width, height, "roofline: arithmetic intensity versus achieved throughput", *out), None


def roofline_view(doc: dict[str, Any], limit: int = 40) -> list[dict[str, Any]]:
    """The rows of the HTML roofline table: :func:`roofline_rows` with their texts and colours."""
    out = []
    for r in roofline_rows(doc, limit):
        v = {k: ("" if r[k] is None else r[k]) for k in ("tflops", "gbps", "pct_bw", "pct_roofline")}
        out.append(dict(r, **v, color=class_color(r["cls"]), us_t=fmt_us(r["us"]), floor_t=fmt_us(r["floor"]),
                        tflops_t=fmt_rate(r["tflops"], "").strip(), gbps_t=fmt_rate(r["gbps"], "").strip(),
                        pct_t=fmt_share(r["pct_roofline"]), bw_t=fmt_share(r["pct_bw"])))
    return out
