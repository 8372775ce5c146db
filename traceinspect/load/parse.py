"""Decode one Kineto Chrome-trace file into column tables.

The file is decompressed in bounded blocks (ISA-L when installed, else zlib; both release the GIL,
so a large file is inflated on a second thread while this one decodes). The ``traceEvents`` array
is cut at event boundaries and each piece goes through a typed msgspec decoder that reads only the
fields the analysis uses, straight into column arrays. Peak memory is the tables plus a few pieces,
not the JSON text plus a Python object per event. Shape arguments of CPU ops stay raw JSON bytes
until a measure stage asks for them.

A piece is accepted only when it decodes as a JSON array of event objects, which can only happen
when both of its ends lie between two events; anything else (an odd layout, a broken file) sends the
whole document through the one-shot decoder, so errors read exactly as for a plain decode.
"""

from __future__ import annotations

import gc
import queue
import re
import sys
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

from traceinspect.errors import TraceInputError
from traceinspect.model import (
    ANNOTATION_COLUMNS,
    CPU_OP_COLUMNS,
    GPU_ANNOTATION_COLUMNS,
    KERNEL_COLUMNS,
    RUNTIME_COLUMNS,
    DeviceInfo,
)

if TYPE_CHECKING:
    import pandas as pd

try:  # ISA-L inflates gzip 2-3x faster than zlib; optional
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - depends on the environment
    _zlib = zlib  # type: ignore[assignment]

_ZLIB_ERRORS: tuple[type[Exception], ...] = (zlib.error, getattr(_zlib, "error", zlib.error))
# ids land in int64 columns: a larger value is a validation error, not an OverflowError later
_I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# no real event lasts a day: Kineto writes ~1.8e16 when an end time underflows; such events are dropped
MAX_DUR_US = 86_400e6


class _Args(msgspec.Struct, gc=False):
    correlation: _I64 | None = None
    external_id: _I64 | None = msgspec.field(default=None, name="External id")
    device: _I64 | None = None
    stream: _I64 | None = None
    grid: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    block: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    bytes: int | float | None = None
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_types: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Concrete Inputs")


class _Event(msgspec.Struct, gc=False):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float = 0.0
    tid: _I64 | str = 0
    args: _Args | None = None


class _Trace(msgspec.Struct):
    traceEvents: list[_Event]  # noqa: N815 - Kineto's key
    deviceProperties: list[dict[str, Any]] = []  # noqa: N815
    distributedInfo: dict[str, Any] | None = None  # noqa: N815
    cuda_runtime_version: int | str | None = None
    cuda_driver_version: int | str | None = None
    trace_id: str | int | None = None


_KIND = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "memcpy": "memcpy",
    "gpu_memset": "memset",
    "memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "runtime": "runtime",
    "cpu_op": "cpu_op",
    "operator": "cpu_op",
    "user_annotation": "annotation",
    "gpu_user_annotation": "gpu_annotation",
}
_KINDS = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "annotation", "gpu_annotation")
GPU_KINDS = ["kernel", "memcpy", "memset"]

_DECODER = msgspec.json.Decoder(_Trace)
_EVENTS = msgspec.json.Decoder(list[_Event])

BLOCK = 1 << 20  # compressed bytes read at a time
PIECE = 8 << 20  # decompressed bytes decoded at a time
THREAD_MIN = 4 << 20  # files at least this large are inflated on a second thread
_HEAD = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"


@dataclass
class ParsedRank:
    """The tables and metadata of one rank file (rank column not yet set)."""

    kernels: pd.DataFrame
    runtime: pd.DataFrame
    cpu_ops: pd.DataFrame
    annotations: pd.DataFrame
    gpu_annotations: pd.DataFrame
    devices: list[DeviceInfo] = field(default_factory=list)
    distributed_info: dict[str, Any] = field(default_factory=dict)
    cuda_runtime_version: str | None = None
    cuda_driver_version: str | None = None
    trace_id: str | None = None
    n_events: int = 0
    dropped: int = 0
    linked: bool = False  # link columns added (see traceinspect.link.link_tables)
    link_dups: int = 0


# ---------------------------------------------------------------------------------------------
# reading


