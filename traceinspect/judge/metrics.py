"""The metric namespace that rules are written against, built from an :class:`Analysis`.

Metrics come in scopes. ``run`` metrics are one value per analysis and are visible to every rule;
the other scopes are *subjects* a rule's ``select:`` iterates over:

``kernels``  one kernel family (kernels picked by class / name regex / op regex), optionally one
             subject per kernel name or per class
``gemm``     GEMM shapes from the efficiency stage, filtered and aggregated
``rank``     one subject per rank (busy time, step time, collective wait/transfer)
``class``    one subject per kernel class

Every metric has a name, a unit and a definition (shown by ``traceinspect rules show``). A value
that cannot be derived from the trace is ``None`` and the reason is kept in ``Subject.missing``;
a rule condition over it is "cannot decide".

Per-step quantities are per rank per analysed step (mean), unless stated otherwise; shares are of
the GPU time (kernels + memcpy + memset) of the analysed steps on all ranks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.judge.saferegex import search
from traceinspect.runmodel import dims as _dims
from traceinspect.runmodel import tensor_bytes as _tensor_bytes
from traceinspect.tables import per_distinct

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

TINY_KERNEL_US = 5.0
GAP_MIN_US = 2.0
SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol", "cudaStreamWaitEvent_sync",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2",
    "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy",
})
DTOH = re.compile(r"DtoH|Device\s*->\s*(?:Host|Pinned|Pageable)", re.IGNORECASE)
CAST_DST = re.compile(r"direct_copy_kernel_cuda.*?lambda\((?:c10::)?(\w+)\)")
CLASS_IDS_FALLBACK = (
    "fp4_gemm", "fp8_gemm", "bf16_gemm", "fp32_gemm", "conv", "moe_gemm", "moe_dispatch", "attention", "kv_write",
    "kv_cast", "dtype_cast", "comm", "norm", "activation", "rotary", "quantize", "sampling", "memcpy", "elementwise",
    "other",
)


def class_ids() -> tuple[str, ...]:
    """The kernel class ids of the classifier (the fallback list when it cannot be imported)."""
    try:
        from traceinspect.classify import CLASSES
    except Exception:  # noqa: BLE001 - the classifier stage is optional for rule loading
        return CLASS_IDS_FALLBACK
    return tuple(CLASSES)


@dataclass(frozen=True)
class Metric:
    """One documented metric."""

    name: str
    unit: str
    scope: str
    definition: str


SCOPES = ("run", "kernels", "gemm", "rank", "class")
_REG: dict[str, dict[str, Metric]] = {s: {} for s in SCOPES}


def _m(scope: str, name: str, unit: str, definition: str) -> None:
    _REG[scope][name] = Metric(name, unit, scope, " ".join(definition.split()))


# ----------------------------------------------------------------------------- run
_m("run", "steps", "count", "Analysed steps per rank (the smallest count over ranks; first and last steps excluded).")
_m("run", "ranks", "count", "Ranks (trace files) in the trace set.")
_m("run", "tp_size", "count", "Tensor-parallel size from server_info (tp_size), else the number of ranks.")
_m("run", "step_us", "us", "Median decode step time: per aligned step, the slowest rank's GPU span "
   "(first GPU activity start to last end); median over analysed steps.")
_m("run", "step_us_p90", "us", "90th percentile of the step time defined in step_us.")
_m("run", "span_us_per_step", "us", "Mean per-rank GPU span of an analysed step.")
_m("run", "kernel_us_per_step", "us", "GPU activity time (kernels + memcpy + memset, summed) per rank per step.")
_m("run", "compute_us_per_step", "us", "GPU activity time outside collective kernels (class comm) per rank per "
   "step: the work itself, without the time collectives spin waiting for other ranks.")
_m("run", "busy_us_per_step", "us", "Time the GPU had at least one activity running, per rank per step.")
_m("run", "idle_us_per_step", "us", "GPU idle time inside the step's span (span minus busy), per rank per step.")
_m("run", "idle_share", "ratio", "idle_us_per_step / span_us_per_step.")
_m("run", "gaps_per_step", "count", f"Idle gaps of at least {GAP_MIN_US:g} us between consecutive GPU "
   "activities inside a step, per rank per step.")
_m("run", "gap_us_per_step", "us", f"Total length of the gaps counted in gaps_per_step (>= {GAP_MIN_US:g} us each).")
_m("run", "kernels_per_step", "count", "GPU activities (kernels, memcpy, memset) per rank per step.")
_m("run", "tiny_kernels_per_step", "count", f"Kernels shorter than {TINY_KERNEL_US:g} us per rank per step.")
_m("run", "tiny_kernel_share", "ratio", "tiny_kernels_per_step / kernels_per_step.")
_m("run", "median_kernel_us", "us", "Median duration of the analysed GPU activities.")
_m("run", "cuda_graph", "bool", "True when most analysed GPU time was replayed from CUDA graphs.")
_m("run", "graph_replay_share", "ratio", "Share of analysed GPU time replayed from CUDA graphs.")
_m("run", "dtoh_per_step", "count", "Device-to-host memcpy events (kind memcpy, name 'Memcpy DtoH ...') "
   "inside steps, per rank per step.")
_m("run", "dtoh_us_per_step", "us", "GPU time of those DtoH copies per rank per step.")
_m("run", "sync_calls_per_step", "count", "Blocking host calls (cudaStreamSynchronize, cudaDeviceSynchronize, "
   "cudaEventSynchronize, synchronous cudaMemcpy, ...) whose start lies inside a step's CPU window, per rank per step.")
_m("run", "sync_us_per_step", "us", "Host time spent inside those blocking calls, per rank per step.")
_m("run", "sync_idle_us_per_step", "us", "GPU bubble caused by those calls: for each call that was made while "
   "GPU work was still running (so it waited for the GPU to drain), the time from the end of that work to the "
   "start of the next GPU activity; per rank per step.")
_m("run", "host_stall_us_per_step", "us", "Host stalls per rank per step: time the launching thread spends inside the "
   "step's CPU window and GPU span outside every CPU op and runtime call, in stretches of at least host_stall_min_us "
   "(Python work between ops, busy waits, GC pauses).")
_m("run", "host_stalls_per_step", "count", "Those stretches per rank per step.")
_m("run", "host_stall_max_us", "us", "The longest of those stretches.")
_m("run", "host_stall_min_us", "us", "The least stretch that counts as a host stall (host_stall_min_us in rules/replay.yaml).")
_m("run", "batch", "count", "Median batch size from the step annotations (step[DECODE bs=N]); None if not annotated.")
_m("run", "layers", "count", "Model layers per pipeline stage, from the run model (run.facts.layers): --layers "
   "or traceinspect.toml, else num_hidden_layers of the model config in server_info.json, else the period "
   "of the step's kernel sequence checked against the per-step count of per-layer kernels.")
_m("run", "layers_source", "text", "Where `layers` came from: 'user', 'server_info', 'trace_structure' or None.")
_m("run", "kv_pool_tokens", "tokens", "KV pool size in tokens: server_info max_total_num_tokens (None if absent).")
_m("run", "kv_cache_dtype", "text", "KV cache dtype: server_info kv_cache_dtype (auto: the model dtype), else the "
   "dtype of the recorded pool tensor (None if neither).")
_m("run", "kv_row_bytes", "bytes", "Bytes of one token's row of a per-layer KV pool: from a recorded tensor "
   "shape whose first dimension equals kv_pool_tokens (CPU ops of the trace, or of the CUDA-graph capture "
   "trace); None if no such tensor was recorded.")
_m("run", "kv_pool_bytes_per_layer", "bytes", "kv_pool_tokens x kv_row_bytes.")
_m("run", "gpu", "text", "GPU spec entry used for peaks (rules/gpus.yaml), None if the device is not in the table.")
_m("run", "mem_bw_gbps", "GB/s", "Peak DRAM bandwidth of the GPU from the spec table.")
_m("run", "comm_us_per_step", "us", "Collective-communication kernel time (class comm) per rank per step.")
_m("run", "comm_share", "ratio", "Share of GPU time in class comm.")
_m("run", "moe_gemm_us_per_step", "us", "Expert GEMM time (class moe_gemm) per rank per step.")
_m("run", "moe_dispatch_us_per_step", "us", "MoE routing / permute / combine time (class moe_dispatch) per rank per step.")
_m("run", "moe_dispatch_ratio", "ratio", "moe_dispatch_us_per_step / moe_gemm_us_per_step (None without expert GEMMs).")
_m("run", "moe_dispatch_compute_share", "ratio", "moe_dispatch_us_per_step / compute_us_per_step.")
_m("run", "max_wait_share", "ratio", "Largest, over ranks, share of a rank's collective time spent waiting "
   "for other ranks (from the collectives stage).")
_m("run", "max_wait_us_per_step", "us", "Largest, over ranks, collective wait time per step.")
_m("run", "transfer_us_per_step", "us", "Collective transfer (non-waiting) time per step, mean over ranks.")
_m("run", "transfer_share", "ratio", "transfer_us_per_step / step_us.")
_m("run", "comm_transfer_share", "ratio", "Share of collective time that is transfer, not waiting: "
   "transfer_us_per_step / comm_us_per_step (mean over ranks).")
_m("run", "straggler_label", "text", "Label of straggler_rank (TP1, ...), or None when there is no straggler.")
_m("run", "straggler_rank", "id", "The rank the collectives stage names as the straggler (arrives last at "
   "most collectives and causes most of the wait), None if none stands out.")

# ----------------------------------------------------------------------------- kernels
_m("kernels", "name", "text", "Kernel name of the subject (the most expensive one when a family has several).")
_m("kernels", "names", "count", "Distinct kernel names in the subject.")
_m("kernels", "cls", "text", "Kernel class of the subject's most expensive kernel.")
_m("kernels", "op_name", "text", "Most frequent CPU op that launched the subject's kernels ('' under graph replay).")
_m("kernels", "calls", "count", "Calls in the analysed steps, all ranks.")
_m("kernels", "calls_per_step", "count", "Calls per rank per step.")
_m("kernels", "calls_per_layer", "count", "calls_per_step / layers.")
_m("kernels", "us_per_step", "us", "GPU time per rank per step.")
_m("kernels", "share", "ratio", "Share of all GPU time of the analysed steps.")
_m("kernels", "step_share", "ratio", "us_per_step / step_us.")
_m("kernels", "compute_share", "ratio", "us_per_step / compute_us_per_step: share of the GPU work that is not "
   "collectives (collective kernels of host-bound or imbalanced ranks mostly spin waiting).")
_m("kernels", "mean_us", "us", "Mean duration of one call.")
_m("kernels", "dur_cv", "ratio", "Coefficient of variation (std / mean) of the call durations: low means every "
   "call does the same amount of work.")
_m("kernels", "rows_per_call", "count", "Median first dimension of the tensor the launching CPU op reads "
   "(aten::copy_: its source; otherwise its first tensor argument); None for graph replays and when "
   "shapes were not recorded.")
_m("kernels", "bytes_per_call", "bytes", "Median bytes one call moves (read + written), from the efficiency "
   "stage's model of the launching op's recorded shapes (for graph replays: of the op recorded in the "
   "CUDA-graph capture trace); for memcpy events the copied bytes; None when unknown.")
_m("kernels", "gbps", "GB/s", "Achieved bandwidth: bytes_per_call / mean_us.")
_m("kernels", "shape_source", "text", "Where bytes_per_call / rows_per_call came from: 'cpu_op' (recorded "
   "shapes), 'capture' (graph-capture trace: for casts without a kernel-level match, the captured "
   "dtype-changing copies into the kernel's destination dtype whose count per graph equals the family's "
   "calls per replay), 'memcpy' or None.")
_m("kernels", "graph_share", "ratio", "Share of the subject's calls replayed from a CUDA graph.")
_m("kernels", "rank_count", "count", "Ranks on which the subject ran.")

# ----------------------------------------------------------------------------- gemm
_m("gemm", "m", "rows", "GEMM M (rows of the activation; for grouped expert GEMMs the rows per expert): "
   "time-weighted median over the subject's calls.")
_m("gemm", "m_min", "rows", "Smallest M among the subject's calls.")
_m("gemm", "m_max", "rows", "Largest M among the subject's calls.")
_m("gemm", "n", "count", "GEMM N of the subject's most expensive shape.")
_m("gemm", "k", "count", "GEMM K of the subject's most expensive shape.")
_m("gemm", "batch", "count", "Batch count of a batched GEMM (bmm), 1 for plain GEMMs (most expensive shape).")
_m("gemm", "dtype", "text", "Compute dtype of the most expensive shape (fp4, fp8, bf16, fp16, fp32).")
_m("gemm", "op_name", "text", "CPU op of the most expensive shape (aten::mm, aten::_scaled_mm, ...).")
_m("gemm", "shapes", "count", "Distinct (M, N, K, batch, dtype) shapes in the subject.")
_m("gemm", "is_moe", "bool", "True when the subject's GEMMs are expert (MoE) GEMMs.")
_m("gemm", "per_expert_m", "rows", "Rows per expert of the subject's expert GEMMs (M of each per-expert "
   "GEMM, or rows / experts of a grouped GEMM), time-weighted median; None for dense GEMMs.")
_m("gemm", "calls_per_step", "count", "GEMM calls per rank per step (calls with known shapes).")
_m("gemm", "us_per_step", "us", "GPU time of those calls per rank per step.")
_m("gemm", "share", "ratio", "Share of all GPU time of the analysed steps.")
_m("gemm", "compute_share", "ratio", "us_per_step / compute_us_per_step (share of the non-collective GPU time).")
_m("gemm", "tflops", "TFLOP/s", "Achieved TFLOP/s: FLOPs (2*M*N*K per GEMM) summed over calls / kernel time.")
_m("gemm", "pct_peak", "ratio", "tflops / dense peak of the GPU for the dtype (rules/gpus.yaml), as a "
   "fraction (0.01 = 1%); None if the GPU or dtype has no peak in the table.")
_m("gemm", "peak_tflops", "TFLOP/s", "The dense peak used for pct_peak (time-weighted over the calls).")
_m("gemm", "unknown_share", "ratio", "Share of the selected GEMM-class time whose shapes are unknown "
   "(no CPU op, no capture trace): they are left out of every other gemm metric.")

# ----------------------------------------------------------------------------- rank
_m("rank", "rank", "id", "Rank number.")
_m("rank", "rank_label", "text", "Rank label (TP0, TP1-DP0, ...).")
_m("rank", "rank_step_us", "us", "Median GPU span of this rank's analysed steps.")
_m("rank", "rank_busy_us", "us", "Median GPU busy time of this rank's steps.")
_m("rank", "rank_compute_us", "us", "Median per-step GPU time of this rank's non-communication kernels.")
_m("rank", "others_compute_us", "us", "Median of rank_compute_us over the other ranks.")
_m("rank", "compute_excess", "ratio", "rank_compute_us / others_compute_us - 1.")
_m("rank", "rank_launch_lag_us", "us", "Median, over steps, of how much later this rank's first GPU activity "
   "of a step starts than the earliest rank's (aligned steps).")
_m("rank", "slowest_step_fraction", "ratio", "Share of aligned steps in which this rank finished its "
   "non-communication work last.")
_m("rank", "comm_us", "us", "Collective kernel time of this rank per step.")
_m("rank", "wait_us", "us", "Collective time per step this rank spent waiting for other ranks to arrive "
   "(from the collectives stage).")
_m("rank", "transfer_us", "us", "Collective time per step that was data transfer (comm_us - wait_us).")
_m("rank", "wait_share", "ratio", "wait_us / comm_us.")
_m("rank", "rank_comm_share", "ratio", "comm_us / rank_step_us.")
_m("rank", "late_arrivals", "ratio", "Share of collectives at which this rank arrived last.")
_m("rank", "waited_on_share", "ratio", "Share of all ranks' collective wait time that this rank caused by "
   "arriving last.")
_m("rank", "wait_caused_us", "us", "Collective wait per step that this rank caused on the other ranks by "
   "arriving last (sum over the other ranks).")
_m("rank", "launch_lateness_us", "us", "Median lateness of this rank's collective launches relative to the "
   "earliest rank (clock-corrected; from the collectives stage).")

# ----------------------------------------------------------------------------- class
_m("class", "class_name", "text", "Kernel class id of the subject (see rules/kernel_classes.yaml).")
_m("class", "class_us_per_step", "us", "GPU time of the class per rank per step.")
_m("class", "class_share", "ratio", "Share of all GPU time of the analysed steps.")
_m("class", "class_calls_per_step", "count", "Calls of the class per rank per step.")

_CLASS_METRICS_DONE = False


def _ensure_class_metrics() -> None:
    global _CLASS_METRICS_DONE
    if _CLASS_METRICS_DONE:
        return
    for c in class_ids():
        _m("run", f"cls_{c}_us_per_step", "us", f"GPU time of class {c} per rank per step.")
        _m("run", f"cls_{c}_share", "ratio", f"Share of all GPU time in class {c}.")
        _m("run", f"cls_{c}_calls_per_step", "count", f"Calls of class {c} per rank per step.")
    _CLASS_METRICS_DONE = True


def registry(scope: str | None = None) -> dict[str, Metric]:
    """Metrics of a scope (``run`` metrics included), or of every scope when ``scope`` is None."""
    _ensure_class_metrics()
    if scope is None:
        out: dict[str, Metric] = {}
        for s in SCOPES:
            out.update(_REG[s])
        return out
    out = dict(_REG["run"])
    out.update(_REG[scope])
    return out


def own_metrics(scope: str) -> dict[str, Metric]:
    """Metrics defined in ``scope`` itself (without the run metrics every scope sees)."""
    _ensure_class_metrics()
    return dict(_REG[scope])


def known(scope: str, name: str) -> bool:
    """Is ``name`` a metric visible to rules of ``scope``?"""
    _ensure_class_metrics()
    return name in _REG["run"] or name in _REG[scope]


# ============================================================================= computation
@dataclass
class Subject:
    """One thing a rule is evaluated on: its metric values, label, ranks and the reasons why some
    metrics are unavailable."""

    scope: str
    label: str
    values: dict[str, Any]
    ranks: list[int] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)
    classes: tuple[str, ...] = ()  # kernel classes of the subject's kernels (kernels, gemm, class scopes)


def _f(x: Any) -> float | None:
    """A finite float or None."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if np.isfinite(v) else None


