"""Kernel classifier: corpus accuracy, op-path rules, fused labels, rule-file errors, KV promotions."""

from __future__ import annotations

import csv
import itertools
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from traceinspect.classify import (
    CLASSES,
    ClassTable,
    Label,
    class_table_rows,
    classify_kernels,
    classify_name,
    load_class_table,
    model_has_experts,
)
from traceinspect.errors import RuleError
from traceinspect.model import RankInfo, TraceSet
from traceinspect.resources import tables_dir

HERE = Path(__file__).parent
CORPUS = HERE / "data" / "kernel_names_dev.tsv"
FIXTURES = HERE.parent / "fixtures"

NVJET = "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT"
KV_CAST = ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::"
           "{lambda()#3}::operator()() const::{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}, "
           "std::array<char*, 2ul>, 4, TrivialOffsetCalculator<1, unsigned int>, TrivialOffsetCalculator<1, "
           "unsigned int>, at::native::memory::LoadWithCast<1>, at::native::memory::StoreWithCast<1> >(int)")
FP8_CAST = ("void at::native::vectorized_elementwise_kernel<4, at::native::float8_copy_kernel_cuda(at::"
            "TensorIteratorBase&)::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >(int)")
INDEX_COPY = ("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::"
              "index_copy_kernel_impl<at::native::OpaqueType<1> > >(long)")


@pytest.fixture(scope="module")
def table() -> ClassTable:
    return load_class_table()


# ----------------------------------------------------------------------------- rule table


def test_classes_and_shipped_table(table: ClassTable) -> None:
    assert len(CLASSES) == 20 and CLASSES[0] == "fp4_gemm" and CLASSES[-1] == "other"
    assert {"fp32_gemm", "conv"} <= set(CLASSES)
    assert table.source == tables_dir() / "kernel_classes.yaml"
    assert table.source.is_file()
    assert {r.cls for r in table.rules} <= set(CLASSES)
    prios = [r.priority for r in table.rules]
    assert prios == sorted(prios, reverse=True)


