"""The critical path of a step across ranks: a dependency graph of GPU activities, launches and
matched collectives per aligned step, and its longest path (docs/collectives.md)."""

from __future__ import annotations

import heapq
import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.load.native import native_available, native_module
from traceinspect.measure.comm_settings import IDLE_MIN_US, ORDER_TOL_US, load_settings
from traceinspect.tables import groups, text_values
from traceinspect.units import json_num

if TYPE_CHECKING:
    from traceinspect.measure.comm_result import Collectives
    from traceinspect.model.analysis import Analysis


def _host_part(gap: float, launch: float, launch_end: float, ref_end: float) -> float:
    """The part of an idle gap on a rank's GPU that was spent waiting for the host to launch the next
    activity: all of it when the launch call began after the GPU went idle, else the part of the gap
    that the launch call itself still covered."""
    if gap <= 0 or not np.isfinite(launch):
        return 0.0
    if launch >= ref_end:
        return gap
    if np.isfinite(launch_end):
        return float(min(max(launch_end - ref_end, 0.0), gap))
    return 0.0


class Cycle(Exception):
    """The step's dependency graph has a cycle (collectives matched in inconsistent orders)."""


class _Graph:
    """Node-weighted DAG of one step, built node by node (:func:`_step_graph`): a path's length is the
    sum of the weights of its nodes but the last (the sink, weight 0)."""

    def __init__(self) -> None:
        self.weight: list[float] = []
        self.cls: list[str] = []
        self.rank: list[int | None] = []
        self.label: list[str] = []
        self.edges: list[tuple[int, int]] = []

    def node(self, weight: float, cls: str, rank: int | None, label: str) -> int:
        self.weight.append(float(max(weight, 0.0)))
        self.cls.append(cls)
        self.rank.append(rank)
        self.label.append(label)
        return len(self.weight) - 1

    def edge(self, u: int, v: int) -> None:
        if u != v:
            self.edges.append((u, v))

    def arrays(self, src: int, sink: int) -> StepGraph:
        """The same graph as :class:`StepGraph` arrays (node numbering and edge order kept)."""
        cls_code, cls_names = pd.factorize(pd.Series(self.cls, dtype=object))
        lab_code, labels = pd.factorize(pd.Series(self.label, dtype=object))
        e = np.array(self.edges, dtype=np.int64).reshape(-1, 2)
        return StepGraph(np.array(self.weight, dtype=np.float64), cls_code.astype(np.int64), list(cls_names),
                         np.array([-1 if r is None else r for r in self.rank], dtype=np.int64),
                         lab_code.astype(np.int64), list(labels), e[:, 0].copy(), e[:, 1].copy(), src, sink)

    def longest_path(self, src: int, sink: int) -> list[int]:
        """:func:`_longest_path` of this graph."""
        return _longest_path(len(self.weight), self.weight, self.edges, src, sink)


def _longest_path(n: int, weight: list[float], edges: list[tuple[int, int]], src: int, sink: int) -> list[int]:
    """The longest path of a node-weighted DAG of ``n`` nodes; nodes without successors lead to the
    sink, nodes without predecessors come from the source. Raises :class:`Cycle`.

    The result is the path networkx's ``dag_longest_path`` returns for the same graph (edges weighted
    with their source node's weight), ties included: topological order by generations, the first
    best predecessor in edge order, the first farthest node in topological order. ``longest_path`` of
    the native module computes the same; this is its fallback where the module is not built.
    """
    succ: list[list[int]] = [[] for _ in range(n)]
    pred: list[list[int]] = [[] for _ in range(n)]
    for u, v in dict.fromkeys(edges):  # a repeated edge counts once, in its first position
        succ[u].append(v)
        pred[v].append(u)
    tail = [u for u in range(n) if not succ[u] and u != sink]
    head = [v for v in range(n) if not pred[v] and v != src]
    for u, v in dict.fromkeys([(u, sink) for u in tail] + [(src, v) for v in head]):
        succ[u].append(v)
        pred[v].append(u)
    indeg = [len(p) for p in pred]
    gen = [v for v in range(n) if not indeg[v]]
    order: list[int] = []
    while gen:
        order += gen
        nxt: list[int] = []
        for u in gen:
            for v in succ[u]:
                indeg[v] -= 1
                if not indeg[v]:
                    nxt.append(v)
        gen = nxt
    if len(order) != n:
        raise Cycle
    w = weight
    dist = [0.0] * n
    back = list(range(n))
    for v in order:
        best, arg = -1.0, v
        for u in pred[v]:
            d = dist[u] + w[u]
            if d > best:
                best, arg = d, u
        if best >= 0:
            dist[v], back[v] = best, arg
    far = max(dist)
    v = next(x for x in order if dist[x] == far)
    path = [v]
    while back[v] != v:
        v = back[v]
        path.append(v)
    path.reverse()
    return path


