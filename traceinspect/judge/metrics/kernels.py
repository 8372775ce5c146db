"""``kernels`` metrics: one kernel family (picked by class, name or op), declared beside their computation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from traceinspect.judge.metrics.registry import Subject, declare

if TYPE_CHECKING:
    import pandas as pd

    from traceinspect.measure.families import FamilyShapes

declare("kernels", "name", "text", "Kernel name of the subject (the most expensive one when a family has several).")
declare("kernels", "names", "count", "Distinct kernel names in the subject.")
declare("kernels", "cls", "text", "Kernel class of the subject's most expensive kernel.")
declare("kernels", "op_name", "text", "Most frequent CPU op that launched the subject's kernels ('' under graph replay).")
declare("kernels", "calls", "count", "Calls in the analysed steps, all ranks.")
declare("kernels", "calls_per_step", "count", "Calls per rank per step.")
declare("kernels", "calls_per_layer", "count", "calls_per_step / layers.")
declare("kernels", "us_per_step", "us", "GPU time per rank per step.")
declare("kernels", "share", "ratio", "Share of all GPU time of the analysed steps.")
declare("kernels", "step_share", "ratio", "us_per_step / step_us.")
declare("kernels", "compute_share", "ratio", "us_per_step / compute_us_per_step: share of the GPU work that is not "
   "collectives (collective kernels of host-bound or imbalanced ranks mostly spin waiting).")
declare("kernels", "mean_us", "us", "Mean duration of one call.")
declare("kernels", "dur_cv", "ratio", "Coefficient of variation (std / mean) of the call durations: low means every "
   "call does the same amount of work.")
declare("kernels", "rows_per_call", "count", "Median first dimension of the tensor the launching CPU op reads "
   "(aten::copy_: its source; otherwise its first tensor argument); None for graph replays and when "
   "shapes were not recorded.")
declare("kernels", "bytes_per_call", "bytes", "Median bytes one call moves (read + written), from the efficiency "
   "stage's model of the launching op's recorded shapes (for graph replays: of the op recorded in the "
   "CUDA-graph capture trace); for memcpy events the copied bytes; None when unknown.")
declare("kernels", "gbps", "GB/s", "Achieved bandwidth: bytes_per_call / mean_us.")
declare("kernels", "shape_source", "text", "Where bytes_per_call / rows_per_call came from: 'cpu_op' (recorded "
   "shapes), 'capture' (graph-capture trace: for casts without a kernel-level match, the captured "
   "dtype-changing copies into the kernel's destination dtype whose count per graph equals the family's "
   "calls per replay), 'memcpy' or None.")
declare("kernels", "graph_share", "ratio", "Share of the subject's calls replayed from a CUDA graph.")
declare("kernels", "rank_count", "count", "Ranks on which the subject ran.")


class KernelMetrics:
    """The ``kernels`` scope of :class:`~traceinspect.judge.metrics.MetricContext`."""

    k: pd.DataFrame
    n_step_rows: int
    total_us: float
    run: dict[str, Any]
    run_missing: dict[str, str]
    shapes: FamilyShapes

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
        rows, nbytes, source = self.shapes.of(g)
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

