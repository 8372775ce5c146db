"""The typed, column-oriented model of a trace set.

Every stage adds columns to these tables; the column sets are declared here so each stage's
contract is visible in one place. Times are microseconds (float64) as Kineto writes them.

Tables (one pandas DataFrame each, all ranks concatenated, column ``rank`` first):

``kernels``  GPU activity: kernels, memcpy and memset.
    load:     rank, kind ('kernel'|'memcpy'|'memset'), name, ts, dur, end, device, stream,
              correlation (-1 if absent), external_id (-1), grid, block, bytes (-1)
    link:     rt_idx (row in ``runtime`` or -1), rt_name, graph_replay (bool),
              op_idx (row in ``cpu_ops`` or -1), op_name ('' if none), op_path (enclosing op names, outer->inner)
    steps:    step (row in ``steps`` or -1)
    classify: cls, cls2 (secondary label of fused kernels, '' if none), cls_evidence
``runtime``  CUDA runtime/driver API calls: rank, name, ts, dur, end, tid, correlation, external_id
``cpu_ops``  CPU operators: rank, name, ts, dur, end, tid, external_id, input_dims, input_types,
             concrete (raw JSON bytes of the recorded-shape args, or None), parent (row or -1)
``annotations``      CPU user annotations (record_function): rank, name, ts, dur, end, tid
``gpu_annotations``  GPU user annotations: rank, name, ts, dur, end
``steps``  see :mod:`traceinspect.steps`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

KERNEL_COLUMNS = [
    "rank", "kind", "name", "ts", "dur", "end", "device", "stream",
    "correlation", "external_id", "grid", "block", "bytes",
]
RUNTIME_COLUMNS = ["rank", "name", "ts", "dur", "end", "tid", "correlation", "external_id"]
CPU_OP_COLUMNS = [
    "rank", "name", "ts", "dur", "end", "tid", "external_id",
    "input_dims", "input_types", "concrete",
]
ANNOTATION_COLUMNS = ["rank", "name", "ts", "dur", "end", "tid"]
GPU_ANNOTATION_COLUMNS = ["rank", "name", "ts", "dur", "end"]


class DeviceInfo(msgspec.Struct):
    """One GPU as described by the trace's ``deviceProperties``."""

    name: str
    compute_capability: str | None = None  # "9.0"
    total_memory_bytes: int | None = None
    num_sms: int | None = None


class RankInfo(msgspec.Struct):
    """One rank file of a trace set and where its identity came from."""

    rank: int
    label: str  # "TP3", "TP3-DP1", ...
    path: Path
    rank_source: str  # 'filename' | 'distributedInfo' | 'order'
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None  # 'EXTEND' | 'DECODE' from the file name
    profile_id: str | None = None
    devices: list[DeviceInfo] = msgspec.field(default_factory=list)
    distributed_info: dict[str, Any] = msgspec.field(default_factory=dict)
    cuda_runtime_version: str | None = None
    cuda_driver_version: str | None = None
    trace_id: str | None = None
    size_bytes: int = 0
    # the file's SHA-256 as hex, or the hash under way (a load without the cache hashes the file beside
    # the analysis): read it as :attr:`sha256`
    digest: Any = ""
    n_events: int = 0

    @property
    def sha256(self) -> str:
        """The file's SHA-256 (hex); where it is still being computed, waited for here, once."""
        d = self.digest
        if not isinstance(d, str):
            self.digest = d = d.result()
        return d

    @property
    def device(self) -> DeviceInfo | None:
        """The GPU this rank ran on (the first listed device when the trace lists several)."""
        if not self.devices:
            return None
        gpu = self.distributed_info.get("local_rank") if self.distributed_info else None
        if isinstance(gpu, int) and 0 <= gpu < len(self.devices):
            return self.devices[gpu]
        return self.devices[0]


class TraceSet(msgspec.Struct, eq=False):
    """All ranks of one capture, as typed tables, plus the evidence found beside them."""

    ranks: list[RankInfo]
    kernels: pd.DataFrame
    runtime: pd.DataFrame
    cpu_ops: pd.DataFrame
    annotations: pd.DataFrame
    gpu_annotations: pd.DataFrame
    server_info: dict[str, Any] | None = None
    server_info_path: Path | None = None
    capture: dict[str, Any] | None = None  # capture.json (``server_load``: the server's load while profiled)
    capture_traces: dict[int, Path] = msgspec.field(default_factory=dict)
    warnings: list[str] = msgspec.field(default_factory=list)
    sources: list[str] = msgspec.field(default_factory=list)
    linked: bool = False  # link columns already present (the loader links each rank where it parses it)
    # cpu_ops.name as (codes, texts), as the loader's link numbered it (texts may repeat); see op_names
    op_name_codes: tuple[Any, Any] | None = None

    @property
    def n_ranks(self) -> int:
        return len(self.ranks)

    def op_names(self) -> tuple[Any, Any]:
        """``cpu_ops.name`` as (integer codes, texts): a test of the op names runs once per text and is
        spread with the codes. The loader's numbering when it kept one, else made here once. A text may
        stand at two codes (the scanner numbers strings per rank): deduplicate before listing them."""
        got = self.op_name_codes
        if got is None or len(got[0]) != len(self.cpu_ops):
            from traceinspect.tables import factorize_text

            got = self.op_name_codes = factorize_text(self.cpu_ops["name"].to_numpy(dtype=object)) \
                if "name" in self.cpu_ops else (np.zeros(len(self.cpu_ops), dtype=np.int64), np.zeros(0, dtype=object))
        return got
