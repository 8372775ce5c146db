"""The report's sortable tables (kernels, GEMM shapes, CPU ops) as template rows, each with its CSV
download as a data URL; the frames are :func:`traceinspect.render.tables.report_tables`'s."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import pandas as pd

from traceinspect.render import kernel_labels, short_name
from traceinspect.render.palette import class_color
from traceinspect.render.svg import isnum
from traceinspect.render.tables import report_tables, to_csv
from traceinspect.render.timeline import NO_SECTION
from traceinspect.units import fmt_count, fmt_pct, fmt_us

TABLE_ROWS = 400  # rows of a table the page shows (its CSV download has all)


def _csv_uri(df: pd.DataFrame) -> str:
    return "data:text/csv;charset=utf-8," + quote(to_csv(df), safe="")


def _cell_num(v: Any, text: str, cls: str = "n") -> dict[str, Any]:
    return {"t": text, "v": float(v) if isnum(v) else None, "cls": cls}


def data_tables(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The kernels, GEMM-shape and CPU-op tables as template rows, each with its CSV as a data URL."""
    tables = report_tables(doc)
    # the kernel and op tables come from the document's report section, which older documents lack
    empty = "no kernels in the analysed steps" if isinstance(doc.get("report"), dict) else f"not available: {NO_SECTION}"
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
                     _cell_num(r.calls, fmt_count(r.calls)), _cell_num(r.calls_per_step, fmt_count(r.calls_per_step)),
                     _cell_num(r.total_us, fmt_us(r.total_us)), _cell_num(r.mean_us, fmt_us(r.mean_us)),
                     _cell_num(r.us_per_step, fmt_us(r.us_per_step)), _cell_num(r.share_of_step, fmt_pct(r.share_of_step))])
    out.append({"id": "kernel-table", "title": "Kernels", "file": "kernels.csv", "csv": _csv_uri(kt),
                "total": len(kt), "shown": len(head), "rows": rows, "empty": empty,
                "cols": [{"h": "#", "num": True}, {"h": "kernel"}, {"h": "launched by"}, {"h": "class"},
                         {"h": "calls", "num": True}, {"h": "calls per step", "num": True}, {"h": "total", "num": True},
                         {"h": "mean", "num": True}, {"h": "per step", "num": True},
                         {"h": "of the step time", "num": True}]})
    gt = tables["gemm"]
    rows = []
    for r in gt.head(TABLE_ROWS).itertuples(index=False):
        shape = "×".join(str(int(x)) if isnum(x) else "?" for x in (r.m, r.n, r.k))
        rows.append([{"t": str(r.op or ""), "cls": "kname", "v": None},
                     {"t": str(r.cls or ""), "cls": "cls", "color": class_color(str(r.cls or "")), "v": None},
                     {"t": str(r.dtype or "?"), "v": None}, {"t": shape, "v": None, "cls": "mono"},
                     _cell_num(r.m, f"{r.m:g}" if isnum(r.m) else "?"),
                     _cell_num(r.groups, f"{r.groups:g}" if isnum(r.groups) else ""),
                     _cell_num(r.calls, f"{int(r.calls):,}" if isnum(r.calls) else ""),
                     _cell_num(r.us_per_step, fmt_us(r.us_per_step)), _cell_num(r.mean_us, fmt_us(r.mean_us)),
                     _cell_num(r.tflops, f"{r.tflops:,.1f}" if isnum(r.tflops) else "n/a"),
                     _cell_num(r.pct_peak, f"{r.pct_peak:.2g}%" if isnum(r.pct_peak) else "n/a"),
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
                "empty": empty,
                "cols": [{"h": "op"}, {"h": "kernel names", "num": True}, {"h": "calls", "num": True},
                         {"h": "calls per step", "num": True}, {"h": "total", "num": True}, {"h": "per step", "num": True},
                         {"h": "of the step time", "num": True}, {"h": "classes (most time first)"}]})
    return out
