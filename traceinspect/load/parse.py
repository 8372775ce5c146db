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
  and within a day (``MAX_TS_FROM_MEDIAN_US``) of the median of the file's finite ``ts`` over all used
  events (a kernel at ``ts = -1e18`` is no time of this profile) (reason ``ts``); ``dur`` a number (absent: 0), finite, >= 0 and at most a day (``MAX_DUR_US``:
  Kineto writes ~1.8e16 when an end time underflows) (reason ``dur``).
* Reporting. ``ParsedRank.drops`` maps reason -> count (``gpu_dropped``: how many of those were
  GPU events); the load stage turns them into one warning per file naming the counts.
"""

from __future__ import annotations

import contextlib
import gc
import re
from collections.abc import Iterator
from pathlib import Path

import msgspec

from traceinspect.errors import TraceInputError
from traceinspect.load.columns import (  # noqa: F401 - the tables' names, importable from here
    _DECODER,
    _EVENTS,
    _MISSING,
    MAX_BAD_GPU_SHARE,
    MAX_DUR_US,
    InvalidText,
    ParsedRank,
    _Builder,
    _Event,
    _ranked,
    _tid,
    drop_summary,
)
from traceinspect.load.native import _native, _scan_native, native_available, tables_native  # noqa: F401
from traceinspect.load.raw import (  # noqa: F401 - the raw read, importable from here
    _KIND,
    _KINDS,
    _ZLIB_ERRORS,
    BLOCK,
    GPU_KINDS,
    PIECE,
    PY_FORWARD_FUNCTIONS,
    THREAD_MIN,
    _blocks,
    _open,
    _read,
    _threaded,
    _truncated,
    _zlib,
    read_scan,
)
from traceinspect.load.salvage import _decode_whole, _NotATrace, _salvage, _salvage_trace

_BOM = b"\xef\xbb\xbf"

_HEAD = re.compile(rb'"traceEvents"\s*:\s*\[')
_WS = b" \t\r\n"



# ---------------------------------------------------------------------------------------------
# reading (the block reader is traceinspect.load.raw's)


def read_bytes(path: Path) -> bytes:
    """Read a ``.json`` or ``.json.gz`` file, turning I/O and gzip failures into TraceInputError."""
    return b"".join(_blocks(Path(path)))


# ---------------------------------------------------------------------------------------------
# decoding


class _Fallback(Exception):
    """The streaming split could not be used: decode the whole document instead."""



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



@contextlib.contextmanager
def _text_errors(path: Path) -> Iterator[None]:
    """Invalid UTF-8 met while the tables are built reads as the decoder's own error would."""
    try:
        yield
    except InvalidText as e:
        raise TraceInputError(f"not valid JSON: {e}", path) from None


def parse_bytes(data: bytes, path: Path) -> ParsedRank:
    """Decode the JSON text of one rank file into tables."""
    gc_was = gc.isenabled()
    gc.disable()  # millions of small objects: the collector would only rescan them
    try:
        with _text_errors(path):
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


def parse_file(path: str | Path) -> ParsedRank:
    """Read and decode one rank file."""
    path = Path(path)
    if native_available():
        return parse_file_native(path)
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
            with _text_errors(path):
                return _parse_stream(blocks, path)
        except _Fallback:
            pass
        finally:
            blocks.close()
    finally:
        if gc_was:
            gc.enable()
    return parse_bytes_whole(read_bytes(path), path)


def parse_file_native(path: str | Path) -> ParsedRank:
    """Read and scan one rank file with the native scanner."""
    path = Path(path)
    return tables_native(read_scan(path), path)


def parse_bytes_whole(data: bytes, path: Path) -> ParsedRank:
    """Decode a whole document in one call (the reference path the streaming reader must agree with)."""
    gc_was = gc.isenabled()
    gc.disable()
    try:
        trace = _decode_whole(data, path)
        b = _Builder()
        with _text_errors(path):
            b.add(trace.traceEvents)
        trace.traceEvents = []
        del data
        return _ranked(b, trace, path)
    finally:
        if gc_was:
            gc.enable()
