"""GEMM / memory efficiency: FLOPs and bytes from recorded shapes, % of the right dtype's peak, per-expert
M of MoE GEMMs, shape recovery for CUDA-graph replays from the capture trace, and the GPU spec table."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from conftest import copy_set, fixture_dir, graph_set_missing_one_launch, manifest

from traceinspect.errors import ConfigError
from traceinspect.measure.gemm import ShapeCache, measure_efficiency
from traceinspect.measure.specs import load_gpu_specs, match_gpu, resolve_gpu
from traceinspect.model import DeviceInfo
from traceinspect.pipeline import Options, analyze

_CACHE: dict[str, object] = {}


def _analysis(variant: str):
    if variant not in _CACHE:
        _CACHE[variant] = analyze(fixture_dir(variant), Options(command="test"))
    return _CACHE[variant]


def _spec(name: str):
    return next(s for s in load_gpu_specs() if s.name == name)


def _dims(a, kernel_row) -> tuple[list, list]:
    """The recorded Input Dims / Input type of the op that launched a kernel, read independently."""
    op = a.trace.cpu_ops.loc[a.kernels.loc[kernel_row, "op_idx"]]
    return json.loads(op["input_dims"]), json.loads(op["input_types"])


# ----------------------------------------------------------------------------- spec table


@pytest.mark.parametrize(("device", "cc", "expected"), [
    ("NVIDIA H200", "9.0", "H200"),
    ("NVIDIA H200 NVL", "9.0", "H200 NVL"),
    ("NVIDIA H100 80GB HBM3", "9.0", "H100 SXM"),
    ("NVIDIA H100 PCIe", "9.0", "H100 PCIe"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "12.0", "RTX PRO 6000 Blackwell Server Edition"),
    ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "12.0", "RTX PRO 6000 Blackwell"),
    ("NVIDIA B200", "10.0", "B200"),
    ("NVIDIA GB200", "10.0", "GB200"),
    ("NVIDIA GeForce RTX 5090", "12.0", "RTX 5090"),
    ("NVIDIA A100-SXM4-80GB", "8.0", "A100 SXM4 80GB"),
    ("NVIDIA A100 80GB PCIe", "8.0", "A100 80GB PCIe"),
    ("NVIDIA A100-SXM4-40GB", "8.0", "A100 40GB"),
    ("AMD Instinct MI300X", "9.4", "MI300X"),
])
def test_spec_matching(device: str, cc: str, expected: str) -> None:
    spec = match_gpu(device, cc)
    assert spec is not None and spec.name == expected


def test_spec_table_is_complete_and_dense() -> None:
    specs = {s.name: s for s in load_gpu_specs()}
    for name in ("H100 SXM", "H200", "B200", "GB200", "RTX PRO 6000 Blackwell Server Edition", "RTX 5090",
                 "A100 SXM4 80GB", "MI300X"):
        s = specs[name]
        assert s.mem_bw_gbps and s.source and {"bf16", "tf32", "fp32"} <= set(s.peak_tflops)
    # dense figures: half of the datasheets' with-sparsity numbers
    assert specs["H200"].peak("fp8") == pytest.approx(3958 / 2)
    assert specs["H200"].peak("bf16") == pytest.approx(1979 / 2)
    assert specs["B200"].peak("fp4") == pytest.approx(18000 / 2)
    assert specs["MI300X"].peak("fp8") == pytest.approx(2614.9)
    # no fp8/fp4 tensor path on Ampere: unknown, not zero
    assert specs["A100 SXM4 80GB"].peak("fp8") is None
    for s in specs.values():  # the Blackwell parts have fp4, Hopper/CDNA3 do not
        assert ("fp4" in s.peak_tflops) == (s.compute_capability in ("10.0", "10.3", "12.0", "12.1"))
    # every entry names its source; a figure no source gave is left out, never zero
    for s in specs.values():
        assert s.source and all(v > 0 for v in s.peak_tflops.values()), s.name
    for name in ("H800", "H20", "GH200", "GB300", "B300", "L40S", "L4", "A10", "T4", "V100 SXM2", "RTX 4090",
                 "RTX 2080 Ti", "MI355X", "MI300X"):
        assert name in specs, name
    assert specs["B300"].compute_capability == "10.3" and specs["L40S"].peak("fp8") == pytest.approx(1466 / 2)
    assert specs["H20"].peak("fp8") is None  # no source gives it
    assert match_gpu("Tesla V100-SXM2-32GB", "7.0").name == "V100 SXM2"
    assert match_gpu("NVIDIA H800", "9.0").name == "H800" and match_gpu("NVIDIA H20", "9.0").name == "H20"


def test_unknown_and_ambiguous_gpu() -> None:
    spec, why = resolve_gpu("NVIDIA Quadro K600", "3.0")
    assert spec is None and "not in the GPU table" in why and "--gpu" in why
    spec, why = resolve_gpu("NVIDIA RTX 4000 Ada Generation", "8.9")  # L4, L40S, RTX 4090 share 8.9
    assert spec is None and "L40S" in why and "L4" in why
    spec, why = resolve_gpu("Some Hopper", "9.0")  # H100 and H200 share 9.0: no guess
    assert spec is None and "H200" in why and "H100 SXM" in why
    spec, why = resolve_gpu(None, None)
    assert spec is None and "deviceProperties" in why


def test_spec_override(tmp_path: Path) -> None:
    spec, why = resolve_gpu("NVIDIA H200", "9.0", override="b200")
    assert spec is not None and spec.name == "B200" and "--gpu" in why
    f = tmp_path / "mygpu.yaml"
    f.write_text("gpus:\n  - name: Lab GPU\n    match: ['nothing']\n    peak_tflops: {bf16: 100, fp8: 200}\n"
                 "    mem_bw_gbps: 1000\n    source: test\n")
    spec, _ = resolve_gpu("NVIDIA H200", "9.0", override=str(f))
    assert spec is not None and spec.name == "Lab GPU" and spec.peak("bf16") == 100
    with pytest.raises(ConfigError):
        resolve_gpu("NVIDIA H200", "9.0", override="no-such-gpu")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus:\n  - name: X\n    peak_tflops: {bf17: 1}\n")
    with pytest.raises(ConfigError, match="bf17"):
        load_gpu_specs(bad)


# ----------------------------------------------------------------------------- shape models


def _shape(name: str, dims, types, concrete=None):
    shapes, why = ShapeCache().get(name, json.dumps(dims).encode(), json.dumps(types).encode(),
                                   json.dumps(concrete).encode() if concrete is not None else None)
    return shapes, why


def test_shape_models() -> None:
    bf = "c10::BFloat16"
    (s,), _ = _shape("aten::addmm", [[1024], [16, 512], [512, 1024], [], []], [bf, bf, bf, "Scalar", "Scalar"])
    assert (s.m, s.n, s.k, s.flops) == (16, 1024, 512, 2 * 16 * 1024 * 512)
    assert s.bytes == (16 * 512 + 512 * 1024 + 16 * 1024 + 1024) * 2
    (s,), _ = _shape("aten::bmm", [[8, 16, 64], [8, 64, 32]], ["c10::Half"] * 2)
    assert (s.batch, s.m, s.n, s.k, s.dtype, s.flops) == (8, 16, 32, 64, "fp16", 2 * 8 * 16 * 32 * 64)
    (s,), _ = _shape("aten::matmul", [[4, 1, 16, 64], [3, 64, 32]], [bf, bf])  # broadcast batch 4 x 3
    assert (s.batch, s.m, s.n, s.k) == (12, 16, 32, 64)
    (s,), _ = _shape("aten::linear", [[2, 16, 64], [32, 64], [32]], [bf, bf, bf])
    assert (s.m, s.n, s.k) == (32, 32, 64)
    (s,), _ = _shape("aten::mm", [[16, 32], [32, 8]], ["c10::Float4_e2m1fn_x2"] * 2)  # packed pairs
    assert (s.k, s.dtype, s.flops) == (64, "fp4", 2 * 16 * 8 * 64)
    (s,), _ = _shape("aten::_scaled_mm", [[16, 1024], [1024, 2048], [], [], [], [], [], []],
                     ["c10::Float8_e4m3fn"] * 2 + ["float"] * 2 + ["", "", "Scalar", "Scalar"],
                     ["", "", "", "", "", "", "15", "False"])
    assert s.dtype == "fp8" and s.bytes == 16 * 1024 + 1024 * 2048 + 16 * 2048 * 2 + 2 * 4
    (s,), _ = _shape("aten::copy_", [[10, 20], [10, 20], []], [bf, "c10::Float8_e4m3fn", "Scalar"])
    assert s.kind == "memory" and s.dtype == "fp8->bf16" and s.bytes == 200 * (1 + 2)
    shapes, why = _shape("aten::mm", [[16, 32], [31, 8]], [bf, bf])
    assert shapes == () and "inner dimensions differ" in why


def test_grouped_and_fused_moe_models() -> None:
    bf = "c10::BFloat16"
    (s,), _ = _shape("aten::_grouped_mm", [[96, 64], [4, 64, 32], [4]], [bf, bf, "int"])
    assert (s.groups, s.m, s.n, s.k, s.flops) == (4, 96, 32, 64, 2 * 96 * 32 * 64)
    # SGLang fused MoE: [T,H], [E,2I,H], [E,H,I], [T,k], [T,k]: two GEMMs, mean per-expert M = T*k/E
    up, down = _shape("sglang::inplace_fused_experts", [[16, 2048], [64, 1024, 2048], [64, 2048, 512], [16, 8],
                                                        [16, 8]], [bf] * 3 + ["float", "int"])[0]
    assert (up.m / up.groups, up.n, up.k) == (16 * 8 / 64, 1024, 2048)
    assert (down.n, down.k, down.flops) == (2048, 512, 2 * 128 * 2048 * 512)
    assert up.note == "shapes (mean over experts)"
    # a different layout under a MoE-like name is not forced into the model
    shapes, why = _shape("tinymoe::fused_experts", [[128, 2048], [16, 2048, 1024], [16, 512, 2048], []],
                         [bf] * 3 + ["Scalar"])
    assert shapes == () and "layout" in why


@pytest.mark.parametrize("variant", ["moe-small-m-eager", "kv-full-cast-eager"])
def test_flops_are_2mnk_from_recorded_shapes(variant: str) -> None:
    a = _analysis(variant)
    man = manifest(variant)
    calls = a.efficiency.calls
    mm = calls[calls["op_name"].isin(["aten::mm", "aten::_scaled_mm"]) & (calls["shape_source"] == "shapes")]
    n_steps = a.steps_per_rank() * a.n_ranks
    # per step: 2 x experts expert GEMMs + q/kv-a, q-b, router per layer, lm-head; one _scaled_mm per layer
    assert (mm["op_name"] == "aten::_scaled_mm").sum() == man["layers"] * n_steps
    assert (mm["op_name"] == "aten::mm").sum() == (man["planted_kernels"]["expert_gemm"]["per_step"]
                                                   + 3 * man["layers"] + 1) * n_steps
    for r in mm.itertuples():
        dims, types = _dims(a, r.kernel)
        m, k = dims[0]
        k2, n = dims[1]
        assert k == k2 and (r.m, r.n, r.k) == (m, n, k)
        assert r.flops == 2 * m * n * k
        assert r.dtype == ("fp8" if types[0].startswith("c10::Float8") else "bf16")
        assert r.tflops == pytest.approx(r.flops / r.us / 1e6)


def test_pct_of_peak_uses_the_dtype_peak() -> None:
    a = _analysis("moe-small-m-eager")
    calls = a.efficiency.calls
    h200 = _spec("H200")
    assert a.efficiency.spec is not None and a.efficiency.spec.name == "H200"
    fp8 = calls[calls["op_name"] == "aten::_scaled_mm"]
    bf16 = calls[(calls["op_name"] == "aten::mm") & calls["dtype"].eq("bf16")]
    assert len(fp8) and len(bf16)
    assert (fp8["dtype"] == "fp8").all()
    for df, peak in ((fp8, h200.peak("fp8")), (bf16, h200.peak("bf16"))):
        for r in df.itertuples():
            assert r.pct_peak == pytest.approx(100 * r.tflops / peak)
    doc = a.efficiency.to_json()
    for row in doc["gemm"]:
        if row["tflops"] is not None and row["dtype"] in ("fp8", "bf16"):
            assert row["pct_peak"] == pytest.approx(100 * row["tflops"] / h200.peak(row["dtype"]), abs=0.02)


def test_per_expert_m_small_and_large() -> None:
    small = _analysis("moe-small-m-eager").efficiency.moe["per_expert_m"]
    want = manifest("moe-small-m-eager")["per_expert_m"]
    assert small["source"] == "shapes"
    assert abs(small["value"] - want) <= 1 and abs(small["min"] - want) <= 1 and abs(small["max"] - want) <= 1
    large = _analysis("moe-large-m-eager").efficiency.moe["per_expert_m"]
    assert large["source"] == "shapes" and large["value"] >= 128
    assert abs(large["value"] - manifest("moe-large-m-eager")["per_expert_m"]) <= 1


def test_json_sections() -> None:
    a = _analysis("kv-full-cast-eager")
    doc = a.to_json()
    json.dumps(doc, allow_nan=False)
    assert {"gemm", "memory_bound", "moe", "gpu"} <= set(doc)
    row = doc["gemm"][0]
    assert {"m", "n", "k", "dtype", "calls", "us", "tflops", "pct_peak", "shape_source"} <= set(row)
    assert doc["gpu"]["name"] == "H200" and doc["gpu"]["mem_bw_gbps"] == 4800
    # the planted full-pool KV cast: bytes = elements x (1 B fp8 read + 2 B bf16 written) per call
    kv = manifest("kv-full-cast-eager")["planted_kernels"]["kv_cast"]
    fam = [r for r in doc["memory_bound"] if r["cls"] == "kv_cast"]
    assert len(fam) == 1 and "fp8->bf16" in fam[0]["dtypes"]
    assert fam[0]["bytes"] / fam[0]["calls"] == kv["bytes_read_per_kernel"] + kv["bytes_written_per_kernel"]
    assert fam[0]["gbps"] == pytest.approx(fam[0]["bytes"] / fam[0]["us"] / 1e3, rel=1e-3)
    assert fam[0]["pct_bw"] == pytest.approx(100 * fam[0]["gbps"] / 4800, abs=0.02)


def test_unknown_gpu_gives_null_percentages_with_reason() -> None:
    a = analyze(fixture_dir("moe-small-m-eager"), Options(command="test"))
    for r in a.trace.ranks:
        r.devices = [DeviceInfo(name="Mystery Accelerator", compute_capability="7.5")]
    eff = measure_efficiency(a)
    doc = eff.to_json()
    assert doc["gpu"]["name"] is None and "Mystery Accelerator" in doc["gpu"]["reason"]
    assert all(r["pct_peak"] is None for r in doc["gemm"]) and all(r["pct_bw"] is None for r in doc["memory_bound"])
    assert any(r["tflops"] for r in doc["gemm"])  # achieved rates stay known


def test_gpu_override_file(tmp_path: Path) -> None:
    f = tmp_path / "gpu.yaml"
    f.write_text("gpus:\n  - name: Half H200\n    peak_tflops: {bf16: 400, fp8: 800}\n    mem_bw_gbps: 2000\n")
    a = analyze(fixture_dir("moe-small-m-eager"), Options(command="test", gpu=str(f)))
    calls = a.efficiency.calls
    bf = calls[calls["dtype"].eq("bf16") & calls["tflops"].notna()]
    assert a.efficiency.spec.name == "Half H200"
    assert bf["pct_peak"].to_numpy() == pytest.approx(100 * bf["tflops"].to_numpy() / 400)


# ----------------------------------------------------------------------------- CUDA-graph replays


def _gemm_sequence(a) -> list[tuple]:
    """(op, M, N, K, batch, dtype) of the GEMM calls of one analysed step of rank 0, in launch order."""
    c = a.efficiency.calls
    c = c[(c["kind"] == "gemm") & (c["rank"] == 0)]
    c = c.assign(ts=a.kernels.loc[c["kernel"], "ts"].to_numpy()).sort_values("ts")
    step = sorted(c["step"].unique())[1]
    c = c[c["step"] == step]
    return [(o, int(m), int(n), int(k), int(b), d) for o, m, n, k, b, d in
            c[["op_name", "m", "n", "k", "batch", "dtype"]].itertuples(index=False)]


@pytest.mark.parametrize(("graph", "eager"), [("kv-full-cast-graph", "kv-full-cast-eager"),
                                              ("kv-gather-cast-graph", "kv-gather-cast-eager")])
def test_graph_shapes_recovered_from_capture_trace(graph: str, eager: str) -> None:
    a = _analysis(graph)
    calls = a.efficiency.calls
    rep = calls[a.kernels.loc[calls["kernel"], "graph_replay"].to_numpy() & (calls["kind"] == "gemm")]
    assert len(rep) and (rep["shape_source"] == "graph_capture").all()
    seq = _gemm_sequence(a)
    assert len(seq) > 100
    assert seq == _gemm_sequence(_analysis(eager))  # same M, N, K as the eager twin, position by position
    pem = a.efficiency.moe["per_expert_m"]
    assert pem["source"] == "graph_capture" and abs(pem["value"] - manifest(graph)["per_expert_m"]) <= 1


def test_graph_shapes_unknown_without_capture_trace(tmp_path: Path) -> None:
    src = fixture_dir("kv-full-cast-graph")
    d = copy_set(src, tmp_path / "set")  # rank files and server_info, not graph_capture_profile/
    a = analyze(d, Options(command="test"))
    assert not a.trace.capture_traces
    calls = a.efficiency.calls
    rep = calls[a.kernels.loc[calls["kernel"], "graph_replay"].to_numpy() & (calls["kind"] == "gemm")]
    assert len(rep) and (rep["shape_source"] == "unknown").all()
    assert rep["flops"].isna().all() and rep["tflops"].isna().all()
    assert rep["reason"].str.contains("no graph-capture trace").all()
    doc = a.efficiency.to_json()
    unknown = [r for r in doc["gemm"] if r["shape_source"] == "unknown"]
    assert unknown and all(r["m"] is None and r["tflops"] is None and r["reason"] for r in unknown)
    # per-expert M falls back to tokens x top-k / experts from the server metadata, and says so
    pem = doc["moe"]["per_expert_m"]
    man = manifest("kv-full-cast-graph")
    assert pem["source"] == "server_metadata"
    assert pem["value"] == man["batch"] * man["topk"] / man["experts"]
    # without the metadata either, it is not decided
    si = json.loads((d / "server_info.json").read_text())
    si.pop("model_info")
    (d / "server_info.json").write_text(json.dumps(si))
    pem = analyze(d, Options(command="test")).efficiency.moe["per_expert_m"]
    assert pem["value"] is None and pem["source"] == "unknown" and "could not be decided" in pem["reason"]


def test_graph_capture_mismatch_is_reported(tmp_path: Path) -> None:
    d = graph_set_missing_one_launch(tmp_path)
    a = analyze(d, Options(command="test"))
    calls = a.efficiency.calls
    rep = calls[a.kernels.loc[calls["kernel"], "graph_replay"].to_numpy() & (calls["kind"] == "gemm")]
    r0, r1 = rep[rep["rank"] == 0], rep[rep["rank"] == 1]
    assert (r0["shape_source"] == "unknown").all() and r0["flops"].isna().all()
    assert r0["reason"].str.contains("not matched to the capture trace").all()
    assert (r1["shape_source"] == "graph_capture").all()  # the intact rank keeps its shapes
    assert not any(isinstance(x, float) and math.isnan(x) for x in r0["m"])  # null, not NaN-as-number


# ----------------------------------------------------------------------------- SGLang fused MoE op


def _fused_moe_trace(path: Path, rank: int, steps: int = 4, kernels: tuple[str, ...] = (
        "moe_align_block_size_kernel", "fused_moe_kernel", "act_and_mul_kernel", "fused_moe_kernel",
        "moe_sum_reduce_kernel")) -> None:
    """A small Kineto trace in SGLang's shape: per step one ``sglang::inplace_fused_experts`` op with
    recorded shapes (T=16 tokens, H=2048, E=64 experts, 2I=1024, top-8) launching the fused-MoE kernels."""
    ev: list[dict] = []
    t, corr, ext = 1000.0, 1, 1
    dims = [[16, 2048], [64, 1024, 2048], [64, 2048, 512], [16, 8], [16, 8]]
    types = ["c10::BFloat16"] * 3 + ["float", "int"]
    for _ in range(steps):
        ev.append({"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=16]", "ts": t, "dur": 400.0,
                   "pid": 1, "tid": 1})
        ev.append({"ph": "X", "cat": "cpu_op", "name": "sglang::inplace_fused_experts", "ts": t + 10, "dur": 300.0,
                   "pid": 1, "tid": 1, "args": {"External id": ext, "Input Dims": dims, "Input type": types,
                                                "Concrete Inputs": [""] * 5}})
        for j, name in enumerate(kernels):
            lt = t + 20 + 40 * j
            ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": lt, "dur": 5.0,
                       "pid": 1, "tid": 1, "args": {"correlation": corr, "External id": ext}})
            ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": lt + 100, "dur": 10.0 + j, "pid": 0,
                       "tid": 7, "args": {"correlation": corr, "External id": ext, "device": 0, "stream": 7,
                                          "grid": [1, 1, 1], "block": [128, 1, 1]}})
            corr += 1
        ext += 1
        t += 1000.0
    doc = {"traceEvents": ev, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "computeMajor": 9,
                                                    "computeMinor": 0}],
           "distributedInfo": {"rank": rank, "world_size": 1}}
    with gzip.open(path, "wt") as f:
        json.dump(doc, f)


def test_sglang_fused_moe_op(tmp_path: Path) -> None:
    _fused_moe_trace(tmp_path / "moe-TP-0.trace.json.gz", 0)
    a = analyze(tmp_path, Options(command="test"))
    calls = a.efficiency.calls
    g = calls[calls["kind"] == "gemm"]
    n_steps = a.steps_per_rank()
    assert n_steps == 2 and len(g) == 2 * n_steps and g["moe"].all()
    assert (g["name"] == "fused_moe_kernel").all() and (g["shape_source"] == "shapes").all()
    up = g.sort_values("kernel").iloc[0]
    down = g.sort_values("kernel").iloc[1]
    assert (up["m"], up["n"], up["k"], up["groups"]) == (128, 1024, 2048, 64)  # T*k rows, 2I, H
    assert (down["n"], down["k"]) == (2048, 512)
    assert up["flops"] == 2 * 128 * 1024 * 2048 and down["flops"] == 2 * 128 * 2048 * 512
    assert up["us"] == 11.0 and down["us"] == 13.0  # each GEMM kernel its own time, not the op's
    pem = a.efficiency.moe["per_expert_m"]
    assert pem["value"] == 16 * 8 / 64 and pem["source"] == "shapes" and "mean over experts" in pem["reason"]


def test_fused_moe_op_with_unexpected_kernels_is_unknown(tmp_path: Path) -> None:
    _fused_moe_trace(tmp_path / "moe-TP-0.trace.json.gz", 0,
                     kernels=("fused_moe_kernel", "fused_moe_kernel", "fused_moe_kernel"))
    a = analyze(tmp_path, Options(command="test"))
    g = a.efficiency.calls[a.efficiency.calls["kind"] == "gemm"]
    assert len(g) and (g["shape_source"] == "unknown").all() and g["flops"].isna().all()
    assert g["reason"].str.contains("cannot tell which is which").all()


def _memory_table_by_groupby(calls, spec):  # noqa: ANN001, ANN202 - the reference: grouping the text columns
    import numpy as np

    from traceinspect.measure.gemm_tables import _HOST_LINK, MEMORY_TABLE_COLUMNS

    m = calls.loc[(calls["kind"] == "memory") & calls["bytes"].notna(), ["name", "cls", "dtype", "bytes", "us"]].copy()
    m["family"] = m["name"].astype(object).astype(str).where(m["name"].notna(), None)
    m["bytes"] = m["bytes"].astype(float)
    m["host"] = [bool(_HOST_LINK.search(str(n))) for n in m["name"]]
    agg = m.groupby(["family", "cls"], sort=False).agg(
        calls=("us", "size"), bytes=("bytes", "sum"), us=("us", "sum"), host=("host", "any")).reset_index()
    dts = m.groupby(["family", "cls"], sort=False)["dtype"].agg(
        lambda s: sorted({x for x in s if isinstance(x, str) and x}))
    agg["dtypes"] = list(dts.to_numpy())
    agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
    bw = spec.mem_bw_gbps
    agg["pct_bw"] = np.where(agg["host"], np.nan, 100.0 * agg["gbps"] / bw)
    agg["reason"] = np.where(agg["host"], "host link copy: not bounded by device memory bandwidth", "")
    return agg.sort_values("us", ascending=False, kind="stable")[[c for c in MEMORY_TABLE_COLUMNS if c in agg]].reset_index(drop=True)


@pytest.mark.parametrize("seed", range(4))
def test_memory_table_equals_grouping_by_family_and_class(seed: int) -> None:
    """The memory table (grouped on integer codes) is what grouping the calls by their name and class
    texts gives, rows without a name or class left out, on a real trace's calls and on shuffled ones."""
    import numpy as np
    import pandas as pd

    from traceinspect.measure.gemm_tables import _memory_table

    a = analyze([str(fixture_dir("tp1-l6-full-eager"))], Options(use_cache=False, jobs=1))
    calls, spec = a.efficiency.calls, a.efficiency.spec
    assert spec is not None and (calls["kind"] == "memory").sum() > 10
    if seed:
        rng = np.random.default_rng(seed)
        calls = calls.iloc[rng.permutation(len(calls))].reset_index(drop=True).copy()
        names = calls["name"].to_numpy(dtype=object).copy()
        names[rng.integers(0, len(names), 3)] = None  # rows without a name or a class are left out
        names[rng.integers(0, len(names), 3)] = "Memcpy HtoD (Pinned -> Device)"
        calls["name"] = pd.Series(names, dtype=object)
        cls = calls["cls"].to_numpy(dtype=object).copy()
        cls[rng.integers(0, len(cls), 2)] = None
        calls["cls"] = pd.Series(cls, dtype=object)
        calls["us"] = calls["us"] * rng.uniform(0.5, 2.0, len(calls))  # distinct times: one order by time
    got, want = _memory_table(calls, spec), _memory_table_by_groupby(calls, spec)
    assert len(got) == len(want) > 3
    for c in ("family", "cls", "reason"):
        assert got[c].tolist() == want[c].tolist()
    assert got["dtypes"].tolist() == want["dtypes"].tolist() and got["calls"].tolist() == want["calls"].tolist()
    for c in ("bytes", "us", "gbps", "pct_bw"):
        np.testing.assert_array_equal(got[c].to_numpy(dtype=float), want[c].to_numpy(dtype=float))


