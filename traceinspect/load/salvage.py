"""The tolerant path: a document or piece that the typed decoder refused for a type, read again under
the tolerance rules of :mod:`traceinspect.load.parse` (every value read as raw JSON text first)."""

from __future__ import annotations

import re
from json.decoder import scanstring
from pathlib import Path
from typing import Any

import msgspec

from traceinspect.errors import TraceInputError
from traceinspect.load.columns import (
    _ARGS,
    _DECODER,
    _KIND,
    GPU_KINDS,
    _Args,
    _Event,
    _Salvaged,
    _Trace,
)

_BOM = b"\xef\xbb\xbf"
_NAN = float("nan")


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


# the event members whose text the typed decoder and the native scanner decode wherever they stand: a
# repeated key is read at each of its places (the value kept is the last), so each must be valid UTF-8
_TEXT_KEYS = frozenset({"ph", "cat", "name", "tid"})


def _check_text_members(raw: bytes) -> None:
    """Raise ``msgspec.DecodeError`` where a string of a :data:`_TEXT_KEYS` member of this event object is
    not valid UTF-8, at any of the key's places (the raw decoder keeps only the last). ``raw`` is an object
    the raw decoder has read (its syntax is sound)."""
    text = raw.decode("latin-1")  # one character per byte: positions are byte offsets
    i = _ws(text, 0) + 1  # past '{'
    while True:
        i = _ws(text, i)
        if text[i] == "}":
            return
        key, i = scanstring(text, i + 1, False)
        i = _ws(text, _ws(text, i) + 1)  # past ':'
        if text[i] == '"':
            end = scanstring(text, i + 1, False)[1]
            if key in _TEXT_KEYS:
                try:
                    raw[i:end].decode()
                except UnicodeDecodeError:
                    raise msgspec.DecodeError("Invalid UTF-8 encoded string") from None
            i = end
        else:
            i = _value_end(text, i)
        i = _ws(text, i)
        if text[i] == ",":
            i += 1


def _ws(text: str, i: int) -> int:
    while text[i] in " \t\r\n":
        i += 1
    return i


def _value_end(text: str, i: int) -> int:
    """The position after the JSON value (not a string) at ``i``, nested values walked without recursion."""
    depth = 0
    while True:
        c = text[i]
        if c == '"':
            i = scanstring(text, i + 1, False)[1]
            continue
        if c in "[{":
            depth += 1
        elif c in "]}":
            if depth == 0:
                return i
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and (c == "," or c in " \t\r\n"):
            return i
        i += 1


def _salvage_event(raw: bytes, out: _Salvaged, check_text: bool = False) -> None:
    """Append one ``traceEvents`` entry that the typed decoder refused, read under the rules
    (``check_text``: the piece holds invalid UTF-8 somewhere, see :func:`_check_text_members`)."""
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
    if check_text:
        _check_text_members(raw)
    ph, cat = _raw_str(bytes(r.ph)) if r.ph else "", _raw_str(bytes(r.cat)) if r.cat else ""
    kind = _KIND.get(cat.lower()) if ph == "X" and cat is not None else None
    if kind is None:
        # an event the analysis never uses: not checked, except that the typed decoder reads its name and
        # tid strings (their UTF-8 too), so an invalid one raises msgspec.DecodeError here as well
        for raw in (bytes(r.name), bytes(r.tid)):
            if raw[:1] == b'"':
                msgspec.json.decode(raw)
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
    try:
        bytes(text).decode()
        check_text = False
    except UnicodeDecodeError:
        check_text = True
    for raw in raws:
        _salvage_event(bytes(raw), out, check_text)
    return out


class _NotATrace(Exception):
    pass


def _any(raw: msgspec.Raw) -> Any:
    """A raw value decoded; None for one holding a number out of range. Invalid UTF-8 in it (a Raw is
    not checked for it) raises msgspec's DecodeError, as decoding the whole document does."""
    try:
        return msgspec.json.decode(raw) if raw else None
    except msgspec.ValidationError:  # a number out of range
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


