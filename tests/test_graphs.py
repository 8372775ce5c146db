"""Recovering the CPU ops of CUDA-graph replays from graph-capture traces, and classifying with them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import copy_set, fixture_dir, graph_set_missing_one_launch, manifest, raw_events

from traceinspect.classify import CLASSES, classify_kernels, graphs
from traceinspect.classify.graphs import NO_CAPTURE, CaptureTrace, GraphOps, recover_graph_ops
from traceinspect.link import link
from traceinspect.load import load_trace_set
from traceinspect.model import RankInfo, TraceSet
from traceinspect.pipeline import Options, analyze

PAIRS = [("kv-full-cast-graph", "kv-full-cast-eager"), ("kv-gather-cast-graph", "kv-gather-cast-eager")]
GEMMS = ("moe_gemm", "bf16_gemm", "fp8_gemm")
NOTE = "op from graph capture trace"
_CACHE: dict[str, object] = {}


def _analysis(variant: str):
    if variant not in _CACHE:
        _CACHE[variant] = analyze(fixture_dir(variant), Options(command="test"))
    return _CACHE[variant]


def _per_step(a, cls: str) -> pd.DataFrame:
    """Calls and time of one class in every analysed (rank, step)."""
    k = a.kernels
    idx = pd.MultiIndex.from_frame(a.selected[["rank"]].assign(step=a.selected.index))
    got = k[k["cls"] == cls].groupby(["rank", "step"])["dur"].agg(calls="size", us="sum")
    return got.reindex(idx, fill_value=0)


def _expert_mm_ids(capture: Path) -> set[int]:
    """External ids of the aten::mm ops inside tinymoe::fused_experts, read from the raw capture trace."""
    ev = [e for e in raw_events(capture) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    outer = [e for e in ev if e["name"] == "tinymoe::fused_experts"]
    return {e["args"]["External id"] for e in ev if e["name"] == "aten::mm" and any(
        o["tid"] == e["tid"] and o["ts"] <= e["ts"] <= o["ts"] + o["dur"] for o in outer)}


# ----------------------------------------------------------------------------- real fixtures


@pytest.mark.parametrize(("graph", "eager"), PAIRS)
def test_expert_gemms_are_moe_gemm_from_the_capture(graph: str, eager: str) -> None:
    a = _analysis(graph)
    man = manifest(graph)
    g = a.graph_ops
    assert g is not None and set(g.ranks) == set(man["ranks"])
    assert all(s.status == "recovered" and s.matched == s.replays == man["steps_profiled"] and not s.reason
               for s in g.ranks.values())
    k = a.kernels
    moe = k[k["cls"] == "moe_gemm"]
    assert len(moe) and moe["graph_replay"].all() and (moe["op_idx"] == -1).all()
    assert moe["name"].str.startswith("nvjet_").all()
    assert moe["cls_evidence"].str.contains("rule moe-gemm-op (op tinymoe::fused_experts", regex=False).all()
    assert moe["cls_evidence"].str.endswith(NOTE).all()
    per = _per_step(a, "moe_gemm")["calls"]
    assert (per == man["planted_kernels"]["expert_gemm"]["per_step"]).all()
    # each step's expert GEMMs are the 128 aten::mm launches inside tinymoe::fused_experts of the capture
    for rank in man["ranks"]:
        ids = _expert_mm_ids(fixture_dir(graph) / man["capture_files"][rank])
        assert len(ids) == man["planted_kernels"]["expert_gemm"]["per_step"]
        ops = g.capture_ops(rank)
        rec = g.kernels.loc[moe.index[moe["rank"] == rank]]
        assert (ops.loc[rec["cap_op"], "name"] == "aten::mm").all()
        assert (rec["cap_op_path"] == "tinymoe::fused_experts > aten::mm").all()
        for _, step in rec.groupby("replay"):
            assert set(ops.loc[step["cap_op"], "external_id"]) == ids
    # every GEMM-class replay got its op, and no GEMM-named kernel outside the experts became moe_gemm
    rep = k[k["graph_replay"] & k["cls"].isin(GEMMS)]
    assert rep["cls_evidence"].str.contains(NOTE).all()
    assert not rep.loc[rep["cls"] != "moe_gemm", "cls_evidence"].str.contains("tinymoe").any()


@pytest.mark.parametrize(("graph", "eager"), PAIRS)
def test_gemm_class_time_matches_the_eager_twin(graph: str, eager: str) -> None:
    a, e = _analysis(graph), _analysis(eager)
    for cls in GEMMS:
        ga, ea = _per_step(a, cls), _per_step(e, cls)
        # same workload: the same calls in every step
        assert set(ga["calls"]) == set(ea["calls"]) and ga["calls"].nunique() == 1, cls
        g_us, e_us = ga["us"].median(), ea["us"].median()
        assert g_us == pytest.approx(e_us, rel=0.05), cls
    # and the other classes of the graph set line up with the eager twin's per-step calls too (the
    # graph set copies its inputs into static buffers: memcpy differs)
    gj, ej = a.to_json()["classes"], e.to_json()["classes"]
    for cls in set(gj) | set(ej):
        if cls != "memcpy":
            assert gj.get(cls, {}).get("calls_per_step") == ej.get(cls, {}).get("calls_per_step"), cls


@pytest.mark.parametrize("graph", ["kv-full-cast-graph", "kv-gather-cast-graph"])
def test_without_capture_traces_names_decide(tmp_path: Path, graph: str) -> None:
    d = copy_set(fixture_dir(graph), tmp_path / "set")  # rank files and server_info only
    a = analyze(d, Options(command="test"))
    assert not a.trace.capture_traces
    g = a.graph_ops
    assert set(g.ranks) == {0, 1} and not g.captures
    assert all(s.status == "unknown" and s.reason == NO_CAPTURE and s.matched == 0 and s.capture is None
               for s in g.ranks.values())
    assert (g.kernels["cap_op"] == -1).all() and (g.kernels["cap_op_path"] == "").all()
    assert (g.kernels["reason"] == NO_CAPTURE).all()
    k = a.kernels
    assert not (k["cls"] == "moe_gemm").any()
    assert not k["cls_evidence"].str.contains(NOTE).any()
    # the expert GEMMs fall back to their name-only class: dense bf16 GEMMs
    with_cap = _analysis(graph)
    experts = with_cap.kernels.index[with_cap.kernels["cls"] == "moe_gemm"]
    assert (k.loc[experts, "cls"] == "bf16_gemm").all()
    assert k.loc[experts, "cls_evidence"].str.match(r"rule dense-gemm \(name\)$").all()
    # the KV cast is still found from its recurrence under graph replay
    casts = k[k["cls"] == "kv_cast"]
    assert len(casts) and casts["cls_evidence"].str.contains("graph replay, no CPU op").all()


def test_mismatched_capture_is_reported_per_rank(tmp_path: Path) -> None:
    d = graph_set_missing_one_launch(tmp_path)
    a = analyze(d, Options(command="test"))
    s0, s1 = a.graph_ops.ranks[0], a.graph_ops.ranks[1]
    assert s0.status == "unknown" and s0.matched == 0 and "not matched to the capture trace" in s0.reason
    assert s1.status == "recovered" and s1.matched == s1.replays
    k = a.kernels
    ref = _analysis("kv-full-cast-graph").kernels
    experts = k.loc[ref.index[ref["cls"] == "moe_gemm"]]
    assert len(experts[experts["rank"] == 0]) and len(experts[experts["rank"] == 1])
    assert (experts.loc[experts["rank"] == 0, "cls"] == "bf16_gemm").all()
    assert (experts.loc[experts["rank"] == 1, "cls"] == "moe_gemm").all()


def test_cheap_without_replays_or_captures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def boom(*_a, **_k):
        raise AssertionError("capture trace read without need")

    monkeypatch.setattr(graphs, "load_capture", boom)
    ts = load_trace_set(fixture_dir("kv-full-cast-eager"))  # no graph replays: nothing to do
    link(ts)
    g = recover_graph_ops(ts)
    assert not len(g.kernels) and not g.ranks and list(g.kernels.columns) == graphs.GRAPH_COLUMNS
    d = copy_set(fixture_dir("kv-full-cast-graph"), tmp_path / "set")  # replays, no capture traces
    ts = load_trace_set(d)
    link(ts)
    g = recover_graph_ops(ts)
    assert len(g.kernels) == int(ts.kernels["graph_replay"].sum()) > 0


# ----------------------------------------------------------------------------- synthetic


def _capture(paths: list[str], dims: list[str]) -> CaptureTrace:
    """A capture trace of two windows with the same launches; op i has path paths[i] and dims dims[i]."""
    n = len(paths)
    ops = pd.DataFrame({"name": [p.rsplit(" > ", 1)[-1] for p in paths], "input_dims": [d.encode() for d in dims],
                        "input_types": [b'["c10::BFloat16"]'] * n, "concrete": [None] * n, "parent": -1})
    return CaptureTrace(kind=np.zeros(n, dtype=np.int64), cat=np.zeros(n, dtype=np.int64),
                        window=np.repeat([0, 1], n // 2), op_idx=np.arange(n), op_path=np.array(paths, dtype=object),
                        ops=ops)


def test_ambiguous_shapes_keep_agreed_op_paths() -> None:
    paths = ["a > aten::add", "moe > aten::mul"] * 2
    cap = _capture(paths, ['[[1]]', '[[1]]', '[[2]]', '[[2]]'])  # two graphs, different shapes
    ops, got, why = graphs._match(cap, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
    assert (ops == -1).all() and list(got) == paths[:2] and "ambiguous" in why
    cap = _capture(["a > aten::add", "moe > aten::mul", "b > aten::add", "moe > aten::mul"],
                   ['[[1]]', '[[1]]', '[[2]]', '[[2]]'])
    _, got, _ = graphs._match(cap, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
    assert list(got) == ["", "moe > aten::mul"]  # only what both windows agree on
    cap = _capture(paths, ['[[1]]', '[[1]]', '[[1]]', '[[1]]'])  # same shapes: not ambiguous
    ops, got, why = graphs._match(cap, np.zeros(2, dtype=np.int64), np.zeros(2, dtype=np.int64))
    assert list(ops) == [2, 3] and list(got) == paths[2:] and why == ""


NVJET = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"


def test_classify_uses_recovered_paths_only_for_replays() -> None:
    names = [NVJET, NVJET, NVJET, "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(x)"]
    k = pd.DataFrame({"rank": 0, "kind": "kernel", "name": names, "ts": [0.0, 10.0, 20.0, 30.0], "dur": 5.0,
                      "step": 0, "graph_replay": [True, True, False, True], "op_idx": [-1, -1, 7, -1],
                      "op_path": ["", "", "aten::mm", ""]}, index=[10, 11, 12, 13])
    ts = TraceSet(ranks=[RankInfo(rank=0, label="TP0", path=Path("x"), rank_source="filename")], kernels=k,
                  runtime=pd.DataFrame(), cpu_ops=pd.DataFrame(), annotations=pd.DataFrame(),
                  gpu_annotations=pd.DataFrame())
    rec = pd.DataFrame({"rank": 0, "replay": 0, "cap_op": [3, 4, 5, 6],
                        "cap_op_path": ["mymoe::experts > aten::mm", "", "mymoe::experts > aten::mm", "c10d::x"],
                        "reason": ""}, index=[10, 11, 12, 13])
    steps = pd.DataFrame({"rank": [0], "idx": [0], "included": [True]})
    classify_kernels(ts, steps, graph_ops=GraphOps(rec))
    got = ts.kernels
    assert got.loc[10, "cls"] == "moe_gemm" and got.loc[10, "cls_evidence"].endswith(NOTE)
    assert got.loc[11, "cls"] == "bf16_gemm" and NOTE not in got.loc[11, "cls_evidence"]  # nothing recovered
    # a live kernel keeps its own op path even if a (bogus) recovered one is listed for it
    assert got.loc[12, "cls"] == "bf16_gemm" and "op aten::mm" in got.loc[12, "cls_evidence"]
    # a name-decided label does not claim the capture as evidence
    assert got.loc[13, "cls"] == "comm" and NOTE not in got.loc[13, "cls_evidence"]
    assert set(got["cls"]) <= set(CLASSES)
    classify_kernels(ts, steps)  # the signature without recovered ops still works
    assert ts.kernels.loc[10, "cls"] == "bf16_gemm"
