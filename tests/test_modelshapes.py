"""GEMM shapes from the model config: CUDA-graph decode traces that record no shapes judged from the model's
HF config, the parallel sizes and each step's batch, as recorded shapes are judged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, copy_set, fixture_dir, real_trace

from traceinspect.errors import ConfigError
from traceinspect.model.run import user_facts
from traceinspect.pipeline import analyze

TINY = FIXTURES / "generate" / "tiny-mla-moe.config.json"
QWEN3 = Path(__file__).resolve().parents[1].parent.parent / "shared" / "model-configs" / "qwen3-8b.config.json"
QWEN3_TRACE = "tracelens__inference__sglang_decode__sglang_Qwen3-8B_decode.json.gz"
QWEN3_CAPTURE = "tracelens__inference__sglang_decode__capture_traces__bs_32_rank0.json.gz"


def _qwen3_config() -> Path:
    for p in (QWEN3, Path("/work/shared/model-configs/qwen3-8b.config.json")):
        if p.is_file():
            return p
    pytest.skip("the shared Qwen3-8B config.json is not here")


def _doc(path: Path, **kw: Any) -> dict[str, Any]:
    return analyze([str(path)], jobs=1, use_cache=False, **kw).to_json(report=False)


def _shapes(doc: dict[str, Any]) -> dict[tuple[Any, ...], int]:
    """(cls, dtype, M, N, K, batch, groups) -> calls of the GEMM rows with known shapes."""
    return {(g["cls"], g["dtype"], g["m"], g["n"], g["k"], g["batch"], g["groups"]): g["calls"]
            for g in doc["gemm"] if g["m"] is not None}


def _qwen3_sets(tmp_path: Path) -> tuple[Path, Path]:
    with_cap = tmp_path / "with"
    (with_cap / "graph_capture_profile").mkdir(parents=True)
    shutil.copy(real_trace(QWEN3_TRACE), with_cap / QWEN3_TRACE)
    shutil.copy(real_trace(QWEN3_CAPTURE), with_cap / "graph_capture_profile" / QWEN3_CAPTURE)
    without = tmp_path / "without"
    without.mkdir()
    shutil.copy(real_trace(QWEN3_TRACE), without / QWEN3_TRACE)
    return with_cap, without


def test_qwen3_shapes_from_the_config_are_those_of_the_capture_trace(tmp_path: Path) -> None:
    with_cap, without = _qwen3_sets(tmp_path)
    cap = _doc(with_cap)
    model = _doc(without, model_config=str(_qwen3_config()))
    assert all(g["shape_source"] == "graph_capture" for g in cap["gemm"])
    assert all(g["shape_source"] == "model_config" and g["confidence"] == "high" for g in model["gemm"])
    # M, N, K of every GEMM: the same from the model config as from the capture trace
    assert _shapes(model) == _shapes(cap)
    by_op = {g["op"]: (g["m"], g["n"], g["k"]) for g in model["gemm"]}
    assert by_op == {"qkv_proj": (32, 6144, 4096), "o_proj": (32, 4096, 4096), "gate_up_proj": (32, 24576, 4096),
                     "down_proj": (32, 4096, 12288), "lm_head": (32, 151936, 4096)}
    assert [g["tflops"] for g in model["gemm"]] == [g["tflops"] for g in cap["gemm"]]
    facts = model["run"]["facts"]
    assert facts["gemm_shapes"]["source"] == "model_config" and facts["gemm_shapes"]["confidence"] == "high"
    assert (facts["attention_heads"]["value"], facts["kv_heads"]["value"], facts["head_dim"]["value"]) == (32, 8, 128)
    # without a model config the GEMM table says what would give the shapes
    blind = _doc(without)
    assert all(g["shape_source"] == "unknown" and "--model-config" in g["reason"] for g in blind["gemm"])


def test_a_recorded_shape_that_differs_from_the_model_is_a_warning_naming_both(tmp_path: Path) -> None:
    with_cap, _ = _qwen3_sets(tmp_path)
    cfg = json.loads(_qwen3_config().read_text())
    cfg["intermediate_size"] = 11008
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(cfg))
    doc = _doc(with_cap, model_config=str(wrong))
    assert all(g["shape_source"] == "graph_capture" for g in doc["gemm"])  # recorded shapes win
    warn = [w for w in doc["warnings"] if "differs from the model config" in w]
    assert any("M=32 N=24576 K=4096" in w and "gate_up_proj (M=32 N=22016 K=4096" in w for w in warn), warn


def test_mla_moe_graph_set_without_capture_gets_its_shapes_from_the_config(tmp_path: Path) -> None:
    nocap = fixture_dir("tp1-l6-full-graph-nocapture")
    man = json.loads((nocap / "manifest.json").read_text())
    doc = _doc(nocap, model_config=str(TINY))
    cap = _doc(fixture_dir("tp1-l6-full-graph"))
    rows = {g["op"]: g for g in doc["gemm"] if g["shape_source"] == "model_config"}
    w13, w2 = rows["experts.w13"], rows["experts.w2"]
    expect = man["batch"] * man["topk"] / man["experts"]
    for g in (w13, w2):
        assert g["cls"] == "moe_gemm" and abs(g["m"] - expect) <= 0.1 * expect
    assert (w13["n"], w13["k"], w2["n"], w2["k"]) == (2 * man["moe_intermediate"], man["hidden_size"],
                                                     man["hidden_size"], man["moe_intermediate"])
    # FLOPs from the model's shapes: 2 M N K per call
    assert w13["gflop"] == pytest.approx(2 * w13["m"] * w13["n"] * w13["k"] * w13["calls"] / 1e9, rel=1e-3)
    assert doc["moe"]["per_expert_m"]["source"] == "model_config"
    assert doc["moe"]["per_expert_m"]["value"] == pytest.approx(expect, rel=0.1)
    # every GEMM the capture trace records (weight GEMMs; attention's batched GEMMs are not the model's)
    weights = {k: v for k, v in _shapes(cap).items() if not (k[0] == "bf16_gemm" and k[5] == man["batch"])}
    assert _shapes(doc) == weights


def _bs16_nocapture(tmp_path: Path) -> Path:
    return copy_set(fixture_dir("tp1-l6-gather-graph-bs16"), tmp_path / "bs16-nocapture")


def test_small_m_fires_with_the_config_and_is_undecided_naming_it_without(tmp_path: Path) -> None:
    d = _bs16_nocapture(tmp_path)
    blind = _doc(d)
    assert not any(f["rule"] == "small-m-gemm" for f in blind["findings"])
    und = [u for u in blind["undecided"] if u["rule"] == "small-m-gemm"]
    assert und and any("--model-config" in s for s in und[0]["how_to_supply"])
    gemm = [u for u in blind["unexplained"] if u["cls"].endswith("_gemm")]
    assert gemm and all("rule small-m-gemm could not decide (missing: m)" in u["explain_with"][0] for u in gemm)
    assert not any("no rule is about" in e for u in gemm for e in u["explain_with"])
    doc = _doc(d, model_config=str(TINY))
    f = [f for f in doc["findings"] if f["rule"] == "small-m-gemm"]
    assert f and f[0]["evidence"]["is_moe"] and f[0]["evidence"]["per_expert_m"] == pytest.approx(16 * 8 / 16)
    assert not [u for u in doc["undecided"] if u["rule"] == "small-m-gemm"]


def test_the_model_config_comes_from_flag_toml_or_server_info(tmp_path: Path) -> None:
    toml = tmp_path / "traceinspect.toml"
    toml.write_text('[model]\nconfig = "tiny.json"\n')
    shutil.copy(TINY, tmp_path / "tiny.json")
    facts = user_facts(config=toml)
    assert facts["model_config"][0]["model_type"] == "deepseek_v3"
    # capture's server_info.json block
    from traceinspect.capture.modelconfig import pick

    d = copy_set(fixture_dir("tp1-l6-gather-graph-bs16"), tmp_path / "si")
    si = json.loads((d / "server_info.json").read_text())
    si["model_config"] = {**pick(json.loads(TINY.read_text())), "source": "/models/tiny-mla-moe/config.json"}
    (d / "server_info.json").write_text(json.dumps(si))
    doc = _doc(d)
    assert doc["run"]["facts"]["model_config"]["source"] == "server_info"
    assert any(g["shape_source"] == "model_config" for g in doc["gemm"])
    assert any(f["rule"] == "small-m-gemm" for f in doc["findings"])


def test_unusable_model_configs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        user_facts(model_config=tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"vocab_size": 5}')
    with pytest.raises(ConfigError, match="not a Hugging Face model config"):
        user_facts(model_config=bad)
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8, "num_hidden_layers": 2}))
    doc = _doc(fixture_dir("tp1-l6-full-graph-nocapture"), model_config=str(odd))
    assert "in no family" in doc["run"]["facts"]["model_config"]["detail"]
    assert all(g["shape_source"] == "unknown" for g in doc["gemm"])


def test_vllm_gpt_oss_graph_decode_gets_its_batch_from_the_generation_marker() -> None:
    """vLLM's full CUDA-graph decode of a gpt-oss model: the batch is the marker's generation_M, every GEMM
    kernel of the step is matched, and the lm_head's recorded shape agrees with the model's."""
    trace = real_trace("tracelens__inference__vllm_decode_full__graph_execution.json.gz")
    cfg = Path(__file__).parent / "data" / "gpt-oss-20b.config.json"
    doc = _doc(trace, model_config=str(cfg))
    assert doc["run"]["facts"]["gemm_shapes"]["confidence"] == "high"
    rows = {g["op"]: g for g in doc["gemm"]}
    assert rows["qkv_proj"]["m"] == 32 and rows["qkv_proj"]["n"] == (64 + 2 * 8) * 64
    w13 = rows["experts.w13"]
    assert w13["cls"] == "moe_gemm" and w13["groups"] == 32 and w13["m"] / w13["groups"] == 32 * 4 / 32
    assert doc["moe"]["per_expert_m"]["value"] == 4
    assert not [w for w in doc["warnings"] if "differs from the model config" in w]
    assert all(g["shape_source"] != "unknown" for g in doc["gemm"])


def _by_name(layer: Any) -> dict[str, tuple[int, int, int]]:
    return {g.name: (g.n, g.k, g.batch) for g in layer.pre + layer.post}


def test_per_rank_gemms_of_the_families() -> None:
    """N and K per rank as the engines shard them: column-parallel N / TP, row-parallel K / TP, experts by
    TP / EP, MLA's absorbed batched GEMMs over the rank's heads, dense first layers."""
    from traceinspect.classify.modelshapes import plan

    dsv3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128,
            "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
            "v_head_dim": 128, "n_routed_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 2048,
            "n_shared_experts": 1, "first_k_dense_replace": 3, "intermediate_size": 18432, "vocab_size": 129280}
    p, why = plan(dsv3, "dsv3", tp=8, ep=8)
    assert p is not None, why
    assert sum(lay.moe for lay in p.layers) == 58 and not any(lay.moe for lay in p.layers[:3])
    dense, moe = _by_name(p.layers[0]), _by_name(p.layers[3])
    assert dense["fused_qkv_a_proj_with_mqa"] == (1536 + 512 + 64, 7168, 1)
    assert dense["q_b_proj"] == (128 * 192 // 8, 1536, 1)
    assert dense["w_kc"] == (512, 128, 16) and dense["w_vc"] == (128, 512, 16)
    assert dense["o_proj"] == (7168, 128 * 128 // 8, 1)
    assert dense["gate_up_proj"] == (2 * 18432 // 8, 7168, 1) and dense["down_proj"] == (7168, 18432 // 8, 1)
    assert moe["gate"] == (256, 7168, 1)
    assert moe["experts.w13"] == (2 * 2048, 7168, 1) and moe["experts.w2"] == (7168, 2048, 1)  # EP = TP: whole
    assert moe["shared_experts.gate_up_proj"] == (2 * 2048 // 8, 7168, 1)
    assert p.local_experts == 32 and (p.heads, p.kv_heads, p.head_dim) == (16, 1, 576)
    assert p.tail[0].n == 129280 // 8

    qwen3moe = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
                "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                "moe_intermediate_size": 768, "intermediate_size": 6144, "vocab_size": 151936}
    p, why = plan(qwen3moe, "q3moe", tp=8)
    assert p is not None, why
    lay = _by_name(p.layers[0])
    assert lay["qkv_proj"] == ((4 + 2 * 1) * 128, 2048, 1)  # 4 KV heads over 8 ranks: one per rank, replicated
    assert lay["experts.w13"] == (2 * 768 // 8, 2048, 1) and lay["experts.w2"] == (2048, 768 // 8, 1)
    assert "shared_expert.gate_up_proj" not in lay and all(la.moe for la in p.layers)

    mixtral = {"model_type": "mixtral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
               "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
               "intermediate_size": 14336, "vocab_size": 32000}
    p, why = plan(mixtral, "mixtral", tp=2)
    assert p is not None, why
    assert _by_name(p.layers[0])["experts.w13"] == (14336, 4096, 1) and p.top_k == 2
    assert plan({"model_type": "deepseek_v3", "hidden_size": 8, "num_hidden_layers": 2}, "x")[0] is None
