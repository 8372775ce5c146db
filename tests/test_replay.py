"""The what-if replay: a replay without edits reproduces every fixture set and real traces; findings' savings
come from replays; the whatif CLI. The before/after pairs: ``test_replay_pairs.py``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FIXTURES, analysed, fixture_dir, real_trace, run_cli

from traceinspect.pipeline import Analysis
from traceinspect.whatif import EditError, Replayer, parse_edit, replayer

SETS = sorted(p.parent.name for p in FIXTURES.glob("*/manifest.json")) + sorted(
    str(p.parent.relative_to(FIXTURES)) for p in FIXTURES.glob("drift/*/manifest.json"))
TOL = 0.03


def _analysis(path: str, phase: str = "decode") -> Analysis:
    return analysed(path, phase)


def _fixture(name: str) -> Analysis:
    return _analysis(str(fixture_dir(name)))


def _check_reproduces(a: Analysis) -> None:
    p = replayer(a).as_measured()
    assert len(p.per_step)
    assert abs(p.replayed_step_us - p.measured_step_us) <= TOL * p.measured_step_us
    for r in p.rank_rows():
        assert abs(r["replayed_step_us"] - r["measured_step_us"]) <= TOL * r["measured_step_us"], r
        assert abs(r["replayed_busy_us"] - r["measured_busy_us"]) <= TOL * r["measured_busy_us"], r
    assert p.predicted_step_us == pytest.approx(p.replayed_step_us)


@pytest.mark.parametrize("name", SETS)
def test_replay_reproduces_fixture_sets(name: str) -> None:
    _check_reproduces(_fixture(name))


@pytest.mark.parametrize("name", ["kv-full-cast-eager", "kv-gather-cast-graph"])
def test_replay_reproduces_single_rank(name: str) -> None:
    one = sorted(fixture_dir(name).glob("*-TP-1.trace.json.gz"))[0]
    a = _analysis(str(one))
    assert a.n_ranks == 1
    _check_reproduces(a)


@pytest.mark.parametrize("name", [
    "param__dlrm_8rank",  # 8 ranks, NCCL, several streams, V100
    "hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz",  # vLLM, graphs
    "tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
])
def test_replay_reproduces_real_traces(name: str) -> None:
    a = _analysis(str(real_trace(name)), "all")
    _check_reproduces(a)
    if name.startswith("param"):
        m = replayer(a).model
        assert len(m.i_members) and m.h_block.any()  # collectives and blocking calls are in the model


def test_model_dependencies_on_fixtures() -> None:
    eager = replayer(_fixture("kv-full-cast-eager")).describe()
    graph = replayer(_fixture("kv-full-cast-graph")).describe()
    assert eager["collective_instances"] == 8 * eager["steps"]  # 2 all-reduces per layer, 4 layers
    assert graph["collective_instances"] == 8 * graph["steps"]
    assert graph["blocking_calls"] >= graph["steps"] * 2  # the DtoH copy of the sampled ids, per rank
    assert graph["host_calls"] < eager["host_calls"] / 50  # one graph launch instead of a launch per kernel


def test_findings_savings_come_from_replays() -> None:
    a = _fixture("slow-rank-eager")
    doc = a.to_json()
    fired = doc["findings"]
    assert len(fired) >= 3
    for f in fired:
        assert f["estimate_source"] == "replay"
        first = next(v for v in f["fixes"] if v["predicted_step_us"] is not None)
        assert f["est_saving_us_per_step"] == pytest.approx(max(first["saving_us_per_step"], 0.0), abs=0.2)
    # comm-wait and rank-straggler claim the same wait: one replay of both is not their sum
    allf = doc["replay"]["all_fixed"]
    savings = sum(f["est_saving_us_per_step"] for f in fired)
    assert savings > doc["steps"]["median_us"]  # what adding them would claim: more than the step
    assert 0 < allf["predicted_step_us"] < allf["replayed_step_us"]
    assert allf["saving_us_per_step"] < doc["steps"]["median_us"]
    # findings sharing a cause are grouped under the largest saving
    by_rule = {f["rule"]: f for f in fired}
    assert by_rule["rank-straggler"]["group"]["parent"] is not None
    assert all(f["group"]["parent"] is None for f in fired if f["group"]["children"])


def test_kv_cast_fix_variants_named_and_ordered() -> None:
    a = _fixture("kv-full-cast-graph")
    f = next(f for f in a.findings if f.rule == "kv-full-pool-cast")
    variants = {v["variant"]: v for v in f.fixes}
    gather, fp8 = variants["kv-full-pool-cast:gather"], variants["kv-full-pool-cast:fp8-attention"]
    # FP8-native attention removes the cast; gather-then-cast keeps active/pool of it: it saves less
    assert fp8["saving_us_per_step"] > gather["saving_us_per_step"] > 0
    assert f.est_saving_us_per_step == pytest.approx(gather["saving_us_per_step"], abs=0.2)
    assert any("65,536 active / 524,288 pool rows" in n for n in gather["notes"])


def test_host_bound_step_gains_little_from_gpu_work() -> None:
    """Removing the KV cast of a host-bound eager step saves little: the GPU waits for the host anyway."""
    a = _fixture("kv-full-cast-eager")
    rp = replayer(a)
    gone = rp.predict([parse_edit("remove class=kv_cast")])
    cast_us = float(a.kernels.loc[a.kernels["cls"] == "kv_cast", "dur"].sum()) / (a.steps_per_rank() * a.n_ranks)
    assert cast_us > 3000
    assert gone.saving_us < 0.1 * cast_us
    # on the graph step, GPU-bound, nearly all of it is saved
    g = replayer(_fixture("kv-full-cast-graph")).predict([parse_edit("remove class=kv_cast")])
    assert g.saving_us > 0.9 * cast_us


def test_kv_rows_undecided_without_evidence(tmp_path: Path) -> None:
    a = _fixture("kv-full-cast-graph")
    saved = a.graph_ops, dict(a.trace.server_info or {})
    try:
        a.graph_ops = None
        p = Replayer(a).predict([parse_edit("kv-rows class=kv_cast")])
    finally:
        a.graph_ops = saved[0]
    assert p.predicted_step_us is None and p.saving_us is None
    assert "cannot be decided" in p.undecided[0]


def test_edit_parsing_errors() -> None:
    for bad in ["bogus 1", "scale class=kv_cast", "scale class=kv_cast -1", "remove foo", "host-from 1",
                "scale name~=(a+)+ 0.5", "scale class~=x 0.5", "host-speed", "host-speed 0", "host-speed fast",
                "host-speed 2 rank=x"]:
        with pytest.raises(EditError):
            parse_edit(bad)
    e = parse_edit("scale class=kv_cast,name~=copy 0.2")
    assert e.select.classes == ("kv_cast",) and e.value == 0.2


def test_host_from_moves_the_straggler() -> None:
    a = _fixture("slow-rank-eager")
    rp = replayer(a)
    fixed = rp.predict([parse_edit("host-from 1 0")])
    worse = rp.predict([parse_edit("host-from 0 1")])
    assert fixed.saving_us > 0.25 * fixed.replayed_step_us  # rank 1 busy-waits 3 ms per layer
    assert abs(worse.saving_us) < 0.02 * worse.replayed_step_us


def test_whatif_cli_json(tmp_path: Path) -> None:
    d = fixture_dir("kv-full-cast-graph")
    out = tmp_path / "w.json"
    r = run_cli("whatif", str(d), "--fix", "kv-full-pool-cast:fp8-attention", "--edit", "transfer 0.5",
                "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    for key in ("measured_step_us", "replayed_step_us", "predicted_step_us", "edits", "ranks"):
        assert key in doc
    assert [e["edit"] for e in doc["edits"]] == ["remove", "transfer"]
    assert {"rank", "measured_step_us", "replayed_step_us", "predicted_step_us"} <= set(doc["ranks"][0])
    assert doc["predicted_step_us"] < 0.6 * doc["measured_step_us"]
    assert "TP step" in r.stdout and "predicted" in r.stdout
    # no fix or edit: replays as measured
    r = run_cli("whatif", str(d), "--json", str(out))
    doc = json.loads(out.read_text())
    assert doc["predicted_step_us"] == doc["replayed_step_us"]
    assert abs(doc["replayed_step_us"] - doc["measured_step_us"]) <= TOL * doc["measured_step_us"]


def test_whatif_cli_host_speed_of(tmp_path: Path) -> None:
    """--host-speed-of gives the trace another capture's host speed (measured, per rank); against a CUDA-graph
    capture, whose steps run no CPU op, the prediction is undecided and says why."""
    out = tmp_path / "w.json"
    r = run_cli("whatif", str(fixture_dir("tp1-l6-full-eager")), "--fix", "kv-full-pool-cast:gather",
                "--host-speed-of", str(fixture_dir("tp1-l6-gather-eager")), "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    ratio = doc["host_speed_of"]["ranks"][0]["ratio"]
    assert ratio > 1.2 and doc["edits"][-1]["edit"] == "host-speed"  # that capture's host ran faster
    assert doc["predicted_step_us"] < doc["replayed_step_us"] / 1.2
    assert "host speed: rank 0" in r.stdout
    r = run_cli("whatif", str(fixture_dir("tp1-l6-full-eager")), "--host-speed-of",
                str(fixture_dir("tp1-l6-full-graph")), "--json", str(out))
    doc = json.loads(out.read_text())
    assert r.returncode == 0 and doc["predicted_step_us"] is None
    assert "runs a CPU op" in doc["undecided"][0]


def test_whatif_cli_bad_input(tmp_path: Path) -> None:
    d = fixture_dir("kv-full-cast-graph")
    for args in (["--edit", "scale class=kv_cast"], ["--fix", "no-such-rule"], ["--fix", "kv-full-pool-cast:nope"]):
        out = tmp_path / "x.json"
        r = run_cli("whatif", str(d), *args, "--json", str(out))
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
        assert not out.exists()


def test_replay_vectors_are_plain_arrays() -> None:
    m = replayer(_fixture("kv-full-cast-graph")).model
    for name in ("g_t", "g_dur", "g_lA", "g_lS", "g_res", "h_t", "h_gap"):
        assert isinstance(getattr(m, name), np.ndarray)


@pytest.mark.parametrize("name,edits", [
    ("kv-full-cast-eager", ["host-gaps 0", "launch-cost 0"]),
    ("kv-full-cast-eager", ["remove class=kv_cast"]),
    ("kv-full-cast-eager", ["host-speed 1.5 rank=1", "remove class=kv_cast"]),
    ("slow-rank-eager", ["host-from 1 0", "transfer 0.5"]),
    ("kv-full-cast-graph", ["kv-rows class=kv_cast", "async"]),
])
def test_segment_simulation_equals_event_loop(name: str, edits: list[str]) -> None:
    """The segment-wise simulation gives the same times as one event per node."""
    from replay_reference import simulate_events

    from traceinspect.whatif.edits import apply_edits
    from traceinspect.whatif.sim import simulate

    a = _fixture(name)
    rp = replayer(a)
    p = apply_edits(a, rp.model, [parse_edit(e) for e in edits], rp.base_params).params
    r1, r2 = simulate_events(rp.model, p), simulate(rp.model, p)
    np.testing.assert_allclose(r2.g_start, r1.g_start, atol=0.05)
    np.testing.assert_allclose(r2.g_end, r1.g_end, atol=0.05)
    np.testing.assert_allclose(r2.h_start, r1.h_start, atol=0.05)


def test_gemm_m_batch_change_says_how_sure() -> None:
    a = _fixture("moe-small-m-eager")
    rp = replayer(a)
    p = rp.predict([parse_edit("gemm-m class=moe_gemm 16")])
    assert p.decided and any("low confidence" in n for n in p.notes)
    before = rp.base_params.dur[rp.model.g_cls == "moe_gemm"].sum()
    after = p.run.g_end - p.run.g_start
    grown = after[rp.model.g_cls == "moe_gemm"].sum()
    assert before < grown < 16 * before  # more rows cost more, far less than proportionally at tiny M
    # graph replays without a capture trace have no M: undecided, not guessed
    g = _fixture("kv-full-cast-graph")
    saved = g.efficiency
    try:
        g.efficiency = None
        q = Replayer(g).predict([parse_edit("gemm-m class=moe_gemm 2")])
    finally:
        g.efficiency = saved
    assert q.predicted_step_us is None and q.undecided


def test_all_fixed_in_every_output_and_savings_never_added(tmp_path: Path) -> None:
    """The all-fixed step is one replay, shown in the terminal, JSON, Markdown and HTML; no output shows a
    sum of findings' savings."""
    import itertools

    from traceinspect.units import fmt_us

    j, md, html = tmp_path / "a.json", tmp_path / "a.md", tmp_path / "a.html"
    r = run_cli("analyze", str(fixture_dir("slow-rank-eager")), "--json", str(j), "--markdown", str(md),
                "--html", str(html), "--no-cache")
    assert r.returncode == 0, r.stderr
    doc = json.loads(j.read_text())
    allf = doc["replay"]["all_fixed"]
    assert allf["predicted_step_us"] is not None and len(allf["fixes"]) >= 3
    line = f"→ {fmt_us(allf['predicted_step_us'])}"
    texts = {"terminal": " ".join(r.stdout.split()), "markdown": md.read_text(), "html": html.read_text()}
    for where, text in texts.items():
        assert "All findings fixed together" in text and line in text, where
    savings = [f["est_saving_us_per_step"] for f in doc["findings"] if f["est_saving_us_per_step"]]
    assert len(savings) >= 3
    sums = {fmt_us(sum(c)) for n in range(2, len(savings) + 1) for c in itertools.combinations(savings, n)}
    sums -= {fmt_us(s) for s in savings} | {fmt_us(allf["saving_us_per_step"]), fmt_us(allf["predicted_step_us"])}
    for where, text in texts.items():
        assert not [s for s in sums if s in text], where


