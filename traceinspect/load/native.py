"""The native scanner (``traceinspect/load/_kineto_scan.c``): the same tables as the msgspec path,
without an object per event."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from traceinspect.errors import TraceInputError
from traceinspect.load.columns import (
    _KIND,
    _KINDS,
    GPU_KINDS,
    ParsedRank,
    _Builder,
    _py_marker,
    _ranked,
    _tid,
    _Trace,
)
from traceinspect.load.salvage import _decode_whole

try:  # by name: import analysers cannot see a C extension and would count `from traceinspect.load import
    # _kineto_scan` as an import of this package by its own module
    _native = importlib.import_module("traceinspect.load._kineto_scan")
except ImportError:  # pragma: no cover - built by pip install; the msgspec path is the fallback
    _native = None

# the columns the scanner fills per kind (those _Builder._add_kind fills)
_GPU_COLS = ("name", "ts", "dur", "external_id", "correlation", "device", "stream", "grid", "block", "bytes")
_NATIVE_COLUMNS = {
    "kernel": _GPU_COLS, "memcpy": _GPU_COLS, "memset": _GPU_COLS,
    "runtime": ("name", "ts", "dur", "tid", "external_id", "correlation"),
    "cpu_op": ("name", "ts", "dur", "tid", "external_id", "input_dims", "input_types", "concrete"),
    "annotation": ("name", "ts", "dur", "tid"),
    "gpu_annotation": ("name", "ts", "dur"),
}
_NATIVE_DTYPES = {"f": np.float64, "i": np.int64}


def native_available() -> bool:
    """Whether the compiled scanner is importable (``TRACEINSPECT_NATIVE=0`` turns it off)."""
    import os

    return _native is not None and os.environ.get("TRACEINSPECT_NATIVE", "1") != "0"


def native_module() -> Any:
    """The compiled module (None when it is not built)."""
    return _native


def _route(cat: str) -> int | None:
    """The scanner's kind of a category: a kind's index, -(index + 1) for python_function events
    (annotations, where :func:`_py_marker` accepts the name), or None (not kept)."""
    kind = _KIND.get(cat)
    if kind is None:
        kind = _KIND.get(cat.lower())
    if kind == "python_function":
        return -(_KINDS.index("annotation") + 1)
    return None if kind is None else _KINDS.index(kind)


def _scan_native(blocks: Iterator[bytes], path: Path) -> ParsedRank:
    """Scan a document with the native scanner into the same tables as the msgspec path."""
    assert _native is not None
    s = _native.Scanner([_NATIVE_COLUMNS[k] for k in _KINDS], _route,
                        [_KINDS.index(k) for k in GPU_KINDS], _py_marker)
    try:
        for block in blocks:
            s.feed(block)
        s.feed(b"", final=True)
    except _native.ScanError as e:
        kind, msg = e.args
        raise TraceInputError(f"not valid JSON: {msg}" if kind == "json" else f"not a Kineto trace: {msg}",
                              path) from None
    res = s.result()
    del s
    strings = np.empty(len(res["strings"]), dtype=object)
    strings[:] = res["strings"]
    raws = np.empty(len(res["raws"]) + 1, dtype=object)  # the last slot: None
    raws[:-1] = res["raws"]
    types = _native.column_types()
    b = _Builder()
    b.n_events = res["n_events"]
    b.drops = {r: n for r, n in res["drops"].items() if n}
    b.gpu_dropped = res["gpu_dropped"]
    tid_memo: dict[int, int] = {}
    for kind, cols in zip(_KINDS, res["kinds"], strict=True):
        if not cols["rows"]:
            continue
        c = b.kinds[kind]
        for col in _NATIVE_COLUMNS[kind]:
            t = types[col]
            buf = cols[col]
            if t in _NATIVE_DTYPES:
                arr = np.frombuffer(buf, dtype=_NATIVE_DTYPES[t])
            else:
                codes = np.frombuffer(buf, dtype=np.int32)
                arr = strings[codes] if t == "s" else raws[codes]
            if col == "tid" and len(cols["tid_rows"]):
                rows = np.frombuffer(cols["tid_rows"], dtype=np.int64)
                idx = np.frombuffer(cols["tid_strs"], dtype=np.int32)
                for i in np.unique(idx).tolist():
                    if i not in tid_memo:
                        tid_memo[i] = _tid(strings[i])
                arr[rows] = [tid_memo[i] for i in idx.tolist()]
            c.cols[col] = [arr]
    meta = res["meta"]
    parts = [b'"traceEvents":[]'] if res["events_seen"] else []
    parts += [msgspec.json.encode(k) + b":" + v for k, v in meta.items() if k in _TRACE_KEYS]
    trace = _decode_whole(b"{" + b",".join(parts) + b"}", path)
    return _ranked(b, trace, path)


_TRACE_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(_Trace)) - {"traceEvents"}

