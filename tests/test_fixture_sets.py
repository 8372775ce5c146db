"""Every committed fixture set analyses with exit 0, and the TP1 sets' manifests agree with their raw events.

The raw-event checks read the traces with the standard library only (``raw_events``), independently of
traceinspect, so a manifest cannot claim a planted truth its traces do not hold.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from conftest import FIXTURES, analysed, fixture_dir, manifest, raw_events, run_cli

from traceinspect.document import dumps

SETS = sorted(str(p.parent.relative_to(FIXTURES)) for p in FIXTURES.glob("**/manifest.json"))
TP1 = [s for s in SETS if json.loads((FIXTURES / s / "manifest.json").read_text()).get("world_size") == 1]
CAST = ("direct_copy_kernel_cuda", "LoadWithCast")


def test_the_tp1_matrix_is_there() -> None:
    assert len(TP1) >= 8, TP1


def test_a_fixture_set_analyses_through_the_cli(tmp_path: Path) -> None:
    out = tmp_path / "analysis.json"
    r = run_cli("analyze", str(fixture_dir("kv-full-cast-graph")), "--json", str(out), "--quiet")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(out.read_text())["steps"]["count"] == manifest("kv-full-cast-graph")["steps_profiled"] - 2


@pytest.mark.parametrize("name", SETS)
def test_every_fixture_set_analyses(name: str) -> None:
    # the session's shared analysis (the other modules check the same sets): its document as --json writes it
    doc = json.loads(dumps(analysed(fixture_dir(name), "decode").to_json()))
    m = manifest(name)
    assert len(doc["ranks"]) == len(m["ranks"])
    # only a first or last step the recording cut is excluded, each with its reason
    edges = max(r["steps_excluded_edge"] for r in doc["ranks"])
    assert edges <= 2 and doc["steps"]["count"] == m["steps_profiled"] - edges
    assert all(x["why"].startswith("partial: ") for x in doc["steps"]["excluded"])
    assert len(doc["steps"]["excluded"]) == doc["steps"]["excluded_edge"]


def _is_cast(name: str) -> bool:
    return all(s in name for s in CAST)


@pytest.mark.parametrize("name", TP1)
def test_tp1_manifest_matches_raw_events(name: str) -> None:
    m = manifest(name)
    d = fixture_dir(name)
    ev = [e for e in raw_events(d / m["files"][0]) if e.get("ph") == "X"]
    L, steps = m["layers"], m["steps_profiled"]
    marker = (f"step[DECODE bs={m['batch']}]" if m["step_marker_kind"] == "span" else "ProfilerStep#")
    assert sum(1 for e in ev if e.get("cat") == "user_annotation" and e["name"].startswith(marker)) == steps
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    casts = [k for k in kernels if _is_cast(k["name"])]
    assert len(casts) == L * steps
    pk = m["planted_kernels"]
    assert sum(1 for k in kernels if k["name"] == pk["kv_write"]["kernel_name"]) == L * steps
    # the KV write is a Triton kernel: no aten op records it
    assert not any("index_copy" in e["name"] or "index_put" in e["name"] for e in ev if e.get("cat") == "cpu_op")
    assert sum(1 for e in ev if e["name"] == "cudaGraphLaunch") == (steps if m["cuda_graph"] else 0)
    share = sum(k["dur"] for k in casts) / sum(k["dur"] for k in kernels)
    assert abs(share - m["observed"]["per_rank"]["0"]["kv_cast_share_of_kernel_time"]) < 0.02
    if m["kv_mode"] == "full":
        assert share > 0.4  # the planted pathology dominates the GPU time
    # recorded shapes: eager traces, else the capture trace (if the set has one)
    shaped = [] if m["cuda_graph"] else ev
    if m["capture_files"]:
        shaped = [e for e in raw_events(d / m["capture_files"][0]) if e.get("ph") == "X"]
    ops = [e for e in shaped if e.get("cat") == "cpu_op"]
    if ops:
        pool = m["kv_pool_shape"]
        assert pool[1] == 1 and pool[0] == m["kv_pool_rows"]
        cast_in = [e["args"]["Input Dims"][0] for e in ops
                   if e["name"] == "aten::copy_" and e.get("args", {}).get("Input Dims", [[]])[0][1:] == [1, 576]]
        want = pk["kv_cast"]["input_shape"]
        assert cast_in and all(dims == want for dims in cast_in)
        eg = pk["expert_gemm"]
        w = [eg["shapes"]["up"][1], eg["shapes"]["down"][1]]
        ms = Counter(e["args"]["Input Dims"][0][-2] for e in ops if e["name"] == eg["cpu_op"]
                     and len(e.get("args", {}).get("Input Dims", [])) >= 2 and e["args"]["Input Dims"][1] in w)
        assert set(ms) == {m["per_expert_m"]}
        per_forward = eg["per_step"] * (1 if m["cuda_graph"] else steps)
        assert sum(ms.values()) == per_forward


@pytest.mark.parametrize("name", TP1)
def test_tp1_server_info_is_sglangs_shape(name: str) -> None:
    m = manifest(name)
    p = fixture_dir(name) / "server_info.json"
    if not m["server_info"]:
        assert not p.exists()
        return
    si = json.loads(p.read_text())
    assert "model_info" not in si and "num_hidden_layers" not in si  # /server_info carries neither
    assert si["version"] == "0.5.23" and si["frontend"] == "python"
    assert si["max_total_num_tokens"] == m["kv_pool_tokens"] and si["page_size"] == m["page_size"]
    assert si["kv_cache_dtype"] == "fp8_e4m3" and si["tp_size"] == 1
    assert si["internal_states"][0]["memory_usage"]["token_capacity"] == m["kv_pool_tokens"]
    assert si["disable_cuda_graph"] is (not m["cuda_graph"])
