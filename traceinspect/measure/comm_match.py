"""Which kernels are collectives, of which kind and message size, in which aligned step: the
inputs of matching collectives across ranks (:mod:`traceinspect.measure.collectives`)."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.measure.comm_settings import COMM_OP, DTYPE_BYTES, collective_kind
from traceinspect.tables import text_values

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


def _aligned_steps(a: Analysis) -> tuple[pd.DataFrame, int]:
    """Analysed steps with ``pos`` (order within the rank) restricted to the positions every rank has."""
    sel = a.selected.sort_values(["rank", "idx"]).copy()
    sel["pos"] = sel.groupby("rank").cumcount()
    counts = sel.groupby("rank").size()
    n = int(counts.min()) if len(counts) else 0
    return sel[sel["pos"] < n], n


def _groups(a: Analysis) -> list[list[int]]:
    """Ranks that take part in the same collectives: one group per (DP, PP) label of the rank files."""
    by: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for info in a.trace.ranks:
        by[(info.dp, info.pp)].append(info.rank)
    return [sorted(v) for _, v in sorted(by.items(), key=lambda kv: min(kv[1]))]


def _comm_mask(k: pd.DataFrame) -> np.ndarray:
    if "cls" not in k.columns:
        return np.zeros(len(k), dtype=bool)
    return (text_values(k["cls"]) == "comm") & (text_values(k["kind"]) == "kernel")


def _span_kinds(a: Analysis, comm: pd.DataFrame) -> list[str | None]:
    """Kind from the innermost ``nccl:*`` record_function span around each kernel's launch."""
    out: list[str | None] = [None] * len(comm)
    ann = a.trace.annotations
    if not len(ann) or not len(comm):
        return out
    spans = ann[ann["name"].str.startswith("nccl:")]
    if not len(spans):
        return out
    rt = a.trace.runtime
    rt_idx = comm["rt_idx"].to_numpy()
    ok = (rt_idx >= 0) & ~comm["graph_replay"].to_numpy()
    if not ok.any():
        return out
    launch_ts = rt["ts"].reindex(rt_idx[ok]).to_numpy()
    launch_tid = rt["tid"].reindex(rt_idx[ok]).to_numpy()
    ranks = comm["rank"].to_numpy()[ok]
    where = np.nonzero(ok)[0]
    groups = {key: (g["ts"].to_numpy(), g["end"].to_numpy(), g["name"].to_numpy(dtype=object))
              for key, g in spans.sort_values("ts", kind="stable").groupby(["rank", "tid"])}
    for j, (r, tid, t) in enumerate(zip(ranks.tolist(), launch_tid.tolist(), launch_ts.tolist(), strict=True)):
        g = groups.get((r, tid))
        if g is None or not np.isfinite(t):
            continue
        ts, end, names = g
        i = int(np.searchsorted(ts, t, side="right")) - 1
        while i >= 0:
            if end[i] >= t:
                out[where[j]] = collective_kind(names[i][5:])
                break
            i -= 1
    return out


def _first_numbers(obj: Any) -> list[list[int]]:
    """Every non-empty list of ints in a nested JSON value (tensor shapes)."""
    found: list[list[int]] = []
    if isinstance(obj, list):
        if obj and all(isinstance(x, int) and not isinstance(x, bool) for x in obj):
            found.append(obj)
        else:
            for x in obj:
                found.extend(_first_numbers(x))
    return found


# element type named in a kernel name: NCCL's ``_bf16_`` tokens, custom all-reduce template arguments
_NAME_DTYPE = re.compile(r"_(bf16|f16|f32|f64|f8e4m3|f8e5m2|i8|u8|i32|u32|i64|u64)(?:_|\b)|"
                         r"(__nv_bfloat16|__half|half|float|double)\b")
_NAME_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8e4m3": 1, "f8e5m2": 1, "i8": 1, "u8": 1,
                     "i32": 4, "u32": 4, "i64": 8, "u64": 8, "__nv_bfloat16": 2, "__half": 2, "half": 2,
                     "float": 4, "double": 8}


