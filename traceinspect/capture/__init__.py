"""Capture decode-step traces from a live SGLang server, or from an in-process program.

::

    import traceinspect
    result = traceinspect.capture("http://127.0.0.1:30000", "traces/", steps=5,
                                  load="concurrency=64,input=1024,output=2048")
    result.files            # one .trace.json.gz per rank, plus server_info.json and capture.json

    from traceinspect.capture import profile_steps   # in-process, see traceinspect.capture.inprocess
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceinspect.capture.errors import (
    AuthError,
    CaptureError,
    CaptureIncomplete,
    CaptureInterrupted,
    ProfileRejected,
    ServerUnreachable,
)
from traceinspect.capture.layout import DEFAULT_PREFIX
from traceinspect.capture.options import DEFAULT_STEPS, CaptureOptions, CaptureResult
from traceinspect.capture.session import run_capture
from traceinspect.capture.traffic import TrafficSpec
from traceinspect.capture.ui import CaptureUI

if TYPE_CHECKING:
    from traceinspect.capture.inprocess import StepMarker, profile_steps

__all__ = [
    "capture",
    "profile_steps",
    "StepMarker",
    "CaptureResult",
    "CaptureOptions",
    "TrafficSpec",
    "CaptureError",
    "CaptureIncomplete",
    "CaptureInterrupted",
    "ServerUnreachable",
    "AuthError",
    "ProfileRejected",
]


def capture(url: str, out: str | Path, *, steps: int = DEFAULT_STEPS, phase: str = "decode",
            api_key: str | None = None, expect: dict[str, Any] | None = None,
            admin_api_key: str | None = None, load: str | TrafficSpec | None = None, analyze: bool = False, prefix: str = DEFAULT_PREFIX,
            timeout: float = 300.0, ramp_timeout: float = 120.0, min_batch: int = 1,
            activities: tuple[str, ...] = ("CPU", "GPU"), record_shapes: bool = True, with_stack: bool = False,
            server_out_dir: str | None = None, verbose: bool = False) -> CaptureResult:
    """Profile ``steps`` forward steps of every rank of the SGLang server at ``url`` into ``out``.

    Reads ``/server_info`` and ``/model_info`` into ``server_info.json``, makes sure there is traffic
    (``load="concurrency=N,input=N,output=N"`` drives it; ``admin_api_key`` is for servers that
    have one, whose profiling endpoints take only that key), POSTs ``/start_profile`` and waits for
    every rank's complete file. ``phase`` is ``decode`` (SGLang's ``profile_by_stage``, ``-DECODE``
    files) or ``all`` (the next ``steps`` batches, whatever they are). ``expect`` ({key: value}) is
    checked against ``/server_info`` before profiling (:class:`ServerMismatch` names each difference).
    ``analyze=True`` also writes ``analysis.json`` (and ``report.html`` where the HTML renderer exists).

    Returns a :class:`CaptureResult`; raises :class:`CaptureIncomplete` (whose ``.result`` holds
    what was written) when some rank file never came, and other :class:`CaptureError` subclasses
    when the server cannot be used. ``capture.json`` in the capture directory records the outcome.
    """
    spec = TrafficSpec.parse(load) if isinstance(load, str) else load
    opts = CaptureOptions(url=url, out=out, steps=steps, phase=phase, api_key=api_key,
                          expect=tuple((str(k), str(v).lower() if isinstance(v, bool) else str(v))
                                       for k, v in (expect or {}).items()),
                          admin_api_key=admin_api_key, load=spec, analyze=analyze,
                          prefix=prefix, timeout_s=timeout, ramp_timeout_s=ramp_timeout, min_batch=min_batch,
                          activities=tuple(activities), record_shapes=record_shapes, with_stack=with_stack,
                          server_out_dir=server_out_dir, command=None)
    ui = CaptureUI(quiet=not verbose, secrets=tuple(k for k in (api_key, admin_api_key) if k))
    return run_capture(opts, ui)


def __getattr__(name: str) -> Any:
    # torch is optional: import the in-process helper only when asked for
    if name in ("profile_steps", "StepMarker", "trace_name"):
        from traceinspect.capture import inprocess

        return getattr(inprocess, name)
    raise AttributeError(name)


class _CallableModule(types.ModuleType):
    """``traceinspect.capture`` names both this package and :func:`capture`: importing the package
    binds it on ``traceinspect``, so the package itself answers calls."""

    def __call__(self, *args: Any, **kwargs: Any) -> CaptureResult:
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
