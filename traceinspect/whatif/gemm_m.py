"""GEMM time at another M (rows per call: a batch change) from the M-efficiency curve measured in the
trace for the GEMM's family (class, dtype, N, K), never below the GEMM's roofline floor at the new M
(:func:`~traceinspect.measure.roofline.floor_us`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traceinspect.measure.roofline import floor_us, gpu_roofs

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis
    from traceinspect.whatif.model import Model


def _floats(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64)


def gemm_rows(a: Analysis) -> pd.DataFrame | None:
    """The GEMM calls with a usable shape (M, N, K, FLOPs and time known), one row per kernel, with
    ``m_ n_ k_ fl_ by_ us_ peak_ batch_`` as floats, the throughput ``tf`` and the family ``fam``;
    None when the efficiency stage measured no GEMM call."""
    eff = a.efficiency
    if eff is None or not len(eff.calls):
        return None
    c = eff.gemm_calls()
    if not len(c):
        return None
    M, N, K = _floats(c["m"]), _floats(c["n"]), _floats(c["k"])
    fl, by, us = _floats(c["flops"]), _floats(c["bytes"]), c["us"].to_numpy(dtype=np.float64)
    ok = (M > 0) & (N > 0) & (K > 0) & (fl > 0) & (us > 0)
    peak = _floats(c["peak_tflops"]) * 1e6 if "peak_tflops" in c else np.full(len(c), np.nan)  # FLOP per us
    bt = _floats(c["batch"]) if "batch" in c else np.full(len(c), np.nan)
    c = c[ok].assign(m_=M[ok], n_=N[ok], k_=K[ok], fl_=fl[ok], by_=by[ok], us_=us[ok], peak_=peak[ok], batch_=bt[ok])
    c = c.assign(tf=c["fl_"] / c["us_"], fam=list(zip(c["cls"], c["dtype"].astype(str), c["n_"], c["k_"],
                                                      strict=True)))
    return c[~c["kernel"].duplicated()]


def attention_like(rows: pd.DataFrame, context: float | None = None) -> np.ndarray:
    """Batched GEMMs (bmm with batch > 1) that are not expert GEMMs and whose N or K is the context per request
    (when known): attention's products over the cached tokens, one per request, whose work follows the active
    tokens, not M. A batched GEMM over a per-head weight (its M the tokens) follows M."""
    out = (rows["batch_"].to_numpy(dtype=np.float64) > 1) & (rows["cls"].astype(str).to_numpy() != "moe_gemm")
    if context:
        n, k = rows["n_"].to_numpy(dtype=np.float64), rows["k_"].to_numpy(dtype=np.float64)
        out &= (np.abs(n - context) < 0.5) | (np.abs(k - context) < 0.5)
    return out


def rows_of(a: Analysis, m: Model, ops: np.ndarray) -> tuple[pd.DataFrame | None, np.ndarray]:
    """(:func:`gemm_rows`, per op of ``ops`` its row position there or NaN)."""
    c = gemm_rows(a)
    if c is None:
        return None, np.full(len(ops), np.nan)
    row = pd.Series(np.arange(len(c)), index=c["kernel"].to_numpy())
    return c, row.reindex(m.g_kidx[ops]).to_numpy(dtype=np.float64)


def scale_m(a: Analysis, m: Model, mask: np.ndarray, factor: float,
            dur: np.ndarray, floor: np.ndarray | None = None) -> tuple[list[str], list[str]]:
    """Set ``dur`` of the selected GEMMs to their time at M x ``factor`` (and ``floor``, when given, to their
    roofline floor at that M); (notes, undecided)."""
    sel = np.nonzero(mask)[0]
    c, hit = rows_of(a, m, sel)
    if c is None:
        return [], ["no GEMM shapes were measured (the efficiency stage has no GEMM calls)"]
    known = ~np.isnan(hit)
    if not known.any():
        return [], [f"the M of the {len(sel)} selected GEMM(s) is not in the trace (no recorded shapes or "
                    "graph-capture trace)"]
    if (~known).any():
        return [], [f"{int((~known).sum())} of {len(sel)} selected GEMMs have no recorded M"]
    how = m_times(a, c, sel, hit.astype(np.int64), factor, dur, floor=floor)
    return [f"GEMM M x {factor:g}: " + "; ".join(f"{n} call(s) from the {k}" for k, n in how.items())], []


def m_times(a: Analysis, c: pd.DataFrame, ops: np.ndarray, rows: np.ndarray, factor: float,
            dur: np.ndarray, latency: bool = False, floor: np.ndarray | None = None) -> dict[str, int]:
    """Set ``dur[ops]`` to the time of GEMM rows ``rows`` of ``c`` at M x ``factor``: FLOPs at the new M over
    the throughput the family reaches there (its measured M-efficiency curve; with one measured M, the
    time scaled with the elements moved, no faster than the dtype's dense peak), never below the roofline
    floor at the new M. ``latency``: with one measured M, a GEMM that does not stream its operands takes only
    the added bytes at the peak bandwidth (the ``batch`` edit's model). Returns how many calls each method
    decided."""
    curves = {fam: g.groupby("m_")["tf"].median().sort_index() for fam, g in c.groupby("fam", sort=False)}
    best = c.groupby(c["dtype"].astype(str))["tf"].max().to_dict()
    from traceinspect.measure.replay_settings import load_settings

    _, bw = gpu_roofs(a)
    stream = load_settings().batch_stream_pct / 100.0
    how: dict[str, int] = {}
    r = c.iloc[rows]
    m0 = r["m_"].to_numpy(dtype=np.float64)
    m1 = np.maximum(m0 * factor, 1.0)
    n_, k_ = r["n_"].to_numpy(dtype=np.float64), r["k_"].to_numpy(dtype=np.float64)
    fl1 = r["fl_"].to_numpy(dtype=np.float64) * m1 / m0
    el0, el1 = m0 * k_ + k_ * n_ + m0 * n_, m1 * k_ + k_ * n_ + m1 * n_
    by1 = r["by_"].to_numpy(dtype=np.float64) * el1 / el0
    floor1 = floor_us(fl1, by1, r["peak_"].to_numpy(dtype=np.float64) / 1e6, bw)
    if floor is not None:
        floor[ops] = floor1
    for j, (op, row) in enumerate(zip(ops, r.itertuples(index=False), strict=True)):
        curve = curves[row.fam]
        if len(curve) >= 2:
            xs, ys = np.log(curve.index.to_numpy()), np.log(curve.to_numpy())
            tf1 = float(np.exp(np.interp(np.log(m1[j]), xs, ys)))
            inside = curve.index.min() <= m1[j] <= curve.index.max()
            key = "measured curve" if inside else "measured curve, held at its nearest end beyond it"
            t = fl1[j] / tf1
        else:
            # one measured M: a GEMM streaming its operands (measured bandwidth at least stream_min_pct_bw of the
            # peak) keeps its bandwidth: time x the bytes at the new M over the bytes at the measured one (weights
            # dominate at small M); a latency-bound one takes only the added bytes at the GPU's peak bandwidth.
            # Either no faster than the dtype's dense peak (rules/gpus.yaml), else the best throughput measured
            has_peak = np.isfinite(row.peak_) and row.peak_ > 0
            cap = row.peak_ if has_peak else best.get(str(row.dtype), row.tf)
            streams = not latency or bw is None or (np.isfinite(row.by_) and row.by_ / row.us_ / 1e3 >= stream * bw)
            if streams or not np.isfinite(row.by_):
                t = max(row.us_ * el1[j] / el0[j], fl1[j] / cap)
                what = "time scaled with the elements moved"
            else:
                t = max(row.us_ + (by1[j] - row.by_) / (bw * 1e3), fl1[j] / cap)
                what = "latency-bound: the added bytes at the GPU's peak bandwidth"
            key = (f"one measured M (low confidence): {what}, no faster than the "
                   + ("dtype's dense peak" if has_peak else "dtype's best measured throughput"))
        if t < floor1[j]:
            t = float(floor1[j])
            key += " (raised to the roofline floor)"
        dur[op] = t
        how[key] = how.get(key, 0) + 1
    return how
