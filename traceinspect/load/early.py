"""Reading a trace set while the analysis modules import.

``analyze``, ``report`` and ``gate`` spend a good part of a second importing pandas, numpy and the
pipeline on one core before the loader reads a byte. :func:`start`, called first by those commands,
finds the rank files as the loader will and, when the loader will read them in this process (the local
executor, one parse process: see :func:`~traceinspect.load.raw.parse_processes`), reads them beside it,
file by file in the loader's order and at most one file ahead of it: with the cache on, it hashes a file
first and stops there when the cache holds its tables; otherwise it reads, hashes (beside the read) and
scans it with the native scanner. On Linux, a first file of up to :data:`FORK_MAX` bytes is read by a
process forked for it (:class:`_ChildPlan`: a thread would slow the imports it runs beside), the later
files on one daemon thread (:class:`_Plan`, which reads them all otherwise). The loader then :func:`take`
s each file's (digest, size, scanner result), or the error its read raised, and does the rest as always:
tables, cache store (never written from the early read), linking. Results not taken are dropped.
A process may be given more work (``beside``: the CLI's shipped tables, then its rule set) for after its
file is read; each part's result comes through a pipe of its own (:func:`beside_result`, waited for only
as long as its caller says).
Imports only light modules (no numpy, pandas or msgspec).
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import select
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from traceinspect.load import cache
from traceinspect.load.discover import discover
from traceinspect.load.raw import (
    COLUMN_TYPES,
    Digest,
    Sha256After,
    Sha256Beside,
    Stopped,
    _sha256,
    gpu_event_names,
    native_available,
    parse_processes,
    read_scan,
    split_point,
)
from traceinspect.parallel import fork_with_pipe, reap_beside, receive, send

Read = tuple[Digest, int, dict[str, Any] | None]  # digest, size, scanner result (None: in the cache)


class _Item:
    """One file's early read: done once the thread is through with it (or has given up)."""

    __slots__ = ("done", "taken", "value", "error", "digest")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.taken = threading.Event()
        self.value: Read | None = None
        self.error: BaseException | None = None
        self.digest: Sha256After | None = None  # the hash to come (cache off), once the read has begun


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
                    item.value = read(path, self.root, self.stop, defer=True,
                                      begun=lambda d, item=item: setattr(item, "digest", d))
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

    def start(self) -> None:
        self.thread.start()

    def take(self, path: Path) -> Read | None:
        try:
            item = self.items.pop(path.resolve(), None)
        except OSError:
            return None
        if item is None:
            return None
        item.taken.set()
        if item.digest is not None:  # this thread waits from here: the core it leaves hashes the file
            item.digest.start()
        item.done.wait()
        if item.error is not None:
            raise item.error
        value, item.value = item.value, None  # the scanner result is the loader's now: it frees it with its tables
        return value

    def drop(self) -> None:
        self.stop.set()
        for _, item in self.order:
            item.taken.set()  # (the thread may be waiting for the loader to take the file before)
        self.thread.join()


