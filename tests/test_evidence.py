"""Seed pathologies on trace sets built unlike the fixtures: no model_info in server_info.json (layers
from the trace's structure), a KV write by an unfamiliar (Triton) kernel, no capture trace, no recorded
shapes, MoE from plain GEMMs; and the undecided / unexplained entries every output shows."""

from __future__ import annotations

import gzip
import json
import shutil
from functools import cache
from pathlib import Path

import pytest
from conftest import fixture_dir, manifest, raw_cast_shares, rewrite_trace, run_cli

FULL = ["kv-full-cast-eager", "kv-full-cast-graph"]
GATHER = ["kv-gather-cast-eager", "kv-gather-cast-graph"]
KV_WRITE = "index_elementwise_kernel<128, 4, at::native::index_copy_kernel_impl"
TRITON_KV_WRITE = "_fwd_set_mla_kv_buffer_kernel"


def make_variant(src: Path, dst: Path, *, model_info: bool = True, server_info: bool = True, capture: bool = True,
                 triton_kv_write: bool = False, shapes: bool = True, rename_op: tuple[str, str] | None = None) -> Path:
    """A copy of a fixture set changed the way real sets differ from ours: server_info.json as SGLang
    returns it (no model_info block), no capture traces, the KV write done by a Triton kernel, no
    recorded shapes, or a CPU op renamed."""
    dst.mkdir(parents=True)
    si = json.loads((src / "server_info.json").read_text())
    if not model_info:
        si.pop("model_info", None)
    if server_info:
        (dst / "server_info.json").write_text(json.dumps(si))
    for p in sorted(src.glob("*-TP-*.trace.json.gz")):
        def edit(doc: dict) -> None:
            for e in doc["traceEvents"]:
                if triton_kv_write and e.get("cat") == "kernel" and KV_WRITE in e.get("name", ""):
                    e["name"] = TRITON_KV_WRITE
                if not shapes and e.get("cat") == "cpu_op":
                    for key in ("Input Dims", "Input type", "Concrete Inputs", "Input Strides"):
                        e.get("args", {}).pop(key, None)
                if rename_op and e.get("cat") == "cpu_op" and e.get("name") == rename_op[0]:
                    e["name"] = rename_op[1]
        rewrite_trace(p, dst / p.name, edit)
    cap = src / "graph_capture_profile"
    if capture and cap.is_dir():
        shutil.copytree(cap, dst / cap.name)
    return dst


@cache
def _analysed(name: str, tmp: str, **kw: bool) -> dict:
    from traceinspect.pipeline import Options, analyze

    d = make_variant(fixture_dir(name), Path(tmp) / f"{name}-{'-'.join(f'{k}{v}' for k, v in sorted(kw.items()))}",
                     **kw)
    return {"doc": analyze(str(d), Options(command="test")).to_json(), "dir": d}


@pytest.fixture(scope="module")
def tmp_module(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("variants"))


def _kv(doc: dict) -> list[dict]:
    return [f for f in doc["findings"] if f["rule"] == "kv-full-pool-cast"]


@pytest.mark.parametrize("triton", [False, True], ids=["aten-kv-write", "triton-kv-write"])
@pytest.mark.parametrize("name", FULL)
def test_full_pool_cast_fires_without_model_info(name: str, triton: bool, tmp_module: str) -> None:
    """server_info.json as SGLang returns it: the layer count comes from the trace's structure; the rule
    fires with it and with the cast kernels' share of the raw events' GPU time."""
    r = _analysed(name, tmp_module, model_info=False, triton_kv_write=triton)
    doc, man = r["doc"], manifest(name)
    facts = doc["run"]["facts"]
    assert facts["layers"]["value"] == man["layers"] and facts["layers"]["source"] == "trace_structure"
    assert "repeats a block" in facts["layers"]["detail"]
    fs = _kv(doc)
    assert len(fs) == 1, [f["rule"] for f in doc["findings"]]
    ev = fs[0]["evidence"]
    assert ev["layers"] == man["layers"] and ev["layers_source"] == "trace_structure"
    assert ev["calls_per_step"] == man["planted_kernels"]["kv_cast"]["per_step"]
    gpu, step = raw_cast_shares(r["dir"], doc["steps"])
    # the cast's share of the step time (the rule's evidence; the finding's share is its replayed saving's)
    # and the kv_cast class's share of the GPU time
    assert abs(fs[0]["evidence"]["step_share"] - step) <= 0.03, (fs[0]["evidence"]["step_share"], step)
    assert abs(doc["classes"]["kv_cast"]["share"] - gpu) <= 0.03, (doc["classes"]["kv_cast"]["share"], gpu)
    if triton:  # the unfamiliar KV write is not taken for anything it is not
        assert not any(k["cls"] == "kv_cast" for k in doc["top_kernels"] if TRITON_KV_WRITE in k["name"])


@pytest.mark.parametrize("name", GATHER)
def test_gather_then_cast_stays_silent_without_model_info(name: str, tmp_module: str) -> None:
    doc = _analysed(name, tmp_module, model_info=False, triton_kv_write=True)["doc"]
    assert _kv(doc) == []
    assert not [u for u in doc["undecided"] if u["rule"] == "kv-full-pool-cast"]


