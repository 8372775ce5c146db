"""GEMM calls aggregated per shape (class, op, dtype, M per expert, N, K, batch), with the time, FLOPs and
peak-weighted time the judge's ``gemm`` subjects are built from."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from traceinspect.tables import combine_codes, factorize_text, first_rows

_type_of = np.frompyfunc(type, 1, 1)
_ONE_KIND = ("string", "integer", "floating", "empty")


def _texts(values: np.ndarray) -> bool:
    """Whether every value is text or missing (None, NaN)."""
    return all(isinstance(u, str) or u is None or (isinstance(u, float) and u != u) for u in values.tolist())


def distinct_rows(frame: pd.DataFrame, cols: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Per row a code shared by the rows whose ``cols`` hold equal values of equal types (1, 1.0 and True
    apart), numbered in order of first appearance, and the position of each code's first row."""
    parts = []
    for c in cols:
        v = frame[c].to_numpy()
        if v.dtype == object:
            codes, uniq = factorize_text(v)
            parts.append(codes)
            # equal values of different types (1, 1.0, True) share a dictionary slot but may convert
            # differently; a column of one kind of value (besides missing ones) has no such pairs, and
            # only texts equal texts
            if not _texts(uniq) and pd.api.types.infer_dtype(v, skipna=True) not in _ONE_KIND:
                parts.append(factorize_text(_type_of(v))[0])
        else:
            parts.append(pd.factorize(v, use_na_sentinel=False)[0])
    code = combine_codes(*parts)
    return code, first_rows(code)


def key_groups(frame: pd.DataFrame, cols: list[str], prepare: Callable[[pd.DataFrame], pd.DataFrame],
               keys: list[str]) -> tuple[pd.DataFrame, np.ndarray]:
    """Group ``frame`` by the ``keys`` that ``prepare`` (a row-by-row function of the ``cols``) derives,
    preparing one row per distinct ``cols`` instead of every row: the key columns of the groups, in order
    of first appearance (``groupby(keys, sort=False, dropna=False)``), each with the prepared column's
    type, and each row's group number."""
    raw, first = distinct_rows(frame, cols)
    prepared = prepare(frame.iloc[first])[keys]
    values = [prepared[c].to_numpy() for c in keys]
    if any(pd.isna(v).any() for v in values):  # a missing key: the groups and their labels as pandas makes them
        grouped = prepared.groupby(keys, sort=False, dropna=False)
        out = grouped.size().reset_index()[keys]
        out.columns = pd.Index(keys)
        return out, grouped.ngroup().to_numpy()[raw]
    # a few prepared rows: their key tuples numbered in a dictionary (values equal as pandas compares
    # a column's values are equal Python objects with equal hashes)
    seen: dict[tuple[Any, ...], int] = {}
    rows = zip(*(v.tolist() for v in values), strict=True)
    number = np.fromiter((seen.setdefault(t, len(seen)) for t in rows), dtype=np.int64, count=len(prepared))
    return prepared.iloc[first_rows(number)].reset_index(drop=True), number[raw]


_SHAPE_KEYS = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "is_moe", "known"]


def numbers(values: np.ndarray) -> np.ndarray:
    """``pd.to_numeric(values, errors="coerce")`` of a column's values (an array in, an array out)."""
    return np.asarray(pd.to_numeric(values, errors="coerce"))


def filled(values: np.ndarray, fill: Any) -> np.ndarray:
    """``Series.fillna(fill)`` of a column's values: missing values (None, NaN) become ``fill``; a numeric
    column without missing values keeps its type."""
    if values.dtype.kind == "f":
        return np.where(np.isnan(values), fill, values)
    if values.dtype == object:
        out = values.copy()
        out[pd.isna(values)] = fill
        return out
    return values


def key_frame(cols: dict[str, np.ndarray], index: pd.Index) -> pd.DataFrame:
    """A frame of prepared key columns, each keeping its array's type (text stays ``object``)."""
    return pd.DataFrame({c: pd.Series(v, index=index, dtype=v.dtype, copy=False) for c, v in cols.items()},
                        index=index)


def _shape_keys(g: pd.DataFrame) -> pd.DataFrame:
    """The key columns of :func:`gemm_shapes` as grouped, from the calls' columns row by row (a few
    distinct rows: column arrays, not frame operations)."""
    col = {c: g[c].to_numpy() for c in ("cls", "op_name", "dtype", "m", "groups", "n", "k", "batch", "moe") if c in g}
    groups = np.maximum(filled(numbers(col["groups"]), 1), 1)
    m = numbers(col["m"]) / groups
    n, k = numbers(col["n"]), numbers(col["k"])
    out = {
        "cls": col["cls"], "op_name": filled(col["op_name"], "").astype(object),
        "dtype": filled(col["dtype"], "").astype(object), "m": filled(m, -1.0), "n": filled(n, -1.0),
        "k": filled(k, -1.0), "batch": filled(numbers(col["batch"]), 1),
        "is_moe": col["moe"].astype(bool) if "moe" in col else np.asarray(col["cls"] == "moe_gemm", dtype=bool),
        "known": ~pd.isna(m) & ~pd.isna(n) & ~pd.isna(k),
    }
    return key_frame(out, g.index)


