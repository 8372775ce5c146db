r"""Decode one Kineto Chrome-trace file into column tables.

The file is decompressed in bounded blocks (ISA-L when installed, else zlib; both release the GIL,
so a large file is inflated on a second thread while this one decodes). The ``traceEvents`` array
is cut at event boundaries and each piece goes through a typed msgspec decoder that reads only the
fields the analysis uses, straight into column arrays. Peak memory is the tables plus a few pieces,
not the JSON text plus a Python object per event. Shape arguments of CPU ops stay raw JSON bytes
until a measure stage asks for them.

A piece is accepted only when it decodes as a JSON array of event objects, which can only happen
when both of its ends lie between two events; anything else (an odd layout, a broken file) sends the
whole document through the one-shot decoder, so errors read exactly as for a plain decode.

Tolerance rules (what is read, dropped or rejected; any other reader must give the same tables)
-------------------------------------------------------------------------------------------------
Well-typed text takes the typed fast path. A piece (or document) that the typed decoder refuses
for a type is decoded again (syntax first, then event by event) under these rules, which give the
same values as the fast path wherever that one succeeds:

* Document. One UTF-8 byte-order mark (EF BB BF) at the start of the decompressed text is skipped.
  The file is rejected (``TraceInputError``: one line, exit 2) only when it is not JSON (syntax
  error, truncated text or gzip), when the top level is not an object with a ``traceEvents``
  array, or when more than 1% (``MAX_BAD_GPU_SHARE``) of its GPU events (kernel, memcpy, memset)
  are dropped by the rules below. Fields not listed here, at any level, are ignored. Top-level
  ``deviceProperties`` that is not an array, ``distributedInfo`` that is not an object, and
  ``cuda_runtime_version``, ``cuda_driver_version`` or ``trace_id`` that is neither an integer nor
  a string count as absent; ``deviceProperties`` entries that are not objects are skipped.
* Numbers. Wherever a number is read, a string whose whole text is a JSON number
  (``-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?``: no spaces, no ``+``, no ``nan``/``inf``,
  no backslash escapes) is read as that number (ROCm writes ``"bytes": "32768"``); ``true``,
  ``false`` and ``null`` are not numbers, nor is a value beyond the double range (``1e400``).
  An integer field (``args.correlation``, ``args["External id"]``, ``args.device``,
  ``args.stream``) takes a number whose value is an integer within int64 (``5.0`` is 5); anything
  else there is absent (-1). ``args.bytes`` takes any number as a float; anything else is absent
  (-1). ``args`` that is not an object counts as absent (every field absent).
* Kept as text. ``args.grid``, ``args.block``, ``args["Input Dims"]``, ``args["Input type"]`` and
  ``args["Concrete Inputs"]`` are the raw JSON text of the value as written, whatever its type
  (grid/block: ``""`` when absent; the others: None when absent).
* Which events. An entry of ``traceEvents`` that is not an object is dropped (reason
  ``not_object``). Only ``ph == "X"`` events whose ``cat`` (a string, matched case-insensitively)
  names a kind in ``_KIND`` are used; ``ph`` or ``cat`` that is not a string leaves the event
  unused (not counted). A ``python_function`` event goes into the annotations table only when its
  name, after the last ``"): "`` (the whole name when there is none), is in
  ``PY_FORWARD_FUNCTIONS`` (vLLM's ``gpu_model_runner.py(1002): execute_model``); it is checked
  (and a non-string name dropped, reason ``name``) like any used event. ``tid``: a number whose value is an integer within int64 is that integer;
  a string of the form ``-?[0-9]+`` (leading zeros allowed) within int64 is that integer, any
  other string is CRC-32 of its UTF-8 bytes & 0x7FFFFFFF; any other value (or none) is 0.
* Needed fields of a used event, else the event is dropped and counted by reason: ``name`` a
  string (absent: ``""``; any other value: reason ``name``); ``ts`` present, a number, finite
  (reason ``ts``); ``dur`` a number (absent: 0), finite, >= 0 and at most a day (``MAX_DUR_US``:
  Kineto writes ~1.8e16 when an end time underflows) (reason ``dur``).
* Reporting. ``ParsedRank.drops`` maps reason -> count (``gpu_dropped``: how many of those were
  GPU events); the load stage turns them into one warning per file naming the counts.
"""

from __future__ import annotations