class StepGraph(msgspec.Struct):
    """One step's dependency graph as arrays: per node its weight, class (``cls_names[cls]``), rank
    (-1: none) and label (``labels[label]``); the edges ``src[i] -> dst[i]`` in order; the step's source
    and sink nodes. A path's length is the sum of the weights of its nodes but the last."""

    weight: np.ndarray
    cls: np.ndarray
    cls_names: list[str]
    rank: np.ndarray
    label: np.ndarray
    labels: list[str]
    src: np.ndarray
    dst: np.ndarray
    source: int
    sink: int

    def longest_path(self) -> list[int]:
        """The longest path from the source to the sink (see :func:`_longest_path`), by the native
        module where it is built. Raises :class:`Cycle`."""
        native = native_module() if native_available() else None
        if native is not None and hasattr(native, "longest_path"):
            path = native.longest_path(len(self.weight), self.weight, self.src, self.dst, self.source, self.sink)
            if path is None:
                raise Cycle
            return np.frombuffer(path, dtype=np.int64).tolist()
        return _longest_path(len(self.weight), self.weight.tolist(),
                             list(zip(self.src.tolist(), self.dst.tolist(), strict=True)), self.source, self.sink)


def _activities(a: Analysis, sel: pd.DataFrame, res: Collectives, positions: list[int] | None = None) -> pd.DataFrame:
    """GPU activities of the aligned steps (those at ``positions`` where given) with corrected times,
    launch times and instance ids."""
    k = a.kernels
    pos_of_step = pd.Series(sel["pos"].to_numpy(), index=sel.index)
    steps = sel.index if positions is None else sel.index[sel["pos"].isin(positions).to_numpy()]
    act = k[k["step"].isin(steps)][["rank", "kind", "name", "ts", "dur", "end", "stream", "rt_idx", "step"]
                                       + (["cls"] if "cls" in k.columns else [])].copy()
    if "cls" not in act.columns:
        act["cls"] = "unknown"
    act["cls"] = pd.Series(text_values(act["cls"]), index=act.index, dtype=object)
    act["pos"] = pos_of_step.reindex(act["step"]).to_numpy().astype(np.int64)
    off = act["rank"].map(res.offsets_applied).fillna(0.0).to_numpy()
    act["ts"] = act["ts"].to_numpy() - off
    act["end"] = act["end"].to_numpy() - off
    rt = a.trace.runtime
    rt_idx = act["rt_idx"].to_numpy()
    act["launch"] = np.where(rt_idx >= 0, rt["ts"].reindex(rt_idx).to_numpy(), np.nan) - off
    act["launch_end"] = np.where(rt_idx >= 0, rt["end"].reindex(rt_idx).to_numpy(), np.nan) - off
    act["instance"] = -1
    act["transfer_us"] = np.nan
    act["residual_wait"] = 0.0
    inst = res.instances
    if len(inst):
        ii = inst.set_index("kidx")
        ii = ii[ii.index.isin(act.index)]
        act.loc[ii.index, "instance"] = ii["instance"].to_numpy()
        act.loc[ii.index, "transfer_us"] = ii["transfer_us"].to_numpy()
        last = ii[ii["last_arrival"]]
        act.loc[last.index, "residual_wait"] = last["wait_us"].to_numpy()
    return act


