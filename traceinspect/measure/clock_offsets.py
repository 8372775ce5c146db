"""Clock offsets between ranks, from the end times of matched collectives (ends are nearly
simultaneous across the ranks of a collective)."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from traceinspect.measure.comm_settings import load_settings


def _offsets(inst: pd.DataFrame, groups: list[list[int]]) -> tuple[dict[int, float], dict[int, float],
                                                                      dict[int, float], dict[int, int]]:
    """Clock offset per rank from matched collectives' end times (ends are nearly simultaneous)."""
    est: dict[int, float] = {}
    noise: dict[int, float] = {}
    applied: dict[int, float] = {}
    ref_of: dict[int, int] = {}
    for gi, ranks in enumerate(groups):
        ref = ranks[0]
        g = inst[inst["group"] == gi]
        ends = g.pivot_table(index="instance", columns="rank", values="end", aggfunc="first")
        for r in ranks:
            ref_of[r] = ref
            if r == ref or r not in ends.columns or ref not in ends.columns:
                est[r], noise[r], applied[r] = 0.0, 0.0, 0.0
                continue
            d = (ends[r] - ends[ref]).dropna().to_numpy()
            if not len(d):
                est[r], noise[r], applied[r] = float("nan"), float("nan"), 0.0
                continue
            med = float(np.median(d))
            mad = float(np.median(np.abs(d - med))) * 1.4826
            se = mad / math.sqrt(len(d))
            est[r], noise[r] = med, mad
            cfg = load_settings()
            applied[r] = med if abs(med) > max(cfg.offset_sigmas * se, cfg.offset_min_us) else 0.0
    return est, noise, applied, ref_of