def _open(path: Path):  # noqa: ANN202 - a binary file object
    try:
        return path.open("rb")
    except FileNotFoundError:
        raise TraceInputError("no such file", path) from None
    except OSError as e:
        raise TraceInputError(f"cannot read file: {e.strerror or e}", path) from None


def _read(f: Any, n: int, path: Path) -> bytes:
    try:
        return f.read(n)
    except OSError as e:
        raise TraceInputError(f"cannot read file: {e.strerror or e}", path) from None


def _truncated(path: Path) -> TraceInputError:
    return TraceInputError("truncated gzip (the file ends before the end-of-stream marker; was the "
                           "capture still being written?)", path)


def _blocks(path: Path, tap: Callable[[bytes], None] | None = None) -> Iterator[bytes]:
    """The decompressed text of a ``.json`` or ``.json.gz`` file, in blocks of about PIECE bytes
    (``tap`` is given every byte read from the file, in order)."""
    with _open(path) as f:
        if tap is not None:
            f = _Tapped(f, tap)
        first = _read(f, BLOCK, path)
        if first[:2] != b"\x1f\x8b":
            data = first
            while data:
                yield data
                data = _read(f, PIECE, path)
            return
        d = _zlib.decompressobj(31)
        data = first
        while True:
            try:
                while data:
                    out = d.decompress(data, PIECE)
                    data = d.unconsumed_tail
                    if out:
                        yield out
                    if d.eof:
                        break
                if d.eof:
                    rest = d.unused_data + _read(f, BLOCK, path)
                    tail = rest + _read(f, BLOCK, path) if len(rest) < 2 else rest
                    if not tail.strip(b"\0"):  # end of file (trailing zero padding is allowed)
                        if not _read(f, BLOCK, path).strip(b"\0"):
                            return
                        raise TraceInputError("corrupt gzip: trailing garbage after the compressed data", path)
                    if tail[:2] != b"\x1f\x8b":
                        raise TraceInputError("corrupt gzip: Not a gzipped file", path)
                    d, data = _zlib.decompressobj(31), tail  # another gzip member follows
                    continue
            except _ZLIB_ERRORS as e:
                raise TraceInputError(f"corrupt gzip: {e}", path) from None
            data = _read(f, BLOCK, path)
            if not data:
                raise _truncated(path)


class _Tapped:
    """A file whose reads are also handed to ``tap``."""

    def __init__(self, f: Any, tap: Callable[[bytes], None]) -> None:
        self.f, self.tap = f, tap

    def read(self, n: int) -> bytes:
        b = self.f.read(n)
        if b:
            self.tap(b)
        return b


class Sha256Beside:
    """SHA-256 of the bytes given to it, computed on a thread of its own (hashlib releases the GIL),
    so that a file is hashed while it is parsed instead of before."""

    def __init__(self) -> None:
        import hashlib

        self._h = hashlib.sha256()
        self._q: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._t = threading.Thread(target=self._run, name="traceinspect-sha256", daemon=True)
        self._t.start()

    def _run(self) -> None:
        while (b := self._q.get()) is not None:
            self._h.update(b)

    def __call__(self, b: bytes) -> None:
        self._q.put(b)

    def hexdigest(self) -> str:
        self._q.put(None)
        self._t.join()
        return self._h.hexdigest()


