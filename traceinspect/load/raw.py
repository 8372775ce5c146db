"""The raw read of one rank file: its decompressed text in blocks, its SHA-256 on a thread once it is read,
and the native scanner's pass over the text into column buffers (:func:`read_scan`). Building the tables from
those buffers (numpy, msgspec, pandas) is :mod:`traceinspect.load.native`'s; this module imports only
the standard library, ISA-L and the compiled scanner."""

from __future__ import annotations

import importlib
import os
import queue
import re
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from traceinspect.errors import TraceInputError
from traceinspect.fileio import sha256_of

try:  # ISA-L inflates gzip 2-3x faster than zlib; optional
    from isal import isal_zlib as _zlib
except ImportError:  # pragma: no cover - depends on the environment
    _zlib = zlib  # type: ignore[assignment]

try:  # by name: import analysers cannot see a C extension and would count `from traceinspect.load import
    # _kineto_scan` as an import of this package by its own module
    _native = importlib.import_module("traceinspect.load._kineto_scan")
except ImportError:  # pragma: no cover - built by pip install; the msgspec path is the fallback
    _native = None

_ZLIB_ERRORS: tuple[type[Exception], ...] = (zlib.error, getattr(_zlib, "error", zlib.error))
# the type of a scanner result's column buffers (none without the compiled scanner)
COLUMN_TYPES: tuple[type, ...] = (_native.Column,) if _native is not None else ()

BLOCK = 1 << 20  # compressed bytes read at a time
PIECE = 8 << 20  # decompressed bytes decoded at a time
THREAD_MIN = 4 << 20  # files at least this large are inflated on a second thread
SPLIT_MIN = 64 << 20  # plain JSON files at least this large are scanned in two halves, on two threads

# ---------------------------------------------------------------------------------------------
# which events are kept (the tolerance rules are in traceinspect.load.parse)

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
    "trace": "annotation",  # Kineto's own span ("PyTorch Profiler (0)"): what the recording covers
}
_KINDS = ("kernel", "memcpy", "memset", "runtime", "cpu_op", "annotation", "gpu_annotation")
# python_function events (with_stack captures) kept, as annotations, when the function name (after
# the last "): ") is one of these: a serving engine's forward (vLLM's worker and model runner)
PY_FORWARD_FUNCTIONS = frozenset({"execute_model"})
GPU_KINDS = ["kernel", "memcpy", "memset"]

# the columns the scanner fills per kind (those _Builder._add_kind fills)
_GPU_COLS = ("name", "ts", "dur", "external_id", "correlation", "device", "stream", "grid", "block", "bytes")
_NATIVE_COLUMNS = {
    "kernel": _GPU_COLS, "memcpy": _GPU_COLS, "memset": _GPU_COLS,
    "runtime": ("name", "ts", "dur", "tid", "external_id", "correlation"),
    "cpu_op": ("name", "ts", "dur", "tid", "external_id", "input_dims", "input_types", "concrete"),
    "annotation": ("name", "ts", "dur", "tid"),
    "gpu_annotation": ("name", "ts", "dur"),
}