def _step_graph(act: pd.DataFrame) -> tuple[_Graph, int, int, float, float]:
    """The dependency graph of one aligned step across ranks; returns (graph, source, sink, t0, t1).

    One loop over the activities: the definition :func:`_step_arrays` follows on whole columns and is
    tested against, and what builds the graph of a step whose times are not all finite."""
    G = _Graph()
    t0 = float(act["ts"].min())
    t1 = float(act["end"].max())
    src = G.node(0.0, "start", None, "step start")
    xnode: dict[int, int] = {}
    act = act.sort_values(["rank", "ts", "end"], kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(act["rank"].to_numpy()) != 0, True])
    # Python lists: the loops below read every element, and a numpy scalar read costs ~10x more
    col = {c: act[c].to_numpy(dtype=object if c in ("cls", "name") else None).tolist()
           for c in ("rank", "ts", "end", "dur", "stream", "cls", "name", "launch", "launch_end", "instance",
                     "transfer_us", "residual_wait")}
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        r = int(col["rank"][lo])
        ts, end, dur, stream = col["ts"][lo:hi], col["end"][lo:hi], col["dur"][lo:hi], col["stream"][lo:hi]
        cls, name = col["cls"][lo:hi], col["name"][lo:hi]
        launch, launch_end = col["launch"][lo:hi], col["launch_end"][lo:hi]
        inst, transfer, resid = col["instance"][lo:hi], col["transfer_us"][lo:hi], col["residual_wait"][lo:hi]
        n = hi - lo
        n_in = [0] * n
        n_out = [0] * n
        for j in range(n):
            if inst[j] >= 0:
                a_node = G.node(resid[j], "comm_wait", r, str(name[j]))
                x = xnode.get(int(inst[j]))
                if x is None:
                    x = xnode[int(inst[j])] = G.node(transfer[j], "comm", None, str(name[j]))
                G.edge(a_node, x)
                n_in[j], n_out[j] = a_node, x
            else:
                n_in[j] = n_out[j] = G.node(dur[j], str(cls[j]), r, str(name[j]))
        # stream order
        last_on: dict[int, int] = {}
        for j in range(n):
            p = last_on.get(stream[j])
            if p is not None:
                G.edge(n_out[p], n_in[j])
            last_on[stream[j]] = j
        # the rank's GPU timeline: the latest activity that ended before j starts precedes j; an
        # idle GPU before j whose launch came late is host time on this rank
        pending: list[tuple[float, int]] = []
        best, best_end = -1, -math.inf
        run_end = -math.inf
        for j in range(n):
            while pending and pending[0][0] <= ts[j] + ORDER_TOL_US:
                e, i = heapq.heappop(pending)
                if e > best_end:
                    best, best_end = i, e
            pred = src if best < 0 else n_out[best]
            idle_from = max(run_end, t0)
            gap = ts[j] - idle_from
            host = _host_part(gap, launch[j], launch_end[j], idle_from) if gap > 0 else 0.0
            idle = gap - host if gap > IDLE_MIN_US else 0.0
            for w, c in ((idle, "idle"), (host, "host")):
                if w > 0:
                    h = G.node(w, c, r, f"{c} before {name[j]}")
                    G.edge(pred, h)
                    pred = h
            G.edge(pred, n_in[j])
            heapq.heappush(pending, (end[j], j))
            run_end = max(run_end, end[j])
    sink = G.node(0.0, "end", None, "step end")
    return G, src, sink, t0, t1


def _excl_cumsum(x: np.ndarray) -> np.ndarray:
    c = np.cumsum(x)
    return c - x


_FIXED_CLS = ["start", "end", "comm_wait", "comm", "idle", "host"]
_START, _END, _WAIT, _COMM, _IDLE, _HOST = range(len(_FIXED_CLS))


