"""Tensor-parallel view: collectives aligned across ranks, wait vs transfer, stragglers, and the
critical path of a step across ranks.

A step is only as fast as its slowest rank. A collective kernel's duration on one rank is the time
that rank spent inside it, most of which is often spent waiting for the other ranks to arrive. This
module separates the two (the transfer is the shortest duration of an instance across ranks, as
TraceLens' NcclAnalyser does; each rank's remainder is wait), names the rank that arrives last, and
builds a cross-rank dependency graph of each step whose longest path says what bounds the step.

Every metric and JSON field is defined in ``docs/collectives.md``.

Tables of :class:`Collectives` (pandas DataFrames):

``instances``  one row per (collective instance, rank): pos (aligned step position), seq (order of
    the rank's collectives in the step), kind, kind_seq, instance (id), group, name, rank, start, end
    (offset-corrected, us), dur, transfer_us, wait_us, bytes, busbw_gbps, launch_us (corrected launch
    time or NaN), launch_lateness_us, arrival_order (0 = first), last_arrival (bool), kind_source,
    bytes_source, wait_caused_us, kidx (the row label in ``Analysis.kernels``).
``per_rank``   one row per rank (columns in :data:`PER_RANK_COLUMNS`).
``per_step``   one row per (pos, rank): comm_us, wait_us, transfer_us, late_arrivals, step_us,
    busy_us, launch_lateness_us, step_start_lateness_us.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import yaml

from traceinspect.tables import text_values

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

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


def _num(x: Any, nd: int = 3) -> Any:
    """JSON-safe scalar: NaN/inf -> None, numpy -> Python, floats rounded."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return round(float(x), nd) if math.isfinite(x) else None
    return x


def _median(v: Any) -> float:
    arr = np.asarray(v, dtype=np.float64)
    arr = arr[np.isfinite(arr)]
    return float(np.median(arr)) if len(arr) else float("nan")


@dataclass(frozen=True)
class Settings:
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
    from traceinspect.resources import tables_dir

    file = Path(path) if path else tables_dir() / SETTINGS_FILE
    try:
        doc = yaml.load(file.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))["collectives"]
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


@dataclass
class Collectives:
    """The tensor-parallel view of an analysis (see the module docstring and docs/collectives.md)."""

    n_ranks: int
    reason: str | None = None  # why there is no collective analysis (None when there is one)
    groups: list[list[int]] = field(default_factory=list)
    instances: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=INSTANCE_COLUMNS))
    per_rank: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PER_RANK_COLUMNS))
    per_step: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=PER_STEP_COLUMNS))
    offsets: dict[int, float] = field(default_factory=dict)  # estimated clock offset per rank (us)
    offsets_applied: dict[int, float] = field(default_factory=dict)  # the offset subtracted (0 if not)
    offset_noise: dict[int, float] = field(default_factory=dict)
    reference_rank: dict[int, int] = field(default_factory=dict)  # rank -> its group's reference rank
    straggler: dict[str, Any] = field(default_factory=dict)
    critical_path: dict[str, Any] = field(default_factory=dict)
    steps_aligned: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def applicable(self) -> bool:
        return self.reason is None

    @property
    def straggler_rank(self) -> int | None:
        return self.straggler.get("rank")

    def rank_row(self, rank: int) -> dict[str, Any] | None:
        """The ``per_rank`` row of one rank as a dict, or None."""
        hit = self.per_rank[self.per_rank["rank"] == rank]
        return hit.iloc[0].to_dict() if len(hit) else None

    def by_kind(self) -> pd.DataFrame:
        """Per collective kind: instances per step, median transfer, median bytes and bus bandwidth."""
        inst = self.instances
        if not len(inst):
            return pd.DataFrame(columns=["kind", "instances", "instances_per_step", "transfer_us_median",
                                         "wait_us_mean", "bytes_median", "busbw_gbps_median"])
        one = inst.drop_duplicates("instance")
        g = one.groupby("kind")
        out = pd.DataFrame({
            "instances": g.size(),
            "transfer_us_median": g["transfer_us"].median(),
            "bytes_median": g["bytes"].median(),
            "busbw_gbps_median": g["busbw_gbps"].median(),
        })
        out["wait_us_mean"] = inst.groupby("kind")["wait_us"].mean()
        out["instances_per_step"] = out["instances"] / max(self.steps_aligned, 1)
        return out.reset_index()

    def to_json(self) -> dict[str, Any]:
        """``{"collectives": {...}, "critical_path": {...}}`` as documented in docs/collectives.md."""
        coll: dict[str, Any] = {
            "applicable": self.applicable,
            "reason": self.reason,
            "ranks": self.n_ranks,
            "groups": self.groups,
            "steps_aligned": self.steps_aligned,
            "notes": list(self.notes),
        }
        if self.applicable:
            coll["clock"] = {
                "method": "median over matched collectives of (end on rank - end on the group's reference rank)",
                "reference_rank": {str(r): int(v) for r, v in sorted(self.reference_rank.items())},
                "offsets_us": {str(r): _num(v) for r, v in sorted(self.offsets.items())},
                "noise_us": {str(r): _num(v) for r, v in sorted(self.offset_noise.items())},
                "applied_us": {str(r): _num(v) for r, v in sorted(self.offsets_applied.items())},
            }
            coll["per_rank"] = [{k: _num(v) for k, v in row.items()} for row in self.per_rank.to_dict("records")]
            coll["by_kind"] = [{k: _num(v) for k, v in row.items()} for row in self.by_kind().to_dict("records")]
            coll["per_step"] = [{k: _num(v) for k, v in row.items()} for row in self.per_step.to_dict("records")]
            coll["instances"] = _instances_json(self.instances)
            coll["instances_truncated"] = bool(self.instances["instance"].nunique() > INSTANCES_JSON_MAX)
            coll["straggler"] = {k: _num(v) if not isinstance(v, (dict, list)) else v
                                 for k, v in self.straggler.items()}
        return {"collectives": coll, "critical_path": self.critical_path}


