"""Every GPU fixture set against its manifest's planted truth: the whole-pool KV cast is found on every
full-pool set (eager and CUDA graph, any layer count, with or without a recognisable KV-write kernel,
with or without model_info) with the right layer count and the cast kernels' share of the raw events'
GPU time, never on a gather set; a graph set without capture trace leaves it undecided, visibly; expert
GEMMs of every MoE form are moe_gemm with the planted per-expert M."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from conftest import FIXTURES, analysed, raw_cast_share, raw_cast_shares


def _sets() -> list[str]:
    out = []
    for m in sorted(FIXTURES.glob("**/manifest.json")):
        man = json.loads(m.read_text())
        if man.get("kv_mode") in ("full", "gather") and list(m.parent.glob("*.trace.json*")):
            out.append(str(m.parent.relative_to(FIXTURES)))
    return out


SETS = _sets()


def _man(name: str) -> dict:
    return json.loads((FIXTURES / name / "manifest.json").read_text())


def _has_capture(name: str) -> bool:
    return any((FIXTURES / name).glob("graph_capture_profile/*.json*"))


@cache
def _doc(name: str) -> dict:
    # decode workloads; sets whose steps carry no phase marker (ProfilerStep#N) are analysed as decode
    return analysed(FIXTURES / name, "decode").to_json()


@pytest.mark.parametrize("name", SETS)
def test_kv_full_pool_cast_on_every_set(name: str) -> None:
    man, doc = _man(name), _doc(name)
    kv = [f for f in doc["findings"] if f["rule"] == "kv-full-pool-cast"]
    undecided = [u for u in doc["undecided"] if u["rule"] == "kv-full-pool-cast"]
    if man["kv_mode"] == "gather":
        assert kv == [], kv
        if man.get("cuda_graph") and not _has_capture(name):
            # the cast of the active rows, replayed without shapes: whether it casts the pool cannot be told
            # from the trace, and the user is told how to record it
            assert not undecided or any("--enable-profile-cuda-graph" in h for h in undecided[0]["how_to_supply"])
        else:
            assert undecided == [], undecided
        return
    if man.get("cuda_graph") and not _has_capture(name):
        # replayed kernels without a capture trace: no shapes, so no finding, and the user is told why
        assert kv == [], kv
        assert undecided and any("--enable-profile-cuda-graph" in h for h in undecided[0]["how_to_supply"])
        assert any(x["cls"] == "kv_cast" for x in doc["unexplained"]), doc["unexplained"]
        return
    assert len(kv) == 1, [f["rule"] for f in doc["findings"]]
    ev = kv[0]["evidence"]
    assert ev["layers"] == man["layers"], (ev["layers"], ev.get("layers_source"))
    assert ev["calls_per_step"] == man["planted_kernels"]["kv_cast"]["per_step"]
    gpu, step = raw_cast_shares(FIXTURES / name, doc["steps"])
    # the cast's share of the step time (the rule's evidence; the finding's share is its replayed saving's)
    # and the kv_cast class's share of the GPU time
    assert abs(kv[0]["evidence"]["step_share"] - step) <= 0.03, (kv[0]["evidence"]["step_share"], step)
    assert abs(doc["classes"]["kv_cast"]["share"] - gpu) <= 0.03, (doc["classes"]["kv_cast"]["share"], gpu)


@pytest.mark.parametrize("name", [s for s in SETS if _man(s).get("per_expert_m")])
def test_expert_gemms_are_moe_gemm_with_the_planted_m(name: str) -> None:
    man, doc = _man(name), _doc(name)
    if man.get("cuda_graph") and not _has_capture(name):
        pytest.skip("no shapes for replayed kernels without a capture trace")
    pem = doc["moe"]["per_expert_m"]
    assert pem["value"] == pytest.approx(man["per_expert_m"]), pem
    moe = doc["classes"].get("moe_gemm")
    assert moe is not None, doc["classes"]
    planted = (man.get("planted_kernels") or {}).get("expert_gemm") or {}
    if "per_step" in planted and "moe_form" in man:  # the TP1 matrix counts expert GEMM kernels per step
        assert moe["calls_per_step"] == planted["per_step"], (moe, planted)


def test_the_matrix_has_what_it_claims() -> None:
    """The committed sets cover full and gather, eager and graph (a check on this file's parametrisation)."""
    modes = {(_man(s)["kv_mode"], bool(_man(s).get("cuda_graph"))) for s in SETS}
    assert {("full", False), ("full", True), ("gather", False), ("gather", True)} <= modes, modes


def test_raw_share_reader_sees_every_rank(tmp_path: Path) -> None:
    """raw_cast_share over a set equals the mean over its single-rank halves (both ranks are read)."""
    import shutil

    src = FIXTURES / "kv-full-cast-graph"
    if not src.is_dir():
        pytest.skip("fixture not present")
    whole = raw_cast_share(src)
    halves = []
    for r in (0, 1):
        d = tmp_path / f"r{r}"
        d.mkdir()
        shutil.copy(src / f"fixture-TP-{r}.trace.json.gz", d)
        halves.append(raw_cast_share(d))
    assert min(halves) <= whole <= max(halves)