import gc
import importlib
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
MAX_BAD_GPU_SHARE = 0.01  # more dropped GPU events than this share: the file is not read
_BOM = b"\xef\xbb\xbf"
_NAN = float("nan")


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
    ts: float = _NAN  # absent: dropped (reason ts)
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
    "python_function": "python_function",  # only forward markers are kept, as annotations
}
_KINDS = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "annotation", "gpu_annotation")
# python_function events (with_stack captures) kept, as annotations, when the function name (after
# the last "): ") is one of these: a serving engine's forward (vLLM's worker and model runner)
PY_FORWARD_FUNCTIONS = frozenset({"execute_model"})


def _py_marker(name: str) -> bool:
    return name.rpartition("): ")[2] in PY_FORWARD_FUNCTIONS
GPU_KINDS = ["kernel", "memcpy", "memset"]

_DECODER = msgspec.json.Decoder(_Trace)
_EVENTS = msgspec.json.Decoder(list[_Event])
_ARGS = msgspec.json.Decoder(_Args)

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
    drops: dict[str, int] = field(default_factory=dict)  # reason -> events dropped (see the rules above)
    gpu_dropped: int = 0  # how many of the dropped events were GPU events
    linked: bool = False  # link columns added (see traceinspect.link.link_tables)
    link_dups: int = 0

    @property
    def dropped(self) -> int:
        return sum(self.drops.values())


def drop_summary(drops: dict[str, int]) -> str:
    """``3 with no usable ts, 2 with an unusable dur``: the counts of ``ParsedRank.drops`` in words."""
    return ", ".join(f"{n} {_REASON_TEXT.get(r, r)}" for r, n in sorted(drops.items()) if n)


_REASON_TEXT = {
    "dur": "with an unusable dur (not a number, negative or over a day)",
    "name": "with a name that is not a string",
    "not_object": "that are not JSON objects",
    "ts": "with no usable ts",
}


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


_DECIMAL = re.compile(r"-?[0-9]+")


def _tid(t: int | str) -> int:
    if isinstance(t, int):
        return t
    if len(t) <= 20 and _DECIMAL.fullmatch(t):
        v = int(t)
        if -(2**63) <= v < 2**63:
            return v
    return zlib.crc32(t.encode()) & 0x7FFFFFFF  # a stable id for a named thread


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
        self.drops: dict[str, int] = {}  # found while salvaging (ts/dur drops are counted in frames)
        self.gpu_dropped = 0
        self.bytes_memo: dict[bytes, bytes | None] = {b"": None}
        self.str_memo: dict[bytes, str] = {b"": ""}
        self.py_memo: dict[str, bool] = {}

    def add(self, events: list[_Event]) -> None:
        if isinstance(events, _Salvaged):
            self.n_events += events.entries
            for r, n in events.drops.items():
                self.drops[r] = self.drops.get(r, 0) + n
            self.gpu_dropped += events.gpu_dropped
        else:
            self.n_events += len(events)
        groups: dict[str, list[_Event]] = {k: [] for k in _KINDS}
        memo, ann = self.py_memo, groups["annotation"].append

        def py_app(ev: _Event) -> None:  # a forward marker joins the annotations in event order
            keep = memo.get(ev.name)
            if keep is None:
                keep = memo[ev.name] = _py_marker(ev.name)
            if keep:
                ann(ev)

        def appender(kind: str | None) -> Callable[[_Event], None] | None:
            return None if kind is None else py_app if kind == "python_function" else groups[kind].append

        appenders: dict[str, Callable[[_Event], None] | None] = {}
        route = self.route
        for cat, kind in route.items():
            appenders[cat] = appender(kind)
        get_app = appenders.get
        for ev in events:
            if ev.ph == "X":
                app = get_app(ev.cat, _MISSING)
                if app is _MISSING:
                    kind = route.setdefault(ev.cat, _KIND.get(ev.cat.lower()))
                    app = appenders[ev.cat] = appender(kind)
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

    def frames(self) -> tuple[dict[str, pd.DataFrame], dict[str, int], int]:
        """The five tables, the events dropped by reason, and how many of those were GPU events."""
        import pandas as pd

        drops = dict(self.drops)
        gpu_dropped = self.gpu_dropped
        out: dict[str, pd.DataFrame] = {}

        def frame(columns: list[str], kinds: list[str]) -> pd.DataFrame:
            nonlocal gpu_dropped
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
            ts_ok = np.isfinite(ts)
            ok = ts_ok & np.isfinite(dur) & (dur >= 0) & (dur <= MAX_DUR_US)
            if not ok.all():
                n_ts = int(n - ts_ok.sum())
                n_dur = int(n - ok.sum()) - n_ts
                for r, k in (("ts", n_ts), ("dur", n_dur)):
                    if k:
                        drops[r] = drops.get(r, 0) + k
                if kinds is GPU_KINDS:
                    gpu_dropped += n_ts + n_dur
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
        return out, drops, gpu_dropped