def _instances_json(inst: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per collective instance (not per rank): the cross-rank summary, the first
    INSTANCES_JSON_MAX instances by id."""
    if not len(inst):
        return []
    inst = inst.sort_values("instance", kind="stable")  # rows of an instance keep their order
    ids = inst["instance"].to_numpy()
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    bounds = np.r_[starts, len(ids)][: INSTANCES_JSON_MAX + 1]
    col = {c: inst[c].to_numpy().tolist() for c in ("instance", "pos", "seq", "kind", "name", "group",
                                                     "transfer_us", "bytes", "busbw_gbps", "last_arrival",
                                                     "rank", "start", "wait_us")}
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        last = next((col["rank"][i] for i in range(a, b) if col["last_arrival"][i]), None)
        start = col["start"][a:b]
        out.append({
            "instance": int(col["instance"][a]), "pos": int(col["pos"][a]), "seq": int(col["seq"][a]),
            "kind": col["kind"][a], "name": col["name"][a], "group": int(col["group"][a]),
            "transfer_us": _num(col["transfer_us"][a]), "bytes": _num(col["bytes"][a]),
            "busbw_gbps": _num(col["busbw_gbps"][a]),
            "last_rank": int(last) if last is not None else None,
            "arrival_skew_us": _num(float(max(start) - min(start))),
            "wait_us": {str(int(r)): _num(w) for r, w in zip(col["rank"][a:b], col["wait_us"][a:b], strict=True)},
        })
    return out


# ----------------------------------------------------------------------------- alignment
def _aligned_steps(a: Analysis) -> tuple[pd.DataFrame, int]:
    """Analysed steps with ``pos`` (order within the rank) restricted to the positions every rank has."""
    sel = a.selected.sort_values(["rank", "idx"]).copy()
    sel["pos"] = sel.groupby("rank").cumcount()
    counts = sel.groupby("rank").size()
    n = int(counts.min()) if len(counts) else 0
    return sel[sel["pos"] < n], n


def _groups(a: Analysis) -> list[list[int]]:
    """Ranks that take part in the same collectives: one group per (DP, PP) label of the rank files."""
    by: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for info in a.trace.ranks:
        by[(info.dp, info.pp)].append(info.rank)
    return [sorted(v) for _, v in sorted(by.items(), key=lambda kv: min(kv[1]))]


def _comm_mask(k: pd.DataFrame) -> np.ndarray:
    if "cls" not in k.columns:
        return np.zeros(len(k), dtype=bool)
    return (text_values(k["cls"]) == "comm") & (text_values(k["kind"]) == "kernel")


def _span_kinds(a: Analysis, comm: pd.DataFrame) -> list[str | None]:
    """Kind from the innermost ``nccl:*`` record_function span around each kernel's launch."""
    out: list[str | None] = [None] * len(comm)
    ann = a.trace.annotations
    if not len(ann) or not len(comm):
        return out
    spans = ann[ann["name"].str.startswith("nccl:")]
    if not len(spans):
        return out
    rt = a.trace.runtime
    rt_idx = comm["rt_idx"].to_numpy()
    ok = (rt_idx >= 0) & ~comm["graph_replay"].to_numpy()
    if not ok.any():
        return out
    launch_ts = rt["ts"].reindex(rt_idx[ok]).to_numpy()
    launch_tid = rt["tid"].reindex(rt_idx[ok]).to_numpy()
    ranks = comm["rank"].to_numpy()[ok]
    where = np.nonzero(ok)[0]
    groups = {key: (g["ts"].to_numpy(), g["end"].to_numpy(), g["name"].to_numpy(dtype=object))
              for key, g in spans.sort_values("ts", kind="stable").groupby(["rank", "tid"])}
    for j, (r, tid, t) in enumerate(zip(ranks.tolist(), launch_tid.tolist(), launch_ts.tolist(), strict=True)):
        g = groups.get((r, tid))
        if g is None or not np.isfinite(t):
            continue
        ts, end, names = g
        i = int(np.searchsorted(ts, t, side="right")) - 1
        while i >= 0:
            if end[i] >= t:
                out[where[j]] = collective_kind(names[i][5:])
                break
            i -= 1
    return out


def _first_numbers(obj: Any) -> list[list[int]]:
    """Every non-empty list of ints in a nested JSON value (tensor shapes)."""
    found: list[list[int]] = []
    if isinstance(obj, list):
        if obj and all(isinstance(x, int) and not isinstance(x, bool) for x in obj):
            found.append(obj)
        else:
            for x in obj:
                found.extend(_first_numbers(x))
    return found


# element type named in a kernel name: NCCL's ``_bf16_`` tokens, custom all-reduce template arguments
_NAME_DTYPE = re.compile(r"_(bf16|f16|f32|f64|f8e4m3|f8e5m2|i8|u8|i32|u32|i64|u64)(?:_|\b)|"
                         r"(__nv_bfloat16|__half|half|float|double)\b")
_NAME_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "f8e4m3": 1, "f8e5m2": 1, "i8": 1, "u8": 1,
                     "i32": 4, "u32": 4, "i64": 8, "u64": 8, "__nv_bfloat16": 2, "__half": 2, "half": 2,
                     "float": 4, "double": 8}