def _timeline(ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For activities of one rank sorted by start, the latest activity that ended by each one's start (up
    to ``ORDER_TOL_US``), or -1: what :func:`_step_graph` finds with a heap of ``(end, position)``. An
    activity leaves the heap at the first later start it ended by; of those left, the first to leave with
    the greatest end is taken, and they leave by start, then end, then position."""
    m = len(ts)
    idx = np.arange(m)
    gone = np.maximum(np.searchsorted(ts + ORDER_TOL_US, end, side="left"), idx + 1)  # position it leaves at
    order = np.lexsort((idx, end, gone))
    e = end[order]
    new = e > np.r_[-np.inf, np.maximum.accumulate(e)[:-1]]  # a strictly greater end than all before
    best_at = order[np.maximum.accumulate(np.where(new, idx, 0))]
    left = np.searchsorted(gone[order], idx, side="right")  # how many have left by each start
    return np.where(left > 0, best_at[np.maximum(left - 1, 0)], -1)


_STEP_COLUMNS = {"ts": np.float64, "end": np.float64, "stream": None, "rank": np.int64, "instance": np.int64,
                 "launch": np.float64, "launch_end": np.float64, "residual_wait": np.float64, "dur": np.float64,
                 "transfer_us": np.float64}


def _step_columns(act: pd.DataFrame) -> dict[str, Any]:
    """The columns :func:`_step_arrays` reads, as arrays (the text columns stay pandas columns: they are
    numbered per step as :func:`pandas.factorize` numbers them)."""
    cols: dict[str, Any] = {c: act[c].to_numpy(t) if t is not None else act[c].to_numpy()
                            for c, t in _STEP_COLUMNS.items()}
    cols["name"], cols["cls"] = act["name"], act["cls"]
    return cols


def _step_arrays(act: pd.DataFrame) -> tuple[StepGraph, float, float] | None:
    """:func:`_step_graph` on whole columns: the same nodes in the same numbering, the same edges in the
    same order. None where a start or end time is not finite (:func:`_step_graph` builds those)."""
    return _step_arrays_of(_step_columns(act.sort_values(["rank", "ts", "end"], kind="stable")))


def _step_arrays_of(col: dict[str, Any]) -> tuple[StepGraph, float, float] | None:
    """:func:`_step_arrays` of one step's columns (:func:`_step_columns`), rows sorted by rank, start, end."""
    ts, end, stream = col["ts"], col["end"], col["stream"]
    if not (np.isfinite(ts).all() and np.isfinite(end).all()) or stream.dtype.kind not in "iu":
        return None
    t0, t1 = float(ts.min()), float(end.max())
    n = len(ts)
    rank, inst = col["rank"], col["instance"]
    launch, launch_end = col["launch"], col["launch_end"]
    name, names = pd.factorize(col["name"], use_na_sentinel=False)
    acls, acls_names = pd.factorize(col["cls"], use_na_sentinel=False)
    k = len(names)
    names_s = [str(x) for x in names]
    labels = [*names_s, *(f"idle before {x}" for x in names_s), *(f"host before {x}" for x in names_s),
              "step start", "step end"]
    cls_names = [*_FIXED_CLS, *(str(x) for x in acls_names)]
    bounds = np.flatnonzero(np.r_[True, np.diff(rank) != 0, True])
    lo_of = np.repeat(bounds[:-1], np.diff(bounds))  # each row's rank's first row
    # the rank's GPU timeline: predecessor, and idle and host time before each activity
    best = np.empty(n, dtype=np.int64)
    run_end = np.empty(n, dtype=np.float64)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        b = _timeline(ts[lo:hi], end[lo:hi])
        best[lo:hi] = np.where(b >= 0, b + lo, -1)
        run_end[lo:hi] = np.r_[-np.inf, np.maximum.accumulate(end[lo:hi])[:-1]]
    idle_from = np.where(t0 > run_end, t0, run_end)
    gap = ts - idle_from
    part = launch_end - idle_from
    part = np.where(part < 0.0, 0.0, part)
    part = np.where(gap < part, gap, part)
    with np.errstate(invalid="ignore"):
        late = launch >= idle_from
    host = np.where(~(gap > 0) | ~np.isfinite(launch), 0.0,
                    np.where(late, gap, np.where(np.isfinite(launch_end), part, 0.0)))
    idle = np.where(gap > IDLE_MIN_US, gap - host, 0.0)
    has_idle, has_host = idle > 0, host > 0
    # node numbering: per rank, its activities (a matched collective: its wait node, then the instance's
    # node where the instance is new), then its idle and host nodes in order
    is_comm = inst >= 0
    ci = np.flatnonzero(is_comm)
    uinst, first_i, inv = np.unique(inst[ci], return_index=True, return_inverse=True)
    new_comm = np.zeros(n, dtype=np.int64)
    new_comm[ci[first_i]] = 1
    a_cnt = 1 + new_comm
    h_cnt = has_idle.astype(np.int64) + has_host
    a_cs, h_cs = _excl_cumsum(a_cnt), _excl_cumsum(h_cnt)
    a_in, h_in = a_cs - a_cs[lo_of], h_cs - h_cs[lo_of]  # within the rank
    per_rank = np.add.reduceat(a_cnt + h_cnt, bounds[:-1]) if n else np.zeros(0, dtype=np.int64)
    a_tot = np.add.reduceat(a_cnt, bounds[:-1]) if n else np.zeros(0, dtype=np.int64)
    rix = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    base = (1 + _excl_cumsum(per_rank))[rix]
    n_in = base + a_in
    xnode = n_in[ci[first_i]] + 1
    n_out = n_in.copy()
    n_out[ci] = xnode[inv]
    hnode = base + a_tot[rix] + h_in
    idle_node = hnode
    host_node = hnode + has_idle
    nn = 2 + int(per_rank.sum())
    sink = nn - 1
    weight = np.zeros(nn, dtype=np.float64)
    cls = np.empty(nn, dtype=np.int64)
    nrank = np.full(nn, -1, dtype=np.int64)
    label = np.empty(nn, dtype=np.int64)
    cls[0], label[0], cls[sink], label[sink] = _START, 3 * k, _END, 3 * k + 1
    w_act = np.where(is_comm, col["residual_wait"], col["dur"])
    weight[n_in] = np.where(w_act < 0, 0.0, w_act)
    cls[n_in] = np.where(is_comm, _WAIT, acls + len(_FIXED_CLS))
    nrank[n_in] = rank
    label[n_in] = name
    xr = ci[first_i]
    w_x = col["transfer_us"][xr]
    weight[xnode] = np.where(w_x < 0, 0.0, w_x)
    cls[xnode] = _COMM
    label[xnode] = name[xr]
    for has, node, w, c, off in ((has_idle, idle_node, idle, _IDLE, k), (has_host, host_node, host, _HOST, 2 * k)):
        weight[node[has]] = w[has]
        cls[node[has]] = c
        nrank[node[has]] = rank[has]
        label[node[has]] = name[has] + off
    # edges, per rank: wait -> instance; stream order; the timeline (pred -> idle -> host -> activity)
    rows = np.arange(n)
    so = np.lexsort((rows, stream, rank))
    same = (rank[so][1:] == rank[so][:-1]) & (stream[so][1:] == stream[so][:-1])
    s_prev, s_row = so[:-1][same], so[1:][same]
    pred = np.where(best >= 0, n_out[np.maximum(best, 0)], 0)
    first_to = np.where(has_idle, idle_node, np.where(has_host, host_node, n_in))
    ih, hh = has_idle & has_host, has_idle & ~has_host
    parts = [  # (section, row, sub, u, v)
        (0, ci, 0, n_in[ci], n_out[ci]),
        (1, s_row, 0, n_out[s_prev], n_in[s_row]),
        (2, rows, 0, pred, first_to),
        (2, rows[ih], 1, idle_node[ih], host_node[ih]),
        (2, rows[hh], 1, idle_node[hh], n_in[hh]),
        (2, rows[has_host], 2, host_node[has_host], n_in[has_host]),
    ]
    key = np.concatenate([(rix[r] * 3 + sec) * (3 * n) + r * 3 + sub for sec, r, sub, _, _ in parts])
    u = np.concatenate([p[3] for p in parts])
    v = np.concatenate([p[4] for p in parts])
    o = np.argsort(key, kind="stable")
    u, v = u[o], v[o]
    keep = u != v
    G = StepGraph(weight, cls, cls_names, nrank, label, labels, u[keep], v[keep], 0, sink)
    return G, t0, t1