_MISSING: Any = object()


def _ranked(b: _Builder, trace: _Trace, path: Path) -> ParsedRank:
    tables, drops, gpu_dropped = b.frames()
    n_gpu = len(tables["kernels"]) + gpu_dropped
    if gpu_dropped and gpu_dropped > MAX_BAD_GPU_SHARE * n_gpu:
        raise TraceInputError(f"{gpu_dropped} of {n_gpu} GPU events are unusable, more than "
                              f"{MAX_BAD_GPU_SHARE:.0%} (dropped: {drop_summary(drops)})", path)
    dist = trace.distributedInfo if isinstance(trace.distributedInfo, dict) else {}
    return ParsedRank(
        **tables,
        devices=_devices(trace.deviceProperties),
        distributed_info=dist,
        cuda_runtime_version=_version(trace.cuda_runtime_version),
        cuda_driver_version=_version(trace.cuda_driver_version),
        trace_id=None if trace.trace_id is None else str(trace.trace_id),
        n_events=b.n_events,
        drops=drops,
        gpu_dropped=gpu_dropped,
    )


# ---------------------------------------------------------------------------------------------
# decoding


class _Fallback(Exception):
    """The streaming split could not be used: decode the whole document instead."""


# ---- the tolerant path (see "Tolerance rules" above): every value read as raw JSON text first


class _RawEvent(msgspec.Struct, gc=False):
    ph: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    cat: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    name: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    ts: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    dur: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    tid: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    args: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _RawArgs(msgspec.Struct, gc=False):
    correlation: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    external_id: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="External id")
    device: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    stream: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    grid: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    block: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    bytes: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_types: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Concrete Inputs")


class _RawTrace(msgspec.Struct):
    traceEvents: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815 - Kineto's key
    deviceProperties: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    distributedInfo: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)  # noqa: N815
    cuda_runtime_version: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    cuda_driver_version: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    trace_id: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)


class _Salvaged(list):
    """Events of a piece read under the tolerance rules, with what was dropped while reading them."""

    def __init__(self) -> None:
        super().__init__()
        self.drops: dict[str, int] = {}
        self.gpu_dropped = 0
        self.entries = 0  # entries of the array read, used or not

    def drop(self, reason: str, gpu: bool) -> None:
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.gpu_dropped += gpu


_EVENT = msgspec.json.Decoder(_Event)
_RAW_EVENT = msgspec.json.Decoder(_RawEvent)
_RAW_ARGS = msgspec.json.Decoder(_RawArgs)
_RAW_LIST = msgspec.json.Decoder(list[msgspec.Raw])
_RAW_TRACE = msgspec.json.Decoder(_RawTrace)
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_INT_TEXT = re.compile(rb"-?[0-9]+")
_GPU_KIND_SET = frozenset(GPU_KINDS)


def _number_text(raw: bytes) -> bytes | None:
    """The text of a JSON number, or of a string holding one; None for anything else."""
    if raw[:1] == b'"':
        if b"\\" in raw:  # an escaped string never spells a plain number
            return None
        raw = raw[1:-1]
    return raw if _NUMBER.fullmatch(raw) else None


def _raw_float(raw: bytes) -> float:
    """A number read as a float; NaN when the value is absent or not a number."""
    t = _number_text(raw)
    if t is None:
        return _NAN
    v = float(t)
    return v if v - v == 0 else _NAN  # float() gives inf past the double range


def _raw_int(raw: bytes) -> int | None:
    """A number whose value is an integer within int64; None otherwise."""
    t = _number_text(raw)
    if t is None:
        return None
    if _INT_TEXT.fullmatch(t):
        if len(t) > 20:  # past int64 (and past what int() converts at all)
            return None
        v = int(t)
    else:
        f = float(t)
        if not f.is_integer():
            return None
        v = int(f)
    return v if -(2**63) <= v < 2**63 else None


def _raw_str(raw: bytes) -> str | None:
    return msgspec.json.decode(raw) if raw[:1] == b'"' else None


def _salvage_args(raw: bytes) -> _Args | None:
    if raw[:1] != b"{":
        return None
    try:
        return _ARGS.decode(raw)
    except msgspec.ValidationError:
        pass
    r = _RAW_ARGS.decode(raw)
    n = _raw_float(bytes(r.bytes))
    return _Args(correlation=_raw_int(bytes(r.correlation)), external_id=_raw_int(bytes(r.external_id)),
                 device=_raw_int(bytes(r.device)), stream=_raw_int(bytes(r.stream)), grid=r.grid, block=r.block,
                 bytes=None if n != n else n, input_dims=r.input_dims, input_types=r.input_types,
                 concrete=r.concrete)


