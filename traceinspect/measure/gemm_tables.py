"""The GEMM and memory-bound tables of the efficiency measure: the GEMM calls aggregated per (class, op,
dtype, shape) and the memory-bound calls per kernel family, each with its rates, share of peak and roofline."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from traceinspect.measure.gemm_shapes import filled, key_frame, key_groups, numbers
from traceinspect.measure.roofline import ROOF_COLUMNS, ROOF_ROW, add_row_roofline
from traceinspect.measure.specs import GpuSpec
from traceinspect.tables import factorize_text, groups

_HOST_LINK = re.compile(r"HtoD|DtoH|HtoH|PtoP|Pinned|Pageable", re.IGNORECASE)


def _obj(values: Any) -> pd.Series:
    """A text column kept object: the calls table has a row per GEMM / memory call (~1e6 under graph
    replay) and pandas 3 would convert every string of it to its own string type."""
    return pd.Series(np.asarray(values, dtype=object), dtype=object, copy=False)


GEMM_TABLE_COLUMNS = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "groups", "calls", "us", "mean_us",
                      "flops", "tflops", "pct_peak", "gbps", "shape_source", "confidence", "reason", "bytes",
                      *ROOF_ROW]


_GEMM_KEYS = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "groups", "shape_source", "confidence", "reason"]


def _gemm_keys(g: pd.DataFrame) -> pd.DataFrame:
    """The key columns of the GEMM table as grouped (unknown shapes: one row per class and reason), from
    a few distinct rows' column arrays."""
    col = {c: g[c].to_numpy() for c in _GEMM_KEYS}
    for c in ("m", "n", "k", "batch", "groups"):
        col[c] = filled(numbers(col[c]), -1).astype(np.int64)
    col["dtype"], col["reason"] = filled(col["dtype"], ""), filled(col["reason"], "")
    col["confidence"] = filled(col["confidence"], "")
    op = col["op_name"]
    unknown = np.asarray(col["shape_source"] == "unknown", dtype=bool) & np.asarray(pd.isna(op), dtype=bool)
    if unknown.any():
        op = op.copy()
        op[unknown] = ""
    col["op_name"] = op
    return key_frame(col, g.index)


def _gemm_table(gemm_calls: pd.DataFrame, spec: GpuSpec | None = None) -> pd.DataFrame:
    if not len(gemm_calls):
        return pd.DataFrame(columns=GEMM_TABLE_COLUMNS)
    g = gemm_calls[[*_GEMM_KEYS, "us", "flops", "bytes", "peak_tflops", *ROOF_COLUMNS]]
    # the keys are prepared once per distinct combination of their columns (a few per shape), the sums
    # run over all rows in row order as grouping by the keys would
    agg, grp = key_groups(g, _GEMM_KEYS, _gemm_keys, _GEMM_KEYS)
    order = np.argsort(grp, kind="stable")
    bounds = np.searchsorted(grp[order], np.arange(len(agg) + 1))
    agg["calls"] = np.bincount(grp, minlength=len(agg)).astype(np.int64)
    agg["us"] = pd.Series(g["us"].to_numpy()).groupby(grp).sum().to_numpy()
    for c in ("flops", "bytes"):
        v = pd.to_numeric(g[c], errors="coerce").to_numpy()[order]
        agg[c] = _sums_or_nan(v, bounds)
    agg["peak"] = pd.Series(g["peak_tflops"].to_numpy()).groupby(grp).first().to_numpy()
    agg["mean_us"] = agg["us"] / agg["calls"]
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["tflops"] = np.where(agg["us"] > 0, agg["flops"] / agg["us"] / 1e6, np.nan)
        agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
    agg["pct_peak"] = 100.0 * agg["tflops"] / agg["peak"]
    add_row_roofline(agg, g, grp, spec)
    for c in ("m", "n", "k", "batch", "groups"):
        v = agg[c].to_numpy()
        agg[c] = _obj(np.where(v >= 0, v.astype(object), None))
    dts = agg["dtype"].to_numpy(dtype=object)
    agg["dtype"] = _obj(np.where(dts == "", None, dts))
    conf = agg["confidence"].to_numpy(dtype=object)
    agg["confidence"] = _obj(np.where(conf == "", None, conf))
    return agg.sort_values("us", ascending=False)[GEMM_TABLE_COLUMNS].reset_index(drop=True)


