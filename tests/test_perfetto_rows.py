"""The merged trace written from the tables' columns (the native row writer) is the document the Python
objects encode to, byte for byte, on GPU fixtures and field traces; the writer refuses
malformed programs and writes numbers that read back as the same doubles."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import fixture_dir, real_trace, rewrite_trace

from traceinspect.pipeline import analyze
from traceinspect.render import perfetto as pf

J = pytest.importorskip("traceinspect.render._json_rows", reason="the native row writer is not built")

FIXTURES = ["kv-full-cast-graph", "tp1-l6-full-eager", "tp1-l12-full-graph-bmm-noinfo", "slow-rank-eager"]
FIELD = ["param__dlrm_8rank", "hyukjlee__traceMap__trace_file__examples__1_h100_1000isl_10osl_32con.pt.trace.json.gz",
         "pytorch__kineto__tb_plugin__samples__resnet50_num_workers_0__worker0.pt.trace.json.gz",
         "tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz"]


def _same_document(path: Path) -> bytes:
    a = analyze(str(path))
    doc = a.to_json()
    native = b"".join(pf.trace_pieces(a, doc))
    assert native == pf.encode(pf.build_trace(a, doc))
    return native


@pytest.mark.parametrize("name", FIXTURES)
def test_fixture_rows_match_the_objects(name: str) -> None:
    _same_document(fixture_dir(name))


@pytest.mark.parametrize("name", FIELD)
def test_field_trace_rows_match_the_objects(name: str) -> None:
    _same_document(real_trace(name))


def test_markup_in_names_is_escaped_in_the_rows(tmp_path: Path) -> None:
    src = fixture_dir("tp1-l6-full-eager")
    evil = "<script>alert(1)</script> & co"
    d = tmp_path / "set"
    d.mkdir()
    p = next(src.glob("*-TP-0*.trace.json.gz"))

    def rename(doc: dict) -> None:
        for e in doc["traceEvents"]:
            if e.get("cat") in ("kernel", "cpu_op"):
                e["name"] = evil + e["name"]
                if isinstance(e.get("args"), dict) and "grid" in e["args"]:
                    e["args"]["grid"] = [1, 2, 3]

    rewrite_trace(p, d / p.name, rename)
    native = _same_document(d)
    assert b"<" not in native and b">" not in native and b"&" not in native
    events = json.loads(native)["traceEvents"]
    assert any(e.get("name", "").startswith(evil) for e in events if e.get("cat") == "kernel")


def test_write_perfetto_without_the_native_writer(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = analyze(str(fixture_dir("tp1-l6-full-graph")))
    doc = a.to_json()
    native = pf.write_perfetto(a, tmp_path / "n.trace.json.gz", doc)
    monkeypatch.setattr(pf, "_rows_native", None)
    plain = pf.write_perfetto(a, tmp_path / "p.trace.json", doc)
    with gzip.open(native, "rb") as f:
        assert f.read() == plain.read_bytes() == pf.encode(pf.build_trace(a, doc))
    assert sorted(q.name for q in tmp_path.iterdir()) == ["n.trace.json.gz", "p.trace.json"]  # no temp files


def test_a_failed_write_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = analyze(str(fixture_dir("tp1-l6-full-graph")))

    def broken(*_: object) -> object:
        yield b'{"traceEvents":['
        raise RuntimeError("disk gone")

    monkeypatch.setattr(pf, "trace_pieces", broken)
    with pytest.raises(RuntimeError):
        pf.write_perfetto(a, tmp_path / "x.trace.json.gz", a.to_json())
    assert not list(tmp_path.iterdir())


def test_numbers_read_back_as_the_same_doubles() -> None:
    rng = np.random.default_rng(7)
    vals = np.concatenate([
        np.round(rng.uniform(0, 2e9, 2000), 3), np.round(rng.uniform(-1e6, 1e6, 500), 3), rng.normal(0, 1e3, 500),
        rng.uniform(0, 1, 200) * 10.0 ** rng.integers(-300, 300, 200),
        [0.0, -0.0, 1.0, -1.0, 0.001, -0.001, 8.999999999999e12, 9.0e12, 1e16, 2.0 ** 53, 5e-324, 1.7976931348623157e308],
    ])
    ints = rng.integers(-2**63, 2**63 - 1, len(vals), dtype=np.int64)
    ints[:3] = [0, -2**63, 2**63 - 1]
    prog = ((J.FLOAT, b",", vals), (J.INT, b",", ints))
    out = json.loads(b"[" + J.rows(prog, 0, len(vals))[1:] + b"]")
    got = np.array(out[0::2], dtype=float)
    assert np.array_equal(got, vals) and np.array_equal(np.signbit(got), np.signbit(vals))
    assert out[1::2] == ints.tolist()
    special = J.rows(((J.FLOAT, b",", np.array([math.nan, math.inf, -math.inf])),), 0, 3)
    assert special == b",null,null,null"


def test_optional_members_groups_and_skips() -> None:
    n = 4
    prog = (
        (J.LIT, b",{"), (J.INT, b'"i":', np.arange(n, dtype=np.int64)),
        (J.GROUP, b',"args":{'), (J.INT_OPT, b',"a":', np.array([1, -1, 2, -1])),
        (J.TEXT, np.array([0, 1, -1, 0]), [b',"t":"x"', b""]), (J.END, b"}"),
        (J.FLOAT_OPT, b',"b":', np.array([0.5, -1.0, math.nan, 3.0])),
        (J.IF, np.array([1, 0, 0, 1], dtype=np.uint8), 1), (J.LIT, b',"f":true'), (J.LIT, b"}"),
    )
    rows = json.loads(b"[" + J.rows(prog, 0, n)[1:] + b"]")
    assert rows == [{"i": 0, "args": {"a": 1, "t": "x"}, "b": 0.5, "f": True}, {"i": 1},
                    {"i": 2, "args": {"a": 2}}, {"i": 3, "args": {"t": "x"}, "b": 3.0, "f": True}]
    assert J.rows(prog, 1, 2) == b',{"i":1}'
    assert J.rows(prog, 2, 2) == b""


@pytest.mark.parametrize("prog, start, stop, error", [
    (((J.INT, b",", np.zeros(2, dtype=np.int64)),), 0, 3, ValueError),  # column shorter than the rows
    (((J.FLOAT, b",", np.zeros(3, dtype=np.float32)),), 0, 3, ValueError),  # 4-byte elements
    (((J.TEXT, np.array([0, 2]), [b"a", b"b"]),), 0, 2, ValueError),  # code past the texts
    (((J.TEXT, np.array([0, 1]), [b"a", "b"]),), 0, 2, TypeError),  # a text that is not bytes
    (((J.IF, np.ones(2, dtype=np.uint8), 1),), 0, 2, ValueError),  # skips past the end
    (((99, b","),), 0, 1, ValueError),  # no such operation
    (((J.LIT, "x"),), 0, 1, TypeError),
    (((J.LIT,),), 0, 1, TypeError),
    (((J.LIT, b","),), 2, 1, ValueError),
    (((J.LIT, b","),), -1, 1, ValueError),
])
def test_malformed_programs_are_refused(prog: tuple, start: int, stop: int, error: type) -> None:
    with pytest.raises(error):
        J.rows(prog, start, stop)


def test_a_failed_compression_is_raised_and_leaves_nothing(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    a = analyze(str(fixture_dir("tp1-l6-full-graph")))

    class Full:
        def write(self, _: bytes) -> None:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    monkeypatch.setattr(pf, "_gzip_writer", lambda raw: Full())
    with pytest.raises(OSError, match="No space left"):
        pf.write_perfetto(a, tmp_path / "x.trace.json.gz", a.to_json())
    assert not list(tmp_path.iterdir())
