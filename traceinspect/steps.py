"""Stage 3, steps: segment each rank into forward steps and attribute kernels to them.

Step sources, in order: SGLang ``step[...]`` spans, ``ProfilerStep#N``, one ``cudaGraphLaunch``
per step, and last a gap-based split of the GPU timeline. Kernels belong to the step whose CPU
window holds the runtime call that launched them (GPU work lags the CPU, so GPU time windows would
misattribute); only the gap fallback, which has no CPU side, uses GPU time.

``steps`` table columns: rank, idx (order within the rank), phase, bs, toks, name, source,
cpu_start, cpu_end, gpu_start, gpu_end, n_kernels, kernel_us, busy_us, span_us, idle_us,
edge (first/last step of the rank), included (analysed).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pandas as pd

from traceinspect.errors import TraceInputError
from traceinspect.link import GRAPH_LAUNCH
from traceinspect.model import TraceSet

STEP_SPAN = re.compile(r"^step\[(\w+)", re.IGNORECASE)
PROFILER_STEP = re.compile(r"^ProfilerStep#(\d+)$")
BS = re.compile(r"\bbs=(\d+)")
TOKS = re.compile(r"\btoks=(\d+)")
PHASES = {"decode": "decode", "extend": "prefill", "prefill": "prefill", "mixed": "mixed", "idle": "idle"}
SOURCES_TRIED = "step[...] spans, ProfilerStep#N, cudaGraphLaunch per step, GPU idle gaps"

STEP_COLUMNS = [
    "rank", "idx", "phase", "bs", "toks", "name", "source", "cpu_start", "cpu_end",
    "gpu_start", "gpu_end", "n_kernels", "kernel_us", "busy_us", "span_us", "idle_us", "edge", "included",
]


@dataclass
class _Windows:
    start: np.ndarray
    end: np.ndarray
    name: list[str]
    source: str


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


def _span_windows(ts: TraceSet, rank: int) -> _Windows | None:
    ann = ts.annotations[ts.annotations["rank"] == rank]
    spans = ann[ann["name"].str.match(STEP_SPAN)]
    source = "step_span"
    if not len(spans):
        spans = ann[ann["name"].str.match(PROFILER_STEP)]
        source = "profiler_step"
    if not len(spans):
        return None
    spans = spans.sort_values("ts")
    start, end = spans["ts"].to_numpy().copy(), spans["end"].to_numpy().copy()
    if source == "step_span":
        # sampling runs after the step span but inside scheduler.run_batch: widen to it
        rb = ann[ann["name"] == "scheduler.run_batch"]
        if len(rb):
            _widen(start, end, rb["ts"].to_numpy(), rb["end"].to_numpy())
    # windows never overlap: clip each at the next one's start
    end[:-1] = np.minimum(end[:-1], start[1:])
    return _Windows(start, end, spans["name"].tolist(), source)


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


def _gap_steps(k: pd.DataFrame) -> np.ndarray:
    """Step number per kernel from idle gaps on the GPU timeline (no CPU evidence)."""
    order = np.argsort(k["ts"].to_numpy(), kind="stable")
    ts, end = k["ts"].to_numpy()[order], k["end"].to_numpy()[order]
    run_end = np.maximum.accumulate(end)
    gaps = ts[1:] - run_end[:-1]
    if len(gaps) < 2:
        return np.full(len(k), -1)
    pos = gaps[gaps > 0]
    thresh = max(10 * float(np.median(pos)) if len(pos) else 0.0, 100.0)
    big = gaps > thresh
    if not big.any():
        return np.full(len(k), -1)
    seg = np.concatenate([[0], np.cumsum(big)])
    out = np.empty(len(k), dtype=np.int64)
    out[order] = seg
    return out


def build_steps(ts: TraceSet) -> pd.DataFrame:
    """Segment every rank into steps, set ``kernels.step`` and return the steps table."""
    k = ts.kernels
    step_col = np.full(len(k), -1, dtype=np.int64)
    rows: list[dict] = []
    rt_ts = ts.runtime["ts"].to_numpy()
    for info in ts.ranks:
        rank = info.rank
        kmask = (k["rank"] == rank).to_numpy()
        kr = k[kmask]
        win = _span_windows(ts, rank) or _graph_windows(ts, rank)
        if win is not None:
            rt_idx = kr["rt_idx"].to_numpy()
            launch = np.where(rt_idx >= 0, rt_ts[np.maximum(rt_idx, 0)] if len(rt_ts) else np.nan, np.nan)
            pos = np.searchsorted(win.start, launch, side="right") - 1
            valid = (pos >= 0) & ~np.isnan(launch)
            valid[valid] &= launch[valid] <= win.end[pos[valid]]
            local = np.where(valid, pos, -1)
            names, source = win.name, win.source
            cpu = list(zip(win.start, win.end, strict=True))
        else:
            local = _gap_steps(kr)
            n = int(local.max()) + 1 if len(local) else 0
            names, source = ["gap-segment"] * n, "gpu_gaps"
            cpu = [(np.nan, np.nan)] * n
        base = len(rows)
        step_col[np.nonzero(kmask)[0]] = np.where(local >= 0, local + base, -1)
        kts, kend, kdur = kr["ts"].to_numpy(), kr["end"].to_numpy(), kr["dur"].to_numpy()
        n_steps = len(names)
        # kernels grouped by step once (a mask per step would cost steps x kernels)
        by_step = np.argsort(local, kind="stable")
        bounds = np.searchsorted(local[by_step], np.arange(n_steps + 1))
        for i in range(n_steps):
            sel = by_step[bounds[i]:bounds[i + 1]]
            name = names[i]
            bs, toks = BS.search(name), TOKS.search(name)
            if source == "step_span":
                phase = phase_of(name)
            elif source == "graph_launch":
                phase = "decode"  # SGLang replays CUDA graphs for decode only
            else:
                phase = "unknown"
            some = len(sel) > 0
            g0 = float(kts[sel].min()) if some else np.nan
            g1 = float(kend[sel].max()) if some else np.nan
            busy = union_us(kts[sel], kend[sel])
            span = (g1 - g0) if some else 0.0
            rows.append({
                "rank": rank, "idx": i, "phase": phase,
                "bs": int(bs.group(1)) if bs else -1, "toks": int(toks.group(1)) if toks else -1,
                "name": name, "source": source, "cpu_start": cpu[i][0], "cpu_end": cpu[i][1],
                "gpu_start": g0, "gpu_end": g1, "n_kernels": len(sel),
                "kernel_us": float(kdur[sel].sum()), "busy_us": busy, "span_us": span,
                "idle_us": max(span - busy, 0.0), "edge": False, "included": True,
            })
        if n_steps >= 3:
            rows[base]["edge"] = rows[base + n_steps - 1]["edge"] = True
            rows[base]["included"] = rows[base + n_steps - 1]["included"] = False
        for r in rows[base:base + n_steps]:
            if r["n_kernels"] == 0:
                r["included"] = False
    k["step"] = step_col
    steps = pd.DataFrame(rows, columns=STEP_COLUMNS)
    if not len(steps):
        raise TraceInputError(f"no steps found (tried {SOURCES_TRIED})", ts.ranks[0].path.parent)
    return steps


def select_steps(steps: pd.DataFrame, phase: str) -> pd.DataFrame:
    """Included steps of the requested phase ('decode', 'prefill' or 'all'); steps of unknown phase
    count for every phase."""
    s = steps[steps["included"]]
    if phase == "all":
        return s
    return s[(s["phase"] == phase) | (s["phase"] == "unknown")]
