"""``traceinspect doctor``: the checklist of what is usable in a trace set, and its exit code."""

from __future__ import annotations

import gzip
import json
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from conftest import copy_set, fixture_dir, run_cli

from traceinspect.commands.doctor import FAIL, INFO, OK, WARN, diagnose, render

EAGER = "kv-full-cast-eager"
GRAPH = "kv-full-cast-graph"


@lru_cache(maxsize=4)
def _text(variant: str, rank: int) -> str:
    with gzip.open(fixture_dir(variant) / f"fixture-TP-{rank}.trace.json.gz", "rt") as f:
        return f.read()


def doc(variant: str, rank: int) -> dict[str, Any]:
    return json.loads(_text(variant, rank))


def write_set(d: Path, docs: dict[str, Any], server_info: str | None = EAGER) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for name, content in docs.items():
        (d / name).write_bytes(content if isinstance(content, bytes) else
                               (content if isinstance(content, str) else json.dumps(content)).encode())
    if server_info:
        shutil.copy(fixture_dir(server_info) / "server_info.json", d / "server_info.json")
    return d


def check(checks, name: str):
    hit = [c for c in checks if c.name == name]
    assert hit, [c.name for c in checks]
    return hit[0]


def diag(d: Path, **kw):
    checks, ok = diagnose([str(d)], use_cache=False, **kw)
    return checks, ok, render([str(d)], checks, ok)


# ----------------------------------------------------------------------------- CLI on the fixtures

def test_doctor_on_an_eager_fixture(tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    r = run_cli("doctor", str(fixture_dir(EAGER)), "--json", str(out))
    assert r.returncode == 0, r.stderr
    text = r.stdout
    for needle in ("[ok]   files: 2 rank files (TP0, TP1), ranks from file names",
                   "device: NVIDIA H200 (compute capability 9.0) on every rank",
                   "kernels: GPU kernels: TP0 3,378, TP1 3,378",
                   "complete decode steps per rank, from step[...] spans",
                   "record_shapes: 100.0% of eager GEMM kernels",
                   "no CUDA-graph replays (eager)",
                   "max_total_num_tokens: 524288", "used by kv-full-pool-cast",
                   "used by small-m-gemm", "clocks: ranks' clocks agree within",
                   "coverage: 100.0% of GPU time classified",
                   "verdict: analysable"):
        assert needle in text, (needle, text)
    assert r.stderr == ""
    j = json.loads(out.read_text())
    assert j["schema"] == "traceinspect.doctor/1" and j["analysable"] is True
    assert {c["check"] for c in j["checks"]} >= {"files", "device", "kernels", "steps", "record_shapes",
                                                 "cuda_graphs", "server_info", "clocks", "coverage", "warnings"}
    assert all(c["status"] in (OK, INFO) for c in j["checks"]), j["checks"]


def test_doctor_on_a_graph_fixture_with_and_without_capture_traces(tmp_path: Path) -> None:
    checks, ok, text = diag(fixture_dir(GRAPH))
    assert ok
    g = check(checks, "cuda_graphs")
    assert g.status == OK and "100.0% of GPU time is replayed from CUDA graphs" in g.summary
    assert "capture traces are present" in g.summary and any("ops recovered" in d for d in g.details)

    bare = copy_set(fixture_dir(GRAPH), tmp_path / "bare")  # rank files and server_info, no capture traces
    checks, ok, text = diag(bare)
    assert ok  # analysable, with less evidence
    g = check(checks, "cuda_graphs")
    assert g.status == WARN and "TP0, TP1 have no graph-capture trace" in g.summary, g.summary
    assert "shapes and ops are unknown" in g.summary


# ----------------------------------------------------------------------------- what is missing

def test_rank_without_kernels_fails_with_the_cupti_hint(tmp_path: Path) -> None:
    d1 = doc(EAGER, 1)
    d1["traceEvents"] = [e for e in d1["traceEvents"] if e.get("cat") != "kernel"]
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _text(EAGER, 0), "fixture-TP-1.trace.json": d1})
    r = run_cli("doctor", str(d))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "[FAIL] kernels: TP1: no GPU kernel events: CUPTI may have failed to start" in r.stdout
    assert "TP0 3,378, TP1 0" in r.stdout
    assert "verdict: not analysable" in r.stdout
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("traceinspect: error: not analysable: kernels: TP1"), r.stderr
    # analyze refuses the same set
    assert run_cli("analyze", str(d), "-q").returncode == 2


def test_no_steps_is_explained(tmp_path: Path) -> None:
    """A handful of back-to-back kernels and no step markers: the whole capture is one step, with a
    warning that says so and how to mark steps."""
    evs = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": 1000.0 + 10 * i, "dur": 5.0, "pid": 0, "tid": 7,
            "args": {"device": 0, "stream": 7, "correlation": i}} for i in range(5)]
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json": {"traceEvents": evs}}, server_info=None)
    checks, ok, text = diag(d, phase="all")
    assert ok
    s = check(checks, "steps")
    assert s.status == WARN and "no step marker: the whole capture is one step" in s.summary
    assert "step[...]" in s.summary and "[warn] steps" in text


