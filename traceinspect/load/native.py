"""The native scanner (``traceinspect/load/_kineto_scan.c``): the same tables as the msgspec path,
without an object per event."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from traceinspect.load.columns import ParsedRank, _Builder, _Coded, _ranked, _tid, _Trace
from traceinspect.load.raw import (  # noqa: F401 - the scanner's inputs, importable from here
    _GPU_COLS,
    _KINDS,
    _NATIVE_COLUMNS,
    _native,
    _route,
    native_available,
    native_module,
    read_scan,
    scan,
)
from traceinspect.load.salvage import _decode_whole

_NATIVE_DTYPES = {"f": np.float64, "i": np.int64}


def _scan_native(blocks: Iterator[bytes], path: Path) -> ParsedRank:
    """Scan a document with the native scanner into the same tables as the msgspec path."""
    return tables_native(scan(blocks, path), path)


def tables_native(res: dict[str, Any], path: Path) -> ParsedRank:
    """The tables of a scanner result (:func:`traceinspect.load.raw.scan`)."""
    assert _native is not None
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
                arr = _Coded(codes, strings if t == "s" else raws)
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