def _threaded(blocks: Iterator[bytes], depth: int = 3) -> Iterator[bytes]:
    """Run ``blocks`` on a second thread, ``depth`` blocks ahead of the consumer."""
    q: queue.Queue[Any] = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for b in blocks:
                if not put(b):
                    return
            put(end)
        except BaseException as e:  # handed to the consumer
            put(e)

    t = threading.Thread(target=produce, name="traceinspect-inflate", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is end:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()


def read_bytes(path: Path) -> bytes:
    """Read a ``.json`` or ``.json.gz`` file, turning I/O and gzip failures into TraceInputError."""
    return b"".join(_blocks(Path(path)))


# ---------------------------------------------------------------------------------------------
# tables


def _version(v: int | str | None) -> str | None:
    return None if v is None else str(v)


def _devices(props: list[dict[str, Any]]) -> list[DeviceInfo]:
    out = []
    for p in props:
        if not isinstance(p, dict):
            continue
        major, minor = p.get("computeMajor"), p.get("computeMinor")
        cc = f"{major}.{minor}" if isinstance(major, int) and isinstance(minor, int) else None
        mem = p.get("totalGlobalMem")
        sms = p.get("numSms")
        out.append(DeviceInfo(
            name=str(p.get("name", "unknown")),
            compute_capability=cc,
            total_memory_bytes=mem if isinstance(mem, int) else None,
            num_sms=sms if isinstance(sms, int) else None,
        ))
    return out


def _tid(t: int | str) -> int:
    if isinstance(t, int):
        return t
    try:
        v = int(t)
    except ValueError:
        return zlib.crc32(t.encode()) & 0x7FFFFFFF  # a stable id for a named thread
    return v if -(2**63) <= v < 2**63 else zlib.crc32(t.encode()) & 0x7FFFFFFF


_NO_ARGS = _Args()


def _floats(values: list[Any]) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def _ids(values: list[Any]) -> np.ndarray:
    """Integer ids with None as -1."""
    try:
        return np.array(values, dtype=np.int64)
    except TypeError:  # None present
        a = np.array(values, dtype=np.float64)
        return np.where(np.isnan(a), -1, a).astype(np.int64)


def _tids(values: list[Any]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError):
        return np.array([_tid(t) for t in values], dtype=np.int64)


class _Columns:
    """Column pieces of one kind of event, appended piece by piece."""

    __slots__ = ("cols",)

    def __init__(self) -> None:
        self.cols: dict[str, list[Any]] = {}

    def add(self, name: str, value: Any) -> None:
        self.cols.setdefault(name, []).append(value)

    def get(self, name: str, dtype: Any) -> Any:
        parts = self.cols.get(name, [])
        if dtype is object:
            return [x for p in parts for x in p] if len(parts) != 1 else parts[0]
        if not parts:
            return np.empty(0, dtype=dtype)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


class _Builder:
    """Turns decoded event pieces into column pieces; holds no reference to the decoded text."""

    def __init__(self) -> None:
        self.kinds = {k: _Columns() for k in _KINDS}
        self.route: dict[str, str | None] = dict(_KIND)
        self.n_events = 0
        self.bytes_memo: dict[bytes, bytes | None] = {b"": None}
        self.str_memo: dict[bytes, str] = {b"": ""}

    def add(self, events: list[_Event]) -> None:
        self.n_events += len(events)
        groups: dict[str, list[_Event]] = {k: [] for k in _KINDS}
        appenders: dict[str, Callable[[_Event], None] | None] = {}
        route = self.route
        for cat, kind in route.items():
            appenders[cat] = groups[kind].append if kind else None
        get_app = appenders.get
        for ev in events:
            if ev.ph == "X":
                app = get_app(ev.cat, _MISSING)
                if app is _MISSING:
                    kind = route.setdefault(ev.cat, _KIND.get(ev.cat.lower()))
                    app = appenders[ev.cat] = groups[kind].append if kind else None
                if app is not None:
                    app(ev)
        for kind, evs in groups.items():
            if evs:
                self._add_kind(kind, evs)

    def _add_kind(self, kind: str, evs: list[_Event]) -> None:
        # one pass over the events per kind, appending to local lists: each event object is visited
        # once (a pass per column re-reads 1e5 scattered objects per column)
        c = self.kinds[kind]
        intern = sys.intern
        name: list[str] = []
        ts: list[float] = []
        dur: list[float] = []
        an, at, ad = name.append, ts.append, dur.append
        if kind == "gpu_annotation":
            for ev in evs:
                an(intern(ev.name))
                at(ev.ts)
                ad(ev.dur)
        elif kind == "annotation":
            tid: list[Any] = []
            ati = tid.append
            for ev in evs:
                an(intern(ev.name))
                at(ev.ts)
                ad(ev.dur)
                ati(ev.tid)
            c.add("tid", _tids(tid))
        elif kind == "cpu_op":
            tid, ext = [], []
            dims: list[bytes | None] = []
            types: list[bytes | None] = []
            conc: list[bytes | None] = []
            ati, ae, adi, aty, aco = tid.append, ext.append, dims.append, types.append, conc.append
            memo = self.bytes_memo.setdefault  # one object per distinct text; b"" -> None
            for ev in evs:
                an(intern(ev.name))
                at(ev.ts)
                ad(ev.dur)
                ati(ev.tid)
                a = ev.args or _NO_ARGS
                ae(a.external_id)
                b = bytes(a.input_dims)
                adi(memo(b, b))
                b = bytes(a.input_types)
                aty(memo(b, b))
                b = bytes(a.concrete)
                aco(memo(b, b))
            c.add("tid", _tids(tid))
            c.add("external_id", _ids(ext))
            c.add("input_dims", dims)
            c.add("input_types", types)
            c.add("concrete", conc)
        elif kind == "runtime":
            tid, ext, corr = [], [], []
            ati, ae, aco = tid.append, ext.append, corr.append
            for ev in evs:
                an(intern(ev.name))
                at(ev.ts)
                ad(ev.dur)
                ati(ev.tid)
                a = ev.args or _NO_ARGS
                ae(a.external_id)
                aco(a.correlation)
            c.add("tid", _tids(tid))
            c.add("external_id", _ids(ext))
            c.add("correlation", _ids(corr))
        else:  # kernel, memcpy, memset
            ext, corr, dev, stream, grid, block, nbytes = [], [], [], [], [], [], []
            ae, aco, adv, ast, agr, abl, aby = (ext.append, corr.append, dev.append, stream.append, grid.append,
                                                block.append, nbytes.append)
            smemo = self.str_memo
            for ev in evs:
                an(intern(ev.name))
                at(ev.ts)
                ad(ev.dur)
                a = ev.args or _NO_ARGS
                ae(a.external_id)
                aco(a.correlation)
                adv(a.device)
                ast(a.stream)
                for raw, out in ((a.grid, agr), (a.block, abl)):
                    b = bytes(raw)
                    v = smemo.get(b)
                    if v is None:
                        v = smemo[b] = intern(b.decode())
                    out(v)
                x = a.bytes
                aby(-1 if x is None else x)
            c.add("external_id", _ids(ext))
            c.add("correlation", _ids(corr))
            c.add("device", _ids(dev))
            c.add("stream", _ids(stream))
            c.add("grid", grid)
            c.add("block", block)
            c.add("bytes", _floats(nbytes))
        c.add("name", name)
        c.add("ts", _floats(ts))
        c.add("dur", _floats(dur))

    def frames(self) -> tuple[dict[str, pd.DataFrame], int]:
        """The five tables, and the number of events dropped for non-finite or negative times."""
        import pandas as pd

        dropped = 0
        out: dict[str, pd.DataFrame] = {}

        def frame(columns: list[str], kinds: list[str]) -> pd.DataFrame:
            nonlocal dropped
            data: dict[str, Any] = {}
            for col in columns:
                if col in ("rank", "end", "kind"):
                    continue
                dtype = object if col in ("name", "grid", "block", "input_dims", "input_types", "concrete") \
                    else (np.float64 if col in ("ts", "dur", "bytes") else np.int64)
                vals = [self.kinds[k].get(col, dtype) for k in kinds]
                if dtype is object:
                    data[col] = np.array([x for v in vals for x in v] if len(vals) > 1 else vals[0], dtype=object) \
                        if sum(map(len, vals)) else np.empty(0, dtype=object)
                else:
                    data[col] = vals[0] if len(vals) == 1 else np.concatenate(vals)
            n = len(data["ts"])
            if "kind" in columns:
                sizes = [len(self.kinds[k].get("ts", np.float64)) for k in kinds]
                codes = np.repeat(np.arange(len(kinds), dtype=np.int8), sizes)
                data["kind"] = pd.Categorical.from_codes(codes, categories=GPU_KINDS)
            ts, dur = data["ts"], data["dur"]
            ok = np.isfinite(ts) & np.isfinite(dur) & (dur >= 0) & (dur <= MAX_DUR_US)
            if not ok.all():
                dropped += int(n - ok.sum())
                data = {k: (v[ok] if not isinstance(v, pd.Categorical) else v[ok]) for k, v in data.items()}
            data["end"] = data["ts"] + data["dur"]
            for c in ("name", "grid", "block", "input_dims", "input_types", "concrete"):
                if c in data:  # object columns stay object (a bare array of str would become str dtype)
                    data[c] = pd.Series(data[c], dtype=object, copy=False)
            return pd.DataFrame({c: data[c] for c in columns if c != "rank"}, copy=False)

        kernels = frame(KERNEL_COLUMNS, GPU_KINDS)
        if len(kernels):
            order = np.argsort(kernels["ts"].to_numpy(), kind="stable")
            if (order != np.arange(len(order))).any():
                kernels = kernels.take(order)
            kernels = kernels.reset_index(drop=True)
        out["kernels"] = kernels
        out["runtime"] = frame(RUNTIME_COLUMNS, ["runtime"])
        out["cpu_ops"] = frame(CPU_OP_COLUMNS, ["cpu_op"])
        out["annotations"] = frame(ANNOTATION_COLUMNS, ["annotation"])
        out["gpu_annotations"] = frame(GPU_ANNOTATION_COLUMNS, ["gpu_annotation"])
        return out, dropped


_MISSING: Any = object()


def _ranked(b: _Builder, trace: _Trace) -> ParsedRank:
    tables, dropped = b.frames()
    dist = trace.distributedInfo if isinstance(trace.distributedInfo, dict) else {}
    return ParsedRank(
        **tables,
        devices=_devices(trace.deviceProperties),
        distributed_info=dist,
        cuda_runtime_version=_version(trace.cuda_runtime_version),
        cuda_driver_version=_version(trace.cuda_driver_version),
        trace_id=None if trace.trace_id is None else str(trace.trace_id),
        n_events=b.n_events,
        dropped=dropped,
    )


# ---------------------------------------------------------------------------------------------
# decoding


class _Fallback(Exception):
    """The streaming split could not be used: decode the whole document instead."""


def _decode_whole(data: bytes, path: Path) -> _Trace:
    try:
        return _DECODER.decode(data)
    except msgspec.ValidationError as e:
        raise TraceInputError(f"not a Kineto trace: {e}", path) from None
    except msgspec.DecodeError as e:
        raise TraceInputError(f"not valid JSON: {e}", path) from None
    except RecursionError:
        raise TraceInputError("not valid JSON: nested too deeply", path) from None


def _skip_ws_back(buf: bytearray, i: int, lo: int) -> int:
    """Index of the last non-whitespace byte at or before ``i`` (>= lo), or lo - 1."""
    while i >= lo and buf[i] in _WS:
        i -= 1
    return i


def _last_boundary(buf: bytearray, lo: int) -> tuple[int, int] | None:
    """(end of an event, start of the next) for the last ``}`` , ``{`` separator in buf[lo:]."""
    i = len(buf)
    while True:
        i = buf.rfind(b"{", lo, i)
        if i <= lo:
            return None
        j = _skip_ws_back(buf, i - 1, lo)
        if j > lo and buf[j] == 0x2C:  # ','
            k = _skip_ws_back(buf, j - 1, lo)
            if k >= lo and buf[k] == 0x7D:  # '}'
                return k + 1, i


def _decode_piece(buf: bytearray | memoryview, end: int) -> list[_Event] | None:
    text = b"".join((b"[", memoryview(buf)[:end], b"]"))
    try:
        return _EVENTS.decode(text)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        return None


def _parse_stream(blocks: Iterator[bytes], path: Path) -> ParsedRank:
    b = _Builder()
    buf = bytearray()
    # 1. the header, up to and including the '[' that opens traceEvents
    head_end = -1
    for block in blocks:
        start = max(0, len(buf) - 4096)
        buf += block
        m = _HEAD.search(buf, start)
        if m:
            head_end = m.end()
            break
    if head_end < 0:
        raise _Fallback
    header = bytes(buf[:head_end])
    del buf[:head_end]

    # 2. the events, piece by piece
    def consume() -> None:
        if len(buf) < PIECE:
            return
        cut = _last_boundary(buf, max(0, len(buf) - PIECE // 2)) or _last_boundary(buf, 0)
        if cut is None:
            return
        events = _decode_piece(buf, cut[0])
        if events is None:
            if len(buf) > 8 * PIECE:  # a piece that never decodes: not a layout this reader can split
                raise _Fallback
            return
        b.add(events)
        del events
        del buf[:cut[1]]

    for block in blocks:
        buf += block
        consume()

    # 3. the end of the array and the rest of the document
    cut = _last_boundary(buf, 0)
    if cut is not None:
        events = _decode_piece(buf, cut[0])
        if events is not None:
            b.add(events)
            del buf[:cut[1]]
    i = 0
    while True:
        i = buf.find(b"]", i)
        if i < 0:
            raise _Fallback
        k = _skip_ws_back(buf, i - 1, 0)
        if k < 0 or buf[k] == 0x7D:
            events = _decode_piece(buf, i) if k >= 0 else []
            if events is not None:
                break
        i += 1
    trailer = bytes(buf[i:])
    try:
        trace = _DECODER.decode(header + trailer)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        raise _Fallback from None
    if trace.traceEvents:
        raise _Fallback
    b.add(events)
    return _ranked(b, trace)


# ---------------------------------------------------------------------------------------------
# the native scanner (traceinspect/load/_kineto_scan.c): the same tables, without an object per event

try:
    from traceinspect.load import _kineto_scan as _native
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


def _route(cat: str) -> int | None:
    kind = _KIND.get(cat)
    if kind is None:
        kind = _KIND.get(cat.lower())
    return None if kind is None else _KINDS.index(kind)


def _scan_native(blocks: Iterator[bytes], path: Path) -> ParsedRank:
    """Scan a document with the native scanner into the same tables as the msgspec path."""
    assert _native is not None
    s = _native.Scanner([_NATIVE_COLUMNS[k] for k in _KINDS], _route,
                        [_KINDS.index(k) for k in GPU_KINDS])
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
    out = _ranked(b, trace)
    out.drops_native = b.drops  # type: ignore[attr-defined]
    return out


_TRACE_KEYS = frozenset(f.encode_name for f in msgspec.structs.fields(_Trace)) - {"traceEvents"}


def parse_bytes(data: bytes, path: Path) -> ParsedRank:
    """Decode the JSON text of one rank file into tables."""
    gc_was = gc.isenabled()
    gc.disable()  # millions of small objects: the collector would only rescan them
    try:
        try:
            return _parse_stream(iter([data]), path)
        except _Fallback:
            pass
        trace = _decode_whole(data, path)
        b = _Builder()
        b.add(trace.traceEvents)
        trace.traceEvents = []
        return _ranked(b, trace)
    finally:
        if gc_was:
            gc.enable()


def parse_file(path: str | Path, tap: Callable[[bytes], None] | None = None) -> ParsedRank:
    """Read and decode one rank file. ``tap`` (only where :func:`native_available`) is given every
    byte read from the file."""
    path = Path(path)
    if native_available():
        return parse_file_native(path, tap)
    if tap is not None:
        raise ValueError("tap needs the native scanner")
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    gc_was = gc.isenabled()
    gc.disable()
    try:
        blocks = _blocks(path)
        if size >= THREAD_MIN:
            blocks = _threaded(blocks)
        try:
            return _parse_stream(blocks, path)
        except _Fallback:
            pass
        finally:
            blocks.close()
    finally:
        if gc_was:
            gc.enable()
    return parse_bytes_whole(read_bytes(path), path)


def parse_file_native(path: str | Path, tap: Callable[[bytes], None] | None = None) -> ParsedRank:
    """Read and scan one rank file with the native scanner (``tap``: see :func:`_blocks`)."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    blocks = _blocks(path, tap)
    if size >= THREAD_MIN:
        blocks = _threaded(blocks)
    try:
        return _scan_native(blocks, path)
    finally:
        blocks.close()


def parse_bytes_native(data: bytes, path: Path) -> ParsedRank:
    """Scan the JSON text of one rank file with the native scanner."""
    return _scan_native(iter([data]), path)


def parse_bytes_whole(data: bytes, path: Path) -> ParsedRank:
    """Decode a whole document in one call (the reference path the streaming reader must agree with)."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        trace = _decode_whole(data, path)
        b = _Builder()
        b.add(trace.traceEvents)
        trace.traceEvents = []
        del data
        return _ranked(b, trace)
    finally:
        if gc_was:
            gc.enable()
