"""Every public trace under ``shared/real-traces`` (systems other than ours wrote them): each analyses,
almost all of its kernel time is classified, its steps are the ones the run had, the run's kind is
what it was, and no fp32 GEMM is taken for a bf16 one. A capture with no step marker is one step
with the classes of its marked twin."""

from __future__ import annotations

import json
import re
import shutil
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
FP32_GEMM_NAME = re.compile(r"(?<![a-z])sgemm|f32f32|tf32|<float, float, float\b|(?:gemm|gemv)\w*_kernel<(?:int, )?float\b",
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
    # the first forward (an eager prefill: a third of the GPU time) is complete (the recording idled 16 ms,
    # most of a step, before it) and analysed; the last marker holds no kernels and ends with the recording
    assert doc["steps"]["count"] == 10 and doc["steps"]["excluded_edge"] == 1
    assert [(x["idx"], x["why"].split(":")[0]) for x in doc["steps"]["excluded"]] == [(10, "partial")]
    first = a.steps.iloc[0]
    assert first["included"] and first["n_kernels"] > 900 and first["kernel_us"] > 0.3 * a.trace.kernels["dur"].sum()
    # the steps hold the graph replays: every kernel is inside a step
    assert doc["coverage"]["kernels_analysed"] == len(a.trace.kernels)
    assert doc["run"]["kind"] is None and "states the phase" in doc["run"]["kind_evidence"]
    # the phase is not invented: asked for prefill, the steps are analysed as such with a note
    r = run_cli("analyze", str(real_trace(VLLM_TP4)), "--phase", "prefill", "-q", "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    out = json.loads((tmp_path / "a.json").read_text())
    assert out["steps"]["phase"] == "prefill" and out["steps"]["analysed"] == {"unknown": 10}
    assert any("10 analysed step(s) are of unknown phase" in w and "not known to be prefill" in w
               for w in out["warnings"])


def test_pytorch_18_resnet_is_six_training_steps() -> None:
    _, doc = analysed(RESNET)
    assert doc["steps"]["source"] == "profiler_step"
    # the recording starts and stops at the first and last ProfilerStep: both partial, each with why
    assert sum(doc["steps"]["found"].values()) == 6 and doc["steps"]["count"] == 4
    whys = [x["why"] for x in doc["steps"]["excluded"]]
    assert [x["idx"] for x in doc["steps"]["excluded"]] == [0, 5] and "began" in whys[0] and "ended" in whys[1]
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


# ----------------------------------------------------------------------------- every input, every command

def _inputs() -> list[str]:
    """Every file alone (top level and under hta/), every folder (the DLRM set, each hta/ folder), the whole
    hta/ tree's folders; '.' (skipped, or failed under CI) when the traces are absent."""
    if not REAL_TRACES.is_dir():
        return ["."]
    out = [p.name for p in sorted(REAL_TRACES.iterdir()) if p.is_file() and p.name.endswith((".json", ".json.gz"))]
    for d in sorted(p for p in REAL_TRACES.iterdir() if p.is_dir()):
        subs = sorted(s for s in d.iterdir() if s.is_dir())
        out += [f"{d.name}/{s.name}" for s in subs]
        out += [f"{d.name}/{s.name}/{f.name}" for s in subs for f in sorted(s.iterdir()) if f.is_file()]
        if not subs:
            out.append(d.name)
    return out


SGLANG_DECODE = "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"
SGLANG_CAPTURE = "tracelens__inference__sglang_decode__capture_traces__bs_32_rank0.json.gz"
MIXED = "a vLLM inference trace beside a ResNet training trace"


def _clean(r: Any, what: str) -> None:
    """Exit 0, or exit 2 with one line naming what is wrong; never a traceback."""
    assert "Traceback" not in r.stderr + r.stdout, (what, r.stderr[-3000:])
    assert r.returncode in (0, 2), (what, r.returncode, r.stderr[-2000:])
    if r.returncode == 2:
        lines = [x for x in r.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and lines[0].startswith("traceinspect: error: "), (what, r.stderr[-2000:])


def _every_command(path: Path, tmp_path: Path) -> dict[str, int]:
    codes = {}
    for cmd, extra in (("analyze", ["-q", "--json", str(tmp_path / "a.json")]),
                       ("report", ["-o", str(tmp_path / "r.html")]), ("doctor", []), ("classify", [])):
        r = run_cli(cmd, str(path), *extra)
        _clean(r, f"{cmd} {path}")
        codes[cmd] = r.returncode
    return codes


@pytest.mark.parametrize("name", _inputs())
def test_every_input_alone_analyses_or_is_refused_in_one_line(name: str, tmp_path: Path) -> None:
    path = real_trace(name)
    codes = _every_command(path, tmp_path)
    if name.endswith("execution_details.json"):  # a side file, not a trace
        assert set(codes.values()) == {2}
    else:
        assert codes["analyze"] == 0 and codes["report"] == 0 and codes["classify"] == 0, codes


def test_a_decode_with_its_capture_trace_beside_it(tmp_path: Path) -> None:
    """SGLang's layout: the decode trace, and its capture trace under graph_capture_profile/ (never a rank)."""
    d = tmp_path / "set"
    (d / "graph_capture_profile").mkdir(parents=True)
    shutil.copy(real_trace(SGLANG_DECODE), d / SGLANG_DECODE)
    shutil.copy(real_trace(SGLANG_CAPTURE), d / "graph_capture_profile" / SGLANG_CAPTURE)
    codes = _every_command(d, tmp_path)
    assert codes == {"analyze": 0, "report": 0, "doctor": 0, "classify": 0}
    doc = json.loads((tmp_path / "a.json").read_text())
    assert doc["run"]["ranks"] == 1 and doc["source"]["capture_traces"]


def test_unrelated_traces_are_never_ranks(tmp_path: Path) -> None:
    """A directory of unrelated traces (and the same two files given by name) stops in one line naming the
    files and why; --allow-mismatch analyses them together, saying so."""
    d = tmp_path / "mixed"
    d.mkdir()
    for n in (VLLM_TP4, RESNET):
        shutil.copy(real_trace(n), d / n)
    for args in ([str(d)], [str(d / VLLM_TP4), str(d / RESNET)]):
        r = run_cli("analyze", *args, "-q")
        _clean(r, MIXED)
        assert r.returncode == 2 and "not the ranks of one run" in r.stderr
        for why in ("a training run beside an inference one", "different captures", "different workloads"):
            assert why in r.stderr
        assert VLLM_TP4 in r.stderr and RESNET in r.stderr
    for cmd in ("doctor", "classify"):
        r = run_cli(cmd, str(d))
        assert r.returncode == 2 and "not the ranks of one run" in r.stdout + r.stderr
    out = tmp_path / "a.json"
    r = run_cli("analyze", str(d), "-q", "--allow-mismatch", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert any("as --allow-mismatch asks" in w for w in json.loads(out.read_text())["warnings"])
    # the whole folder of field traces: never analysed as ranks
    r = run_cli("analyze", str(real_trace(".")), "-q")
    _clean(r, "the real-traces folder")
    assert r.returncode == 2 and "not the ranks of one run" in r.stderr


def test_dlrm_straggler_is_shown_where_users_look(tmp_path: Path) -> None:
    """The training job's straggler (the collectives analysis names it) is in the terminal summary, the
    Markdown and the HTML headline, with no decode rule applied."""
    md, html = tmp_path / "s.md", tmp_path / "r.html"
    r = run_cli("analyze", str(real_trace(DLRM)), "--markdown", str(md), "--html", str(html),
                "--json", str(tmp_path / "a.json"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "a.json").read_text())
    st = doc["collectives"]["straggler"]
    assert st["rank"] == 7 and st["late_share"] == pytest.approx(0.625)
    line = "Straggler: R7 arrives last at 62.5% of the collectives"
    assert line in r.stdout and line in md.read_text() and line in html.read_text()
    assert not doc["findings"] and doc["run"]["kind"] == "training"
