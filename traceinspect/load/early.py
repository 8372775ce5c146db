"""Reading a trace set while the analysis modules import.

``analyze``, ``report`` and ``gate`` spend a good part of a second importing pandas, numpy and the
pipeline on one core before the loader reads a byte. :func:`start`, called first by those commands,
finds the rank files as the loader will and, when the loader will read them in this process (the local
executor, one parse process: see :func:`~traceinspect.load.raw.parse_processes`), reads them on one daemon thread, file by file in the loader's
order and at most one file ahead of it: with the cache on, it hashes a file first and stops there when the cache holds its tables;
otherwise it reads, hashes (beside the read) and scans it with the native scanner. The loader then
:func:`take` s each file's (digest, size, scanner result), or the error its read raised, and does the
rest as always: tables, cache store (never written from the thread), linking. Results not taken are
dropped. Imports only light modules (no numpy, pandas or msgspec).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from traceinspect.load import cache
from traceinspect.load.discover import discover
from traceinspect.load.raw import Sha256Beside, Stopped, _sha256, native_available, parse_processes, read_scan

Read = tuple[str, int, dict[str, Any] | None]  # digest, size, scanner result (None: in the cache)


class _Item:
    """One file's early read: done once the thread is through with it (or has given up)."""

    __slots__ = ("done", "taken", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.taken = threading.Event()
        self.value: Read | None = None
        self.error: BaseException | None = None


class _Plan:
    """The files read early, for one cache root (None: the cache is off), on one thread."""

    def __init__(self, files: list[Path], root: Path | None) -> None:
        self.root = root
        self.pid = os.getpid()
        self.order = [(p, _Item()) for p in files]
        self.items = {p.resolve(): item for p, item in self.order}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="traceinspect-early-read", daemon=True)

    def _run(self) -> None:
        try:
            for i, (path, item) in enumerate(self.order):
                if i:  # one file ahead of the loader at most: a scanner result is as large as the tables
                    self.order[i - 1][1].taken.wait()
                if self.stop.is_set():
                    return
                try:
                    item.value = read(path, self.root, self.stop)
                except Stopped:
                    return
                except Exception as e:  # noqa: BLE001 - the loader raises it when it comes to this file
                    item.error = e
                    return  # the loader stops at this file
                finally:
                    item.done.set()
        finally:
            for _, item in self.order:
                item.done.set()


def read(path: Path, root: Path | None, stop: threading.Event | None = None) -> Read:
    """The read of one rank file before its tables are built, for cache root ``root`` (None: no cache):
    with the cache on, the file is hashed first and not scanned when the cache holds its tables; without
    it, it is hashed beside the read. Here or on the early-read thread (which gives ``stop``), the same."""
    if root is None:
        hasher = Sha256Beside()
        try:
            res = read_scan(path, hasher, stop)
        finally:
            digest = hasher.hexdigest()
        return digest, path.stat().st_size, res
    digest = _sha256(path)
    size = path.stat().st_size
    if stop is not None and stop.is_set():
        raise Stopped
    if cache.has_entry(root, digest):
        return digest, size, None
    return digest, size, read_scan(path, None, stop)


_plan: _Plan | None = None


def start(paths: Sequence[str | Path], *, use_cache: bool, jobs: int | None, executor: str,
          phase: str = "decode") -> None:
    """Start reading the rank files of ``paths`` beside this thread, where the loader will read them in
    this process; otherwise (or when the paths cannot be resolved: the loader reports that) do nothing."""
    global _plan
    drop()  # an earlier start's reads
    _memory_settings()
    if executor != "local" or not native_available():
        return
    try:
        files = [f.path for f in discover(list(paths), phase=phase).files]
    except Exception:  # noqa: BLE001 - the loader finds the same problem and reports it
        return
    if not files or parse_processes(len(files), jobs) > 1:
        return  # several files on several processes: nothing runs beside the imports
    _plan = _Plan(files, cache.cache_dir() if use_cache else None)
    _plan.thread.start()


def _memory_settings() -> None:
    """Memory settings for a command's one large read and the analysis of its tables (a short-lived
    process whose large arrays are mostly written once and read a few times). On Linux, glibc's
    allocator gets:

    * one arena: glibc gives a thread that allocates its own arena, and the scanner's column buffers,
      grown on the read thread and freed once the tables are built, would stay mapped there beside the
      main thread's heap (about 150 MB more peak memory for a 1 GB rank file). With one arena the main
      thread reuses them.
    * blocks under 32 MB (the most glibc allows) from the heap, and freed heap memory kept up to 512 MB:
      by default a freed block of a few MB is given back to the kernel and the next one is mapped and
      zeroed page by page again (a 1 GB rank file's read blocks, column buffers and table columns took
      about 150,000 page faults; a third fewer with these settings, for the same peak memory).

    and numpy does not ask for transparent huge pages for its arrays (``NUMPY_MADVISE_HUGEPAGE=0``, unless
    set): each new array of 4 MB or more is then faulted in 2 MB at a time, which made the analysis of a
    1 GB rank file's tables about 0.2 s slower than with 4 kB pages. Huge pages pay off for arrays that
    live long and are read many times, which these are not."""
    if "NUMPY_MADVISE_HUGEPAGE" not in os.environ:
        np = sys.modules.get("numpy")
        if np is None:
            os.environ["NUMPY_MADVISE_HUGEPAGE"] = "0"  # read once, when numpy is imported
        else:
            with contextlib.suppress(AttributeError):  # another numpy layout: left as it is
                np._core.multiarray._set_madvise_hugepage(False)
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.mallopt(-8, 1)  # M_ARENA_MAX (glibc); other C libraries have no mallopt
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD
        libc.mallopt(-1, 512 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def take(path: Path, root: Path | None) -> Read | None:
    """The early read of ``path`` for cache root ``root``, waiting for it if it is under way; None when
    there is none. The error the read raised is raised here."""
    plan = _plan
    if plan is None or plan.pid != os.getpid() or plan.root != root:
        return None
    try:
        item = plan.items.pop(path.resolve(), None)
    except OSError:
        return None
    if item is None:
        return None
    item.taken.set()
    item.done.wait()
    if item.error is not None:
        raise item.error
    value, item.value = item.value, None  # the scanner result is the loader's now: it frees it with its tables
    return value


def drop() -> None:
    """Give up the early reads not taken: the thread ends at its next block, and has ended on return
    (so that no process is forked while it runs)."""
    global _plan
    plan, _plan = _plan, None
    if plan is None or plan.pid != os.getpid():
        return
    plan.stop.set()
    for _, item in plan.order:
        item.taken.set()  # (the thread may be waiting for the loader to take the file before)
    plan.thread.join()
