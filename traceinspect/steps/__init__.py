"""Stage 3, steps: segment each rank into forward steps and attribute kernels to them.

Inputs: a linked :class:`~traceinspect.model.TraceSet`.
Outputs: the ``steps`` table and each kernel's ``step``; the phase analysed and its steps (:mod:`.select`).

Step sources, in order (the first that marks steps on a rank is used; ``rules/tables/steps.yaml`` holds the
patterns and thresholds): SGLang ``step[...]`` spans; ``ProfilerStep#N`` in any category (a
``user_annotation``, or a ``cpu_op``/``Operator`` in PyTorch 1.8-era traces; the GPU-side
``gpu_user_annotation`` copy where no CPU one exists); a serving engine's forward markers (vLLM's
``execute_model``), outermost spans, so every CUDA-graph replay of one forward is one step; repeated
iteration annotations on the CPU, else on the GPU; one ``cudaGraphLaunch`` per step; idle gaps on the
GPU timeline, only where they are periodic and the pieces alike. A rank with none of these is one
step, the whole capture (source ``whole_capture``), never cut into arbitrary pieces.

Kernels belong to the step whose CPU window holds the runtime call that launched them (GPU work lags
the CPU, so GPU time windows would misattribute); only GPU-side sources (GPU annotations, gaps) use
GPU time. Steps whose phase no marker states are ``unknown``; they are never relabelled.

``steps`` table columns: rank, idx (order within the rank), phase, bs, toks, name, source,
cpu_start, cpu_end, gpu_start, gpu_end, n_kernels, kernel_us, busy_us, span_us, idle_us,
edge (a partial step: the recording cut it), included (analysed), excluded_why (why a step is not
analysed: what cut it, or that it has no kernels; empty for an analysed step).

A step is partial (``edge``, excluded) only on evidence, and only the first or last of a rank of three or
more: the recording began less than ``edges.max_gap_steps`` of a step period (the median start-to-start
interval of the rank's steps) before it, or ended less than that after it (the profiler started or
stopped while the step before or after it ran: its start-up or flush, and GPU work not in the trace, fall
into this step; a Python-tracer frame or the last ProfilerStep#N, which the profiler itself opens or
closes, is cut outright); or kernel launches in it have no GPU work in the trace (the recording stopped
first). The recording's bounds are the profiler's own span where the trace has one, else the rank's
first and last CPU events. A complete first or last step (the recording idle around it) is analysed.
Windows drawn on the GPU timeline (GPU annotations, idle gaps) and one ``cudaGraphLaunch`` per step
reach the recording's ends by construction: their first and last steps are partial.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.link import GRAPH_LAUNCH
from traceinspect.model import TraceSet

STEP_SPAN = re.compile(r"^step\[(\w+)", re.IGNORECASE)
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
BS = re.compile(r"\bbs=(\d+)")
TOKS = re.compile(r"\btoks=(\d+)")
PHASES = {"decode": "decode", "extend": "prefill", "prefill": "prefill", "mixed": "mixed", "idle": "idle"}
SOURCES_TRIED = ("step[...] spans, ProfilerStep#N, forward markers, iteration annotations, cudaGraphLaunch "
                 "per step, periodic GPU idle gaps")
WHOLE_CAPTURE = "whole capture (no step marker)"
PROFILER_SPAN = re.compile(r"^PyTorch Profiler \(\d+\)$")  # Kineto's own span: the recording itself
# sources whose windows are CPU spans the trace records: a partial step shows in its launches, and, where
# the profiler itself opens or closes the span, against the recording's bounds
CPU_SOURCES = ("step_span", "profiler_step", "forward_marker", "iteration")

STEP_COLUMNS = [
    "rank", "idx", "phase", "bs", "toks", "name", "source", "cpu_start", "cpu_end",
    "gpu_start", "gpu_end", "n_kernels", "kernel_us", "busy_us", "span_us", "idle_us", "edge", "included",
    "excluded_why",
]


class _Windows(msgspec.Struct):
    start: np.ndarray
    end: np.ndarray
    name: list[str]
    source: str
    phase: list[str] | None = None  # per window, where the source states it
    gpu: bool = False  # windows in GPU time: kernels are assigned by their own start


@dataclass(frozen=True)
class StepRules:
    """``rules/tables/steps.yaml``: forward-marker patterns and the thresholds of the weaker sources."""

    forward: list[re.Pattern[str]]
    iteration_min_repeats: int
    iteration_min_share: float
    iteration_ignore: re.Pattern[str]
    gap_min_pieces: int
    gap_count_spread: float
    gap_name_overlap: float
    gap_period_spread: float
    capture_calls: re.Pattern[str]
    max_gap_steps: float
    raw: dict[str, Any] = field(default_factory=dict, compare=False)


@lru_cache(maxsize=1)
def step_rules() -> StepRules:
    from traceinspect.resources import settings_document

    doc = settings_document("steps.yaml")
    it, gaps = doc["iteration"], doc["gaps"]
    return StepRules(
        forward=[re.compile(m["pattern"]) for m in doc["forward_markers"]],
        iteration_min_repeats=int(it["min_repeats"]), iteration_min_share=float(it["min_kernel_share"]),
        iteration_ignore=re.compile(it["ignore"]), gap_min_pieces=int(gaps["min_pieces"]),
        gap_count_spread=float(gaps["max_kernel_count_spread"]), gap_name_overlap=float(gaps["min_name_overlap"]),
        gap_period_spread=float(gaps["max_period_spread"]), capture_calls=re.compile(gaps["not_in_capture"]),
        max_gap_steps=float(doc["edges"]["max_gap_steps"]), raw=doc)


def phase_of(name: str) -> str:
    """Normalised phase of a step span name: decode, prefill, mixed, idle, verify, draft, ... or unknown."""
    m = STEP_SPAN.match(name)
    if not m:
        return "unknown"
    mode = m.group(1).lower()
    return PHASES.get(mode, mode)


def union_us(ts: np.ndarray, end: np.ndarray) -> float:
    """Length of the union of intervals [ts, end)."""
    if len(ts) == 0:
        return 0.0
    order = np.argsort(ts, kind="stable")
    s, e = ts[order], end[order]
    run_end = np.maximum.accumulate(e)
    starts_new = np.empty(len(s), dtype=bool)
    starts_new[0] = True
    starts_new[1:] = s[1:] > run_end[:-1]
    seg = np.cumsum(starts_new) - 1
    seg_start = s[starts_new]
    seg_end = np.zeros(len(seg_start))
    np.maximum.at(seg_end, seg, run_end)
    return float(np.sum(seg_end - seg_start))


def group_unions(ts: np.ndarray, end: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """:func:`union_us` of each group of intervals at once, group ``k`` being rows ``bounds[k]`` to
    ``bounds[k + 1]`` of ``ts`` and ``end``: the same values, bit for bit (each group's segment lengths
    are summed as :func:`union_us` sums them), without a dozen array calls per group."""
    n_groups = len(bounds) - 1
    out = np.zeros(max(n_groups, 0))
    lo, hi = int(bounds[0]), int(bounds[-1])
    if n_groups <= 0 or hi <= lo:
        return out
    counts = np.diff(bounds)
    group = np.repeat(np.arange(n_groups), counts)
    ts, end = np.asarray(ts[lo:hi], dtype=float), np.asarray(end[lo:hi], dtype=float)
    order = np.lexsort((ts, group))  # by start within each group, ties in row order (a stable sort)
    s, e = ts[order], end[order]
    first = bounds[:-1] - lo
    nonempty = counts > 0
    # the running end over all groups equals each group's own where no earlier group ends after the
    # group's first interval does; the other groups (overlapping ones, NaN) are run one by one
    run_end = np.maximum.accumulate(e)
    heads = first[nonempty]
    later = heads[heads > 0]
    leaky = later[~(run_end[later - 1] <= e[later])]
    for a in leaky.tolist():
        b = a + int(counts[np.searchsorted(first, a, side="right") - 1])
        run_end[a:b] = np.maximum.accumulate(e[a:b])
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > run_end[:-1]
    new[heads] = True
    seg_first = np.nonzero(new)[0]
    seg_last = np.append(seg_first[1:] - 1, len(s) - 1)
    # a segment's end: the largest running end in it (its last, the running end never falling), and at
    # least 0, as union_us's maximum.at into zeros gives
    length = np.maximum(0.0, run_end[seg_last]) - s[seg_first]
    per = np.searchsorted(seg_first, heads)  # each non-empty group's first segment
    stops = np.append(per[1:], len(seg_first))
    for k, a, b in zip(np.nonzero(nonempty)[0].tolist(), per.tolist(), stops.tolist(), strict=True):
        out[k] = float(np.sum(length[a:b]))
    return out


def _rank_rows(df: pd.DataFrame, rank: int) -> pd.DataFrame:
    return df[df["rank"] == rank] if len(df) else df


def _clip(start: np.ndarray, end: np.ndarray) -> None:
    """Windows never overlap: clip each at the next one's start (in place; sorted by start)."""
    end[:-1] = np.minimum(end[:-1], start[1:])


