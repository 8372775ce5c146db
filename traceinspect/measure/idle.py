"""Where the GPU waits inside steps: idle gaps between kernels, blocking host calls and the bubbles they
cause, device-to-host copies, tiny kernels."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

TINY_KERNEL_US = 5.0
GAP_MIN_US = 2.0
SYNC_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
    "cudaMemcpy2D", "cudaMemcpyFromSymbol", "cudaMemcpyToSymbol", "cudaStreamWaitEvent_sync",
    "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH", "cuMemcpyDtoH_v2",
    "hipStreamSynchronize", "hipDeviceSynchronize", "hipEventSynchronize", "hipMemcpy",
})
DTOH = re.compile(r"DtoH|Device\s*->\s*(?:Host|Pinned|Pageable)", re.IGNORECASE)


def gpu_gaps(k: pd.DataFrame) -> tuple[int, float]:
    """Idle gaps of at least GAP_MIN_US between consecutive GPU activities inside a step (count, total us),
    over the kernels of the analysed steps."""
    if not len(k):
        return 0, 0.0
    d = k[["rank", "step", "ts", "end"]].sort_values(["rank", "step", "ts"], kind="stable")
    prev_end = d.groupby(["rank", "step"], sort=False)["end"].cummax()
    prev_end = prev_end.groupby([d["rank"], d["step"]], sort=False).shift(1)
    gap = (d["ts"] - prev_end).to_numpy()
    gap = gap[np.isfinite(gap) & (gap >= GAP_MIN_US)]
    return int(len(gap)), float(gap.sum())


def host_syncs(runtime: pd.DataFrame, kernels: pd.DataFrame, selected: pd.DataFrame) -> tuple[int, float, float]:
    """Blocking host calls whose start lies inside a step's CPU window: (calls, host us inside them, GPU
    bubble they caused). ``kernels`` is every GPU activity of the trace set (the bubble's next activity may
    lie outside the analysed steps), ``selected`` the analysed steps."""
    rt = runtime
    if not len(rt) or not len(selected):
        return 0, 0.0, 0.0
    from traceinspect.tables import text_isin

    rt = rt[text_isin(rt["name"].to_numpy(dtype=object), SYNC_CALLS)]
    calls, call_us, bubble = 0, 0.0, 0.0
    # each rank's GPU activities from the columns (not a copy of the rank's rows of every column)
    k_rank, k_ts, k_end = kernels["rank"].to_numpy(), kernels["ts"].to_numpy(), kernels["end"].to_numpy()
    for rank, steps in selected.groupby("rank"):
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
        mine = k_rank == rank
        rk_ts = k_ts[mine]
        by_ts = np.argsort(rk_ts)
        kts = rk_ts[by_ts]
        kend_sorted_by_ts = k_end[mine][by_ts]
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


def tiny_kernels(k: pd.DataFrame) -> tuple[int, int]:
    """(kernels shorter than TINY_KERNEL_US, kernels) among the GPU activities ``k``."""
    kern = k.loc[(k["kind"] == "kernel").to_numpy(), ["dur"]]
    return int((kern["dur"] < TINY_KERNEL_US).sum()), len(kern)


def dtoh_copies(k: pd.DataFrame) -> tuple[int, float]:
    """(device-to-host memcpy events, their GPU us) among the GPU activities ``k``."""
    mem = k.loc[(k["kind"] == "memcpy").to_numpy(), ["name", "dur"]]  # the name test only on memcpy rows
    dtoh = mem[mem["name"].str.contains(DTOH)]
    return len(dtoh), float(dtoh["dur"].sum())
