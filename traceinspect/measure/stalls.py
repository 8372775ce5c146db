"""Host stalls: time a launching thread spends inside a step (its CPU window and GPU span) outside every
CPU op and runtime call, in stretches of at least a threshold (Python work between ops, a busy wait,
logging, a GC pause). The rule ``host-stall`` counts them; the ``host-stalls`` edit removes them from
the replayed host chain."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

COLUMNS = ["rank", "tid", "step", "start", "end"]


def stall_stretches(a: Analysis, min_us: float) -> pd.DataFrame:
    """Stretches of at least ``min_us`` inside the analysed steps' CPU windows and GPU spans (first kernel
    start to last kernel end), on every thread that issues runtime calls, covered by no CPU op and no
    runtime call of that thread (trace clock):
    ``rank, tid, step`` (row label of the steps table), ``start, end``."""
    ts, sel = a.trace, a.selected
    rt, ops = ts.runtime, ts.cpu_ops
    out: list[pd.DataFrame] = []
    if sel is None or not len(sel) or rt is None or not len(rt):
        return pd.DataFrame(columns=COLUMNS)
    # the few columns needed, as arrays once: masking whole tables per rank copies every column
    cols = [_columns(t) for t in ([rt, ops] if ops is not None and len(ops) else [rt])]
    for r, g in sel.groupby("rank"):
        # only a stall while the step's GPU work is under way can lengthen it
        lo = np.fmax(g["cpu_start"].to_numpy(dtype=np.float64), g["gpu_start"].to_numpy(dtype=np.float64))
        hi = np.fmin(g["cpu_end"].to_numpy(dtype=np.float64), g["gpu_end"].to_numpy(dtype=np.float64))
        ok = np.isfinite(lo) & np.isfinite(hi) & (hi > lo)
        if not ok.any():
            continue
        o = np.argsort(lo[ok])
        lo, hi, labels = lo[ok][o], hi[ok][o], g.index.to_numpy()[ok][o]
        mine = [_where(rank == r, tids, start, end) for rank, tids, start, end in cols]
        for tid in np.unique(mine[0][0]):
            gs, ge = _uncovered([_where(tids == tid, start, end) for tids, start, end in mine], min_us)
            w = np.searchsorted(lo, gs, side="right") - 1  # the step window the stretch starts in
            inside = (w >= 0) & (gs < hi[np.maximum(w, 0)])
            if not inside.any():
                continue
            w, gs, ge = w[inside], gs[inside], np.minimum(ge[inside], hi[w[inside]])
            keep = ge - gs >= min_us
            out.append(pd.DataFrame({"rank": r, "tid": tid, "step": labels[w[keep]], "start": gs[keep],
                                     "end": ge[keep]}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=COLUMNS)


def _columns(t: pd.DataFrame) -> tuple[np.ndarray, ...]:
    """``rank, tid, start, end`` of a table of intervals, as arrays (``end`` is the loader's ts + dur)."""
    return (t["rank"].to_numpy(), t["tid"].to_numpy(), t["ts"].to_numpy(dtype=np.float64),
            t["end"].to_numpy(dtype=np.float64))


def _where(m: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
    """``arrays`` where ``m`` holds (the arrays themselves, not copies, where it holds everywhere)."""
    return arrays if m.all() else tuple(x[m] for x in arrays)


def _uncovered(parts: list[tuple[np.ndarray, np.ndarray]], min_us: float) -> tuple[np.ndarray, np.ndarray]:
    """The stretches of at least ``min_us`` between the first start and the last end of the intervals of
    ``parts`` (each ``start, end``) that none of them covers, in start order."""
    parts = [p for p in parts if len(p[0])]
    if min_us <= 0 or len(parts) != 2:
        s, e = _covered(parts)
        gs, ge = e[:-1], s[1:]  # uncovered between the covered run so far and the next interval
        keep = ge - gs >= min_us
        return gs[keep], ge[keep]
    # what the intervals of all parts leave uncovered is what each leaves uncovered (before its first start
    # and after its last end included), and such a stretch of min_us lies in one of min_us of each: the
    # long gaps of each part, intersected, without merging the parts' (large) tables
    gaps = []
    for p in parts:
        s, e = _covered([p])
        keep = np.nonzero(s[1:] - e[:-1] >= min_us)[0]
        gaps.append((np.r_[-np.inf, e[:-1][keep], e[-1]], np.r_[s[0], s[1:][keep], np.inf]))
    (a0, a1), (b0, b1) = gaps
    first = np.searchsorted(b1, a0, side="right")  # per stretch of a: the stretches of b that overlap it
    last = np.searchsorted(b0, a1, side="left")
    n = np.maximum(last - first, 0)
    i = np.repeat(np.arange(len(a0)), n)
    j = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n) + np.repeat(first, n)
    gs, ge = np.maximum(a0[i], b0[j]), np.minimum(a1[i], b1[j])
    keep = (ge - gs >= min_us) & np.isfinite(gs) & np.isfinite(ge)
    return gs[keep], ge[keep]


def _covered(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """The intervals of ``parts`` (each ``start, end``) in start order, as ``start`` and the running maximum
    of ``end`` (the end of the covered run so far)."""
    s, e = parts[0] if len(parts) == 1 else (np.concatenate([p[0] for p in parts]),
                                             np.concatenate([p[1] for p in parts]))
    if len(parts) > 1 or not (s[1:] >= s[:-1]).all():
        order = np.argsort(s, kind="stable")  # (of tables in start order: a merge of their runs)
        s, e = s[order], e[order]
    return s, np.maximum.accumulate(e)


def overlap_us(stretches: pd.DataFrame, rank: np.ndarray, tid: np.ndarray, lo: np.ndarray,
               hi: np.ndarray) -> np.ndarray:
    """Per window ``(lo, hi)`` of thread ``(rank, tid)``: the stall time inside it."""
    out = np.zeros(len(lo))
    if not len(stretches) or not len(lo):
        return out
    for (r, t), g in stretches.groupby(["rank", "tid"]):
        m = np.nonzero((rank == r) & (tid == t))[0]
        if not len(m):
            continue
        s = g["start"].to_numpy(dtype=np.float64)
        e = g["end"].to_numpy(dtype=np.float64)
        o = np.argsort(s)
        s, e = s[o], e[o]
        before = np.r_[0.0, np.cumsum(e - s)]  # stall time of the stretches before each one

        def upto(x: np.ndarray, s: np.ndarray = s, e: np.ndarray = e, before: np.ndarray = before) -> np.ndarray:
            j = np.searchsorted(s, x, side="right") - 1
            part = np.where(j >= 0, np.clip(x - s[np.maximum(j, 0)], 0.0, None), 0.0)
            part = np.minimum(part, np.where(j >= 0, (e - s)[np.maximum(j, 0)], 0.0))
            return before[np.maximum(j, 0)] * (j >= 0) + part

        out[m] = np.clip(upto(hi[m]) - upto(lo[m]), 0.0, None)
    return out
