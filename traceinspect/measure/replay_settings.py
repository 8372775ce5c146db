"""The replay settings (``rules/tables/replay.yaml``): read by the host measures of the measure stage (the
stall threshold) and by the what-if stage (:mod:`traceinspect.whatif`: blocking calls, step counts, floors)."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path

import msgspec

from traceinspect.resources import lazy_module

yaml = lazy_module("yaml")

SETTINGS_FILE = "replay.yaml"


class Settings(msgspec.Struct, frozen=True):
    blocking: re.Pattern[str]
    block_tol_us: float
    max_steps: int
    launch_floor_pct: float
    graph_gaps: tuple[tuple[re.Pattern[str], float, str], ...] = ()
    # least replayed saving (share of the replayed step) a severity needs, most severe first
    severity_floors: tuple[tuple[str, float], ...] = ()
    host_stall_min_us: float = 200.0
    batch_latency_pct: float = 25.0  # batch edit: a kernel's fixed part, this percentile of the rank's kernel times
    batch_stream_pct: float = 10.0  # batch edit: a kernel streams from this share of peak bandwidth (percent)
    batch_stream_latency_multiple: float = 3.0  # ... or, without recorded bytes, from this multiple of its fixed part
    batch_route_entry_bytes: float = 32.0  # ... MoE routing kernels without recorded bytes: bytes per tokens x top-k


@lru_cache(maxsize=4)
def load_settings(path: str | None = None) -> Settings:
    """Read ``rules/tables/replay.yaml`` (or ``path``)."""
    from traceinspect.errors import RuleError
    from traceinspect.resources import settings_document, tables_dir

    file = Path(path) if path else tables_dir() / SETTINGS_FILE
    try:
        doc = settings_document(SETTINGS_FILE, path)["replay"]
        gaps = tuple((re.compile(str(g["match"]), re.IGNORECASE), float(g["us"]), str(g.get("source", "")))
                     for g in doc.get("graph_kernel_gap_us") or [])
        floors = tuple(sorted(((str(k), float(v)) for k, v in (doc.get("severity_min_saving_share") or {}).items()),
                              key=lambda kv: -kv[1]))
        return Settings(blocking=re.compile(str(doc["blocking_calls"])),
                        block_tol_us=float(doc["block_tolerance_us"]), max_steps=max(1, int(doc["max_steps"])),
                        launch_floor_pct=float(doc["launch_floor_percentile"]), graph_gaps=gaps,
                        severity_floors=floors, host_stall_min_us=float(doc.get("host_stall_min_us", 200.0)),
                        batch_latency_pct=float((doc.get("batch") or {}).get("latency_percentile", 25.0)),
                        batch_stream_pct=float((doc.get("batch") or {}).get("stream_min_pct_bw", 10.0)),
                        batch_stream_latency_multiple=float((doc.get("batch") or {}).get(
                            "stream_min_latency_multiple", 3.0)),
                        batch_route_entry_bytes=float((doc.get("batch") or {}).get("route_entry_bytes", 32.0)))
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, re.error) as e:
        raise RuleError(f"unusable replay settings: {type(e).__name__}: {e}", file) from None
