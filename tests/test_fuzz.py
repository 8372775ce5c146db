"""Robustness of the analyze pipeline against hostile and broken trace sets.

Real fixture traces, trimmed to four decode steps and a few hundred kernels per rank (so one analysis
takes a fraction of a second), are mutated at every layer: the gzip stream, the JSON text, the
document, the ``traceEvents`` list, single events and their ``args``, the server_info.json and the
CUDA-graph capture traces. Every mutated input must give an analysis (whose JSON, Markdown, terminal
and HTML renderings also succeed) or a clean :class:`TraceInspectError`, which the CLI prints as one
line with exit 2. Any other exception is a crash and fails the test with the input that caused it.

The number of mutated inputs tried is written to ``test-artifacts/fuzz-summary.json`` and printed at
the end of the session. By default (and in CI) the hypothesis profile of tests/conftest.py tries the same
inputs every run, a fixed number of them, without shrinking: a failure shows the input as found. Open-ended
fuzzing draws new inputs each run and shrinks what fails (the "fuzz" profile):

    TRACEINSPECT_FUZZ_RANDOM=1 TRACEINSPECT_FUZZ_SCALE=10 python -m pytest -q tests/test_fuzz.py

``TRACEINSPECT_FUZZ_SCALE=N`` multiplies the number of examples. No assertion here reads a clock: a hang
is ended by pytest's timeout, and the speed of hostile inputs is measured in benchmarks/.
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES, ROOT

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from traceinspect.errors import TraceInspectError  # noqa: E402

ARTIFACTS = ROOT / "test-artifacts"
SUMMARY = ARTIFACTS / "fuzz-summary.json"
EAGER = "kv-full-cast-eager"
GRAPH = "kv-full-cast-graph"
SCALE = max(1, int(os.environ.get("TRACEINSPECT_FUZZ_SCALE", "1") or 1))
# Each fuzz test sets this many examples; the session must try at least MIN_TRIED inputs in all.
N_BYTES = 160 * SCALE
N_STRUCT = 50 * SCALE
N_SERVER_INFO = 15 * SCALE
MIN_TRIED = 200

# outcome counts per test: {"test": Counter({"result": n, "error": n})}
COUNTS: dict[str, Counter] = {}
ERRORS: Counter = Counter()  # first words of clean error reasons, for the summary

# derandomizing, deadline, database and shrinking: the profile of tests/conftest.py ("ci", or "fuzz")
SETTINGS = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])


def test_property_tests_try_the_same_inputs_every_run(request: pytest.FixtureRequest) -> None:
    """Every collected hypothesis test runs under the "ci" profile of tests/conftest.py unless the
    open-ended run is asked for: derandomized, no database, no deadline, no shrinking."""
    from hypothesis import Phase
    from hypothesis import settings as current

    if os.environ.get("TRACEINSPECT_FUZZ_RANDOM") == "1":
        pytest.skip("the open-ended (fuzz) profile was asked for")
    tests = [item.obj for item in request.session.items if hasattr(item, "obj")]
    here = [v for k, v in globals().items() if k.startswith("test_")]
    found = [current.default] + [s for t in tests + here
                                 if (s := getattr(t, "_hypothesis_internal_use_settings", None)) is not None]
    assert len(found) >= 4  # the profile and this module's property tests at least
    for s in found:
        assert s.derandomize and s.database is None and s.deadline is None, s
        assert Phase.shrink not in s.phases and s.max_examples <= 1000, s


# ============================================================================= base trace sets

class Base:
    """A small, analysable trace set held in memory: rank documents, server_info, capture traces."""

    def __init__(self, name: str, docs: list[dict[str, Any]], server_info: dict[str, Any],
                 captures: dict[int, dict[str, Any]] | None = None) -> None:
        self.name, self.docs, self.server_info, self.captures = name, docs, server_info, captures or {}
        self.texts = [json.dumps(d).encode() for d in docs]  # the rank documents as JSON text

    def fresh_docs(self) -> list[dict[str, Any]]:
        return [json.loads(t) for t in self.texts]

    def __repr__(self) -> str:  # hypothesis prints the arguments of a failing example
        return f"Base({self.name!r}: {[len(d['traceEvents']) for d in self.docs]} events per rank)"


_COMM_OR_GEMM = re.compile(r"nccl|all_?reduce|cross_device|nvjet|cutlass|xmma|gemm", re.IGNORECASE)


def _load_events(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    doc["traceEvents"] = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    return doc


def _trim(doc: dict[str, Any], window: tuple[float, float], every: int) -> dict[str, Any]:
    """Keep the CPU window [t0, t1]: its runtime calls, the GPU work they launched (every ``every``-th
    kernel plus all GEMM and communication kernels; all of it for graph replays), the CPU ops that
    enclose a kept launch and the annotations of the window."""
    t0, t1 = window
    ev = doc["traceEvents"]
    rt = [e for e in ev if e.get("cat") in ("cuda_runtime", "cuda_driver") and t0 <= e["ts"] <= t1]
    by_corr = {e["args"]["correlation"]: e for e in rt if "correlation" in e.get("args", {})}
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
           and e.get("args", {}).get("correlation") in by_corr]
    graph = {c for c, e in by_corr.items() if "Graph" in e["name"]}
    kept = [k for i, k in enumerate(gpu) if k["args"]["correlation"] in graph or i % every == 0
            or _COMM_OR_GEMM.search(k["name"])]
    launches = sorted({k["args"]["correlation"] for k in kept})
    launch_rt = [by_corr[c] for c in launches]
    other_rt = [e for e in rt if "correlation" not in e.get("args", {}) or "Graph" in e["name"]]
    marks = sorted((e["tid"], e["ts"]) for e in launch_rt)
    ops = []
    for o in ev:
        if o.get("cat") != "cpu_op" or not (t0 <= o["ts"] <= t1):
            continue
        end = o["ts"] + o["dur"]
        if any(tid == o["tid"] and o["ts"] <= ts <= end for tid, ts in marks):
            ops.append(o)
    ann = [e for e in ev if e.get("cat") in ("user_annotation", "gpu_user_annotation") and t0 <= e["ts"] <= t1 + 1]
    out = {k: v for k, v in doc.items() if k != "traceEvents"}
    uniq = {id(e): e for e in ann + ops + launch_rt + other_rt + kept}
    out["traceEvents"] = sorted(uniq.values(), key=lambda e: e["ts"])
    return out


def _eager_base() -> Base:
    src = FIXTURES / EAGER
    docs = []
    for r in (0, 1):
        doc = _load_events(src / f"fixture-TP-{r}.trace.json.gz")
        steps = sorted((e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("step[")),
                       key=lambda e: e["ts"])[1:5]  # four steps after the first (warm-up) one
        docs.append(_trim(doc, (steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]), every=12))
    return Base("eager", docs, json.loads((src / "server_info.json").read_text()))


def _graph_base() -> Base:
    src = FIXTURES / GRAPH
    docs = []
    for r in (0, 1):
        doc = _load_events(src / f"fixture-TP-{r}.trace.json.gz")
        steps = sorted((e for e in doc["traceEvents"] if str(e.get("name", "")).startswith("step[")),
                       key=lambda e: e["ts"])[:4]
        docs.append(_trim(doc, (steps[0]["ts"] - 1, steps[-1]["ts"] + steps[-1]["dur"]), every=1))
    caps = {}
    for p in sorted((src / "graph_capture_profile").glob("*.json.gz")):
        r = int(re.search(r"TP-(\d+)", p.name).group(1))
        with gzip.open(p, "rt") as f:
            caps[r] = json.load(f)
    return Base("graph", docs, json.loads((src / "server_info.json").read_text()), caps)


@pytest.fixture(scope="module")
def bases() -> Any:
    for v in (EAGER, GRAPH):
        if not (FIXTURES / v).is_dir():
            pytest.skip(f"fixture {v} is not present")
    out = {"eager": _eager_base(), "graph": _graph_base()}
    from traceinspect import judge
    from traceinspect.pipeline import analyze

    # The shipped rule set is parsed once, not for every input: it is not what is fuzzed here, and
    # parsing its YAML would be a third of each analysis.
    real = judge.load_rule_set
    memo: dict[Any, Any] = {}

    def load_rule_set(extra: Any = (), only: Any = (), disable: Any = (), shipped: bool = True) -> Any:
        key = (tuple(map(str, extra)), tuple(only), tuple(disable), shipped)
        if key not in memo:
            memo[key] = real(extra=extra, only=only, disable=disable, shipped=shipped)
        return memo[key]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(judge, "load_rule_set", load_rule_set)
        for b in out.values():  # the unmutated bases analyse: the mutations start from a working input
            d = _write_case(b, b.fresh_docs(), dict(b.server_info))
            a = analyze(str(d), jobs=1, use_cache=False, command="fuzz-base")
            assert len(a.selected) >= 2 and len(a.kernels) > 50, b.name
            shutil.rmtree(d)
        yield out
    for t in _TMP:
        shutil.rmtree(t, ignore_errors=True)
    _TMP.clear()


# ============================================================================= running one input

_TMP: list[Path] = []  # the directory cases are written to (made on first use, removed with the bases)
_SEQ = [0]


def _case_dir() -> Path:
    if not _TMP:
        _TMP.append(Path(tempfile.mkdtemp(prefix="traceinspect-fuzz-")))
    _SEQ[0] += 1
    d = _TMP[0] / f"case{_SEQ[0]}"
    d.mkdir()
    return d


def _write_case(base: Base, docs: list[Any], server_info: Any, *, raw: dict[int, bytes] | None = None,
                gz: set[int] = frozenset(), captures: dict[int, Any] | None = None,
                raw_captures: dict[int, bytes] | None = None, names: dict[int, str] | None = None) -> Path:
    """Write a trace set: rank r from ``raw[r]`` (bytes as given) or ``docs[r]`` (JSON), gzipped when r in
    ``gz``; server_info as JSON (bytes as given, or absent when None); capture traces for the graph base."""
    d = _case_dir()
    raw = raw or {}
    for r, doc in enumerate(docs):
        data = raw[r] if r in raw else json.dumps(doc).encode()
        stem = (names or {}).get(r, f"fixture-TP-{r}")
        if r in gz:
            (d / f"{stem}.trace.json.gz").write_bytes(gzip.compress(data, 1) if r not in raw else data)
        else:
            (d / f"{stem}.trace.json").write_bytes(data)
    if server_info is not None:
        si = server_info if isinstance(server_info, bytes) else json.dumps(server_info).encode()
        (d / "server_info.json").write_bytes(si)
    caps = captures if captures is not None else base.captures
    if caps or raw_captures:
        cdir = d / "graph_capture_profile"
        cdir.mkdir()
        for r, cap in caps.items():
            data = (raw_captures or {}).get(r) or json.dumps(cap).encode()
            (cdir / f"cuda_graph_capture-DecodeCudaGraphRunner-TP-{r}.json").write_bytes(data)
    return d


def run_pipeline(d: Path, test: str, *, cache: bool = False, html: bool = False, keep: bool = False) -> str:
    """Analyse ``d`` in-process and render the result; 'result' or 'error' (a clean TraceInspectError).
    Any other exception propagates: that is a crash. ``d`` is removed afterwards unless ``keep``."""
    from rich.console import Console

    from traceinspect.document import dumps
    from traceinspect.pipeline import analyze
    from traceinspect.render.markdown import render_markdown
    from traceinspect.render.terminal import render

    try:
        a = analyze(str(d), jobs=1, use_cache=cache, command="traceinspect analyze fuzz")
        doc = a.to_json()
        dumps(doc)  # what --json writes (a non-finite number fails here, naming its JSON path)
        render_markdown(doc)
        render(doc, console=Console(file=io.StringIO(), width=120))
        if html:  # the report command's outputs
            from traceinspect.render.html import render_html
            from traceinspect.render.perfetto import write_perfetto

            render_html(doc)
            write_perfetto(a, d / "merged.json", doc)
        outcome = "result"
    except TraceInspectError as e:
        msg = e.one_line()
        assert msg.strip() and "\n" not in msg, repr(msg)
        ERRORS[" ".join(e.reason.split()[:4])] += 1
        outcome = "error"
    finally:
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
    COUNTS.setdefault(test, Counter())[outcome] += 1
    return outcome


# ============================================================================= byte layer

NON_OBJECTS = [
    b"", b" \n\t", b"[]", b"1", b'"x"', b"null", b"true", b"{}", b'{"traceEvents": null}', b'{"traceEvents": {}}',
    b'{"traceEvents": 5}', b'{"traceEvents": "x"}', b'{"traceEvents": [1, "x", null, []]}', b'{"traceEvents": []}',
    b'[{"traceEvents": []}]', b'{"traceEvents": [{}]}', b'{"traceEvents": [{"ph": "X"}]}',
    b"\xef\xbb\xbf{}", b"\x00" * 64, b"[" * 5000, b'{"a":' * 5000, b'{"traceEvents": ' + b"[" * 3000,
    b'{"traceEvents": [], "traceEvents": []}', b"\x1f\x8b", b"\x1f\x8b\x08\x00" + b"\x00" * 20,
    b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "dur": 1}]',
]
BAD_UTF8 = [b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf8\x88\x80\x80\x80", b"\x80"]
NUMBER_TOKENS = [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"18446744073709551616",
                 b"-9223372036854775809", b"1" * 5000, b"0x10", b"1.e", b"--1"]
LAYOUTS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "pretty": lambda d: json.dumps(d, indent=1).encode(),
    "compact": lambda d: json.dumps(d, separators=(",", ":")).encode(),
    "events_first": lambda d: json.dumps({"traceEvents": d["traceEvents"],
                                          **{k: v for k, v in d.items() if k != "traceEvents"}}).encode(),
    "events_last": lambda d: json.dumps({**{k: v for k, v in d.items() if k != "traceEvents"},
                                         "traceEvents": d["traceEvents"]}).encode(),
    "nested_decoy": lambda d: json.dumps({"meta": {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "decoy",
                                                                    "ts": 1, "dur": 1}]}, **d}).encode(),
    "string_decoy": lambda d: json.dumps({"traceName": '"traceEvents": [{}, {', **d}).encode(),
    "crlf": lambda d: json.dumps(d, indent=2).replace("\n", "\r\n").encode(),
    "unicode_escapes": lambda d: json.dumps(d, ensure_ascii=True).replace('"name": "', '"name": "\\u00e9').encode(),
}
_NUMBER_FIELD = re.compile(rb'"(ts|dur|correlation|External id|device|stream|tid|bytes)": -?[0-9.e+-]+')
_STRING_VALUE = re.compile(rb'"(name|cat|ph)": "')


@given(data=st.data())
@settings(max_examples=N_BYTES, **SETTINGS)
def test_mutated_bytes(bases: dict[str, Base], data: st.DataObject) -> None:
    """The gzip and JSON-text layers of a rank file: truncation, corruption, invalid UTF-8, bad
    number tokens, non-object JSON, garbage after the stream."""
    base = bases[data.draw(st.sampled_from(["eager", "graph"]), label="base")]
    text = base.texts[1]
    kind = data.draw(st.sampled_from(["truncate_text", "truncate_gzip", "flip_byte", "invalid_utf8",
                                      "number_token", "non_object", "gzip_trailer", "gzip_members", "layout"]),
                     label="kind")
    gz: set[int] = set()
    if kind == "truncate_text":
        out = text[:data.draw(st.integers(0, len(text) - 1), label="at")]
    elif kind == "truncate_gzip":
        z = gzip.compress(text, 1)
        out, gz = z[:data.draw(st.integers(0, len(z) - 1), label="at")], {1}
    elif kind == "flip_byte":
        i = data.draw(st.integers(0, len(text) - 1), label="at")
        out = text[:i] + bytes([data.draw(st.integers(0, 255), label="byte")]) + text[i + 1:]
    elif kind == "invalid_utf8":
        spots = [m.end() for m in _STRING_VALUE.finditer(text)]
        i = spots[data.draw(st.integers(0, len(spots) - 1), label="spot")]
        out = text[:i] + data.draw(st.sampled_from(BAD_UTF8), label="seq") + text[i:]
    elif kind == "number_token":
        spots = list(_NUMBER_FIELD.finditer(text))
        m = spots[data.draw(st.integers(0, len(spots) - 1), label="spot")]
        start = text.index(b": ", m.start()) + 2
        out = text[:start] + data.draw(st.sampled_from(NUMBER_TOKENS), label="token") + text[m.end():]
    elif kind == "non_object":
        out = data.draw(st.sampled_from(NON_OBJECTS), label="doc")
        if data.draw(st.booleans(), label="gzip"):
            out, gz = gzip.compress(out), {1}
    elif kind == "gzip_trailer":
        tail = data.draw(st.sampled_from([b"\x00" * 16, b"garbage", b"\x1f\x8b", b"\x1f\x8bxx", b"\n"]), label="tail")
        out, gz = gzip.compress(text, 1) + tail, {1}
    elif kind == "gzip_members":  # two gzip members: valid gzip, and the text is the concatenation
        cut = data.draw(st.integers(0, len(text)), label="cut")
        out, gz = gzip.compress(text[:cut], 1) + gzip.compress(text[cut:], 1), {1}
    else:  # valid JSON laid out differently: the streaming reader must read it as a whole decode does
        layout = data.draw(st.sampled_from(sorted(LAYOUTS)), label="layout")
        out = LAYOUTS[layout](json.loads(text))
    note(f"{base.name} {kind}: {len(out)} bytes")
    # the mutated file alone (a one-rank set): what fails here fails while reading it
    d = _write_case(base, [None], dict(base.server_info), raw={0: out}, gz={0} if gz else set(), captures={})
    valid = kind in ("gzip_members", "layout") or (kind == "gzip_trailer" and not tail.strip(b"\x00"))
    try:
        if valid:  # multi-member gzip, zero padding and any JSON layout: the same document as the base's
            assert _split_reads_agree(next(d.glob("fixture-TP-*"))), "a valid file was refused"
            COUNTS.setdefault("bytes", Counter())["result"] += 1
        else:
            run_pipeline(d, "bytes", keep=True)
            _split_reads_agree(next(d.glob("fixture-TP-*")))
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _split_reads_agree(f: Path) -> bool:
    """The streaming reader, fed the file in small blocks and pieces, gives what a whole-document decode
    gives: the same tables, or an error as well. True when the file was read."""
    from traceinspect.load import parse as P

    if not all(hasattr(P, n) for n in ("parse_bytes_whole", "BLOCK", "PIECE")):
        return P.parse_file(f) is not None

    def outcome(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except TraceInspectError:
            return None

    from traceinspect.load import raw

    with pytest.MonkeyPatch.context() as mp:
        for mod in (P, raw):  # the streaming decoder's and the raw read's (the native scanner's) settings
            mp.setattr(mod, "BLOCK", 3000)
            mp.setattr(mod, "PIECE", 8000)
        split = outcome(lambda: P.parse_file(f))
    whole = outcome(lambda: P.parse_bytes_whole(P.read_bytes(f), f))
    assert (split is None) == (whole is None), (f, split is None)
    if whole is not None:
        for t in ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations"):
            assert getattr(split, t).equals(getattr(whole, t)), t
        assert (split.n_events, split.dropped, split.trace_id) == (whole.n_events, whole.dropped, whole.trace_id)
    return whole is not None


# ============================================================================= document and event layers

WEIRD: list[Any] = [None, "", "x", [], {}, True, False, -1, 0, 1.5, -0.0, 1e308, -1e308, 2**63, 2**64 + 1,
                    -(2**63) - 1, 10**30, "12", "<b>", "\u202e\u0000", [1, 2], {"a": 1}, [[[[]]]]]
BIG_INTS = [2**63, 2**64 + 1, -(2**63) - 1, 10**30, 2**63 - 1, -(2**63)]
EVENT_FIELDS = ["ph", "cat", "name", "ts", "dur", "tid", "pid", "args", "id"]
ARG_FIELDS = ["correlation", "External id", "device", "stream", "grid", "block", "bytes", "Input Dims",
              "Input type", "Concrete Inputs", "Collective name", "In msg nelems"]
CATEGORIES = ["kernel", "cuda_runtime", "cuda_driver", "cpu_op", "user_annotation", "gpu_user_annotation",
              "gpu_memcpy", "gpu_memset"]
DURATIONS = [-1.0, -1e-3, 0.0, 1e-9, 1e12, 1e300, 1.8446744073709552e16, 86_400e6 + 1, 3.5e9]
TIMESTAMPS = [-1e18, -5.0, 0.0, 1e18, 1e300, -1e300, 2.0**53 + 1]
DIMS = [[[2**62, 5]], [[-1, 4], [4, -3]], [["a"]], [[1e308, 2]], [[]], "x", [[0, 0], [0, 0]], [[[[1]]]], None, 5,
        [[1, 2, 3, 4, 5, 6, 7, 8]], [[2**40, 2**40], [2**40, 2**40]], [[True]], [[1] * 64],
        json.loads("[" * 400 + "]" * 400)]
TYPES = [["c10::BFloat16", "c10::BFloat16"], ["nope"], [None], "x", [1, 2], [], [["a"]], ["c10::Float8_e4m3fn"] * 5]
CONCRETE = [["", "", "2**70"], [1], "x", [None], ["1e400"], ["-5"], [["1"]], ["9" * 40], ["24", "x"], ["", "nan"]]
KERNEL_NAMES = ["", "x" * 5000, "\u202e\u0000evil\u2028", "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
                "<script>alert(1)</script>", "void " * 200, "nvjet_tst_64x8_64x16_1x1_v_bz_TNT", "🙂" * 50,
                "step[DECODE bs=4]", "cudaGraphLaunch", "**bold** | `x` [a](javascript:b)", "%s%n{0}{__class__}"]
STEP_NAMES = ["step[", "step[DECODE bs=99999999999999999999999]", "step[EXTEND bs=4]", "step[MIXED]",
              "step[DECODE bs=0 toks=0]", "step[IDLE]", "step[verify bs=-1]", "ProfilerStep#1",
              "ProfilerStep#99999999999999999999", "step[🙂]", "STEP[DECODE]", "step[decode] bs=1 toks=1"]


def _events(doc: Any) -> list[Any]:
    ev = doc.get("traceEvents") if isinstance(doc, dict) else None
    return ev if isinstance(ev, list) else []


def _pick(draw: Callable, evs: list[Any], label: str, cat: str | None = None) -> list[dict]:
    pool = [e for e in evs if isinstance(e, dict) and (cat is None or e.get("cat") == cat)]
    if not pool:
        return []
    n = draw(st.integers(1, min(len(pool), 40)), label=f"{label}.n")
    seed = draw(st.integers(0, 2**16), label=f"{label}.seed")
    return random.Random(seed).sample(pool, n)


def _args(e: dict) -> dict:
    a = e.get("args")
    if not isinstance(a, dict):
        a = e["args"] = {}
    return a


def m_truncate_events(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    n = draw(st.integers(0, len(evs)), label="keep")
    c.docs[r]["traceEvents"] = evs[:n]
    return f"traceEvents[:{n}]"


def m_truncate_event(c: Case, r: int, draw: Callable) -> str:
    """Events cut short: some of their keys (or of their args) are missing."""
    evs = _events(c.docs[r])
    in_args = draw(st.booleans(), label="in_args")
    keys = draw(st.lists(st.sampled_from(ARG_FIELDS if in_args else EVENT_FIELDS), min_size=1, max_size=4,
                         unique=True), label="keys")
    for e in _pick(draw, evs, "events"):
        for k in keys:
            (_args(e) if in_args else e).pop(k, None)
    return f"events lost {'args ' if in_args else ''}{keys}"


def m_wrong_type(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    in_args = draw(st.booleans(), label="in_args")
    key = draw(st.sampled_from(ARG_FIELDS if in_args else EVENT_FIELDS), label="key")
    value = draw(st.sampled_from(WEIRD), label="value")
    for e in _pick(draw, evs, "events", draw(st.sampled_from([None, *CATEGORIES]), label="cat")):
        (_args(e) if in_args else e)[key] = copy.deepcopy(value)
    return f"{'args.' if in_args else ''}{key} = {value!r:.40}"


def m_missing_field(c: Case, r: int, draw: Callable) -> str:
    cat = draw(st.sampled_from(CATEGORIES), label="cat")
    key = draw(st.sampled_from(["ts", "dur", "name", "ph", "cat", "args", "tid", "correlation", "External id"]),
               label="key")
    for e in _events(c.docs[r]):
        if isinstance(e, dict) and e.get("cat") == cat:
            (_args(e) if key in ("correlation", "External id") else e).pop(key, None)
    return f"every {cat} lost {key}"


def m_durations(c: Case, r: int, draw: Callable) -> str:
    v = draw(st.sampled_from(DURATIONS), label="dur")
    for e in _pick(draw, _events(c.docs[r]), "events", draw(st.sampled_from(CATEGORIES), label="cat")):
        e["dur"] = v
    return f"dur = {v}"


def m_timestamps(c: Case, r: int, draw: Callable) -> str:
    v = draw(st.sampled_from(TIMESTAMPS), label="ts")
    for e in _pick(draw, _events(c.docs[r]), "events", draw(st.sampled_from(CATEGORIES), label="cat")):
        e["ts"] = v
    return f"ts = {v}"


def m_big_ints(c: Case, r: int, draw: Callable) -> str:
    key = draw(st.sampled_from(["correlation", "External id", "device", "stream", "tid", "pid", "bytes"]),
               label="key")
    v = draw(st.sampled_from(BIG_INTS), label="value")
    for e in _pick(draw, _events(c.docs[r]), "events"):
        (e if key in ("tid", "pid") else _args(e))[key] = v
    return f"{key} = {v}"


def m_duplicate_correlation(c: Case, r: int, draw: Callable) -> str:
    evs = [e for e in _events(c.docs[r]) if isinstance(e, dict) and "correlation" in e.get("args", {})]
    if not evs:
        return "no correlation ids"
    cid = evs[draw(st.integers(0, len(evs) - 1), label="from")]["args"]["correlation"]
    for e in _pick(draw, evs, "events"):
        e["args"]["correlation"] = cid
    return f"correlation {cid} reused"


def m_missing_correlation(c: Case, r: int, draw: Callable) -> str:
    share = draw(st.sampled_from([0.1, 0.5, 1.0]), label="share")
    rng = random.Random(draw(st.integers(0, 2**16), label="seed"))
    for e in _events(c.docs[r]):
        if isinstance(e, dict) and isinstance(e.get("args"), dict) and rng.random() < share:
            e["args"].pop("correlation", None)
    return f"{share:.0%} lost their correlation id"


def m_outside_steps(c: Case, r: int, draw: Callable) -> str:
    shift = draw(st.sampled_from([1e9, -1e9, 5e5, -5e5, 1e15]), label="shift")
    what = draw(st.sampled_from(["kernel", "cuda_runtime"]), label="what")
    for e in _pick(draw, _events(c.docs[r]), "events", what):
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += shift
    return f"{what} moved by {shift}"


def m_order(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    how = draw(st.sampled_from(["shuffle", "reverse", "by_name"]), label="how")
    if how == "shuffle":
        random.Random(draw(st.integers(0, 2**16), label="seed")).shuffle(evs)
    elif how == "reverse":
        evs.reverse()
    else:
        evs.sort(key=lambda e: str(e.get("name")) if isinstance(e, dict) else "")
    return f"events {how}"


def m_categories(c: Case, r: int, draw: Callable) -> str:
    cat = draw(st.sampled_from(CATEGORIES), label="cat")
    keep = draw(st.booleans(), label="keep_only")
    c.docs[r]["traceEvents"] = [e for e in _events(c.docs[r]) if isinstance(e, dict) and (e.get("cat") == cat) == keep]
    return f"{'only' if keep else 'no'} {cat} events"


def m_empty(c: Case, r: int, draw: Callable) -> str:
    c.docs[r]["traceEvents"] = []
    return "traceEvents = []"


def m_steps(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    spans = [e for e in evs if isinstance(e, dict) and str(e.get("name", "")).startswith("step[")]
    how = draw(st.sampled_from(["drop_some", "drop_all", "rename", "duplicate", "overlap", "zero"]), label="how")
    if how == "drop_all":
        c.docs[r]["traceEvents"] = [e for e in evs if not any(e is s for s in spans)]
    elif how == "drop_some":
        for s in _pick(draw, spans, "spans"):
            evs.remove(s)
    elif how == "rename":
        name = draw(st.sampled_from(STEP_NAMES), label="name")
        for s in _pick(draw, spans, "spans"):
            s["name"] = name
    elif how == "duplicate":
        evs.extend(copy.deepcopy(s) for s in _pick(draw, spans, "spans"))
    elif how == "overlap":
        for s in _pick(draw, spans, "spans"):
            s["dur"] = s.get("dur", 0) * 10 if isinstance(s.get("dur"), (int, float)) else 1e6
    else:
        for s in _pick(draw, spans, "spans"):
            s["dur"] = 0
    return f"step spans: {how}"


def m_duplicate_events(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    evs.extend(copy.deepcopy(e) for e in _pick(draw, evs, "events"))
    return "duplicated events"


def m_nesting(c: Case, r: int, draw: Callable) -> str:
    """CPU ops that cross instead of nesting, or that swallow the whole trace."""
    f = draw(st.sampled_from([0, 1000, 1e6]), label="factor")
    for e in _pick(draw, _events(c.docs[r]), "ops", "cpu_op"):
        if isinstance(e.get("dur"), (int, float)):
            e["dur"] = e["dur"] * f if f else 0
    return f"cpu_op dur x{f}"


def m_top_level(c: Case, r: int, draw: Callable) -> str:
    key = draw(st.sampled_from(["deviceProperties", "distributedInfo", "cuda_runtime_version", "trace_id",
                                "cuda_driver_version", "traceName", "displayTimeUnit"]), label="key")
    value = draw(st.sampled_from(WEIRD + [[{}], [{"name": 5, "computeMajor": "9", "numSms": -1}], {"rank": "1"},
                                          {"rank": -3}, {"rank": 2**70}, {"rank": 7, "world_size": 9}, [[]], [1]]),
                 label="value")
    c.docs[r][key] = value
    return f"{key} = {value!r:.60}"


def m_shapes(c: Case, r: int, draw: Callable) -> str:
    key, pool = draw(st.sampled_from([("Input Dims", DIMS), ("Input type", TYPES), ("Concrete Inputs", CONCRETE)]),
                     label="key")
    value = draw(st.sampled_from(pool), label="value")
    for e in _pick(draw, _events(c.docs[r]), "ops", "cpu_op"):
        _args(e)[key] = value
    return f"cpu_op {key} = {json.dumps(value)[:40]}"


def m_grid(c: Case, r: int, draw: Callable) -> str:
    key = draw(st.sampled_from(["grid", "block"]), label="key")
    value = draw(st.sampled_from([[2**62, 1, 1], "x", [], [0, 0, 0], {"a": 1}, [-1], None, [1.5], [[1]]]),
                 label="value")
    for e in _pick(draw, _events(c.docs[r]), "kernels", "kernel"):
        _args(e)[key] = value
    return f"kernel {key} = {value!r}"


def m_names(c: Case, r: int, draw: Callable) -> str:
    name = draw(st.sampled_from(KERNEL_NAMES), label="name")
    cat = draw(st.sampled_from(["kernel", "cpu_op", "user_annotation", "cuda_runtime"]), label="cat")
    for e in _pick(draw, _events(c.docs[r]), "events", cat):
        e["name"] = name
    return f"{cat} named {name[:30]!r}"


def m_clock_skew(c: Case, r: int, draw: Callable) -> str:
    off = draw(st.sampled_from([3e3, -3e3, 2e6, -2e6, 1e12, -1e12]), label="offset")
    for e in _events(c.docs[r]):
        if isinstance(e, dict) and isinstance(e.get("ts"), (int, float)):
            e["ts"] += off
    return f"rank clock shifted by {off} us"


def m_graph_launches(c: Case, r: int, draw: Callable) -> str:
    evs = _events(c.docs[r])
    launches = [e for e in evs if isinstance(e, dict) and e.get("name") == "cudaGraphLaunch"]
    how = draw(st.sampled_from(["drop", "duplicate", "recorrelate"]), label="how")
    for e in _pick(draw, launches, "launches"):
        if how == "drop":
            evs.remove(e)
        elif how == "duplicate":
            evs.append(copy.deepcopy(e))
        else:
            _args(e)["correlation"] = draw(st.sampled_from([-1, 0, 2**62]), label="corr")
    return f"cudaGraphLaunch: {how}"


def m_capture(c: Case, r: int, draw: Callable) -> str:
    if r not in c.captures:
        return "no capture trace"
    how = draw(st.sampled_from(["truncate", "shuffle", "garbage", "args", "drop"]), label="how")
    cap = c.captures[r]
    if how == "truncate":
        cap["traceEvents"] = cap["traceEvents"][:draw(st.integers(0, len(cap["traceEvents"])), label="keep")]
    elif how == "shuffle":
        random.Random(draw(st.integers(0, 2**16), label="seed")).shuffle(cap["traceEvents"])
    elif how == "garbage":
        c.raw_captures[r] = draw(st.sampled_from([b"", b"[]", b'{"traceEvents": 1}', b"{", b"\xff\xfe",
                                                  b'{"traceEvents": [{"ph": 5}]}']), label="bytes")
    elif how == "args":
        key = draw(st.sampled_from(["Input Dims", "correlation", "grid", "External id"]), label="key")
        value = draw(st.sampled_from(WEIRD), label="value")
        for e in _pick(draw, cap["traceEvents"], "events"):
            _args(e)[key] = value
    else:
        del c.captures[r]
    return f"capture trace TP-{r}: {how}"


def m_ranks(c: Case, r: int, draw: Callable) -> str:
    """Rank files: one missing, a gap in the TP numbers, a copy from another capture."""
    how = draw(st.sampled_from(["missing", "gap", "other_capture", "extra_copy", "unnamed"]), label="how")
    if how == "missing":
        c.docs = [c.docs[0]]
    elif how == "gap":
        c.names = {0: "fixture-TP-0", 1: "fixture-TP-2"}
    elif how == "other_capture":
        c.names = {0: "run-1700000000-TP-0", 1: "run-1700009999-TP-1"}
    elif how == "extra_copy":
        c.docs = [*c.docs, copy.deepcopy(c.docs[0])]
    else:
        c.names = {0: "rank-a", 1: "rank-b"}
    return f"ranks: {how}"


MUTATIONS: dict[str, Callable[[Case, int, Callable], str]] = {
    f.__name__[2:]: f for f in (
        m_truncate_events, m_truncate_event, m_wrong_type, m_missing_field, m_durations, m_timestamps,
        m_big_ints, m_duplicate_correlation, m_missing_correlation, m_outside_steps, m_order, m_categories,
        m_empty, m_steps, m_duplicate_events, m_nesting, m_top_level, m_shapes, m_grid, m_names, m_clock_skew,
        m_graph_launches, m_capture, m_ranks)
}


@dataclass
class Case:
    """One mutated trace set before it is written."""

    base: Base
    docs: list[Any]
    server_info: Any
    captures: dict[int, Any]
    raw_captures: dict[int, bytes] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def write(self, gz: set[int]) -> Path:
        return _write_case(self.base, self.docs, self.server_info, gz=gz, captures=self.captures,
                           raw_captures=self.raw_captures, names=self.names)


@given(data=st.data())
@settings(max_examples=N_STRUCT, **SETTINGS)
def test_mutated_structure(bases: dict[str, Base], data: st.DataObject) -> None:
    """One to three mutations of the document, event and args layers (wrong types, missing fields,
    NaN-free but absurd numbers, ints beyond int64, duplicate or missing correlation ids, kernels
    outside any step, events out of order, empty traceEvents, rank files missing or from another
    capture, clock skew, broken capture traces) on either rank of an eager or a CUDA-graph trace set."""
    base = bases[data.draw(st.sampled_from(["eager", "graph"]), label="base")]
    case = Case(base, base.fresh_docs(), dict(base.server_info), copy.deepcopy(base.captures))
    names = data.draw(st.lists(st.sampled_from(sorted(MUTATIONS)), min_size=1, max_size=3), label="mutations")
    for name in names:
        r = data.draw(st.integers(0, len(case.docs) - 1), label="rank")
        note(f"{name} on rank {r}: {MUTATIONS[name](case, r, data.draw)}")
    gz = set(data.draw(st.sets(st.integers(0, len(case.docs) - 1)), label="gzipped"))
    d = case.write(gz)
    run_pipeline(d, "structure", cache=data.draw(st.booleans(), label="cache"),
                 html=data.draw(st.integers(0, 3), label="html") == 0)


# ============================================================================= server_info

SI_KEYS = ["tp_size", "dp_size", "pp_size", "ep_size", "max_total_num_tokens", "page_size", "kv_cache_dtype",
           "served_model_name", "model_path", "attention_backend", "disable_cuda_graph", "enable_dp_attention",
           "model_info", "cuda_graph_max_bs", "quantization"]
MI_KEYS = ["n_routed_experts", "num_experts_per_tok", "num_hidden_layers", "hidden_size", "architectures",
           "text_config"]


@given(data=st.data())
@settings(max_examples=N_SERVER_INFO, **SETTINGS)
def test_mutated_server_info(bases: dict[str, Base], data: st.DataObject) -> None:
    """server_info.json with wrong types, absurd values, huge or non-finite numbers, or not JSON."""
    base = bases[data.draw(st.sampled_from(["eager", "graph"]), label="base")]
    si: Any = copy.deepcopy(base.server_info)
    if data.draw(st.integers(0, 4), label="whole") == 0:
        si = data.draw(st.sampled_from([b"", b"[]", b"{", b"\xff", b"null", b"1", b'{"tp_size": ' + b"9" * 5000 + b"}",
                                        b"[" * 5000, b'{"tp_size": NaN, "page_size": Infinity}']), label="bytes")
    else:
        for _ in range(data.draw(st.integers(1, 4), label="n")):
            in_model = data.draw(st.booleans(), label="model_info")
            target = si.setdefault("model_info", {}) if in_model else si
            if not isinstance(target, dict):
                target = si
            key = data.draw(st.sampled_from(MI_KEYS if in_model else SI_KEYS), label="key")
            target[key] = data.draw(st.sampled_from(WEIRD + [0, -5, 3, 7, 1024, 10**12, float("nan"),
                                                             float("inf"), -float("inf")]), label="value")
    note(f"server_info: {str(si)[:200]}")
    d = _write_case(base, base.fresh_docs(), si)
    run_pipeline(d, "server_info", html=data.draw(st.booleans(), label="html"))


# ============================================================================= the CLI

def _cli_cases(base: Base) -> dict[str, tuple[Path, int]]:
    """A handful of mutated trace sets and the exit code each must give through the CLI."""
    text = base.texts[1]
    docs = base.fresh_docs()
    no_kernels = base.fresh_docs()
    no_kernels[1]["traceEvents"] = [e for e in no_kernels[1]["traceEvents"] if e.get("cat") != "kernel"]
    big = base.fresh_docs()
    next(e for e in big[1]["traceEvents"] if e.get("cat") == "kernel")["args"]["correlation"] = 2**64
    skewed = base.fresh_docs()
    for e in skewed[1]["traceEvents"]:
        e["ts"] += 2.5e6
    return {
        "truncated gzip": (_write_case(base, docs, base.server_info, raw={1: gzip.compress(text)[:-9]}, gz={1}), 2),
        "not an object": (_write_case(base, docs, base.server_info, raw={1: b"[1, 2, 3]"}), 2),
        "invalid UTF-8": (_write_case(base, docs, base.server_info,
                                      raw={1: text.replace(b'"name": "', b'"name": "\xff', 1)}), 2),
        "int beyond int64 (an absent id)": (_write_case(base, big, base.server_info), 0),
        "no kernels": (_write_case(base, no_kernels, base.server_info), 2),
        "deep nesting": (_write_case(base, docs, base.server_info, raw={1: b'{"traceEvents": ' + b"[" * 100000}), 2),
        "clock skew": (_write_case(base, skewed, base.server_info), 0),
    }


def test_cli_mutated_inputs_exit_2_with_one_line(bases: dict[str, Base]) -> None:
    """Through ``python -m traceinspect analyze``: exit 2 and exactly one stderr line, no traceback;
    a usable input exits 0. The subprocesses run side by side."""
    cases = _cli_cases(bases["eager"])
    env = dict(os.environ)
    procs = {name: subprocess.Popen([sys.executable, "-m", "traceinspect", "analyze", str(d), "-q"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for name, (d, _) in cases.items()}
    for name, p in procs.items():
        out, err = p.communicate(timeout=240)
        want = cases[name][1]
        assert p.returncode == want, (name, p.returncode, err)
        assert "Traceback" not in err and "Traceback" not in out, (name, err)
        if want == 2:
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("traceinspect: error: "), (name, err)
        COUNTS.setdefault("cli", Counter())["error" if want == 2 else "result"] += 1
        shutil.rmtree(cases[name][0], ignore_errors=True)


# ============================================================================= memory and time bounds

_BOUNDED = r"""
import resource, sys, time
limit = int(sys.argv[1])
resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
t0 = time.perf_counter()
from traceinspect.cli import main
try:
    main(["analyze", sys.argv[2], "-q", "--json", sys.argv[3], "--jobs", "1", "--no-cache"])
