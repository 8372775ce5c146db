"""The decode step at another running batch (``batch`` edit, ``traceinspect whatif --batch``): the measured
batch pairs, the server's caps and the roofline floor."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
from conftest import fixture_dir, run_cli

from traceinspect.measure.roofline import floor_us
from traceinspect.pipeline import Analysis, analyze
from traceinspect.whatif import EditError, Prediction, parse_edit, replayer
from traceinspect.whatif.batch import plan_batch
from traceinspect.whatif.edits import apply_edits
from traceinspect.whatif.gemm_m import gemm_rows

# GPU busy time per step predicted at the other set's batch against the other set's measured one
BUSY_TOL = 0.15
# the CUDA-graph TP step: the two captures' graph-launch latency differs by about 1.1 ms (1,251 us before the
# first graph kernel at batch 16, 141 us at batch 256), which no batch model moves (docs/whatif.md)
GRAPH_STEP_TOL = 0.30
# the eager TP step with the two captures' host speeds controlled (--host-speed-of)
EAGER_STEP_TOL = 0.10
PAIRS = [("tp1-l6-gather-graph-bs16", "tp1-l6-gather-graph"), ("tp1-l6-gather-eager-bs16", "tp1-l6-gather-eager")]


@lru_cache(maxsize=8)
def _fixture(name: str) -> Analysis:
    return analyze(str(fixture_dir(name)), phase="decode")


def _busy(p: Prediction, col: str) -> float:
    return float(np.median([r[col] for r in p.rank_rows()]))


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "->".join(p))
@pytest.mark.parametrize("reverse", [False, True], ids=["up", "down"])
def test_batch_pair_predicts_the_other_sets_step(pair: tuple[str, str], reverse: bool) -> None:
    src, dst = (pair[1], pair[0]) if reverse else pair
    a, b = _fixture(src), _fixture(dst)
    target = b.run_model.value("batch")
    assert target and target != a.run_model.value("batch")
    p = replayer(a).predict([parse_edit(f"batch {target:g} max-running-requests={target:g}")])
    assert p.decided, p.undecided
    assert p.batch.target == target and p.batch.bound_by is None
    measured = replayer(b).as_measured()
    busy = _busy(p, "predicted_busy_us") / _busy(measured, "measured_busy_us") - 1.0
    assert abs(busy) <= BUSY_TOL, f"GPU busy time {busy:+.1%}"
    if "graph" in src:
        step = p.predicted_step_us / measured.measured_step_us - 1.0
        assert abs(step) <= GRAPH_STEP_TOL, f"step {step:+.1%}"
    # tokens/s is the batch over the step
    assert p.tokens_per_s("predicted") == pytest.approx(target * 1e6 / p.predicted_step_us)
    assert measured.tokens_per_s("measured") == pytest.approx(target * 1e6 / measured.measured_step_us)


def test_eager_batch_pair_with_host_speed_controlled() -> None:
    """The host-bound eager pair: the batch change plus the other capture's host speed (the same-host recapture
    of the batch-256 set) predicts its measured step."""
    from traceinspect.whatif.hostspeed import host_speed_ratio

    a, b = _fixture("tp1-l6-gather-eager-bs16"), _fixture("tp1-l6-gather-eager-samehost")
    hs = host_speed_ratio(a, b)
    assert hs.decided
    target = b.run_model.value("batch")
    edits = [parse_edit(f"batch {target:g} max-running-requests={target:g}")] + [parse_edit(e) for e in hs.edits()]
    p = replayer(a).predict(edits)
    step = p.predicted_step_us / replayer(b).as_measured().measured_step_us - 1.0
    assert abs(step) <= EAGER_STEP_TOL, f"step {step:+.1%}"


def test_kv_pool_caps_the_batch() -> None:
    a = _fixture("tp1-l6-gather-graph-bs16")
    pool = a.run_model.value("kv_pool_tokens")
    plan, notes = plan_batch(a, parse_edit("batch 1000000 max-running-requests=1000000"), replayer(a).cache)
    assert plan.bound_by == "kv_pool"
    per_req = plan.tokens_per_request
    assert per_req and plan.target == np.floor(pool / per_req)
    assert any("capped at" in n and "KV pool" in n for n in notes)
    # 'max' is the KV pool's capacity, and names the max_running_requests it needs
    top, notes = plan_batch(a, parse_edit("batch max"), replayer(a).cache)
    assert top.target == plan.target and any("needs max_running_requests" in n for n in notes)


def test_max_running_requests_caps_the_batch() -> None:
    a = _fixture("tp1-l6-gather-graph-bs16")
    mrr = a.trace.server_info["max_running_requests"]
    plan, notes = plan_batch(a, parse_edit("batch 4x"), replayer(a).cache)
    assert plan.asked == 4 * a.run_model.value("batch")
    assert plan.bound_by == "max_running_requests" and plan.target == mrr
    assert any(f"capped at {mrr}" in n and "max_running_requests" in n for n in notes)
    # an assumed setting replaces server_info's
    plan, _ = plan_batch(a, parse_edit("batch 4x max-running-requests=48"), replayer(a).cache)
    assert plan.target == 48 and plan.bound_by == "max_running_requests"


def test_no_gemm_below_its_floor() -> None:
    a = _fixture("tp1-l6-gather-graph-bs16")
    rp = replayer(a)
    m = rp.model
    dur = apply_edits(a, m, [parse_edit("batch 2048 max-running-requests=2048")], rp.base_params, rp.cache).params.dur
    r = gemm_rows(a).set_index("kernel").reindex(m.g_kidx)
    f = 2048 / a.run_model.value("batch")
    m0, n, k = r["m_"].to_numpy(), r["n_"].to_numpy(), r["k_"].to_numpy()
    m1 = m0 * f
    nbytes = r["by_"].to_numpy() * (m1 * k + k * n + m1 * n) / (m0 * k + k * n + m0 * n)
    floor = floor_us(r["fl_"].to_numpy() * f, nbytes, r["peak_"].to_numpy() / 1e6, a.efficiency.spec.mem_bw_gbps)
    gemm = np.isfinite(m0) & (r["batch_"].to_numpy() <= 1)
    assert gemm.sum() > 100 and (floor[gemm] > 0).all()
    assert (dur[gemm] >= floor[gemm] * (1 - 1e-9)).all()
    # memory-bound kernels with recorded bytes: their bytes x F at the peak bandwidth
    mem = a.efficiency.calls
    mem = mem[mem["kind"] == "memory"].drop_duplicates("kernel").set_index("kernel")["bytes"]
    nb = mem.reindex(m.g_kidx).to_numpy(dtype=np.float64)
    has = np.isfinite(nb) & (nb > 0)
    assert has.sum() > 100
    mem_floor = floor_us(np.full(has.sum(), np.nan), nb[has] * f, np.full(has.sum(), np.nan),
                         a.efficiency.spec.mem_bw_gbps)
    assert (dur[has] >= mem_floor * (1 - 1e-9)).all()
    assert (mem_floor > rp.base_params.dur[has]).any()  # at 128x the batch some floors pass the measured time


def test_floor_us_is_the_slower_roof() -> None:
    fl, by = np.array([2e9, 1e6, np.nan]), np.array([1e6, 4.8e9, 4.8e6])
    got = floor_us(fl, by, np.array([1000.0, 1000.0, np.nan]), 4800.0)
    assert got[0] == pytest.approx(2.0)  # 2 GFLOP at 1 PFLOP/s
    assert got[1] == pytest.approx(1000.0)  # 4.8 GB at 4.8 TB/s
    assert got[2] == pytest.approx(1.0)  # FLOPs unknown: the bytes alone
    assert floor_us(np.array([np.nan]), np.array([np.nan]), np.array([np.nan]), None)[0] == 0.0


def test_unknown_batch_is_undecided_not_guessed() -> None:
    a = analyze(str(fixture_dir("tp1-l6-gather-graph-bs16")), phase="decode")
    a.run_model.facts.pop("batch")
    p = replayer(a).predict([parse_edit("batch 2x")])
    assert p.predicted_step_us is None and p.tokens_per_s("predicted") is None
    assert any("observed batch is unknown" in u for u in p.undecided)


def test_gemms_without_shapes_are_undecided() -> None:
    a = _fixture("tp1-l6-full-graph-nocapture")
    p = replayer(a).predict([parse_edit("batch 2x")])
    assert p.predicted_step_us is None
    assert any("no recorded shape" in u for u in p.undecided)


def test_batch_edit_text() -> None:
    assert parse_edit("batch 4x").times and parse_edit("batch 4x").value == 4
    assert parse_edit("batch max").value is None
    assert parse_edit("batch 512 max-running-requests=1024").cap == 1024
    for bad in ("batch", "batch 0", "batch -2x", "batch 4 foo=1", "batch 4x max-running-requests=0"):
        with pytest.raises(EditError):
            parse_edit(bad)


def test_larger_batch_fix_reports_tokens_per_s_not_a_step_saving() -> None:
    a = _fixture("tp1-l6-gather-graph-bs16")
    f = next(f for f in a.findings if f.rule == "small-m-gemm")
    fx = next(x for x in f.fixes if x["variant"] == "small-m-gemm:larger-batch")
    assert fx["batch"]["capped_by"] is None and fx["batch"]["predicted"] > fx["batch"]["observed"]
    assert fx["predicted_tokens_per_s"] > fx["replayed_tokens_per_s"]
    assert fx["tokens_per_s_gain"] == pytest.approx(fx["predicted_tokens_per_s"] / fx["replayed_tokens_per_s"] - 1,
                                                    abs=1e-3)
    # the finding's step saving is the first step-time fix's, never the batch change's
    assert f.est_saving_us_per_step == pytest.approx(f.fixes[0]["saving_us_per_step"], abs=0.1)


def test_whatif_cli_batch(tmp_path: Path) -> None:
    j = tmp_path / "w.json"
    r = run_cli("whatif", str(fixture_dir("tp1-l6-gather-graph-bs16")), "--batch", "4x", "--json", str(j))
    assert r.returncode == 0, r.stderr
    doc = json.loads(j.read_text())
    assert doc["batch"]["capped_by"] == "max_running_requests"
    assert "tokens/s" in r.stdout and "capped at" in r.stdout
    assert doc["measured_tokens_per_s"] == pytest.approx(doc["batch"]["observed"] * 1e6 / doc["measured_step_us"],
                                                          rel=1e-3)
    r = run_cli("whatif", str(fixture_dir("tp1-l6-gather-graph-bs16")), "--max-running-requests", "4")
    assert r.returncode == 2 and "--batch" in r.stderr