def _sums(groups: np.ndarray, n: int, w: np.ndarray) -> list[float]:
    """Per group 0..n-1: the sum of its weights, added in element order (as a running sum would)."""
    return np.bincount(groups, weights=w, minlength=n).tolist() if len(groups) else [0.0] * n


def _path_summary(G: StepGraph, path: list[int], t0: float, t1: float) -> dict[str, Any]:
    """Composition of a path: time per class and per rank, and its runs of one rank and class (the path's
    nodes of positive weight, in order; the sink is not counted)."""
    ix = np.asarray(path[:-1], dtype=np.int64)
    w = G.weight[ix]
    on = ~(w <= 0)  # (a NaN weight counts, as it would in a running sum)
    canon: dict[str, int] = {}  # one code per class name (a kernel class may share a fixed class's name)
    to_canon = np.array([canon.setdefault(c, len(canon)) for c in G.cls_names], dtype=np.int64)
    names = list(canon)
    w, cls, rank, lab = w[on], to_canon[G.cls[ix][on]], G.rank[ix][on], G.label[ix][on]
    ci, first = groups(cls)  # (numbered in order of first appearance: the dicts' key order)
    comp = dict(zip((names[c] for c in cls[first].tolist()), _sums(ci, len(first), w), strict=True))
    ranked = rank >= 0
    rr, rc, rw = rank[ranked], cls[ranked], w[ranked]
    ri, first = groups(rr)
    by_rank = dict(zip(rr[first].tolist(), _sums(ri, len(first), rw), strict=True))
    host = np.nonzero(rc == canon["host"])[0] if "host" in canon else np.zeros(0, dtype=np.int64)
    hi, first = groups(rr[host])
    host_by_rank = dict(zip(rr[host][first].tolist(), _sums(hi, len(first), rw[host]), strict=True))
    cls_by_rank: dict[int, dict[str, float]] = {r: {} for r in by_rank}
    pi, first = groups(rr, rc)
    for r, c, v in zip(rr[first].tolist(), rc[first].tolist(), _sums(pi, len(first), rw), strict=True):
        cls_by_rank[r][names[c]] = v
    # runs of one rank and class
    new = np.ones(len(w), dtype=bool)
    new[1:] = (rank[1:] != rank[:-1]) | (cls[1:] != cls[:-1])
    run = np.cumsum(new) - 1
    heads = np.nonzero(new)[0]
    us = _sums(run, len(heads), w)
    count = np.bincount(run, minlength=len(heads)).tolist() if len(run) else []
    segs = _Segments(rank[heads], cls[heads], us, count, lab[heads], names, G.labels)
    total = float(sum(comp.values()))
    bounding = max(by_rank, key=by_rank.get) if by_rank else None  # type: ignore[arg-type]
    every = G.rank[np.asarray(path, dtype=np.int64)]
    every = every[every >= 0]
    ends_on = int(every[-1]) if len(every) else None
    return {
        "total_us": total, "span_us": t1 - t0, "slack_us": max((t1 - t0) - total, 0.0),
        "composition": comp, "by_rank": by_rank, "host_by_rank": host_by_rank,
        "cls_by_rank": cls_by_rank,
        "bounding_rank": bounding, "ends_on_rank": ends_on, "nodes": len(path) - 2, "segments": segs,
    }