def test_host_stall_matches_the_injected_delay() -> None:
    """The host-stall finding measures the planted busy wait (manifest: per layer) and its fix's replay
    removes about that much from the host-bound step."""
    name = "tp1-l6-gather-eager-hostdelay"
    man = json.loads((fixture_dir(name) / "manifest.json").read_text())
    planted = man["host_delay_us_per_layer"] * man["layers"]
    a = _fixture(name)
    f = next(f for f in a.findings if f.rule == "host-stall")
    ev = f.evidence
    assert ev["host_stalls_per_step"] == man["layers"]
    assert abs(ev["host_stall_us_per_step"] - planted) <= 0.05 * planted
    assert abs(f.est_saving_us_per_step - planted) <= 0.1 * planted
    assert not [g for g in _fixture("tp1-l6-gather-eager").findings if g.rule == "host-stall"]
    p = replayer(_fixture("tp1-l6-gather-eager")).predict([parse_edit("host-stalls 200")])
    assert p.predicted_step_us == pytest.approx(p.replayed_step_us) and "no host stall" in p.notes[0]


def test_ops_inside_steps_equal_the_direct_test() -> None:
    """The sorted-range test of which CPU ops start inside an analysed step equals testing every op against
    every step: on random ops and steps (NaN starts, equal starts, empty and reversed spans)."""
    import numpy as np
    import pandas as pd

    from traceinspect.whatif.kvrows import _inside_steps

    rng = np.random.default_rng(3)
    for trial in range(30):
        n, m = int(rng.integers(0, 400)), int(rng.integers(0, 12))
        ts = np.round(rng.uniform(0, 100, n), 0 if trial % 2 else 2)
        ts[rng.random(n) < 0.05] = np.nan
        ops = pd.DataFrame({"rank": rng.integers(0, 3, n), "ts": ts})
        lo = np.round(rng.uniform(-5, 100, m), 0)
        hi = lo + np.round(rng.uniform(-10, 40, m), 0)
        lo[rng.random(m) < 0.1] = np.nan
        sel = pd.DataFrame({"rank": rng.integers(0, 3, m), "cpu_start": lo, "cpu_end": hi})
        want = np.zeros(n, dtype=bool)
        for r, a, b in zip(sel["rank"], lo, hi, strict=True):
            if np.isfinite(a) and np.isfinite(b):
                want |= (ops["rank"].to_numpy() == r) & (ts >= a) & (ts <= b)
        assert np.array_equal(_inside_steps(ops, sel), want), trial