class _ChildPlan:
    """The first file read early by a process forked for it; the later files by a :class:`_Plan`
    thread, begun when the loader takes the first (and reading while it builds that file's tables).

    A thread reading beside the imports costs them about a fifth more time on two cores: every mapping
    change the imports make (loading an extension module, freeing an arena) must then be flushed from
    the other core's TLB too, by an interrupt that a virtual machine makes slow; and the read's own
    threads (inflate, hash, scan) take turns with the imports for the cores. The process has mappings of
    its own and reads on one thread (read, hash, inflate and scan in turn: it is done before the imports
    are). Its result's column buffers come through a memory file, mapped copy-on-write (not copied);
    its strings and counts in a pickle through a pipe. A read that fails there is left to the loader,
    which reads that file itself and reports what it finds. The later files stay on a thread: there,
    the loader would have to fault in the buffers of every file itself."""

    def __init__(self, files: list[Path], root: Path | None, beside: Sequence[Callable[[list[str]], Any]] = ()) -> None:
        self.root = root
        self.pid = os.getpid()
        self.files = files
        self.first = files[0].resolve()
        self.beside = beside
        self.child: int | None = None  # (None once the process is the :class:`_Later`'s to end)
        self.fd = -1
        self.res_r = -1
        self.rest: _Plan | None = None

    def start(self) -> None:
        global _later
        self.fd = fd = os.memfd_create("traceinspect-read", os.MFD_CLOEXEC)
        pipes: list[tuple[int, int]] = []
        try:
            for _ in self.beside:
                pipes.append(os.pipe())
                _widen(pipes[-1][1])
            self.child, self.res_r = fork_with_pipe(partial(_read_then, fd, self.files[0], self.root, self.beside,
                                                            pipes))
        except OSError:
            for end in (e for pipe in pipes for e in pipe):
                os.close(end)
            raise
        for _, w in pipes:
            os.close(w)
        if pipes:  # (the last part's ends the process)
            _later = [_Later(self.child if i == len(pipes) - 1 else None, r) for i, (r, _) in enumerate(pipes)]
            self.child = None

    def take(self, path: Path) -> Read | None:
        if self.rest is not None:
            return self.rest.take(path)
        try:
            first = path.resolve() == self.first
        except OSError:
            return None
        if self.res_r < 0 or not first:
            return None  # (not the file the process read: the loader reads it itself)
        fd, self.res_r = self.res_r, -1
        status, value = receive(fd)  # (an error there: the loader reads the file itself and reports it)
        self._end()
        if status != "ok":
            return None
        digest, size, res, spans = value
        if res is not None:
            res["strings"] = [sys.intern(t) for t in res["strings"]]  # (as the scanner gives them)
            end = os.fstat(self.fd).st_size
            view = memoryview(mmap.mmap(self.fd, end, flags=mmap.MAP_PRIVATE,
                                        prot=mmap.PROT_READ | mmap.PROT_WRITE)) if end else None
            for (k, col), (off, n) in spans.items():
                res["kinds"][k][col] = view[off:off + n] if n and view is not None else bytearray()
        self._close_file()
        if len(self.files) > 1:  # the next files on a thread, while the loader builds this one's tables
            self.rest = _Plan(self.files[1:], self.root)
            self.rest.start()
        return digest, size, res

    def drop(self) -> None:
        self._end()
        self._close_file()
        if self.rest is not None:
            self.rest.drop()

    def _end(self) -> None:
        """The process stopped (if still running, and not the :class:`_Later`'s) and reaped beside; the
        pipe closed."""
        pid, self.child = self.child, None
        fd, self.res_r = self.res_r, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)  # (it is about to exit or has exited, unless the read was given up)
        reap_beside(pid)

    def _close_file(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class _Later:
    """One part of the ``beside`` work of an early-read process (:class:`_ChildPlan`): the pipe its result
    comes through, and the process, stopped and reaped once the result is read or given up."""

    def __init__(self, child: int | None, fd: int) -> None:
        self.pid = os.getpid()
        self.child: int | None = child
        self.fd = fd
        self.value: tuple[str, Any] | None = None
        self.taken = False

    def result(self, wait: float = 0.0) -> tuple[str, Any] | None:
        """``("ok", value)`` or ``("error", None)`` once it has come, the first time it is asked for after
        that; None while it has not come (waited for up to ``wait`` seconds), and once it is taken."""
        if self.taken:
            return None
        fd = self.fd
        if fd >= 0:
            try:
                ready = bool(select.select([fd], [], [], wait)[0])  # (the end of the pipe reads as ready too)
            except (OSError, ValueError):
                ready = True
            if not ready:
                return None
            self.fd = -1
            self.value = receive(fd)  # (the process sends it whole, then closes the pipe)
            self.end()
        self.taken = self.value is not None
        return self.value

    def end(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        pid, self.child = self.child, None
        if pid is not None:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)  # (it has exited, unless the result was given up)
            reap_beside(pid)


_later: list[_Later] = []  # the parts of the beside work not taken yet, in order

_PART_PIPE = 1 << 18


def _widen(fd: int) -> None:
    """Let the pipe ``fd`` hold a whole part of the beside work (about 60-90 kB; a pipe holds 64 kB), so
    that the process goes on to the next part before this one reads it (Linux; elsewhere, or over the
    system's limit, it keeps its size)."""
    import fcntl

    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, _PART_PIPE)


def _read_then(fd: int, path: Path, root: Path | None, beside: Sequence[Callable[[list[str]], Any]],
               pipes: list[tuple[int, int]], out: int) -> None:
    """The early-read process: the read of ``path`` (:func:`_store`) through ``out``, which is then closed
    (the loader reads it to its end), then each of ``beside`` in turn, given the distinct names of the
    file's GPU events, through its pipe (closed once written); each as ``("ok", value)`` or
    ``("error", None)``."""
    for r, _ in pipes:
        os.close(r)
    names: list[str] = []
    try:
        value = read(path, root, threads=False)
        res: tuple[str, Any] = ("ok", _store(fd, value))
    except BaseException:  # noqa: BLE001 - the loader reads the file itself and meets the real error
        res = ("error", None)
    send(out, res)
    os.close(out)
    if res[0] == "ok":
        with contextlib.suppress(Exception):  # (none: the work does without them)
            names = gpu_event_names(value[2])
    for work, (_, w) in zip(beside, pipes, strict=True):
        try:
            more: tuple[str, Any] = ("ok", work(names))
        except BaseException:  # noqa: BLE001 - the caller does the work itself and meets the real error
            more = ("error", None)
        with contextlib.suppress(OSError):  # (a closed pipe: the caller did without it)
            send(w, more)
            os.close(w)


def _store(fd: int, value: Read) -> tuple[str, int, dict[str, Any] | None, dict[tuple[int, str], tuple[int, int]]]:
    """A read with its column buffers written to the memory file ``fd`` (64-byte aligned) and taken out
    of the result: (digest, size, the rest of the result, (kind, column) -> (offset, length))."""
    digest, size, res = value
    spans: dict[tuple[int, str], tuple[int, int]] = {}
    if res is None:
        return digest, size, None, spans
    off = 0
    kinds = []
    for k, cols in enumerate(res["kinds"]):
        rest = {}
        for col, v in cols.items():
            if not isinstance(v, COLUMN_TYPES):
                rest[col] = v
                continue
            spans[(k, col)] = (off, len(v))
            view, at = memoryview(v), off
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            off += (len(v) + 63) & ~63
        kinds.append(rest)
    os.ftruncate(fd, off)
    return digest, size, {**res, "kinds": kinds}, spans


