"""Stage 2, link: kernel -> launching runtime event (``correlation``) -> enclosing CPU op.

Kernels replayed from a CUDA graph share the correlation id of their ``cudaGraphLaunch``; they
are kept, marked ``graph_replay`` and get no CPU op (the op that was running at capture time is
not the one running now).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceinspect.model import TraceSet

GRAPH_LAUNCH = {"cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch", "hipGraphLaunch"}


def _op_parents(cpu_ops: pd.DataFrame) -> np.ndarray:
    """Row of the innermost enclosing op on the same thread, or -1 (ops nest per thread)."""
    parent = np.full(len(cpu_ops), -1, dtype=np.int64)
    if not len(cpu_ops):
        return parent
    order = np.lexsort((-cpu_ops["dur"].to_numpy(), cpu_ops["ts"].to_numpy(),
                        cpu_ops["tid"].to_numpy(), cpu_ops["rank"].to_numpy()))
    ts = cpu_ops["ts"].to_numpy()
    end = cpu_ops["end"].to_numpy()
    key = (cpu_ops["rank"].to_numpy() << 32) ^ cpu_ops["tid"].to_numpy()
    stack: list[int] = []
    cur = None
    for i in order:
        if key[i] != cur:
            stack.clear()
            cur = key[i]
        while stack and end[stack[-1]] < ts[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _enclosing(outer: pd.DataFrame, inner: pd.DataFrame) -> np.ndarray:
    """For each row of ``inner`` (rank, tid, ts), the innermost ``outer`` row containing it, or -1."""
    out = np.full(len(inner), -1, dtype=np.int64)
    if not len(outer) or not len(inner):
        return out
    for (rank, tid), grp in inner.groupby(["rank", "tid"], sort=False):
        o = outer[(outer["rank"] == rank) & (outer["tid"] == tid)]
        if not len(o):
            continue
        o = o.sort_values(["ts", "dur"], ascending=[True, False])
        ots, oend, oidx = o["ts"].to_numpy(), o["end"].to_numpy(), o.index.to_numpy()
        # candidates start at or before the event; walk back to the latest that still contains it
        pos = np.searchsorted(ots, grp["ts"].to_numpy(), side="right") - 1
        for row, p, t in zip(grp.index.to_numpy(), pos, grp["ts"].to_numpy(), strict=True):
            j = p
            while j >= 0 and oend[j] < t:
                j -= 1
            if j >= 0:
                out[inner.index.get_loc(row)] = oidx[j]
    return out


def link(ts: TraceSet) -> TraceSet:
    """Add link columns to ``kernels`` (rt_idx, rt_name, graph_replay, op_idx, op_name, op_path)
    and ``parent`` to ``cpu_ops``."""
    k, rt, ops = ts.kernels, ts.runtime, ts.cpu_ops
    ops["parent"] = _op_parents(ops)

    # runtime row per (rank, correlation); duplicated ids keep the first and are reported
    rtc = rt[rt["correlation"] >= 0]
    dup = rtc.duplicated(["rank", "correlation"])
    if dup.any():
        ts.warnings.append(f"{int(dup.sum())} runtime events reuse a correlation id; the first one is used")
        rtc = rtc[~dup]
    rt_map = pd.Series(rtc.index.to_numpy(), index=pd.MultiIndex.from_frame(rtc[["rank", "correlation"]]))
    keys = pd.MultiIndex.from_frame(k[["rank", "correlation"]])
    rt_idx = rt_map.reindex(keys).to_numpy()
    rt_idx = np.where(np.isnan(rt_idx.astype(np.float64)), -1, rt_idx).astype(np.int64)
    k["rt_idx"] = rt_idx
    names = rt["name"].to_numpy(dtype=object)
    k["rt_name"] = np.where(rt_idx >= 0, names[np.maximum(rt_idx, 0)] if len(rt) else "", "")
    k["graph_replay"] = k["rt_name"].isin(GRAPH_LAUNCH).to_numpy()

    # runtime event -> CPU op: External id when Kineto wrote it, else the innermost op on the thread
    rt_op = np.full(len(rt), -1, dtype=np.int64)
    if len(rt) and len(ops):
        opx = ops[ops["external_id"] >= 0]
        opx = opx[~opx.duplicated(["rank", "external_id"], keep="last")]
        op_map = pd.Series(opx.index.to_numpy(), index=pd.MultiIndex.from_frame(opx[["rank", "external_id"]]))
        via_ext = op_map.reindex(pd.MultiIndex.from_frame(rt[["rank", "external_id"]])).to_numpy()
        via_ext = np.where(np.isnan(via_ext.astype(np.float64)), -1, via_ext).astype(np.int64)
        # an External id only counts when that op really encloses the launch
        ok = via_ext >= 0
        ok[ok] = (ops["ts"].to_numpy()[via_ext[ok]] <= rt["ts"].to_numpy()[ok]) & (
            ops["end"].to_numpy()[via_ext[ok]] >= rt["ts"].to_numpy()[ok])
        rt_op = np.where(ok, via_ext, -1)
        missing = rt_op < 0
        if missing.any():
            rt_op[missing] = _enclosing(ops, rt[missing])
    op_idx = np.where((rt_idx >= 0) & ~k["graph_replay"].to_numpy(), rt_op[np.maximum(rt_idx, 0)] if len(rt)
                      else -1, -1)
    k["op_idx"] = op_idx.astype(np.int64)
    op_names = ops["name"].to_numpy(dtype=object)
    k["op_name"] = np.where(op_idx >= 0, op_names[np.maximum(op_idx, 0)] if len(ops) else "", "")
    k["op_path"] = _paths(op_idx, ops)
    return ts


def _paths(op_idx: np.ndarray, ops: pd.DataFrame) -> np.ndarray:
    """Names of the enclosing ops, outermost first, joined by ' > '."""
    out = np.full(len(op_idx), "", dtype=object)
    if not len(ops):
        return out
    parent = ops["parent"].to_numpy()
    names = ops["name"].to_numpy(dtype=object)
    cache: dict[int, str] = {}

    def path(i: int) -> str:
        if i in cache:
            return cache[i]
        chain = []
        j = i
        while j >= 0 and len(chain) < 64:
            chain.append(names[j])
            j = parent[j]
        s = " > ".join(reversed(chain))
        cache[i] = s
        return s

    for n, i in enumerate(op_idx):
        if i >= 0:
            out[n] = path(int(i))
    return out