def test_unreadable_files_are_each_named(tmp_path: Path) -> None:
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json.gz": gzip.compress(_text(EAGER, 0).encode())[:-20],
                                   "fixture-TP-1.trace.json": b"[1, 2]"})
    checks, ok, text = diag(d)
    f = check(checks, "files")
    assert not ok and f.status == FAIL
    assert len(f.details) == 2 and "truncated gzip" in f.details[0] and "fixture-TP-1" in f.details[1], f.details
    r = run_cli("doctor", str(d))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_missing_server_info_lists_what_rules_need(tmp_path: Path) -> None:
    d = write_set(tmp_path / "s", {f"fixture-TP-{r}.trace.json": _text(EAGER, r) for r in (0, 1)}, server_info=None)
    checks, ok, _ = diag(d)
    assert ok
    s = check(checks, "server_info")
    assert s.status == WARN and "no server_info.json" in s.summary
    assert any(x.startswith("max_total_num_tokens: needed by kv-full-pool-cast") for x in s.details), s.details
    assert any("top-k" in x and "small-m-gemm" in x for x in s.details), s.details


def test_server_info_without_pool_size_names_the_field(tmp_path: Path) -> None:
    d = write_set(tmp_path / "s", {f"fixture-TP-{r}.trace.json": _text(EAGER, r) for r in (0, 1)}, server_info=None)
    si = json.loads((fixture_dir(EAGER) / "server_info.json").read_text())
    del si["max_total_num_tokens"]
    si["model_info"].pop("num_experts_per_tok")
    (d / "server_info.json").write_text(json.dumps(si))
    s = check(diag(d)[0], "server_info")
    assert s.status == WARN and "absent: max_total_num_tokens" in s.summary and "top-k" in s.summary


def test_shapes_not_recorded(tmp_path: Path) -> None:
    docs = {}
    for r in (0, 1):
        d = doc(EAGER, r)
        for e in d["traceEvents"]:
            if e.get("cat") == "cpu_op":
                e.get("args", {}).pop("Input Dims", None)
        docs[f"fixture-TP-{r}.trace.json"] = d
    c = check(diag(write_set(tmp_path / "s", docs))[0], "record_shapes")
    assert c.status == WARN and c.summary.startswith("only 0.0% of eager GEMM kernels") and "record_shapes=True" in c.summary


def test_clock_skew_is_measured_and_warned(tmp_path: Path) -> None:
    d1 = doc(EAGER, 1)
    for e in d1["traceEvents"]:
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += 1.5e6
    checks, ok, text = diag(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _text(EAGER, 0),
                                                       "fixture-TP-1.trace.json": d1}))
    assert ok
    c = check(checks, "clocks")
    assert c.status == WARN and "differ by up to 1,500.0" in c.summary, c.summary
    assert any(x.startswith("TP1 vs TP0: +1,500.0 ms") and "corrected" in x for x in c.details), c.details
    w = check(checks, "warnings")
    assert w.status == WARN and any("the clock of TP1" in x for x in w.details)


def test_single_rank_and_missing_rank(tmp_path: Path) -> None:
    checks, ok, text = diag(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _text(EAGER, 0)}))
    assert ok
    assert check(checks, "clocks").status == INFO
    w = check(checks, "warnings")
    assert any("tp_size=2 but 1 rank file(s)" in x for x in w.details), w.details


def test_hostile_names_are_printed_inert(tmp_path: Path) -> None:
    """Unclassified kernel names with terminal escapes and line breaks: shown escaped, one line each."""
    d0 = doc(EAGER, 0)
    evil = "\x1b[2J\x1b]0;pwned\x07evil\nkernel\u2028x"
    kernels = [e for e in d0["traceEvents"] if e.get("cat") == "kernel"]
    for e in kernels[len(kernels) // 3: len(kernels) // 3 + 400]:
        e["name"] = evil
    checks, ok, text = diag(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": d0}))
    assert "\x1b" not in text and "\x07" not in text and "\u2028" not in text
    cov = check(checks, "coverage")
    assert cov.status == WARN, cov
    line = next(x for x in text.splitlines() if "unclassified:" in x and "evil" in x)
    assert "\\x1b[2J\\x1b]0;pwned\\x07evil\\x0akernel\\u2028x" in line


@pytest.mark.parametrize("phase", ["prefill"])
def test_no_steps_of_the_phase(tmp_path: Path, phase: str) -> None:
    checks, ok, _ = diag(fixture_dir(EAGER), phase=phase)
    assert not ok
    s = check(checks, "steps")
    assert s.status == FAIL and "no complete prefill steps" in s.summary and "--phase all" in s.summary