def _groupby_keys(frame, prepare, keys):
    """What ``key_groups`` gives, the way pandas groups: the prepared rows grouped by their keys."""
    grouped = prepare(frame).groupby(keys, sort=False, dropna=False)
    return grouped.size().reset_index()[keys], grouped.ngroup().to_numpy()


@pytest.mark.parametrize("seed", range(6))
def test_key_groups_number_rows_as_pandas_groups_them(seed: int) -> None:
    """Grouping on distinct rows, then on the prepared keys in a dictionary, numbers every row and lists the
    groups' keys as grouping all rows by the prepared keys does: for values equal across types (1, 1.0,
    True), zeros of both signs, missing values (where the groups come from pandas), and shuffled rows."""
    import numpy as np
    import pandas as pd

    from traceinspect.measure.gemm_shapes import _SHAPE_KEYS, _shape_keys, key_groups
    from traceinspect.measure.gemm_tables import _GEMM_KEYS, _gemm_keys

    rng = np.random.default_rng(seed)
    n = 400
    pick = lambda *opts: np.array([opts[i] for i in rng.integers(0, len(opts), n)], dtype=object)  # noqa: E731
    frame = pd.DataFrame({
        "cls": pd.Series(pick("gemm_bf16", "moe_gemm", "gemm_fp8"), dtype=object),
        "op_name": pd.Series(pick("aten::mm", "aten::bmm", None if seed % 2 else "aten::mm"), dtype=object),
        "dtype": pd.Series(pick("bf16", "fp8", None), dtype=object),
        "m": pd.Series(pick(16, 16.0, True, 1, None if seed % 3 == 0 else 64, 0.0, -0.0), dtype=object),
        "n": pd.Series(pick(4096, 4096.0, 7168), dtype=object),
        "k": pd.Series(pick(7168, 512, None if seed % 2 else 512), dtype=object),
        "batch": pd.Series(pick(1, 2, None), dtype=object),
        "groups": pd.Series(pick(1, 8, 0, None), dtype=object),
        "moe": rng.integers(0, 2, n).astype(bool),
        "shape_source": pd.Series(pick("shapes", "graph_capture", "unknown"), dtype=object),
        "reason": pd.Series(pick("", None, "no CPU op"), dtype=object),
        "confidence": pd.Series(pick("high", "medium", None), dtype=object),
    })
    shape_cols = [c for c in frame.columns if c not in ("shape_source", "reason", "confidence")]
    for prepare, keys, cols in ((_gemm_keys, _GEMM_KEYS, _GEMM_KEYS), (_shape_keys, _SHAPE_KEYS, shape_cols)):
        got, number = key_groups(frame, cols, prepare, keys)
        want, want_number = _groupby_keys(frame, prepare, keys)
        np.testing.assert_array_equal(number, want_number)
        assert len(got) == len(want) and list(got.columns) == keys
        for c in keys:
            g, w = got[c].tolist(), want[c].tolist()
            assert [x if x == x else None for x in g] == [x if x == x else None for x in w], c


