"""The tables a reader takes away: kernels, GEMM shapes and CPU ops, as DataFrames with plain columns.

The same frames feed the HTML report's sortable tables (with their CSV downloads), ``analyze --csv
DIR`` and the notebook API, so a number in one is the number in the others. Times are microseconds
per rank per step unless a column says ``total``; shares are of the step time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.fileio import write_text_atomic
from traceinspect.render import launching_ops
from traceinspect.render.story import step_us_of

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

TABLES = ("kernels", "gemm", "ops")
KERNEL_COLUMNS = ["name", "cls", "launched_by", "calls", "calls_per_step", "total_us", "mean_us", "us_per_step",
                  "share_of_step"]
GEMM_COLUMNS = ["op", "cls", "dtype", "m", "n", "k", "batch", "groups", "calls", "us_per_step", "mean_us", "tflops",
                "pct_peak", "gbps", "shape_source", "reason"]
OP_COLUMNS = ["op", "kernels", "calls", "calls_per_step", "total_us", "us_per_step", "share_of_step", "classes"]


def _per(a: Analysis) -> int:
    """Rank-steps the totals are over (the divisor of every per-step figure)."""
    return max(len(a.selected), 1)


def kernels_table(a: Analysis, doc: dict[str, Any]) -> pd.DataFrame:
    """One row per kernel name (full name): class, launching op, calls and time."""
    k = a.kernels
    if not len(k):
        return pd.DataFrame(columns=KERNEL_COLUMNS)
    g = k.groupby("name", observed=True).agg(cls=("cls", "first"), calls=("dur", "size"), total_us=("dur", "sum"),
                                             mean_us=("dur", "mean")).reset_index()
    g["name"] = g["name"].astype(str)
    g["cls"] = g["cls"].astype(str)
    ops = launching_ops(k)
    g["launched_by"] = [ops.get(n, "") for n in g["name"]]
    per = _per(a)
    g["calls_per_step"] = g["calls"] / per
    g["us_per_step"] = g["total_us"] / per
    step = step_us_of(doc)
    g["share_of_step"] = g["us_per_step"] / step if step else np.nan
    return g.sort_values("total_us", ascending=False)[KERNEL_COLUMNS].reset_index(drop=True)


def gemm_table(a: Analysis, doc: dict[str, Any]) -> pd.DataFrame:
    """One row per GEMM op and shape, from the efficiency stage (``gemm`` of the JSON)."""
    rows = doc.get("gemm")
    if not isinstance(rows, list) or not rows:
        return pd.DataFrame(columns=GEMM_COLUMNS)
    g = pd.DataFrame([r for r in rows if isinstance(r, dict)])
    for c in GEMM_COLUMNS + ["us"]:
        if c not in g.columns:
            g[c] = None
    g["us_per_step"] = pd.to_numeric(g["us"], errors="coerce") / _per(a)
    return g[GEMM_COLUMNS].reset_index(drop=True)


def ops_table(a: Analysis, doc: dict[str, Any]) -> pd.DataFrame:
    """One row per CPU op that launches GPU work: its kernels' calls and time (CUDA-graph replays,
    which have no CPU op, are one row of their own)."""
    k = a.kernels
    if not len(k):
        return pd.DataFrame(columns=OP_COLUMNS)
    op = k["op_name"].astype(str).where(k["op_idx"].to_numpy() >= 0, "")
    op = op.where(op != "", np.where(k["graph_replay"].to_numpy(), "(CUDA graph replay: no CPU op)",
                                     "(no CPU op linked)"))
    d = pd.DataFrame({"op": op.to_numpy(), "name": k["name"].astype(str).to_numpy(),
                      "cls": k["cls"].astype(str).to_numpy(), "dur": k["dur"].to_numpy()})
    g = d.groupby("op").agg(kernels=("name", "nunique"), calls=("dur", "size"), total_us=("dur", "sum")).reset_index()
    cls = (d.groupby(["op", "cls"])["dur"].sum().reset_index().sort_values(["op", "dur"], ascending=[True, False])
           .groupby("op")["cls"].agg(lambda s: ", ".join(s)))
    g["classes"] = g["op"].map(cls).fillna("")
    per = _per(a)
    g["calls_per_step"] = g["calls"] / per
    g["us_per_step"] = g["total_us"] / per
    step = step_us_of(doc)
    g["share_of_step"] = g["us_per_step"] / step if step else np.nan
    return g.sort_values("total_us", ascending=False)[OP_COLUMNS].reset_index(drop=True)


def report_tables(a: Analysis, doc: dict[str, Any] | None = None) -> dict[str, pd.DataFrame]:
    """The kernels, GEMM and ops tables of an analysis."""
    doc = doc if doc is not None else a.to_json()
    return {"kernels": kernels_table(a, doc), "gemm": gemm_table(a, doc), "ops": ops_table(a, doc)}


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
