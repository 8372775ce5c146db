"""Applying a replay's edits (:mod:`traceinspect.whatif.edit_spec`: what each edit is, its text and mapping
forms) to the replay model's parameters: the operations an edit selects, the floors no edit goes below, and
each edit's change to the durations, gaps and waits of the replayed step."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from traceinspect.tables import name_mask, text_isin
from traceinspect.whatif.edit_spec import (
    Edit,
    Select,
)

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis
    from traceinspect.whatif.model import Model
    from traceinspect.whatif.sim import Params


def op_mask(a: Analysis, m: Model, sel: Select) -> np.ndarray:
    """Ops of the model the selector picks."""
    mask = np.ones(m.n_ops, dtype=bool)
    if sel.kernels is not None:
        mask &= np.isin(m.g_kidx, sel.kernels)
    if sel.classes:
        mask &= np.isin(m.g_cls, list(sel.classes))
    if sel.ranks:
        mask &= np.isin(m.g_rank, list(sel.ranks))
    by_name = sel.name is not None or sel.not_name is not None
    by_op = sel.op is not None or sel.not_op is not None
    if not sel.kinds and not by_name and not by_op:
        return mask
    k = a.kernels.loc[m.g_kidx]  # only the columns' rows of the replayed ops, when a text test needs them
    if sel.kinds:
        mask &= text_isin(k["kind"], sel.kinds)
    if by_name:
        mask &= name_mask(k["name"], sel.name, sel.not_name)
    if by_op:
        mask &= name_mask(k["op_path"] if "op_path" in k.columns else k["op_name"], sel.op, sel.not_op)
    return mask


def kv_rows(a: Analysis, cache: dict[str, Any] | None = None) -> tuple[float | None, float | None, str]:
    """(active rows, pool rows, where from or why not): the KV rows a decode step reads, from the ops that
    gather rows out of a pool-shaped tensor (recorded shapes, or the CUDA-graph capture trace); found
    once per ``cache``."""
    from traceinspect.whatif.kvrows import cached_active_kv_rows

    return cached_active_kv_rows(a, cache)


class Applied(msgspec.Struct):
    """Parameters after the edits, and what could not be decided."""

    params: Params
    undecided: list[str] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    floors: np.ndarray | None = None  # per op: the roofline floor after the edits (NaN: unknown)
    batch: Any = None  # the BatchPlan of a batch edit (whatif.batch)


def op_floors(a: Analysis, m: Model, cache: dict[str, Any] | None = None) -> np.ndarray:
    """Per replayed op: its roofline floor (us; :func:`~traceinspect.measure.roofline.kernel_floors`), at
    most its measured time (a model that overestimates the bytes, e.g. of a tensor the cache holds, never
    lengthens a kernel), NaN where the shapes are unknown and for collectives. Found once per ``cache``."""
    if cache is not None and "op_floors" in cache:
        return cache["op_floors"]
    from traceinspect.measure.roofline import kernel_floors

    kf = kernel_floors(a.efficiency) if getattr(a, "efficiency", None) is not None else None
    fl = np.full(m.n_ops, np.nan)
    if kf is not None and len(kf):
        fl = kf.reindex(m.g_kidx).to_numpy(dtype=np.float64)
    fl = np.where((m.g_inst >= 0) | ~np.isfinite(fl), np.nan, np.minimum(fl, m.g_dur))
    if cache is not None:
        cache["op_floors"] = fl
    return fl


def apply_edits(a: Analysis, m: Model, edits: list[Edit], base: Params,
                cache: dict[str, Any] | None = None) -> Applied:
    """Apply ``edits`` in order to a copy of ``base`` (``cache``: facts found once per replayer)."""
    hspeed = base.hspeed.copy() if base.hspeed is not None else np.ones(len(m.h_t))
    p = msgspec.structs.replace(base, dur=base.dur.copy(), res=base.res.copy(), lA=base.lA.copy(), lS=base.lS.copy(),
                                gap=base.gap.copy(), hdur=base.hdur.copy(), block=base.block.copy(),
                                r=base.r.copy(), hspeed=hspeed)
    out = Applied(params=p)
    coll = m.g_inst >= 0
    floor = op_floors(a, m, cache).copy()
    for e in edits:
        if e.kind in ("scale", "remove", "transfer", "kv-rows", "trim", "gemm-m", "to-roofline"):
            mask = op_mask(a, m, e.select)
            if not mask.any():
                out.notes.append(f"{e.describe()}: no operation in the replayed steps matched")
                continue
            if e.kind == "kv-rows":
                active, pool, why = kv_rows(a, cache)
                if active is None or pool is None or pool <= 0:
                    out.undecided.append(f"{e.describe()}: the active KV row count cannot be decided ({why})")
                    continue
                factor = min(active / pool, 1.0)
                out.notes.append(f"{e.describe()}: time x {active:,.0f} active / {pool:,.0f} pool rows = "
                                 f"{factor:.4f} at the kernel's measured bandwidth ({why})")
                _scale(p, mask, coll, factor)
                floor[mask] *= factor  # the floor of the work that is left
            elif e.kind == "to-roofline":
                sel = mask & ~coll
                unknown = sel & ~np.isfinite(floor)
                if unknown.any():
                    out.undecided.append(f"{e.describe()}: {int(unknown.sum())} of {int(sel.sum())} selected kernels "
                                         "have no roofline floor (shapes unknown or no peak and bandwidth for this GPU)")
                    continue
                pct = float(e.value or 100.0)
                if pct <= 0:
                    out.undecided.append(f"{e.describe()}: the share of the roofline must be above 0")
                    continue
                p.dur[sel] = np.minimum(p.dur[sel], floor[sel] / min(pct / 100.0, 1.0))
            elif e.kind == "trim":
                total = float(p.dur[mask & ~coll].sum() + p.res[mask & coll].sum())
                per_step = total / max(len(m.pos) * len(m.ranks), 1)
                if e.value is None:
                    out.undecided.append(f"{e.describe()}: the time to remove is not known")
                    continue
                factor = max(1.0 - e.value / per_step, 0.0) if per_step > 0 else 1.0
                _scale(p, mask, coll, factor)
            elif e.kind == "gemm-m":
                from traceinspect.whatif.gemm_m import scale_m

                n_, u_ = scale_m(a, m, mask & ~coll, float(e.value or 1.0), p.dur, floor)
                out.notes += [f"{e.describe()}: {x}" for x in n_]
                out.undecided += [f"{e.describe()}: {x}" for x in u_]
            elif e.kind == "scale":
                _scale(p, mask, coll, float(e.value or 0.0))
            elif e.kind == "transfer":
                p.res[mask & coll] *= float(e.value or 0.0)
            else:  # remove
                floor[mask] = 0.0
                p.dur[mask & ~coll] = 0.0
                p.res[mask & coll] = 0.0
                p.lS[mask] = 0.0
                _remove_launches(m, p, mask)
        elif e.kind in ("host-gaps", "launch-cost"):
            hm = np.ones(len(m.h_t), dtype=bool)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            v = float(e.value or 0.0)
            if e.kind == "host-gaps":
                hm &= m.h_prev >= 0
                p.gap[hm] = np.minimum(p.gap[hm], v)
            else:
                hm &= m.h_launches & ~p.block
                p.hdur[hm] = np.minimum(p.hdur[hm], v)
        elif e.kind == "host-speed":
            hm = np.ones(len(m.h_t), dtype=bool)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            f = float(e.value or 1.0)
            # a blocking call that waited ends on the GPU: only its own time (the non-waiting ones) scales
            p.gap[hm] /= f
            nb = hm & ~p.block
            p.hdur[nb] /= f
            p.hspeed[hm] *= f
        elif e.kind == "batch":
            _batch(a, m, p, e, cache, out, floor)
        elif e.kind == "host-stalls":
            _remove_stalls(a, m, p, e, cache, out)
        elif e.kind == "graph-gaps":
            gap, why = graph_gap(a)
            if gap is None:
                out.notes.append(f"{e.describe()}: {why}; the measured gaps are kept")
                continue
            gm = np.ones(m.n_ops, dtype=bool)
            if e.select.ranks:
                gm &= np.isin(m.g_rank, list(e.select.ranks))
            p.lS[gm] = np.minimum(p.lS[gm], gap)
            out.notes.append(f"{e.describe()}: gaps between back-to-back kernels capped at {gap:g} us ({why})")
        elif e.kind == "host-from":
            why = _host_from(m, p, e)
            if why:
                out.undecided.append(f"{e.describe()}: {why}")
        elif e.kind == "async":
            hm = p.block.copy()
            if e.select.name is not None:
                hm &= name_mask(m.h_name, e.select.name, None)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            p.block[hm] = False
            p.hdur[hm] = p.r[hm]
    held = np.isfinite(floor) & ~coll & (p.dur < floor - 1e-9)
    if held.any():
        steps = max(len(m.pos) * len(m.ranks), 1)
        out.notes.append(f"{held.sum() / steps:,.1f} kernel(s) per rank per step held at their roofline floor "
                         f"({float((floor[held] - p.dur[held]).sum()) / steps:,.1f} us per rank per step that the "
                         "edits would have taken below what the GPU's peaks allow)")
        p.dur[held] = floor[held]
    out.floors = floor
    return out


def _batch(a: Analysis, m: Model, p: Params, e: Edit, cache: dict[str, Any] | None, out: Applied,
           floor: np.ndarray) -> None:
    """The step at another running batch (:mod:`.batch`); ``floor`` (per op) follows the work: the new
    floors of the kernels the batch model rescales from their shapes, the others' in proportion to time."""
    from traceinspect.measure.replay_settings import load_settings
    from traceinspect.whatif.batch import plan_batch, scale_batch

    plan, notes = plan_batch(a, e, cache)
    out.batch = plan
    out.notes += [f"{e.describe()}: {x}" for x in notes]
    if plan.why is not None or plan.factor is None:
        out.undecided.append(f"{e.describe()}: {plan.why or 'the batch cannot be decided'}")
        return
    capped = f"; capped by {plan.bound_by}" if plan.bound_by else ""
    out.notes.append(f"{e.describe()}: batch {plan.observed:,.0f} -> {plan.target:,.0f} ({plan.how}{capped})")
    coll = m.g_inst >= 0
    before, old = p.dur.copy(), floor.copy()
    n_, u_ = scale_batch(a, m, p.dur, coll, plan, load_settings(), floor)
    kept = (floor == old) & (before > 0) & (p.dur != before)
    with np.errstate(divide="ignore", invalid="ignore"):
        floor[kept] = old[kept] * p.dur[kept] / before[kept]
    out.notes += [f"{e.describe()}: {x}" for x in n_]
    out.undecided += [f"{e.describe()}: {x}" for x in u_]


