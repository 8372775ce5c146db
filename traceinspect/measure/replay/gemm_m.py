"""GEMM time at another M (rows per call: a batch change) from the M-efficiency curve measured in the
trace for the GEMM's family (class, dtype, N, K)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis
    from traceinspect.measure.replay.model import Model


def _floats(s: pd.Series) -> np.ndarray:
    return pd.to_numeric(s, errors="coerce").to_numpy(dtype=np.float64)


def scale_m(a: Analysis, m: Model, mask: np.ndarray, factor: float,
            dur: np.ndarray, floor: np.ndarray | None = None) -> tuple[list[str], list[str]]:
    """Set ``dur`` of the selected GEMMs to their time at M x ``factor`` and ``floor`` to their roofline
    floor at that M (FLOPs and elements moved scaled; unknown without the GPU's peak and bandwidth);
    (notes, undecided)."""
    eff = a.efficiency
    if eff is None or not len(eff.calls):
        return [], ["no GEMM shapes were measured (the efficiency stage has no GEMM calls)"]
    c = eff.gemm_calls()
    M, N, K = _floats(c["m"]), _floats(c["n"]), _floats(c["k"])
    fl, by, us = _floats(c["flops"]), _floats(c["bytes"]), c["us"].to_numpy(dtype=np.float64)
    ok = (M > 0) & (N > 0) & (K > 0) & (fl > 0) & (us > 0)
    peak = _floats(c["peak_tflops"]) * 1e6 if "peak_tflops" in c else np.full(len(c), np.nan)  # FLOP per us
    c = c[ok].assign(m_=M[ok], n_=N[ok], k_=K[ok], fl_=fl[ok], by_=by[ok], us_=us[ok], peak_=peak[ok])
    c = c.assign(tf=c["fl_"] / c["us_"], fam=list(zip(c["cls"], c["dtype"].astype(str), c["n_"], c["k_"],
                                                      strict=True)))
    row = pd.Series(np.arange(len(c)), index=c["kernel"].to_numpy())
    row = row[~row.index.duplicated()]
    sel = np.nonzero(mask)[0]
    hit = row.reindex(m.g_kidx[sel]).to_numpy()
    known = ~np.isnan(hit)
    notes: list[str] = []
    undecided: list[str] = []
    if not known.any():
        return [], [f"the M of the {len(sel)} selected GEMM(s) is not in the trace (no recorded shapes or "
                    "graph-capture trace)"]
    if (~known).any():
        undecided.append(f"{int((~known).sum())} of {len(sel)} selected GEMMs have no recorded M")
        return notes, undecided
    curves = {fam: g.groupby("m_")["tf"].median().sort_index() for fam, g in c.groupby("fam", sort=False)}
    best = c.groupby(c["dtype"].astype(str))["tf"].max().to_dict()
    how: dict[str, int] = {}
    rows = c.iloc[hit.astype(np.int64)]
    spec = eff.spec
    bw = spec.mem_bw_gbps * 1e3 if spec is not None and spec.mem_bw_gbps else np.nan  # bytes per us
    for op, r in zip(sel, rows.itertuples(index=False), strict=True):
        m0, m1 = float(r.m_), float(r.m_) * factor
        curve = curves[r.fam]
        fl1 = r.fl_ * m1 / m0
        if floor is not None:
            e0 = r.m_ * r.k_ + r.k_ * r.n_ + r.m_ * r.n_
            e1 = m1 * r.k_ + r.k_ * r.n_ + m1 * r.n_
            tc = fl1 / r.peak_ if np.isfinite(r.peak_) and r.peak_ > 0 else np.nan
            floor[op] = max(tc, r.by_ * e1 / e0 / bw) if np.isfinite(tc) and np.isfinite(bw) else np.nan
        if len(curve) >= 2:
            xs, ys = np.log(curve.index.to_numpy()), np.log(curve.to_numpy())
            tf1 = float(np.exp(np.interp(np.log(m1), xs, ys)))
            inside = curve.index.min() <= m1 <= curve.index.max()
            key = "measured curve" if inside else "measured curve, held at its nearest end beyond it"
            dur[op] = fl1 / tf1
        else:
            # one measured M: scale with the elements moved (weights dominate at small M), no faster than the
            # GPU's dense peak for the dtype (rules/gpus.yaml), else the best throughput measured for it
            b0 = r.m_ * r.k_ + r.k_ * r.n_ + r.m_ * r.n_
            b1 = m1 * r.k_ + r.k_ * r.n_ + m1 * r.n_
            cap = r.peak_ if np.isfinite(r.peak_) and r.peak_ > 0 else best.get(str(r.dtype), r.tf)
            dur[op] = max(r.us_ * b1 / b0, fl1 / cap)
            key = ("one measured M (low confidence): time scaled with the elements moved, no faster than the "
                   + ("dtype's dense peak" if np.isfinite(r.peak_) and r.peak_ > 0 else "dtype's best measured throughput"))
        how[key] = how.get(key, 0) + 1
    notes.append(f"GEMM M x {factor:g}: " + "; ".join(f"{n} call(s) from the {k}" for k, n in how.items()))
    return notes, undecided