def _median(values: Iterable[float]) -> float | None:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.median(arr)) if len(arr) else None


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float | None:
    if not len(values):
        return None
    order = np.argsort(values)
    v, w = values[order], weights[order]
    if w.sum() <= 0:
        return float(np.median(v))
    c = np.cumsum(w)
    return float(v[np.searchsorted(c, 0.5 * c[-1])])


def first_tensor(dims_raw: Any, types_raw: Any) -> tuple[list[int], str | None] | None:
    """Shape and dtype of the first tensor input of a CPU op, from its recorded Input Dims/Types."""
    dims, types = _dims(dims_raw), _dims(types_raw)
    if not dims:
        return None
    for i, d in enumerate(dims):
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            t = types[i] if types and i < len(types) and isinstance(types[i], str) else None
            return d, t
    return None


def _first_rows(name: str, dims: list[Any] | None) -> float | None:
    """First dimension of the tensor an op reads (copy_: its source), from its recorded dims."""
    if not dims:
        return None
    arg = 1 if name in ("aten::copy_", "aten::copy") else 0
    cand = [d for d in dims if isinstance(d, list) and d and all(isinstance(x, int) for x in d)]
    pick = dims[arg] if arg < len(dims) and isinstance(dims[arg], list) and dims[arg] else \
        (cand[0] if cand else None)
    if pick and all(isinstance(x, int) for x in pick):
        return float(pick[0])
    return None


