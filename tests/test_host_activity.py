"""The measure stage's host activity (stall stretches, syncs, GPU gaps) is what the metrics and the
``host-stalls`` edit would compute themselves, and measuring it in a forked process changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from traceinspect.measure.host import host_activity
from traceinspect.measure.idle import gpu_gaps, host_syncs
from traceinspect.measure.replay.model import load_settings
from traceinspect.measure.replay.stalls import stall_stretches
from traceinspect.parallel import _can_fork
from traceinspect.pipeline import analyze

ROOT = Path(__file__).resolve().parent.parent
HOSTDELAY = ROOT / "fixtures" / "tp1-l6-gather-eager-hostdelay"  # host stalls, one rank
REAL = ROOT.parent / "shared" / "real-traces" / "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"


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


@pytest.mark.skipif(not _can_fork(None), reason="no fork here, or a single CPU")
@pytest.mark.parametrize("path", [HOSTDELAY, REAL], ids=["fixture", "real"])
def test_document_same_with_and_without_the_second_process(path: Path) -> None:
    if not path.exists():
        pytest.skip(f"{path} not present")
    assert _doc(path) == _doc(path, jobs=1)


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