@pytest.mark.parametrize("source,edits", [
    ("fixture:kv-full-cast-eager", ["remove class=kv_cast"]),
    ("fixture:kv-full-cast-graph", ["kv-rows class=kv_cast", "async"]),
    ("fixture:slow-rank-eager", ["host-from 1 0", "transfer 0.5"]),
    ("fixture:tp1-l6-gather-eager-hostdelay", ["host-gaps 0", "launch-cost 0"]),
    ("real:param__dlrm_8rank", ["transfer 0.5"]),
    ("real:tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", ["launch-cost 0"]),
])
def test_native_critical_walk_equals_the_python_walk(source: str, edits: list[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's critical path walked by the native scanner: the same sums, bit for bit, in the same key
    order, as the Python walk, replayed as measured and with edits."""
    from traceinspect.load.native import native_available
    from traceinspect.whatif.edits import apply_edits
    from traceinspect.whatif.sim import simulate

    if not native_available():
        pytest.skip("the native scanner is not built")
    kind, name = source.split(":", 1)
    a = _fixture(name) if kind == "fixture" else _analysis(str(real_trace(name)), "all")
    rp = Replayer(a)
    runs = [(rp.base, rp.base_params)]
    p = apply_edits(a, rp.model, [parse_edit(e) for e in edits], rp.base_params).params
    runs.append((simulate(rp.model, p), p))
    for run, params in runs:
        native = rp._path(run, params)
        monkeypatch.setenv("TRACEINSPECT_NATIVE", "0")
        plain = rp._path(run, params)
        monkeypatch.delenv("TRACEINSPECT_NATIVE")
        assert plain and list(native.items()) == list(plain.items())


def test_native_critical_walk_refuses_arrays_that_do_not_fit() -> None:
    from traceinspect.load.native import native_available, native_module

    if not native_available():
        pytest.skip("the native scanner is not built")
    walk = native_module().critical_walk
    i, f = np.zeros(3, dtype=np.int64), np.zeros(3)
    ok = dict(order=np.arange(3), bounds=np.array([0, 3]), g_inst=i - 1, g_key=i, g_prev=i - 1, g_xprev=i - 1,
              g_launch=i - 1, bind=i + 3, last_op=i, g_start=f, g_end=f, h_wait=i - 1, h_prev=i - 1, h_waited=i,
              h_start=f, dur=f + 1.0, r=f)
    sums, first, steps = walk(*ok.values(), (5, 1, 2, 3, 4), (1, 2, 0))
    assert steps == 1 and np.frombuffer(sums)[0] == 1.0 and np.frombuffer(first, dtype=np.int64)[0] == 0
    for name, bad, err in (("order", np.array([0, 1, 7]), ValueError), ("bounds", np.array([0, 4]), ValueError),
                           ("g_key", i + 9, ValueError), ("g_prev", np.zeros(2, dtype=np.int64), ValueError),
                           ("g_end", i, TypeError), ("last_op", i + 5, IndexError)):
        args = {**ok, name: bad}
        if name == "last_op":
            args["g_inst"] = i  # collectives: their last op is read
        with pytest.raises(err):
            walk(*args.values(), (5, 1, 2, 3, 4), (1, 2, 0))
