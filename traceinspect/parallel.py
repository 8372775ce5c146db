"""Run one independent stage in a forked process while this one goes on with another.

After loading, the analysis runs in one process; the stages that do not depend on each other (GEMM
efficiency and the collectives analysis) can use a second core. The child inherits the analysis
through ``fork`` (nothing is copied up front) and sends back only its result. Where ``fork`` is
unavailable, in a daemon process, or with one CPU or ``--jobs 1``, the stage simply runs in this process; a child that fails
in any way is also retried here, so errors read exactly as in a serial run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _child(out: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        res = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - the parent runs it again and raises the real error
        res = ("error", None)
    try:
        data = pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - an unpicklable result: the parent runs it again
        data = pickle.dumps(("error", None))
    view = memoryview(data)
    while view:
        view = view[os.write(out, view):]


class Beside(Generic[T]):
    """``fn(*args)`` running in a forked child (or deferred, where that is not possible)."""

    def __init__(self, fn: Callable[..., T], *args: Any, jobs: int | None = None) -> None:
        self.fn, self.args = fn, args
        self._pid: int | None = None
        self._fd = -1
        if not _can_fork(jobs):
            return
        r, w = os.pipe()
        try:
            pid = os.fork()
        except OSError:  # no process to spare: run it here later
            os.close(r)
            os.close(w)
            return
        if pid == 0:  # the child: compute, send, exit (never back into the caller)
            code = 1
            try:
                os.close(r)
                _child(w, fn, args)
                code = 0
            finally:
                os._exit(code)
        os.close(w)
        self._pid, self._fd = pid, r

    def result(self) -> T:
        """The result: the child's, or computed here."""
        if self._pid is not None:
            pid, fd = self._pid, self._fd
            self._pid, self._fd = None, -1
            status, value = "error", None
            try:
                with os.fdopen(fd, "rb") as f:  # to the end: the child closes it by exiting
                    status, value = pickle.loads(f.read())
            except Exception:  # noqa: BLE001 - the child died before sending: run it here
                pass
            # the child's exit (unmapping a copy of this process) takes tens of ms: it is reaped beside,
            # not waited for
            threading.Thread(target=_reap, args=(pid,), name="traceinspect-reap", daemon=True).start()
            if status == "ok":
                return value
        return self.fn(*self.args)


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