def _name_elem_bytes(name: str) -> float:
    m = _NAME_DTYPE.search(name)
    return float(_NAME_DTYPE_BYTES[m.group(1) or m.group(2)]) if m else float("nan")


def _message_bytes(a: Analysis, comm: pd.DataFrame) -> tuple[np.ndarray, list[str]]:
    """Message size per comm kernel and where it came from: Kineto's collective args where the loader
    kept them (``coll_nelems``, ``coll_dtype``), else the recorded shapes of the enclosing communication
    CPU op (largest tensor) times the element size from that op's types or from the kernel name."""
    out = np.full(len(comm), np.nan)
    src = [""] * len(comm)
    if {"coll_nelems", "coll_dtype"} <= set(comm.columns):
        nel = comm["coll_nelems"].to_numpy(dtype=np.float64)
        size = np.array([DTYPE_BYTES.get(str(d).lower(), np.nan) for d in comm["coll_dtype"]], dtype=np.float64)
        out = np.where(nel > 0, nel * size, np.nan)
        src = ["kineto_args" if np.isfinite(v) else "" for v in out]
    ops = a.trace.cpu_ops
    if not len(ops) or "op_idx" not in comm.columns:
        return out, src
    parent = ops["parent"].to_numpy() if "parent" in ops.columns else np.full(len(ops), -1)
    names = ops["name"].to_numpy(dtype=object)
    dims = ops["input_dims"].to_numpy(dtype=object)
    types = ops["input_types"].to_numpy(dtype=object)
    n_ops = len(ops)
    # op_idx / parent hold row labels; the loader's tables are labelled by position (no lookup table)
    labels = None if ops.index.equals(pd.RangeIndex(n_ops)) else {lab: i for i, lab in enumerate(ops.index)}

    def pos(label: int) -> int:
        if labels is not None:
            return labels.get(label, -1)
        return int(label) if 0 <= label < n_ops else -1

    cache: dict[int, tuple[float, float]] = {}

    def shape_of(i: int) -> tuple[float, float]:
        """(elements of the largest tensor, element size or NaN) of the nearest comm op up the tree."""
        if i in cache:
            return cache[i]
        val = (float("nan"), float("nan"))
        j, depth = i, 0
        while j >= 0 and depth < 8:
            if COMM_OP.search(str(names[j])) and dims[j] is not None:
                try:
                    shapes = _first_numbers(json.loads(dims[j]))
                    tnames = json.loads(types[j]) if types[j] is not None else []
                except (ValueError, TypeError):
                    shapes, tnames = [], []
                if shapes:
                    esz = next((DTYPE_BYTES[t.lower()] for t in tnames
                                if isinstance(t, str) and t.lower() in DTYPE_BYTES), float("nan"))
                    val = (float(max(math.prod(s) for s in shapes)), float(esz))
                    break
            p = parent[j]
            j = pos(p) if p >= 0 else -1
            depth += 1
        cache[i] = val
        return val

    op_idx = comm["op_idx"].to_numpy()
    knames = comm["name"].to_numpy(dtype=object)
    for n, oi in enumerate(op_idx.tolist()):
        if np.isnan(out[n]) and oi >= 0 and pos(oi) >= 0:
            nel, esz = shape_of(pos(oi))
            how = "cpu_op_shapes"
            if not np.isfinite(esz):
                esz, how = _name_elem_bytes(str(knames[n])), "cpu_op_shapes+kernel_name_dtype"
            if np.isfinite(nel) and np.isfinite(esz):
                out[n], src[n] = nel * esz, how
    return out, src


def _offsets(inst: pd.DataFrame, groups: list[list[int]]) -> tuple[dict[int, float], dict[int, float],
                                                                      dict[int, float], dict[int, int]]:
    """Clock offset per rank from matched collectives' end times (ends are nearly simultaneous)."""
    est: dict[int, float] = {}
    noise: dict[int, float] = {}
    applied: dict[int, float] = {}
    ref_of: dict[int, int] = {}
    for gi, ranks in enumerate(groups):
        ref = ranks[0]
        g = inst[inst["group"] == gi]
        ends = g.pivot_table(index="instance", columns="rank", values="end", aggfunc="first")
        for r in ranks:
            ref_of[r] = ref
            if r == ref or r not in ends.columns or ref not in ends.columns:
                est[r], noise[r], applied[r] = 0.0, 0.0, 0.0
                continue
            d = (ends[r] - ends[ref]).dropna().to_numpy()
            if not len(d):
                est[r], noise[r], applied[r] = float("nan"), float("nan"), 0.0
                continue
            med = float(np.median(d))
            mad = float(np.median(np.abs(d - med))) * 1.4826
            se = mad / math.sqrt(len(d))
            est[r], noise[r] = med, mad
            cfg = load_settings()
            applied[r] = med if abs(med) > max(cfg.offset_sigmas * se, cfg.offset_min_us) else 0.0
    return est, noise, applied, ref_of


