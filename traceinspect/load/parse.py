"""Decode one Kineto Chrome-trace file into column tables.

A typed msgspec decoder reads only the fields the analysis uses; shape arguments of CPU ops stay
raw JSON bytes until a measure stage asks for them.
"""

from __future__ import annotations

import gc
import gzip
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.errors import TraceInputError
from traceinspect.model import (
    ANNOTATION_COLUMNS,
    CPU_OP_COLUMNS,
    GPU_ANNOTATION_COLUMNS,
    KERNEL_COLUMNS,
    RUNTIME_COLUMNS,
    DeviceInfo,
)

_NO_RAW = msgspec.Raw()


class _Args(msgspec.Struct):
    correlation: int | None = None
    external_id: int | None = msgspec.field(default=None, name="External id")
    device: int | None = None
    stream: int | None = None
    grid: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    block: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw)
    bytes: int | float | None = None
    input_dims: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input Dims")
    input_types: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Input type")
    concrete: msgspec.Raw = msgspec.field(default_factory=msgspec.Raw, name="Concrete Inputs")


class _Event(msgspec.Struct):
    ph: str = ""
    cat: str = ""
    name: str = ""
    ts: float = 0.0
    dur: float = 0.0
    tid: int | str = 0
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

_DECODER = msgspec.json.Decoder(_Trace)


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


