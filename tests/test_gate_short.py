"""The gate on short captures: per-step samples pooled across ranks where valid, how many steps the
noise test needs, a collective's growth attributed to waiting or transfer, and the server-config keys
that differ between two trace sets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import fixture_dir

from traceinspect.gate import Gate
from traceinspect.gate.diff import diff_documents
from traceinspect.gate.outputs import diff_markdown, diff_text, gate_text
from traceinspect.gate.stats import EDGE_STEPS, noise_test, samples_needed


@pytest.fixture(scope="module")
def eager_doc() -> dict:
    from traceinspect.pipeline import analyze

    return analyze(str(fixture_dir("kv-full-cast-eager")), jobs=1).to_json()


def _short(doc: dict, n: int = 3) -> dict:
    """The document as a 5-step capture gives it: 3 analysed steps per rank."""
    d = copy.deepcopy(doc)
    ranks = d["run"]["ranks"]
    d["steps"]["samples"] = d["steps"]["samples"][:n]
    d["steps"]["rank_samples"] = [s for r in range(ranks)
                                  for s in [x for x in d["steps"]["rank_samples"] if x["rank"] == r][:n]]
    d["steps"]["count"] = n
    return d


def _scale_class(doc: dict, cls: str, f: float) -> dict:
    d = copy.deepcopy(doc)
    d["classes"][cls]["us_per_step"] *= f
    for s in d["steps"]["samples"] + d["steps"]["rank_samples"]:
        if cls in s["classes"]:
            s["classes"][cls] *= f
    return d


def _add_class(doc: dict, cls: str, us: float) -> dict:
    d = copy.deepcopy(doc)
    d["classes"][cls]["us_per_step"] += us
    for s in d["steps"]["samples"]:
        s["classes"][cls] = s["classes"].get(cls, 0.0) + us
    for s in d["steps"]["rank_samples"]:
        s["classes"][cls] = s["classes"].get(cls, 0.0) + us
    return d


def test_samples_needed_and_the_capture_default() -> None:
    from traceinspect.capture.options import DEFAULT_STEPS

    assert samples_needed(0.05) == 4  # 1/C(8,4) = 1/70 < 0.05; 3 vs 3 reaches only 1/20
    assert samples_needed(0.01) == 5
    assert samples_needed(0.05, n_other=8) == 3  # the test never runs on fewer than 3
    assert DEFAULT_STEPS == 4 + EDGE_STEPS
    r = noise_test([1.0, 2.0, 3.0], [7.0, 8.0, 9.0])
    assert not r.decided and "needs at least 4 per-step samples on each side" in r.reason
    assert "capture --steps 6" in r.reason


def test_pooled_rank_samples_let_a_short_capture_decide(eager_doc) -> None:
    base = _short(eager_doc)
    cand = _scale_class(base, "kv_cast", 1.5)
    assert len(base["steps"]["samples"]) == 3 and len(base["steps"]["rank_samples"]) == 6
    result = Gate(["class.kv_cast:10%"]).run(base, cand)  # a class threshold written: it gates on its own
    c = next(c for c in result.checks if c.id == "class.kv_cast")
    assert c.status == "fail", c.message
    assert c.data["noise"]["decided"] and c.data["noise"]["n_base"] == 6
    assert "pooled" in c.data["noise"]["pooled"]
    # the step time (the slowest rank's span) is never pooled; the output says what the test needs
    d = diff_documents(base, cand)
    assert d.step.pooled is None and len(d.step.base_samples) == 3
    text = gate_text(result)
    assert "needs at least 4 per-step samples on each side" in text
    # collectives wait on other ranks: their samples are not pooled
    comm = next(m for m in d.classes if m.metric == "class.comm")
    assert comm.pooled is None and len(comm.base_samples) == 3


def test_collective_wait_growth_points_at_the_late_rank(eager_doc) -> None:
    base = copy.deepcopy(eager_doc)
    grow = base["classes"]["comm"]["us_per_step"] * 2.25  # class.comm +225%
    cand = _add_class(base, "comm", grow)
    per = {r["rank"]: r for r in cand["collectives"]["per_rank"]}
    for r in per.values():
        r["wait_us_per_step"] += grow
    per[1]["wait_caused_us_per_step"] += 2 * grow  # TP1 arrives late: the others wait for it
    # the step time did not change: the late rank explains nothing failing, and is a warning
    result = Gate().run(base, cand)
    assert result.exit_code == 0 and result.verdict().startswith("PASS")
    c = next(c for c in result.checks if c.id == "late-rank.TP1")
    assert c.status == "warn" and "TP1 arrives late" in c.message and "not at the collectives" in c.message
    assert "class.comm" not in [c.id for c in result.checks]
    # the step grew too: the late rank explains the failing step
    slow = copy.deepcopy(cand)
    for s in slow["steps"]["samples"]:
        s["step_us"] += grow
    slow["steps"]["median_us"] += grow
    result = Gate().run(base, slow)
    assert result.exit_code == 1
    assert "late-rank.TP1" in [c.id for c in result.failing()]
    assert "step regressed" in result.verdict() and "class.comm" in result.verdict()
    assert "(TP1 arrives late)" in result.verdict(), result.verdict()
    # transfer growth stays a collective regression; a class.comm threshold written gates it on its own
    cand2 = _add_class(base, "comm", grow)
    for r in cand2["collectives"]["per_rank"]:
        r["transfer_us_per_step"] += grow
    r2 = Gate(["class.comm:10%"]).run(base, cand2)
    c2 = next(c for c in r2.checks if c.id == "class.comm")
    assert c2.status == "fail" and "the growth is transfer" in c2.message and r2.exit_code == 1


def test_diff_and_gate_name_the_server_config_keys_that_differ(eager_doc, tmp_path: Path) -> None:
    base = copy.deepcopy(eager_doc)
    assert base["server_config"]["max_running_requests"] == 256
    cand = copy.deepcopy(base)
    cand["server_config"]["max_running_requests"] = 2048
    cand["server_config"]["num_continuous_decode_steps"] = 8
    d = diff_documents(base, cand)
    assert {r["key"] for r in d.server_config} == {"max_running_requests", "num_continuous_decode_steps"}
    text = diff_text(d)
    assert "server config: 2 key(s) differ (1 set in both runs, 1 in one run only):" in text
    assert "    max_running_requests: 256 -> 2048" in text
    assert "num_continuous_decode_steps: absent -> 8" in text
    assert "max\\_running\\_requests" in diff_markdown(d)
    assert "    max_running_requests: 256 -> 2048" in gate_text(Gate().run(base, cand))
    assert diff_documents(base, copy.deepcopy(base)).server_config == []
    old = copy.deepcopy(base)
    del old["server_config"]
    assert "not compared" in diff_text(diff_documents(old, cand))


def test_check_expected_reads_nested_and_resolved_values() -> None:
    from traceinspect.capture.errors import ServerMismatch
    from traceinspect.capture.expect import check_expected

    info = {"max_running_requests": None, "tp_size": 2, "disable_cuda_graph": False,
            "internal_states": [{"max_running_requests": 2048}], "model_info": {"num_hidden_layers": 4}}
    check_expected(info, (("max_running_requests", "2048"), ("tp_size", "2"), ("disable_cuda_graph", "false"),
                          ("model_info.num_hidden_layers", "4")))
    with pytest.raises(ServerMismatch) as e:
        check_expected(info, (("tp_size", "4"), ("num_continuous_decode_steps", "8")))
    msg = e.value.one_line()
    assert "tp_size: expected 4, actual 2" in msg
    assert "num_continuous_decode_steps: expected 8, actual: not in /server_info" in msg
