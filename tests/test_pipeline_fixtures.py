"""The foundation on real H200 traces: step counts, graph replay, kernel totals, JSON contract, CLI errors."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from conftest import FIXTURES, copy_set, fixture_dir, manifest, raw_events, rewrite_trace, run_cli

from traceinspect.classify import CLASSES
from traceinspect.document import SCHEMA
from traceinspect.link import link
from traceinspect.load import load_trace_set
from traceinspect.pipeline import analyze
from traceinspect.steps import build_steps

EAGER = "kv-full-cast-eager"
GRAPH = "kv-full-cast-graph"


MANIFESTS = sorted(str(p.parent.relative_to(FIXTURES)) for p in FIXTURES.glob("**/manifest.json"))


@pytest.mark.parametrize("name", MANIFESTS)
def test_manifest_matches_trace(name: str) -> None:
    """Every committed fixture agrees with its manifest (ranks, steps, batch, device, graph replay), so
    a regenerated fixture cannot drift silently."""
    m = manifest(name)
    ts = load_trace_set(fixture_dir(name))
    assert [r.rank for r in ts.ranks] == m["ranks"]
    # SGLang step spans (the default) or a plain torch loop's ProfilerStep#N (TP1 sets, one unnamed rank file)
    spans = m.get("step_marker_kind", "span") == "span"
    if spans:
        assert all(r.rank_source == "filename" for r in ts.ranks)
    assert {r.device.name for r in ts.ranks} == {m["device_name"]}
    link(ts)
    steps = build_steps(ts)
    per_rank = steps.groupby("rank").size()
    assert per_rank.tolist() == [m["steps_profiled"]] * len(m["ranks"])
    if spans:
        assert set(steps["phase"]) == {"decode"}
        assert set(steps["bs"]) == {m["batch"]}
    assert steps["source"].unique().tolist() == ["step_span" if spans else "profiler_step"]
    assert bool(ts.kernels["graph_replay"].any()) == m["cuda_graph"]
    # only partial first / last steps (the recording cut them) excluded, with why; the rest analysed
    edge = steps[steps["edge"]]
    assert edge["excluded_why"].str.startswith("partial: ").all()
    assert set(edge["idx"]) <= {0, m["steps_profiled"] - 1}
    assert (steps.groupby("rank")["included"].sum() + steps.groupby("rank")["edge"].sum()).tolist() \
        == [m["steps_profiled"]] * len(m["ranks"])


def test_graph_replay_kernels_are_kept_and_marked() -> None:
    d = fixture_dir(GRAPH)
    ts = load_trace_set(d)
    link(ts)
    build_steps(ts)
    k = ts.kernels
    replay = k[k["graph_replay"]]
    assert len(replay) > 0
    assert (replay["rt_name"] == "cudaGraphLaunch").all()
    assert (replay["op_idx"] == -1).all() and (replay["op_name"] == "").all()
    # every replayed kernel is attributed to a step through its cudaGraphLaunch
    assert (replay["step"] >= 0).all()
    launches = ts.runtime[ts.runtime["name"] == "cudaGraphLaunch"].groupby("rank").size()
    assert launches.tolist() == [manifest(GRAPH)["steps_profiled"]] * 2
    # the capture traces beside the set are evidence, never ranks
    assert sorted(ts.capture_traces) == [0, 1] and ts.n_ranks == 2


def test_graph_launch_is_a_step_source_when_spans_are_missing(tmp_path: Path) -> None:
    src = fixture_dir(GRAPH)

    def drop_spans(doc: dict) -> None:
        doc["traceEvents"] = [e for e in doc["traceEvents"] if not str(e.get("name", "")).startswith("step[")]

    for r in (0, 1):
        rewrite_trace(src / f"fixture-TP-{r}.trace.json.gz", tmp_path / f"fixture-TP-{r}.trace.json.gz", drop_spans)
    ts = load_trace_set(tmp_path)
    link(ts)
    steps = build_steps(ts)
    assert set(steps["source"]) == {"graph_launch"}
    assert steps.groupby("rank").size().tolist() == [manifest(GRAPH)["steps_profiled"]] * 2


@pytest.mark.parametrize("name", [EAGER, GRAPH])
def test_kernel_totals_equal_raw_json_sum(name: str) -> None:
    d = fixture_dir(name)
    doc = analyze(d).to_json()
    for r in doc["ranks"]:
        ev = raw_events(d / f"fixture-TP-{r['rank']}.trace.json.gz")
        raw = sum(e["dur"] for e in ev if e.get("ph") == "X" and e.get("cat") == "kernel")
        assert math.isclose(r["kernel_us_total"], raw, rel_tol=0, abs_tol=0.01)


def test_json_contract() -> None:
    doc = analyze(fixture_dir(EAGER)).to_json()
    assert doc["schema"] == SCHEMA
    for key in ("source", "ranks", "steps", "classes", "findings", "coverage"):
        assert key in doc
    assert set(doc["steps"]) >= {"phase", "count", "median_us"}
    # the recording began and ended within a step of the first and last steps: partial, excluded, with why
    assert doc["steps"]["count"] == manifest(EAGER)["steps_profiled"] - 2
    assert [x["why"].split(":")[0] for x in doc["steps"]["excluded"]] == ["partial"] * 4
    assert set(doc["classes"]) <= set(CLASSES)
    assert math.isclose(sum(v["share"] for v in doc["classes"].values()), 1.0, abs_tol=1e-3)
    for r in doc["ranks"]:
        assert set(r) >= {"rank", "device", "steps", "step_us", "gpu_busy_us", "idle_us", "classes"}
        assert math.isclose(sum(v["share"] for v in r["classes"].values()), 1.0, abs_tol=1e-3)
        assert r["step_us"]["median"] > 0 and r["step_us"]["p90"] >= r["step_us"]["median"]
    json.dumps(doc, allow_nan=False)  # strict JSON


def test_cli_analyze_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    p = run_cli("analyze", str(fixture_dir(EAGER)), "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "decode step" in p.stdout and "kv-full-pool-cast" in p.stdout
    assert json.loads(out.read_text())["schema"] == SCHEMA


# ---- error paths: one line, exit 2, nothing written -------------------------------------------


def _one_line_error(p, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_error_missing_path(tmp_path: Path) -> None:
    out = tmp_path / "a.json"
    _one_line_error(run_cli("analyze", str(tmp_path / "nope"), "--json", str(out)), "nope", "no such file")
    assert not out.exists()


def test_error_not_json(tmp_path: Path) -> None:
    (tmp_path / "x-TP-0.trace.json").write_text("this is not json")
    _one_line_error(run_cli("analyze", str(tmp_path)), "x-TP-0.trace.json", "not valid JSON")


def test_error_truncated_gzip(tmp_path: Path) -> None:
    src = fixture_dir(EAGER) / "fixture-TP-0.trace.json.gz"
    data = src.read_bytes()
    (tmp_path / "fixture-TP-0.trace.json.gz").write_bytes(data[: len(data) // 2])
    _one_line_error(run_cli("analyze", str(tmp_path)), "fixture-TP-0.trace.json.gz", "truncated gzip")


def test_error_no_kernels(tmp_path: Path) -> None:
    def strip(doc: dict) -> None:
        doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("cat") != "kernel"]

    rewrite_trace(fixture_dir(EAGER) / "fixture-TP-0.trace.json.gz", tmp_path / "fixture-TP-0.trace.json.gz", strip)
    _one_line_error(run_cli("analyze", str(tmp_path)), "no GPU kernel events", "CUPTI")


def test_error_no_steps(tmp_path: Path) -> None:
    def strip(doc: dict) -> None:
        # no step spans, no ProfilerStep, no graph launches, and one burst of kernels with no idle gaps
        ev = [e for e in doc["traceEvents"]
              if e.get("cat") not in ("user_annotation", "gpu_user_annotation", "gpu_memcpy", "gpu_memset")]
        kernels = sorted((e for e in ev if e.get("cat") == "kernel"), key=lambda e: e["ts"])[:50]
        t = kernels[0]["ts"]
        for e in kernels:
            e["ts"] = t
            t += e["dur"]
        doc["traceEvents"] = [e for e in ev if e.get("cat") != "kernel"] + kernels

    rewrite_trace(fixture_dir(EAGER) / "fixture-TP-0.trace.json.gz", tmp_path / "fixture-TP-0.trace.json.gz", strip)
    out = tmp_path / "a.json"
    r = run_cli("analyze", str(tmp_path), "-q", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    # nothing marks a step: the whole capture is one step, of unknown phase, and the user is told
    assert doc["steps"]["source"] == "whole_capture" and doc["steps"]["count"] == 1
    assert doc["steps"]["phase"] == "unknown" and doc["ranks"][0]["steps_found"] == {"unknown": 1}
    assert any("states the phase" in w for w in doc["warnings"]), doc["warnings"]
    assert doc["coverage"]["kernels_analysed"] == 50


def test_error_no_decode_steps(tmp_path: Path) -> None:
    def prefill(doc: dict) -> None:
        for e in doc["traceEvents"]:
            if str(e.get("name", "")).startswith("step[DECODE"):
                e["name"] = e["name"].replace("DECODE", "EXTEND")

    for r in (0, 1):
        rewrite_trace(fixture_dir(EAGER) / f"fixture-TP-{r}.trace.json.gz",
                      tmp_path / f"fixture-TP-{r}.trace.json.gz", prefill)
    _one_line_error(run_cli("analyze", str(tmp_path), "--phase", "decode"), "no complete decode steps", "prefill")
    assert run_cli("analyze", str(tmp_path), "--phase", "prefill", "-q").returncode == 0
    # without --phase, a trace of prefill steps only is analysed as such, and says so
    out = tmp_path / "a.json"
    assert run_cli("analyze", str(tmp_path), "-q", "--json", str(out)).returncode == 0
    doc = json.loads(out.read_text())
    assert doc["steps"]["phase"] == "prefill" and doc["run"]["kind"] == "prefill"
    assert any("no decode steps: analysed its" in w and "prefill step(s)" in w for w in doc["warnings"])


def test_server_info_flag_and_missing_rank_warning(tmp_path: Path) -> None:
    d = copy_set(fixture_dir(EAGER), tmp_path / "set")
    (d / "fixture-TP-1.trace.json.gz").unlink()
    si = json.loads((d / "server_info.json").read_text())
    (d / "server_info.json").unlink()
    (tmp_path / "si.json").write_text(json.dumps(si))
    doc = analyze(d, server_info=tmp_path / "si.json").to_json()
    assert doc["source"]["server_info"].endswith("si.json")
    assert any("ranks are missing" in w for w in doc["warnings"])


def test_gzip_and_plain_json_agree(tmp_path: Path) -> None:
    src = fixture_dir(EAGER)
    for r in (0, 1):
        with gzip.open(src / f"fixture-TP-{r}.trace.json.gz", "rb") as f:
            (tmp_path / f"fixture-TP-{r}.trace.json").write_bytes(f.read())
    (tmp_path / "server_info.json").write_bytes((src / "server_info.json").read_bytes())
    a = analyze(src).to_json()
    b = analyze(tmp_path).to_json()
    assert a["classes"] == b["classes"] and a["steps"]["median_us"] == b["steps"]["median_us"]
