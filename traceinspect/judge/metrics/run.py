"""``run`` metrics: one value per analysis, visible to every rule, declared beside the code that computes
them from the measured results (:mod:`traceinspect.measure.idle`, the run model, the collectives)."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np

from traceinspect.judge.metrics.registry import Subject, class_ids, declare
from traceinspect.measure.idle import (
    GAP_MIN_US,
    TINY_KERNEL_US,
    dtoh_copies,
    tiny_kernels,
)
from traceinspect.measure.specs import resolve_gpu
from traceinspect.units import finite

if TYPE_CHECKING:
    import pandas as pd

    from traceinspect.measure.host import HostActivity
    from traceinspect.model.analysis import Analysis

declare("run", "steps", "count", "Analysed steps per rank (the smallest count over ranks; first and last steps excluded).")
declare("run", "ranks", "count", "Ranks (trace files) in the trace set.")
declare("run", "tp_size", "count", "Tensor-parallel size from server_info (tp_size), else the number of ranks.")
declare("run", "step_us", "us", "Median decode step time: per aligned step, the slowest rank's GPU span "
   "(first GPU activity start to last end); median over analysed steps.")
declare("run", "step_us_p90", "us", "90th percentile of the step time defined in step_us.")
declare("run", "span_us_per_step", "us", "Mean per-rank GPU span of an analysed step.")
declare("run", "kernel_us_per_step", "us", "GPU activity time (kernels + memcpy + memset, summed) per rank per step.")
declare("run", "compute_us_per_step", "us", "GPU activity time outside collective kernels (class comm) per rank per "
   "step: the work itself, without the time collectives spin waiting for other ranks.")
declare("run", "busy_us_per_step", "us", "Time the GPU had at least one activity running, per rank per step.")
declare("run", "idle_us_per_step", "us", "GPU idle time inside the step's span (span minus busy), per rank per step.")
declare("run", "idle_share", "ratio", "idle_us_per_step / span_us_per_step.")
declare("run", "gaps_per_step", "count", f"Idle gaps of at least {GAP_MIN_US:g} us between consecutive GPU "
   "activities inside a step, per rank per step.")
declare("run", "gap_us_per_step", "us", f"Total length of the gaps counted in gaps_per_step (>= {GAP_MIN_US:g} us each).")
declare("run", "kernels_per_step", "count", "GPU activities (kernels, memcpy, memset) per rank per step.")
declare("run", "tiny_kernels_per_step", "count", f"Kernels shorter than {TINY_KERNEL_US:g} us per rank per step.")
declare("run", "tiny_kernel_share", "ratio", "tiny_kernels_per_step / kernels_per_step.")
declare("run", "median_kernel_us", "us", "Median duration of the analysed GPU activities.")
declare("run", "cuda_graph", "bool", "True when most analysed GPU time was replayed from CUDA graphs.")
declare("run", "graph_replay_share", "ratio", "Share of analysed GPU time replayed from CUDA graphs.")
declare("run", "dtoh_per_step", "count", "Device-to-host memcpy events (kind memcpy, name 'Memcpy DtoH ...') "
   "inside steps, per rank per step.")
declare("run", "dtoh_us_per_step", "us", "GPU time of those DtoH copies per rank per step.")
declare("run", "sync_calls_per_step", "count", "Blocking host calls (cudaStreamSynchronize, cudaDeviceSynchronize, "
   "cudaEventSynchronize, synchronous cudaMemcpy, ...) whose start lies inside a step's CPU window, per rank per step.")
declare("run", "sync_us_per_step", "us", "Host time spent inside those blocking calls, per rank per step.")
declare("run", "sync_idle_us_per_step", "us", "GPU bubble caused by those calls: for each call that was made while "
   "GPU work was still running (so it waited for the GPU to drain), the time from the end of that work to the "
   "start of the next GPU activity; per rank per step.")
declare("run", "host_stall_us_per_step", "us", "Host stalls per rank per step: time the launching thread spends inside "
        "the step's CPU window and GPU span outside every CPU op and runtime call, in stretches of at least "
        "host_stall_min_us (Python work between ops, busy waits, GC pauses).")
declare("run", "host_stalls_per_step", "count", "Those stretches per rank per step.")
declare("run", "host_stall_max_us", "us", "The longest of those stretches.")
declare("run", "host_stall_min_us", "us", "The least stretch that counts as a host stall (host_stall_min_us in "
        "rules/tables/replay.yaml).")
declare("run", "batch", "count", "Median batch size from the step annotations (step[DECODE bs=N]); None if not annotated.")
declare("run", "layers", "count", "Model layers per pipeline stage, from the run model (run.facts.layers): --layers "
   "or traceinspect.toml, else num_hidden_layers of the model config in server_info.json, else the period "
   "of the step's kernel sequence checked against the per-step count of per-layer kernels.")
declare("run", "layers_source", "text", "Where `layers` came from: 'user', 'server_info', 'trace_structure' or None.")
declare("run", "kv_pool_tokens", "tokens", "KV pool size in tokens: server_info max_total_num_tokens (None if absent).")
declare("run", "kv_cache_dtype", "text", "KV cache dtype: server_info kv_cache_dtype (auto: the model dtype), else the "
   "dtype of the recorded pool tensor (None if neither).")
declare("run", "kv_row_bytes", "bytes", "Bytes of one token's row of a per-layer KV pool: from a recorded tensor "
   "shape whose first dimension equals kv_pool_tokens (CPU ops of the trace, or of the CUDA-graph capture "
   "trace); None if no such tensor was recorded.")
declare("run", "kv_pool_bytes_per_layer", "bytes", "kv_pool_tokens x kv_row_bytes.")
declare("run", "gpu", "text", "GPU spec entry used for peaks (rules/tables/gpus.yaml), None if the device is not in the table.")
declare("run", "mem_bw_gbps", "GB/s", "Peak DRAM bandwidth of the GPU from the spec table.")
declare("run", "comm_us_per_step", "us", "Collective-communication kernel time (class comm) per rank per step.")
declare("run", "comm_share", "ratio", "Share of GPU time in class comm.")
declare("run", "moe_gemm_us_per_step", "us", "Expert GEMM time (class moe_gemm) per rank per step.")
declare("run", "moe_dispatch_us_per_step", "us", "MoE routing / permute / combine time (class moe_dispatch) per rank per step.")
declare("run", "moe_dispatch_ratio", "ratio", "moe_dispatch_us_per_step / moe_gemm_us_per_step (None without expert GEMMs).")
declare("run", "moe_dispatch_compute_share", "ratio", "moe_dispatch_us_per_step / compute_us_per_step.")
declare("run", "max_wait_share", "ratio", "Largest, over ranks, share of a rank's collective time spent waiting "
   "for other ranks (from the collectives stage).")
declare("run", "max_wait_us_per_step", "us", "Largest, over ranks, collective wait time per step.")
declare("run", "transfer_us_per_step", "us", "Collective transfer (non-waiting) time per step, mean over ranks.")
declare("run", "transfer_share", "ratio", "transfer_us_per_step / step_us.")
declare("run", "comm_transfer_share", "ratio", "Share of collective time that is transfer, not waiting: "
   "transfer_us_per_step / comm_us_per_step (mean over ranks).")
declare("run", "straggler_label", "text", "Label of straggler_rank (TP1, ...), or None when there is no straggler.")
declare("run", "straggler_rank", "id", "The rank the collectives stage names as the straggler (arrives last at "
   "most collectives and causes most of the wait), None if none stands out.")


def _mean_of_rank_medians(sel: pd.DataFrame, col: str) -> float | None:
    """The mean over ranks of each rank's median of ``col`` over its steps (missing values left out, as
    pandas' grouped median and mean leave them out); None when there is none."""
    if not len(sel):
        return None
    rank, x = sel["rank"].to_numpy(), sel[col].to_numpy(dtype=np.float64)
    order = np.argsort(rank, kind="stable")
    cuts = np.flatnonzero(np.r_[True, rank[order][1:] != rank[order][:-1], True])
    with warnings.catch_warnings():  # a rank whose values are all missing has a missing median
        warnings.simplefilter("ignore", RuntimeWarning)
        meds = np.array([np.nanmedian(x[order[a:b]]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)])
        return finite(np.nanmean(meds))


