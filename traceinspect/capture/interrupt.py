"""Ending a capture or a sweep early: Ctrl-C and SIGTERM (``kill``, ``timeout``, a CI runner cancelling a job)
both raise :class:`KeyboardInterrupt` in the main thread, so either stops the load and the profile and keeps
what was written; a server left profiling would refuse the next capture."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

EXIT_CODES = {"Ctrl-C": 130, "SIGTERM": 143}  # 128 + the signal's number, as a shell reports it


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived."""


def signal_name(e: BaseException) -> str:
    """``SIGTERM`` or ``Ctrl-C``: what ended the run, for its reason and exit code."""
    return "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"


def _on_term(_signum: int, _frame: Any) -> None:
    raise Terminated


@contextlib.contextmanager
def interruptible(say: Callable[[str], None]) -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the block runs (main thread only). A process started with
    Ctrl-C ignored (a background job of a non-interactive shell) keeps it ignored; ``say`` is told how to
    stop it instead."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _on_term)
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        say(f"Ctrl-C is ignored in this process (started in the background); `kill {os.getpid()}` stops it "
            "the same way, keeping what was written")
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if old is None else old)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Ignore Ctrl-C and SIGTERM while cleaning up (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