def _sums_or_nan(v: np.ndarray, bounds: np.ndarray) -> list[Any]:
    """The sum of each run ``v[bounds[i]:bounds[i + 1]]``, NaN where the run holds a missing value (what
    ``pd.Series(run).sum(min_count=len(run))`` gives: the run's ``sum()``, or NaN)."""
    out: list[Any] = []
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        run = v[lo:hi]
        out.append(np.nan if run.dtype.kind == "f" and np.isnan(run).any() else run.sum())
    return out


MEMORY_TABLE_COLUMNS = ["family", "cls", "dtypes", "calls", "bytes", "us", "gbps", "pct_bw", "reason", *ROOF_ROW]


def _memory_table(calls: pd.DataFrame, spec: GpuSpec | None) -> pd.DataFrame:
    """Memory-op calls per (family, class), in order of first appearance, then by time: calls, bytes,
    time, achieved GB/s and share of the device's bandwidth, and the dtypes seen."""
    pos = np.flatnonzero((calls["kind"].to_numpy() == "memory") & calls["bytes"].notna().to_numpy())
    if not len(pos):
        return pd.DataFrame(columns=MEMORY_TABLE_COLUMNS)
    # a family is one full kernel name: kernels that differ only in template arguments (the dtype a copy
    # casts to, tile sizes) are different kernels and keep their own rows. Grouped on integer codes:
    # a family is the name's text, and rows without a family or class are left out (as grouping by
    # those columns would)
    codes, names = factorize_text(calls["name"].to_numpy(dtype=object)[pos])
    texts = np.array([None if x is None or x != x else str(x) for x in names.tolist()], dtype=object)
    fam_codes, fam = factorize_text(texts[codes])
    cls_codes, cls = factorize_text(calls["cls"].to_numpy(dtype=object)[pos])
    keep = _present(fam)[fam_codes] & _present(cls)[cls_codes]
    if not keep.all():
        pos, codes, fam_codes, cls_codes = pos[keep], codes[keep], fam_codes[keep], cls_codes[keep]
    if not len(pos):
        return pd.DataFrame(columns=MEMORY_TABLE_COLUMNS)
    grp, first = groups(fam_codes, cls_codes)
    n = len(first)
    host = np.array([bool(_HOST_LINK.search(str(x))) for x in names.tolist()], dtype=bool)[codes]
    us = calls["us"].to_numpy(dtype=float)[pos]
    agg = pd.DataFrame({
        "family": fam[fam_codes[first]], "cls": cls[cls_codes[first]],
        "calls": np.bincount(grp, minlength=n).astype(np.int64),
        # pandas' group sums (compensated), as grouping the columns would give
        "bytes": pd.Series(calls["bytes"].to_numpy()[pos].astype(float)).groupby(grp).sum().to_numpy(),
        "us": pd.Series(us).groupby(grp).sum().to_numpy(),
        "host": np.bincount(grp[host], minlength=n) > 0,
    })
    # the dtypes of each group, from its distinct (group, dtype) pairs
    dt_codes, dts = factorize_text(calls["dtype"].to_numpy(dtype=object)[pos])
    per_group: list[set[str]] = [set() for _ in range(n)]
    pairs = np.unique(grp * len(dts) + dt_codes)
    for g, d in zip((pairs // len(dts)).tolist(), (pairs % len(dts)).tolist(), strict=True):
        x = dts[d]
        if isinstance(x, str) and x:
            per_group[g].add(x)
    agg["dtypes"] = pd.Series([sorted(v) for v in per_group], dtype=object)
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
    bw = spec.mem_bw_gbps if spec and spec.mem_bw_gbps else None
    agg["pct_bw"] = np.where(agg["host"] | (bw is None), np.nan, 100.0 * agg["gbps"] / (bw or 1.0))
    agg["reason"] = np.where(agg["host"], "host link copy: not bounded by device memory bandwidth",
                             "" if bw else "GPU not in the spec table")
    add_row_roofline(agg, calls.iloc[pos], grp, spec)
    return agg.sort_values("us", ascending=False)[MEMORY_TABLE_COLUMNS].reset_index(drop=True)


def _present(values: np.ndarray) -> np.ndarray:
    """Which values are not missing (None or NaN)."""
    return np.array([not (v is None or (isinstance(v, float) and v != v)) for v in values.tolist()], dtype=bool)