def parse_processes(n_files: int, jobs: int | None) -> int:
    """How many processes parse ``n_files`` rank files: ``jobs`` when given, else one per two CPUs (a
    parse keeps about two cores busy already: the scanner, and the inflate and hash threads beside it),
    never more than there are files."""
    if jobs is None:
        jobs = max(1, (os.cpu_count() or 1) // 2)
    return max(1, min(jobs, n_files))


def _py_marker(name: str) -> bool:
    return name.rpartition("): ")[2] in PY_FORWARD_FUNCTIONS


def _route(cat: str) -> int | None:
    """The scanner's kind of a category: a kind's index, -(index + 1) for python_function events
    (annotations, where :func:`_py_marker` accepts the name), or None (not kept)."""
    kind = _KIND.get(cat)
    if kind is None:
        kind = _KIND.get(cat.lower())
    if kind == "python_function":
        return -(_KINDS.index("annotation") + 1)
    return None if kind is None else _KINDS.index(kind)


def native_available() -> bool:
    """Whether the compiled scanner is importable (``TRACEINSPECT_NATIVE=0`` turns it off)."""
    return _native is not None and os.environ.get("TRACEINSPECT_NATIVE", "1") != "0"


def native_module() -> Any:
    """The compiled module (None when it is not built)."""
    return _native


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


def _sha256(path: Path) -> str:
    try:
        with path.open("rb") as f:
            return sha256_of(f)
    except FileNotFoundError:
        raise TraceInputError("no such file", path) from None
    except OSError as e:
        raise TraceInputError(f"cannot read file: {e.strerror or e}", path) from None


def _blocks(path: Path) -> Iterator[bytes]:
    """The decompressed text of a ``.json`` or ``.json.gz`` file, in blocks of about PIECE bytes."""
    with _open(path) as f:
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


def hash_later(f: Any, path: Path) -> Future[str]:
    """The SHA-256 (hex) of the open file ``f`` (closed when hashed), begun now on a thread of its own: called
    once a scan is over, so the hash runs beside the rest of the analysis, not beside the scan (on two cores
    a 1 GB rank file read in 1.22-1.29 s this way, 1.35-1.48 s hashed beside the scan). The file was opened
    before it was scanned, so the file hashed is the one scanned even if its name is taken away meanwhile."""
    fut: Future[str] = Future()

    def run() -> None:
        try:
            with f:
                fut.set_result(sha256_of(f))
        except OSError as e:
            fut.set_exception(TraceInputError(f"cannot read file: {e.strerror or e}", path))
        except BaseException as e:  # any other failure too: a future never set would leave its reader waiting
            fut.set_exception(e)

    threading.Thread(target=run, name="traceinspect-sha256", daemon=True).start()
    return fut


Digest = str | Future  # a file's SHA-256, or the hash under way that gives it


def hex_digest(d: Digest) -> str:
    """The hex digest of ``d``, waiting for it when it is still being computed."""
    return d if isinstance(d, str) else d.result()


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


# ---------------------------------------------------------------------------------------------
# scanning


def _scanner(**kw: Any) -> Any:
    assert _native is not None
    return _native.Scanner([_NATIVE_COLUMNS[k] for k in _KINDS], _route, [_KINDS.index(k) for k in GPU_KINDS],
                           _py_marker, **kw)


def _scan_error(e: Exception, path: Path) -> TraceInputError:
    kind, msg = e.args
    return TraceInputError(f"not valid JSON: {msg}" if kind == "json" else f"not a Kineto trace: {msg}", path)


def scan(blocks: Iterator[bytes], path: Path) -> dict[str, Any]:
    """Feed a document's blocks to the native scanner; its result (column buffers, strings, counts and
    the top-level keys' raw text). Malformed text raises TraceInputError."""
    assert _native is not None
    s = _scanner()
    try:
        for block in blocks:
            s.feed(block)
        s.feed(b"", final=True)
    except _native.ScanError as e:
        raise _scan_error(e, path) from None
    return s.result()


# an entry of an array of objects ending, and the next one beginning on a new line: a raw newline is
# never inside a JSON string, so the braces and the comma here are the document's own
_ENTRY_BREAK = re.compile(rb"\},[ \t\r]*\n[ \t\r\n]*\{")


def split_point(path: Path) -> int | None:
    """Where the scan of a plain JSON rank file of SPLIT_MIN bytes or more is split in two, on a machine
    of two CPUs or more: the offset of the first entry of an array of objects to begin on a line of its
    own after the middle of the file (Kineto writes one event per line group), found within 1 MB; None
    for a smaller or gzipped file, or one with no such place. Whether the place is between two entries of
    traceEvents is known only once the first half is scanned (:func:`_scan_split`)."""
    if _native is None or (os.cpu_count() or 1) < 2 or not hasattr(os, "pread"):
        return None
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < SPLIT_MIN or f.read(2) == b"\x1f\x8b":
                return None
            mid = size // 2
            m = _ENTRY_BREAK.search(os.pread(f.fileno(), 1 << 20, mid))
    except OSError:
        return None  # the read proper reports it
    return None if m is None else mid + m.end() - 1


def _pread_blocks(fd: int, start: int, stop: int | None, path: Path) -> Iterator[bytes]:
    """The bytes of the open file ``fd`` from ``start`` to ``stop`` (None: its end), PIECE at a time."""
    at = start
    while stop is None or at < stop:
        n = PIECE if stop is None else min(PIECE, stop - at)
        try:
            data = os.pread(fd, n, at)
        except OSError as e:
            raise TraceInputError(f"cannot read file: {e.strerror or e}", path) from None
        if not data:
            return
        yield data
        at += len(data)


def _scan_split(path: Path, at: int) -> dict[str, Any]:
    """:func:`scan` of a plain JSON file as two halves on two threads: this one scans the text before
    ``at``, a second one the rest, as the rest of traceEvents. When the first half ends between two
    events (and the second scanned to the end of the document, without a second traceEvents key), the
    second's tables are joined to the first's: the result is the one scanning the whole file gives. Else
    (the place was not between two events, or the second half failed) this thread scans the rest itself,
    so a malformed document fails with the message the whole scan gives."""
    assert _native is not None
    halt = threading.Event()
    with _open(path) as f:
        fd = f.fileno()

        def feed(s: Any, start: int, end: int | None) -> None:
            """Feed s the file's bytes from start to end (None: to the end of the document)."""
            for block in _pread_blocks(fd, start, end, path):
                if halt.is_set():
                    raise _Halted
                s.feed(block)
            if end is None:
                s.feed(b"", final=True)

        first, rest = _scanner(), _scanner(inside_events=True, offset=at)
        done: list[bool] = []

        def second(s: Any) -> None:
            try:
                feed(s, at, None)
                done.append(True)
            except Exception:  # noqa: BLE001 - a stop, or an error the first thread's scan finds as well
                pass

        t = threading.Thread(target=second, args=(rest,), name="traceinspect-scan-rest", daemon=True)
        t.start()
        try:
            try:
                feed(first, 0, at)
            except BaseException:
                halt.set()  # the second half is of no use now
                raise
            finally:
                t.join()
            if done and first.at_event_boundary():
                try:
                    first.join(rest)  # refused, nothing changed: the rest had a traceEvents key of its own
                except ValueError:
                    pass
                else:
                    return first.result()
            del rest
            feed(first, at, None)
        except _native.ScanError as e:
            raise _scan_error(e, path) from None
        return first.result()


class _Halted(Exception):
    """The second half of a split scan given up (the first half failed)."""


def read_scan(path: Path) -> dict[str, Any]:
    """Read one rank file and :func:`scan` it; a large file is inflated on a second thread, and a large
    plain one scanned in two halves on two threads (at :func:`split_point`)."""
    at = split_point(path)
    if at is not None:
        return _scan_split(path, at)
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    blocks = _blocks(path)
    if size >= THREAD_MIN:
        blocks = _threaded(blocks)
    try:
        return scan(blocks, path)
    finally:
        blocks.close()