def _remove_stalls(a: Analysis, m: Model, p: Params, e: Edit, cache: dict[str, Any] | None, out: Applied) -> None:
    """Host stalls of at least ``e.value`` us leave the host gaps they lie in (:mod:`.stalls`)."""
    from traceinspect.measure.stalls import overlap_us, stall_stretches

    v = float(e.value or 0.0)
    key = f"stalls:{v:g}"
    st = cache.get(key) if cache is not None else None
    if st is None and getattr(a, "host", None) is not None:
        st = a.host.stalls_at(v)  # measured by the measure stage at the settings' threshold
    if st is None:
        st = stall_stretches(a, v)
        if cache is not None:
            cache[key] = st
    hm = m.h_prev >= 0
    if e.select.ranks:
        hm &= np.isin(m.h_rank, list(e.select.ranks))
    idx = np.nonzero(hm)[0]
    coll = a.collectives
    offsets = dict(coll.offsets_applied) if coll is not None else {}
    off = np.array([offsets.get(int(r), 0.0) for r in m.h_rank[idx]], dtype=np.float64)
    lo = m.h_end[m.h_prev[idx]] + off
    hi = m.h_t[idx] + off
    cut = overlap_us(st, m.h_rank[idx], m.h_tid[idx], lo, hi)
    p.gap[idx] = np.maximum(p.gap[idx] - cut, 0.0)
    steps = max(len(m.pos) * (len(e.select.ranks) or len(m.ranks)), 1)
    n = int(np.count_nonzero(cut > 0))
    out.notes.append(f"{e.describe()}: {cut.sum() / steps:,.0f} us per rank per step of host stalls (stretches of at least "
                     f"{v:g} us outside every CPU op and runtime call; {n / steps:.1f} per rank per step) removed"
                     if n else f"{e.describe()}: no host stall of at least {v:g} us in the replayed steps")


