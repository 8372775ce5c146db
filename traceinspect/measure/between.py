"""Time between decode steps: how long the GPU waits from the end of one step's GPU work to the start of the
next one's, over consecutive steps of the analysed phase on each rank. That is the scheduler and host
work outside the forward (batch assembly, sampling, output processing); batching several decode steps per
scheduling round (SGLang ``--num-continuous-decode-steps``) can save at most its share of the decode cycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from traceinspect.units import json_num

if TYPE_CHECKING:
    import pandas as pd


def between_steps(steps: pd.DataFrame, phase: str) -> dict[str, Any]:
    """``between_us`` (median gap between consecutive ``phase`` steps' GPU work), ``cycle_us`` (median from
    one step's first GPU work to the next one's), ``between_share`` (all gaps / all cycles) and
    ``between_pairs``; None values where no rank has two consecutive steps with GPU work."""
    none = {"between_us": None, "cycle_us": None, "between_share": None, "between_pairs": 0}
    if steps is None or not len(steps):
        return none
    cols = ["rank", "idx", "phase", "gpu_start", "gpu_end"]
    d = steps[cols].sort_values(["rank", "idx"], kind="stable")
    rank, idx = d["rank"].to_numpy(), d["idx"].to_numpy()
    ph = d["phase"].to_numpy(dtype=object)
    g0, g1 = d["gpu_start"].to_numpy(dtype=np.float64), d["gpu_end"].to_numpy(dtype=np.float64)
    if len(d) < 2:
        return none
    ok = ((rank[1:] == rank[:-1]) & (idx[1:] == idx[:-1] + 1) & (ph[1:] == phase) & (ph[:-1] == phase)
          & np.isfinite(g0[1:]) & np.isfinite(g1[:-1]) & np.isfinite(g0[:-1]))
    if not ok.any():
        return none
    gap = np.clip(g0[1:][ok] - g1[:-1][ok], 0.0, None)
    cycle = g0[1:][ok] - g0[:-1][ok]
    keep = cycle > 0
    gap, cycle = gap[keep], cycle[keep]
    if not len(cycle):
        return none
    return {"between_us": json_num(float(np.median(gap))), "cycle_us": json_num(float(np.median(cycle))),
            "between_share": json_num(float(gap.sum() / cycle.sum()), 6), "between_pairs": int(len(cycle))}
