"""Settings and constants of the collectives analysis (``rules/tables/collectives.yaml``): collective
kinds, clock-offset and straggler thresholds, table columns."""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from traceinspect.resources import lazy_module

yaml = lazy_module("yaml")

SCHEMA_NOTE = "docs/collectives.md"

# Bus-bandwidth factor per kind for n ranks (nccl-tests' PERFORMANCE.md convention).
BUSBW_FACTOR = {
    "allreduce": lambda n: 2.0 * (n - 1) / n,
    "allgather": lambda n: (n - 1) / n,
    "reducescatter": lambda n: (n - 1) / n,
    "alltoall": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
DTYPE_BYTES = {
    "float": 4, "float32": 4, "c10::float": 4, "double": 8, "float64": 8, "half": 2, "float16": 2,
    "c10::half": 2, "bfloat16": 2, "c10::bfloat16": 2, "int": 4, "int32": 4, "long": 8, "int64": 8,
    "long int": 8, "short": 2, "int16": 2, "char": 1, "int8": 1, "signed char": 1, "unsigned char": 1,
    "uint8": 1, "byte": 1, "bool": 1, "float8_e4m3fn": 1, "c10::float8_e4m3fn": 1, "float8_e5m2": 1,
    "c10::float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
# CPU ops whose recorded shapes describe a collective's message.
COMM_OP = re.compile(r"record_param_comms|c10d|nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|"
                     r"broadcast|custom_ar|sgl_kernel|vllm::", re.IGNORECASE)

SETTINGS_FILE = "collectives.yaml"  # kind patterns, clock-offset and straggler thresholds (data)
# "Ended before" tolerance when ordering GPU activities of one rank (Kineto rounds to ns).
ORDER_TOL_US = 0.5
# Idle gaps (GPU idle although the launch came in time) shorter than this are rounding, not time.
IDLE_MIN_US = 0.01
INSTANCES_JSON_MAX = 2000

PER_RANK_COLUMNS = [
    "rank", "group", "steps", "comm_us", "wait_us", "transfer_us", "comm_us_per_step", "wait_us_per_step",
    "transfer_us_per_step", "wait_share", "wait_step_fraction", "transfer_step_fraction", "late_arrivals", "arrivals", "late_share", "wait_caused_us",
    "wait_caused_us_per_step", "step_us_median", "busy_us_median", "launch_lateness_us_median",
    "step_start_lateness_us_median", "clock_offset_us", "clock_offset_noise_us", "clock_offset_applied",
    "unmatched_kernels",
]
INSTANCE_COLUMNS = [
    "pos", "seq", "kind", "kind_seq", "instance", "group", "name", "rank", "start", "end", "dur",
    "transfer_us", "wait_us", "bytes", "busbw_gbps", "launch_us", "launch_lateness_us", "arrival_order",
    "last_arrival", "kind_source", "bytes_source",
]
PER_STEP_COLUMNS = [
    "pos", "rank", "comm_us", "wait_us", "transfer_us", "late_arrivals", "step_us", "busy_us",
    "launch_lateness_us", "step_start_lateness_us",
]


def _median(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    return float(np.median(arr)) if len(arr) else float("nan")


class Settings(msgspec.Struct, frozen=True):
    """The data-driven part of the collectives analysis (``rules/tables/collectives.yaml``)."""

    kinds: tuple[tuple[str, re.Pattern[str]], ...]
    offset_sigmas: float
    offset_min_us: float
    straggler_min_late_share: float
    straggler_min_wait_share: float
    straggler_min_step_fraction: float
    critical_path_max_steps: int


@lru_cache(maxsize=4)
def load_settings(path: str | None = None) -> Settings:
    """Read the collectives settings (default: the shipped ``rules/tables/collectives.yaml``)."""
    from traceinspect.errors import RuleError
    from traceinspect.resources import settings_document, tables_dir

    file = Path(path) if path else tables_dir() / SETTINGS_FILE
    try:
        doc = settings_document(SETTINGS_FILE, path)["collectives"]
        kinds = tuple((str(k["kind"]), re.compile(str(k["pattern"]), re.IGNORECASE)) for k in doc["kinds"])
        off, strag = doc["clock_offset"], doc["straggler"]
        return Settings(
            kinds=kinds, offset_sigmas=float(off["sigmas"]), offset_min_us=float(off["min_us"]),
            straggler_min_late_share=float(strag["min_late_share"]),
            straggler_min_wait_share=float(strag["min_wait_share"]),
            straggler_min_step_fraction=float(strag["min_step_fraction"]),
            critical_path_max_steps=max(1, int(doc["critical_path"]["max_steps"])),
        )
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError, re.error) as e:
        raise RuleError(f"unusable collectives settings: {type(e).__name__}: {e}", file) from None


@lru_cache(maxsize=4096)
def collective_kind(text: str) -> str | None:
    """Collective kind named by a kernel name, span name or Kineto collective name, or None."""
    for kind, pat in load_settings().kinds:
        if pat.search(text):
            return kind
    return None


