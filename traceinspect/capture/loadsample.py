"""The server's load during a capture's profile window, sampled from the live server.

CUDA-graph decode records no shapes, so the batch and the KV rows a step reads are not in the trace;
the scheduler reports them (:meth:`~traceinspect.capture.client.SGLangClient.load_state`). A capture
samples them when ``/start_profile`` is sent, about once a second while it waits for the rank files and
when they are complete, and saves the samples in ``capture.json`` under ``server_load``.
"""

from __future__ import annotations

import time
from typing import Any

from traceinspect.capture.client import SGLangClient
from traceinspect.capture.errors import CaptureError

INTERVAL_S = 1.0  # between the samples taken while waiting for the rank files
MAX_SAMPLES = 64  # a long wait keeps its first samples and its last


class LoadSampler:
    """Samples of ``load_state()``, each with ``at`` (start, during, end), ``unix_s`` and ``t_s`` (seconds
    after ``/start_profile`` was sent; negative before it)."""

    def __init__(self, client: SGLangClient, interval_s: float = INTERVAL_S) -> None:
        self.client = client
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self.problem: str | None = None
        self.t_profile: float | None = None  # monotonic time of /start_profile
        self._last = -float("inf")
        self._unsupported = False

    def profile_started(self) -> None:
        self.t_profile = time.monotonic()
        for s in self.samples:  # samples taken before it: their offset to it
            s["t_s"] = round(s.pop("_mono") - self.t_profile, 3)

    def sample(self, at: str) -> None:
        """One sample; a server that reports no load, or a failed request, is noted once, never raised."""
        if self._unsupported:
            return
        mono, unix = time.monotonic(), time.time()
        try:
            state = self.client.load_state()
        except CaptureError as e:
            self.problem = f"could not read the server's load: {e.one_line()}"
            return
        self._last = mono
        if state is None:
            self._unsupported = True
            self.problem = "the server reports no load (no /v1/loads, no sglang:num_running_reqs on /metrics)"
            return
        s: dict[str, Any] = {"at": at, "unix_s": round(unix, 3), **state}
        if self.t_profile is None:
            s["_mono"] = mono
        else:
            s["t_s"] = round(mono - self.t_profile, 3)
        if len(self.samples) >= MAX_SAMPLES and at == "during":
            self.samples.pop(len(self.samples) // 2)  # thin the middle
        self.samples.append(s)

    def maybe_sample(self) -> None:
        """A ``during`` sample when ``interval_s`` has passed since the last one."""
        if time.monotonic() - self._last >= self.interval_s:
            self.sample("during")

    def record(self) -> dict[str, Any]:
        """The ``server_load`` block of capture.json."""
        samples = [{k: v for k, v in s.items() if k != "_mono"} for s in self.samples]
        out: dict[str, Any] = {"samples": samples, "interval_s": self.interval_s}
        if self.problem:
            out["problem"] = self.problem
        return out