class _Segments:
    """A path's runs of one rank and class, as columns; :meth:`top` makes the records of the longest."""

    __slots__ = ("cls", "count", "first", "labels", "names", "rank", "us")

    def __init__(self, rank: np.ndarray, cls: np.ndarray, us: list[float], count: list[int], first: np.ndarray,
                 names: list[str], labels: list[str]) -> None:
        self.rank, self.cls, self.us, self.count, self.first = rank, cls, us, count, first
        self.names, self.labels = names, labels

    def top(self, n: int) -> list[dict[str, Any]]:
        """The ``n`` runs of most time (ties in path order), as records."""
        us = self.us
        keep = sorted(range(len(us)), key=lambda i: -us[i])[:n]
        return [{"rank": None if int(self.rank[i]) < 0 else int(self.rank[i]), "cls": self.names[int(self.cls[i])],
                 "us": us[i], "nodes": self.count[i], "first": self.labels[int(self.first[i])]} for i in keep]


def _jsonify_path(s: dict[str, Any], top: int = 12) -> dict[str, Any]:
    total = s["total_us"] or 1.0
    segs = s["segments"].top(top)
    return {
        "pos": s["pos"], "total_us": json_num(s["total_us"]), "span_us": json_num(s["span_us"]),
        "slack_us": json_num(s["slack_us"]), "nodes": s["nodes"],
        "composition": {c: {"us": json_num(v), "share": json_num(v / total)}
                        for c, v in sorted(s["composition"].items(), key=lambda kv: -kv[1])},
        "by_rank": {str(r): {"us": json_num(v), "share": json_num(v / total),
                             "classes": {c: json_num(x) for c, x in sorted(s["cls_by_rank"][r].items(),
                                                                        key=lambda kv: -kv[1])}}
                    for r, v in sorted(s["by_rank"].items())},
        "host_by_rank": {str(r): json_num(v) for r, v in sorted(s["host_by_rank"].items())},
        "bounding_rank": s["bounding_rank"], "ends_on_rank": s["ends_on_rank"],
        "top_segments": [{"rank": x["rank"], "cls": x["cls"], "us": json_num(x["us"]), "kernels": x["nodes"],
                          "first": x["first"]} for x in segs],
    }


