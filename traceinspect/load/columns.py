"""The column tables of one rank file and the typed events they are built from (the msgspec path;
the native scanner fills the same columns). The tolerance rules are in :mod:`traceinspect.load.parse`."""

from __future__ import annotations

import math
import re
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import numpy as np

from traceinspect.errors import TraceInputError
from traceinspect.load.raw import _KIND, _KINDS, GPU_KINDS, PY_FORWARD_FUNCTIONS, _py_marker  # noqa: F401
from traceinspect.model import (
    ANNOTATION_COLUMNS,
    CPU_OP_COLUMNS,
    GPU_ANNOTATION_COLUMNS,
    KERNEL_COLUMNS,
    RUNTIME_COLUMNS,
    DeviceInfo,
)
from traceinspect.tables import dense_codes

if TYPE_CHECKING:
    import pandas as pd

# ids land in int64 columns: a larger value is a validation error, not an OverflowError later
_I64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
# no real event lasts a day: Kineto writes ~1.8e16 when an end time underflows; such events are dropped
MAX_DUR_US = 86_400e6
# nor does a profile span a day: an event whose ts lies further than this from the file's median ts is
# unusable (a ts of -1e18 or 1e18 would otherwise stretch its step to ~1e18 us, where float64 keeps
# no microseconds and differences of such times overflow or lose the step's own durations)
MAX_TS_FROM_MEDIAN_US = 86_400e6
MAX_BAD_GPU_SHARE = 0.01  # more dropped GPU events than this share: the file is not read
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



_DECODER = msgspec.json.Decoder(_Trace)
_EVENTS = msgspec.json.Decoder(list[_Event])
_ARGS = msgspec.json.Decoder(_Args)


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
    "ts": "with no usable ts (not a number, or over a day from the file's median ts)",
}





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
    except TypeError:  # None present (exactly, not through floats: ids beyond 2**53 stay as written)
        return np.fromiter((-1 if v is None else v for v in values), dtype=np.int64, count=len(values))


def _tids(values: list[Any]) -> np.ndarray:
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError):
        return np.array([_tid(t) for t in values], dtype=np.int64)


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



class _Coded:
    """An object column as integer codes into a table of values (the native scanner's strings): filtering
    and sorting move the codes, and the objects are made once, in the table's final row order."""

    __slots__ = ("codes", "values")

    def __init__(self, codes: np.ndarray, values: np.ndarray) -> None:
        self.codes, self.values = codes, values

    def __len__(self) -> int:
        return len(self.codes)

    def __getitem__(self, rows: np.ndarray) -> _Coded:
        return _Coded(self.codes[rows], self.values)

    def objects(self) -> np.ndarray:
        return self.values[self.codes]


def _objects(vals: list[Any]) -> np.ndarray | _Coded:
    """One object column from the pieces of several kinds (lists, object arrays or :class:`_Coded`)."""
    vals = [v for v in vals if len(v)]
    if not vals:
        return np.empty(0, dtype=object)
    if all(isinstance(v, _Coded) and v.values is vals[0].values for v in vals):
        return vals[0] if len(vals) == 1 else _Coded(np.concatenate([v.codes for v in vals]), vals[0].values)
    arrs = [v.objects() if isinstance(v, _Coded) else v if isinstance(v, np.ndarray) else np.array(v, dtype=object)
            for v in vals]
    return arrs[0] if len(arrs) == 1 else np.concatenate(arrs)


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