def read(path: Path, root: Path | None, stop: threading.Event | None = None, threads: bool = True,
         defer: bool = False, begun: Callable[[Sha256After], None] | None = None) -> Read:
    """The read of one rank file before its tables are built, for cache root ``root`` (None: no cache):
    with the cache on, the file is hashed first and not scanned when the cache holds its tables; without
    it, it is hashed beside the read, or with ``defer`` on a thread of its own begun once the scan is
    over or earlier by whoever starts the :class:`~traceinspect.load.raw.Sha256After` that is the digest
    then (given to ``begun`` before the scan starts). Here, on the early-read thread (which gives
    ``stop``) or in the early-read process, the same; ``threads=False`` reads, hashes, inflates and
    scans on this thread alone."""
    if root is None:
        if not threads:
            h = hashlib.sha256()
            res = read_scan(path, h.update, stop, threads=False)
            return h.hexdigest(), path.stat().st_size, res
        if defer:
            later = Sha256After(path)
            at = split_point(path)
            if begun is not None and at is None:  # (a split scan keeps both cores busy)
                begun(later)
            try:
                res = read_scan(path, None, stop, split=at)
            except BaseException:
                later.close()
                raise
            return later.start(), path.stat().st_size, res
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
    return digest, size, read_scan(path, None, stop, threads=threads)


_plan: _Plan | _ChildPlan | None = None


def start(paths: Sequence[str | Path], *, use_cache: bool, jobs: int | None, executor: str,
          phase: str = "decode", beside: Sequence[Callable[[list[str]], Any]] = ()) -> None:
    """Start reading the rank files of ``paths`` beside this thread, where the loader will read them in
    this process; otherwise (or when the paths cannot be resolved: the loader reports that) do nothing.
    ``beside``: more work for the early-read process once its file is read, when there is one, done in
    turn, each given the distinct names of the file's GPU events ([] when the read failed) and its result
    sent as soon as it is made (:func:`beside_result`); light work, of modules that import without
    pandas."""
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
    root = cache.cache_dir() if use_cache else None
    if _process_possible(files):
        child = _ChildPlan(files, root, beside)
        try:
            child.start()
        except OSError:  # no process (or memory file) to spare: a thread reads them
            child.drop()
        else:
            _plan = child
            return
    _plan = _Plan(files, root)
    _plan.start()


FORK_MAX = 16 << 20  # the first file's size (on disk) up to which the files are read by a process


def process_supported() -> bool:
    """Whether this platform can read in a forked process (Linux: fork and memory files)."""
    return sys.platform.startswith("linux") and hasattr(os, "memfd_create") and hasattr(os, "fork")


def _process_possible(files: list[Path]) -> bool:
    """Whether the early reads go to a forked process (:class:`_ChildPlan`): on Linux, from a process
    with no other thread (one that could hold a lock the child needs), when the first file is small
    enough that one thread reads it while the imports run (a larger first file keeps the read's three
    threads, and its buffers need not pass between processes: :class:`_Plan`)."""
    if not process_supported() or threading.active_count() > 1:
        return False
    try:
        return files[0].stat().st_size <= FORK_MAX
    except OSError:
        return False


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
    return plan.take(path)


def beside_expected() -> bool:
    """Whether this process's early-read process was given ``beside`` work (:func:`start`) whose results
    are still to be taken."""
    return any(later.pid == os.getpid() and not later.taken and later.fd >= 0 for later in _later)


def beside_result(wait: float = 0.0) -> tuple[str, Any] | None:
    """What the next part of the early-read process's ``beside`` work gave, ``("ok", value)`` or
    ``("error", None)``, once it has come, and once only (the first caller takes it); None while it has not
    (waited for up to ``wait`` seconds), or when there is none left. Parts are taken in the order of the
    work."""
    while _later and _later[0].pid == os.getpid():
        later = _later[0]
        got = later.result(wait)
        if got is not None:
            _later.pop(0)
            return got
        if later.fd >= 0:
            return None  # (not come yet)
        _later.pop(0)  # (taken, or given up)
    return None


def drop() -> None:
    """Give up the early reads not taken (:func:`drop_reads`) and the ``beside`` work's result."""
    global _later
    drop_reads()
    parts, _later = _later, []
    for later in parts:
        if later.pid == os.getpid():
            later.end()


def drop_reads() -> None:
    """Give up the early reads not taken: the thread ends at its next block, and has ended on return
    (so that no process is forked while it runs); a reading process is stopped (unless it is doing its
    ``beside`` work, whose result stays to be taken)."""
    global _plan
    plan, _plan = _plan, None
    if plan is None or plan.pid != os.getpid():
        return
    plan.drop()
