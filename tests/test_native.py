"""The native Kineto scanner (traceinspect/load/_kineto_scan.c) against the msgspec path.

Both must give identical tables (and so identical analyses) on every fixture and every public real
trace, on documents cut into pieces anywhere, and on mutated documents (a hypothesis differential
test): either both read a document, to the same tables, or both reject it. Under CI the scanner
must have been built (``pip install -e .`` compiles it) whenever a C compiler exists.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import sysconfig
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import FIXTURES, REAL_TRACES

from traceinspect.errors import TraceInputError
from traceinspect.load import parse

TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")
META = ("devices", "distributed_info", "cuda_runtime_version", "cuda_driver_version", "trace_id", "n_events",
        "dropped")


def _require_native() -> None:
    if parse._native is not None:
        return
    compiler = sysconfig.get_config_var("CC") or "cc"
    if os.environ.get("CI") and shutil.which(compiler.split()[0]):
        pytest.fail("the native scanner was not built although a C compiler exists (pip install -e . builds it)")
    pytest.skip("the native scanner is not built")


@pytest.fixture(autouse=True)
def _native() -> None:
    _require_native()


def assert_same(a: parse.ParsedRank, b: parse.ParsedRank) -> None:
    for t in TABLES:
        pd.testing.assert_frame_equal(getattr(a, t), getattr(b, t))
    for m in META:
        assert getattr(a, m) == getattr(b, m), m


def _files() -> list[Path]:
    out = sorted(FIXTURES.rglob("*.json.gz")) + sorted(FIXTURES.rglob("*.trace.json"))
    if REAL_TRACES.is_dir():
        out += sorted(p for p in REAL_TRACES.rglob("*.json*") if p.is_file())
    return [p for p in out if "manifest" not in p.name and "server_info" not in p.name]


def _python(path: Path) -> parse.ParsedRank:
    return parse.parse_bytes_whole(parse.read_bytes(path), path)


def _id(p: Path) -> str:
    return str(p.relative_to(REAL_TRACES if REAL_TRACES in p.parents else FIXTURES))


@pytest.mark.parametrize("path", _files(), ids=_id)
def test_tables_identical_on_fixtures_and_real_traces(path: Path) -> None:
    try:
        want = _python(path)
    except TraceInputError:
        with pytest.raises(TraceInputError):
            parse.parse_file_native(path)
        return
    assert_same(parse.parse_file_native(path), want)


def test_real_traces_present() -> None:
    """The equality test above ran on the public traces, not only on our own fixtures."""
    files = _files()
    assert any(REAL_TRACES in p.parents for p in files) or not os.environ.get("CI"), "no real traces found"


def _analysis_targets() -> list[Path]:
    out = sorted(d for d in FIXTURES.iterdir() if d.is_dir() and any(d.glob("*.json.gz")))
    rt = FIXTURES / "rule-tests"
    out += sorted(d for d in rt.iterdir() if d.is_dir()) if rt.is_dir() else []
    if REAL_TRACES.is_dir():
        out += sorted(p for p in REAL_TRACES.iterdir() if p.name.endswith((".json.gz", ".json"))
                      and "execution_details" not in p.name)
        out += sorted(d for d in REAL_TRACES.iterdir() if d.is_dir() and any(d.glob("*.json*")))
    return out


def _analysis_doc(target: Path) -> Any:
    from traceinspect.errors import TraceInspectError
    from traceinspect.pipeline import Options, analyze

    try:
        doc = analyze([target], Options(phase="all", use_cache=False, jobs=1)).to_json()
    except TraceInspectError as e:
        return f"error: {type(e).__name__}"
    doc.pop("timing", None)
    return json.dumps(doc, sort_keys=True, default=str)


@pytest.mark.parametrize("target", _analysis_targets(), ids=lambda p: p.name)
def test_analysis_json_identical(target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEINSPECT_NATIVE", "0")
    want = _analysis_doc(target)
    monkeypatch.setenv("TRACEINSPECT_NATIVE", "1")
    assert _analysis_doc(target) == want


# ------------------------------------------------------------------------- pieces, errors, text


def _doc(limit: int | None = None) -> bytes:
    """A fixture's rank file with odd but readable events added (and, unless ``limit`` cuts the events
    short, three GPU events to drop)."""
    f = FIXTURES / "kv-full-cast-graph" / "fixture-TP-0.trace.json.gz"
    doc = json.loads(gzip.decompress(f.read_bytes()))
    bad_gpu = [
        {"ph": "X", "cat": "kernel", "name": 5, "ts": 1, "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "no ts", "dur": 1},
        {"ph": "X", "cat": "kernel", "name": "bad dur", "ts": 1, "dur": "x"},
    ]
    doc["traceEvents"] = doc["traceEvents"][:limit] + ([] if limit else bad_gpu) + [
        {"ph": "X", "cat": "Kernel", "name": "k\u00e9\u4e2d\\}{\"", "ts": 1.5, "dur": 2, "tid": "stream 7",
         "args": {"bytes": "32768", "correlation": "12", "device": 1.0, "grid": [1, 2, 3]}},
        {"ph": "X", "cat": "python_function", "name": "gpu_worker.py(88): execute_model", "ts": 3, "dur": 9,
         "tid": 5},
        {"ph": "X", "cat": "python_function", "name": "other.py(1): helper", "ts": 3, "dur": 1, "tid": 5},
        {"ph": "X", "cat": "python_function", "name": ["not a name"], "ts": 3, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "\ud83d\ude00", "ts": "2.5", "dur": -0, "tid": "42",
         "args": {"Input Dims": [[1, 2], []], "Input type": None}},
        "not an event", 7,
    ]
    return json.dumps(doc, indent=1).encode()


def _native_pieces(data: bytes, size: int) -> parse.ParsedRank:
    return parse._scan_native(iter(data[i:i + size] for i in range(0, len(data), size)), Path("x.json"))


@pytest.mark.parametrize("size", [1, 7, 64, 4096, 1 << 30])
def test_any_cut_into_pieces(size: int) -> None:
    data = _doc(300 if size < 10 else None)  # every byte a piece: a shorter document
    want = parse.parse_bytes_whole(data, Path("x.json"))
    assert want.dropped  # the document has events to drop
    got = _native_pieces(data, size)
    assert_same(got, want)
    assert_same(_native_pieces(b"\xef\xbb\xbf" + data, size), want)


@pytest.mark.parametrize("text, message", [
    (b"", "not valid JSON"),
    (b"   ", "not valid JSON"),
    (b"[]", "not a Kineto trace"),
    (b'"traceEvents"', "not a Kineto trace"),
    (b'{"traceEvents": {}}', "no traceEvents array"),
    (b'{"traceEventz": []}', "not a Kineto trace"),
    (b'{"traceEvents": [}', "not valid JSON"),
    (b'{"traceEvents": [{"ph": "X"},]}', "not valid JSON"),
    (b'{"traceEvents": []} x', "not valid JSON"),
    (b'{"traceEvents": [{"name": "\xff"}]}', "not valid JSON"),
    (b'{"traceEvents": [{"name": "\\ud800"}]}', "not valid JSON"),
    # a surrogate escape not in a high-low pair, in strings the scanner only skips (the typed decoder
    # refuses them anywhere)
    (b'{"traceEvents": ["\\ud800X"]}', "not valid JSON"),
    (b'{"traceEvents": [["\\udfff"]]}', "not valid JSON"),
    (b'{"traceEvents": [{"args": {"x": "\\udc00"}}]}', "not valid JSON"),
    (b'{"traceEvents": [{"args": {"grid": ["\\ud800\\u0041"]}}]}', "not valid JSON"),
    (b'{"traceEvents": [], "x": "\\ud800"}', "not valid JSON"),
    # invalid UTF-8 in the name or tid of an event the analysis never uses, beside a type the typed
    # decoder refuses (which sends the event through the rules, where these strings are read too)
    (b'{"traceEvents": [{"args": "X", "name": "c\x90\x81"}]}', "not valid JSON"),
    (b'{"traceEvents": [{"ph": "X", "cat": "zzz", "args": "X", "tid": "\xff"}]}', "not valid JSON"),
    # ... or at an earlier place of a repeated key (every place of ph, cat, name and tid is read), after a
    # type the typed decoder refuses (a fuzz finding: the rules read only the last place)
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "1.5", "tid": "s\xfc\xfc", "tid": 3}]}', "not valid JSON"),
    (b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": "1", "name": "\xc3", "name": "k"}]}', "not valid JSON"),
    (b'{"traceEvents": [{"ph": "i", "ts": "1", "cat": "a\xfc", "cat": "x", "ph": "\xfc", "ph": "X"}]}',
     "not valid JSON"),
    # invalid UTF-8 in a kernel's grid or block, kept raw by the typed decoder (once a crash there)
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "args": {"grid": ["\xfc"]}}]}',
     "not valid JSON"),
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "1", "args": {"block": "\xfc"}}]}',
     "not valid JSON"),
    # invalid UTF-8 in the device properties, after a type the typed decoder refuses (a fuzz finding: the
    # rules took the properties as absent)
    (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "ts": "1.5"}], "deviceProperties": [{"name": "M\x92"}]}',
     "not valid JSON"),
    (b'{"deviceProperties": [{"name": "M\x92"}], "traceEvents": [{"ph": "X", "cat": "kernel", "ts": "1.5"}]}',
     "not valid JSON"),
    (b'{"traceEvents": [{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}]}", "not valid JSON"),
    (b'{"traceEvents": [{"a": ' + b'{"b":' * 100_000 + b"}" * 100_000 + b"}]}", "not valid JSON"),
    (b'{"traceEvents": [{"ts": 01}]}', "not valid JSON"),
    (b'{"traceEvents": [{"ts": 1.}]}', "not valid JSON"),
    (b'{"traceEvents": [{"ts": NaN}]}', "not valid JSON"),
    (b'{"traceEvents": [{"s": "a\x01"}]}', "not valid JSON"),
    (b'{"traceEvents": [{"s": "\\x"}]}', "not valid JSON"),
])
def test_broken_documents_are_one_clean_error(text: bytes, message: str) -> None:
    for size in (1, 5, 1 << 30):
        with pytest.raises(TraceInputError, match=message):
            _native_pieces(text, size)
    with pytest.raises(TraceInputError):
        parse.parse_bytes_whole(text, Path("x.json"))


@pytest.mark.parametrize("text", [
    # invalid UTF-8 where neither reader decodes it: an unknown member, an args value kept raw, a repeated
    # ts or grid whose last place is sound (both keep the last)
    b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "1.5", "zz": "\xfc", "tid": 1}]}',
    b'{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "k", "ts": "1", "args": {"Input Dims": ["\xfc"]}}]}',
    b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "1.5", "ts": "\xfc", "ts": 2, "tid": 3}]}',
    b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": 1, "args": {"grid": "\xfc", "grid": [1]}}]}',
])
def test_invalid_utf8_neither_reader_decodes_is_read_alike(text: bytes) -> None:
    want = parse.parse_bytes_whole(text, Path("x.json"))
    assert want.n_events == 1
    for size in (1, 5, 1 << 30):
        assert_same(_native_pieces(text, size), want)


def test_a_surrogate_pair_in_a_skipped_string_is_read() -> None:
    text = b'{"traceEvents": [["\\ud83d\\ude00"], {"args": {"x": "a\\udbff\\udfffb"}}]}'
    want = parse.parse_bytes_whole(text, Path("x.json"))
    for size in (1, 5, 1 << 30):
        assert_same(_native_pieces(text, size), want)


def test_every_truncation_is_an_error() -> None:
    data = json.dumps({"traceEvents": [{"ph": "X", "cat": "kernel", "name": "a\\u00e9", "ts": 1.25, "dur": 2,
                                        "args": {"grid": [1, 1, 1], "correlation": 3}}], "trace_id": "t"}).encode()
    for n in range(len(data)):
        with pytest.raises(TraceInputError):
            _native_pieces(data[:n], 3)
    assert _native_pieces(data, 3).kernels["name"].tolist() == ["a\\u00e9"]


def test_scanner_refuses_misuse() -> None:
    s = parse._native.Scanner([["name"]], lambda c: 0)
    with pytest.raises(RuntimeError):
        s.result()  # nothing scanned yet
    s.feed(b'{"traceEvents": []}', final=True)
    with pytest.raises(RuntimeError):
        s.feed(b"")
    with pytest.raises(ValueError):
        parse._native.Scanner([["no such column"]], lambda c: 0)
    bad = parse._native.Scanner([["name"]], lambda c: 99)  # a route that answers nonsense
    with pytest.raises(ValueError):
        bad.feed(b'{"traceEvents": [{"ph": "X", "cat": "kernel"}]}', final=True)


def test_result_columns_are_the_scanners_buffers_handed_over() -> None:
    """The result's columns are the scanner's own buffers (no copy), writable, and outlive the scanner."""
    import gc

    import numpy as np

    s = parse._native.Scanner([["name", "ts", "tid"]], lambda c: 0)
    s.feed(b'{"traceEvents": [{"ph": "X", "cat": "k", "name": "a", "ts": 1.5, "tid": 7},'
           b' {"ph": "X", "cat": "k", "name": "b", "ts": 2.5, "tid": "x"}]}', final=True)
    res = s.result()
    del s
    gc.collect()
    cols = res["kinds"][0]
    assert all(isinstance(cols[c], parse._native.Column) for c in ("name", "ts", "tid", "tid_rows", "tid_strs"))
    ts = np.frombuffer(cols["ts"], dtype=np.float64)
    assert ts.tolist() == [1.5, 2.5] and len(cols["ts"]) == 16 and ts.flags.writeable
    tid = np.frombuffer(cols["tid"], dtype=np.int64)
    tid[np.frombuffer(cols["tid_rows"], dtype=np.int64)] = 9  # the loader writes string tids in place
    assert np.frombuffer(cols["tid"], dtype=np.int64).tolist() == [7, 9]
    assert bytes(memoryview(cols["name"])) == np.array([0, 1], dtype=np.int32).tobytes()
    empty = parse._native.Scanner([["ts"]], lambda c: 0)
    empty.feed(b'{"traceEvents": []}', final=True)
    none = empty.result()["kinds"][0]["ts"]
    assert len(none) == 0 and np.frombuffer(none, dtype=np.float64).size == 0
    del res, ts, tid
    gc.collect()  # (a column freed while arrays viewed it would crash here under ASan)


# ------------------------------------------------------------------ differential, mutated traces

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_KEYS = ["ph", "cat", "name", "ts", "dur", "tid", "args", "pid"]
_ARG_KEYS = ["correlation", "External id", "device", "stream", "bytes", "grid", "block", "Input Dims",
             "Input type", "Concrete Inputs", "kind"]
# raw JSON texts: numbers in every spelling, numbers in strings, and values of the wrong type
_RAW = st.one_of(
    st.sampled_from([
        "-0", "0", "-0.0", "1", "-1", "5.0", "1e3", "1E+3", "2.5e-3", "1e400", "-1e400", "1e-400",
        "9223372036854775807", "9223372036854775808", "-9223372036854775808", "-9223372036854775809",
        "18446744073709551616", "123456789012345678901234567890", "9007199254740993", "0.1", "86400000001",
        '"12"', '"-0"', '"1.5e3"', '"5.0"', '" 1"', '"+1"', '"0x10"', '"1_000"', '"01"', '"1."', '"nan"',
        '"inf"', '""', '"\\u0031"', '"X"', '"kernel"', '"Kernel"', '"cpu_op"', '"cuda_runtime"',
        '"gpu_user_annotation"', '"user_annotation"', '"gpu_memcpy"', '"\u212aernel"', '"stream 7"',
        '"python_function"', '"worker.py(12): execute_model"',
        '"\\ud83d\\ude00"', '"caf\u00e9"', "true", "false", "null", "[]", "{}", "[1, 2, 3]", '[[1, 2], []]',
        '{"correlation": 1}', '{"bytes": "7"}', '{"device": 1.5}',
    ]),
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=6).map(lambda s: json.dumps(s)),
)


def _small_doc() -> dict[str, Any]:
    f = FIXTURES / "kv-full-cast-eager" / "fixture-TP-0.trace.json.gz"
    doc = json.loads(gzip.decompress(f.read_bytes()))
    evs = doc["traceEvents"]
    by_cat: dict[str, list[Any]] = {}
    for e in evs:
        by_cat.setdefault(str(e.get("cat")), []).append(e)
    keep = [e for c in by_cat.values() for e in c[:25]]
    doc["traceEvents"] = keep * 4  # many GPU events: a few dropped ones stay under 1%
    return doc


_SMALL: dict[str, Any] = {}


def _base() -> dict[str, Any]:
    if not _SMALL:
        _SMALL.update(_small_doc())
    return _SMALL


@st.composite
def _mutated(draw: Any) -> bytes:
    doc = json.loads(json.dumps(_base()))
    evs = doc["traceEvents"]
    subs: dict[str, str] = {}
    for k in range(draw(st.integers(1, 6))):
        i = draw(st.integers(0, len(evs) - 1))
        what = draw(st.sampled_from(["set", "set_arg", "del", "del_arg", "replace", "dup"]))
        mark = f"@@{k}@@"
        ev = evs[i]
        if not isinstance(ev, dict):
            continue
        if what == "set":
            ev[draw(st.sampled_from(_KEYS))] = mark
        elif what == "set_arg":
            if not isinstance(ev.get("args"), dict):
                ev["args"] = {}
            ev["args"][draw(st.sampled_from(_ARG_KEYS))] = mark
        elif what == "del":
            ev.pop(draw(st.sampled_from(_KEYS)), None)
        elif what == "del_arg" and isinstance(ev.get("args"), dict):
            ev["args"].pop(draw(st.sampled_from(_ARG_KEYS)), None)
        elif what == "replace":
            evs[i] = mark
        elif what == "dup":  # a repeated key: the last one counts
            key = draw(st.sampled_from(_KEYS))
            evs[i] = {**ev, "@@dup@@": 0}
            subs['"@@dup@@": 0'] = f'"{key}": {mark}'
        subs[f'"{mark}"'] = draw(_RAW)
    text = json.dumps(doc)
    for a, b in subs.items():
        text = text.replace(a, b)
    data = text.encode()
    if draw(st.booleans()):  # a byte-level edit (ASCII, so the text stays UTF-8)
        pos = draw(st.integers(0, len(data)))
        junk = draw(st.sampled_from([b"", b"{", b"}", b"[", b"]", b",", b'"', b":", b"\\", b"0", b"-", b" "]))
        cut = draw(st.integers(0, 3))
        data = data[:pos] + junk + data[pos + cut:]
    return data


def _outcome(fn: Any, data: bytes) -> Any:
    try:
        return fn(data)
    except TraceInputError:
        return None


@settings(max_examples=int(os.environ.get("TRACEINSPECT_NATIVE_EXAMPLES", "150")),
          suppress_health_check=list(HealthCheck))  # derandomized, no deadline: tests/conftest.py's profile
@given(data=_mutated(), size=st.sampled_from([1 << 30, 4096, 97]))
def test_differential_mutated_traces(data: bytes, size: int) -> None:
    want = _outcome(lambda d: parse.parse_bytes_whole(d, Path("x.json")), data)
    got = _outcome(lambda d: _native_pieces(d, size), data)
    if want is None or got is None:
        assert want is None and got is None, ("python", want is not None, "native", got is not None)
        return
    assert_same(got, want)


def test_nest_parents_native_equals_numpy() -> None:
    """The native stack walk finds each op's enclosing op exactly as the numpy pointer jumping does: random
    nested intervals per thread, equal starts, zero durations, overlaps that do not nest, and NaN times."""
    import numpy as np

    from traceinspect import link

    native = parse._native
    rng = np.random.default_rng(7)
    for trial in range(40):
        n = int(rng.integers(1, 3000))
        key = np.sort(rng.integers(0, 1 + trial % 5, n)).astype(np.int64)
        ts = np.round(rng.uniform(0, 1000, n), 0 if trial % 3 == 0 else 3)
        dur = np.where(rng.random(n) < 0.1, 0.0, rng.exponential(50 if trial % 2 else 400, n))
        if trial % 4 == 0:
            ts[rng.random(n) < 0.02] = np.nan
        order = np.lexsort((-dur, ts, key))
        key, ts, end = key[order], ts[order], (ts + dur)[order]
        got = np.frombuffer(native.nest_parents(key, ts, end), dtype=np.int64)
        assert np.array_equal(got, link._nest_parents_numpy(key, ts, end)), trial
    with pytest.raises(TypeError):
        native.nest_parents(np.zeros(3, dtype=np.int32), np.zeros(3), np.zeros(3))
    with pytest.raises(TypeError):
        native.nest_parents(np.zeros(3, dtype=np.int64), np.zeros(2), np.zeros(3))


def _random_dag(rng, n: int, m: int, repeat: float = 0.2):
    """A node-weighted DAG on a random numbering (edges run both ways in id), integer weights with many
    zeros (plenty of equally long paths) and repeated edges."""
    import numpy as np

    rank = rng.permutation(n)  # a topological position per node
    src, dst = [], []
    for _ in range(m):
        a, b = rng.choice(n, 2, replace=False).tolist()
        if rank[a] > rank[b]:
            a, b = b, a
        src.append(a)
        dst.append(b)
        if rng.random() < repeat:
            src.append(a)
            dst.append(b)
    return (rng.integers(0, 3, n).astype(np.float64), np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64),
            rank)


def test_longest_path_native_equals_python_and_networkx() -> None:
    """On random DAGs with ties, the native longest path is the Python loop's and networkx's
    ``dag_longest_path``, whichever nodes are source and sink and whether they have edges of their own."""
    import numpy as np
    from test_collectives import _nx_longest

    from traceinspect.measure.critical_path import _Graph, _longest_path

    native = parse._native
    rng = np.random.default_rng(11)
    for trial in range(300):
        n = int(rng.integers(1, 80))
        w, s, d, rank = _random_dag(rng, n, int(rng.integers(0, 3 * n + 1)) if n > 1 else 0)
        if trial % 3 == 0 and n > 1:  # source first and sink last in topological order, as a step graph has them
            source, sink = int(np.argmin(rank)), int(np.argmax(rank))
        else:
            source, sink = (int(x) for x in rng.integers(0, n, 2))
        edges = list(zip(s.tolist(), d.tolist(), strict=True))
        got = native.longest_path(n, w, s, d, source, sink)
        try:
            want = _longest_path(n, w.tolist(), edges, source, sink)
        except Exception as e:  # a source after the sink, or one node: the links make a cycle
            assert type(e).__name__ == "Cycle" and got is None, trial
            continue
        assert np.frombuffer(got, dtype=np.int64).tolist() == want, trial
        if trial % 3 == 0 and n > 1:
            G = _Graph()
            G.weight, G.edges = w.tolist(), edges
            assert want == _nx_longest(G, source, sink), trial


def test_longest_path_native_large_and_cycle() -> None:
    import numpy as np

    from traceinspect.measure.critical_path import _longest_path

    native = parse._native
    rng = np.random.default_rng(5)
    w, s, d, rank = _random_dag(rng, 20000, 60000)
    source, sink = int(np.argmin(rank)), int(np.argmax(rank))
    want = _longest_path(20000, w.tolist(), list(zip(s.tolist(), d.tolist(), strict=True)), source, sink)
    assert np.frombuffer(native.longest_path(20000, w, s, d, source, sink), dtype=np.int64).tolist() == want
    # a long chain: no recursion, the path is the chain
    n = 200000
    chain = np.frombuffer(native.longest_path(n, np.ones(n), np.arange(n - 1), np.arange(1, n), 0, n - 1),
                          dtype=np.int64)
    assert np.array_equal(chain, np.arange(n))
    # a cycle is reported, not looped on
    assert native.longest_path(4, np.ones(4), np.array([0, 1, 2, 1]), np.array([1, 2, 1, 3]), 0, 3) is None
    assert native.longest_path(2, np.ones(2), np.array([1]), np.array([1]), 0, 1) is None  # a self-loop


def test_longest_path_native_rejects_malformed_input() -> None:
    """Wrong buffer formats, lengths that disagree and node ids out of range raise; nothing crashes."""
    import numpy as np

    native = parse._native
    i64 = np.array([0, 1], dtype=np.int64)
    ok = (3, np.ones(3), i64, np.array([1, 2], dtype=np.int64), 0, 2)
    assert np.frombuffer(native.longest_path(*ok), dtype=np.int64).tolist() == [0, 1, 2]
    bad_args = [
        (3, np.zeros(3, dtype=np.float32), *ok[2:]),
        (3, np.zeros(3, dtype=np.int64), *ok[2:]),
        (3, np.zeros(3), i64.astype(np.int32), *ok[3:]),
        (3, np.zeros(3), i64.astype(np.float64), *ok[3:]),
        (3, np.zeros(3), i64, i64.astype(">i8"), 0, 2),
        (3, np.zeros(3), i64, [1, 2], 0, 2),
        (3, np.zeros(3), i64, b"\0" * 16, 0, 2),
        (3, np.zeros(3), i64, np.zeros((2, 1), dtype=np.int64), 0, 2),
        (3, np.zeros(6)[::2], *ok[2:]),
        (3, np.zeros(4), *ok[2:]),
        (3, np.zeros(3), i64, np.array([1], dtype=np.int64), 0, 2),
        (3, np.zeros(3), i64, np.array([1, 3], dtype=np.int64), 0, 2),
        (3, np.zeros(3), np.array([-1, 1], dtype=np.int64), np.array([1, 2], dtype=np.int64), 0, 2),
        (3, np.zeros(3), i64, np.array([1, 2], dtype=np.int64), 0, 3),
        (3, np.zeros(3), i64, np.array([1, 2], dtype=np.int64), -1, 2),
        (0, np.zeros(0), i64[:0], i64[:0], 0, 0),
        (-1, np.zeros(3), *ok[2:]),
        (3.0, *ok[1:]),
        (3, np.zeros(3), i64, np.array([1, 2], dtype=np.int64), 0),
    ]
    for args in bad_args:
        with pytest.raises((TypeError, ValueError)):
            native.longest_path(*args)
    rng = np.random.default_rng(3)
    for _ in range(500):  # random ids, lengths and sizes: a path, a cycle or an error, never a crash
        n = int(rng.integers(-2, 12))
        m = int(rng.integers(0, 20))
        args = (n, rng.random(max(n + (int(rng.integers(-1, 2)) if rng.random() < 0.2 else 0), 0)),
                rng.integers(-2, 14, m), rng.integers(-2, 14, m + (1 if rng.random() < 0.1 else 0)),
                int(rng.integers(-1, 13)), int(rng.integers(-1, 13)))
        try:
            out = native.longest_path(*args)
        except (TypeError, ValueError):
            continue
        if out is not None:
            path = np.frombuffer(out, dtype=np.int64)
            assert len(path) >= 1 and ((path >= 0) & (path < n)).all()


def test_step_graph_longest_path_without_the_module(monkeypatch) -> None:
    """``TRACEINSPECT_NATIVE=0``: the Python loop gives the same path."""
    import numpy as np

    from traceinspect.measure.critical_path import StepGraph

    rng = np.random.default_rng(2)
    for _ in range(20):
        w, s, d, rank = _random_dag(rng, 40, 90)
        g = StepGraph(w, np.zeros(40, dtype=np.int64), ["x"], np.zeros(40, dtype=np.int64),
                      np.zeros(40, dtype=np.int64), ["x"], s, d, int(np.argmin(rank)), int(np.argmax(rank)))
        native = g.longest_path()
        monkeypatch.setenv("TRACEINSPECT_NATIVE", "0")
        assert g.longest_path() == native
        monkeypatch.delenv("TRACEINSPECT_NATIVE")


def test_ids_beyond_two_to_the_53_stay_exact_on_both_paths() -> None:
    """Integer ids are int64 as written, on the msgspec path too, also where some events lack them (that
    column once went through float64: 2**63 - 1 came back as -2**63)."""
    text = (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "tid": 7, "ts": 1, "dur": 1, "args": '
            b'{"stream": 7, "correlation": 9223372036854775807, "External id": 9007199254740993}}, '
            b'{"ph": "X", "cat": "kernel", "name": "k2", "tid": 7, "ts": 2, "dur": 1, "args": {"stream": 7}}]}')
    want = parse.parse_bytes_whole(text, Path("x.json"))
    assert want.kernels["correlation"].tolist() == [2**63 - 1, -1]
    assert want.kernels["external_id"].tolist() == [2**53 + 1, -1]
    assert_same(parse.parse_bytes(text, Path("x.json")), want)
    for size in (1, 5, 1 << 30):
        assert_same(_native_pieces(text, size), want)