def graph_gap(a: Analysis) -> tuple[float | None, str]:
    """This GPU's kernel-to-kernel gap in a CUDA-graph replay from ``rules/tables/replay.yaml``, or why not."""
    from traceinspect.measure.replay_settings import load_settings

    dev = a.device_name() or ""
    for rx, us, src in load_settings().graph_gaps:
        if rx.search(dev):
            return us, src
    return None, f"no CUDA-graph kernel gap for {dev or 'an unknown GPU'} in rules/tables/replay.yaml"


def _scale(p: Params, mask: np.ndarray, coll: np.ndarray, f: float) -> None:
    p.dur[mask & ~coll] *= f
    p.res[mask & coll] *= f


def _remove_launches(m: Model, p: Params, mask: np.ndarray) -> None:
    """A removed op's launch call goes too, with its op's host time before it, when that call launches
    nothing else (a CUDA-graph launch stays)."""
    L = m.g_launch
    has = L >= 0
    if not has.any():
        return
    n = len(p.gap)  # (one per host call: a launch's index)
    gone = np.flatnonzero((np.bincount(L[has & mask], minlength=n) > 0) & (np.bincount(L[has & ~mask], minlength=n) == 0))
    if not len(gone):
        return
    gone = gone[~p.block[gone]]
    speed = p.hspeed[gone] if p.hspeed is not None else 1.0  # the op's host time at the edited host speed
    p.gap[gone] = np.maximum(p.gap[gone] - m.h_op_in[gone] / speed, 0.0)
    p.hdur[gone] = 0.0