def _step_summaries(act: pd.DataFrame) -> tuple[list[dict[str, Any]], int]:
    """The longest path of each step of ``act`` (:func:`_activities`) summarised (:func:`_path_summary`,
    with its ``pos``), in step order, and how many steps had a cycle instead."""
    # every step's rows at once, sorted as each step's graph reads them (by step, then rank, start, end)
    act = act.sort_values(["pos", "rank", "ts", "end"], kind="stable")
    cols = _step_columns(act)
    at = act["pos"].to_numpy()
    cuts = np.flatnonzero(np.r_[True, at[1:] != at[:-1], True]).tolist() if len(at) else [0]
    summaries, failed = [], 0
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        built = _step_arrays_of({c: (v.iloc[lo:hi] if isinstance(v, pd.Series) else v[lo:hi])
                                 for c, v in cols.items()})
        if built is None:
            G0, src, sink, t0, t1 = _step_graph(act.iloc[lo:hi])
            G = G0.arrays(src, sink)
        else:
            G, t0, t1 = built
        src = G.source
        try:
            path = G.longest_path()
        except Cycle:
            failed += 1  # collectives matched in inconsistent orders would form a cycle
            continue
        if not path or path[0] != src:
            path = [src, *path]
        s = _path_summary(G, path, t0, t1)
        s["pos"] = int(at[lo])
        summaries.append(s)
    return summaries, failed


def critical_path(a: Analysis, sel: pd.DataFrame, res: Collectives) -> dict[str, Any]:
    """Longest path through each aligned step's cross-rank dependency graph; the median
    step in detail and the composition averaged over the steps (all of them, or an even sample of
    ``critical_path.max_steps`` of rules/tables/collectives.yaml; see docs/collectives.md)."""
    if not len(sel):
        return {"applicable": False, "reason": "no analysed steps common to all ranks"}
    # the positions of the steps with GPU activity
    positions = sorted(sel.loc[sel.index.isin(a.kernels["step"].to_numpy()), "pos"].astype(np.int64).unique())
    if not positions:
        return {"applicable": False, "reason": "no GPU activity in the analysed steps"}
    # the longest path is computed on at most max_steps evenly spaced steps
    max_steps = load_settings().critical_path_max_steps
    if len(positions) > max_steps:
        keep = np.unique(np.linspace(0, len(positions) - 1, max_steps).round().astype(int))
        positions = [positions[i] for i in keep]
    summaries, failed = _step_summaries(_activities(a, sel, res, positions))
    if not summaries:
        return {"applicable": False, "reason": "the dependency graph of every step has a cycle "
                "(collectives matched in inconsistent orders)"}
    n = len(summaries)
    totals = np.array([s["total_us"] for s in summaries])
    med_i = int(np.argsort(totals, kind="stable")[(n - 1) // 2])
    comp: dict[str, float] = defaultdict(float)
    by_rank: dict[int, float] = defaultdict(float)
    host_by_rank: dict[int, float] = defaultdict(float)
    bounds: dict[int, int] = defaultdict(int)
    for s in summaries:
        for c, v in s["composition"].items():
            comp[c] += v
        for r, v in s["by_rank"].items():
            by_rank[r] += v
        for r, v in s["host_by_rank"].items():
            host_by_rank[r] += v
        if s["bounding_rank"] is not None:
            bounds[s["bounding_rank"]] += 1
    grand = float(sum(comp.values())) or 1.0
    host_total = sum(host_by_rank.values())
    out: dict[str, Any] = {
        "applicable": True, "reason": None,
        "steps": n, "steps_failed": failed, "steps_available": int(sel["pos"].nunique()),
        "clock_corrected": any(v != 0.0 for v in res.offsets_applied.values()),
        "total_us_median": json_num(float(np.median(totals))),
        "composition": {c: {"us_per_step": json_num(v / n), "share": json_num(v / grand)}
                        for c, v in sorted(comp.items(), key=lambda kv: -kv[1])},
        "by_rank": {str(r): {"us_per_step": json_num(v / n), "share": json_num(v / grand)}
                    for r, v in sorted(by_rank.items())},
        "host_by_rank": {str(r): {"us_per_step": json_num(v / n), "share_of_host": json_num(v / host_total if host_total
                                                                                        else float("nan"))}
                         for r, v in sorted(host_by_rank.items())},
        "bounding_rank": max(bounds, key=bounds.get) if bounds else None,
        "bounding_rank_steps": {str(r): c for r, c in sorted(bounds.items())},
        "median_step": _jsonify_path(summaries[med_i]),
    }
    return out
