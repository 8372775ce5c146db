"""Per-rank step statistics: each rank's step span, busy and compute time, how it compares with the
other ranks, how late its steps start and how often it finishes its work last."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

from traceinspect.units import finite


@dataclass
class RankSteps:
    """One rank over the analysed steps (per-step medians; None where it cannot be measured)."""

    rank: int
    step_us: float | None  # median GPU span of its steps
    busy_us: float | None  # median GPU busy time
    compute_us: float | None  # median per-step time of its non-communication kernels
    others_compute_us: float | None  # median of compute_us over the other ranks
    compute_excess: float | None  # compute_us / others_compute_us - 1
    launch_lag_us: float | None  # median lag of its first GPU activity behind the earliest rank's (aligned steps)
    slowest_step_fraction: float | None  # share of aligned steps in which it finished its work last
    comm_us: float  # communication kernel time per step (from the kernels)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the values that are not None, or None."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.median(arr)) if len(arr) else None


def rank_steps(selected: pd.DataFrame, kernels: pd.DataFrame, ranks: list[int], aligned: int) -> list[RankSteps]:
    """The statistics of each rank in ``ranks`` over the analysed steps ``selected``, whose kernels (with
    ``cls``) are ``kernels``; ``aligned`` steps per rank are compared across ranks by position."""
    sel = selected.copy()
    sel["pos"] = sel.groupby("rank").cumcount()
    al = sel[sel["pos"] < aligned]
    k = kernels
    is_comm = (k["cls"] == "comm").to_numpy()
    # a step is one rank's: grouping by step groups by (rank, step)
    step, dur = k["step"].to_numpy(), k["dur"]
    nc = ~is_comm
    comp = dur[nc].groupby(step[nc]).sum() if nc.any() else pd.Series(dtype=float)
    comp_end = k["end"][nc].groupby(step[nc]).max() if nc.any() else pd.Series(dtype=float)
    comm_us = dur[is_comm].groupby(k["rank"].to_numpy()[is_comm]).sum() if is_comm.any() else pd.Series(dtype=float)
    steps_per = sel.groupby("rank").size()
    # each step's compute time and compute end, looked up for all steps at once
    sel_comp = comp.reindex(sel.index).fillna(0.0).to_numpy(dtype=np.float64) if len(comp) else np.zeros(len(sel))
    sel_rank = sel["rank"].to_numpy()
    per_rank_comp = {int(r): median(sel_comp[sel_rank == r].tolist()) for r in np.unique(sel_rank)}
    multi = len(ranks) > 1
    # slowest / lag over aligned steps
    slow_count: dict[int, int] = {}
    lag: dict[int, list[float]] = {}
    if multi and aligned and len(al):
        pos = al["pos"].to_numpy()
        rk = al["rank"].to_numpy()
        starts = al["gpu_start"].to_numpy(dtype=np.float64)
        first = al.groupby("pos")["gpu_start"].transform("min").to_numpy(dtype=np.float64)
        for r in pd.unique(rk):
            lag[int(r)] = (starts[rk == r] - first[rk == r]).tolist()
        ends = (comp_end.reindex(al.index).to_numpy(dtype=np.float64)
                if len(comp_end) else np.full(len(al), np.nan))
        # finishing last relative to the aligned steps' earliest start is what makes others wait
        rel = pd.Series(ends - first)
        by = rel.groupby(pos)
        whole = pd.Series(np.isfinite(ends)).groupby(pos).transform("all").to_numpy(dtype=bool)
        top = by.transform("max").to_numpy(dtype=np.float64)
        # the first row reaching the maximum in each aligned step (the first row when none is a number)
        cand = whole & ((rel.to_numpy() == top) | np.isnan(top))
        idx = np.nonzero(cand)[0]
        _, firsts = np.unique(pos[idx], return_index=True)
        for r in rk[idx[firsts]].tolist():
            slow_count[int(r)] = slow_count.get(int(r), 0) + 1
    out = []
    for r in ranks:
        rs = sel[sel["rank"] == r]
        mine = per_rank_comp.get(r)
        others = [per_rank_comp[o] for o in per_rank_comp if o != r and per_rank_comp[o] is not None]
        others_med = median(others) if others else None
        ns = max(int(steps_per.get(r, 0)), 1)
        out.append(RankSteps(
            rank=r,
            step_us=finite(rs["span_us"].median()) if len(rs) else None,
            busy_us=finite(rs["busy_us"].median()) if len(rs) else None,
            compute_us=mine,
            others_compute_us=others_med,
            compute_excess=mine / others_med - 1 if mine is not None and others_med else None,
            launch_lag_us=median(lag.get(r, [])) if lag else None,
            slowest_step_fraction=slow_count.get(r, 0) / aligned if (multi and aligned) else None,
            comm_us=float(comm_us.get(r, 0.0)) / ns,
        ))
    return out
