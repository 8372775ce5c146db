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

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traceinspect.measure.clock_offsets import _offsets
from traceinspect.measure.comm_match import (  # noqa: F401 - importable from here
    _aligned_steps,
    _comm_mask,
    _groups,
    _message_bytes,
    _span_kinds,
)
from traceinspect.measure.comm_result import Collectives
from traceinspect.measure.comm_settings import (  # noqa: F401 - importable from here
    BUSBW_FACTOR,
    INSTANCE_COLUMNS,
    INSTANCES_JSON_MAX,
    PER_RANK_COLUMNS,
    PER_STEP_COLUMNS,
    SCHEMA_NOTE,
    Settings,
    _median,
    collective_kind,
    load_settings,
)
from traceinspect.measure.critical_path import Cycle, _activities, _Graph, _step_graph, critical_path  # noqa: F401
from traceinspect.measure.stragglers import _straggler

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


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


