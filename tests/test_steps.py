"""Step sources other than SGLang's spans, each checked against the spans they stand in for: repeated
iteration annotations on the CPU or the GPU, ProfilerStep#N written as an operator, periodic idle gaps
(and aperiodic ones, which are not steps), and the choice of phase."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import fixture_dir, real_trace, rewrite_trace

from traceinspect.link import link
from traceinspect.load import load_trace_set
from traceinspect.pipeline import analyze
from traceinspect.steps import build_steps
from traceinspect.steps.select import resolve_phase

SRC = "kv-full-cast-eager"


def _steps(path: Path) -> pd.DataFrame:
    ts = load_trace_set([path], use_cache=False, jobs=1)
    link(ts)
    steps = build_steps(ts)
    steps["kernels"] = [tuple(np.nonzero(ts.kernels["step"].to_numpy() == i)[0]) for i in range(len(steps))]
    return steps


def _rewrite(tmp_path: Path, name: str, edit) -> Path:  # noqa: ANN001 - a doc -> None callable
    out = tmp_path / f"{name}-TP-0.trace.json.gz"
    rewrite_trace(fixture_dir(SRC) / "fixture-TP-0.trace.json.gz", out, edit)
    return out


def test_iteration_annotations_on_cpu_and_gpu_cut_the_spans_steps(tmp_path: Path) -> None:
    ref = _steps(fixture_dir(SRC) / "fixture-TP-0.trace.json.gz")
    assert set(ref["source"]) == {"step_span"}

    def cpu(doc: dict) -> None:
        n = 0
        for e in doc["traceEvents"]:
            if str(e.get("name", "")).startswith("step["):
                e["name"] = f"train_iteration_{n}"
                n += 1
            elif str(e.get("name", "")).startswith("scheduler."):
                e["name"] = "x"

    it = _steps(_rewrite(tmp_path, "cpu", cpu))
    assert set(it["source"]) == {"iteration"} and len(it) == len(ref)
    assert it["phase"].eq("unknown").all() and it["name"].tolist()[:2] == ["train_iteration_0", "train_iteration_1"]
    # the windows are the spans themselves (the spans' run_batch widening aside): nearly the same kernels
    inner = slice(1, len(ref) - 1)
    same = [len(set(a) & set(b)) / max(len(b), 1) for a, b in zip(it["kernels"][inner], ref["kernels"][inner],
                                                                   strict=True)]
    assert min(same) > 0.9

    wins = ref[["gpu_start", "gpu_end"]].to_numpy()

    def gpu(doc: dict) -> None:
        ev = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith(("step[", "scheduler."))]
        pid = next(e["pid"] for e in ev if e.get("cat") == "kernel")
        for i, (g0, g1) in enumerate(wins):
            ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": f"iteration {i}", "pid": pid, "tid": 0,
                       "ts": float(g0), "dur": float(g1 - g0)})
        doc["traceEvents"] = ev

    g = _steps(_rewrite(tmp_path, "gpu", gpu))
    assert set(g["source"]) == {"iteration_gpu"} and len(g) == len(ref)
    assert g["kernels"].tolist() == ref["kernels"].tolist()  # GPU windows drawn on the spans' kernels


def test_profiler_step_as_an_operator(tmp_path: Path) -> None:
    def op(doc: dict) -> None:
        for e in doc["traceEvents"]:
            name = str(e.get("name", ""))
            if name.startswith("step["):
                e["name"], e["cat"] = f"ProfilerStep#{int(e['ts']) % 1000}", "Operator"
            elif name.startswith("scheduler."):
                e["name"] = "x"

    st = _steps(_rewrite(tmp_path, "op", op))
    assert set(st["source"]) == {"profiler_step"} and len(st) == 12 and st["edge"].sum() == 2


def test_idle_gaps_cut_only_periodic_alike_pieces(tmp_path: Path) -> None:
    """The same kernels with no marker: the steps' idle gaps are periodic and the pieces alike, so gaps
    cut them; with the pieces made unalike (half the kernels of every other step removed) they do not,
    and the capture is one step."""
    ref = _steps(fixture_dir(SRC) / "fixture-TP-0.trace.json.gz")
    bounds = ref[["gpu_start", "gpu_end"]].to_numpy()

    def bare(doc: dict) -> None:
        doc["traceEvents"] = [e for e in doc["traceEvents"]
                              if e.get("cat") not in ("user_annotation", "gpu_user_annotation")]

    def unalike(doc: dict) -> None:
        bare(doc)
        drop = set()
        for i, (g0, g1) in enumerate(bounds):
            if i % 2:
                ks = [j for j, e in enumerate(doc["traceEvents"]) if e.get("cat") == "kernel" and g0 <= e["ts"] <= g1]
                drop |= set(ks[::2])
        doc["traceEvents"] = [e for j, e in enumerate(doc["traceEvents"]) if j not in drop]

    gaps = _steps(_rewrite(tmp_path, "bare", bare))
    if set(gaps["source"]) == {"gpu_gaps"}:
        assert len(gaps) >= 3
    else:  # the fixture's gaps are not clean enough: then the whole capture is one step, never pieces
        assert gaps["source"].tolist() == ["whole_capture"]
    one = _steps(_rewrite(tmp_path, "unalike", unalike))
    assert one["source"].tolist() == ["whole_capture"] and one["n_kernels"].iloc[0] > 1000


def test_only_steps_the_recording_cut_are_partial(tmp_path: Path) -> None:
    """The fixture's profiler starts and stops within a few percent of a step of its first and last steps
    (it began and ended while the steps around them ran): those are partial, each with why. With the
    recording idle a whole step before and after them, they are complete and analysed; a last step whose
    launches have no GPU work in the trace (the recording stopped first) is still partial."""
    ref = _steps(fixture_dir(SRC) / "fixture-TP-0.trace.json.gz")
    assert ref["edge"].tolist() == [True] + [False] * (len(ref) - 2) + [True]
    assert ref["excluded_why"].iloc[0].startswith("partial: the recording (the profiler's span) began ")
    assert ref["excluded_why"].iloc[-1].startswith("partial: the recording (the profiler's span) ended ")
    period = float(np.median(np.diff(ref["cpu_start"].to_numpy())))
    last = ref.iloc[-1]
    gpu_cut = (last["gpu_start"] + last["gpu_end"]) / 2

    def idle(doc: dict, stop_early: bool) -> None:
        ev = []
        for e in doc["traceEvents"]:
            if e.get("cat") == "Trace":  # the profiler started a step earlier and stopped a step later
                e["ts"], e["dur"] = e["ts"] - period, e["dur"] + 2 * period
            if stop_early and e.get("cat") == "kernel" and e["ts"] > gpu_cut:
                continue  # the recording stops before the last step's second half runs on the GPU
            ev.append(e)
        doc["traceEvents"] = ev

    whole = _steps(_rewrite(tmp_path, "idle", lambda doc: idle(doc, False)))
    assert not whole["edge"].any() and whole["included"].all() and (whole["excluded_why"] == "").all()
    cut = _steps(_rewrite(tmp_path, "cut", lambda doc: idle(doc, True)))
    assert cut["edge"].tolist() == [False] * (len(cut) - 1) + [True]
    why = cut["excluded_why"].iloc[-1]
    n = int(why.removeprefix("partial: ").split()[0])
    assert n > 0 and why == f"partial: {n} kernel launch(es) in it have no GPU work in the trace"


def test_phase_resolution_says_what_it_did() -> None:
    def steps(*phases: str) -> pd.DataFrame:
        return pd.DataFrame({"phase": list(phases), "included": True})

    assert resolve_phase(steps("decode", "prefill"), "auto") == ("decode", [])
    p, notes = resolve_phase(steps("prefill", "prefill"), "auto")
    assert p == "prefill" and "no decode steps: analysed its 2 prefill step(s)" in notes[0]
    p, notes = resolve_phase(steps("unknown"), "auto")
    assert p == "unknown" and "states the phase" in notes[0]
    p, notes = resolve_phase(steps("unknown", "unknown"), "prefill")
    assert p == "prefill" and "2 analysed step(s) are of unknown phase" in notes[0] and "not known to be" in notes[0]
    p, notes = resolve_phase(steps("prefill", "mixed"), "auto")
    assert p == "all" and "prefill 1" in notes[0] and "mixed 1" in notes[0]


def test_a_training_step_gets_no_decode_advice() -> None:
    a = analyze([fixture_dir(SRC)], jobs=1)
    assert a.run_kind is not None and a.run_kind.kind == "decode" and a.rule_phase == "decode"
    a.run_kind.kind = "training"
    assert a.rule_phase == "training"


def test_group_unions_are_each_groups_union_bit_for_bit() -> None:
    """The unions of many groups at once equal union_us of each group: overlapping and touching
    intervals, equal starts, groups that overlap earlier groups in time, empty groups, NaN and negative
    times."""
    from traceinspect.steps import group_unions, union_us

    rng = np.random.default_rng(7)
    for trial in range(40):
        n_groups = int(rng.integers(1, 30))
        counts = rng.integers(0, 40, n_groups)
        counts[rng.random(n_groups) < 0.15] = 0
        bounds = np.r_[0, np.cumsum(counts)]
        n = int(bounds[-1])
        # groups mostly later in time than the ones before, some reaching back into them
        base = np.repeat(np.cumsum(rng.uniform(0, 50, n_groups)), counts)
        ts = base + np.round(rng.uniform(-5 if trial % 3 else -80, 40, n), 1 if trial % 2 else 3)
        end = ts + np.round(rng.exponential(4, n), 2)
        if trial % 5 == 0 and n:
            ts[rng.integers(0, n, 3)] = np.nan
            end[rng.integers(0, n, 2)] = np.nan
        if trial % 7 == 0:
            ts -= 500.0
            end -= 500.0
        got = group_unions(ts, end, bounds)
        with np.errstate(invalid="ignore"):  # (NaN times)
            want = [union_us(ts[a:b], end[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        assert len(got) == n_groups
        for g, w in zip(got.tolist(), want, strict=True):
            assert (np.isnan(g) and np.isnan(w)) or g == w, (trial, g, w)
    assert group_unions(np.zeros(0), np.zeros(0), np.array([0, 0, 0])).tolist() == [0.0, 0.0]


def _samples_by_named_aggregation(a) -> pd.DataFrame:  # noqa: ANN001 - an Analysis
    """The step samples as a named aggregation and an inner merge make them (the reference)."""
    sel = a.selected.copy()
    sel["pos"] = sel.groupby("rank").cumcount()
    sel = sel[sel["pos"] < a.steps_per_rank()]
    out = sel.groupby("pos").agg(step_us=("span_us", "max"), busy_us=("busy_us", "mean"),
                                 kernel_us=("kernel_us", "mean"), bs=("bs", "max"))
    cs = a.class_steps.merge(sel[["pos"]], left_on="step", right_index=True)
    wide = cs.groupby(["pos", "cls"], observed=True)["us"].sum().unstack("cls", fill_value=0.0) / a.n_ranks
    return out.join(wide.add_prefix("class."), how="left").fillna(0.0)


@pytest.mark.parametrize("trace", [
    lambda: fixture_dir("slow-rank-eager"),  # two ranks
    lambda: fixture_dir("kv-full-cast-graph"),
    lambda: real_trace("param__dlrm_8rank"),
    lambda: real_trace("tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"),
], ids=["slow-rank", "kv-graph", "dlrm-8rank", "tracelens-sglang-decode"])
def test_step_samples_are_the_named_aggregations_value_for_value(trace) -> None:  # noqa: ANN001
    a = analyze([trace()], use_cache=False)
    a.selected = a.selected.sample(frac=1.0, random_state=3).sort_values("rank", kind="stable")  # steps unsorted
    got = a._step_samples()
    pd.testing.assert_frame_equal(got, _samples_by_named_aggregation(a), check_exact=True)
    assert len(got) == a.steps_per_rank() and got.filter(like="class.").shape[1]


def _capture_phase_trace(path: Path, pieces: int = 3, per: int = 33, capture: bool = True) -> None:
    """A vLLM CUDA-graph capture phase as the profiler records it: python_function events all along, no
    step marker, ``pieces`` alike bursts of ``per`` kernels (one per captured batch size) apart by idle gaps."""
    import gzip
    import json

    ev: list[dict] = [{"ph": "X", "cat": "python_function", "name": "vllm/v1/worker/gpu_model_runner.py(2001): "
                       "capture_model", "pid": 1, "tid": 1, "ts": 0.0, "dur": pieces * 10_000.0}]
    corr = 0
    for p in range(pieces):
        t = 100.0 + p * 10_000.0
        ev.append({"ph": "X", "cat": "python_function", "name": "vllm/v1/worker/gpu_model_runner.py(1900): _dummy_run",
                   "pid": 1, "tid": 1, "ts": t - 50, "dur": per * 20.0 + 100})
        for i in range(per):
            corr += 1
            at = t + i * 20.0
            ev.append({"ph": "X", "cat": "python_function", "name": f"torch/nn/modules/module.py({i}): _call_impl",
                       "pid": 1, "tid": 1, "ts": at, "dur": 15.0})
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": at + 1,
                       "dur": 4.0, "args": {"correlation": corr, "External id": corr}})
            ev.append({"ph": "X", "cat": "kernel", "name": f"kernel_{i % 11}", "pid": 0, "tid": 7, "ts": at + 10,
                       "dur": 8.0, "args": {"correlation": corr, "External id": corr, "device": 0, "stream": 7}})
        if capture:  # then the same forward captured into a graph (its kernels do not run)
            for j, call in enumerate(("cudaStreamBeginCapture", "cudaStreamEndCapture", "cudaGraphInstantiate")):
                ev.append({"ph": "X", "cat": "cuda_runtime", "name": call, "pid": 1, "tid": 1,
                           "ts": t + per * 20.0 + 200 + 100 * j, "dur": 20.0, "args": {"correlation": 10_000 + corr + j}})
    doc = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}], "traceEvents": ev}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def test_a_capture_phase_with_python_functions_and_no_marker_is_analysed(tmp_path: Path) -> None:
    """Periodic alike bursts and no marker: the gaps are compared by kernel names (read for the rank, not
    left out of the columns the steps stage reads), and the capture analyses."""
    bare = tmp_path / "bare.pt.trace.json.gz"
    _capture_phase_trace(bare, capture=False)
    st = _steps(bare)
    assert st["source"].tolist() == ["gpu_gaps"] * 3 and int(st["n_kernels"].sum()) == 99
    # with the capture calls, the bursts are the captured batch sizes' warm-up runs: one whole-capture step
    path = tmp_path / "capture.pt.trace.json.gz"
    _capture_phase_trace(path)
    st = _steps(path)
    assert st["source"].tolist() == ["whole_capture"] and st["n_kernels"].tolist() == [99]
    doc = analyze([path], jobs=1).to_json()
    assert doc["steps"]["count"] == 1 and doc["coverage"]["kernels_analysed"] == 99
