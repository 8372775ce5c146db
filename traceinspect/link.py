"""Stage 2, link: kernel -> launching runtime event (``correlation``) -> enclosing CPU op.

Inputs: a :class:`~traceinspect.model.TraceSet` (or one rank's parsed tables) not yet linked.
Outputs: the same tables, each kernel's launching runtime call (``rt_idx``) and CPU op (``op_idx``) set.

Kernels replayed from a CUDA graph share the correlation id of their ``cudaGraphLaunch``; they
are kept, marked ``graph_replay`` and get no CPU op (the op that was running at capture time is
not the one running now).

Everything here is vectorised: the enclosing-op searches run as a few rounds of pointer jumping
over whole columns instead of a Python loop per event, so linking costs O(n log n) in numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from traceinspect.load import duplicate_warning
from traceinspect.load.columns import take_name_codes
from traceinspect.load.native import native_available, native_module
from traceinspect.load.parse import ParsedRank
from traceinspect.model import TraceSet
from traceinspect.tables import dense_codes, factorize_text, in_key_order, string_column

GRAPH_LAUNCH = {"cudaGraphLaunch", "cudaGraphLaunch_v10000", "cuGraphLaunch", "hipGraphLaunch"}
_MAX_PATH = 64  # names kept in an op_path (innermost ones)
_MAX_THREAD_LOOP = 512  # threads searched one by one; more: one merge sort of ops and events


def _thread_key(df: pd.DataFrame) -> np.ndarray:
    key = df["rank"].to_numpy().astype(np.int64) << 32
    key ^= df["tid"].to_numpy().astype(np.int64, copy=False)
    return key


def _sort_ops(key: np.ndarray, ts: np.ndarray, dur: np.ndarray) -> np.ndarray | None:
    """Row order by (thread key, ts, -dur), ties kept in row order: two stable sorts, which are nearly
    linear on the time-ordered rows of a trace, then longest-first within the rare equal starts. None:
    the rows are in that order (one thread's ops in time order, as the loader leaves them)."""
    order = None
    if not in_key_order(key, ts):
        order = np.argsort(ts, kind="stable")
        order = order[np.argsort(key[order], kind="stable")]
    s, k = (ts, key) if order is None else (ts[order], key[order])
    tie = (s[1:] == s[:-1]) & (k[1:] == k[:-1])
    if tie.any():
        order = np.arange(len(ts)) if order is None else order
        run = np.cumsum(np.concatenate([[True], ~tie])) - 1
        idx = np.nonzero(np.concatenate([tie, [False]]) | np.concatenate([[False], tie]))[0]
        sub = np.lexsort((-dur[order[idx]], run[idx]))
        order[idx] = order[idx][sub]
    return order


def _nest_parents(key: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    """For ops sorted per thread by (ts, -dur): the position of each op's innermost enclosing op, or -1
    (see :class:`_OpTree`); one stack walk in the native module, else pointer jumping in numpy."""
    key = np.ascontiguousarray(key, dtype=np.int64)
    ts = np.ascontiguousarray(ts, dtype=np.float64)
    end = np.ascontiguousarray(end, dtype=np.float64)
    native = native_module() if native_available() else None
    if native is not None and hasattr(native, "nest_parents"):
        return np.frombuffer(native.nest_parents(key, ts, end), dtype=np.int64)
    return _nest_parents_numpy(key, ts, end)


def _nest_parents_numpy(key: np.ndarray, ts: np.ndarray, end: np.ndarray) -> np.ndarray:
    n = len(key)
    cand = np.arange(-1, n - 1, dtype=np.int64)
    if n:
        cand[1:][key[1:] != key[:-1]] = -1
    par = np.full(n, -2, dtype=np.int64)  # -2: not yet known
    active = np.arange(n, dtype=np.int64)
    while active.size:
        c = cand[active]
        root = c < 0
        par[active[root]] = -1
        active, c = active[~root], c[~root]
        hit = end[c] >= ts[active]
        par[active[hit]] = c[hit]
        active, c = active[~hit], c[~hit]
        pc = par[c]
        cand[active] = np.where(pc != -2, pc, cand[c])
    return par


class _OpTree:
    """CPU ops sorted per thread by (ts, -dur), with each op's innermost enclosing op.

    In that order, the op enclosing op ``i`` is the nearest earlier op of the same thread whose end
    is not before ``i``'s start (what a stack walk over the sorted ops finds). If a candidate ``c``
    ends too early, every op between ``c``'s own parent and ``c`` ended even earlier, so the search
    may jump straight to that parent (or to ``c``'s current candidate while ``c`` is unresolved).
    """

    def __init__(self, ops: pd.DataFrame) -> None:
        key = _thread_key(ops)
        ts = ops["ts"].to_numpy()
        self.order = _sort_ops(key, ts, ops["dur"].to_numpy())  # None: the rows' own order
        end = ops["end"].to_numpy()
        self.key, self.ts, self.end = (key, ts, end) if self.order is None else \
            (key[self.order], ts[self.order], end[self.order])
        self.parent_sorted = _nest_parents(self.key, self.ts, self.end)

    def parents(self) -> np.ndarray:
        """Row of the innermost enclosing op on the same thread, or -1, in the table's row order."""
        p = self.parent_sorted
        if self.order is None:
            return np.where(p >= 0, p, -1)
        out = np.full(len(self.order), -1, dtype=np.int64)
        out[self.order] = np.where(p >= 0, self.order[np.maximum(p, 0)], -1)
        return out

    def _last_started(self, key: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """For events (thread key, ts): the last sorted position of an op of that thread starting at or
        before ``ts``, or -1."""
        m, n = len(ts), len(self.key)
        start = np.concatenate([[0], np.nonzero(self.key[1:] != self.key[:-1])[0] + 1])  # a run per thread
        uk = self.key[start]
        if len(uk) <= _MAX_THREAD_LOOP:
            stop = np.append(start[1:], n).tolist()
            g = np.searchsorted(uk, key)
            found = (g < len(uk)) & (uk[np.minimum(g, len(uk) - 1)] == key)
            cand = np.full(m, -1, dtype=np.int64)
            by_g = np.argsort(np.where(found, g, len(uk)), kind="stable")
            bounds = np.searchsorted(np.where(found, g, len(uk))[by_g], np.arange(len(uk) + 1)).tolist()
            for j, (lo, hi) in enumerate(zip(start.tolist(), stop, strict=True)):
                ev = by_g[bounds[j]:bounds[j + 1]]
                if len(ev):  # an op starting at ts counts
                    cand[ev] = lo + np.searchsorted(self.ts[lo:hi], ts[ev], side="right") - 1
            cand[cand < np.append(start, n)[np.minimum(g, len(uk))]] = -1  # no op of the thread before ts
            return cand
        # merge ops and events; at equal (thread, ts) ops come first
        k = np.concatenate([self.key, key])
        t = np.concatenate([self.ts, ts])
        is_ev = np.concatenate([np.zeros(n, dtype=np.int8), np.ones(m, dtype=np.int8)])
        pos = np.concatenate([np.arange(n, dtype=np.int64), np.full(m, -1, dtype=np.int64)])
        merged = np.lexsort((np.arange(n + m), is_ev, t, k))
        last_op = np.maximum.accumulate(pos[merged])
        ev_rows = merged >= n
        cand = np.empty(m, dtype=np.int64)
        cand[merged[ev_rows] - n] = last_op[ev_rows]
        ok = cand >= 0
        ok[ok] = self.key[cand[ok]] == key[ok]
        cand[~ok] = -1
        return cand

    def enclosing(self, key: np.ndarray, ts: np.ndarray) -> np.ndarray:
        """For events (thread key, ts): the row of the innermost op containing ``ts``, or -1."""
        m, n = len(ts), len(self.key)
        out = np.full(m, -1, dtype=np.int64)
        if not m or not n:
            return out
        cand = self._last_started(key, ts)
        active = np.nonzero(cand >= 0)[0]
        while active.size:
            c = cand[active]
            miss = self.end[c] < ts[active]
            active, c = active[miss], c[miss]
            cand[active] = self.parent_sorted[c]
            active = active[cand[active] >= 0]
        return np.where(cand >= 0, cand if self.order is None else self.order[np.maximum(cand, 0)], -1)


def _lookup(table: pd.DataFrame, id_col: str, queries: pd.DataFrame, query_col: str,
            keep: str = "first") -> tuple[np.ndarray, int]:
    """Row of ``table`` with the same (rank, id) as each query row, or -1; and the number of
    duplicated (rank, id) pairs in ``table`` (``keep`` says which one is used)."""
    ids = table[id_col].to_numpy()
    ranks = table["rank"].to_numpy()
    valid = ids >= 0
    if valid.all():
        sel = np.arange(len(ids))
    else:
        sel = np.nonzero(valid)[0]
        ranks, ids = ranks[sel], ids[sel]
    qr, qi = queries["rank"].to_numpy(), queries[query_col].to_numpy()
    if len(sel) and ranks[0] == ranks[-1] and (ranks == ranks[0]).all() and (ids[1:] >= ids[:-1]).all():
        # one rank (as where each rank is linked on its own)
        return _sorted_lookup(ids, sel, np.where((qi >= 0) & (qr == ranks[0]), qi, -1), keep)
    if len(sel) and ids.max() < (1 << 43) and ranks.max() < (1 << 19) and ranks.min() >= 0:
        keys = (ranks.astype(np.int64) << 43) | ids
        qkeys = np.where((qi >= 0) & (qi < (1 << 43)), (qr.astype(np.int64) << 43) | np.maximum(qi, 0), -1)
        if (keys[1:] >= keys[:-1]).all():  # ids in row order (Kineto numbers them so): a binary search
            return _sorted_lookup(keys, sel, qkeys, keep)
        index = pd.Index(keys)
    else:
        index = pd.MultiIndex.from_arrays([ranks, ids])
        qkeys = pd.MultiIndex.from_arrays([qr, qi])
    dup = index.duplicated(keep=keep)
    n_dup = int(dup.sum())
    if n_dup:
        index, sel = index[~dup], sel[~dup]
    pos = index.get_indexer(qkeys)
    return np.where(pos >= 0, sel[np.maximum(pos, 0)] if len(sel) else -1, -1).astype(np.int64), n_dup


def _sorted_lookup(keys: np.ndarray, sel: np.ndarray, qkeys: np.ndarray, keep: str) -> tuple[np.ndarray, int]:
    """:func:`_lookup` on non-decreasing ``keys`` (>= 0; a query key < 0 finds nothing)."""
    n_dup = int((keys[1:] == keys[:-1]).sum())
    if keep == "first":
        pos = np.searchsorted(keys, qkeys, side="left")
    else:
        pos = np.searchsorted(keys, qkeys, side="right") - 1
    pos = np.clip(pos, 0, len(keys) - 1)
    hit = keys[pos] == qkeys
    return np.where(hit, sel[pos], -1).astype(np.int64), n_dup


def link(ts: TraceSet) -> TraceSet:
    """Add link columns to ``kernels`` (rt_idx, rt_name, graph_replay, op_idx, op_name, op_path)
    and ``parent`` to ``cpu_ops`` (nothing to do when the loader already linked the ranks)."""
    if ts.linked:
        return ts
    n_dup = link_tables(ts.kernels, ts.runtime, ts.cpu_ops)
    if n_dup:
        ts.warnings.append(duplicate_warning(n_dup))
    ts.linked = True
    return ts


def link_parsed(p: ParsedRank) -> None:
    """Link one rank's tables where they were parsed (the loader's ``prepare``: the work is per rank, so it
    runs in the parse worker; see :func:`link_tables`)."""
    tables = (p.kernels, p.runtime, p.cpu_ops)
    for t in tables:
        t["rank"] = 0
    op_names = take_name_codes(p, "cpu_ops") or factorize_text(p.cpu_ops["name"].to_numpy(dtype=object))
    p.link_dups = link_tables(*tables, rt_names=take_name_codes(p, "runtime"), op_names=op_names)
    p.op_name_codes = op_names  # type: ignore[attr-defined]  # not a field: neither cached nor compared
    for t in tables:
        del t["rank"]
    # kernel names as a categorical (made here, in the parse worker): the analysis groups and filters
    # the kernel table by name many times
    names = take_name_codes(p, "kernels") or factorize_text(p.kernels["name"].to_numpy(dtype=object))
    p.kernels["name"] = string_column(*names)
    p.linked = True


def link_tables(k: pd.DataFrame, rt: pd.DataFrame, ops: pd.DataFrame, *,
                rt_names: tuple[np.ndarray, np.ndarray] | None = None,
                op_names: tuple[np.ndarray, np.ndarray] | None = None) -> int:
    """:func:`link` on bare tables (with a ``rank`` column), in place; returns the number of runtime
    events that reuse a (rank, correlation) pair. Rows only ever link within their rank, so linking
    each rank's tables on its own and stacking them (offsetting the row columns) gives the same result
    as linking the stacked tables. ``rt_names``, ``op_names``: the name columns as (codes, uniques), when
    already known (:func:`~traceinspect.load.columns.take_name_codes`)."""
    tree = _OpTree(ops)
    ops["parent"] = tree.parents()

    # runtime row per (rank, correlation); duplicated ids keep the first and are reported
    rt_idx, n_dup = _lookup(rt, "correlation", k, "correlation", keep="first")
    k["rt_idx"] = rt_idx
    rt_names = rt_names or factorize_text(rt["name"].to_numpy(dtype=object))
    k["rt_name"] = _names_at(rt_idx, rt_names)
    replay = np.zeros(len(k), dtype=bool)
    if len(rt):
        is_launch = np.isin(rt_names[1], list(GRAPH_LAUNCH))[rt_names[0]]
        replay = (rt_idx >= 0) & is_launch[np.maximum(rt_idx, 0)]
    k["graph_replay"] = replay

    # runtime event -> CPU op: External id when Kineto wrote it, else the innermost op on the thread
    rt_op = np.full(len(rt), -1, dtype=np.int64)
    if len(rt) and len(ops):
        via_ext, _ = _lookup(ops, "external_id", rt, "external_id", keep="last")
        # an External id only counts when that op really encloses the launch
        ok = via_ext >= 0
        rts = rt["ts"].to_numpy()
        ok[ok] = (ops["ts"].to_numpy()[via_ext[ok]] <= rts[ok]) & (ops["end"].to_numpy()[via_ext[ok]] >= rts[ok])
        rt_op = np.where(ok, via_ext, -1)
        missing = np.nonzero(rt_op < 0)[0]
        if len(missing):
            rt_op[missing] = tree.enclosing(_thread_key(rt)[missing], rts[missing])
    op_idx = np.where((rt_idx >= 0) & ~k["graph_replay"].to_numpy(), rt_op[np.maximum(rt_idx, 0)] if len(rt)
                      else -1, -1)
    k["op_idx"] = op_idx.astype(np.int64)
    op_names = op_names or factorize_text(ops["name"].to_numpy(dtype=object))
    k["op_name"] = _names_at(op_idx, op_names)
    k["op_path"] = _paths(op_idx, ops, op_names)
    return n_dup


def _names_at(idx: np.ndarray, names: tuple[np.ndarray, np.ndarray]) -> Any:
    """Column of ``names[idx]``, '' where idx < 0; ``names`` as (codes, uniques) of
    :func:`~traceinspect.tables.factorize_text`. Its categories are only the names taken."""
    codes, uniq = names
    ok = idx >= 0
    if not len(codes) or not ok.any():
        return string_column(np.zeros(len(idx), dtype=np.int64), np.array([""], dtype=object))
    taken, used = dense_codes(codes[idx[ok]], len(uniq))  # the names taken, in code order
    full = np.zeros(len(idx), dtype=np.int64)
    full[ok] = taken + 1
    return string_column(full, np.concatenate([np.array([""], dtype=object), np.asarray(uniq, dtype=object)[used]]))


def _paths(op_idx: np.ndarray, ops: pd.DataFrame, names: tuple[np.ndarray, np.ndarray] | None = None) -> Any:
    """Names of the enclosing ops, outermost first, joined by ' > ' (at most the innermost 64).

    Paths are built level by level: an op's path is its parent's path plus its name, so each distinct
    path string is made once, however many ops (and kernels) share it. ``names``: the ops' names as
    (codes, uniques) of :func:`~traceinspect.tables.factorize_text`, when already made.
    """
    n = len(op_idx)
    if not len(ops) or not n or not (op_idx >= 0).any():
        return string_column(np.zeros(n, dtype=np.int64), np.array([""], dtype=object))
    parent = ops["parent"].to_numpy()
    name_codes, name_uniq = names if names is not None else factorize_text(ops["name"].to_numpy(dtype=object))
    # the ops on the kernels' chains
    mark = np.zeros(len(parent), dtype=bool)
    mark[op_idx[op_idx >= 0]] = True
    frontier = np.nonzero(mark)[0]
    while frontier.size:
        mark[frontier] = True
        up = parent[frontier]
        up = up[up >= 0]
        frontier = pd.unique(up[~mark[up]])
    ops_all = np.nonzero(mark)[0]
    d = np.zeros(len(ops_all), dtype=np.int64)  # depth: number of enclosing ops
    at, cur = np.arange(len(ops_all)), parent[ops_all]
    while at.size:  # climb from the ops whose chain goes on
        live = cur >= 0
        at, cur = at[live], cur[live]
        d[at] += 1
        cur = parent[cur]
    path_id = np.full(len(parent), -1, dtype=np.int64)
    pid_parent: list[int] = []  # per path id: the enclosing path's id (-1: none) and the name
    pid_name: list[int] = []
    texts: list[str] = []
    m = len(name_uniq) + 1
    # a stable sort of small integers is a radix sort
    by_depth = ops_all[np.argsort(d.astype(np.int16) if d.max() < (1 << 15) else d, kind="stable")]
    bounds = np.cumsum(np.bincount(d)).tolist()
    for lvl in range(len(bounds)):
        rows = by_depth[bounds[lvl - 1] if lvl else 0:bounds[lvl]]
        up = parent[rows]
        pp = np.where(up >= 0, path_id[np.maximum(up, 0)], -1)
        inv, uniq_pairs = dense_codes((pp + 1) * m + name_codes[rows], (len(texts) + 1) * m)
        path_id[rows] = len(texts) + inv
        for q, c in zip((uniq_pairs // m - 1).tolist(), (uniq_pairs % m).tolist(), strict=True):
            pid_parent.append(q)
            pid_name.append(c)
            if q < 0:
                texts.append(name_uniq[c])
            elif lvl < _MAX_PATH:
                texts.append(texts[q] + " > " + name_uniq[c])
            else:  # only the innermost names
                chain, j = [], len(pid_parent) - 1
                while j >= 0 and len(chain) < _MAX_PATH:
                    chain.append(name_uniq[pid_name[j]])
                    j = pid_parent[j]
                texts.append(" > ".join(reversed(chain)))
    codes = np.where(op_idx >= 0, path_id[np.maximum(op_idx, 0)] + 1, 0)
    return string_column(codes, np.concatenate([np.array([""], dtype=object), np.asarray(texts, dtype=object)]))