except SystemExit as e:
    code = e.code
else:
    code = 0
# VmHWM: this process's own peak (ru_maxrss would include the parent's, inherited through fork and exec)
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM:"))
rss = int(hwm.split()[1]) * 1024
print(f"RESULT {code} {rss} {time.perf_counter() - t0:.2f}")
"""
AS_LIMIT = 3 << 30  # address space of the analysing process
RSS_LIMIT = 1536 << 20


def _run_bounded(d: Path, out: Path) -> tuple[int, int, float, str]:
    p = subprocess.run([sys.executable, "-c", _BOUNDED, str(AS_LIMIT), str(d), str(out)], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    m = re.search(r"RESULT (\S+) (\d+) ([\d.]+)", p.stdout)
    assert m, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    code = 0 if m.group(1) == "None" else int(m.group(1))
    return code, int(m.group(2)), float(m.group(3)), p.stderr


def test_huge_inputs_stay_within_memory_and_time(bases: dict[str, Base], tmp_path: Path) -> None:
    """Under RLIMIT_AS: a rank file with a million flow events (one kind), and kernels that claim
    absurd durations (1e300 us, Kineto's underflowed 1.8e16 us, an hour) inside analysed steps. Both
    give a result (the absurd events dropped with a warning), in bounded memory and time."""
    base = bases["eager"]
    docs = base.fresh_docs()
    t0 = docs[1]["traceEvents"][0]["ts"]
    flow = ('{"ph":"f","id":%d,"pid":0,"tid":7,"ts":%.3f,"cat":"ac2g","name":"ac2g","bp":"e"}')
    head = json.dumps({**docs[1], "traceEvents": []}).encode()
    body = ",".join(flow % (i, t0 + i * 1e-3) for i in range(1_000_000)).encode()
    many = head.replace(b'"traceEvents": []', b'"traceEvents": [' + body + b"," + json.dumps(
        docs[1]["traceEvents"]).encode()[1:])
    d_many = _write_case(base, docs, base.server_info, raw={1: many})

    absurd = base.fresh_docs()
    kernels = [e for e in absurd[1]["traceEvents"] if e.get("cat") == "kernel"]
    mid = len(kernels) // 2
    for e, dur in zip(kernels[mid:mid + 3], (1e300, 1.8446744073709552e16, 3.6e9), strict=True):
        e["dur"] = dur
    d_absurd = _write_case(base, absurd, base.server_info)

    for label, d, big in (("a million events", d_many, len(many)), ("absurd durations", d_absurd, 0)):
        out = tmp_path / f"{d.name}.json"
        code, rss, secs, err = _run_bounded(d, out)
        print(f"{label}: exit {code}, max RSS {rss / 2**20:.0f} MiB, {secs:.1f} s, input {big / 1e6:.0f} MB")
        assert code == 0, (label, err)
        assert rss < RSS_LIMIT, (label, rss)
        doc = json.loads(out.read_text())
        if label == "absurd durations":
            assert any("dropped 2 of" in w and "over a day" in w for w in doc["warnings"]), doc["warnings"]
        COUNTS.setdefault("bounded", Counter())["result"] += 1
        shutil.rmtree(d, ignore_errors=True)


# ============================================================================= times far from the trace's

# (base, field, value, which kernels of rank 1): a ts far outside the profile (at 1e18 us float64 keeps no
# microseconds) is dropped as unusable; an absurd dur too; a kernel an hour or ten seconds away from the
# others (before its own launch: the replay cannot place it in measured order) is kept, and the analysis
# stays finite
FAR: dict[str, tuple[str, str, float, str]] = {
    "graph, first kernel at ts -1e18": ("graph", "ts", -1e18, "first"),
    "graph, first kernel at ts 1e18": ("graph", "ts", 1e18, "first"),
    "eager, a middle kernel at ts -1e18": ("eager", "ts", -1e18, "middle"),
    "eager, a middle kernel at ts 1e18": ("eager", "ts", 1e18, "middle"),
    "graph, a middle kernel lasting 1e18 us": ("graph", "dur", 1e18, "middle"),
    "graph, first kernel 10 s before the others": ("graph", "ts+", -1e7, "first"),
    "graph, ten kernels an hour early": ("graph", "ts+", -3.6e9, "ten"),
    "eager, first kernel an hour late": ("eager", "ts+", 3.6e9, "first"),
    "eager, a middle kernel lasting an hour": ("eager", "dur", 3.6e9, "middle"),
}


@pytest.mark.parametrize("case", list(FAR))
def test_times_far_from_the_trace_give_a_finite_analysis(bases: dict[str, Base], case: str) -> None:
    from traceinspect.document import dumps, nonfinite_path
    from traceinspect.pipeline import analyze

    name, field, value, which = FAR[case]
    base = bases[name]
    docs = base.fresh_docs()
    kernels = [e for e in docs[1]["traceEvents"] if e.get("cat") == "kernel"]
    picked = {"first": kernels[:1], "middle": [kernels[len(kernels) // 2]],
              "ten": kernels[::len(kernels) // 10][:10]}[which]
    for e in picked:
        if field == "ts+":
            e["ts"] += value
        else:
            e[field] = value
    d = _write_case(base, docs, base.server_info)
    try:
        doc = analyze(str(d), jobs=1, use_cache=False, command="traceinspect analyze far").to_json()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    assert nonfinite_path(doc) is None, nonfinite_path(doc)
    dumps(doc)
    dropped = [w for w in doc["warnings"] if "dropped 1 of" in w and "unusable" in w]
    assert len(dropped) == (field != "ts+" and abs(value) >= 1e12), doc["warnings"]  # else nothing dropped
    assert doc["steps"]["count"] >= 2 and all(math.isfinite(x) for x in (doc["steps"]["median_us"],))


def test_the_document_refuses_a_non_finite_number_naming_its_path(tmp_path: Path) -> None:
    from traceinspect.document import NonFiniteNumber, write_document

    doc = {"schema": "x", "findings": [{"fixes": [{"saving_share": 0.5}, {"saving_share": float("nan")}]}],
           "report": {"timeline": {"span": 1.0, "lanes": [{"ts": [0.0, float("-inf")]}]}}}
    with pytest.raises(NonFiniteNumber, match=r"non-finite number nan at \$\.findings\[0\]\.fixes\[1\]\.saving_share"):
        write_document(tmp_path / "a.json", doc)
    doc["findings"] = []
    with pytest.raises(NonFiniteNumber, match=r"-inf at \$\.report\.timeline\.lanes\[0\]\.ts\[1\]"):
        write_document(tmp_path / "a.json", doc)
    assert not (tmp_path / "a.json").exists()
    doc["report"]["timeline"]["lanes"] = []
    assert json.loads(write_document(tmp_path / "a.json", doc).read_text()) == doc


@pytest.mark.timeout(300)
def test_hostile_long_names_cost_bounded_time(bases: dict[str, Base]) -> None:
    """Two hundred distinct 100 kB kernel names per rank (20 MB of names) analyse (in seconds; matching every class
    pattern against every full name would take many minutes, past this test's timeout)."""
    base = bases["eager"]
    docs = base.fresh_docs()
    for doc in docs.values() if isinstance(docs, dict) else docs:  # every rank: the ranks of one run share names
        kernels = [e for e in doc["traceEvents"] if e.get("cat") == "kernel"]
        for i, e in enumerate(kernels):
            e["name"] = f"k{i % 200}_" + "x" * 100_000
    d = _write_case(base, docs, base.server_info)
    assert run_pipeline(d, "bounded") == "result"


# ============================================================================= atheris (optional)

_ATHERIS = r"""
import pathlib, resource, sys, tempfile
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # memory bound (libFuzzer's RSS check would
# count the parent's peak: ru_maxrss is inherited through fork and exec)
import numpy, pandas, msgspec  # noqa: F401 - imported before instrumentation: only traceinspect is instrumented
import atheris
with atheris.instrument_imports(include=["traceinspect"]):
    from traceinspect.load import parse as P
    from traceinspect.load import raw as R
from traceinspect.errors import TraceInspectError

P.BLOCK, P.PIECE = R.BLOCK, R.PIECE = 64, 256  # the reader cuts even small inputs into many pieces
TMP = pathlib.Path(tempfile.mkdtemp()) / "fuzz.trace.json"
TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")


def outcome(fn):
    try:
        return fn()
    except TraceInspectError:
        return None


def one(data: bytes) -> None:
    TMP.write_bytes(data)
    split = outcome(lambda: P.parse_file(TMP))
    whole = outcome(lambda: P.parse_bytes_whole(data, TMP))
    if (split is None) != (whole is None):
        raise AssertionError(f"streaming read {'failed' if split is None else 'succeeded'}, whole decode did not")
    if whole is not None:
        for t in TABLES:
            if not getattr(split, t).equals(getattr(whole, t)):
                raise AssertionError(f"streaming and whole decode give different {t}")


atheris.Setup([sys.argv[0], f"-runs={sys.argv[2]}", "-max_len=20000", "-seed=1", "-rss_limit_mb=0",
               "-malloc_limit_mb=0", "-max_total_time=60", "-print_final_stats=1",
               f"-artifact_prefix={sys.argv[3]}/", sys.argv[1]], one)
atheris.Fuzz()
"""


def test_atheris_parser_fuzz(bases: dict[str, Base], tmp_path: Path) -> None:
    """Coverage-guided fuzzing of the rank-file reader with atheris, where it is installed: any exception
    other than TraceInspectError fails it, and so does the streaming reader (cutting the input into tiny
    pieces) disagreeing with a whole-document decode."""
    pytest.importorskip("atheris")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, base in bases.items():  # small valid documents to start from
        text = base.texts[0][:12000]
        (corpus / f"{name}.json").write_bytes(text[:text.rfind(b"}, {") + 1] + b"]}")
    runs = 2000 * SCALE
    p = subprocess.run([sys.executable, "-c", _ATHERIS, str(corpus), str(runs), str(tmp_path)], capture_output=True,
                       text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-4000:]
    m = re.search(r"Done (\d+) runs", p.stderr)
    assert m and int(m.group(1)) > 0, p.stderr[-2000:]
    COUNTS.setdefault("atheris", Counter())["parsed"] += int(m.group(1))
    print(f"atheris: {m.group(1)} inputs")


# ============================================================================= summary

def _summary() -> dict[str, Any]:
    tried = sum(sum(c.values()) for c in COUNTS.values())
    return {
        "tried": tried,
        "crashes": 0,  # a crash fails its test; a summary is only written for runs that got here
        "by_test": {k: dict(v) for k, v in sorted(COUNTS.items())},
        "clean_errors": dict(ERRORS.most_common(25)),
        "scale": SCALE,
    }


def _write_summary() -> dict[str, Any]:
    s = _summary()
    ARTIFACTS.mkdir(exist_ok=True)
    tmp = SUMMARY.with_suffix(".tmp")
    tmp.write_text(json.dumps(s, indent=2) + "\n")
    tmp.replace(SUMMARY)
    return s


@pytest.fixture(scope="module", autouse=True)
def _report_count(request: pytest.FixtureRequest):
    yield
    if not COUNTS:
        return
    s = _write_summary()
    line = (f"fuzz: {s['tried']} mutated inputs tried, 0 crashes "
            f"({', '.join(f'{k}: {sum(v.values())}' for k, v in s['by_test'].items())}); see {SUMMARY}")
    tr = request.config.pluginmanager.getplugin("terminalreporter")
    if tr is not None:  # shown whether or not output is captured
        tr.write_line(line)
    print(line)


def test_fuzz_summary_written() -> None:
    """The count of mutated inputs is recorded (and it is the full count when the fuzz tests ran)."""
    if not {"bytes", "structure", "server_info"} <= set(COUNTS):
        pytest.skip("the fuzz tests did not all run in this session")
    s = _write_summary()
    on_disk = json.loads(SUMMARY.read_text())
    assert on_disk["tried"] == s["tried"] >= MIN_TRIED
    assert sum(COUNTS["bytes"].values()) >= N_BYTES // 2
    assert sum(COUNTS["structure"].values()) >= N_STRUCT // 2
    assert COUNTS["structure"]["result"] > 0 and COUNTS["structure"]["error"] > 0  # both paths exercised
    print(f"fuzz: {s['tried']} mutated inputs tried, 0 crashes")