# ----------------------------------------------------------------------------- main entry
def analyze_collectives(a: Analysis) -> Collectives:
    """Align collectives across ranks, split them into wait and transfer, find the straggler and the
    critical path. Always returns an object; ``reason`` says why parts are not applicable."""
    n_ranks = a.n_ranks
    groups = _groups(a)
    sel, n_steps = _aligned_steps(a)
    k = a.kernels
    comm_mask = _comm_mask(k)
    result = Collectives(n_ranks=n_ranks, groups=groups, steps_aligned=n_steps)
    if n_ranks < 2:
        result.reason = "single rank: there is no other rank to align collectives with"
    elif not n_steps:
        result.reason = "no analysed steps common to all ranks"
    elif not comm_mask.any():
        result.reason = "no communication kernels (class 'comm') in the analysed steps"
    elif all(len(g) < 2 for g in groups):
        result.reason = "every rank group (DP/PP label) holds a single rank"
    if result.reason is None:
        _collective_tables(a, result, sel, comm_mask)
    result.critical_path = critical_path(a, sel, result)
    return result


def _collective_tables(a: Analysis, res: Collectives, sel: pd.DataFrame, comm_mask: np.ndarray) -> None:
    k = a.kernels
    pos_of_step = pd.Series(sel["pos"].to_numpy(), index=sel.index)
    comm = k[comm_mask].copy()
    comm["pos"] = pos_of_step.reindex(comm["step"]).to_numpy()
    comm = comm[comm["pos"].notna()]
    comm["pos"] = comm["pos"].astype(np.int64)
    group_of = {r: gi for gi, ranks in enumerate(res.groups) for r in ranks}
    comm["group"] = comm["rank"].map(group_of).astype(np.int64)
    comm = comm.sort_values(["rank", "pos", "ts"], kind="stable")

    # kind: Kineto's collective name, else the enclosing nccl:* span, else the kernel name
    kinds: list[str | None] = [None] * len(comm)
    sources = [""] * len(comm)
    if "coll_name" in comm.columns:
        for i, v in enumerate(comm["coll_name"].to_numpy(dtype=object)):
            if isinstance(v, str) and v:
                kinds[i], sources[i] = collective_kind(v) or v.lower(), "kineto_args"
    span = _span_kinds(a, comm)
    for i, name in enumerate(comm["name"].to_numpy(dtype=object)):
        if kinds[i] is None and span[i] is not None:
            kinds[i], sources[i] = span[i], "nccl_span"
        if kinds[i] is None:
            kk = collective_kind(str(name))
            kinds[i], sources[i] = (kk, "kernel_name") if kk else ("collective", "unknown")
    comm["kind"] = kinds
    comm["kind_source"] = sources
    comm["seq"] = comm.groupby(["rank", "pos"]).cumcount()
    comm["kind_seq"] = comm.groupby(["rank", "pos", "kind"]).cumcount()
    comm["bytes"], comm["bytes_source"] = _message_bytes(a, comm)

    # match: (group, pos, kind, kind_seq) present on every rank of the group
    key = ["group", "pos", "kind", "kind_seq"]
    size = {gi: len(g) for gi, g in enumerate(res.groups)}
    present = comm.groupby(key)["rank"].transform("nunique")
    matched = present.to_numpy() == comm["group"].map(size).to_numpy()
    unmatched = comm[~matched].groupby("rank").size()
    inst = comm[matched].copy()
    if (~matched).any():
        res.notes.append(f"{int((~matched).sum())} communication kernels have no counterpart on every rank of "
                         "their group (same step position, kind and order) and are left out")
    if not len(inst):
        res.reason = "no collective could be matched across ranks (same step position, kind and order)"
        return
    inst["instance"] = inst.groupby(key, sort=True).ngroup()

    rt = a.trace.runtime
    rt_idx = inst["rt_idx"].to_numpy()
    inst["launch_raw"] = np.where(rt_idx >= 0, rt["ts"].reindex(rt_idx).to_numpy(), np.nan)
    est, noise, applied, ref_of = _offsets(inst, res.groups)
    res.offsets, res.offset_noise, res.offsets_applied, res.reference_rank = est, noise, applied, ref_of
    off = inst["rank"].map(applied).to_numpy()
    inst["start"] = inst["ts"].to_numpy() - off
    inst["end"] = inst["end"].to_numpy() - off
    inst["launch_us"] = inst["launch_raw"].to_numpy() - off

    g = inst.groupby("instance")
    inst["transfer_us"] = g["dur"].transform("min")
    inst["wait_us"] = inst["dur"] - inst["transfer_us"]
    inst["arrival_order"] = g["start"].rank(method="first").astype(np.int64) - 1
    inst["last_arrival"] = inst["arrival_order"] == g["start"].transform("size") - 1
    inst["launch_lateness_us"] = inst["launch_us"] - g["launch_us"].transform("min")
    nbytes = g["bytes"].transform("max")
    inst["bytes"] = nbytes
    n_in = g["rank"].transform("size").to_numpy()
    factor = np.array([BUSBW_FACTOR.get(kd, lambda n: float("nan"))(n) for kd, n in
                       zip(inst["kind"], n_in, strict=True)])
    with np.errstate(divide="ignore", invalid="ignore"):
        inst["busbw_gbps"] = np.where(inst["transfer_us"] > 0, nbytes / (inst["transfer_us"] * 1e3) * factor,
                                      np.nan)
    # wait caused: the other ranks' wait at instances where this rank arrived last
    wait_sum = g["wait_us"].transform("sum")
    inst["wait_caused_us"] = np.where(inst["last_arrival"], wait_sum - inst["wait_us"], 0.0)
    inst["kidx"] = inst.index.to_numpy()
    res.instances = inst[INSTANCE_COLUMNS + ["wait_caused_us", "kidx"]].reset_index(drop=True)

    _per_step_and_rank(a, res, sel, unmatched)
    res.straggler = _straggler(res)


