"""Every public trace under ``shared/real-traces`` (systems other than ours wrote them): each analyses,
almost all of its kernel time is classified, its steps are the ones the run had, the run's kind is
what it was, and no fp32 GEMM is taken for a bf16 one. A capture with no step marker is one step
with the classes of its marked twin."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, REAL_TRACES, fixture_dir, real_trace, rewrite_trace, run_cli

from traceinspect.pipeline import Analysis, analyze

SGLANG_PREFILL = "tracelens__inference__sglang_prefilldecode__sglang_Qwen3-8B_prefilldecode.json.gz"
VLLM_TP4 = "hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz"
RESNET = "pytorch__kineto__tb_plugin__samples__resnet50_num_workers_0__worker0.pt.trace.json.gz"
DLRM = "param__dlrm_8rank"
TRACES = [
    "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz",
    "tracelens__inference__sglang_decode__capture_traces__bs_32_rank0.json.gz",
    SGLANG_PREFILL,
    "tracelens__inference__vllm_decode_full__graph_execution.json.gz",
    "tracelens__b200__eager_trace.json.gz",
    "tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz",
    RESNET,
    VLLM_TP4,
    DLRM,
    "hta/df_index_resolver",
    "hta/nccl_parser_config",
    "hta/trace_file_list",
    "hta/trace_filter",
]
FP32_GEMM_NAME = re.compile(r"(?<![a-z])sgemm|f32f32|tf32|<float, float, float\b|(gemm|gemv)\w*_kernel<(int, )?float\b",
                            re.IGNORECASE)
_DONE: dict[str, tuple[Analysis, dict[str, Any]]] = {}


def test_the_list_covers_every_real_trace() -> None:
    real_trace(".")
    present = {p.name for p in REAL_TRACES.iterdir() if p.name.endswith((".json.gz", ".json"))
               and "execution_details" not in p.name}  # the capture's side file is not a trace
    present |= {f"hta/{p.name}" for p in (REAL_TRACES / "hta").iterdir() if p.is_dir()}
    present |= {p.name for p in REAL_TRACES.iterdir() if p.is_dir() and p.name != "hta"}
    assert present == set(TRACES)


def analysed(name: str) -> tuple[Analysis, dict[str, Any]]:
    if name not in _DONE:
        a = analyze([real_trace(name)], jobs=1)
        _DONE[name] = (a, a.to_json())
    return _DONE[name]


@pytest.mark.parametrize("name", TRACES)
def test_every_real_trace_analyses_and_is_classified(name: str) -> None:
    a, doc = analysed(name)
    assert doc["steps"]["count"] >= 1 and doc["coverage"]["kernels_analysed"] > 0
    assert doc["coverage"]["unknown_share"] <= 0.05, doc["coverage"]["top_unknown"][:3]
    # an fp32 / tf32 GEMM (by its name) is never measured as bf16
    k = a.trace.kernels
    names = k["name"].astype(str)
    fp32 = k[names.str.contains(FP32_GEMM_NAME) & names.str.contains("gemm|gemv", case=False)]
    bad = fp32.loc[fp32["cls"].astype(str) == "bf16_gemm", "name"].astype(str).unique()
    assert not len(bad), bad[:3]
    # every kernel's step phase is stated or unknown; unknown-phase steps analysed as a phase are said so
    analysed_phases = set(a.selected["phase"])
    if "unknown" in analysed_phases and doc["steps"]["phase"] in ("decode", "prefill"):
        assert any("of unknown phase" in w for w in doc["warnings"])


def test_prefill_only_sglang_trace_says_it_analysed_prefill() -> None:
    _, doc = analysed(SGLANG_PREFILL)
    assert doc["steps"]["phase"] == "prefill" and doc["run"]["kind"] == "prefill"
    assert any("no decode steps: analysed its 1 prefill step(s)" in w for w in doc["warnings"])
    r = run_cli("analyze", str(real_trace(SGLANG_PREFILL)), "--phase", "prefill", "-q")
    assert r.returncode == 0, r.stderr


def test_vllm_piecewise_graphs_are_one_step_per_forward(tmp_path: Path) -> None:
    a, doc = analysed(VLLM_TP4)
    launches = int(a.trace.runtime["name"].isin(["cudaGraphLaunch"]).sum())
    assert launches > 700  # dozens of piecewise graph replays per forward
    assert doc["steps"]["source"] == "forward_marker" and doc["steps"]["found"] == {"unknown": 11}
    assert doc["steps"]["count"] == 9 and doc["steps"]["excluded_edge"] == 2
    # the steps hold the graph replays: nearly all kernel time is inside a step
    assert doc["coverage"]["kernels_analysed"] > 0.7 * len(a.trace.kernels)
    assert doc["run"]["kind"] is None and "states the phase" in doc["run"]["kind_evidence"]
    # the phase is not invented: asked for prefill, the steps are analysed as such with a note
    r = run_cli("analyze", str(real_trace(VLLM_TP4)), "--phase", "prefill", "-q", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "a.json").read_text())
    assert out["steps"]["phase"] == "prefill" and out["steps"]["analysed"] == {"unknown": 9}
    assert any("9 analysed step(s) are of unknown phase" in w and "not known to be prefill" in w
               for w in out["warnings"])


def test_pytorch_18_resnet_is_six_training_steps() -> None:
    _, doc = analysed(RESNET)
    assert doc["steps"]["source"] == "profiler_step"
    assert sum(doc["steps"]["found"].values()) == 6 and doc["steps"]["count"] == 4
    assert doc["run"]["kind"] == "training" and "Backward" in doc["run"]["kind_evidence"]
    assert doc["classes"]["conv"]["share"] > 0.5 and doc["classes"]["norm"]["share"] > 0.05
    assert not any(f["rule"] for f in doc["findings"])  # no decode advice for a training run
    assert any(w.startswith("a training run (") and "rules" in w for w in doc["warnings"])


def test_dlrm_is_eight_training_ranks() -> None:
    _, doc = analysed(DLRM)
    assert doc["run"]["ranks"] == 8 and len(doc["ranks"]) == 8
    assert doc["run"]["kind"] == "training"
    assert sorted(r["rank"] for r in doc["ranks"]) == list(range(8))


def test_fixtures_hold_no_fp32_gemm_labelled_bf16() -> None:
    n = 0
    for d in sorted(p for p in FIXTURES.iterdir() if any(p.glob("*-TP-*.trace.json.gz"))):
        a = analyze([d], phase="all", jobs=1)
        k = a.trace.kernels
        names = k["name"].astype(str)
        fp32 = names.str.contains(FP32_GEMM_NAME) & names.str.contains("gemm|gemv", case=False)
        assert not (fp32 & (k["cls"].astype(str) == "bf16_gemm")).any(), d.name
        n += 1
    assert n >= 5


def _one_step(doc: dict[str, Any], keep_span: bool, win: tuple[float, float, float, float]) -> None:
    """Only the events of one decode step (CPU events in its CPU window, GPU events in its GPU one),
    with or without its step[...] span."""
    c0, c1, g0, g1 = win
    gpu = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}
    out = []
    for e in doc["traceEvents"]:
        if e.get("ph") == "M":
            out.append(e)
            continue
        if e.get("ph") != "X" or "ts" not in e:
            continue
        name = str(e.get("name", ""))
        if name.startswith(("step[", "scheduler.")) and not keep_span:
            continue
        lo, hi = (g0, g1) if e.get("cat") in gpu else (c0, c1)
        if lo <= e["ts"] <= hi:
            out.append(e)
    doc["traceEvents"] = out


def test_a_capture_with_no_step_marker_is_one_step_with_its_twins_classes(tmp_path: Path) -> None:
    src = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    full = analyze([src], phase="all", jobs=1)
    s = full.steps.iloc[len(full.steps) // 2]
    win = (float(s.cpu_start), float(s.cpu_end), float(s.gpu_start), float(s.gpu_end))
    twins = {}
    for keep in (True, False):
        d = tmp_path / ("marked" if keep else "bare")
        d.mkdir()
        rewrite_trace(src, d / "one-TP-0.trace.json.gz", lambda doc, k=keep: _one_step(doc, k, win))
        twins[keep] = analyze([d], jobs=1)
    marked, bare = twins[True], twins[False]
    assert marked.steps["source"].tolist() == ["step_span"]
    assert bare.steps["source"].tolist() == ["whole_capture"] and bare.steps["phase"].tolist() == ["unknown"]
    assert bare.steps["name"].tolist() == ["whole capture (no step marker)"]
    assert len(bare.kernels) == len(marked.kernels) > 100
    assert bare.kernels["cls"].astype(str).tolist() == marked.kernels["cls"].astype(str).tolist()
    assert bare.to_json()["classes"].keys() == marked.to_json()["classes"].keys()
    assert any("states the phase" in w for w in bare.to_json()["warnings"])
