"""GEMM calls aggregated per shape (class, op, dtype, M per expert, N, K, batch), with the time, FLOPs and
peak-weighted time the judge's ``gemm`` subjects are built from."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def gemm_shapes(calls: Any) -> pd.DataFrame | None:
    """The GEMM calls of the efficiency stage (``Efficiency.calls``) aggregated per shape: cls, op_name, dtype, m (rows per
    expert for grouped GEMMs), n, k, batch, is_moe, known, calls, us, flops, peak_us (peak x us),
    ranks. None when the efficiency stage produced no GEMM calls."""
    if not isinstance(calls, pd.DataFrame) or not len(calls) or "kind" not in calls.columns:
        return None
    g = calls[calls["kind"] == "gemm"].copy()
    if not len(g):
        return None
    groups = pd.to_numeric(g.get("groups"), errors="coerce").fillna(1).clip(lower=1)
    m = pd.to_numeric(g["m"], errors="coerce")
    g["m"] = m / groups
    for c in ("n", "k"):
        g[c] = pd.to_numeric(g[c], errors="coerce")
    g["batch"] = pd.to_numeric(g.get("batch"), errors="coerce").fillna(1)
    g["known"] = g["m"].notna() & g["n"].notna() & g["k"].notna()
    g["is_moe"] = g["moe"].astype(bool) if "moe" in g.columns else (g["cls"] == "moe_gemm")
    g["flops"] = pd.to_numeric(g["flops"], errors="coerce")
    peak = pd.to_numeric(g.get("peak_tflops"), errors="coerce")
    g["peak_us"] = (peak * g["us"]).where(peak.notna(), np.nan)
    g["peak_known_us"] = g["us"].where(peak.notna(), 0.0)
    g["dtype"] = g["dtype"].fillna("").astype(object)
    g["op_name"] = g["op_name"].fillna("").astype(object)
    keys = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "is_moe", "known"]
    for c in ("m", "n", "k"):
        g[c] = g[c].fillna(-1.0)
    agg = g.groupby(keys, sort=False, dropna=False).agg(
        calls=("us", "size"), us=("us", "sum"), flops=("flops", "sum"),
        peak_us=("peak_us", "sum"), peak_known_us=("peak_known_us", "sum"),
        ranks=("rank", lambda r: tuple(sorted({int(x) for x in r})))).reset_index()
    for c in ("m", "n", "k"):
        agg[c] = agg[c].where(agg[c] >= 0, np.nan)
    return agg.sort_values("us", ascending=False).reset_index(drop=True)
