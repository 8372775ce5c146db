"""The KV rows a decode step reads: the row count of the ops that gather rows out of a pool-shaped
tensor, from recorded shapes (eager) or the CUDA-graph capture trace (graph replays)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traceinspect.tables import per_distinct, text_values

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

GATHER_OP = re.compile(r"^aten::(index_select|index|gather|take|embedding)$")


def _pool_rows(a: Analysis) -> tuple[float | None, str]:
    rm = getattr(a, "run_model", None)
    v = rm.value("kv_pool_tokens") if rm is not None else None
    if v is not None:
        return float(v), f"kv_pool_tokens ({rm.describe('kv_pool_tokens')})"
    k = a.kernels
    casts = k[text_values(k["cls"]) == "kv_cast"] if len(k) else k
    ops = a.trace.cpu_ops
    rows = []
    for oi in casts["op_idx"].to_numpy()[:64] if len(casts) else []:
        if oi >= 0:
            d = _dims(ops["input_dims"].iloc[int(oi)])
            if d and len(d[0]) >= 2:
                rows.append(d[0][0])
    if rows:
        return float(np.median(rows)), "rows of the tensor the KV cast reads"
    return None, "KV pool size unknown (run model: no server_info max_total_num_tokens, no pool in the shapes) and no recorded shapes of the KV cast"


def _dims(raw: object) -> list[list[int]]:
    if raw is None:
        return []
    try:
        val = json.loads(raw)
    except (TypeError, ValueError):
        return []
    return [x for x in val if isinstance(x, list) and all(isinstance(y, int) for y in x)] if isinstance(val, list) \
        else []


def _active_in(ops: pd.DataFrame, pool: float) -> list[int]:
    out: list[int] = []
    if not len(ops):
        return out
    ops = ops[per_distinct(ops["name"], lambda nm: bool(GATHER_OP.match(str(nm))))]
    seen: dict[object, list[int] | None] = {}
    for raw in ops["input_dims"].to_numpy(dtype=object):
        if raw in seen:
            if seen[raw] is not None:
                out.append(seen[raw][0])  # type: ignore[index]
            continue
        seen[raw] = None
        d = _dims(raw)
        # the pool tensor: its rows are the pool's, give or take padding rows (SGLang allocates one extra)
        if not d or len(d[0]) < 2 or abs(d[0][0] - pool) > max(16.0, 1e-3 * pool):
            continue
        later = [x[0] for x in d[1:] if x and 0 < x[0] < 0.99 * pool]
        if later:
            seen[raw] = later
            out.append(later[0])
    return out


def _inside_steps(ops: pd.DataFrame, sel: pd.DataFrame) -> np.ndarray:
    """Which CPU ops start inside the CPU span of one of the ``sel`` steps of their rank (bounds included):
    per rank, each step's span is a range of the rank's ops sorted by start."""
    o_rank, o_ts = ops["rank"].to_numpy(), ops["ts"].to_numpy(dtype=np.float64)
    inside = np.zeros(len(ops), dtype=bool)
    s_rank = sel["rank"].to_numpy()
    s_lo, s_hi = sel["cpu_start"].to_numpy(dtype=np.float64), sel["cpu_end"].to_numpy(dtype=np.float64)
    ok = np.isfinite(s_lo) & np.isfinite(s_hi) & (s_lo <= s_hi)
    for r in np.unique(s_rank[ok]).tolist():
        rows = np.flatnonzero(o_rank == r)
        rows = rows[np.argsort(o_ts[rows], kind="stable")]  # NaN starts sort last and fall in no span
        ts = o_ts[rows]
        m = ok & (s_rank == r)
        lo = np.searchsorted(ts, s_lo[m], side="left")
        hi = np.searchsorted(ts, s_hi[m], side="right")
        cover = np.zeros(len(rows) + 1, dtype=np.int64)
        np.add.at(cover, lo, 1)
        np.add.at(cover, hi, -1)
        inside[rows[np.cumsum(cover[:-1]) > 0]] = True
    return inside


def active_kv_rows(a: Analysis, steps: pd.DataFrame | None = None) -> tuple[float | None, float | None, str]:
    """(active rows per step, pool rows, source or the reason it cannot be decided), from the ``steps``
    rows (default: the analysed steps)."""
    pool, psrc = _pool_rows(a)
    if pool is None:
        return None, None, psrc
    sel = a.selected if steps is None else steps
    ops = a.trace.cpu_ops
    found: list[int] = []
    src = ""
    if len(ops) and len(sel):
        found += _active_in(ops[_inside_steps(ops, sel)], pool)
        src = "recorded shapes of the ops gathering rows from the pool"
    if not found and a.graph_ops is not None:
        for r in sorted(set(sel["rank"].tolist())):
            cap = a.graph_ops.capture_ops(int(r))
            if cap is not None:
                found += _active_in(cap, pool)
        src = "the CUDA-graph capture trace's ops gathering rows from the pool"
    if not found and len(ops) and len(sel):
        found, src = _consumed_rows(ops[_inside_steps(ops, sel)], pool)
    if not found:
        rm = getattr(a, "run_model", None)
        used = rm.value("kv_tokens_in_use") if rm is not None else None
        if used is not None and 0 < used <= pool:
            return float(used), pool, (f"no op gathers rows out of a pool-shaped tensor; the KV tokens in use "
                                       f"({rm.describe('kv_tokens_in_use')}); pool: {psrc}")
        return None, pool, ("no op gathers rows out of a pool-shaped tensor in the recorded shapes or a "
                            "graph-capture trace; record shapes (record_shapes=True) or keep the capture trace")
    return float(np.median(found)), pool, f"{src}; pool: {psrc}"


CONSUMER_LOOKAHEAD = 64  # ops after a gather searched for the one that reads its rows


def _consumed_rows(ops: pd.DataFrame, pool: float) -> tuple[list[int], str]:
    """The active rows of gathers whose index is not recorded (``pool[idx]`` is ``aten::index`` with a
    TensorList index, which Kineto writes as ``[]``): the leading dim of the next op on the gather's thread,
    starting after it ends, whose first input is a [rows, <the pool's row dims>] tensor with fewer rows."""
    if not len(ops) or not {"tid", "end"} <= set(ops.columns):
        return [], ""
    ops = ops.sort_values(["rank", "tid", "ts"], kind="stable")
    gathers = np.flatnonzero(per_distinct(ops["name"], lambda nm: bool(GATHER_OP.match(str(nm)))))
    names, raws = ops["name"].to_numpy(dtype=object), ops["input_dims"].to_numpy(dtype=object)
    rank, tid = ops["rank"].to_numpy(), ops["tid"].to_numpy()
    ts, end = ops["ts"].to_numpy(dtype=np.float64), ops["end"].to_numpy(dtype=np.float64)
    found: list[int] = []
    how = ""
    for i in gathers.tolist():
        d = _dims(raws[i])
        if not d or len(d[0]) < 2 or abs(d[0][0] - pool) > max(16.0, 1e-3 * pool):
            continue
        if any(x and 0 < x[0] < 0.99 * pool for x in d[1:]):
            continue  # its index is recorded: _active_in reads it
        row = d[0][1:]
        for j in range(i + 1, min(i + 1 + CONSUMER_LOOKAHEAD, len(ops))):
            if rank[j] != rank[i] or tid[j] != tid[i]:
                break
            if not ts[j] >= end[i]:
                continue  # inside the gather
            c = _dims(raws[j])
            if c and len(c[0]) == len(d[0]) and c[0][1:] == row and 0 < c[0][0] < 0.99 * pool:
                found.append(c[0][0])
                how = how or (f"recorded shapes of the op that reads the rows {names[i]} gathers from the pool "
                              f"(its index is not recorded: a TensorList): {names[j]} {c[0]}")
                break
    return found, how


def cached_active_kv_rows(a: Analysis, cache: dict | None = None) -> tuple[float | None, float | None, str]:
    """:func:`active_kv_rows` of the replayed steps (``cache["steps"]``), found once per ``cache``."""
    if cache is not None and "kv_rows" in cache:
        return cache["kv_rows"]
    out = active_kv_rows(a, cache.get("steps") if cache is not None else None)
    if cache is not None:
        cache["kv_rows"] = out
    return out