def _span_windows(ts: TraceSet, rank: int) -> _Windows | None:
    ann = _rank_rows(ts.annotations, rank)
    spans = ann[ann["name"].str.match(STEP_SPAN)] if len(ann) else ann
    if not len(spans):
        return None
    spans = spans.sort_values("ts")
    start, end = spans["ts"].to_numpy().copy(), spans["end"].to_numpy().copy()
    # sampling runs after the step span but inside scheduler.run_batch: widen to it
    rb = ann[ann["name"] == "scheduler.run_batch"]
    if len(rb):
        _widen(start, end, rb["ts"].to_numpy(), rb["end"].to_numpy())
    _clip(start, end)
    names = spans["name"].tolist()
    return _Windows(start, end, names, "step_span", [phase_of(n) for n in names])


def _profiler_windows(ts: TraceSet, rank: int) -> _Windows | None:
    """``ProfilerStep#N`` as a user annotation or a CPU op (``cat: Operator`` in PyTorch 1.8/1.9), else
    its GPU-side copy."""
    parts = []
    for df in (ts.annotations, ts.cpu_ops):
        r = _rank_rows(df, rank)
        if len(r):
            parts.append(r.loc[r["name"].str.match(PROFILER_STEP), ["name", "ts", "end"]])
    spans = pd.concat(parts) if parts else pd.DataFrame(columns=["name", "ts", "end"])
    gpu = False
    if not len(spans):
        g = _rank_rows(ts.gpu_annotations, rank)
        spans = g.loc[g["name"].str.match(PROFILER_STEP), ["name", "ts", "end"]] if len(g) else g
        gpu = True
    if not len(spans):
        return None
    spans = spans.drop_duplicates(["name", "ts"]).sort_values("ts")
    start, end = spans["ts"].to_numpy(dtype=float).copy(), spans["end"].to_numpy(dtype=float).copy()
    _clip(start, end)
    return _Windows(start, end, spans["name"].tolist(), "profiler_step_gpu" if gpu else "profiler_step", gpu=gpu)


