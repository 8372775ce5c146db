"""``gemm`` metrics: GEMM shapes of the efficiency stage, filtered and aggregated, declared beside their
computation."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from traceinspect.judge.metrics.registry import Subject, _fmt_num, _weighted_median, declare
from traceinspect.units import finite

if TYPE_CHECKING:
    import pandas as pd

    from traceinspect.model.analysis import Analysis

# the columns of the efficiency stage's shape rows (Efficiency.shapes) that the metrics read
_COLUMNS = ("us", "m", "n", "k", "batch", "dtype", "op_name", "is_moe", "calls", "flops", "peak_known_us", "peak_us",
            "ranks", "cls")
_ROOF = ("floor_us", "floor_unknown", "bytes", "t_memory_us", "t_compute_us", "weight_bytes", "rows",
         "weight_bytes_per_row", "memory_us",
         "compute_us", "latency_us", "kernels")

declare("gemm", "m", "rows", "GEMM M (rows of the activation; for grouped expert GEMMs the rows per expert): "
   "time-weighted median over the subject's calls.")
declare("gemm", "m_min", "rows", "Smallest M among the subject's calls.")
declare("gemm", "m_max", "rows", "Largest M among the subject's calls.")
declare("gemm", "n", "count", "GEMM N of the subject's most expensive shape.")
declare("gemm", "k", "count", "GEMM K of the subject's most expensive shape.")
declare("gemm", "batch", "count", "Batch count of a batched GEMM (bmm), 1 for plain GEMMs (most expensive shape).")
declare("gemm", "dtype", "text", "Compute dtype of the most expensive shape (fp4, fp8, bf16, fp16, fp32).")
declare("gemm", "op_name", "text", "CPU op of the most expensive shape (aten::mm, aten::_scaled_mm, ...).")
declare("gemm", "shapes", "count", "Distinct (M, N, K, batch, dtype) shapes in the subject.")
declare("gemm", "is_moe", "bool", "True when the subject's GEMMs are expert (MoE) GEMMs.")
declare("gemm", "per_expert_m", "rows", "Rows per expert of the subject's expert GEMMs (M of each per-expert "
   "GEMM, or rows / experts of a grouped GEMM), time-weighted median; None for dense GEMMs.")
declare("gemm", "calls_per_step", "count", "GEMM calls per rank per step (calls with known shapes).")
declare("gemm", "us_per_step", "us", "GPU time of those calls per rank per step.")
declare("gemm", "share", "ratio", "Share of all GPU time of the analysed steps.")
declare("gemm", "compute_share", "ratio", "us_per_step / compute_us_per_step (share of the non-collective GPU time).")
declare("gemm", "tflops", "TFLOP/s", "Achieved TFLOP/s: FLOPs (2*M*N*K per GEMM) summed over calls / kernel time.")
declare("gemm", "pct_peak", "percent", "100 x tflops / dense peak of the GPU for the dtype (rules/tables/gpus.yaml), "
   "in percent (0-100), as in the analysis JSON; None if the GPU or dtype has no peak in the table.")
declare("gemm", "peak_tflops", "TFLOP/s", "The dense peak used for pct_peak (time-weighted over the calls).")
declare("gemm", "floor_us_per_step", "us", "Roofline floor of the subject's calls per rank per step: the sum over "
   "calls of max(FLOPs / dense peak of the dtype, bytes / memory bandwidth); None when a call's is unknown.")
declare("gemm", "pct_roofline", "percent", "100 x floor_us_per_step / us_per_step: the share of what the GPU's peaks "
   "allow that the calls reach (of the bound that holds: compute or memory).")
declare("gemm", "bound", "text", "What bounds most of the subject's time at the roofline: compute, memory or "
   "latency (calls too short to reach either peak, rules/tables/roofline.yaml).")
declare("gemm", "memory_bound_share", "ratio", "Share of the subject's time in calls whose floor is the memory term.")
declare("gemm", "gbps", "GB/s", "Achieved bandwidth: bytes (weights, activations, output) / time.")
declare("gemm", "pct_bw", "percent", "100 x gbps / the GPU's memory bandwidth (rules/tables/gpus.yaml).")
declare("gemm", "weight_bytes_per_step", "bytes", "Weight bytes the subject's calls read per rank per step (K x N per "
   "call, group and batch, at the compute dtype).")
declare("gemm", "weight_bytes_per_token", "bytes", "Weight bytes read per step for each row (token) the calls "
   "multiply: the sum over calls of weight bytes / M, per rank per step.")
declare("gemm", "unknown_share", "ratio", "Share of the selected GEMM-class time whose shapes are unknown "
   "(no CPU op, no capture trace): they are left out of every other gemm metric.")


class GemmMetrics:
    """The ``gemm`` scope of :class:`~traceinspect.judge.metrics.MetricContext`."""

    a: Analysis
    n_step_rows: int
    total_us: float
    run: dict[str, Any]

    def gemm_rows(self) -> pd.DataFrame | None:
        """The GEMM calls of the efficiency stage per shape (:meth:`~traceinspect.measure.gemm.Efficiency.shapes`)."""
        eff = self.a.efficiency
        return eff.shapes() if eff is not None else None

    def gemm_columns(self, rows: pd.DataFrame) -> dict[str, np.ndarray]:
        """The columns of shape rows that the gemm metrics read, as arrays (taken once per selection)."""
        return {c: rows[c].to_numpy() for c in (*_COLUMNS, *(x for x in _ROOF if x in rows.columns))}

    def gemm_row_values(self, cols: dict[str, np.ndarray], i: int) -> dict[str, Any]:
        """Metrics of shape row ``i`` of :meth:`gemm_columns` (what ``select.gemm.where`` sees)."""
        return self._gemm_group(cols, np.array([i])).values

    def gemm_subjects(self, rows: pd.DataFrame, group_by: str | None, unknown: pd.DataFrame | None = None
                      ) -> list[Subject]:
        known_rows = np.flatnonzero(rows["known"].to_numpy().astype(bool))
        if not len(known_rows):
            return []
        cols = self.gemm_columns(rows)
        col = "cls" if group_by == "cls" else "is_moe"
        if group_by == "shape":
            groups = [known_rows[i:i + 1] for i in range(len(known_rows))]
        elif group_by in ("cls", "moe"):  # as groupby(col, sort=False): in order of first appearance, no missing key
            import pandas as pd

            codes, _ = pd.factorize(cols[col][known_rows], sort=False)
            groups = [known_rows[codes == c] for c in range(int(codes.max()) + 1)] if (codes >= 0).any() else []
        else:
            groups = [known_rows]
        out = []
        for g in groups:
            unk_us = 0.0
            if unknown is not None and len(unknown):
                unk = unknown
                if group_by in ("cls", "moe"):
                    unk = unknown[unknown[col] == cols[col][g[0]]]
                unk_us = float(unk["us"].sum()) if len(unk) else 0.0
            out.append(self._gemm_group(cols, g, unk_us))
        out.sort(key=lambda s: -(s.values["us_per_step"] or 0.0))
        return out

    def gemm_unknown_subjects(self, unknown: pd.DataFrame, group_by: str | None, known: pd.DataFrame
                              ) -> list[Subject]:
        """Subjects of the selected GEMMs whose shapes are all unknown (per expert / dense group when the
        rule groups by ``moe``), where the group has no GEMM of known shape (``known``: the selected shape
        rows with known shapes, before ``where``): every shape metric is unavailable and says why
        (``shapes`` is 0)."""
        if unknown is None or not len(unknown):
            return []
        moe = unknown["is_moe"].to_numpy().astype(bool)
        if group_by == "moe":
            covered = set(known["is_moe"].astype(bool).tolist())
            parts = [(flag, moe == flag) for flag in (True, False) if flag not in covered and (moe == flag).any()]
        else:
            parts = [(bool(moe.all()), np.ones(len(unknown), dtype=bool))] if not len(known) else []
        out = []
        n = self.n_step_rows
        for flag, sel in parts:
            u = unknown[sel]
            us = float(u["us"].sum())
            why = self._unknown_reason(u)
            v: dict[str, Any] = {m: None for m in ("m", "m_min", "m_max", "n", "k", "batch", "dtype", "op_name",
                                                   "per_expert_m", "tflops", "peak_tflops", "pct_peak")}
            comp = self.run.get("compute_us_per_step")
            v.update(shapes=0, is_moe=flag, calls_per_step=float(u["calls"].sum()) / n, us_per_step=us / n,
                     share=us / self.total_us if self.total_us else None,
                     compute_share=(us / n) / comp if comp else None, unknown_share=1.0)
            missing = {m: why for m in v if v[m] is None}
            pm = self._facts_per_expert_m() if flag else None
            if pm is not None:  # the rows per expert follow from the run facts; N, K and the FLOPs do not
                v["per_expert_m"] = pm[0]
                missing.pop("per_expert_m", None)
                missing["m"] = f"per-expert M = {pm[1]} rows from the run facts, but N, K and the FLOPs need the " \
                               f"GEMM shapes: {why}"
            ranks = sorted({r for t in u["ranks"].tolist() for r in t})
            label = f"{'expert' if flag else 'dense'} GEMMs with unknown shapes"
            out.append(Subject("gemm", label, v, ranks, missing, tuple(sorted({str(c) for c in u["cls"].tolist()}))))
        return out

    def _facts_per_expert_m(self) -> tuple[float, str] | None:
        """tokens x top-k / (experts / ep) from the run facts (batch, top-k, experts, EP size), and how."""
        rm = self.a.run_model
        tokens, topk, experts = rm.value("batch"), rm.value("top_k"), rm.value("experts")
        ep = rm.value("ep_size") or 1
        if not (tokens and topk and experts):
            return None
        pm = float(tokens) * topk * ep / experts
        return pm, f"{float(tokens):g} x {topk} / ({experts} / {ep}) = {pm:g}"

    def _unknown_reason(self, u: pd.DataFrame) -> str:
        """Why the shapes of these GEMMs are unknown: the efficiency stage's reason for the most time."""
        eff = self.a.efficiency
        calls = eff.gemm_calls() if eff is not None else None
        if calls is not None and len(calls) and "reason" in calls:
            unk = calls[(calls["shape_source"] == "unknown").to_numpy() & calls["cls"].isin(set(u["cls"])).to_numpy()]
            if len(unk):
                by = unk.groupby("reason", observed=True)["us"].sum()
                if len(by):
                    return str(by.idxmax())
        return "no recorded shapes for these GEMM kernels"

    def _gemm_group(self, cols: dict[str, np.ndarray], rows: np.ndarray, unk_us: float = 0.0) -> Subject:
        """The subject of shape rows ``rows`` (positions in ``cols``); ``unk_us``: the time of the
        selection's calls with unknown shapes (sums skip missing values, as a frame's do)."""
        n = self.n_step_rows
        v: dict[str, Any] = {}
        missing: dict[str, str] = {}
        us = cols["us"][rows].astype(float)
        m = cols["m"][rows].astype(float)
        top = int(rows[int(np.argmax(us))])
        v["m"] = _weighted_median(m, us)
        v["m_min"] = finite(np.nanmin(m))
        v["m_max"] = finite(np.nanmax(m))
        v["n"] = finite(cols["n"][top])
        v["k"] = finite(cols["k"][top])
        v["batch"] = finite(cols["batch"][top])
        v["dtype"] = str(cols["dtype"][top]) or None
        v["op_name"] = str(cols["op_name"][top])
        v["shapes"] = len(rows)
        moe = cols["is_moe"][rows].astype(bool)
        v["is_moe"] = bool(moe.all())
        v["per_expert_m"] = _weighted_median(m[moe], us[moe]) if moe.any() else None
        if not moe.any():
            missing["per_expert_m"] = "no expert GEMMs in the subject"
        v["calls_per_step"] = float(np.nansum(cols["calls"][rows])) / n
        v["us_per_step"] = float(us.sum()) / n
        v["share"] = float(us.sum()) / self.total_us if self.total_us else None
        comp = self.run.get("compute_us_per_step")
        v["compute_share"] = v["us_per_step"] / comp if comp else None
        flops = float(np.nansum(cols["flops"][rows].astype(float)))
        v["tflops"] = flops / float(us.sum()) / 1e6 if us.sum() > 0 and flops > 0 else None
        pk_us = float(np.nansum(cols["peak_known_us"][rows]))
        peak = float(np.nansum(cols["peak_us"][rows])) / pk_us if pk_us > 0 else None
        v["peak_tflops"] = peak
        v["pct_peak"] = 100.0 * v["tflops"] / peak if v["tflops"] is not None and peak else None
        if v["pct_peak"] is None:
            missing["pct_peak"] = ("GEMM FLOPs unknown" if v["tflops"] is None else
                                   "no dense peak for this GPU and dtype in rules/tables/gpus.yaml ("
                                   + (getattr(self.a.efficiency, "spec_reason", "") or "GPU unknown") + ")")
        v["unknown_share"] = unk_us / (unk_us + float(us.sum())) if (unk_us + us.sum()) > 0 else None
        kernels = self._roofline(cols, rows, v, missing)
        ranks = sorted({r for t in cols["ranks"][rows].tolist() for r in t})
        kind = "expert GEMMs" if v["is_moe"] else ("GEMMs" if moe.any() else "dense GEMMs")
        label = f"{kind} M={_fmt_num(v['m'])}" if len(rows) > 1 else \
            f"{kind} M={_fmt_num(v['m'])} N={_fmt_num(v['n'])} K={_fmt_num(v['k'])} {v['dtype'] or ''}".strip()
        return Subject("gemm", label, v, ranks, missing, tuple(sorted({str(c) for c in cols["cls"][rows].tolist()})),
                       kernels=kernels)

    def _roofline(self, cols: dict[str, np.ndarray], rows: np.ndarray, v: dict[str, Any],
                  missing: dict[str, str]) -> np.ndarray | None:
        """The roofline metrics of a subject (into ``v``) and its kernel rows."""
        for key in ("floor_us_per_step", "pct_roofline", "bound", "memory_bound_share", "gbps", "pct_bw",
                    "weight_bytes_per_step", "weight_bytes_per_token"):
            v[key] = None
        if "floor_us" not in cols:
            missing["pct_roofline"] = "no roofline (the efficiency stage made none)"
            return None
        n = self.n_step_rows
        us = float(cols["us"][rows].astype(float).sum())

        def total(c: str) -> float:
            return float(np.nansum(cols[c][rows].astype(float)))

        spec = getattr(self.a.efficiency, "spec", None)
        bw = spec.mem_bw_gbps if spec is not None else None
        if total("floor_unknown") == 0 and us > 0:
            v["floor_us_per_step"] = total("floor_us") / n
            v["pct_roofline"] = 100.0 * total("floor_us") / us
            parts = {b: total(f"{b}_us") for b in ("memory", "compute", "latency")}
            v["bound"] = max(parts, key=lambda b: parts[b]) if max(parts.values()) > 0 else None
            v["memory_bound_share"] = parts["memory"] / us
        else:
            missing["pct_roofline"] = ("no roofline floor for some of the calls: the GPU has no peak and "
                                       "bandwidth in rules/tables/gpus.yaml, or their bytes are unknown")
        if us > 0:
            v["gbps"] = total("bytes") / us / 1e3
            v["pct_bw"] = 100.0 * v["gbps"] / bw if bw else None
        wb = total("weight_bytes")
        if wb > 0:
            v["weight_bytes_per_step"] = wb / n
            v["weight_bytes_per_token"] = total("weight_bytes_per_row") / n if total("rows") > 0 else None
        ks = [x for x in cols["kernels"][rows].tolist() if x is not None] if "kernels" in cols else []
        return np.concatenate(ks).astype(np.int64) if ks else None

