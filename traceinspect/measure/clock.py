"""Clock offsets between ranks that are large enough to say so, with what the analysis did about them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from traceinspect.measure.comm_result import Collectives
    from traceinspect.model import RankInfo

CLOCK_WARN_US = 1000.0  # a clock offset between ranks above this is reported


def clock_warnings(c: Collectives | None, ranks: list[RankInfo]) -> list[str]:
    """Warnings for clock offsets between ranks above CLOCK_WARN_US (from the collectives analysis ``c``),
    with the offset used."""
    if c is None or not c.applicable:
        return []
    label = {i.rank: i.label for i in ranks}
    inst = c.instances
    out = []
    for r, off in sorted(c.offsets.items()):
        if off is None or not np.isfinite(off) or abs(off) <= CLOCK_WARN_US:
            continue
        ref = c.reference_rank.get(r, r)
        n = int((inst["rank"] == r).sum()) if len(inst) else 0
        applied = c.offsets_applied.get(r, 0.0)
        noise = c.offset_noise.get(r, float("nan"))
        what = (f"subtracted {applied / 1e3:+,.3f} ms from {label.get(r, r)}'s times before comparing ranks"
                if applied else
                f"not corrected (its spread, {noise / 1e3:,.3f} ms, is too large to trust it): cross-rank "
                "times of this rank are uncorrected")
        out.append(f"the clock of {label.get(r, r)} is {abs(off) / 1e3:,.3f} ms "
                   f"{'ahead of' if off > 0 else 'behind'} {label.get(ref, ref)}'s (median over {n} matched "
                   f"collectives' end times): {what}")
    return out