def test_prepared_keys_are_the_frame_formulas() -> None:
    """The GEMM table's and the shape rows' keys, made from column arrays, are those the frame operations
    they replace give (values and types)."""
    import numpy as np
    import pandas as pd

    from traceinspect.measure.gemm_shapes import _SHAPE_KEYS, _shape_keys
    from traceinspect.measure.gemm_tables import _GEMM_KEYS, _gemm_keys

    g = pd.DataFrame({
        "cls": pd.Series(["gemm_bf16", "moe_gemm", "gemm_fp8", "gemm_bf16"], dtype=object),
        "op_name": pd.Series(["aten::mm", None, np.nan, "aten::bmm"], dtype=object),
        "dtype": pd.Series(["bf16", None, "fp8", np.nan], dtype=object),
        "m": pd.Series([16, None, 2.5, 7], dtype=object), "n": pd.Series([4096, 4096, None, 1], dtype=object),
        "k": pd.Series([7168, 512, 1, 2], dtype=object), "batch": pd.Series([1, None, 2, 1], dtype=object),
        "groups": pd.Series([1, 8, None, 0], dtype=object), "moe": [False, True, False, True],
        "shape_source": pd.Series(["shapes", "unknown", "unknown", "graph_capture"], dtype=object),
        "reason": pd.Series(["", None, "no CPU op", ""], dtype=object),
        "confidence": pd.Series(["high", None, None, "medium"], dtype=object),
    }, index=[5, 3, 9, 1])

    want = g[_GEMM_KEYS].copy()
    for c in ("m", "n", "k", "batch", "groups"):
        want[c] = pd.to_numeric(want[c], errors="coerce").fillna(-1).astype(np.int64)
    want["dtype"], want["reason"] = want["dtype"].fillna(""), want["reason"].fillna("")
    want["confidence"] = want["confidence"].fillna("")
    known = want["shape_source"] != "unknown"
    want.loc[~known, "op_name"] = want.loc[~known, "op_name"].fillna("")
    pd.testing.assert_frame_equal(_gemm_keys(g), want)

    want = g.copy()
    groups = pd.to_numeric(want["groups"], errors="coerce").fillna(1).clip(lower=1)
    want["m"] = pd.to_numeric(want["m"], errors="coerce") / groups
    for c in ("n", "k"):
        want[c] = pd.to_numeric(want[c], errors="coerce")
    want["batch"] = pd.to_numeric(want["batch"], errors="coerce").fillna(1)
    want["known"] = want["m"].notna() & want["n"].notna() & want["k"].notna()
    want["is_moe"] = want["moe"].astype(bool)
    want["dtype"] = want["dtype"].fillna("").astype(object)
    want["op_name"] = want["op_name"].fillna("").astype(object)
    for c in ("m", "n", "k"):
        want[c] = want[c].fillna(-1.0)
    pd.testing.assert_frame_equal(_shape_keys(g)[_SHAPE_KEYS], want[_SHAPE_KEYS])


def test_run_sums_are_series_sums_with_min_count() -> None:
    """A GEMM group's FLOPs and bytes: each run's sum, NaN when a value is missing, as
    ``pd.Series(run).sum(min_count=len(run))`` gives (same rounding, same type)."""
    import numpy as np
    import pandas as pd

    from traceinspect.measure.gemm_tables import _sums_or_nan

    rng = np.random.default_rng(3)
    bounds = np.array([0, 1, 5, 6, 200, 201, 1000])
    for v in (rng.uniform(0, 1e12, 1000), rng.integers(0, 1 << 40, 1000),
              np.where(rng.uniform(size=1000) < 0.01, np.nan, rng.uniform(0, 1e6, 1000))):
        got = _sums_or_nan(v, bounds)
        want = [pd.Series(v[lo:hi]).sum(min_count=hi - lo) for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]
        assert [type(x) for x in got] == [type(x) for x in want] or all(isinstance(x, float) for x in got + want)
        np.testing.assert_array_equal(np.array(got, dtype=float), np.array(want, dtype=float))
