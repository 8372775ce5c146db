"""``rank`` metrics: one subject per rank (step statistics from :mod:`traceinspect.measure.ranks`, collective
wait and transfer from the collectives stage), declared beside their computation."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from traceinspect.judge.metrics.registry import Subject, _first, declare
from traceinspect.units import finite

if TYPE_CHECKING:
    import pandas as pd

    from traceinspect.model.analysis import Analysis

declare("rank", "rank", "id", "Rank number.")
declare("rank", "rank_label", "text", "Rank label (TP0, TP1-DP0, ...).")
declare("rank", "rank_step_us", "us", "Median GPU span of this rank's analysed steps.")
declare("rank", "rank_busy_us", "us", "Median GPU busy time of this rank's steps.")
declare("rank", "rank_compute_us", "us", "Median per-step GPU time of this rank's non-communication kernels.")
declare("rank", "others_compute_us", "us", "Median of rank_compute_us over the other ranks.")
declare("rank", "compute_excess", "ratio", "rank_compute_us / others_compute_us - 1.")
declare("rank", "rank_launch_lag_us", "us", "Median, over steps, of how much later this rank's first GPU activity "
   "of a step starts than the earliest rank's (aligned steps).")
declare("rank", "slowest_step_fraction", "ratio", "Share of aligned steps in which this rank finished its "
   "non-communication work last.")
declare("rank", "comm_us", "us", "Collective kernel time of this rank per step.")
declare("rank", "wait_us", "us", "Collective time per step this rank spent waiting for other ranks to arrive "
   "(from the collectives stage).")
declare("rank", "transfer_us", "us", "Collective time per step that was data transfer (comm_us - wait_us).")
declare("rank", "wait_share", "ratio", "wait_us / comm_us.")
declare("rank", "rank_comm_share", "ratio", "comm_us / rank_step_us.")
declare("rank", "late_arrivals", "ratio", "Share of collectives at which this rank arrived last.")
declare("rank", "waited_on_share", "ratio", "Share of all ranks' collective wait time that this rank caused by "
   "arriving last.")
declare("rank", "wait_caused_us", "us", "Collective wait per step that this rank caused on the other ranks by "
   "arriving last (sum over the other ranks).")
declare("rank", "launch_lateness_us", "us", "Median lateness of this rank's collective launches relative to the "
   "earliest rank (clock-corrected; from the collectives stage).")


class RankMetrics:
    """The ``rank`` scope of :class:`~traceinspect.judge.metrics.MetricContext`."""

    a: Analysis
    k: pd.DataFrame

    def _coll_reason(self) -> str:
        if self.a.n_ranks < 2:
            return "single rank: no multi-rank collective analysis"
        c = self.a.collectives
        if c is None:
            return "the collectives stage produced no result"
        return getattr(c, "reason", None) or "the collectives stage has no per-rank wait/transfer split"

    _ranks_cache: list[Subject] | None = None

    def rank_subjects(self) -> list[Subject]:
        if self._ranks_cache is not None:
            return self._ranks_cache
        a = self.a
        multi = a.n_ranks > 1
        from traceinspect.measure.ranks import rank_steps

        stats = rank_steps(a.selected, self.k, [i.rank for i in a.trace.ranks], a.steps_per_rank())
        coll = self._collective_rows()
        out = []
        for info, st in zip(a.trace.ranks, stats, strict=True):
            r = info.rank
            v: dict[str, Any] = {"rank": r, "rank_label": info.label}
            missing: dict[str, str] = {}
            v["rank_step_us"] = st.step_us
            v["rank_busy_us"] = st.busy_us
            v["rank_compute_us"] = st.compute_us
            v["others_compute_us"] = st.others_compute_us
            v["compute_excess"] = st.compute_excess
            v["rank_launch_lag_us"] = st.launch_lag_us
            v["slowest_step_fraction"] = st.slowest_step_fraction
            c = coll.get(r, {})
            v["comm_us"] = c["comm_us"] if c.get("comm_us") is not None else st.comm_us
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
            if not multi:
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
        import pandas as pd

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
        total_wait = sum(finite(_first(r, "wait_us")) or 0.0 for r in rows)
        for row in rows:
            if "rank" not in row:
                continue
            r = int(row["rank"])
            d: dict[str, Any] = {}
            d["comm_us"] = finite(_first(row, "comm_us_per_step"))
            d["wait_us"] = finite(_first(row, "wait_us_per_step"))
            d["transfer_us"] = finite(_first(row, "transfer_us_per_step"))
            d["wait_share"] = finite(_first(row, "wait_share"))
            d["late_arrivals"] = finite(_first(row, "late_share"))
            d["wait_caused_us"] = finite(_first(row, "wait_caused_us_per_step"))
            caused = finite(_first(row, "wait_caused_us"))
            d["waited_on_share"] = caused / total_wait if caused is not None and total_wait > 0 else None
            d["launch_lateness_us"] = finite(_first(row, "launch_lateness_us_median"))
            out[r] = d
        return out