def _per_step_and_rank(a: Analysis, res: Collectives, sel: pd.DataFrame, unmatched: pd.Series) -> None:
    inst = res.instances
    applied = res.offsets_applied
    s = sel[["rank", "pos", "span_us", "busy_us", "cpu_start"]].copy()
    s["cpu_start_c"] = s["cpu_start"] - s["rank"].map(applied).fillna(0.0)
    group_of = {r: gi for gi, ranks in enumerate(res.groups) for r in ranks}
    s["group"] = s["rank"].map(group_of)
    s["step_start_lateness_us"] = s["cpu_start_c"] - s.groupby(["group", "pos"])["cpu_start_c"].transform("min")
    agg = inst.groupby(["pos", "rank"]).agg(
        comm_us=("dur", "sum"), wait_us=("wait_us", "sum"), transfer_us=("transfer_us", "sum"),
        late_arrivals=("last_arrival", "sum"), launch_lateness_us=("launch_lateness_us", "median"))
    ps = s.merge(agg.reset_index(), on=["pos", "rank"], how="left")
    ps[["comm_us", "wait_us", "transfer_us", "late_arrivals"]] = ps[
        ["comm_us", "wait_us", "transfer_us", "late_arrivals"]].fillna(0.0)
    ps["late_arrivals"] = ps["late_arrivals"].astype(np.int64)
    ps = ps.rename(columns={"span_us": "step_us"}).sort_values(["pos", "rank"])
    res.per_step = ps[PER_STEP_COLUMNS].reset_index(drop=True)

    rows = []
    n = max(res.steps_aligned, 1)
    tp_step = _median(ps.groupby("pos")["step_us"].max()) if len(ps) else float("nan")
    for info in a.trace.ranks:
        r = info.rank
        ri = inst[inst["rank"] == r]
        rs = ps[ps["rank"] == r]
        comm_us, wait_us, transfer_us = float(ri["dur"].sum()), float(ri["wait_us"].sum()), \
            float(ri["transfer_us"].sum())
        arrivals = int(len(ri))
        late = int(ri["last_arrival"].sum())
        caused = float(ri["wait_caused_us"].sum())
        rows.append({
            "rank": r, "group": group_of.get(r, -1), "steps": int(len(rs)),
            "comm_us": comm_us, "wait_us": wait_us, "transfer_us": transfer_us,
            "comm_us_per_step": comm_us / n, "wait_us_per_step": wait_us / n, "transfer_us_per_step": transfer_us / n,
            "wait_share": wait_us / comm_us if comm_us > 0 else float("nan"),
            "wait_step_fraction": wait_us / n / tp_step if tp_step > 0 else float("nan"),
            "transfer_step_fraction": transfer_us / n / tp_step if tp_step > 0 else float("nan"),
            "late_arrivals": late, "arrivals": arrivals,
            "late_share": late / arrivals if arrivals else float("nan"),
            "wait_caused_us": caused, "wait_caused_us_per_step": caused / n,
            "step_us_median": _median(rs["step_us"]), "busy_us_median": _median(rs["busy_us"]),
            "launch_lateness_us_median": _median(ri["launch_lateness_us"]),
            "step_start_lateness_us_median": _median(rs["step_start_lateness_us"]),
            "clock_offset_us": res.offsets.get(r, float("nan")),
            "clock_offset_noise_us": res.offset_noise.get(r, float("nan")),
            "clock_offset_applied": bool(res.offsets_applied.get(r, 0.0) != 0.0),
            "unmatched_kernels": int(unmatched.get(r, 0)),
        })
    res.per_rank = pd.DataFrame(rows, columns=PER_RANK_COLUMNS)


