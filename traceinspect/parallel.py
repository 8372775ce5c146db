"""Run one independent stage in a forked process while this one goes on with another.

After loading, the analysis runs in one process; the stages that do not depend on each other (GEMM
efficiency and the collectives analysis) can use a second core. The child inherits the analysis
through ``fork`` (nothing is copied up front) and sends back only its result, and, when asked, goes on
to further work that needs it, sent part by part (the what-if replay model and the document's table
sections, while this process applies the rules). Where ``fork`` is unavailable, in a daemon process, or
with one CPU or ``--jobs 1``, the work simply runs in this process when asked for; a part that fails in the
child in any way is also retried here, so errors read exactly as in a serial run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class Beside(Generic[T]):
    """``fn(*args)`` running in a forked child (or deferred, where that is not possible), and, when given,
    each of ``then`` after it, in order, in the same child, each called with ``fn``'s result: :meth:`result`
    has the first as soon as the child sends it, while the child goes on with the others
    (:meth:`then_result`). ``before``: what the child does first, and only a child (say, wait for this
    process to be through with something)."""

    def __init__(self, fn: Callable[..., T], *args: Any, jobs: int | None = None,
                 then: Sequence[Callable[[T], Any]] = (), before: Callable[[], None] | None = None) -> None:
        self.fn, self.args, self.then = fn, args, tuple(then)
        self._pid: int | None = None
        self._pipe: Any = None
        self._spill = -1  # the memory file the child writes its larger parts to
        self._first: tuple[str, Any] | None = None
        self._parts: list[tuple[str, Any]] = []  # the parts of ``then`` read so far
        self.forked = False  # whether a child runs it (else it runs here when asked)
        if not _can_fork(jobs):
            return
        spill = _memory_file()
        try:
            self._pid, fd = fork_with_pipe(lambda out: _send_parts(out, fn, args, self.then, spill, before))
        except OSError:  # no process to spare: it runs here later
            if spill >= 0:
                os.close(spill)
            return
        self.forked = True
        self._pipe = os.fdopen(fd, "rb")
        self._spill = spill
        # a Beside dropped before its parts were taken still ends and reaps its child
        self._finalizer = weakref.finalize(self, _abandon, self._pipe, self._pid, spill)

    def _next(self) -> tuple[str, Any]:
        """The child's next part, ``("error", None)`` when it failed or died first."""
        if self._pipe is None:
            return "error", None
        try:
            part = pickle.load(self._pipe)
            if part[0] == "spilled":
                part = _unspill(self._spill, *part[1])
            return part
        except Exception:  # noqa: BLE001 - a process that died sent nothing readable
            self.close()
            return "error", None

    def result(self) -> T:
        """The result of ``fn``: the child's, or computed here."""
        if self._first is None:
            self._first = self._next()
            if not self.then:
                self.close()
            if self._first[0] != "ok":
                self._first = ("ok", self.fn(*self.args))
        return self._first[1]

    def then_result(self, i: int = 0) -> Any:
        """The result of ``then[i]``: the child's, or computed here from :meth:`result`. The child is
        closed once its last part is read."""
        first = self.result()
        while len(self._parts) <= i:
            self._parts.append(self._next())
        if len(self._parts) == len(self.then):
            self.close()
        status, value = self._parts[i]
        return value if status == "ok" else self.then[i](first)

    def close(self) -> None:
        """Stop reading the child (which ends at its next write) and reap it."""
        pipe, pid, spill = self._pipe, self._pid, self._spill
        self._pipe, self._pid, self._spill = None, None, -1
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        _abandon(pipe, pid, spill)


def _abandon(pipe: Any, pid: int | None, spill: int = -1) -> None:
    if pipe is not None:
        pipe.close()
    if spill >= 0:
        with contextlib.suppress(OSError):
            os.close(spill)
    if pid is not None:
        reap_beside(pid)


# A part larger than this is written to a memory file and only its place goes through the pipe: a pipe
# holds 64 kB, so a child writing a larger part there waits until this process reads it, instead of going
# on with its next part (the what-if replay model of a 114 MB rank file is about 3 MB).
_PIPE_PART = 48 << 10