def _name_elem_bytes(name: str) -> float:
    m = _NAME_DTYPE.search(name)
    return float(_NAME_DTYPE_BYTES[m.group(1) or m.group(2)]) if m else float("nan")


def _message_bytes(a: Analysis, comm: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Message size per comm kernel and where it came from: Kineto's collective args where the loader
    kept them (``coll_nelems``, ``coll_dtype``), else the recorded shapes of the enclosing communication
    CPU op (largest tensor) times the element size from that op's types or from the kernel name."""
    out = np.full(len(comm), np.nan)
    src = [""] * len(comm)
    if {"coll_nelems", "coll_dtype"} <= set(comm.columns):
        nel = comm["coll_nelems"].to_numpy(dtype=np.float64)
        size = np.array([DTYPE_BYTES.get(str(d).lower(), np.nan) for d in comm["coll_dtype"]], dtype=np.float64)
        out = np.where(nel > 0, nel * size, np.nan)
        src = ["kineto_args" if np.isfinite(v) else "" for v in out]
    ops = a.trace.cpu_ops
    if not len(ops) or "op_idx" not in comm.columns:
        return out, src
    parent = ops["parent"].to_numpy() if "parent" in ops.columns else np.full(len(ops), -1)
    names = ops["name"].to_numpy(dtype=object)
    dims = ops["input_dims"].to_numpy(dtype=object)
    types = ops["input_types"].to_numpy(dtype=object)
    n_ops = len(ops)
    # op_idx / parent hold row labels; the loader's tables are labelled by position (no lookup table)
    labels = None if ops.index.equals(pd.RangeIndex(n_ops)) else {lab: i for i, lab in enumerate(ops.index)}

    def pos(label: int) -> int:
        if labels is not None:
            return labels.get(label, -1)
        return int(label) if 0 <= label < n_ops else -1

    cache: dict[int, tuple[float, float]] = {}
    comm_names: dict[Any, bool] = {}
    raw: dict[tuple[Any, Any], tuple[float, float] | None] = {}

    def is_comm(name: Any) -> bool:
        hit = comm_names.get(name)
        if hit is None:
            hit = comm_names[name] = COMM_OP.search(str(name)) is not None
        return hit

    def decoded(d: Any, t: Any) -> tuple[float, float] | None:
        """(elements of the largest tensor, element size or NaN) of recorded shapes, once per distinct value."""
        try:
            key = (d, t)
            if key in raw:
                return raw[key]
        except TypeError:  # not raw JSON text: decoded every time
            key = None
        try:
            shapes = _first_numbers(json.loads(d))
            tnames = json.loads(t) if t is not None else []
        except (ValueError, TypeError):
            shapes, tnames = [], []
        val = None
        if shapes:
            esz = next((DTYPE_BYTES[x.lower()] for x in tnames
                        if isinstance(x, str) and x.lower() in DTYPE_BYTES), float("nan"))
            val = (float(max(math.prod(s) for s in shapes)), float(esz))
        if key is not None:
            raw[key] = val
        return val

    def shape_of(i: int) -> tuple[float, float]:
        """(elements of the largest tensor, element size or NaN) of the nearest comm op up the tree."""
        if i in cache:
            return cache[i]
        val = (float("nan"), float("nan"))
        j, depth = i, 0
        while j >= 0 and depth < 8:
            if is_comm(names[j]) and dims[j] is not None:
                got = decoded(dims[j], types[j])
                if got is not None:
                    val = got
                    break
            p = parent[j]
            j = pos(p) if p >= 0 else -1
            depth += 1
        cache[i] = val
        return val

    op_idx = comm["op_idx"].to_numpy()
    knames = comm["name"].to_numpy(dtype=object)
    for n, oi in enumerate(op_idx.tolist()):
        if np.isnan(out[n]) and oi >= 0 and pos(oi) >= 0:
            nel, esz = shape_of(pos(oi))
            how = "cpu_op_shapes"
            if not np.isfinite(esz):
                esz, how = _name_elem_bytes(str(knames[n])), "cpu_op_shapes+kernel_name_dtype"
            if np.isfinite(nel) and np.isfinite(esz):
                out[n], src[n] = nel * esz, how
    return out, src