def gemm_shapes(calls: Any) -> pd.DataFrame | None:
    """The GEMM calls of the efficiency stage (``Efficiency.calls``) aggregated per shape: cls, op_name, dtype, m (rows per
    expert for grouped GEMMs), n, k, batch, is_moe, known, calls, us, flops, peak_us (peak x us),
    ranks. None when the efficiency stage produced no GEMM calls."""
    if not isinstance(calls, pd.DataFrame) or not len(calls) or "kind" not in calls.columns:
        return None
    gemm = calls["kind"].to_numpy() == "gemm"
    g = calls if gemm.all() else calls[gemm]  # (given Efficiency.gemm_calls: already the GEMM rows)
    if not len(g):
        return None
    # the keys are prepared once per distinct combination of the columns they come from; the sums run
    # over all rows in row order as grouping by the keys would
    cols = [c for c in ("cls", "op_name", "dtype", "m", "groups", "n", "k", "batch", "moe") if c in g.columns]
    agg, grp = key_groups(g, cols, _shape_keys, _SHAPE_KEYS)
    us = g["us"].to_numpy()
    peak = pd.to_numeric(g.get("peak_tflops"), errors="coerce")
    sums = {
        "us": us, "flops": pd.to_numeric(g["flops"], errors="coerce").to_numpy(),
        "peak_us": (peak * g["us"]).where(peak.notna(), np.nan).to_numpy(),
        "peak_known_us": g["us"].where(peak.notna(), 0.0).to_numpy(),
        **_roof_sums(g),
    }
    agg["calls"] = np.bincount(grp, minlength=len(agg)).astype(np.int64)
    for c, v in sums.items():
        # one column at a time: a frame's 2-D sum does not round as a column's sum does
        agg[c] = pd.Series(v).groupby(grp).sum().to_numpy()
    rank = g["rank"].to_numpy().astype(np.int64)
    lo, span = int(rank.min()), int(rank.max() - rank.min()) + 1
    pair = np.unique(grp.astype(np.int64) * span + (rank - lo))  # sorted by group, then rank
    cut = np.searchsorted(pair // span, np.arange(len(agg) + 1))
    ranks = (pair % span + lo).tolist()
    agg["ranks"] = pd.Series([tuple(ranks[a:b]) for a, b in zip(cut[:-1], cut[1:], strict=True)],
                             dtype=object)
    order = np.argsort(grp, kind="stable")
    kcut = np.searchsorted(grp[order], np.arange(len(agg) + 1))
    kern = g["kernel"].to_numpy()[order]
    agg["kernels"] = pd.Series([kern[a:b] for a, b in zip(kcut[:-1], kcut[1:], strict=True)], dtype=object)
    for c in ("m", "n", "k"):
        agg[c] = agg[c].where(agg[c] >= 0, np.nan)
    return agg.sort_values("us", ascending=False).reset_index(drop=True)


_EL_BYTES = {"fp4": 0.5, "fp8": 1.0, "int8": 1.0, "fp16": 2.0, "bf16": 2.0, "fp32": 4.0, "tf32": 4.0}


def _roof_sums(g: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per call, the columns whose sums per shape the roofline metrics read: floor (0 where unknown, with
    ``floor_unknown`` counting those), bytes, compute and memory time at the peaks, weight bytes (K x N
    per group and batch, at the compute dtype) and rows."""
    n = len(g)
    if "floor_us" not in g:
        return {}
    fl = g["floor_us"].to_numpy(dtype=float)
    by = pd.to_numeric(g["bytes"], errors="coerce").to_numpy(dtype=float)
    el = np.array([_EL_BYTES.get(d, np.nan) if isinstance(d, str) else np.nan
                   for d in g["dtype"].tolist()], dtype=float) if n else np.zeros(0)
    mult = np.maximum(filled(numbers(g["groups"].to_numpy()), 1), 1) * np.maximum(
        filled(numbers(g["batch"].to_numpy()), 1), 1)
    w = numbers(g["n"].to_numpy()) * numbers(g["k"].to_numpy()) * mult * el
    rows = numbers(g["m"].to_numpy()) * np.maximum(filled(numbers(g["batch"].to_numpy()), 1), 1)
    tm = g["t_memory_us"].to_numpy(dtype=float)
    tc = g["t_compute_us"].to_numpy(dtype=float)
    bound = g["bound"].to_numpy(dtype=object)
    us = g["us"].to_numpy(dtype=float)
    return {"floor_us": np.nan_to_num(fl), "floor_unknown": (~np.isfinite(fl)).astype(float),
            "bytes": np.nan_to_num(by), "t_memory_us": np.nan_to_num(tm), "t_compute_us": np.nan_to_num(tc),
            "weight_bytes": np.nan_to_num(w), "rows": np.nan_to_num(rows),
            "weight_bytes_per_row": np.nan_to_num(np.where(rows > 0, w / np.where(rows > 0, rows, 1), np.nan)),
            "memory_us": np.where(bound == "memory", us, 0.0), "compute_us": np.where(bound == "compute", us, 0.0),
            "latency_us": np.where(bound == "latency", us, 0.0)}