def test_corpus_accuracy(table: ClassTable) -> None:
    with CORPUS.open(newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    assert len(rows) >= 150
    misses = []
    for r in rows:
        lb = classify_name(r["name"], table=table)
        if lb.cls != r["class"]:
            misses.append(f"want {r['class']:12s} got {lb.cls:12s} [{lb.evidence}] {r['name'][:120]}")
    acc = 1 - len(misses) / len(rows)
    print(f"corpus accuracy {acc:.3f} ({len(rows) - len(misses)}/{len(rows)})")
    for m in misses:
        print("MISS", m)
    assert acc >= 0.98


@pytest.mark.parametrize(("name", "op_path", "want"), [
    (NVJET, "aten::_scaled_mm", "fp8_gemm"),
    (NVJET, "sgl_kernel::fp8_scaled_mm", "fp8_gemm"),
    (NVJET, "sglang::fp4_gemm", "fp4_gemm"),
    (NVJET, "aten::mm", "bf16_gemm"),
    (NVJET, "aten::linear > aten::matmul > aten::mm", "bf16_gemm"),
    (NVJET, "tinymoe::fused_experts > aten::mm", "moe_gemm"),
    (NVJET, "", "bf16_gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(float)", "aten::_scaled_mm", "fp8_gemm"),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(float)", "aten::mm", "bf16_gemm"),
    ("nvjet_sm90_qqtst_80x64_128x11_4x1_v_bz_algo2_TNN", "", "fp8_gemm"),
    ("void router_gemm_kernel_float_output<__nv_bfloat16, 128>(float*)", "", "moe_dispatch"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(int)", "", "moe_dispatch"),
    ("void at::native::sbtopk::gatherTopK<float, unsigned int, 2, false>(int)", "aten::topk", "moe_dispatch"),
    (FP8_CAST, "aten::to > aten::_to_copy > aten::copy_", "dtype_cast"),
    (KV_CAST, "", "dtype_cast"),
    ("Memcpy DtoH (Device -> Pinned)", "aten::copy_", "memcpy"),
])
def test_op_path_rules(table: ClassTable, name: str, op_path: str, want: str) -> None:
    lb = classify_name(name, op_path, table=table)
    assert lb.cls == want, lb
    if op_path and want.endswith("gemm") and name == NVJET:
        assert "op " in lb.evidence


def test_event_kinds(table: ClassTable) -> None:
    assert classify_name("whatever", kind="memset", table=table).cls == "memcpy"
    assert classify_name("Memcpy HtoD (Pinned -> Device)", kind="memcpy", table=table).cls == "memcpy"
    assert classify_name("totally_unknown_kernel_xyz", table=table) == Label("other", "", "no rule matched")


@pytest.mark.parametrize(("name", "cls", "cls2"), [
    ("void flashinfer::trtllm_allreduce_fusion::allreduce_fusion_kernel_oneshot_lamport<"
     "(flashinfer::trtllm_allreduce_fusion::AllReduceFusionPattern)1, __nv_bfloat16, 4, false, false>(int)",
     "comm", "norm"),
    ("fused_rope_store_kernel", "rotary", "kv_write"),
    ("_silu_and_mul_post_quant_kernel", "activation", "quantize"),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu", "moe_gemm", "activation"),
    ("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(int)", "norm", ""),
])
def test_fused_secondary(table: ClassTable, name: str, cls: str, cls2: str) -> None:
    lb = classify_name(name, table=table)
    assert (lb.cls, lb.cls2) == (cls, cls2)


def test_malformed_yaml_names_file_and_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nrules:\n  - id: x\n    class: comm\n    priority: 5\n    name: [unclosed\n")
    with pytest.raises(RuleError) as e:
        load_class_table(bad)
    assert str(bad) in str(e.value) and ":" in e.value.path
    line = int(e.value.path.rsplit(":", 1)[1])
    assert 6 <= line <= 7


@pytest.mark.parametrize(("body", "line", "what"), [
    ("  - id: x\n    class: not_a_class\n    priority: 5\n    name: foo\n", 4, "unknown class id"),
    ("  - id: x\n    class: comm\n    priority: 5\n    name: 'foo('\n", 6, "bad regex"),
    ("  - id: x\n    class: comm\n    priority: high\n    name: foo\n", 5, "integer"),
    ("  - id: x\n    class: comm\n    priority: 5\n    nmae: foo\n", 6, "unknown key"),
    ("  - id: x\n    class: comm\n    secondary: nope\n    priority: 5\n    name: foo\n", 5, "unknown class id"),
    ("  - id: x\n    class: comm\n    priority: 5\n    name: '${nosuch}'\n", 6, "unknown macro"),
    ("  - id: x\n    class: comm\n    priority: 5\n", 3, "matcher"),
])
def test_rule_errors_cite_line(tmp_path: Path, body: str, line: int, what: str) -> None:
    p = tmp_path / "t.yaml"
    p.write_text("version: 1\nrules:\n" + body)
    with pytest.raises(RuleError) as e:
        load_class_table(p)
    assert e.value.path == f"{p}:{line}", e.value.one_line()
    assert what in e.value.reason


def test_extra_table_adds_a_family(tmp_path: Path, table: ClassTable) -> None:
    name = "void acme::fancy_layernorm_v2<128>(float*)"
    assert classify_name("void acme::warp_magic_kernel<4>(int)", table=table).cls == "other"
    extra = tmp_path / "acme.yaml"
    extra.write_text(
        "version: 1\n"
        "rules:\n"
        "  - id: acme-magic\n"
        "    class: moe_dispatch\n"
        "    priority: 500\n"
        "    name: 'acme::warp_magic'\n"
        "  - id: acme-gemm\n"
        "    class: fp8_gemm\n"
        "    priority: 450\n"
        "    op: 'acme::qlinear'\n"
        "    name: '${gemm}'\n"
    )
    t = load_class_table(extra=[extra])
    assert t.extra == (extra,)
    lb = t.classify("void acme::warp_magic_kernel<4>(int)")
    assert lb.cls == "moe_dispatch" and "acme-magic" in lb.evidence
    assert t.classify(NVJET, "acme::qlinear").cls == "fp8_gemm"
    assert t.classify(name).cls == "norm"  # shipped rules still apply


# ----------------------------------------------------------------------------- promotions (synthetic)


def _trace(*, graph: bool, kv_mode: str, layers: int = 4, steps: int = 4, pool: int = 4096,
           with_model_info: bool = True) -> tuple[TraceSet, pd.DataFrame]:
    """A one-rank decode trace: per layer mm, KV write, write-side fp8 cast, KV read cast, activation
    quant cast, scaled_mm, allreduce; eager traces carry CPU ops with recorded shapes."""
    kern: list[dict] = []
    ops: list[dict] = []
    t = 0.0
    active = 512

    def op(name: str, dims: list, types: list, parent: int = -1) -> int:
        ops.append({"rank": 0, "name": name, "ts": t, "dur": 1.0, "end": t + 1.0, "tid": 1, "external_id": -1,
                    "input_dims": json.dumps(dims).encode(), "input_types": json.dumps(types).encode(),
                    "concrete": None, "parent": parent})
        return len(ops) - 1

    def kernel(name: str, step: int, dur: float, o: int = -1, path: str = "") -> None:
        nonlocal t
        kern.append({"rank": 0, "kind": "kernel", "name": name, "ts": t, "dur": dur, "end": t + dur, "step": step,
                     "graph_replay": graph, "op_idx": -1 if graph else o, "op_path": "" if graph else path})
        t += dur + 1.0

    for s in range(steps):
        for _ in range(layers):
            o = op("aten::mm", [[64, 256], [256, 1088]], ["c10::BFloat16", "c10::BFloat16"])
            kernel(NVJET, s, 5, o, "aten::mm")
            a = op("aten::to", [[64, 576], [], [], [], []], ["c10::BFloat16", "Scalar", "", "", ""])
            b = op("aten::_to_copy", [[64, 576]], ["c10::BFloat16"], a)
            c = op("aten::copy_", [[64, 576], [64, 576], []], ["c10::Float8_e4m3fn", "c10::BFloat16", "Scalar"], b)
            kernel(FP8_CAST, s, 2, c, "aten::to > aten::_to_copy > aten::copy_")
            o = op("aten::index_copy_", [[pool, 576], [], [64], [64, 576]],
                   ["unsigned char", "Scalar", "long int", "unsigned char"])
            kernel(INDEX_COPY, s, 2, o, "aten::index_copy_")
            rows = pool if kv_mode == "full" else active
            if kv_mode == "gather":
                o = op("aten::index_select", [[pool, 576], [], [active]], ["unsigned char", "Scalar", "long int"])
                kernel("void at::native::(anonymous namespace)::indexSelectLargeIndex<char, long>(int)", s, 3, o,
                       "aten::index_select")
            a = op("aten::to", [[rows, 576], [], [], [], []], ["c10::Float8_e4m3fn", "Scalar", "", "", ""])
            b = op("aten::_to_copy", [[rows, 576]], ["c10::Float8_e4m3fn"], a)
            c = op("aten::copy_", [[rows, 576], [rows, 576], []], ["c10::BFloat16", "c10::Float8_e4m3fn", "Scalar"], b)
            kernel(KV_CAST, s, 40 if kv_mode == "full" else 8, c, "aten::to > aten::_to_copy > aten::copy_")
            a = op("aten::to", [[64, 1024], [], [], [], []], ["c10::BFloat16", "Scalar", "", "", ""])
            kernel(FP8_CAST.replace("<4,", "<8,"), s, 2, a, "aten::to")
            o = op("aten::_scaled_mm", [[64, 1024], [1024, 2048]], ["c10::Float8_e4m3fn", "c10::Float8_e4m3fn"])
            kernel("nvjet_sm90_qqtst_80x64_128x11_4x1_v_bz_algo2_TNN", s, 5, o, "aten::_scaled_mm")
            kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", s, 6, -1, "")
        o = op("aten::argmax", [[64, 4096]], ["c10::BFloat16"])
        kernel("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, "
               "unsigned int, long, 4, 4> >(int)", s, 3, o, "aten::argmax")
        t += 100.0
    k = pd.DataFrame(kern)
    k["op_idx"] = k["op_idx"].astype(np.int64)
    si = {"max_total_num_tokens": pool, "page_size": 1, "kv_cache_dtype": "fp8_e4m3"}
    if with_model_info:
        si["model_info"] = {"num_hidden_layers": layers}
    ts = TraceSet(ranks=[RankInfo(rank=0, label="TP0", path=Path("x"), rank_source="filename")], kernels=k,
                  runtime=pd.DataFrame(), cpu_ops=pd.DataFrame(ops), annotations=pd.DataFrame(),
                  gpu_annotations=pd.DataFrame(), server_info=si)
    st = pd.DataFrame({"rank": 0, "idx": range(steps), "included": True})
    return ts, st


@pytest.mark.parametrize("kv_mode", ["full", "gather"])
@pytest.mark.parametrize("graph", [False, True])
def test_kv_cast_promotion_synthetic(graph: bool, kv_mode: str) -> None:
    ts, st = _trace(graph=graph, kv_mode=kv_mode)
    classify_kernels(ts, st)
    k = ts.kernels
    casts = k[k["name"] == KV_CAST]
    assert (casts["cls"] == "kv_cast").all(), casts["cls_evidence"].iloc[0]
    ev = casts["cls_evidence"].iloc[0]
    if graph:
        assert "graph replay" in ev and "once per layer" in ev and "num_hidden_layers=4" in ev
    elif kv_mode == "full":
        assert "KV pool" in ev and "max_total_num_tokens=4096" in ev
    else:
        assert "KV-dtype rows" in ev and "once per layer" in ev
    # the write-side fp8 cast belongs to the KV write, the activation fp8 cast to the FP8 GEMM: never kv_cast
    write_cast = k[k["name"] == FP8_CAST]
    act_cast = k[k["name"] == FP8_CAST.replace("<4,", "<8,")]
    assert (write_cast["cls"] == "kv_write").all(), write_cast["cls_evidence"].iloc[0]
    assert "right before kv_write" in write_cast["cls_evidence"].iloc[0]
    assert (act_cast["cls"] == "quantize").all(), act_cast["cls_evidence"].iloc[0]
    assert "right before fp8_gemm" in act_cast["cls_evidence"].iloc[0]
    writes = k[k["name"] == INDEX_COPY]
    assert (writes["cls"] == "kv_write").all(), writes["cls_evidence"].iloc[0]
    assert set(k["cls"]) <= set(CLASSES) and "other" not in set(k["cls"])


def test_layer_count_inferred_from_attention() -> None:
    ts, st = _trace(graph=True, kv_mode="full", with_model_info=False)
    k = ts.kernels
    # make the all-reduce an attention kernel stand-in: one per layer per step
    k.loc[k["name"].str.startswith("ncclDevKernel"), "name"] = "void flashinfer::BatchDecodeWithPagedKVCacheKernel<>"
    classify_kernels(ts, st)
    ev = ts.kernels.loc[ts.kernels["name"] == KV_CAST, "cls_evidence"].iloc[0]
    assert ts.kernels.loc[ts.kernels["name"] == KV_CAST, "cls"].eq("kv_cast").all()
    assert "trace_structure" in ev and "checked: attention 4 per step" in ev


def test_no_promotion_without_evidence() -> None:
    # one layer: no layer count in server_info, no repeating block, no attention kernels, no ops
    ts, st = _trace(graph=True, kv_mode="full", layers=1, with_model_info=False)
    classify_kernels(ts, st)
    assert (ts.kernels.loc[ts.kernels["name"] == KV_CAST, "cls"] == "dtype_cast").all()


def test_softmax_expert_size_check() -> None:
    ts, st = _trace(graph=True, kv_mode="full")
    k = ts.kernels
    sm = "void (anonymous namespace)::softmax_warp_forward<c10::BFloat16, c10::BFloat16, float, {}, false, false>(int)"
    extra = pd.DataFrame([{**k.iloc[0].to_dict(), "name": sm.format(n), "ts": -10.0 - n} for n in (4, 8)])
    ts.kernels = pd.concat([k, extra], ignore_index=True)
    ts.server_info["model_info"]["n_routed_experts"] = 16
    classify_kernels(ts, st)
    got = dict(zip(ts.kernels["name"], zip(ts.kernels["cls"], ts.kernels["cls_evidence"], strict=True), strict=True))
    assert got[sm.format(4)][0] == "moe_dispatch" and "matches 16 experts" in got[sm.format(4)][1]
    assert got[sm.format(8)][0] == "elementwise" and "not MoE routing" in got[sm.format(8)][1]
    # without an expert count the generic label stands
    assert classify_name(sm.format(8)).cls == "moe_dispatch"


def test_routing_labels_only_where_the_model_has_experts() -> None:
    """A generic softmax / top-k / sort is MoE routing only in a model with experts: with no expert
    count and no MoE kernel or op in the trace it is elementwise, with the reason recorded."""
    sm = "void (anonymous namespace)::softmax_warp_forward<float, float, float, 10, true>(float*)"
    sort = "void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<int>(int)"
    for experts in (False, True):
        ts, st = _trace(graph=True, kv_mode="full")
        k = ts.kernels
        extra = [{**k.iloc[0].to_dict(), "name": n, "ts": -10.0 - i} for i, n in enumerate((sm, sort))]
        if experts:
            extra.append({**k.iloc[0].to_dict(), "name": "fused_moe_kernel", "ts": -20.0})
        ts.kernels = pd.concat([k, pd.DataFrame(extra)], ignore_index=True)
        has, why = model_has_experts(ts)
        assert not has and "no expert count" in why if not experts else True
        classify_kernels(ts, st)
        got = dict(zip(ts.kernels["name"], zip(ts.kernels["cls"], ts.kernels["cls_evidence"], strict=True),
                       strict=True))
        for n in (sm, sort):
            if experts:
                assert got[n][0] == "moe_dispatch", got[n]
            else:
                assert got[n][0] == "elementwise" and "the model has no experts" in got[n][1], got[n]
        if experts:
            assert model_has_experts(ts) == (True, "expert GEMM kernels in the trace")


@pytest.mark.parametrize(("name", "op_path", "want"), [
    ("volta_sgemm_128x64_nt", "", "fp32_gemm"),
    ("volta_sgemm_128x64_nt", "aten::addmm", "fp32_gemm"),
    ("ampere_sgemm_64x32_sliced1x4_nn", "aten::mm", "fp32_gemm"),
    ("sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4", "", "fp32_gemm"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn"
     "_align1::Params)", "aten::linear > aten::matmul > aten::mm", "fp32_gemm"),
    ("sm80_xmma_gemm_tf32f32_tf32f32_f32_tn_n_tilesize64x64x32", "", "fp32_gemm"),
    ("void cutlass::Kernel<cutlass_80_tensorop_s1688gemm_256x64_16x4_nn_align4>(cutlass_80_tensorop_s1688gemm"
     "_256x64_16x4_nn_align4::Params)", "aten::mm", "fp32_gemm"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_s16816gemm_bf16_128x64_64x6_tn_align8>(x)", "aten::mm", "bf16_gemm"),
    ("void epilogue::impl::globalKernel<float, float, float, true, true>(int, int, long, float*)", "", "fp32_gemm"),
    ("volta_sgemm_128x64_nt", "aten::cudnn_convolution", "conv"),
    ("void implicit_convolve_sgemm<float, float, 1024, 6, 7, 3, 3, 5, 1, false, true, true>(int)", "", "conv"),
    ("void cudnn::winograd_nonfused::winogradForwardData4x4<float, float>(x)", "", "conv"),
    ("volta_scudnn_winograd_128x128_ldg1_ldg4_relu_tile148t_nt_v1", "", "conv"),
    ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int)", "", "conv"),
    ("sm80_xmma_fprop_implicit_gemm_indexed_f16f16_f16f32_f32_nhwckrsc_nhwc", "", "conv"),
    ("_ZN19cutlass_cudnn_train6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11threadblock", "", "conv"),
    ("void cudnn::bn_fw_tr_1C11_kernel_NCHW<float, float, int, 512, true, 1>(x)", "", "norm"),
    ("void at::native::batch_norm_collect_statistics_kernel<float, float, float, 512>(x)", "", "norm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous)::foo>(int)",
     "aten::batch_norm > aten::native_batch_norm", "norm"),
    ("convert_fp8_kernel", "", "dtype_cast"),
    ("void causal_conv1d_fwd_kernel<x>(int)", "", "attention"),
    ("void dpsk::ep::internode::dispatch<8, 4, 128>(int*)", "", "moe_dispatch"),
    ("void dpsk::ep::internode::combine<__nv_bfloat16, 8>(int*)", "", "moe_dispatch"),
    ("void dpsk::ep::internode::notify_dispatch<8>(int)", "", "moe_dispatch"),
    ("void deep_ep::intranode::dispatch<8, 768>(int*)", "", "moe_dispatch"),
    ("triton_poi_fused_add_all_reduce_embedding_mul_0", "", "elementwise"),
    ("triton_poi_fused_add_all_reduce_embedding_mul_0", "c10d::allreduce_", "elementwise"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "", "comm"),
    ("cross_device_reduce_1stage<__nv_bfloat16, 8>", "", "comm"),
])
def test_new_classes_and_namespaces(table: ClassTable, name: str, op_path: str, want: str) -> None:
    lb = classify_name(name, op_path, table=table)
    assert lb.cls == want, lb


FP32_GEMM_NAME = re.compile(r"(?<![a-z])sgemm|f32f32|tf32|simt_sgemm|<float, float, float\b", re.IGNORECASE)


def test_no_fp32_gemm_in_the_corpus_is_bf16(table: ClassTable) -> None:
    """The corpus' fp32 / tf32 GEMMs (by name) are fp32_gemm; the traces are checked in test_real_traces."""
    n = 0
    for r in csv.DictReader(CORPUS.open(), delimiter="\t"):
        if FP32_GEMM_NAME.search(r["name"]) and "gemm" in r["name"].lower():
            assert classify_name(r["name"], table=table).cls == "fp32_gemm" == r["class"], r["name"]
            n += 1
    assert n >= 2


def test_class_table_rows() -> None:
    ts, st = _trace(graph=False, kv_mode="full")
    classify_kernels(ts, st)
    rows = class_table_rows(ts.kernels)
    assert list(rows.columns) == ["name", "cls", "cls2", "evidence", "calls", "us", "share"]
    assert rows["us"].is_monotonic_decreasing
    assert rows.iloc[0]["name"] == KV_CAST and rows.iloc[0]["cls"] == "kv_cast"
    assert rows["share"].sum() == pytest.approx(1.0)
    assert rows["calls"].sum() == len(ts.kernels)


# ----------------------------------------------------------------------------- real GPU fixtures

VARIANTS = ["kv-full-cast-eager", "kv-gather-cast-eager", "moe-small-m-eager", "moe-large-m-eager",
            "kv-full-cast-graph", "kv-gather-cast-graph", "slow-rank-eager"]


def _load(variant: str):
    d = FIXTURES / variant
    if not (d / "manifest.json").is_file() or not list(d.glob("*.trace.json*")):
        pytest.skip(f"fixture {variant} not present")
    from traceinspect.link import link
    from traceinspect.load import load_trace_set
    from traceinspect.steps import build_steps

    ts = load_trace_set(str(d))
    link(ts)
    steps = build_steps(ts)
    classify_kernels(ts, steps)
    return ts, steps, json.loads((d / "manifest.json").read_text())


@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_other_below_2pct(variant: str) -> None:
    ts, _, _ = _load(variant)
    k = ts.kernels
    share = k.loc[k["cls"] == "other", "dur"].sum() / k["dur"].sum()
    print(variant, f"other {share:.4%}")
    assert share < 0.02, class_table_rows(k[k["cls"] == "other"]).head(10)


@pytest.mark.parametrize("variant", ["kv-full-cast-eager", "kv-full-cast-graph", "kv-gather-cast-eager",
                                     "kv-gather-cast-graph"])
def test_fixture_planted_kv_casts(variant: str) -> None:
    ts, steps, man = _load(variant)
    k = ts.kernels
    pk = man["planted_kernels"]["kv_cast"]
    planted = k["name"].str.contains(pk["name_substring"], regex=False) & k["name"].str.contains(
        pk["and_substring"], regex=False) & (k["step"] >= 0)
    assert planted.any()
    got = k[planted]
    assert (got["cls"] == "kv_cast").all(), got[["cls", "cls_evidence"]].drop_duplicates().to_string()
    ev = got["cls_evidence"].iloc[0]
    if man["cuda_graph"]:
        assert "graph replay" in ev and "once per layer" in ev
    elif man["kv_mode"] == "full":
        assert "KV pool" in ev
    else:
        assert "once per layer" in ev
    inc = steps[steps["included"]]
    per_step = got[got["step"].isin(inc.index)].groupby(["rank", "step"]).size()
    assert (per_step == pk["per_step"]).all()
    # nothing else is a KV cast
    assert (k.loc[~planted, "cls"] != "kv_cast").all()


# ----------------------------------------------------------------------------- same-dtype copies, MoE from GEMMs

NOCAST = ("void at::native::elementwise_kernel_manual_unroll<128, 8, at::native::gpu_kernel_impl_nocast<"
          "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
          "{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1}>(at::TensorIteratorBase&, "
          "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)::{lambda()#3}::operator()() const::"
          "{lambda()#12}::operator()() const::{lambda(c10::BFloat16)#1} const&)::{lambda(int)#1}>(int, "
          "at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>)")


@pytest.mark.parametrize("graph", [True, False])
def test_same_dtype_copy_is_never_kv_cast(graph: bool) -> None:
    """A copy that keeps the dtype recurs once per layer and, eager, even reads the pool: still no cast."""
    from traceinspect.classify import promote_kv

    assert classify_name(NOCAST).cls == "memcpy"
    ts, st = _trace(graph=graph, kv_mode="full")
    k = ts.kernels
    k.loc[k["name"] == KV_CAST, "name"] = NOCAST
    classify_kernels(ts, st)
    assert not (ts.kernels.loc[ts.kernels["name"] == NOCAST, "cls"] == "kv_cast").any()
    # even where a class table of one's own calls it a dtype cast
    ts.kernels["cls"] = ts.kernels["cls"].astype(object)
    ts.kernels.loc[ts.kernels["name"] == NOCAST, "cls"] = "dtype_cast"
    promote_kv(ts, st)
    assert not (ts.kernels.loc[ts.kernels["name"] == NOCAST, "cls"] == "kv_cast").any()


def test_copy_op_that_keeps_the_dtype_is_not_a_kv_cast() -> None:
    """An eager copy_ of the pool from fp8 to fp8 under a cast-looking kernel name is a copy."""
    ts, st = _trace(graph=False, kv_mode="full")
    ops = ts.cpu_ops
    same = ops["name"].eq("aten::copy_") & ops["input_types"].astype(str).str.contains('"c10::BFloat16", "c10::Float8')
    ops.loc[same, "input_types"] = json.dumps(["c10::Float8_e4m3fn", "c10::Float8_e4m3fn", "Scalar"]).encode()
    classify_kernels(ts, st)
    assert not (ts.kernels.loc[ts.kernels["name"] == KV_CAST, "cls"] == "kv_cast").any()


def _moe_trace(form: str, *, layers: int = 3, steps: int = 4, experts: int = 8, rows: int = 6, hidden: int = 256,
               inter: int = 128, batch: int = 8) -> tuple[TraceSet, pd.DataFrame]:
    """One rank, eager: per layer an attention bmm whose batch equals the expert count, the router GEMM
    and top-k, then the experts as a per-expert mm loop ('loop') or two batched GEMMs ('bmm')."""
    kern: list[dict] = []
    ops: list[dict] = []
    t = 0.0
    win: list[tuple[float, float]] = []

    def op(name: str, dims: list, types: list, conc: list | None = None) -> int:
        ops.append({"rank": 0, "name": name, "ts": t, "dur": 1.0, "end": t + 1.0, "tid": 1, "external_id": -1,
                    "input_dims": json.dumps(dims).encode(), "input_types": json.dumps(types).encode(),
                    "concrete": json.dumps(conc).encode() if conc else None, "parent": -1})
        return len(ops) - 1

    def kernel(name: str, step: int, o: int, path: str) -> None:
        nonlocal t
        kern.append({"rank": 0, "kind": "kernel", "name": name, "ts": t, "dur": 4.0, "end": t + 4.0, "step": step,
                     "graph_replay": False, "op_idx": o, "op_path": path, "stream": 7})
        t += 5.0

    bf = "c10::BFloat16"
    for s in range(steps):
        start = t
        for _ in range(layers):
            o = op("aten::bmm", [[batch, 4, 64], [batch, 64, 512]], [bf, bf])  # attention: batch = requests
            kernel("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_NNT", s, o, "aten::bmm")
            o = op("aten::mm", [[batch, hidden], [hidden, experts]], [bf, bf])
            kernel("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT", s, o, "aten::mm")
            o = op("aten::topk", [[batch, experts], [], [], [], []], [bf, "Scalar", "Scalar", "Scalar", "Scalar"],
                   ["", "2", "-1", "True", "True"])
            kernel("void at::native::sbtopk::gatherTopK<c10::BFloat16, unsigned int, 2, false>()", s, o, "aten::topk")
            if form == "loop":
                for _e in range(experts):
                    o = op("aten::mm", [[rows, hidden], [hidden, inter]], [bf, bf])
                    kernel("nvjet_sm90_tst_64x8_64x16_1x2_h_bz_NNT", s, o, "aten::mm")
                    o = op("aten::mm", [[rows, inter], [inter, hidden]], [bf, bf])
                    kernel("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_NNT", s, o, "aten::mm")
            else:
                o = op("aten::bmm", [[experts, rows, hidden], [experts, hidden, inter]], [bf, bf])
                kernel("nvjet_sm90_tst_64x16_64x16_1x2_h_bz_NNT", s, o, "aten::bmm")
                o = op("aten::bmm", [[experts, rows, inter], [experts, inter, hidden]], [bf, bf])
                kernel("nvjet_sm90_tst_64x16_64x16_4x1_v_bz_NNT", s, o, "aten::bmm")
            kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", s, -1, "")
        win.append((start - 0.5, t))
        t += 50.0
    k = pd.DataFrame(kern)
    ts = TraceSet(ranks=[RankInfo(rank=0, label="TP0", path=Path("x"), rank_source="filename")], kernels=k,
                  runtime=pd.DataFrame(), cpu_ops=pd.DataFrame(ops), annotations=pd.DataFrame(),
                  gpu_annotations=pd.DataFrame(), server_info={"tp_size": 1})
    st = pd.DataFrame({"rank": 0, "idx": range(steps), "included": True, "phase": "decode", "bs": batch,
                       "cpu_start": [w[0] for w in win], "cpu_end": [w[1] for w in win]})
    return ts, st


@pytest.mark.parametrize("form", ["loop", "bmm"])
def test_expert_gemms_of_plain_gemm_moe_are_moe_gemm(form: str) -> None:
    """No MoE op, no model config: the router's top-k shapes give the experts (8) and hidden size; the
    expert GEMMs become moe_gemm with their per-expert M, the attention bmm (batch 8 as well) does not."""
    from traceinspect.measure.gemm import ShapeCache

    ts, st = _moe_trace(form)
    run = classify_kernels(ts, st)
    assert (run.value("experts"), run.value("top_k"), run.value("hidden_size")) == (8, 2, 256)
    assert run.value("layers") == 3
    k = ts.kernels
    moe = k[k["cls"] == "moe_gemm"]
    assert len(moe) == 4 * 3 * (16 if form == "loop" else 2)
    assert moe["cls_evidence"].astype(str).str.contains("one per expert" if form == "loop" else "batch 8").all()
    assert (k.loc[k["op_path"] == "aten::bmm", "cls"] != "moe_gemm").sum() == 12  # attention bmm, 3 x 4 steps
    cache = ShapeCache()
    ops = ts.cpu_ops
    for o in moe["op_idx"].unique():
        (shape,), _ = cache.get(ops.at[o, "name"], ops.at[o, "input_dims"], ops.at[o, "input_types"], None)
        assert shape.m == 6  # the rows each expert gets


def test_expert_count_from_config_sets_the_loop_length() -> None:
    """With 16 experts in the model config, 8 calls per layer still are one per expert (half the experts
    idle is allowed), but a GEMM shape run once per layer is not."""
    ts, st = _moe_trace("loop")
    ts.server_info = {"tp_size": 1, "model_info": {"n_routed_experts": 16, "num_hidden_layers": 3}}
    run = classify_kernels(ts, st)
    assert run.source("experts") == "server_info"
    k = ts.kernels
    assert (k["cls"] == "moe_gemm").sum() == 4 * 3 * 16
    router = k["name"] == "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_TNT"
    assert (k.loc[router, "cls"] == "bf16_gemm").all()


# ----------------------------------------------------------------------------- name patterns


def test_name_patterns_match_as_their_regex(table: ClassTable) -> None:
    """The substring fast path of every shipped name pattern agrees with ``re.search`` of the whole
    pattern on every labeled kernel name (and on their upper-case and non-ASCII variants)."""
    with CORPUS.open(newline="") as f:
        names = [r["name"] for r in csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)]
    names += [NVJET, KV_CAST, FP8_CAST, INDEX_COPY, "", "x"]
    names += [n.upper() for n in names[:50]] + [n + " \u017f\u212a" for n in names[:50]]
    pats = {p for r in table.rules for p in (*r.name, *r.not_name)}
    assert len(pats) > 20
    for p in pats:
        rx = re.compile(p.pattern, p.flags)
        for n in names:
            want = rx.search(n) is not None
            assert p.matches(n) == want and p.matches(n, n.lower()) == want, (p.pattern[:80], n[:80])


@pytest.mark.parametrize(("pattern", "text", "want"), [
    ("gemm|^bmm_|foo", "xbmm_gemm", True), ("gemm|^bmm_", "xbmm_", False), ("gemm|^bmm_", "bmm_x", True),
    ("a(b|c)d|zz", "acd", True), ("a(b|c)d|zz", "bzz", True), ("a[|]b|q", "a|b", True), ("a[|]b|q", "ab", False),
    (r"x\|y|q", "x|y", True), ("(?i)ABC|def", "abc", True), ("foo||bar", "zzz", True), ("Kern", "kern", True),
    ("conv(?!ert)|winograd", "convert", False), ("conv(?!ert)|winograd", "WINOGRAD", True),
])
def test_name_pattern_alternatives(pattern: str, text: str, want: bool) -> None:
    from traceinspect.classify.table import NamePattern

    p = NamePattern(pattern, re.IGNORECASE)
    assert p.matches(text) is want
    assert (re.search(pattern, text, re.IGNORECASE) is not None) is want


# regexes whose needed texts are easy to get wrong: common prefixes the parser factors out of alternatives,
# repeats that may match nothing, groups with flags of their own, lookarounds, escapes, backreferences,
# an empty alternative, verbose and case-sensitive patterns
TRICKY = [r"(internode|intranode)\w*::\w*(dispatch|combine)", r"a{2}b|(ab)+c", r"(ab)*cd|x{0}yz", r"(ab)?cd",
          r"(?:foo)bar|baz\d", r"(?<![a-z])sgemm|conv(?!ert)", r"x(?i:AB)c|q\d", r"(?-i:AB)c|q\d", r"\bfoo\b|x\.y",
          r"(a)b\1|zz\d", r"(a)x|\1y", "\u00e9t\\d|ab\\d", r"[ab]cd|e+f", ".|zz", "a\\d|", r"(?x) a b \s c | d e",
          r"^bmm_\w+|_sm\d+$", r"(rope|norm)_\w*quant", r"kern(el)?s?_", r"k\w*K|s\w*S", "\u017fgemm\\d|zz\\d",
          r"(?i)ABC\d", r"(abc|)d\d|q\d", r"(foo|ba)r\d|zz", r"x(y|z)*w", r"(?:aa|bb)(?:cc|dd)|^(Mem|mem)cpy\b"]


@pytest.mark.parametrize("flags", [0, re.IGNORECASE])
@pytest.mark.parametrize("pattern", TRICKY)
def test_name_patterns_search_only_names_with_a_needed_text(pattern: str, flags: int) -> None:
    """A name pattern agrees with ``re.search`` on generated names, with and without case folding, for
    regexes whose needed texts (the prefilter before the regex) are easy to get wrong."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from traceinspect.classify.table import NamePattern

    p = NamePattern(pattern, flags)
    rx = re.compile(pattern, flags)
    plain = re.sub(r"\(\?[a-zA-Z-]*:?|\\[a-zA-Z]", " ", pattern)  # without inline flags and escapes
    words = sorted(set(re.findall(r"[A-Za-z_:]+", plain)))  # the pattern's own texts
    words = [w for t in words for w in (t, t.upper(), t.lower(), t[: len(t) // 2], t[len(t) // 2:])]
    pieces = [*dict.fromkeys(words), *"abksxyz_. 1", "\u00e9t", "\u212a", "\u017f"]

    def agree(text: str) -> None:
        want = rx.search(text) is not None
        assert p.matches(text) == want, (pattern, text)
        assert p.matches(text, text.lower()) == want, (pattern, text)

    for n in (1, 2, 3):
        for parts in itertools.product(pieces[:24], repeat=n):
            agree("".join(parts))
    settings(max_examples=200)(  # derandomized, no deadline: tests/conftest.py's profile
        given(st.lists(st.sampled_from(pieces), max_size=8).map("".join))(agree))()


def test_most_shipped_name_patterns_have_a_prefilter(table: ClassTable) -> None:
    """The shipped name patterns with regex alternatives mostly come with needed texts (else every
    distinct kernel name goes through their regex)."""
    pats = {p for r in table.rules for p in (*r.name, *r.not_name) if p._rest is not None}
    assert len(pats) > 20
    assert sum(p._needs is not None for p in pats) >= 0.8 * len(pats)


BAD_OR_ODD = [r"(?<=ab|c)x|zz", r"(?<!a+)bq|zz", r"foo(?=(?<=a*)b)", r"(a|(?<=x{2,3})b)c", r"(a)(?(1)(?<=a+)|b)c",
              r"(?:(?<!\w{1,2})q)+r", r"ok(?<=ab)x|zz", r"(ab|zz", r"a{3,2}q", r"[z-a]q", r"(?P<n>a)(?P=m)",
              r"(?<=a(?<=b+))c", r"q(?=(?:a|(?<!bc?)))d", r"abc|(?<=\d)x"]


@pytest.mark.parametrize("pattern", BAD_OR_ODD)
def test_name_pattern_refuses_what_compiling_refuses(pattern: str) -> None:
    """A name pattern is checked at load as compiling checks it (the parse, and lookbehinds of one fixed
    width anywhere in the pattern), though its regex is compiled only when a name first needs it: the
    same patterns are refused, with the same message."""
    from traceinspect.classify.table import NamePattern

    try:
        re.compile(pattern, re.IGNORECASE)
        want = None
    except re.error as e:
        want = str(e)
    try:
        NamePattern(pattern, re.IGNORECASE)
        got = None
    except re.error as e:
        got = str(e)
    assert got == want


def test_name_pattern_compiles_its_regex_when_a_name_needs_it() -> None:
    """The regex part of a pattern with needed texts is compiled by the first name that holds one of
    them; names without them never compile it (a pattern without needed texts is compiled at load)."""
    from traceinspect.classify.table import NamePattern

    p = NamePattern(r"sm\d+_xmma|nvjet", 0)
    assert p._rest is None and p.matches("void elementwise_kernel<float>") is False and p._rest is None
    assert p.matches("nvjet_tst") is True and p._rest is None  # (a plain alternative: substring search)
    assert p.matches("sm90_xmma_gemm") is True and p._rest is not None
    assert NamePattern(r".\d", 0)._rest is not None


@pytest.mark.parametrize(("name", "want"), [
    # FP4 / MXFP4 / NVFP4 block-scaled GEMMs, every family
    ("kernel_cutlass_kernel_flashinfercute_dslgemm_blockscaled_gemm_sm100_Sm100BlockScaledPersistentDenseGemmKernel_"
     "object_at__TiledMMA_ThrLayoutVMNK21111000", "fp4_gemm"),
    ("void cutlass::device_kernel<flashinfer::gemm::dense_blockscaled_gemm_sm100<cutlass::float_e2m1_t>>", "fp4_gemm"),
    ("void cutlass::device_kernel<cutlass3x_sm100_bstensorop_s256x128x64gemm_block_scaled_ue4m3xe2m1_ue4m3xe2m1_f32_"
     "bf16_bf16_128x128x256_1x1x1_0_tnt_align32_o_vs16_2sm_bias_bf16_relu>", "fp4_gemm"),
    ("bmm_E2m1E2m1_Fp32_t128x64x256u2_s4_et128x64_m128x64x64_cga1x1x1_16dp256b_TN_transOut_schedS_sm100f", "fp4_gemm"),
    ("nvjet_sm100_ootst_128x256_64x4_2x1_2cta_v_bz_Avec16UE4M3_Bvec16UE4M3_TNT", "fp4_gemm"),
    ("void tensorrt_llm::kernels::cutlass_kernels::cutlass_fp4_gemm_sm100", "fp4_gemm"),
    ("_gemm_afp4_wfp4_kernel", "fp4_gemm"),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1", "moe_gemm"),
    ("bmm_Bfloat16_E2m1E2m1_Fp32_t128x8x512u2_s4_et64x8_m128x8x64_cga1x1x1_16dp256b_TN_transOut_schedP_bN_dynBatch_"
     "sm100f", "moe_gemm"),
    # a block-scaled GEMM of FP8 data (MXFP8) stays fp8
    ("cutlass3x_sm100_bstensorop_s128x128x128gemm_block_scaled_ue8m0xe4m3_ue8m0xe4m3_f32_bf16_bf16", "fp8_gemm"),
    # quantization, MoE routing, KV-cache writes, casts
    ("per_tensor_absmax_kernel", "quantize"),
    ("void vllm::segmented_max_reduction<c10::BFloat16>(float*, c10::BFloat16 const*, long)", "quantize"),
    ("_downcast_to_mxfp", "quantize"),
    ("_sum_bitmatrix_rows", "moe_dispatch"),
    ("_routing_compute_indx", "moe_dispatch"),
    ("_finalize_matmul_launch_metadata", "moe_dispatch"),
    ("set_mla_kv_scale_buffer_kernel", "kv_write"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
     "TensorListMetadata<2>, at::native::(anonymous namespace)::CopyFunctor<c10::BFloat16, float, 2, 1, 1>, "
     "at::native::(anonymous namespace)::Copy<c10::BFloat16, float> >(int)", "dtype_cast"),
    ("void multi_tensor_apply_kernel<TensorListMetadata<3>, AdamFunctor<float>, float, float>(long)", "elementwise"),
    # fp32 cuBLAS kernels (V100: the first type argument is float) are fp32, their half twins 16-bit
    ("void gemmSN_TN_kernel<float, 128, 16, 2, 4, 8, 9, false, cublasGemvTensorStridedBatched<float const>>", "fp32_gemm"),
    ("void gemmk1_kernel<int, float, 256, 5, false, false, false, false, cublasGemvTensorStridedBatched<float const>>",
     "fp32_gemm"),
    ("void dot_kernel<float, 128, 0, cublasDotParams<cublasGemvTensorStridedBatched<float const>>>", "fp32_gemm"),
    ("void gemmSN_TN_kernel<__half, 128, 16, 2, 4, 8, 9, false, cublasGemvTensorStridedBatched<__half const>>",
     "bf16_gemm"),
])
def test_named_families(table: ClassTable, name: str, want: str) -> None:
    assert classify_name(name, table=table).cls == want