def _outermost(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Indices of the spans no earlier span contains (arrays sorted by start, longer first on ties)."""
    keep, reach = [], -np.inf
    for i in range(len(start)):
        if end[i] > reach:
            keep.append(i)
            reach = end[i]
    return np.asarray(keep, dtype=np.int64)


def _forward_windows(ts: TraceSet, rank: int) -> _Windows | None:
    """A serving engine's forward markers: one step per outermost marked span; the step's phase from
    the request counts a marker inside it names."""
    ann = _rank_rows(ts.annotations, rank)
    if not len(ann):
        return None
    rules = step_rules()
    names = ann["name"].to_numpy(dtype=object)
    uniq = pd.unique(names)
    hit = {n for n in uniq if any(p.search(n) for p in rules.forward)}
    if not hit:
        return None
    m = ann[np.isin(names, list(hit))].sort_values(["ts", "end"], ascending=[True, False])
    start, end = m["ts"].to_numpy(dtype=float), m["end"].to_numpy(dtype=float)
    mnames = m["name"].tolist()
    outer = _outermost(start, end)
    ws, we = start[outer].copy(), end[outer].copy()
    phases = ["unknown"] * len(outer)
    for j, (s0, e0) in enumerate(zip(ws, we, strict=True)):
        found = set()
        for i in np.nonzero((start >= s0) & (end <= e0))[0]:
            ph = _marker_phase(mnames[i], rules)
            if ph:
                found.add(ph)
        if found:
            phases[j] = found.pop() if len(found) == 1 else "mixed"
    _clip(ws, we)
    return _Windows(ws, we, [mnames[i] for i in outer], "forward_marker", phases)


def _marker_phase(name: str, rules: StepRules) -> str | None:
    for p in rules.forward:
        m = p.search(name)
        if m and "prefill" in p.groupindex and "decode" in p.groupindex:
            pre, dec = int(m.group("prefill")), int(m.group("decode"))
            return "mixed" if pre and dec else "prefill" if pre else "decode" if dec else None
    return None


def _iteration_windows(ts: TraceSet, rank: int, kr: pd.DataFrame, launch: np.ndarray) -> _Windows | None:
    """Repeated iteration annotations: the family of names (digits ignored) that repeats, never
    overlaps itself and holds the most of the rank's kernel time (at least ``min_kernel_share``);
    CPU annotations first (kernels by launch time), else GPU annotations (kernels by start)."""
    rules = step_rules()
    total = float(kr["dur"].sum())
    if total <= 0:
        return None
    for gpu, df in ((False, ts.annotations), (True, ts.gpu_annotations)):
        a = _rank_rows(df, rank)
        if not len(a):
            continue
        a = a[~a["name"].str.contains(rules.iteration_ignore)]
        if not len(a):
            continue
        fam = a["name"].str.replace(r"\d+", "#", regex=True)
        k_at = kr["ts"].to_numpy() if gpu else launch
        kdur = kr["dur"].to_numpy()
        best: tuple[float, int, pd.DataFrame] | None = None
        for _, g in a.groupby(fam, sort=False):
            if len(g) < rules.iteration_min_repeats:
                continue
            g = g.sort_values("ts")
            s0, e0 = g["ts"].to_numpy(dtype=float), g["end"].to_numpy(dtype=float)
            if (s0[1:] < e0[:-1]).any():  # instances overlap: not iterations
                continue
            pos = np.searchsorted(s0, k_at, side="right") - 1
            ok = (pos >= 0) & ~np.isnan(k_at)
            ok[ok] &= k_at[ok] <= e0[pos[ok]]
            share = float(kdur[ok].sum()) / total
            if share >= rules.iteration_min_share and (best is None or (share, len(g)) > best[:2]):
                best = (share, len(g), g)
        if best is not None:
            g = best[2]
            return _Windows(g["ts"].to_numpy(dtype=float).copy(), g["end"].to_numpy(dtype=float).copy(),
                            g["name"].tolist(), "iteration_gpu" if gpu else "iteration", gpu=gpu)
    return None


def _widen(start: np.ndarray, end: np.ndarray, rbs: np.ndarray, rbe: np.ndarray) -> None:
    """Widen each window [start, end] to the run_batch spans holding it: the latest start and earliest
    end among the spans that contain it (in place)."""
    order = np.argsort(rbs, kind="stable")
    rbs, rbe = rbs[order], rbe[order]
    if len(rbs) > 1 and (rbs[1:] <= rbe[:-1]).any():  # overlapping or touching spans: check every one
        for i in range(len(start)):
            hit = np.nonzero((rbs <= start[i]) & (rbe >= end[i]))[0]
            if len(hit):
                start[i], end[i] = rbs[hit].max(), rbe[hit].min()
        return
    # disjoint spans: only the last one starting at or before the window can hold it
    p = np.searchsorted(rbs, start, side="right") - 1
    ok = p >= 0
    ok[ok] = rbe[p[ok]] >= end[ok]
    start[ok], end[ok] = rbs[p[ok]], rbe[p[ok]]


def _graph_windows(ts: TraceSet, rank: int) -> _Windows | None:
    rt = ts.runtime[(ts.runtime["rank"] == rank) & ts.runtime["name"].isin(GRAPH_LAUNCH)]
    if not len(rt):
        return None
    start = rt["ts"].sort_values().to_numpy()
    end = np.append(start[1:], np.inf)
    # the last launch's window ends with the rank's last runtime call
    end[-1] = ts.runtime.loc[ts.runtime["rank"] == rank, "end"].max() + 1e-3
    start = start.copy()
    start[0] = min(start[0], ts.runtime.loc[ts.runtime["rank"] == rank, "ts"].min())
    return _Windows(start, end, ["cudaGraphLaunch"] * len(start), "graph_launch")


def _captures_graphs(ts: TraceSet, rank: int) -> bool:
    """Whether the rank captures CUDA graphs (stream capture / graph instantiation calls): its bursts of
    kernels are the warm-up runs of the captured batch sizes, not steps."""
    rt = _rank_rows(ts.runtime, rank)
    if not len(rt):
        return False
    names = pd.unique(rt["name"].to_numpy(dtype=object))
    pat = step_rules().capture_calls
    return any(pat.search(str(n)) for n in names)


def _gap_steps(k: pd.DataFrame) -> np.ndarray | None:
    """Step number per kernel (``k``: the rank's kernels, with ``ts``, ``end`` and ``name``) from idle gaps
    on the GPU timeline (no CPU evidence), or None unless the gaps are periodic and the pieces alike
    (``gaps`` in rules/tables/steps.yaml)."""
    rules = step_rules()
    order = np.argsort(k["ts"].to_numpy(), kind="stable")
    ts, end = k["ts"].to_numpy()[order], k["end"].to_numpy()[order]
    run_end = np.maximum.accumulate(end) if len(end) else end
    gaps = ts[1:] - run_end[:-1]
    if len(gaps) < 2:
        return None
    pos = gaps[gaps > 0]
    thresh = max(10 * float(np.median(pos)) if len(pos) else 0.0, 100.0)
    big = gaps > thresh
    n = int(big.sum()) + 1
    if n < rules.gap_min_pieces:
        return None
    seg = np.concatenate([[0], np.cumsum(big)])
    counts = np.bincount(seg, minlength=n)
    inner = counts[1:-1] if n >= 3 else counts  # the edge pieces may be cut by the profiler
    med = float(np.median(inner))
    if med <= 0 or (np.abs(inner - med) > rules.gap_count_spread * med).any():
        return None
    starts = ts[np.searchsorted(seg, np.arange(n))]
    periods = np.diff(starts)[1:-1] if n >= 4 else np.diff(starts)
    if len(periods) and (np.abs(periods - np.median(periods)) > rules.gap_period_spread * np.median(periods)).any():
        return None
    names = k["name"].to_numpy(dtype=object)[order]
    sets = [set(names[seg == i]) for i in range(1, n - 1)] if n >= 3 else [set(names[seg == i]) for i in range(n)]
    ref = sets[0]
    if any(len(ref & x) / max(len(ref | x), 1) < rules.gap_name_overlap for x in sets[1:]):
        return None
    out = np.empty(len(k), dtype=np.int64)
    out[order] = seg
    return out


class _Recording(msgspec.Struct):
    """What a rank's trace recorded on the CPU: its first and last CPU event (ops, runtime calls,
    annotations), the profiler's own span where the trace has one, and the runtime calls whose GPU work
    is in the trace."""

    first: float
    last: float
    profiler: tuple[float, float] | None
    launches: np.ndarray  # ts of kernel launches (runtime calls) with no GPU work in the trace


LAUNCH_CALLS = re.compile(r"Launch(?!HostFunc)", re.IGNORECASE)


def _recording(ts: TraceSet, rank: int, linked: np.ndarray) -> _Recording:
    lo, hi = np.inf, -np.inf
    prof: tuple[float, float] | None = None
    for df in (ts.cpu_ops, ts.runtime, ts.annotations):
        r = _rank_rows(df, rank)
        if not len(r):
            continue
        if df is ts.annotations:
            own = r["name"].str.match(PROFILER_SPAN).to_numpy(dtype=bool)
            if own.any():
                prof = (float(r["ts"].to_numpy()[own].min()), float(r["end"].to_numpy()[own].max()))
                r = r[~own]
                if not len(r):
                    continue
        lo, hi = min(lo, float(r["ts"].min())), max(hi, float(r["end"].max()))
    rt = ts.runtime
    rows = np.nonzero((rt["rank"] == rank).to_numpy())[0] if len(rt) else np.zeros(0, dtype=np.int64)
    launches = np.zeros(0)
    if len(rows):
        names = rt["name"].to_numpy(dtype=object)[rows]
        uniq = pd.unique(names)
        is_launch = {n for n in uniq if LAUNCH_CALLS.search(str(n))}
        cand = rows[np.isin(names, list(is_launch))] if is_launch else rows[:0]
        if "correlation" in rt.columns:
            cand = cand[rt["correlation"].to_numpy()[cand] > 0]
        missing = cand[~np.isin(cand, linked)]
        launches = np.sort(rt["ts"].to_numpy(dtype=float)[missing])
    return _Recording(lo, hi, prof, launches)


def _partial(row: dict[str, Any], first: bool, rec: _Recording, period: float, max_gap: float) -> str:
    """Why the first or last step ``row`` of a rank is partial (the recording cut it), or ''."""
    if row["source"] not in CPU_SOURCES:
        return ("its window is drawn on the GPU timeline or from launches, and the recording's "
                + ("start" if first else "end") + " bounds it")
    c0, c1 = float(row["cpu_start"]), float(row["cpu_end"])
    lo, hi = rec.profiler if rec.profiler is not None else (rec.first, rec.last)
    what = "the profiler's span" if rec.profiler is not None else "the rank's CPU events"
    why = []
    if first and math.isfinite(lo) and c0 - lo < max_gap * period:
        why.append(f"the recording ({what}) began {fmt_gap(c0 - lo, period)} before it: the profiler started "
                   "while the step before it ran")
    end = max(c1, float(row["gpu_end"])) if math.isfinite(float(row["gpu_end"])) else c1
    if not first and math.isfinite(hi) and hi - end < max_gap * period:
        why.append(f"the recording ({what}) ended {fmt_gap(hi - end, period)} after it: the profiler stopped "
                   "while the step after it ran")
    n = int(np.count_nonzero((rec.launches >= c0) & (rec.launches <= c1)))
    if n:
        why.append(f"{n} kernel launch(es) in it have no GPU work in the trace")
    return "; ".join(why)


def fmt_gap(us: float, period: float) -> str:
    """A gap in microseconds and as a share of the step period."""
    return f"{max(us, 0.0):,.0f} us ({max(us, 0.0) / period:.2f} of a step)"


def build_steps(ts: TraceSet) -> pd.DataFrame:
    """Segment every rank into steps, set ``kernels.step`` and return the steps table."""
    k = ts.kernels
    step_col = np.full(len(k), -1, dtype=np.int64)
    rows: list[dict] = []
    rt_ts = ts.runtime["ts"].to_numpy()
    for info in ts.ranks:
        rank = info.rank
        kmask = (k["rank"] == rank).to_numpy()
        kr = k.loc[kmask, ["rt_idx", "ts", "end", "dur"]]  # the columns read here (not a copy of every one)
        rt_idx = kr["rt_idx"].to_numpy()
        launch = np.where(rt_idx >= 0, rt_ts[np.maximum(rt_idx, 0)] if len(rt_ts) else np.nan, np.nan)
        win = (_span_windows(ts, rank) or _profiler_windows(ts, rank) or _forward_windows(ts, rank)
               or _iteration_windows(ts, rank, kr, launch) or _graph_windows(ts, rank))
        phases: list[str] | None = None
        if win is not None:
            at = kr["ts"].to_numpy() if win.gpu else launch
            pos = np.searchsorted(win.start, at, side="right") - 1
            valid = (pos >= 0) & ~np.isnan(at)
            valid[valid] &= at[valid] <= win.end[pos[valid]]
            local = np.where(valid, pos, -1)
            names, source, phases = win.name, win.source, win.phase
            cpu = [(np.nan, np.nan)] * len(names) if win.gpu else list(zip(win.start, win.end, strict=True))
        else:
            gap = None if _captures_graphs(ts, rank) else _gap_steps(k.loc[kmask, ["ts", "end", "name"]])
            if gap is not None:
                local = gap
                n = int(local.max()) + 1
                names, source = ["gap-segment"] * n, "gpu_gaps"
            else:  # nothing marks a step: the whole capture is one
                local = np.zeros(len(kr), dtype=np.int64)
                names, source = ([WHOLE_CAPTURE] if len(kr) else []), "whole_capture"
            cpu = [(np.nan, np.nan)] * len(names)
        base = len(rows)
        step_col[np.nonzero(kmask)[0]] = np.where(local >= 0, local + base, -1)
        kts, kend, kdur = kr["ts"].to_numpy(), kr["end"].to_numpy(), kr["dur"].to_numpy()
        n_steps = len(names)
        # kernels grouped by step once (a mask per step would cost steps x kernels)
        by_step = np.argsort(local, kind="stable")
        bounds = np.searchsorted(local[by_step], np.arange(n_steps + 1))
        g_ts, g_end, g_dur = kts[by_step], kend[by_step], kdur[by_step]
        counts = np.diff(bounds)
        some_k = counts > 0
        g0s, g1s = np.full(n_steps, np.nan), np.full(n_steps, np.nan)
        if some_k.any():
            at = bounds[:-1][some_k]
            top = int(bounds[-1])
            g0s[some_k] = np.minimum.reduceat(g_ts[:top], at)
            g1s[some_k] = np.maximum.reduceat(g_end[:top], at)
        busys = group_unions(g_ts, g_end, bounds)
        for i in range(n_steps):
            a, b = int(bounds[i]), int(bounds[i + 1])
            name = names[i]
            bs, toks = BS.search(name), TOKS.search(name)
            if phases is not None:
                phase = phases[i]
            elif source == "graph_launch":
                phase = "decode"  # SGLang replays CUDA graphs for decode only
            else:
                phase = "unknown"
            some = b > a
            g0, g1, busy = float(g0s[i]), float(g1s[i]), float(busys[i])
            span = (g1 - g0) if some else 0.0
            rows.append({
                "rank": rank, "idx": i, "phase": phase,
                "bs": int(bs.group(1)) if bs else -1, "toks": int(toks.group(1)) if toks else -1,
                "name": name, "source": source, "cpu_start": cpu[i][0], "cpu_end": cpu[i][1],
                "gpu_start": g0, "gpu_end": g1, "n_kernels": b - a,
                "kernel_us": float(g_dur[a:b].sum()), "busy_us": busy, "span_us": span,
                "idle_us": max(span - busy, 0.0), "edge": False, "included": True, "excluded_why": "",
            })
        if n_steps >= 3:
            rec = _recording(ts, rank, rt_idx[rt_idx >= 0])
            starts = np.asarray([r["cpu_start"] for r in rows[base:]], dtype=float)
            steps_apart = np.diff(starts[np.isfinite(starts)])
            period = float(np.median(steps_apart)) if len(steps_apart) else math.inf
            for j, first in ((base, True), (base + n_steps - 1, False)):
                why = _partial(rows[j], first, rec, period, step_rules().max_gap_steps)
                if why:
                    rows[j].update(edge=True, included=False, excluded_why="partial: " + why)
        for r in rows[base:base + n_steps]:
            if r["n_kernels"] == 0:
                r["included"] = False
                r["excluded_why"] = r["excluded_why"] or "no kernels"
    k["step"] = step_col
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