def _straggler(res: Collectives) -> dict[str, Any]:
    pr = res.per_rank
    if not len(pr) or pr["arrivals"].sum() == 0:
        return {"rank": None, "reason": "no matched collectives"}
    total_wait = float(pr["wait_us"].sum())
    cand = pr.sort_values(["wait_caused_us", "late_arrivals"], ascending=False).iloc[0]
    n_group = max((len(g) for g in res.groups), default=1)
    cfg = load_settings()
    min_late = max(cfg.straggler_min_late_share, 1.5 / n_group)
    step_med = _median(res.per_step.groupby("pos")["step_us"].max()) if len(res.per_step) else float("nan")
    caused_share = float(cand["wait_caused_us"]) / total_wait if total_wait > 0 else 0.0
    step_frac = float(cand["wait_caused_us_per_step"]) / step_med if step_med > 0 else float("nan")
    checks = {
        "late_share": (float(cand["late_share"]), min_late),
        "wait_caused_share": (caused_share, cfg.straggler_min_wait_share),
        "wait_caused_step_fraction": (step_frac, cfg.straggler_min_step_fraction),
    }
    failed = [f"{name} {v:.3g} < {lim:.3g}" for name, (v, lim) in checks.items() if not (v >= lim)]
    others = pr[pr["rank"] != cand["rank"]]
    return {
        "rank": None if failed else int(cand["rank"]),
        "candidate": int(cand["rank"]),
        "late_arrivals": int(cand["late_arrivals"]),
        "arrivals": int(cand["arrivals"]),
        "late_share": float(cand["late_share"]),
        "late_share_min": min_late,
        "wait_caused_us_per_step": float(cand["wait_caused_us_per_step"]),
        "wait_caused_share": caused_share,
        "wait_caused_step_fraction": step_frac,
        "step_us_median": step_med,
        "launch_lateness_us_median": float(cand["launch_lateness_us_median"]),
        "busy_us_median": float(cand["busy_us_median"]),
        "others_busy_us_median": _median(others["busy_us_median"]),
        "reason": ("; ".join(failed) if failed else None),
    }


# ----------------------------------------------------------------------------- critical path
def _host_part(gap: float, launch: float, launch_end: float, ref_end: float) -> float:
    """The part of an idle gap on a rank's GPU that was spent waiting for the host to launch the next
    activity: all of it when the launch call began after the GPU went idle, else the part of the gap
    that the launch call itself still covered."""
    if gap <= 0 or not np.isfinite(launch):
        return 0.0
    if launch >= ref_end:
        return gap
    if np.isfinite(launch_end):
        return float(min(max(launch_end - ref_end, 0.0), gap))
    return 0.0


class Cycle(Exception):
    """The step's dependency graph has a cycle (collectives matched in inconsistent orders)."""


class _Graph:
    """Node-weighted DAG of one step: a path's length is the sum of the weights of its nodes but the
    last (the sink, weight 0)."""

    def __init__(self) -> None:
        self.weight: list[float] = []
        self.cls: list[str] = []
        self.rank: list[int | None] = []
        self.label: list[str] = []
        self.edges: list[tuple[int, int]] = []

    def node(self, weight: float, cls: str, rank: int | None, label: str) -> int:
        self.weight.append(float(max(weight, 0.0)))
        self.cls.append(cls)
        self.rank.append(rank)
        self.label.append(label)
        return len(self.weight) - 1

    def edge(self, u: int, v: int) -> None:
        if u != v:
            self.edges.append((u, v))

    def longest_path(self, src: int, sink: int) -> list[int]:
        """The longest path; nodes without successors lead to the sink, nodes without predecessors come
        from the source. Raises :class:`Cycle`.

        The result is the path networkx's ``dag_longest_path`` returns for the same graph (edges weighted
        with their source node's weight), ties included: topological order by generations, the first
        best predecessor in edge order, the first farthest node in topological order. A step graph has
        ~10k nodes and ~15k edges; networkx's generic graph classes made this most of the cost of an
        analysis.
        """
        n = len(self.weight)
        succ: list[list[int]] = [[] for _ in range(n)]
        pred: list[list[int]] = [[] for _ in range(n)]
        for u, v in dict.fromkeys(self.edges):  # a repeated edge counts once, in its first position
            succ[u].append(v)
            pred[v].append(u)
        tail = [u for u in range(n) if not succ[u] and u != sink]
        head = [v for v in range(n) if not pred[v] and v != src]
        for u, v in dict.fromkeys([(u, sink) for u in tail] + [(src, v) for v in head]):
            succ[u].append(v)
            pred[v].append(u)
        indeg = [len(p) for p in pred]
        gen = [v for v in range(n) if not indeg[v]]
        order: list[int] = []
        while gen:
            order += gen
            nxt: list[int] = []
            for u in gen:
                for v in succ[u]:
                    indeg[v] -= 1
                    if not indeg[v]:
                        nxt.append(v)
            gen = nxt
        if len(order) != n:
            raise Cycle
        w = self.weight
        dist = [0.0] * n
        back = list(range(n))
        for v in order:
            best, arg = -1.0, v
            for u in pred[v]:
                d = dist[u] + w[u]
                if d > best:
                    best, arg = d, u
            if best >= 0:
                dist[v], back[v] = best, arg
        far = max(dist)
        v = next(x for x in order if dist[x] == far)
        path = [v]
        while back[v] != v:
            v = back[v]
            path.append(v)
        path.reverse()
        return path