class InvalidText(ValueError):
    """Text of the document that is not valid UTF-8, found while the tables are built."""


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
        self.name_codes: dict[str, _Coded] = {}  # table -> its name column as codes (native scan)

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
                        try:
                            v = smemo[b] = intern(b.decode())
                        except UnicodeDecodeError:  # (kept raw by the decoder: its UTF-8 is checked here)
                            raise InvalidText("invalid UTF-8 in a string") from None
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

    def _ts_range(self) -> tuple[float, float] | None:
        """The usable timestamps, [median - MAX_TS_FROM_MEDIAN_US, median + MAX_TS_FROM_MEDIAN_US] over the
        finite ts of every used event of the file; None (any finite ts) when they all lie within a day of
        each other (the usual case: the median is then not needed)."""
        parts = [a for c in self.kinds.values() for a in c.cols.get("ts", []) if len(a)]
        with np.errstate(invalid="ignore"):
            lows = [float(np.nanmin(a)) for a in parts if not np.isnan(a).all()]
            highs = [float(np.nanmax(a)) for a in parts if not np.isnan(a).all()]
        lo, hi = min(lows, default=0.0), max(highs, default=0.0)
        if math.isfinite(lo) and math.isfinite(hi) and hi - lo <= MAX_TS_FROM_MEDIAN_US:
            return None
        ts = np.concatenate(parts)
        ts = ts[np.isfinite(ts)]
        if not len(ts):
            return None
        mid = float(np.median(ts))
        return mid - MAX_TS_FROM_MEDIAN_US, mid + MAX_TS_FROM_MEDIAN_US

    def frames(self) -> tuple[dict[str, pd.DataFrame], dict[str, int], int]:
        """The five tables, the events dropped by reason, and how many of those were GPU events."""
        import pandas as pd

        drops = dict(self.drops)
        gpu_dropped = self.gpu_dropped
        out: dict[str, pd.DataFrame] = {}
        ts_range = self._ts_range()

        def frame(table: str, columns: list[str], kinds: list[str], by_ts: bool = False) -> pd.DataFrame:
            """The table of ``kinds`` (in order; ``by_ts``: rows sorted by ts, ties in that order)."""
            nonlocal gpu_dropped
            data: dict[str, Any] = {}
            for col in columns:
                if col in ("rank", "end", "kind"):
                    continue
                dtype = object if col in _OBJECT_COLUMNS else (np.float64 if col in ("ts", "dur", "bytes") else np.int64)
                vals = [self.kinds[k].get(col, dtype) for k in kinds]
                if dtype is object:
                    data[col] = _objects(vals)
                else:
                    data[col] = vals[0] if len(vals) == 1 else np.concatenate(vals)
            n = len(data["ts"])
            if "kind" in columns:
                sizes = [len(self.kinds[k].get("ts", np.float64)) for k in kinds]
                codes = np.repeat(np.arange(len(kinds), dtype=np.int8), sizes)
                data["kind"] = pd.Categorical.from_codes(codes, categories=GPU_KINDS)
            ts, dur = data["ts"], data["dur"]
            ts_ok = np.isfinite(ts) if ts_range is None else (ts >= ts_range[0]) & (ts <= ts_range[1])
            ok = ts_ok & np.isfinite(dur) & (dur >= 0) & (dur <= MAX_DUR_US)
            if not ok.all():
                n_ts = int(n - ts_ok.sum())
                n_dur = int(n - ok.sum()) - n_ts
                for r, k in (("ts", n_ts), ("dur", n_dur)):
                    if k:
                        drops[r] = drops.get(r, 0) + k
                if kinds is GPU_KINDS:
                    gpu_dropped += n_ts + n_dur
                data = {k: v[ok] for k, v in data.items()}
            if by_ts and len(data["ts"]):
                order = np.argsort(data["ts"], kind="stable")
                if (order != np.arange(len(order))).any():
                    data = {k: v[order] for k, v in data.items()}
            data["end"] = data["ts"] + data["dur"]
            if isinstance(data["name"], _Coded):
                self.name_codes[table] = data["name"]
            for c in _OBJECT_COLUMNS:
                if c in data:  # object columns stay object (a bare array of str would become str dtype)
                    v = data[c]
                    data[c] = pd.Series(v.objects() if isinstance(v, _Coded) else v, dtype=object, copy=False)
            return pd.DataFrame({c: data[c] for c in columns if c != "rank"}, copy=False)

        out["kernels"] = frame("kernels", KERNEL_COLUMNS, GPU_KINDS, by_ts=True)
        out["runtime"] = frame("runtime", RUNTIME_COLUMNS, ["runtime"])
        out["cpu_ops"] = frame("cpu_ops", CPU_OP_COLUMNS, ["cpu_op"])
        out["annotations"] = frame("annotations", ANNOTATION_COLUMNS, ["annotation"])
        out["gpu_annotations"] = frame("gpu_annotations", GPU_ANNOTATION_COLUMNS, ["gpu_annotation"])
        return out, drops, gpu_dropped


_MISSING: Any = object()
_OBJECT_COLUMNS = ("name", "grid", "block", "input_dims", "input_types", "concrete")


def _ranked(b: _Builder, trace: _Trace, path: Path) -> ParsedRank:
    tables, drops, gpu_dropped = b.frames()
    n_gpu = len(tables["kernels"]) + gpu_dropped
    if gpu_dropped and gpu_dropped > MAX_BAD_GPU_SHARE * n_gpu:
        raise TraceInputError(f"{gpu_dropped} of {n_gpu} GPU events are unusable, more than "
                              f"{MAX_BAD_GPU_SHARE:.0%} (dropped: {drop_summary(drops)})", path)
    dist = trace.distributedInfo if isinstance(trace.distributedInfo, dict) else {}
    parsed = ParsedRank(
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
    if b.name_codes:  # not a field: neither cached nor compared
        parsed._name_codes = b.name_codes  # type: ignore[attr-defined]
    return parsed


def take_name_codes(p: ParsedRank, table: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(codes, uniques) of a table's name column as the native scan numbered its strings (uniques: only the
    names present; two may be equal texts), once, or None (tables from the cache or the msgspec path)."""
    coded = getattr(p, "_name_codes", {}).pop(table, None)
    if coded is None or len(coded) != len(getattr(p, table)):
        return None
    codes, used = dense_codes(coded.codes, len(coded.values))
    return codes, coded.values[used]


