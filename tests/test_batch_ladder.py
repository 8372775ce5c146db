"""The batch ladder: one MoE decoder (16 experts, top-8) replayed from CUDA graphs with no capture trace, at
decode batches 2, 8, 32, 128 and 512 (per-expert M 1, 4, 16, 64 and 256), each profiled on a GPU with its
measured step. From the model config the tool derives every expert GEMM's shape and per-expert M, judges
small M, and predicts each rung's step from the rung below (``whatif --batch 4x``)."""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, fixture_dir, run_cli

from traceinspect.pipeline import Options, analyze

BATCHES = (2, 8, 32, 128, 512)
TINY = FIXTURES / "generate" / "tiny-mla-moe.config.json"
STEP_TOL = 0.15  # a rung's predicted step against the step measured at that batch


def _set(b: int) -> Path:
    return fixture_dir(f"tp1-l6-gather-graph-nocapture-bs{b}")


@cache
def _doc(b: int, config: bool = True) -> dict[str, Any]:
    opts = Options(command="test", use_cache=False, model_config=str(TINY) if config else None)
    return analyze(str(_set(b)), opts).to_json()


@pytest.mark.parametrize("b", BATCHES)
def test_expert_gemms_carry_per_expert_m_and_flops_from_the_model(b: int) -> None:
    man = json.loads((_set(b) / "manifest.json").read_text())
    assert man["batch"] == b and man["capture_files"] == []  # no capture trace: no recorded shapes
    doc = _doc(b)
    expect = b * man["topk"] / man["experts"]
    experts = [g for g in doc["gemm"] if g["cls"] == "moe_gemm"]
    assert experts and all(g["shape_source"] == "model_config" for g in experts)
    for g in experts:
        assert abs(g["m"] - expect) <= 0.1 * expect
        assert g["gflop"] == pytest.approx(2 * g["m"] * g["n"] * g["k"] * g["calls"] / 1e9, rel=1e-3)
    assert doc["moe"]["per_expert_m"]["value"] == pytest.approx(expect, rel=0.1)
    fired = [f for f in doc["findings"] if f["rule"] == "small-m-gemm" and f["evidence"].get("is_moe")]
    if expect <= 16:
        assert fired and fired[0]["evidence"]["per_expert_m"] == pytest.approx(expect, rel=0.1)


def test_without_the_model_config_small_m_is_undecided_naming_it_in_every_output(tmp_path: Path) -> None:
    doc = _doc(2, config=False)
    assert not any(f["rule"] == "small-m-gemm" for f in doc["findings"])
    und = [u for u in doc["undecided"] if u["rule"] == "small-m-gemm"]
    assert und and any("--model-config" in s for s in und[0]["how_to_supply"])
    out = tmp_path / "r"
    r = run_cli("report", str(_set(2)), "--no-cache", "-o", str(out.with_suffix(".html")), "--markdown",
                str(out.with_suffix(".md")), "--json", str(out.with_suffix(".json")))
    assert r.returncode == 0, r.stderr
    a = run_cli("analyze", str(_set(2)), "--no-cache")
    assert a.returncode == 0, a.stderr
    for text in (a.stdout, out.with_suffix(".md").read_text(), out.with_suffix(".html").read_text(),
                 out.with_suffix(".json").read_text()):
        flat = " ".join(text.split())
        assert "small-m-gemm" in flat and "--model-config" in flat
        assert "no rule is about class moe_gemm" not in flat and "no rule is about class bf16_gemm" not in flat


@pytest.mark.parametrize("b", BATCHES[:-1])
def test_whatif_batch_4x_predicts_the_next_rung(b: int, tmp_path: Path) -> None:
    """Each rung predicts the rung 4x its batch (the server's max_running_requests, which the profiled server
    set to its own batch, raised to the new one) within STEP_TOL, and prints tokens/s."""
    j = tmp_path / "w.json"
    r = run_cli("whatif", str(_set(b)), "--no-cache", "--model-config", str(TINY), "--batch", "4x",
                "--max-running-requests", str(4 * b), "--json", str(j))
    assert r.returncode == 0, r.stderr
    p = json.loads(j.read_text())
    assert p["batch"]["observed"] == b and p["batch"]["predicted"] == 4 * b
    measured = _doc(4 * b)["steps"]["median_us"]
    err = p["predicted_step_us"] / measured - 1.0
    assert abs(err) <= STEP_TOL, f"batch {b} -> {4 * b}: step {p['predicted_step_us']:,.0f} us predicted, " \
                                 f"{measured:,.0f} us measured ({err:+.1%})"
    assert p["predicted_tokens_per_s"] == pytest.approx(4 * b * 1e6 / p["predicted_step_us"], rel=1e-5)
    assert re.search(r"tokens/s\s+[\d,]+\s+[\d,]+\s+[\d,]+\s+\(batch " + f"{b:,} -> {4 * b:,}", r.stdout), r.stdout


def test_the_server_cap_binds_and_is_named() -> None:
    """As profiled, each server held exactly its batch (max_running_requests = batch): 4x is capped there."""
    r = run_cli("whatif", str(_set(8)), "--no-cache", "--model-config", str(TINY), "--batch", "4x")
    assert r.returncode == 0, r.stderr
    assert "capped at 8 by max_running_requests" in r.stdout
