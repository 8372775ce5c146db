"""Run one independent stage in a forked process while this one goes on with another.

After loading, the analysis runs in one process; the stages that do not depend on each other (GEMM
efficiency and the collectives analysis) can use a second core. The child inherits the analysis
through ``fork`` (nothing is copied up front) and sends back only its result. Where ``fork`` is
unavailable, in a daemon process, or with one CPU or ``--jobs 1``, the stage simply runs in this process; a child that fails
in any way is also retried here, so errors read exactly as in a serial run.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def _child(conn: Any, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        out = ("ok", fn(*args))
    except BaseException:  # noqa: BLE001 - the parent runs it again and raises the real error
        out = ("error", None)
    try:
        conn.send(out)
    except Exception:  # noqa: BLE001 - an unpicklable result: the parent runs it again
        conn.send(("error", None))
    finally:
        conn.close()


class Beside(Generic[T]):
    """``fn(*args)`` running in a forked child (or deferred, where that is not possible)."""

    def __init__(self, fn: Callable[..., T], *args: Any, jobs: int | None = None) -> None:
        self.fn, self.args = fn, args
        self._proc: Any = None
        self._conn: Any = None
        if not _can_fork(jobs):
            return
        import multiprocessing as mp

        ctx = mp.get_context("fork")
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, fn, args), daemon=True)
        try:
            proc.start()
        except OSError:  # no process to spare: run it here later
            recv.close()
            send.close()
            return
        send.close()
        self._proc, self._conn = proc, recv

    def result(self) -> T:
        """The result: the child's, or computed here."""
        if self._proc is not None:
            status, value = "error", None
            try:
                status, value = self._conn.recv()
            except (EOFError, OSError):  # the child died before sending
                pass
            finally:
                self._conn.close()
                # the child's exit (unmapping a copy of this process) takes tens of ms: it is reaped
                # beside, not waited for
                threading.Thread(target=self._proc.join, name="traceinspect-reap", daemon=True).start()
                self._proc = None
            if status == "ok":
                return value
        return self.fn(*self.args)


def _can_fork(jobs: int | None) -> bool:
    if jobs is not None and jobs <= 1:
        return False
    if (os.cpu_count() or 1) < 2:
        return False
    if sys.platform != "linux":  # fork with threads is unsafe on macOS; Windows has none
        return False
    import multiprocessing as mp

    # a daemon (a pool or dask worker, say) may not start processes
    return "fork" in mp.get_all_start_methods() and not mp.current_process().daemon
