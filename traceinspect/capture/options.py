"""What a capture is asked to do (:class:`CaptureOptions`) and what it produced (:class:`CaptureResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceinspect.capture.layout import DEFAULT_PREFIX
from traceinspect.capture.traffic import TrafficSpec
from traceinspect.gate.stats import EDGE_STEPS, samples_needed

# SGLang's by-stage prefill capture ends at the first decode batch, so under mixed traffic it holds
# whatever prefills came first, or nothing; prefill steps are better taken from an "all" capture.
PHASES = {"decode": (True, "DECODE"), "all": (False, None)}
ACTIVITIES = ("CPU", "GPU")

WHY_MISSING = (
    "Usually one of: no traffic reached the server (the profiler only advances on forward steps, so a "
    "rank with no batches never writes); the output directory is not visible from the server (it writes "
    "to output_dir on its own filesystem); or another profile was already running"
)


# steps recorded by default: enough analysed steps (the first and last are not analysed) for the gate's
# noise test to be able to decide at its default alpha
DEFAULT_STEPS = samples_needed() + EDGE_STEPS

@dataclass
class CaptureOptions:
    """Everything :func:`run_capture` needs."""

    url: str
    out: str | Path
    steps: int = DEFAULT_STEPS
    phase: str = "decode"
    api_key: str | None = None
    admin_api_key: str | None = None
    load: TrafficSpec | None = None
    analyze: bool = False
    prefix: str = DEFAULT_PREFIX
    timeout_s: float = 300.0
    ramp_timeout_s: float = 120.0
    min_batch: int = 1
    activities: tuple[str, ...] = ACTIVITIES
    record_shapes: bool = True
    with_stack: bool = False
    server_out_dir: str | None = None
    expect: tuple[tuple[str, str], ...] = ()  # (key, value): what /server_info must say before profiling
    stable_s: float = 1.0
    poll_s: float = 0.25
    command: list[str] | None = None


@dataclass
class CaptureResult:
    """What a capture produced. ``status`` is ``complete`` or ``incomplete``."""

    status: str
    out_dir: Path
    profile_id: str
    prefix: str
    files: list[Path]
    missing: list[str]
    server_info: dict[str, Any]
    reason: str | None = None
    warnings: list[str] = field(default_factory=list)
    analysis: Any = None
    report: Path | None = None

    @property
    def complete(self) -> bool:
        return self.status == "complete"
