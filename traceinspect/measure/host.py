"""Host-side facts of the analysed steps, measured once in the measure stage: the stretches where a
launching thread stalls (:func:`~traceinspect.measure.stalls.stall_stretches` at the replay
settings' threshold), blocking host synchronisations and idle gaps between GPU activities. The rules'
run metrics and the ``host-stalls`` replay edit read them from here."""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec
import pandas as pd

from traceinspect.measure.idle import gpu_gaps, host_syncs
from traceinspect.measure.replay_settings import load_settings
from traceinspect.measure.stalls import stall_stretches

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


class HostActivity(msgspec.Struct):
    """What :func:`host_activity` measured."""

    stall_min_us: float  # the threshold of ``stalls``
    stalls: pd.DataFrame  # stall_stretches(a, stall_min_us)
    syncs: tuple[int, float, float]  # host_syncs: calls, host us inside them, GPU bubble they caused
    gaps: tuple[int, float]  # gpu_gaps of the analysed steps' kernels: count, total us

    def stalls_at(self, min_us: float) -> pd.DataFrame | None:
        """The stall stretches at threshold ``min_us``, if that is the one measured."""
        return self.stalls if min_us == self.stall_min_us else None


def host_of(a: Analysis) -> HostActivity:
    """``a``'s host activity: the measure stage's, or measured now (for a record made without it)."""
    host = getattr(a, "host", None)
    return host if host is not None else host_activity(a)


def host_activity(a: Analysis) -> HostActivity:
    """The host-side facts of ``a``'s analysed steps."""
    lo = load_settings().host_stall_min_us
    return HostActivity(lo, stall_stretches(a, lo), host_syncs(a.trace.runtime, a.trace.kernels, a.selected),
                        gpu_gaps(a.kernels))