def _host_from(m: Model, p: Params, e: Edit) -> str | None:
    """Give rank ``e.dst`` the host gaps and call times of rank ``e.src``, call by call, on each rank's
    busiest thread. Refused when the two ranks' call sequences differ."""
    if e.dst is None or e.src is None:
        return "which rank's host timeline to give is not known"
    if e.dst == e.src:
        return "a rank cannot take its own host timeline"
    for r in (e.dst, e.src):
        if r not in m.ranks:
            return f"rank {r} is not in the replayed trace set"

    def main_calls(r: int) -> dict[int, np.ndarray]:
        idx = np.nonzero(m.h_rank == r)[0]
        tids, counts = np.unique(m.h_tid[idx], return_counts=True)
        if not len(tids):
            return {}
        tid = tids[np.argmax(counts)]
        idx = idx[m.h_tid[idx] == tid]
        return {int(q): idx[m.h_pos[idx] == q] for q in np.unique(m.h_pos[idx])}

    dst, src = main_calls(e.dst), main_calls(e.src)
    done = 0
    for q, di in dst.items():
        si = src.get(q)
        if si is None or len(si) != len(di) or bool((m.h_name[di] != m.h_name[si]).any()):
            return (f"the host call sequences of ranks {e.dst} and {e.src} differ in step position {q} "
                    f"({len(di)} vs {0 if si is None else len(si)} calls)")
        keep = m.h_prev[di] >= 0
        p.gap[di[keep]] = p.gap[si[keep]]
        nb = ~p.block[di] & ~p.block[si]
        p.hdur[di[nb]] = p.hdur[si[nb]]
        done += 1
    return None if done else f"rank {e.dst} has no host calls in the replayed steps"