def _salvage_event(raw: bytes, out: _Salvaged) -> None:
    """Append one ``traceEvents`` entry that the typed decoder refused, read under the rules."""
    try:
        out.append(_EVENT.decode(raw))
        return
    except msgspec.ValidationError:
        pass
    try:
        r = _RAW_EVENT.decode(raw)
    except msgspec.ValidationError:  # not an object
        out.drop("not_object", False)
        return
    ph, cat = _raw_str(bytes(r.ph)) if r.ph else "", _raw_str(bytes(r.cat)) if r.cat else ""
    if ph != "X" or cat is None:
        return  # an event the analysis never uses: not checked
    kind = _KIND.get(cat.lower())
    if kind is None:
        return
    name = _raw_str(bytes(r.name)) if r.name else ""
    if name is None:
        out.drop("name", kind in _GPU_KIND_SET)
        return
    tid_raw = bytes(r.tid)
    tid: int | str = 0
    if tid_raw[:1] == b'"':
        tid = msgspec.json.decode(tid_raw)
    elif tid_raw:
        tid = _raw_int(tid_raw) or 0
    out.append(_Event(ph=ph, cat=cat, name=name, ts=_raw_float(bytes(r.ts)),
                      dur=_raw_float(bytes(r.dur)) if r.dur else 0.0, tid=tid,
                      args=_salvage_args(bytes(r.args))))


def _salvage(text: bytes | memoryview) -> _Salvaged:
    """The events of a JSON array of events that the typed decoder refused for a type."""
    out = _Salvaged()
    raws = _RAW_LIST.decode(text)
    out.entries = len(raws)
    for raw in raws:
        _salvage_event(bytes(raw), out)
    return out


class _NotATrace(Exception):
    pass


def _any(raw: msgspec.Raw) -> Any:
    try:
        return msgspec.json.decode(raw) if raw else None
    except (msgspec.ValidationError, msgspec.DecodeError):  # a number out of range
        return None


def _salvage_trace(data: bytes | memoryview) -> _Trace:
    """A document the typed decoder refused for a type, read under the rules (``_NotATrace``: it is
    no trace: the top level is not an object with a traceEvents array)."""
    try:
        r = _RAW_TRACE.decode(data)
    except msgspec.ValidationError:
        raise _NotATrace("the top level is not a JSON object") from None
    ev = bytes(r.traceEvents)
    if ev[:1] != b"[":
        raise _NotATrace("no traceEvents array")
    props = _any(r.deviceProperties)
    dist = _any(r.distributedInfo)

    def version(raw: msgspec.Raw) -> int | str | None:
        v = _any(raw)
        return v if isinstance(v, (int, str)) and not isinstance(v, bool) else None

    return _Trace(traceEvents=_salvage(ev), deviceProperties=props if isinstance(props, list) else [],
                  distributedInfo=dist if isinstance(dist, dict) else None,
                  cuda_runtime_version=version(r.cuda_runtime_version),
                  cuda_driver_version=version(r.cuda_driver_version), trace_id=version(r.trace_id))


def _decode_whole(data: bytes | memoryview, path: Path) -> _Trace:
    if data[:3] == _BOM:
        data = memoryview(data)[3:]
    try:
        try:
            return _DECODER.decode(data)
        except msgspec.ValidationError:
            return _salvage_trace(data)
    except _NotATrace as e:
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
        try:
            return _EVENTS.decode(text)
        except msgspec.ValidationError:  # a type the fast path refuses (the syntax is checked next)
            return _salvage(text)
    except (msgspec.DecodeError, RecursionError):
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
    header = bytes(buf[:head_end]).removeprefix(_BOM)
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
        try:
            trace = _DECODER.decode(header + trailer)
        except msgspec.ValidationError:
            trace = _salvage_trace(header + trailer)
    except (_NotATrace, msgspec.DecodeError, RecursionError):
        raise _Fallback from None
    if trace.traceEvents:
        raise _Fallback
    b.add(events)
    return _ranked(b, trace, path)


# ---------------------------------------------------------------------------------------------
# the native scanner (traceinspect/load/_kineto_scan.c): the same tables, without an object per event

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
        return _ranked(b, trace, path)
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
        return _ranked(b, trace, path)
    finally:
        if gc_was:
            gc.enable()
