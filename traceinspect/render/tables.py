"""The tables a reader takes away: kernels, GEMM shapes and CPU ops, as DataFrames with plain columns.

The same frames feed the HTML report's sortable tables (with their CSV downloads), ``analyze --csv
DIR`` and the notebook API, so a number in one is the number in the others. Times are microseconds
per rank per step unless a column says ``total``; shares are of the step time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from traceinspect.fileio import write_text_atomic
from traceinspect.render.story import rank_steps, step_us_of

TABLES = ("kernels", "gemm", "ops")
KERNEL_COLUMNS = ["name", "cls", "launched_by", "calls", "calls_per_step", "total_us", "mean_us", "us_per_step",
                  "share_of_step"]
GEMM_COLUMNS = ["op", "cls", "dtype", "m", "n", "k", "batch", "groups", "calls", "us_per_step", "mean_us", "tflops",
                "pct_peak", "gbps", "shape_source", "confidence", "reason"]
OP_COLUMNS = ["op", "kernels", "calls", "calls_per_step", "total_us", "us_per_step", "share_of_step", "classes"]


def _section(doc: dict[str, Any], name: str) -> pd.DataFrame | None:
    """A column table of the document's ``report`` section as a frame, or None when there is none."""
    cols = (doc.get("report") or {}).get(name) if isinstance(doc.get("report"), dict) else None
    if not isinstance(cols, dict) or not cols:
        return None
    return pd.DataFrame(cols)


def _per_step(g: pd.DataFrame, doc: dict[str, Any]) -> pd.DataFrame:
    per = rank_steps(doc)
    g["calls_per_step"] = g["calls"] / per
    g["us_per_step"] = g["total_us"] / per
    step = step_us_of(doc)
    g["share_of_step"] = g["us_per_step"] / step if step else np.nan
    return g


def kernels_table(doc: dict[str, Any]) -> pd.DataFrame:
    """One row per kernel name (full name): class, launching op, calls and time."""
    g = _section(doc, "kernels")
    if g is None or not len(g):
        return pd.DataFrame(columns=KERNEL_COLUMNS)
    return _per_step(g, doc)[KERNEL_COLUMNS].reset_index(drop=True)


def gemm_table(doc: dict[str, Any]) -> pd.DataFrame:
    """One row per GEMM op and shape, from the efficiency stage (``gemm`` of the JSON)."""
    rows = doc.get("gemm")
    if not isinstance(rows, list) or not rows:
        return pd.DataFrame(columns=GEMM_COLUMNS)
    g = pd.DataFrame([r for r in rows if isinstance(r, dict)])
    for c in GEMM_COLUMNS + ["us"]:
        if c not in g.columns:
            g[c] = None
    g["us_per_step"] = pd.to_numeric(g["us"], errors="coerce") / rank_steps(doc)
    return g[GEMM_COLUMNS].reset_index(drop=True)


def ops_table(doc: dict[str, Any]) -> pd.DataFrame:
    """One row per CPU op that launches GPU work: its kernels' calls and time (CUDA-graph replays,
    which have no CPU op, are one row of their own)."""
    g = _section(doc, "ops")
    if g is None or not len(g):
        return pd.DataFrame(columns=OP_COLUMNS)
    return _per_step(g, doc)[OP_COLUMNS].reset_index(drop=True)


def report_tables(doc: dict[str, Any]) -> dict[str, pd.DataFrame]:
    """The kernels, GEMM and ops tables of an analysis document."""
    return {"kernels": kernels_table(doc), "gemm": gemm_table(doc), "ops": ops_table(doc)}


def to_csv(df: pd.DataFrame) -> str:
    """A table as CSV text (the same text the report's download links carry)."""
    return df.to_csv(index=False, float_format="%.6g", lineterminator="\n")


def write_csv(tables: dict[str, pd.DataFrame], out_dir: str | Path) -> list[Path]:
    """Write each table as ``DIR/<name>.csv`` (atomically); returns the paths written."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for name, df in tables.items():
        p = d / f"{name}.csv"
        write_text_atomic(p, to_csv(df))
        out.append(p)
    return out
