"""The server's load a capture records (capture.json ``server_load``) and the analysis reading it as run facts;
the active KV rows of a gather whose index Kineto does not record (a TensorList), from the op that reads them.
The capture against the stand-in server: ``test_capture.py``."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import httpx
import pytest
from conftest import fixture_dir

from traceinspect.capture.client import SGLangClient
from traceinspect.capture.loadsample import LoadSampler
from traceinspect.model.run import Fact, undecided
from traceinspect.model.serverload import ServerLoad, load_facts
from traceinspect.pipeline import analyze
from traceinspect.whatif.kvrows import active_kv_rows

POOL = 524288  # max_total_num_tokens of the tp1-l6 fixtures' server_info.json


def _sample(at: str, t: float, running: int, used: int | None, source: str = "/v1/loads") -> dict:
    return {"at": at, "t_s": t, "running": running, "waiting": 0, "used_tokens": used,
            "max_total_num_tokens": POOL, "token_usage": None, "source": source}


def _capture(*samples: dict) -> dict:
    return {"schema": "traceinspect.capture/1", "server_load": {"samples": list(samples), "interval_s": 1.0}}


# -- the record read as facts ----------------------------------------------------------------------------

def test_server_batch_used_where_the_steps_carry_no_marker() -> None:
    facts = {"batch": undecided("steps carry no bs=N annotation")}
    warn = load_facts(facts, _capture(_sample("start", -0.01, 32, 40_000), _sample("end", 2.0, 32, 40_960)))
    assert warn == []
    assert facts["batch"].value == 32 and facts["batch"].source == "server_load"
    assert facts["batch"].confidence == "medium" and "no bs=N" in facts["batch"].detail
    kv = facts["kv_tokens_in_use"]
    assert kv.value == 40_480 and kv.source == "server_load" and "2 sample(s)" in kv.detail


def test_marker_wins_and_a_large_disagreement_names_both() -> None:
    facts = {"batch": Fact(256.0, "trace_structure", "high", "median bs=N of the step annotations")}
    warn = load_facts(facts, _capture(_sample("start", 0.0, 6, 900), _sample("end", 1.0, 6, 930)))
    assert facts["batch"].value == 256.0 and facts["batch"].source == "trace_structure"
    assert facts["running_requests"].value == 6
    assert len(warn) == 1 and "256" in warn[0] and "6 running requests" in warn[0]
    facts = {"batch": Fact(30.0, "trace_structure", "high", "median bs=N")}
    assert load_facts(facts, _capture(_sample("start", 0.0, 32, 900))) == []  # close enough: no warning


def test_moving_load_and_dp_ranks_lower_the_confidence() -> None:
    cap = _capture(_sample("start", 0.0, 16, 1000), _sample("during", 1.0, 32, 2000), _sample("end", 2.0, 32, 2000))
    f = ServerLoad(cap).fact("running")
    assert f is not None and f.value == 32 and f.confidence == "low" and "differ" in f.detail
    f = ServerLoad(_capture(_sample("start", 0.0, 64, 8000))).fact("used_tokens", dp_size=4)
    assert f is not None and f.value == 2000 and f.confidence == "low" and "dp_size=4" in f.detail


def test_no_record_or_metrics_without_used_tokens() -> None:
    facts = {"batch": undecided("steps carry no bs=N annotation")}
    assert load_facts(facts, None) == [] and set(facts) == {"batch"}
    assert load_facts(facts, {"server_load": {"samples": [], "problem": "no load"}}) == []
    load_facts(facts, _capture(_sample("start", 0.0, 8, None, "/metrics")))
    assert facts["batch"].value == 8 and "kv_tokens_in_use" not in facts  # /metrics has no token count


def test_sampler_records_times_and_what_the_server_reports() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/loads"
        return httpx.Response(200, json={"loads": [
            {"dp_rank": 0, "num_running_reqs": 5, "num_waiting_reqs": 1, "num_used_tokens": 700,
             "max_total_num_tokens": 4096, "max_running_requests": 48, "token_usage": 0.17, "gen_throughput": 9.0},
            {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 0, "num_used_tokens": 300,
             "max_total_num_tokens": 4096, "max_running_requests": 48, "token_usage": 0.07, "gen_throughput": 4.0}]})

    with SGLangClient("http://127.0.0.1:1", transport=httpx.MockTransport(handler)) as c:
        s = LoadSampler(c, interval_s=0.0)
        s.sample("start")
        s.profile_started()
        s.maybe_sample()
        s.sample("end")
    rec = s.record()
    assert [x["at"] for x in rec["samples"]] == ["start", "during", "end"]
    first = rec["samples"][0]
    assert first["running"] == 8 and first["waiting"] == 1 and first["used_tokens"] == 1000
    assert first["max_total_num_tokens"] == 8192 and first["source"] == "/v1/loads"
    assert first["t_s"] <= 0 <= rec["samples"][-1]["t_s"] and "_mono" not in first and "problem" not in rec


def test_sampler_notes_a_server_without_load() -> None:
    with SGLangClient("http://127.0.0.1:1", transport=httpx.MockTransport(lambda r: httpx.Response(404))) as c:
        s = LoadSampler(c)
        s.sample("start")
        s.sample("end")
    rec = s.record()
    assert rec["samples"] == [] and "no load" in rec["problem"]


# -- the analysis: graph replays without shapes, eager gathers with a TensorList index -------------------

def _copy(name: str, tmp: Path) -> Path:
    d = tmp / name
    shutil.copytree(fixture_dir(name), d)
    return d


def test_graph_trace_takes_active_rows_and_batch_from_the_record(tmp_path: Path) -> None:
    d = _copy("tp1-l6-gather-graph-nocapture-bs8", tmp_path)
    a = analyze(str(d), use_cache=False)
    active, pool, why = active_kv_rows(a)
    assert active is None and pool == POOL and "no op gathers rows" in why  # neither shapes nor a record
    assert "kv_tokens_in_use" not in a.run_model.facts

    (d / "capture.json").write_text(json.dumps(_capture(_sample("start", -0.01, 8, 8200),
                                                        _sample("end", 1.5, 8, 8232))))
    a = analyze(str(d), use_cache=False)
    active, pool, why = active_kv_rows(a)
    assert active == 8216 and pool == POOL
    assert "KV tokens in use" in why and "server_load" in why and "capture.json" in why
    assert a.run_model.facts["batch"].source == "trace_structure"  # its bs=8 marker wins, and agrees
    assert a.run_model.value("running_requests") == 8
    assert not any("bs=N markers" in w for w in a.trace.warnings)


def _tensorlist_gathers(d: Path, drop_consumers: bool = False) -> int:
    """Rewrite the pool gathers of an eager fixture as ``pool[idx]`` records them: ``aten::index`` with a
    TensorList index (Input Dims ``[]``) and no ``aten::gather`` below it; ``drop_consumers``: the shapes of the
    ops reading the gathered rows unrecorded too."""
    f = next(d.glob("*.trace.json.gz"))
    doc = json.loads(gzip.decompress(f.read_bytes()))
    spans, rows = [], set()
    for e in doc["traceEvents"]:
        args = e.get("args") or {}
        dims = args.get("Input Dims")
        if e.get("name") == "aten::index_select" and dims and dims[0] and dims[0][0] >= POOL:
            rows.add(tuple(dims[0][1:]))
            e["name"] = "aten::index"
            args["Input Dims"] = [dims[0], []]
            args["Input type"] = [args["Input type"][0], "TensorList"]
            args.pop("Concrete Inputs", None)
            spans.append((e["tid"], e["ts"], e["ts"] + e["dur"]))
    doc["traceEvents"] = [e for e in doc["traceEvents"] if not (e.get("name") == "aten::gather" and any(
        e.get("tid") == t and t0 <= e["ts"] <= t1 for t, t0, t1 in spans))]
    if drop_consumers:
        for e in doc["traceEvents"]:
            dims = (e.get("args") or {}).get("Input Dims")
            lead = dims[0][0] if dims and isinstance(dims[0], list) and dims[0] else None
            if isinstance(lead, int) and 0 < lead < POOL and tuple(dims[0][1:]) in rows:
                e["args"]["Input Dims"] = [[] for _ in dims]
    f.write_bytes(gzip.compress(json.dumps(doc).encode()))
    return len(spans)


def test_tensorlist_index_takes_rows_from_the_consuming_op(tmp_path: Path) -> None:
    d = _copy("tp1-l6-gather-eager", tmp_path)
    assert _tensorlist_gathers(d) > 0
    a = analyze(str(d), use_cache=False)
    active, pool, why = active_kv_rows(a)
    assert active == 65536 and pool == POOL
    assert "TensorList" in why and "aten::index" in why and "[65536, 1, 576]" in why


def test_tensorlist_index_without_consumer_shapes_stays_undecided(tmp_path: Path) -> None:
    d = _copy("tp1-l6-gather-eager", tmp_path)
    assert _tensorlist_gathers(d, drop_consumers=True) > 0
    a = analyze(str(d), use_cache=False)
    active, pool, why = active_kv_rows(a)
    assert active is None and pool == POOL and "no op gathers rows out of a pool-shaped tensor" in why


@pytest.mark.parametrize("bad", ["{not json", "[1, 2]"])
def test_unreadable_capture_json_is_a_warning(tmp_path: Path, bad: str) -> None:
    d = _copy("tp1-l6-gather-graph-nocapture-bs8", tmp_path)
    (d / "capture.json").write_text(bad)
    a = analyze(str(d), use_cache=False)
    assert any("capture.json" in w and "ignored" in w for w in a.trace.warnings)
    assert "running_requests" not in a.run_model.facts
