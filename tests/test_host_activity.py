"""The measure stage's host activity (stall stretches, syncs, GPU gaps) is what the metrics and the
``host-stalls`` edit would compute themselves, and measuring it in a forked process changes nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
from conftest import FIXTURES, REAL_TRACES

from traceinspect.measure.host import host_activity
from traceinspect.measure.idle import gpu_gaps, host_syncs
from traceinspect.measure.replay_settings import load_settings
from traceinspect.measure.stalls import stall_stretches
from traceinspect.pipeline import analyze

HOSTDELAY = FIXTURES / "tp1-l6-gather-eager-hostdelay"  # host stalls, one rank
REAL = REAL_TRACES / "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"
# (a thread that issues runtime calls and runs no CPU op)
REAL_THREADS = REAL_TRACES / "hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz"


def _doc(path: Path, **kw: object) -> dict:
    doc = analyze([str(path)], use_cache=False, **kw).to_json()
    doc["source"].pop("command", None)
    doc.pop("generated_at", None)
    return doc


@pytest.mark.parametrize("path", [HOSTDELAY, REAL], ids=["fixture", "real"])
def test_host_activity_is_what_the_metrics_compute(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} not present")
    a = analyze([str(path)], use_cache=False)
    assert a.host is not None
    lo = load_settings().host_stall_min_us
    h = host_activity(a)
    assert h.stall_min_us == lo
    assert h.stalls.equals(stall_stretches(a, lo)) and a.host.stalls.equals(h.stalls)
    assert h.syncs == a.host.syncs == host_syncs(a.trace.runtime, a.trace.kernels, a.selected)
    assert h.gaps == a.host.gaps == gpu_gaps(a.kernels)
    assert h.stalls_at(lo) is h.stalls and h.stalls_at(lo + 1.0) is None


def test_the_fixture_has_host_stalls() -> None:
    if not HOSTDELAY.exists():
        pytest.skip("fixture not present")
    a = analyze([str(HOSTDELAY)], use_cache=False)
    assert len(a.host.stalls) > 0  # so that the comparison above compares something


def test_metrics_without_a_measured_host_activity() -> None:
    """An analysis record made without the measure stage's host activity (older stored records, hand-made
    ones) gets the same run metrics: the metrics compute it themselves."""
    if not HOSTDELAY.exists():
        pytest.skip("fixture not present")
    from traceinspect.judge.metrics import MetricContext

    a = analyze([str(HOSTDELAY)], use_cache=False, jobs=1)
    with_host = MetricContext(a).run
    a.host = None
    assert MetricContext(a).run == with_host


def _stretches_by_hand(rt: pd.DataFrame, ops: pd.DataFrame, sel: pd.DataFrame, min_us: float) -> set[tuple]:
    """The stall stretches of every (rank, thread) by a plain walk over its intervals in start order."""
    out = set()
    both = pd.concat([rt[["rank", "tid", "ts", "dur"]], ops[["rank", "tid", "ts", "dur"]]], ignore_index=True)
    for (r, tid), g in both.groupby(["rank", "tid"]):
        if not (rt["tid"].eq(tid) & rt["rank"].eq(r)).any():
            continue  # only threads that issue runtime calls
        windows = []
        for label, s in sel[sel["rank"] == r].iterrows():
            lo, hi = max(s["cpu_start"], s["gpu_start"]), min(s["cpu_end"], s["gpu_end"])
            if np.isfinite(lo) and np.isfinite(hi) and hi > lo:
                windows.append((lo, hi, label))
        covered = None
        for start, dur in sorted(zip(g["ts"].tolist(), g["dur"].tolist(), strict=True)):
            if covered is not None and start - covered >= min_us:
                for lo, hi, label in windows:
                    if lo <= covered < hi and min(start, hi) - covered >= min_us:
                        out.add((int(r), int(tid), label, round(covered, 3), round(min(start, hi), 3)))
            covered = start + dur if covered is None else max(covered, start + dur)
    return out


@pytest.mark.parametrize("path", [HOSTDELAY, REAL, REAL_THREADS], ids=["fixture", "real", "real-threads"])
@pytest.mark.parametrize("min_us", [0.0, 5.0, 200.0])
def test_stall_stretches_are_the_gaps_of_each_thread(path: Path, min_us: float) -> None:
    """The stretches are those a walk over each thread's intervals finds, whatever the order of the rows."""
    if not path.exists():
        pytest.skip(f"{path} not present")
    a = analyze([str(path)], use_cache=False)
    rt, ops = a.trace.runtime, a.trace.cpu_ops
    want = _stretches_by_hand(rt, ops, a.selected, min_us)
    assert want or min_us > 5.0  # something to compare (a real trace may have no stretch of 200 us)
    for order in (None, 0, 1):
        t = a.trace if order is None else SimpleNamespace(
            runtime=rt.sample(frac=1.0, random_state=order), cpu_ops=ops.sample(frac=1.0, random_state=order + 7))
        got = stall_stretches(SimpleNamespace(trace=t, selected=a.selected), min_us)  # type: ignore[arg-type]
        assert {(int(r.rank), int(r.tid), r.step, round(r.start, 3), round(r.end, 3))
                for r in got.itertuples()} == want