class MetricContext:
    """Computes metric values for one analysis, lazily and once."""

    def __init__(self, analysis: Analysis) -> None:
        _ensure_class_metrics()
        self.a = analysis
        k = analysis.kernels
        self.k = k
        self.n_step_rows = max(len(analysis.selected), 1)  # (rank, step) pairs analysed
        self.total_us = float(k["dur"].sum()) if len(k) else 0.0
        self.run_missing: dict[str, str] = {}
        self._capture_shapes: dict[int, Any] | None = None
        self.run = self._run_metrics()

    # ------------------------------------------------------------------ run
    def _host_stalls(self) -> dict[str, Any]:
        from traceinspect.measure.replay.model import load_settings
        from traceinspect.measure.replay.stalls import stall_stretches

        lo = load_settings().host_stall_min_us
        st = stall_stretches(self.a, lo)
        n = self.n_step_rows
        d = (st["end"] - st["start"]).to_numpy(dtype=np.float64) if len(st) else np.zeros(0)
        return {"host_stall_us_per_step": float(d.sum()) / n, "host_stalls_per_step": len(d) / n,
                "host_stall_max_us": _f(d.max()) if len(d) else None, "host_stall_min_us": lo}

    def _miss(self, name: str, reason: str) -> None:
        self.run_missing[name] = reason

    def _run_metrics(self) -> dict[str, Any]:
        a, k, sel = self.a, self.k, self.a.selected
        v: dict[str, Any] = {}
        v["steps"] = a.steps_per_rank()
        v["ranks"] = a.n_ranks
        v["tp_size"] = a.run_model.value("tp_size") or a.n_ranks
        samples = a.step_samples()
        v["step_us"] = _f(np.median(samples["step_us"])) if len(samples) else None
        v["step_us_p90"] = _f(np.percentile(samples["step_us"], 90)) if len(samples) else None
        per_rank = sel.groupby("rank").agg(span=("span_us", "median"), busy=("busy_us", "median"),
                                           idle=("idle_us", "median"))
        v["span_us_per_step"] = _f(per_rank["span"].mean()) if len(per_rank) else None
        v["busy_us_per_step"] = _f(per_rank["busy"].mean()) if len(per_rank) else None
        v["idle_us_per_step"] = _f(per_rank["idle"].mean()) if len(per_rank) else None
        v["idle_share"] = (v["idle_us_per_step"] / v["span_us_per_step"]
                           if v["span_us_per_step"] and v["idle_us_per_step"] is not None else None)
        n = self.n_step_rows
        v["kernel_us_per_step"] = self.total_us / n
        v["kernels_per_step"] = len(k) / n
        kern = k.loc[(k["kind"] == "kernel").to_numpy(), ["dur"]]
        v["tiny_kernels_per_step"] = float((kern["dur"] < TINY_KERNEL_US).sum()) / n
        v["tiny_kernel_share"] = (v["tiny_kernels_per_step"] / (len(kern) / n)) if len(kern) else None
        v["median_kernel_us"] = _f(np.median(k["dur"])) if len(k) else None
        gaps_n, gaps_us = self._gaps()
        v["gaps_per_step"] = gaps_n / n
        v["gap_us_per_step"] = gaps_us / n
        replay = float(k.loc[k["graph_replay"], "dur"].sum()) if len(k) else 0.0
        v["graph_replay_share"] = replay / self.total_us if self.total_us else None
        v["cuda_graph"] = bool(v["graph_replay_share"] is not None and v["graph_replay_share"] > 0.5)
        mem = k.loc[(k["kind"] == "memcpy").to_numpy(), ["name", "dur"]]  # the name test only on memcpy rows (a regex per kernel is slow)
        dtoh = mem[mem["name"].str.contains(DTOH)]
        v["dtoh_per_step"] = len(dtoh) / n
        v["dtoh_us_per_step"] = float(dtoh["dur"].sum()) / n
        calls, call_us, bubble = self._syncs()
        v["sync_calls_per_step"] = calls / n
        v["sync_us_per_step"] = call_us / n
        v["sync_idle_us_per_step"] = bubble / n
        v.update(self._host_stalls())
        rm = a.run_model
        for name in ("batch", "layers", "kv_pool_tokens", "kv_cache_dtype", "kv_row_bytes"):
            v[name] = rm.value(name)
            if v[name] is None:
                self._miss(name, rm.missing(name) or "unknown")
        v["layers_source"] = rm.source("layers")
        v["kv_pool_bytes_per_layer"] = (v["kv_pool_tokens"] * v["kv_row_bytes"]
                                        if v["kv_pool_tokens"] and v["kv_row_bytes"] else None)
        if v["kv_pool_bytes_per_layer"] is None:
            self._miss("kv_pool_bytes_per_layer", self.run_missing.get("kv_row_bytes")
                       or self.run_missing.get("kv_pool_tokens", "unknown"))
        spec = self._gpu_spec()
        v["gpu"] = spec.name if spec is not None else None
        v["mem_bw_gbps"] = spec.mem_bw_gbps if spec is not None else None
        # classes
        by_cls = k.groupby("cls", observed=True)["dur"].agg(["sum", "count"]) if len(k) else None
        for c in class_ids():
            us = float(by_cls.loc[c, "sum"]) if by_cls is not None and c in by_cls.index else 0.0
            cnt = int(by_cls.loc[c, "count"]) if by_cls is not None and c in by_cls.index else 0
            v[f"cls_{c}_us_per_step"] = us / n
            v[f"cls_{c}_share"] = us / self.total_us if self.total_us else None
            v[f"cls_{c}_calls_per_step"] = cnt / n
        v["comm_us_per_step"] = v.get("cls_comm_us_per_step", 0.0)
        v["compute_us_per_step"] = max(v["kernel_us_per_step"] - v["comm_us_per_step"], 0.0)
        v["comm_share"] = v.get("cls_comm_share")
        v["moe_gemm_us_per_step"] = v.get("cls_moe_gemm_us_per_step", 0.0)
        v["moe_dispatch_us_per_step"] = v.get("cls_moe_dispatch_us_per_step", 0.0)
        v["moe_dispatch_ratio"] = (v["moe_dispatch_us_per_step"] / v["moe_gemm_us_per_step"]
                                   if v["moe_gemm_us_per_step"] else None)
        v["moe_dispatch_compute_share"] = (v["moe_dispatch_us_per_step"] / v["compute_us_per_step"]
                                           if v["compute_us_per_step"] else None)
        if v["moe_dispatch_ratio"] is None:
            self._miss("moe_dispatch_ratio", "no expert (moe_gemm) kernels in the analysed steps")
        ranks = self.rank_subjects()
        waits = [(r.values["wait_share"], r.values["wait_us"]) for r in ranks if r.values.get("wait_share") is not None]
        v["max_wait_share"] = max(w[0] for w in waits) if waits else None
        v["max_wait_us_per_step"] = max(w[1] for w in waits if w[1] is not None) if waits else None
        tr = [r.values["transfer_us"] for r in ranks if r.values.get("transfer_us") is not None]
        v["transfer_us_per_step"] = float(np.mean(tr)) if tr else None
        v["transfer_share"] = (v["transfer_us_per_step"] / v["step_us"]
                               if v["transfer_us_per_step"] is not None and v["step_us"] else None)
        comm_r = [r.values["comm_us"] for r in ranks if r.values.get("transfer_us") is not None]
        v["comm_transfer_share"] = (v["transfer_us_per_step"] / float(np.mean(comm_r))
                                    if tr and comm_r and float(np.mean(comm_r)) > 0 else None)
        c = self.a.collectives
        st = getattr(c, "straggler", None) if c is not None else None
        v["straggler_rank"] = st.get("rank") if isinstance(st, dict) else None
        labels = {r.rank: r.label for r in a.trace.ranks}
        v["straggler_label"] = labels.get(v["straggler_rank"]) if v["straggler_rank"] is not None else None
        if v["straggler_rank"] is None:
            self._miss("straggler_rank", (st or {}).get("reason") if isinstance(st, dict) and st.get("reason")
                       else self._coll_reason() if not waits else "no rank stands out")
        if not waits:
            reason = self._coll_reason()
            for name in ("max_wait_share", "max_wait_us_per_step", "transfer_us_per_step", "transfer_share",
                         "comm_transfer_share"):
                self._miss(name, reason)
        return v

    def _gaps(self) -> tuple[int, float]:
        k = self.k
        if not len(k):
            return 0, 0.0
        d = k[["rank", "step", "ts", "end"]].sort_values(["rank", "step", "ts"], kind="stable")
        prev_end = d.groupby(["rank", "step"], sort=False)["end"].cummax()
        prev_end = prev_end.groupby([d["rank"], d["step"]], sort=False).shift(1)
        gap = (d["ts"] - prev_end).to_numpy()
        gap = gap[np.isfinite(gap) & (gap >= GAP_MIN_US)]
        return int(len(gap)), float(gap.sum())

    def _syncs(self) -> tuple[int, float, float]:
        a = self.a
        rt = a.trace.runtime
        if not len(rt) or not len(self.a.selected):
            return 0, 0.0, 0.0
        rt = rt[rt["name"].isin(SYNC_CALLS)]
        calls, call_us, bubble = 0, 0.0, 0.0
        allk = a.trace.kernels
        for rank, steps in a.selected.groupby("rank"):
            r = rt[rt["rank"] == rank]
            if not len(r):
                continue
            st = steps.sort_values("cpu_start")
            s0, s1 = st["cpu_start"].to_numpy(), st["cpu_end"].to_numpy()
            if np.isnan(s0).all():
                continue
            ts, end = r["ts"].to_numpy(), r["end"].to_numpy()
            pos = np.searchsorted(s0, ts, side="right") - 1
            inside = (pos >= 0) & (ts <= s1[np.maximum(pos, 0)])
            if not inside.any():
                continue
            calls += int(inside.sum())
            call_us += float((end - ts)[inside].sum())
            rk = allk[allk["rank"] == rank]
            kts = np.sort(rk["ts"].to_numpy())
            kend_sorted_by_ts = rk.sort_values("ts")["end"].to_numpy()
            run_end = np.maximum.accumulate(kend_sorted_by_ts) if len(kend_sorted_by_ts) else kend_sorted_by_ts
            for t0, e in zip(ts[inside], end[inside], strict=True):
                j = np.searchsorted(kts, e, side="left")  # first GPU activity starting after the call returned
                if j >= len(kts) or j == 0:
                    continue
                last_end = run_end[j - 1]
                # the call drained the GPU only if work was still running when it was made; a GPU that
                # was already idle is the host's doing (launch-bound), not the sync's
                if t0 < last_end <= e:
                    bubble += float(kts[j] - last_end)
        return calls, call_us, bubble

    def capture_parsed(self) -> dict[int, Any]:
        """Per rank, the parsed CUDA-graph capture trace (``ParsedRank``), when one was found."""
        if self._capture_shapes is None:
            out: dict[int, Any] = {}
            graph_ops = getattr(self.a, "graph_ops", None)
            read = graph_ops.captures if graph_ops is not None else {}
            for rank, path in sorted(self.a.trace.capture_traces.items()):
                cap = read.get(rank)
                if cap is not None and cap.path == path:  # the graphs stage read it already
                    if cap.parsed is not None:
                        out[rank] = cap.parsed
                    continue
                try:
                    from traceinspect.load.parse import parse_file

                    out[rank] = parse_file(path)
                except Exception:  # noqa: BLE001 - capture traces are optional evidence
                    continue
            self._capture_shapes = out
        return self._capture_shapes

    def capture_shapes(self) -> dict[int, pd.DataFrame]:
        """Per rank, the CPU ops (name, input_dims, input_types) of the CUDA-graph capture trace."""
        return {r: p.cpu_ops for r, p in self.capture_parsed().items()}

    def _gpu_spec(self) -> Any:
        eff = self.a.efficiency
        spec = getattr(eff, "gpu", None) or getattr(eff, "spec", None)
        if spec is not None and hasattr(spec, "mem_bw_gbps"):
            return spec
        try:
            from traceinspect.measure.specs import resolve_gpu

            dev = self.a.trace.ranks[0].device if self.a.trace.ranks else None
            spec, why = resolve_gpu(dev.name if dev else None, dev.compute_capability if dev else None,
                                    self.a.options.gpu)
        except Exception as e:  # noqa: BLE001
            spec, why = None, str(e)
        if spec is None:
            self._miss("gpu", why)
            self._miss("mem_bw_gbps", why)
        return spec

    def _coll_reason(self) -> str:
        if self.a.n_ranks < 2:
            return "single rank: no multi-rank collective analysis"
        c = self.a.collectives
        if c is None:
            return "the collectives stage produced no result"
        return getattr(c, "reason", None) or "the collectives stage has no per-rank wait/transfer split"

    # ------------------------------------------------------------------ kernels
    def kernel_subjects(self, mask: np.ndarray, group_by: str | None) -> list[Subject]:
        """Subjects for kernels selected by ``mask`` (over ``analysis.kernels``), grouped by
        nothing (one family), 'name' or 'cls'."""
        sub = self.k[mask]
        if not len(sub):
            return []
        if group_by in ("name", "cls"):
            groups = [g for _, g in sub.groupby(group_by, observed=True, sort=False)]
        else:
            groups = [sub]
        out = [self._family(g) for g in groups if len(g)]
        out.sort(key=lambda s: -(s.values["us_per_step"] or 0.0))
        return out

    def _family(self, g: pd.DataFrame) -> Subject:
        n = self.n_step_rows
        v: dict[str, Any] = {}
        missing: dict[str, str] = {}
        by_name = g.groupby("name", observed=True)["dur"].sum().sort_values(ascending=False)
        top = str(by_name.index[0])
        v["name"] = top
        v["names"] = len(by_name)
        v["cls"] = str(g.loc[g["name"] == top, "cls"].iloc[0])
        ops = g.loc[g["op_name"] != "", "op_name"]
        v["op_name"] = str(ops.mode().iloc[0]) if len(ops) else ""
        v["calls"] = len(g)
        v["calls_per_step"] = len(g) / n
        layers = self.run.get("layers")
        v["calls_per_layer"] = v["calls_per_step"] / layers if layers else None
        if layers is None:
            missing["calls_per_layer"] = self.run_missing.get("layers", "layers unknown")
        us = float(g["dur"].sum())
        v["us_per_step"] = us / n
        v["share"] = us / self.total_us if self.total_us else None
        step_us = self.run.get("step_us")
        v["step_share"] = v["us_per_step"] / step_us if step_us else None
        comp = self.run.get("compute_us_per_step")
        v["compute_share"] = v["us_per_step"] / comp if comp else None
        v["mean_us"] = float(g["dur"].mean())
        v["dur_cv"] = float(g["dur"].std(ddof=0) / g["dur"].mean()) if g["dur"].mean() > 0 else None
        rows, nbytes, source = self._shapes(g)
        v["rows_per_call"], v["bytes_per_call"], v["shape_source"] = rows, nbytes, source
        if nbytes is None:
            why = ("no tensor shapes: kernels replayed from a CUDA graph and no capture trace matched"
                   if g["graph_replay"].mean() > 0.5 else "the launching CPU ops recorded no input shapes")
            missing.update({"rows_per_call": why, "bytes_per_call": why, "gbps": why})
        v["gbps"] = nbytes / v["mean_us"] / 1e3 if nbytes and v["mean_us"] > 0 else None
        v["graph_share"] = float(g["graph_replay"].mean())
        ranks = sorted(int(r) for r in g["rank"].unique())
        v["rank_count"] = len(ranks)
        label = top if v["names"] == 1 else f"{top} (+{v['names'] - 1} more)"
        return Subject("kernels", label, v, ranks, missing,
                       tuple(sorted({str(c) for c in g["cls"].unique()})))

    _calls_bytes: pd.Series | None = None

    def _eff_bytes(self) -> pd.Series:
        """Bytes moved per kernel row (efficiency stage memory/GEMM model), indexed by kernel row."""
        if self._calls_bytes is None:
            calls = getattr(self.a.efficiency, "calls", None)
            if isinstance(calls, pd.DataFrame) and len(calls) and {"kernel", "bytes"} <= set(calls.columns):
                c = calls[["kernel", "bytes", "shape_source"]].copy()
                c["bytes"] = pd.to_numeric(c["bytes"], errors="coerce")
                c = c[c["bytes"].notna()].drop_duplicates("kernel")
                self._calls_bytes = c.set_index("kernel")
            else:
                self._calls_bytes = pd.DataFrame(columns=["bytes", "shape_source"])
        return self._calls_bytes

    def _shapes(self, g: pd.DataFrame) -> tuple[float | None, float | None, str | None]:
        """(rows_per_call, bytes_per_call, source) of a kernel family."""
        eb = self._eff_bytes()
        hit = eb[eb.index.isin(g.index)]
        nbytes = _median(hit["bytes"]) if len(hit) else None
        source = None
        if len(hit):
            srcs = sorted(set(hit["shape_source"].astype(str)))
            source = {"shapes": "cpu_op", "graph_capture": "capture"}.get(srcs[0], srcs[0]) if len(srcs) == 1 \
                else "+".join(srcs)
        if nbytes is None:
            mem = g[(g["kind"] == "memcpy") & (g["bytes"] >= 0)]
            if len(mem):
                nbytes, source = _median(mem["bytes"]), "memcpy"
        rows = self._read_rows(g)
        if rows is not None and source is None:
            source = "cpu_op"
        if (nbytes is None or rows is None) and bool(g["graph_replay"].mean() > 0.5):
            cap = self._capture_cast_shapes(g)
            if cap is not None:
                if rows is None:
                    rows = cap[0]
                if nbytes is None:
                    nbytes = cap[1]
                source = source or "capture"
        return rows, nbytes, source

    def _capture_casts(self, rank: int) -> list[tuple[tuple[int, ...], str, int]] | None:
        """dtype-changing ``aten::copy_`` ops recorded inside the CUDA-graph capture of one rank:
        (source shape, destination dtype, bytes read + written), in capture order."""
        if not hasattr(self, "_cap_casts"):
            self._cap_casts: dict[int, list[tuple[tuple[int, ...], str, int]] | None] = {}
        if rank in self._cap_casts:
            return self._cap_casts[rank]
        out: list[tuple[tuple[int, ...], str, int]] | None = None
        ops = self.capture_shapes().get(rank)
        if ops is not None and len(ops):
            window = self._capture_window(rank)
            sel = ops[ops["name"] == "aten::copy_"]
            if window is not None:
                sel = sel[(sel["ts"] >= window[0]) & (sel["ts"] <= window[1])]
            out = []
            for row in sel.sort_values("ts").itertuples():
                dims, types = _dims(row.input_dims) or [], _dims(row.input_types) or []
                if len(dims) < 2 or len(types) < 2:
                    continue
                dst, src = dims[0], dims[1]
                if not (isinstance(src, list) and src and isinstance(dst, list) and dst):
                    continue
                if types[0] == types[1]:
                    continue
                sb, db = _tensor_bytes(src, types[1]), _tensor_bytes(dst, types[0])
                if sb is None or db is None:
                    continue
                out.append((tuple(src), str(types[0]), sb + db))
        self._cap_casts[rank] = out
        return out

    def _capture_window(self, rank: int) -> tuple[float, float] | None:
        parsed = self.capture_parsed().get(rank)
        if parsed is None:
            return None
        rt = parsed.runtime
        b = rt.loc[rt["name"] == "cudaStreamBeginCapture", "ts"]
        e = rt.loc[rt["name"] == "cudaStreamEndCapture", "end"]
        if len(b) != 1 or len(e) != 1:
            return None  # several captures (or none) in one file: no single window
        return float(b.iloc[0]), float(e.iloc[0])

    def _capture_cast_shapes(self, g: pd.DataFrame) -> tuple[float, float] | None:
        """Shapes of graph-replayed cast kernels from the capture trace, matched by count: the
        captured dtype-changing copies into the kernel's destination dtype, grouped by source
        shape; a group is the family's when it is the only one with as many members as the family
        has calls per graph replay. None unless that holds on every rank with a capture trace."""
        names = g["name"].unique()
        dsts = {m.group(1) for m in (CAST_DST.search(str(n)) for n in names) if m}
        if len(dsts) != 1:
            return None
        dst = dsts.pop().lower()
        rows, nbytes = [], []
        for rank, rg in g[g["graph_replay"]].groupby("rank"):
            casts = self._capture_casts(int(rank))
            if not casts:
                return None
            replays = rg["correlation"].nunique()
            if replays == 0 or len(rg) % replays:
                return None
            per = len(rg) // replays
            groups: dict[tuple[int, ...], list[int]] = {}
            for shape, dtype, b in casts:
                if dtype.lower().replace("c10::", "") == dst:
                    groups.setdefault(shape, []).append(b)
            hits = [(shape, bs) for shape, bs in groups.items() if len(bs) == per]
            if len(hits) != 1:
                return None
            rows.append(float(hits[0][0][0]))
            nbytes.append(float(np.median(hits[0][1])))
        if not rows:
            return None
        return float(np.median(rows)), float(np.median(nbytes))

    def _read_rows(self, g: pd.DataFrame) -> float | None:
        """Median first dimension of the tensor the launching op reads (copy_: its source)."""
        ops = self.a.trace.cpu_ops
        idx = g.loc[g["op_idx"] >= 0, "op_idx"].to_numpy()
        if not len(idx) or not len(ops):
            return None
        rows: list[float] = []
        uniq, counts = np.unique(idx, return_counts=True)
        pos = ops.index.get_indexer(uniq)
        names = ops["name"].to_numpy(dtype=object)[pos].tolist()
        dims_raw = ops["input_dims"].to_numpy(dtype=object)[pos].tolist()
        memo: dict[tuple[str, Any], float | None] = {}  # ops recorded with equal shapes decode once
        for name, raw, c in zip(names, dims_raw, counts.tolist(), strict=True):
            key = (name, raw)
            try:
                row = memo[key]
            except KeyError:
                row = memo[key] = _first_rows(str(name), _dims(raw))
            except TypeError:  # an unhashable (already decoded) value
                row = _first_rows(str(name), _dims(raw))
            if row is not None:
                rows.extend([row] * c)
        return _median(rows) if rows else None

    # ------------------------------------------------------------------ gemm
    _gemm_cache: pd.DataFrame | None = None

    def gemm_rows(self) -> pd.DataFrame | None:
        """GEMM calls of the efficiency stage aggregated per shape: cls, op_name, dtype, m (rows per
        expert for grouped GEMMs), n, k, batch, is_moe, known, calls, us, flops, peak_us (peak x us),
        ranks. None when the efficiency stage produced no GEMM calls."""
        if self._gemm_cache is not None:
            return self._gemm_cache
        eff = self.a.efficiency
        calls = getattr(eff, "calls", None)
        if not isinstance(calls, pd.DataFrame) or not len(calls) or "kind" not in calls.columns:
            return None
        g = calls[calls["kind"] == "gemm"].copy()
        if not len(g):
            return None
        groups = pd.to_numeric(g.get("groups"), errors="coerce").fillna(1).clip(lower=1)
        m = pd.to_numeric(g["m"], errors="coerce")
        g["m"] = m / groups
        for c in ("n", "k"):
            g[c] = pd.to_numeric(g[c], errors="coerce")
        g["batch"] = pd.to_numeric(g.get("batch"), errors="coerce").fillna(1)
        g["known"] = g["m"].notna() & g["n"].notna() & g["k"].notna()
        g["is_moe"] = g["moe"].astype(bool) if "moe" in g.columns else (g["cls"] == "moe_gemm")
        g["flops"] = pd.to_numeric(g["flops"], errors="coerce")
        peak = pd.to_numeric(g.get("peak_tflops"), errors="coerce")
        g["peak_us"] = (peak * g["us"]).where(peak.notna(), np.nan)
        g["peak_known_us"] = g["us"].where(peak.notna(), 0.0)
        g["dtype"] = g["dtype"].fillna("").astype(object)
        g["op_name"] = g["op_name"].fillna("").astype(object)
        keys = ["cls", "op_name", "dtype", "m", "n", "k", "batch", "is_moe", "known"]
        for c in ("m", "n", "k"):
            g[c] = g[c].fillna(-1.0)
        agg = g.groupby(keys, sort=False, dropna=False).agg(
            calls=("us", "size"), us=("us", "sum"), flops=("flops", "sum"),
            peak_us=("peak_us", "sum"), peak_known_us=("peak_known_us", "sum"),
            ranks=("rank", lambda r: tuple(sorted({int(x) for x in r})))).reset_index()
        for c in ("m", "n", "k"):
            agg[c] = agg[c].where(agg[c] >= 0, np.nan)
        self._gemm_cache = agg.sort_values("us", ascending=False).reset_index(drop=True)
        return self._gemm_cache

    def gemm_row_values(self, row: pd.Series) -> dict[str, Any]:
        """Metrics of one shape row (what ``select.gemm.where`` sees)."""
        return self._gemm_group(pd.DataFrame([row])).values

    def gemm_subjects(self, rows: pd.DataFrame, group_by: str | None, unknown: pd.DataFrame | None = None
                      ) -> list[Subject]:
        known = rows[rows["known"].astype(bool)]
        if not len(known):
            return []
        if group_by == "shape":
            groups = [known.iloc[[i]] for i in range(len(known))]
        elif group_by in ("cls", "moe"):
            col = "cls" if group_by == "cls" else "is_moe"
            groups = [g for _, g in known.groupby(col, sort=False)]
        else:
            groups = [known]
        out = []
        for g in groups:
            unk = None
            if unknown is not None and len(unknown):
                unk = unknown
                if group_by in ("cls", "moe"):
                    col = "cls" if group_by == "cls" else "is_moe"
                    unk = unknown[unknown[col] == g[col].iloc[0]]
            out.append(self._gemm_group(g, unk))
        out.sort(key=lambda s: -(s.values["us_per_step"] or 0.0))
        return out

    def _gemm_group(self, g: pd.DataFrame, unknown: pd.DataFrame | None = None) -> Subject:
        n = self.n_step_rows
        v: dict[str, Any] = {}
        missing: dict[str, str] = {}
        us = g["us"].astype(float).to_numpy()
        m = g["m"].astype(float).to_numpy()
        top = g.iloc[int(np.argmax(us))]
        v["m"] = _weighted_median(m, us)
        v["m_min"] = _f(np.nanmin(m))
        v["m_max"] = _f(np.nanmax(m))
        v["n"] = _f(top["n"])
        v["k"] = _f(top["k"])
        v["batch"] = _f(top["batch"])
        v["dtype"] = str(top["dtype"]) or None
        v["op_name"] = str(top["op_name"])
        v["shapes"] = len(g)
        moe = g["is_moe"].astype(bool).to_numpy()
        v["is_moe"] = bool(moe.all())
        v["per_expert_m"] = _weighted_median(m[moe], us[moe]) if moe.any() else None
        if not moe.any():
            missing["per_expert_m"] = "no expert GEMMs in the subject"
        v["calls_per_step"] = float(g["calls"].sum()) / n
        v["us_per_step"] = float(us.sum()) / n
        v["share"] = float(us.sum()) / self.total_us if self.total_us else None
        comp = self.run.get("compute_us_per_step")
        v["compute_share"] = v["us_per_step"] / comp if comp else None
        flops = float(np.nansum(g["flops"].astype(float)))
        v["tflops"] = flops / float(us.sum()) / 1e6 if us.sum() > 0 and flops > 0 else None
        pk_us = float(g["peak_known_us"].sum())
        peak = float(g["peak_us"].sum()) / pk_us if pk_us > 0 else None
        v["peak_tflops"] = peak
        v["pct_peak"] = v["tflops"] / peak if v["tflops"] is not None and peak else None
        if v["pct_peak"] is None:
            missing["pct_peak"] = ("GEMM FLOPs unknown" if v["tflops"] is None else
                                   "no dense peak for this GPU and dtype in rules/gpus.yaml ("
                                   + (getattr(self.a.efficiency, "spec_reason", "") or "GPU unknown") + ")")
        unk_us = float(unknown["us"].sum()) if unknown is not None and len(unknown) else 0.0
        v["unknown_share"] = unk_us / (unk_us + float(us.sum())) if (unk_us + us.sum()) > 0 else None
        ranks = sorted({r for t in g["ranks"] for r in t})
        kind = "expert GEMMs" if v["is_moe"] else ("GEMMs" if moe.any() else "dense GEMMs")
        label = f"{kind} M={_fmt_num(v['m'])}" if len(g) > 1 else \
            f"{kind} M={_fmt_num(v['m'])} N={_fmt_num(v['n'])} K={_fmt_num(v['k'])} {v['dtype'] or ''}".strip()
        return Subject("gemm", label, v, ranks, missing, tuple(sorted({str(c) for c in g["cls"].unique()})))

    # ------------------------------------------------------------------ rank
    _ranks_cache: list[Subject] | None = None

    def rank_subjects(self) -> list[Subject]:
        if self._ranks_cache is not None:
            return self._ranks_cache
        a, k = self.a, self.k
        sel = a.selected.copy()
        sel["pos"] = sel.groupby("rank").cumcount()
        n_al = a.steps_per_rank()
        al = sel[sel["pos"] < n_al]
        kc = k[["rank", "step", "dur", "end"]]
        is_comm = (k["cls"] == "comm").to_numpy()
        noncomm = kc[~is_comm]
        comp = noncomm.groupby(["rank", "step"])["dur"].sum() if len(noncomm) else pd.Series(dtype=float)
        comp_end = noncomm.groupby(["rank", "step"])["end"].max() if len(noncomm) else pd.Series(dtype=float)
        comm = kc[is_comm]
        comm_us = comm.groupby("rank")["dur"].sum() if len(comm) else pd.Series(dtype=float)
        steps_per = sel.groupby("rank").size()
        per_rank_comp = {}
        for rank, grp in sel.groupby("rank"):
            vals = [float(comp.get((rank, s), 0.0)) for s in grp.index]
            per_rank_comp[int(rank)] = _median(vals)
        # slowest / lag over aligned steps
        slow_count: dict[int, int] = {}
        lag: dict[int, list[float]] = {}
        if a.n_ranks > 1 and n_al:
            for _pos, grp in al.groupby("pos"):
                starts = grp.set_index("rank")["gpu_start"]
                first = starts.min()
                for r, s in starts.items():
                    lag.setdefault(int(r), []).append(float(s - first))
                ends = {int(r): float(comp_end.get((r, s), np.nan)) for r, s in zip(grp["rank"], grp.index,
                                                                                      strict=True)}
                ends = {r: e for r, e in ends.items() if np.isfinite(e)}
                if len(ends) == len(grp):
                    # finishing last relative to the rank's own step start is what makes others wait
                    rel = {r: ends[r] - float(starts.min()) for r in ends}
                    last = max(rel, key=rel.get)  # type: ignore[arg-type]
                    slow_count[last] = slow_count.get(last, 0) + 1
        coll = self._collective_rows()
        out = []
        for info in a.trace.ranks:
            r = info.rank
            rs = sel[sel["rank"] == r]
            v: dict[str, Any] = {"rank": r, "rank_label": info.label}
            missing: dict[str, str] = {}
            v["rank_step_us"] = _f(rs["span_us"].median()) if len(rs) else None
            v["rank_busy_us"] = _f(rs["busy_us"].median()) if len(rs) else None
            v["rank_compute_us"] = per_rank_comp.get(r)
            others = [per_rank_comp[o] for o in per_rank_comp if o != r and per_rank_comp[o] is not None]
            v["others_compute_us"] = _median(others) if others else None
            v["compute_excess"] = (v["rank_compute_us"] / v["others_compute_us"] - 1
                                   if v["rank_compute_us"] is not None and v["others_compute_us"] else None)
            v["rank_launch_lag_us"] = _median(lag.get(r, [])) if lag else None
            v["slowest_step_fraction"] = slow_count.get(r, 0) / n_al if (a.n_ranks > 1 and n_al) else None
            ns = max(int(steps_per.get(r, 0)), 1)
            c = coll.get(r, {})
            v["comm_us"] = c["comm_us"] if c.get("comm_us") is not None else float(comm_us.get(r, 0.0)) / ns
            v["rank_comm_share"] = v["comm_us"] / v["rank_step_us"] if v["rank_step_us"] else None
            for key in ("wait_us", "transfer_us", "wait_share", "late_arrivals", "waited_on_share",
                        "wait_caused_us", "launch_lateness_us"):
                v[key] = c.get(key)
            if v["wait_us"] is not None and v["transfer_us"] is None:
                v["transfer_us"] = max(v["comm_us"] - v["wait_us"], 0.0)
            if v["wait_share"] is None and v["wait_us"] is not None and v["comm_us"]:
                v["wait_share"] = min(v["wait_us"] / v["comm_us"], 1.0)
            for key in ("wait_us", "transfer_us", "wait_share", "late_arrivals", "waited_on_share",
                        "wait_caused_us", "launch_lateness_us"):
                if v[key] is None:
                    missing[key] = c.get("_reason") or self._coll_reason()
            if a.n_ranks < 2:
                for key in ("others_compute_us", "compute_excess", "rank_launch_lag_us", "slowest_step_fraction"):
                    missing[key] = "single rank"
            out.append(Subject("rank", info.label, v, [r], missing))
        self._ranks_cache = out
        return out

    def _collective_rows(self) -> dict[int, dict[str, Any]]:
        """Per-rank wait/transfer figures from the collectives stage, normalised to per-step values."""
        c = self.a.collectives
        if c is None:
            return {}
        per_rank = getattr(c, "per_rank", None)
        if per_rank is None:
            return {}
        rows: list[dict[str, Any]]
        if isinstance(per_rank, pd.DataFrame):
            rows = per_rank.to_dict("records")
        elif isinstance(per_rank, dict):
            rows = [dict(v, rank=k) if isinstance(v, dict) else {"rank": k, **getattr(v, "__dict__", {})}
                    for k, v in per_rank.items()]
        elif isinstance(per_rank, Sequence):
            rows = [r if isinstance(r, dict) else dict(getattr(r, "__dict__", {})) for r in per_rank]
        else:
            return {}
        out: dict[int, dict[str, Any]] = {}
        total_wait = sum(_f(_first(r, "wait_us")) or 0.0 for r in rows)
        for row in rows:
            if "rank" not in row:
                continue
            r = int(row["rank"])
            d: dict[str, Any] = {}
            d["comm_us"] = _f(_first(row, "comm_us_per_step"))
            d["wait_us"] = _f(_first(row, "wait_us_per_step"))
            d["transfer_us"] = _f(_first(row, "transfer_us_per_step"))
            d["wait_share"] = _f(_first(row, "wait_share"))
            d["late_arrivals"] = _f(_first(row, "late_share"))
            d["wait_caused_us"] = _f(_first(row, "wait_caused_us_per_step"))
            caused = _f(_first(row, "wait_caused_us"))
            d["waited_on_share"] = caused / total_wait if caused is not None and total_wait > 0 else None
            d["launch_lateness_us"] = _f(_first(row, "launch_lateness_us_median"))
            out[r] = d
        return out

    # ------------------------------------------------------------------ class
    def class_subjects(self, classes: Sequence[str] | None) -> list[Subject]:
        out = []
        for c in classes or class_ids():
            us = self.run.get(f"cls_{c}_us_per_step")
            if not us:
                continue
            v = {"class_name": c, "class_us_per_step": us, "class_share": self.run.get(f"cls_{c}_share"),
                 "class_calls_per_step": self.run.get(f"cls_{c}_calls_per_step")}
            ranks = sorted(int(r) for r in self.k.loc[self.k["cls"] == c, "rank"].unique())
            out.append(Subject("class", c, v, ranks, classes=(c,)))
        return out

    def run_subject(self) -> Subject:
        return Subject("run", "run", {}, [r.rank for r in self.a.trace.ranks], {})


def _fmt_num(x: Any) -> str:
    return "?" if x is None else f"{x:g}"


def _first(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return None


def name_mask(names: pd.Series, include: Any, exclude: Any) -> np.ndarray:
    """Boolean mask of names (kernel names, op paths) matching ``include`` and not ``exclude`` (compiled
    regexes or None), evaluated once per distinct name."""
    def good(nm: Any) -> bool:
        s = str(nm)
        return bool((include is None or search(include, s)) and not (exclude is not None and search(exclude, s)))

    return per_distinct(names, good)