def _memory_file() -> int:
    """A memory file for a child's larger parts (-1 where there is none: they go through the pipe)."""
    if not hasattr(os, "memfd_create"):
        return -1
    try:
        return os.memfd_create("traceinspect-parts", os.MFD_CLOEXEC)
    except OSError:
        return -1


def _unspill(spill: int, offset: int, size: int) -> tuple[str, Any]:
    data = os.pread(spill, size, offset)
    if len(data) != size:
        raise EOFError("a part cut short")
    return pickle.loads(data)


def _send_parts(out: int, fn: Callable[..., Any], args: tuple[Any, ...], then: Sequence[Callable[[Any], Any]],
                spill: int = -1, before: Callable[[], None] | None = None) -> None:
    """A :class:`Beside` child: ``("ok", fn(*args))`` (or ``("error", None)``) through ``out``, then, when
    ``fn`` succeeded, the same for each of ``then`` on that result (a part too large for the pipe through
    the memory file ``spill``, when there is one); ``before`` first, when given."""
    try:
        if before is not None:
            before()
        res: tuple[str, Any] = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - the parent does the work itself and meets the real error
        res = ("error", None)
    send(out, res, spill)
    if res[0] != "ok":
        return
    for part in then:
        try:
            more: tuple[str, Any] = ("ok", part(res[1]))
        except BaseException:  # noqa: BLE001 - as above
            more = ("error", None)
        send(out, more, spill)


def send(out: int, res: tuple[str, Any], spill: int = -1) -> None:
    """Write ``res`` (``("ok", value)`` or ``("error", None)``) to the pipe ``out`` as one pickle, for
    :func:`receive` (``("error", None)`` when ``value`` cannot be pickled). With a memory file ``spill``, a
    pickle larger than :data:`_PIPE_PART` is appended to it and the pipe gets ``("spilled", (offset, size))``
    (for :class:`Beside`, which reads it from there)."""
    try:
        data = pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an unpicklable result: the parent does the work itself
        data = pickle.dumps(("error", None))
    if spill >= 0 and len(data) > _PIPE_PART:
        with contextlib.suppress(OSError):  # (no memory for it there: through the pipe)
            offset = os.lseek(spill, 0, os.SEEK_END)
            _write_all(spill, data)
            data = pickle.dumps(("spilled", (offset, len(data))), protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(out, data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fork_with_pipe(child: Callable[[int], None]) -> tuple[int, int]:
    """Fork a process that runs ``child(fd)`` and exits, never returning into the caller (status 1 if
    ``child`` raised); ``fd`` is the writing end of a pipe whose reading end this process gets, with the
    child's pid: (pid, fd). OSError when no process can be forked."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:
        code = 1
        try:
            os.close(r)
            child(w)
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


def receive(fd: int) -> tuple[str, Any]:
    """What a forked process :func:`send` through the pipe ``fd``, read to its end (the process closes it,
    or exits), which is then closed here; ``("error", None)`` when it died before sending."""
    try:
        with os.fdopen(fd, "rb") as f:
            return pickle.loads(f.read())
    except Exception:  # noqa: BLE001 - a process that died sent nothing readable
        return "error", None


def reap_beside(pid: int) -> None:
    """Wait for a child's exit on a daemon thread: its exit (unmapping its copy of this process) takes
    milliseconds that this one need not wait."""
    threading.Thread(target=_reap, args=(pid,), name="traceinspect-reap", daemon=True).start()


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def _can_fork(jobs: int | None) -> bool:
    if jobs is not None and jobs <= 1:
        return False
    if (os.cpu_count() or 1) < 2:
        return False
    if sys.platform != "linux" or not hasattr(os, "fork"):  # fork with threads is unsafe on macOS; Windows has none
        return False
    # a multiprocessing daemon (a pool or dask worker, say) may not start processes
    mp = sys.modules.get("multiprocessing")
    return mp is None or not mp.current_process().daemon