@pytest.mark.parametrize("name", FULL + GATHER)
def test_without_server_info_the_pool_comes_from_shapes(name: str, tmp_module: str) -> None:
    """No server_info.json at all: the pool is the per-layer tensor that is indexed and cast (recorded
    shapes, or the capture trace's); the rule fires on the full-pool sets only."""
    r = _analysed(name, tmp_module, server_info=False)
    doc, man = r["doc"], manifest(name)
    pool = doc["run"]["facts"]["kv_pool_tokens"]
    assert pool["value"] == man["kv_pool_tokens"] and pool["source"] in ("shapes", "capture_trace"), pool
    fs = _kv(doc)
    if name in FULL:
        gpu, step = raw_cast_shares(r["dir"], doc["steps"])
        assert len(fs) == 1 and abs(fs[0]["evidence"]["step_share"] - step) <= 0.03
        assert abs(doc["classes"]["kv_cast"]["share"] - gpu) <= 0.03
        assert fs[0]["evidence"]["layers"] == man["layers"]
    else:
        assert fs == []


def test_graph_cast_is_judged_on_capture_trace_shapes(tmp_module: str) -> None:
    """Replayed casts get the shapes of the op recovered from the capture trace, as eager ones do."""
    from traceinspect.pipeline import Options, analyze

    d = _analysed("kv-full-cast-graph", tmp_module, model_info=False)["dir"]
    a = analyze(str(d), Options(command="test"))
    ev = a.kernels.loc[a.kernels["cls"] == "kv_cast", "cls_evidence"].astype(str)
    assert len(ev) and ev.str.contains("op from graph capture trace: aten::copy_ input \\[524288, 576\\]").all(), \
        ev.iloc[0]
    assert a.run_model.source("kv_row_bytes") == "capture_trace"


def test_server_info_without_shapes_or_capture_is_undecided_everywhere(tmp_path: Path) -> None:
    """CUDA-graph replay, server_info.json, no capture trace: no KV finding, and an undecided entry
    naming the missing evidence and how to get it in the terminal, the JSON, the Markdown and the HTML."""
    d = make_variant(fixture_dir("kv-full-cast-graph"), tmp_path / "set", model_info=False, capture=False)
    out = tmp_path / "o"
    r = run_cli("analyze", str(d), "--json", f"{out}.json", "--markdown", f"{out}.md", "--html", f"{out}.html")
    assert r.returncode == 0, r.stderr
    doc = json.loads(Path(f"{out}.json").read_text())
    assert _kv(doc) == []
    (u,) = [u for u in doc["undecided"] if u["rule"] == "kv-full-pool-cast"]
    assert u["share"] > 0.5 and any(m.startswith("bytes_per_call") for m in u["missing"])
    assert any("--enable-profile-cuda-graph" in h for h in u["how_to_supply"]), u
    (x,) = [x for x in doc["unexplained"] if x["cls"] == "kv_cast"]
    assert x["share"] > 0.3 and any("kv-full-pool-cast could not decide" in e for e in x["explain_with"])
    md = Path(f"{out}.md").read_text().replace("\\", "")  # markdown escapes: kv\_cast
    html = Path(f"{out}.html").read_text()
    for text in (r.stdout, md, html):
        assert "kv-full-pool-cast could not decide" in text
        assert "--enable-profile-cuda-graph" in text
        assert "class kv_cast takes" in text
    # doctor names the rule the missing capture trace leaves undecided
    r = run_cli("doctor", str(d))
    assert "leaves undecided: kv-full-pool-cast" in r.stdout


def test_eager_without_recorded_shapes_says_how_to_record_them(tmp_path: Path) -> None:
    d = make_variant(fixture_dir("kv-full-cast-eager"), tmp_path / "set", shapes=False)
    from traceinspect.pipeline import Options, analyze

    doc = analyze(str(d), Options(command="test")).to_json()
    assert _kv(doc) == []
    (u,) = [u for u in doc["undecided"] if u["rule"] == "kv-full-pool-cast"]
    assert any("record_shapes" in h for h in u["how_to_supply"]), u


def test_expert_gemm_loop_without_a_moe_op_is_moe_gemm(tmp_path: Path) -> None:
    """A per-expert mm loop under an op that does not say 'moe', and no model_info: the expert count
    comes from the router's top-k shapes, the loop from the GEMM structure; per-expert M from shapes."""
    name = "moe-small-m-eager"
    d = make_variant(fixture_dir(name), tmp_path / "set", model_info=False,
                     rename_op=("tinymoe::fused_experts", "tinymodel::block_ffn"))
    from traceinspect.pipeline import Options, analyze

    a = analyze(str(d), Options(command="test"))
    man = manifest(name)
    assert a.run_model.value("experts") == man["experts"] and a.run_model.source("experts") == "shapes"
    assert a.run_model.value("top_k") == man["topk"]
    k = a.kernels
    moe = k[k["cls"] == "moe_gemm"]
    per_step = len(moe) / len(a.selected)
    assert per_step == man["planted_kernels"]["expert_gemm"]["per_step"]
    assert moe["cls_evidence"].astype(str).str.contains("one per expert").all()
    doc = a.to_json()
    assert doc["moe"]["per_expert_m"]["value"] == man["per_expert_m"]
    (f,) = [f for f in doc["findings"] if f["rule"] == "small-m-gemm"]
    assert f["evidence"]["is_moe"] is True and f["evidence"]["per_expert_m"] == man["per_expert_m"]
    assert f["message"].startswith("Expert GEMMs")


def test_variant_traces_are_what_they_claim(tmp_path: Path) -> None:
    """The derived sets change only what they say (guards the helpers above)."""
    d = make_variant(fixture_dir("kv-full-cast-eager"), tmp_path / "set", model_info=False, triton_kv_write=True)
    assert "model_info" not in json.loads((d / "server_info.json").read_text())
    with gzip.open(next(d.glob("*-TP-0.trace.json.gz")), "rt") as f:
        text = f.read()
    assert TRITON_KV_WRITE in text and KV_WRITE not in text
