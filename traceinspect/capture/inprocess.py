"""Profile decode steps of an in-process program into the same layout SGLang writes.

::

    from traceinspect.capture import profile_steps

    with profile_steps("traces/", rank=rank, prefix="mymodel", profile_id=run_id) as prof:
        for _ in range(8):
            with prof.step(bs=64):          # record_function("step[DECODE bs=64]")
                logits = model(ids)
            ids = sample(logits)
    # -> traces/mymodel-<run_id>-TP-<rank>.trace.json.gz

Like SGLang it uses ``torch.profiler.profile(...).start()/.stop()`` and ``export_chrome_trace``
without a schedule. Give every rank the same ``profile_id`` so their files form one set.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from traceinspect.capture.errors import CaptureError
from traceinspect.capture.layout import (
    DEFAULT_PREFIX,
    SERVER_INFO_JSON,
    atomic_write_json,
    check_prefix,
    redact,
)

STAGES = ("DECODE", "EXTEND", None)


def _torch() -> Any:
    try:
        import torch
        import torch.profiler  # noqa: F401
    except ImportError:
        raise CaptureError("profile_steps needs torch (pip install torch)") from None
    return torch


def _default_rank(torch: Any) -> int:
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    for var in ("RANK", "LOCAL_RANK"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def trace_name(prefix: str, profile_id: str, rank: int, stage: str | None = "DECODE", dp: int | None = None,
               pp: int | None = None, ep: int | None = None) -> str:
    """SGLang's file name: ``{prefix}-{profile_id}-TP-{rank}[-DP-d][-PP-p][-EP-e][-STAGE].trace.json.gz``."""
    parts = [profile_id, f"TP-{rank}"]
    if dp is not None:
        parts.append(f"DP-{dp}")
    if pp is not None:
        parts.append(f"PP-{pp}")
    if ep is not None:
        parts.append(f"EP-{ep}")
    name = (f"{prefix}-" if prefix else "") + "-".join(parts)
    return name + (f"-{stage}" if stage else "") + ".trace.json.gz"


class StepMarker:
    """Handed out by :func:`profile_steps`; wraps each forward step in SGLang's step span."""

    def __init__(self, torch: Any, default_mode: str) -> None:
        self._torch = torch
        self._mode = default_mode
        self.steps = 0
        self.path: Path | None = None

    @contextlib.contextmanager
    def step(self, bs: int, mode: str | None = None, toks: int | None = None) -> Iterator[None]:
        """``record_function("step[DECODE bs=N]")`` (``toks=`` adds `` toks=T`` as SGLang does for EXTEND)."""
        m = (mode or self._mode).upper()
        name = f"step[{m} bs={int(bs)}" + (f" toks={int(toks)}" if toks is not None else "") + "]"
        with self._torch.profiler.record_function(name):
            yield
        self.steps += 1


@contextlib.contextmanager
def profile_steps(out_dir: str | Path, rank: int | None = None, prefix: str = DEFAULT_PREFIX,
                  profile_id: str | None = None, stage: str | None = "DECODE",
                  activities: tuple[str, ...] | None = None, record_shapes: bool = True,
                  with_stack: bool = False, server_info: dict[str, Any] | None = None,
                  dp: int | None = None, pp: int | None = None, ep: int | None = None) -> Iterator[StepMarker]:
    """Profile the enclosed steps and export ``<prefix>-<id>-TP-<rank>[-STAGE].trace.json.gz``.

    ``activities`` defaults to CPU plus CUDA when a GPU is present. ``server_info`` (a dict with
    ``tp_size`` and friends) is written to ``server_info.json`` by rank 0, atomically. The trace is
    exported to a temporary name and renamed, so a half-written file never carries the final name.
    """
    torch = _torch()
    check_prefix(prefix)
    stage = stage.upper() if stage else None
    if stage not in STAGES:
        raise CaptureError(f"stage must be DECODE, EXTEND or None, got {stage!r}")
    rank = _default_rank(torch) if rank is None else int(rank)
    if profile_id is None:
        from traceinspect.capture.layout import new_profile_id

        profile_id = os.environ.get("TRACEINSPECT_PROFILE_ID") or new_profile_id()
    if "-" in profile_id or "/" in profile_id or not profile_id.strip():
        raise CaptureError(f"profile_id {profile_id!r} must be non-empty and contain no '-' or '/'")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    acts = []
    wanted = activities or (("CPU", "GPU") if torch.cuda.is_available() else ("CPU",))
    for a in wanted:
        if a == "CPU":
            acts.append(torch.profiler.ProfilerActivity.CPU)
        elif a in ("GPU", "CUDA"):
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        else:
            raise CaptureError(f"unknown profiler activity {a!r}; use CPU and/or GPU")

    marker = StepMarker(torch, stage or "DECODE")
    prof = torch.profiler.profile(activities=acts, record_shapes=record_shapes, with_stack=with_stack)
    prof.start()
    try:
        yield marker
    finally:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        prof.stop()
    name = trace_name(prefix, profile_id, rank, stage, dp=dp, pp=pp, ep=ep)
    final = out / name
    tmp = out / (name[: -len(".trace.json.gz")] + ".partial.gz")
    try:
        prof.export_chrome_trace(str(tmp))
        os.replace(tmp, final)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    marker.path = final
    if server_info is not None and rank == 0:
        atomic_write_json(out / SERVER_INFO_JSON, redact(server_info))