def _activities(a: Analysis, sel: pd.DataFrame, res: Collectives) -> pd.DataFrame:
    """GPU activities of the aligned steps with corrected times, launch times and instance ids."""
    k = a.kernels
    pos_of_step = pd.Series(sel["pos"].to_numpy(), index=sel.index)
    act = k[k["step"].isin(sel.index)][["rank", "kind", "name", "ts", "dur", "end", "stream", "rt_idx", "step"]
                                       + (["cls"] if "cls" in k.columns else [])].copy()
    if "cls" not in act.columns:
        act["cls"] = "unknown"
    act["cls"] = pd.Series(text_values(act["cls"]), index=act.index, dtype=object)
    act["pos"] = pos_of_step.reindex(act["step"]).to_numpy().astype(np.int64)
    off = act["rank"].map(res.offsets_applied).fillna(0.0).to_numpy()
    act["ts"] = act["ts"].to_numpy() - off
    act["end"] = act["end"].to_numpy() - off
    rt = a.trace.runtime
    rt_idx = act["rt_idx"].to_numpy()
    act["launch"] = np.where(rt_idx >= 0, rt["ts"].reindex(rt_idx).to_numpy(), np.nan) - off
    act["launch_end"] = np.where(rt_idx >= 0, rt["end"].reindex(rt_idx).to_numpy(), np.nan) - off
    act["instance"] = -1
    act["transfer_us"] = np.nan
    act["residual_wait"] = 0.0
    inst = res.instances
    if len(inst):
        ii = inst.set_index("kidx")
        ii = ii[ii.index.isin(act.index)]
        act.loc[ii.index, "instance"] = ii["instance"].to_numpy()
        act.loc[ii.index, "transfer_us"] = ii["transfer_us"].to_numpy()
        last = ii[ii["last_arrival"]]
        act.loc[last.index, "residual_wait"] = last["wait_us"].to_numpy()
    return act


def _step_graph(act: pd.DataFrame) -> tuple[_Graph, int, int, float, float]:
    """The dependency graph of one aligned step across ranks; returns (graph, source, sink, t0, t1)."""
    G = _Graph()
    t0 = float(act["ts"].min())
    t1 = float(act["end"].max())
    src = G.node(0.0, "start", None, "step start")
    xnode: dict[int, int] = {}
    act = act.sort_values(["rank", "ts", "end"], kind="stable")
    bounds = np.flatnonzero(np.r_[True, np.diff(act["rank"].to_numpy()) != 0, True])
    # Python lists: the loops below read every element, and a numpy scalar read costs ~10x more
    col = {c: act[c].to_numpy(dtype=object if c in ("cls", "name") else None).tolist()
           for c in ("rank", "ts", "end", "dur", "stream", "cls", "name", "launch", "launch_end", "instance",
                     "transfer_us", "residual_wait")}
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        r = int(col["rank"][lo])
        ts, end, dur, stream = col["ts"][lo:hi], col["end"][lo:hi], col["dur"][lo:hi], col["stream"][lo:hi]
        cls, name = col["cls"][lo:hi], col["name"][lo:hi]
        launch, launch_end = col["launch"][lo:hi], col["launch_end"][lo:hi]
        inst, transfer, resid = col["instance"][lo:hi], col["transfer_us"][lo:hi], col["residual_wait"][lo:hi]
        n = hi - lo
        n_in = [0] * n
        n_out = [0] * n
        for j in range(n):
            if inst[j] >= 0:
                a_node = G.node(resid[j], "comm_wait", r, str(name[j]))
                x = xnode.get(int(inst[j]))
                if x is None:
                    x = xnode[int(inst[j])] = G.node(transfer[j], "comm", None, str(name[j]))
                G.edge(a_node, x)
                n_in[j], n_out[j] = a_node, x
            else:
                n_in[j] = n_out[j] = G.node(dur[j], str(cls[j]), r, str(name[j]))
        # stream order
        last_on: dict[int, int] = {}
        for j in range(n):
            p = last_on.get(stream[j])
            if p is not None:
                G.edge(n_out[p], n_in[j])
            last_on[stream[j]] = j
        # the rank's GPU timeline: the latest activity that ended before j starts precedes j; an
        # idle GPU before j whose launch came late is host time on this rank
        pending: list[tuple[float, int]] = []
        best, best_end = -1, -math.inf
        run_end = -math.inf
        for j in range(n):
            while pending and pending[0][0] <= ts[j] + ORDER_TOL_US:
                e, i = heapq.heappop(pending)
                if e > best_end:
                    best, best_end = i, e
            pred = src if best < 0 else n_out[best]
            idle_from = max(run_end, t0)
            gap = ts[j] - idle_from
            host = _host_part(gap, launch[j], launch_end[j], idle_from) if gap > 0 else 0.0
            idle = gap - host if gap > IDLE_MIN_US else 0.0
            for w, c in ((idle, "idle"), (host, "host")):
                if w > 0:
                    h = G.node(w, c, r, f"{c} before {name[j]}")
                    G.edge(pred, h)
                    pred = h
            G.edge(pred, n_in[j])
            heapq.heappush(pending, (end[j], j))
            run_end = max(run_end, end[j])
    sink = G.node(0.0, "end", None, "step end")
    return G, src, sink, t0, t1


def _path_summary(G: _Graph, path: list[int], t0: float, t1: float) -> dict[str, Any]:
    comp: dict[str, float] = defaultdict(float)
    by_rank: dict[int, float] = defaultdict(float)
    host_by_rank: dict[int, float] = defaultdict(float)
    cls_by_rank: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    segs: list[dict[str, Any]] = []
    for u in path[:-1]:
        w = G.weight[u]
        if w <= 0:
            continue
        c, r = G.cls[u], G.rank[u]
        comp[c] += w
        if r is not None:
            by_rank[r] += w
            cls_by_rank[r][c] += w
            if c == "host":
                host_by_rank[r] += w
        if segs and segs[-1]["rank"] == r and segs[-1]["cls"] == c:
            segs[-1]["us"] += w
            segs[-1]["nodes"] += 1
        else:
            segs.append({"rank": r, "cls": c, "us": w, "nodes": 1, "first": G.label[u]})
    total = float(sum(comp.values()))
    bounding = max(by_rank, key=by_rank.get) if by_rank else None
    ends_on = next((G.rank[u] for u in reversed(path) if G.rank[u] is not None), None)
    return {
        "total_us": total, "span_us": t1 - t0, "slack_us": max((t1 - t0) - total, 0.0),
        "composition": dict(comp), "by_rank": dict(by_rank), "host_by_rank": dict(host_by_rank),
        "cls_by_rank": {r: dict(v) for r, v in cls_by_rank.items()},
        "bounding_rank": bounding, "ends_on_rank": ends_on, "nodes": len(path) - 2, "segments": segs,
    }