class RunMetrics:
    """The ``run`` scope of :class:`~traceinspect.judge.metrics.MetricContext`."""

    a: Analysis
    k: pd.DataFrame
    n_step_rows: int
    total_us: float
    run_missing: dict[str, str]

    def _host_stalls(self, host: HostActivity) -> dict[str, Any]:
        lo, st = host.stall_min_us, host.stalls
        n = self.n_step_rows
        d = (st["end"] - st["start"]).to_numpy(dtype=np.float64) if len(st) else np.zeros(0)
        return {"host_stall_us_per_step": float(d.sum()) / n, "host_stalls_per_step": len(d) / n,
                "host_stall_max_us": finite(d.max()) if len(d) else None, "host_stall_min_us": lo}

    def _miss(self, name: str, reason: str) -> None:
        self.run_missing[name] = reason

    def _run_metrics(self) -> dict[str, Any]:
        a, k, sel = self.a, self.k, self.a.selected
        v: dict[str, Any] = {}
        v["steps"] = a.steps_per_rank()
        v["ranks"] = a.n_ranks
        v["tp_size"] = a.run_model.value("tp_size") or a.n_ranks
        samples = a.step_samples()
        v["step_us"] = finite(np.median(samples["step_us"])) if len(samples) else None
        v["step_us_p90"] = finite(np.percentile(samples["step_us"], 90)) if len(samples) else None
        for name, col in (("span", "span_us"), ("busy", "busy_us"), ("idle", "idle_us")):
            v[f"{name}_us_per_step"] = _mean_of_rank_medians(sel, col)
        v["idle_share"] = (v["idle_us_per_step"] / v["span_us_per_step"]
                           if v["span_us_per_step"] and v["idle_us_per_step"] is not None else None)
        n = self.n_step_rows
        v["kernel_us_per_step"] = self.total_us / n
        v["kernels_per_step"] = len(k) / n
        tiny, n_kern = tiny_kernels(k)
        v["tiny_kernels_per_step"] = float(tiny) / n
        v["tiny_kernel_share"] = (v["tiny_kernels_per_step"] / (n_kern / n)) if n_kern else None
        v["median_kernel_us"] = finite(np.median(k["dur"])) if len(k) else None
        from traceinspect.measure.host import host_of

        host = host_of(a)
        gaps_n, gaps_us = host.gaps
        v["gaps_per_step"] = gaps_n / n
        v["gap_us_per_step"] = gaps_us / n
        replay = float(k.loc[k["graph_replay"], "dur"].sum()) if len(k) else 0.0
        v["graph_replay_share"] = replay / self.total_us if self.total_us else None
        v["cuda_graph"] = bool(v["graph_replay_share"] is not None and v["graph_replay_share"] > 0.5)
        n_dtoh, dtoh_us = dtoh_copies(k)
        v["dtoh_per_step"] = n_dtoh / n
        v["dtoh_us_per_step"] = dtoh_us / n
        calls, call_us, bubble = host.syncs
        v["sync_calls_per_step"] = calls / n
        v["sync_us_per_step"] = call_us / n
        v["sync_idle_us_per_step"] = bubble / n
        v.update(self._host_stalls(host))
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

    def _gpu_spec(self) -> Any:
        eff = self.a.efficiency
        spec = getattr(eff, "gpu", None) or getattr(eff, "spec", None)
        if spec is not None and hasattr(spec, "mem_bw_gbps"):
            return spec
        try:
            dev = self.a.trace.ranks[0].device if self.a.trace.ranks else None
            spec, why = resolve_gpu(dev.name if dev else None, dev.compute_capability if dev else None,
                                    self.a.options.gpu)
        except Exception as e:  # noqa: BLE001
            spec, why = None, str(e)
        if spec is None:
            self._miss("gpu", why)
            self._miss("mem_bw_gbps", why)
        return spec


    def run_subject(self) -> Subject:
        return Subject("run", "run", {}, [r.rank for r in self.a.trace.ranks], {})


