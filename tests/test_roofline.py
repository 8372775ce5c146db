"""The roofline: floors from shapes and the GPU table, what bounds each kernel, and every what-if held to
the floors. On the public SGLang decode (MI300X, CUDA-graph replay) with its capture trace, the GEMMs are
memory-bound at the share of bandwidth computed here from their shapes, and small-m-gemm saves no more
than their time above the floor."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FIXTURES, fixture_dir, real_trace
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from traceinspect.measure.roofline import floors, load_roofline
from traceinspect.measure.specs import load_gpu_specs, match_gpu
from traceinspect.pipeline import Options, analyze
from traceinspect.whatif import parse_edit, replayer
from traceinspect.whatif.fixes import saving_parts

SGLANG_DECODE = "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"
SGLANG_CAPTURE = "tracelens__inference__sglang_decode__capture_traces__bs_32_rank0.json.gz"
_DONE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def sglang(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any]]:
    """The decode trace as SGLang lays a trace set out: the rank file, its capture trace beside it."""
    d = tmp_path_factory.mktemp("sglang-decode")
    shutil.copy(real_trace(SGLANG_DECODE), d / "qwen3-8b-TP-0.trace.json.gz")
    (d / "graph_capture_profile").mkdir()
    shutil.copy(real_trace(SGLANG_CAPTURE), d / "graph_capture_profile" / "cuda_graph_capture-CudaGraphRunner-TP-0.json.gz")
    a = analyze([str(d)], Options(use_cache=False, jobs=1))
    return a, a.to_json()


def test_sglang_decode_gemms_are_memory_bound_at_their_bandwidth_share(sglang: tuple[Any, dict[str, Any]]) -> None:
    _, doc = sglang
    bw = match_gpu("AMD Instinct MI300X", "9.4").mem_bw_gbps
    assert doc["gpu"]["name"] == "MI300X" and bw == 5300
    rows = [r for r in doc["gemm"] if r["m"] is not None]
    assert len(rows) == 5 and all(r["dtype"] == "bf16" and r["m"] == 32 for r in rows)
    for r in rows:
        # bytes from the shapes: activations [M, K], weights [K, N], output [M, N], 2 bytes each
        nbytes = r["calls"] * 2 * (r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"])
        want = 100 * nbytes / (r["us"] * 1e-6 * bw * 1e9)
        assert r["bound"] == "memory"
        assert abs(r["pct_roofline"] - want) <= 5, (r, want)
        assert 30 <= r["pct_roofline"] <= 65  # what TraceLens reports: 39-60% of roofline
        assert r["pct_bw"] == pytest.approx(r["pct_roofline"], abs=0.01)


def test_sglang_decode_small_m_gemm_saves_at_most_the_time_above_the_floor(sglang: tuple[Any, dict[str, Any]]) -> None:
    _, doc = sglang
    bw = 5300e9
    per = doc["steps"]["count"] * len(doc["ranks"])
    headroom = sum(r["us"] - r["calls"] * 2 * (r["m"] * r["k"] + r["k"] * r["n"] + r["m"] * r["n"]) / bw * 1e6
                   for r in doc["gemm"] if r["m"] is not None) / per
    f = next(f for f in doc["findings"] if f["rule"] == "small-m-gemm")
    assert 0 < f["est_saving_us_per_step"] <= headroom + 1.0
    ev = f["evidence"]
    assert ev["bound"] == "memory" and ev["pct_roofline"] == pytest.approx(49.9, abs=1)
    assert "memory-bound" in f["message"] and "per token" in f["message"] and "of the memory bandwidth" in f["message"]
    # the weights: ~15 GB per step, ~470 MB per token (M = 32)
    assert 14e9 < ev["weight_bytes_per_step"] < 16e9
    assert ev["weight_bytes_per_token"] == pytest.approx(ev["weight_bytes_per_step"] / 32, rel=1e-6)
    at = next(x for x in f["fixes"] if x["variant"] == "small-m-gemm:at-roofline")
    assert at["saving_us_per_step"] <= headroom + 1.0
    # a step saving, not a per-token one, and said so
    assert "per step" in f["message"] or "per step" in str(f.get("est_saving_us_per_step"))


def test_sglang_decode_attention_rows_say_why_there_is_no_floor(sglang: tuple[Any, dict[str, Any]]) -> None:
    _, doc = sglang
    paged = [r for r in doc["attention"] if r["op"] and "paged_attention" in r["op"]]
    assert paged and all(r["floor_us"] is None and r["pct_roofline"] is None for r in paged)
    assert "not recorded" in paged[0]["reason"]


def _fixtures_with_shapes() -> list[str]:
    out = []
    for d in sorted(p for p in FIXTURES.iterdir() if (p / "manifest.json").exists() or any(p.glob("*TP-*.json.gz"))):
        if not any(d.glob("*TP-*.trace.json.gz")):
            continue
        graph = "graph" in d.name
        if graph and not any(d.glob("graph_capture_profile/*.json*")):
            continue  # replayed kernels without a capture trace have no shapes
        out.append(d.name)
    return out


FIXTURES_WITH_SHAPES = _fixtures_with_shapes()


def _analysed(name: str) -> Any:
    if name not in _DONE:
        _DONE[name] = analyze([str(fixture_dir(name))], Options(use_cache=False, jobs=1))
    return _DONE[name]


@pytest.mark.parametrize("name", FIXTURES_WITH_SHAPES)
def test_attention_rows_with_bandwidth_and_roofline_on_every_fixture(name: str) -> None:
    doc = _analysed(name).to_json()
    rows = [r for r in doc["attention"] if r["floor_us"] is not None]
    assert rows, doc["attention"]
    for r in rows:
        assert r["gbps"] > 0 and 0 < r["pct_bw"] <= 100 and 0 < r["pct_roofline"] <= 100
        assert r["bound"] in ("memory", "compute", "latency")
        # FLOPs: 2 B H ctx (D + Dv), the QK^T and PV products
        assert r["gflop"] == pytest.approx(r["calls"] * 2 * r["batch"] * r["heads"] * r["ctx"] * (r["d"] + r["dv"])
                                           / 1e9, rel=1e-3)


@pytest.mark.parametrize("name,phase,family", [
    ("tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", "auto", "flash_fwd_kernel"),
    ("tracelens__inference__sglang_prefilldecode__sglang_Qwen3-8B_prefilldecode.json.gz", "prefill", "FmhaBatchPrefill"),
])
def test_attention_roofline_on_real_traces_with_shapes(name: str, phase: str, family: str) -> None:
    doc = analyze([str(real_trace(name))], Options(use_cache=False, jobs=1, phase=phase)).to_json()
    rows = [r for r in doc["attention"] if family in r["family"]]
    assert rows and all(r["pct_roofline"] is not None and r["gbps"] > 0 for r in rows)
    if "h100" in name:  # TraceLens: SDPA at 90 TFLOP/s
        assert rows[0]["tflops"] == pytest.approx(90, abs=2)


def test_floors_and_bounds() -> None:
    st_ = load_roofline()
    out = floors([2e12, None, 1e6], [1e9, 8e9, 1e3], [4000.0, 5000.0, 3.0], [1000.0, np.nan, 1000.0], 4000.0,
                 [True, False, True])
    # 2 TFLOP at 1000 TFLOP/s = 2000 us, 1 GB at 4 TB/s = 250 us: compute-bound, floor 2000 us
    assert out["floor_us"][0] == pytest.approx(2000) and out["bound"][0] == "compute"
    assert out["pct_roofline"][0] == pytest.approx(50)
    # a copy: 8 GB at 4 TB/s = 2000 us, memory-bound
    assert out["floor_us"][1] == pytest.approx(2000) and out["bound"][1] == "memory"
    # far below a microsecond at both peaks: latency-bound, its floor the shortest kernel time
    assert out["bound"][2] == "latency" and out["floor_us"][2] == pytest.approx(st_.kernel_min_us)
    # no peak for the dtype: the memory term still bounds it, the bound is not decided
    out = floors([2e12], [1e9], [4000.0], [np.nan], 4000.0, [True])
    assert out["floor_us"][0] == pytest.approx(250) and out["bound"][0] is None
    # unknown FLOPs of a GEMM: no floor at all
    out = floors([None], [1e9], [4000.0], [1000.0], 4000.0, [True])
    assert np.isnan(out["floor_us"][0])


def test_gpu_table_has_sources_and_the_field_gpus() -> None:
    specs = {s.name: s for s in load_gpu_specs()}
    for s in specs.values():
        assert s.source.strip(), s.name
    for device, cc, name in [("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0", "RTX PRO 6000 Blackwell"),
                             ("NVIDIA GB10", "12.1", "GB10"), ("NVIDIA B300 SXM6 AC", "10.3", "B300"),
                             ("AMD Instinct MI300X", "9.4", "MI300X"), ("NVIDIA B200", "10.0", "B200"),
                             ("NVIDIA H100 80GB HBM3", "9.0", "H100 SXM"), ("Tesla V100-SXM2-32GB", "7.0", "V100 SXM2")]:
        s = match_gpu(device, cc)
        assert s is not None and s.name == name and s.mem_bw_gbps, device


def test_launch_bound_saving_beyond_the_idle_says_where_the_rest_comes_from() -> None:
    doc = _analysed("moe-small-m-eager").to_json()
    f = next(f for f in doc["findings"] if f["rule"] == "launch-bound")
    assert f["est_saving_us_per_step"] > f["evidence"]["idle_us_per_step"]
    src = f["evidence"]["saving_from"]
    assert "is more than the" in f["message"] and "waiting for it" in f["message"]
    assert src["others_collective_us"] > 0
    assert f["est_saving_us_per_step"] <= f["evidence"]["saving_bound_us_per_step"] + 1.0


def test_to_roofline_is_undecided_where_shapes_are_unknown() -> None:
    a = _analysed("tp1-l6-full-graph")
    rp = replayer(a)
    # top-k has no byte model: no floor, so no number
    p = rp.predict([parse_edit("to-roofline name~=gatherTopK 100")])
    assert not p.decided and p.predicted_step_us is None and "no roofline floor" in p.undecided[0]
    # the KV cast has one: decided, and no faster than its floor
    p = rp.predict([parse_edit("to-roofline class=kv_cast 100")])
    assert p.decided and p.saving_us is not None and p.saving_us > 0


_EDIT = st.one_of(
    st.tuples(st.just("scale"), st.sampled_from(["bf16_gemm", "moe_gemm", "kv_cast", "elementwise", "memcpy"]),
              st.sampled_from([0.0, 0.1, 0.5])),
    st.tuples(st.just("trim"), st.sampled_from(["bf16_gemm", "moe_gemm", "kv_cast", "fp8_gemm"]),
              st.sampled_from([50.0, 500.0, 5000.0])),
    st.tuples(st.just("gemm-m"), st.sampled_from(["bf16_gemm", "moe_gemm"]), st.sampled_from([0.25, 0.5, 2.0, 8.0])),
    st.tuples(st.just("to-roofline"), st.sampled_from(["bf16_gemm", "fp8_gemm", "kv_cast"]),
              st.sampled_from([10.0, 80.0, 100.0])),
    st.tuples(st.just("host-gaps"), st.just(""), st.sampled_from([0.0, 5.0])),
)


@settings(derandomize=True, max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(name=st.sampled_from(FIXTURES_WITH_SHAPES), edits=st.lists(_EDIT, min_size=1, max_size=3))
def test_no_replayed_kernel_below_its_floor_and_no_saving_above_its_bound(name: str,
                                                                          edits: list[tuple[str, str, float]]) -> None:
    a = _analysed(name)
    rp = replayer(a)
    parsed = [parse_edit(f"{k} {v:g}" if k == "host-gaps" else f"{k} class={c} {v:g}") for k, c, v in edits]
    p = rp.predict(parsed)
    coll = rp.model.g_inst >= 0
    fl = p.floors
    assert fl is not None and p.params is not None
    known = np.isfinite(fl) & ~coll
    assert known.any()
    assert (p.params.dur[known] >= fl[known] - 1e-6).all()
    if p.decided:
        parts = saving_parts(rp, p)
        assert parts is not None and p.saving_us is not None
        assert p.saving_us <= parts["bound_us"] + 0.5, (edits, p.saving_us, parts)
    for f in a.findings:
        b = f.evidence.get("saving_bound_us_per_step")
        if b is not None and f.est_saving_us_per_step is not None:
            assert f.est_saving_us_per_step <= b + 0.5, f.rule


def test_fixture_list_is_not_empty() -> None:
    assert len(FIXTURES_WITH_SHAPES) >= 10 and Path(FIXTURES).is_dir()


def test_trim_and_scale_stop_at_the_floor() -> None:
    a = _analysed("tp1-l6-full-graph")
    rp = replayer(a)
    m = rp.model
    sel = np.isin(m.g_cls, ["kv_cast"])
    steps = len(m.pos) * len(m.ranks)
    base = float(rp.base_params.dur[sel].sum()) / steps
    p = rp.predict([parse_edit("trim class=kv_cast 100")])  # a little: taken as asked
    assert float(p.params.dur[sel].sum()) / steps == pytest.approx(base - 100, abs=0.5)
    p = rp.predict([parse_edit("scale class=kv_cast 0")])  # all of it: held at the floor, never removed
    assert (p.params.dur[sel] > 0).all() and np.allclose(p.params.dur[sel], p.floors[sel])
    assert any("held at their roofline floor" in n for n in p.notes)