def read_bytes(path: Path) -> bytes:
    """Read a ``.json`` or ``.json.gz`` file, turning I/O and gzip failures into TraceInputError."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise TraceInputError("no such file", path) from None
    except OSError as e:
        raise TraceInputError(f"cannot read file: {e.strerror or e}", path) from None
    if data[:2] == b"\x1f\x8b":
        try:
            return gzip.decompress(data)
        except EOFError:
            raise TraceInputError("truncated gzip (the file ends before the end-of-stream marker; was the "
                                  "capture still being written?)", path) from None
        except (gzip.BadGzipFile, zlib.error, OSError) as e:
            raise TraceInputError(f"corrupt gzip: {e}", path) from None
    return data


def _raw(r: msgspec.Raw) -> bytes | None:
    return bytes(r) if len(r) else None


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


def _frame(columns: list[str], data: dict[str, Any]) -> pd.DataFrame:
    cols = {c: data[c] for c in columns if c not in ("rank", "end")}
    cols["name"] = pd.Series(cols["name"], dtype=object)  # stays a string column when empty
    df = pd.DataFrame(cols)
    df["end"] = df["ts"] + df["dur"]
    return df[[c for c in columns if c != "rank"]]


def _tid(t: int | str) -> int:
    if isinstance(t, int):
        return t
    try:
        return int(t)
    except ValueError:
        return hash(t) & 0x7FFFFFFF


def parse_bytes(data: bytes, path: Path) -> ParsedRank:
    """Decode the JSON text of one rank file into tables."""
    gc_was = gc.isenabled()
    gc.disable()  # millions of small structs: the collector would only rescan them
    try:
        try:
            trace = _DECODER.decode(data)
        except msgspec.ValidationError as e:
            raise TraceInputError(f"not a Kineto trace: {e}", path) from None
        except msgspec.DecodeError as e:
            raise TraceInputError(f"not valid JSON: {e}", path) from None
        return _tables(trace, path)
    finally:
        if gc_was:
            gc.enable()


def _tables(trace: _Trace, path: Path) -> ParsedRank:
    groups: dict[str, list[_Event]] = {
        "kernel": [], "memcpy": [], "memset": [], "runtime": [], "cpu_op": [],
        "annotation": [], "gpu_annotation": [],
    }
    dropped = 0
    for ev in trace.traceEvents:
        if ev.ph != "X":
            continue
        kind = _KIND.get(ev.cat) or _KIND.get(ev.cat.lower())
        if kind is None:
            continue
        if not (np.isfinite(ev.ts) and np.isfinite(ev.dur)) or ev.dur < 0:
            dropped += 1
            continue
        groups[kind].append(ev)

    gpu = groups["kernel"] + groups["memcpy"] + groups["memset"]
    kinds = (["kernel"] * len(groups["kernel"]) + ["memcpy"] * len(groups["memcpy"])
             + ["memset"] * len(groups["memset"]))
    none = _Args()
    ga = [e.args or none for e in gpu]
    kernels = _frame(KERNEL_COLUMNS, {
        "kind": pd.Categorical(kinds, categories=["kernel", "memcpy", "memset"]),
        "name": [e.name for e in gpu],
        "ts": np.array([e.ts for e in gpu], dtype=np.float64),
        "dur": np.array([e.dur for e in gpu], dtype=np.float64),
        "device": np.array([-1 if a.device is None else a.device for a in ga], dtype=np.int64),
        "stream": np.array([-1 if a.stream is None else a.stream for a in ga], dtype=np.int64),
        "correlation": np.array([-1 if a.correlation is None else a.correlation for a in ga], dtype=np.int64),
        "external_id": np.array([-1 if a.external_id is None else a.external_id for a in ga], dtype=np.int64),
        "grid": [bytes(a.grid).decode() if len(a.grid) else "" for a in ga],
        "block": [bytes(a.block).decode() if len(a.block) else "" for a in ga],
        "bytes": np.array([-1 if a.bytes is None else a.bytes for a in ga], dtype=np.float64),
    })
    if len(kernels):
        kernels = kernels.sort_values("ts", kind="stable").reset_index(drop=True)

    rt = groups["runtime"]
    ra = [e.args or none for e in rt]
    runtime = _frame(RUNTIME_COLUMNS, {
        "name": [e.name for e in rt],
        "ts": np.array([e.ts for e in rt], dtype=np.float64),
        "dur": np.array([e.dur for e in rt], dtype=np.float64),
        "tid": np.array([_tid(e.tid) for e in rt], dtype=np.int64),
        "correlation": np.array([-1 if a.correlation is None else a.correlation for a in ra], dtype=np.int64),
        "external_id": np.array([-1 if a.external_id is None else a.external_id for a in ra], dtype=np.int64),
    })

    ops = groups["cpu_op"]
    oa = [e.args or none for e in ops]
    cpu_ops = _frame(CPU_OP_COLUMNS, {
        "name": [e.name for e in ops],
        "ts": np.array([e.ts for e in ops], dtype=np.float64),
        "dur": np.array([e.dur for e in ops], dtype=np.float64),
        "tid": np.array([_tid(e.tid) for e in ops], dtype=np.int64),
        "external_id": np.array([-1 if a.external_id is None else a.external_id for a in oa], dtype=np.int64),
        "input_dims": [_raw(a.input_dims) for a in oa],
        "input_types": [_raw(a.input_types) for a in oa],
        "concrete": [_raw(a.concrete) for a in oa],
    })

    ann = groups["annotation"]
    annotations = _frame(ANNOTATION_COLUMNS, {
        "name": [e.name for e in ann],
        "ts": np.array([e.ts for e in ann], dtype=np.float64),
        "dur": np.array([e.dur for e in ann], dtype=np.float64),
        "tid": np.array([_tid(e.tid) for e in ann], dtype=np.int64),
    })
    gann = groups["gpu_annotation"]
    gpu_annotations = _frame(GPU_ANNOTATION_COLUMNS, {
        "name": [e.name for e in gann],
        "ts": np.array([e.ts for e in gann], dtype=np.float64),
        "dur": np.array([e.dur for e in gann], dtype=np.float64),
    })
    dist = trace.distributedInfo if isinstance(trace.distributedInfo, dict) else {}
    return ParsedRank(
        kernels=kernels,
        runtime=runtime,
        cpu_ops=cpu_ops,
        annotations=annotations,
        gpu_annotations=gpu_annotations,
        devices=_devices(trace.deviceProperties),
        distributed_info=dist,
        cuda_runtime_version=_version(trace.cuda_runtime_version),
        cuda_driver_version=_version(trace.cuda_driver_version),
        trace_id=None if trace.trace_id is None else str(trace.trace_id),
        n_events=len(trace.traceEvents),
        dropped=dropped,
    )


def parse_file(path: str | Path) -> ParsedRank:
    """Read and decode one rank file."""
    path = Path(path)
    return parse_bytes(read_bytes(path), path)