def _jsonify_path(s: dict[str, Any], top: int = 12) -> dict[str, Any]:
    total = s["total_us"] or 1.0
    segs = sorted(s["segments"], key=lambda x: -x["us"])[:top]
    return {
        "pos": s["pos"], "total_us": _num(s["total_us"]), "span_us": _num(s["span_us"]),
        "slack_us": _num(s["slack_us"]), "nodes": s["nodes"],
        "composition": {c: {"us": _num(v), "share": _num(v / total)}
                        for c, v in sorted(s["composition"].items(), key=lambda kv: -kv[1])},
        "by_rank": {str(r): {"us": _num(v), "share": _num(v / total),
                             "classes": {c: _num(x) for c, x in sorted(s["cls_by_rank"][r].items(),
                                                                        key=lambda kv: -kv[1])}}
                    for r, v in sorted(s["by_rank"].items())},
        "host_by_rank": {str(r): _num(v) for r, v in sorted(s["host_by_rank"].items())},
        "bounding_rank": s["bounding_rank"], "ends_on_rank": s["ends_on_rank"],
        "top_segments": [{"rank": x["rank"], "cls": x["cls"], "us": _num(x["us"]), "kernels": x["nodes"],
                          "first": x["first"]} for x in segs],
    }


def critical_path(a: Analysis, sel: pd.DataFrame, res: Collectives) -> dict[str, Any]:
    """Longest path through each aligned step's cross-rank dependency graph; the median
    step in detail and the composition averaged over the steps (all of them, or an even sample of
    ``critical_path.max_steps`` of rules/tables/collectives.yaml; see docs/collectives.md)."""
    if not len(sel):
        return {"applicable": False, "reason": "no analysed steps common to all ranks"}
    act = _activities(a, sel, res)
    if not len(act):
        return {"applicable": False, "reason": "no GPU activity in the analysed steps"}
    summaries = []
    failed = 0
    positions = sorted(act["pos"].unique())
    # the longest path is computed on at most max_steps evenly spaced steps
    max_steps = load_settings().critical_path_max_steps
    if len(positions) > max_steps:
        keep = np.unique(np.linspace(0, len(positions) - 1, max_steps).round().astype(int))
        positions = [positions[i] for i in keep]
    act = act[act["pos"].isin(positions)]
    for pos, pa in act.groupby("pos", sort=True):
        G, src, sink, t0, t1 = _step_graph(pa)
        try:
            path = G.longest_path(src, sink)
        except Cycle:
            failed += 1  # collectives matched in inconsistent orders would form a cycle
            continue
        if not path or path[0] != src:
            path = [src, *path]
        s = _path_summary(G, path, t0, t1)
        s["pos"] = int(pos)
        summaries.append(s)
    if not summaries:
        return {"applicable": False, "reason": "the dependency graph of every step has a cycle "
                "(collectives matched in inconsistent orders)"}
    n = len(summaries)
    totals = np.array([s["total_us"] for s in summaries])
    med_i = int(np.argsort(totals, kind="stable")[(n - 1) // 2])
    comp: dict[str, float] = defaultdict(float)
    by_rank: dict[int, float] = defaultdict(float)
    host_by_rank: dict[int, float] = defaultdict(float)
    bounds: dict[int, int] = defaultdict(int)
    for s in summaries:
        for c, v in s["composition"].items():
            comp[c] += v
        for r, v in s["by_rank"].items():
            by_rank[r] += v
        for r, v in s["host_by_rank"].items():
            host_by_rank[r] += v
        if s["bounding_rank"] is not None:
            bounds[s["bounding_rank"]] += 1
    grand = float(sum(comp.values())) or 1.0
    host_total = sum(host_by_rank.values())
    out: dict[str, Any] = {
        "applicable": True, "reason": None,
        "steps": n, "steps_failed": failed, "steps_available": int(sel["pos"].nunique()),
        "clock_corrected": any(v != 0.0 for v in res.offsets_applied.values()),
        "total_us_median": _num(float(np.median(totals))),
        "composition": {c: {"us_per_step": _num(v / n), "share": _num(v / grand)}
                        for c, v in sorted(comp.items(), key=lambda kv: -kv[1])},
        "by_rank": {str(r): {"us_per_step": _num(v / n), "share": _num(v / grand)}
                    for r, v in sorted(by_rank.items())},
        "host_by_rank": {str(r): {"us_per_step": _num(v / n), "share_of_host": _num(v / host_total if host_total
                                                                                        else float("nan"))}
                         for r, v in sorted(host_by_rank.items())},
        "bounding_rank": max(bounds, key=bounds.get) if bounds else None,
        "bounding_rank_steps": {str(r): c for r, c in sorted(bounds.items())},
        "median_step": _jsonify_path(summaries[med_i]),
    }
    return out
