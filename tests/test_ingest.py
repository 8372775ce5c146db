"""The streaming rank-file reader, the parsed-table cache and the vectorised linker, each checked
against a plain reference: one-shot decoding of the whole document, a fresh parse, and the
per-event Python walks the vectorised code replaced."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from conftest import fixture_dir

from traceinspect.errors import TraceInputError
from traceinspect.link import _OpTree, _paths
from traceinspect.load import cache, load_trace_set, parse, raw

TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")
META = ("devices", "distributed_info", "cuda_runtime_version", "cuda_driver_version", "trace_id",
        "n_events", "dropped")


def assert_same(a: parse.ParsedRank, b: parse.ParsedRank) -> None:
    for t in TABLES:
        pd.testing.assert_frame_equal(getattr(a, t), getattr(b, t))
    for m in META:
        assert getattr(a, m) == getattr(b, m), m


def _events(n: int = 120) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 1, "tid": 0, "args": {"name": "py"}}]
    for i in range(n):
        t = 1000.0 + 10 * i
        ev.append({"ph": "X", "cat": "cpu_op", "name": f"aten::op{i % 3}", "pid": 1, "tid": 7, "ts": t, "dur": 8.0,
                   "args": {"External id": i + 1, "Input Dims": [[4, i], []], "Input type": ["float", ""],
                            "Concrete Inputs": ["", "1"], "nested": [{"a": 1}, {"b": [2]}]}})
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 7,
                   "ts": t + 1, "dur": 2.0, "args": {"External id": i + 1, "correlation": 100 + i}})
        ev.append({"ph": "X", "cat": "kernel", "name": f"k}}, {{odd] \"name\" {i}" if i % 7 == 0 else f"gemm_{i % 4}",
                   "pid": 0, "tid": 3, "ts": t + 4, "dur": 3.0,
                   "args": {"device": 0, "stream": 3, "correlation": 100 + i, "External id": i + 1,
                            "grid": [1, 2, 3], "block": [128, 1, 1]}})
        ev.append({"ph": "f", "id": 100 + i, "pid": 0, "tid": 3, "ts": t + 4, "cat": "ac2g", "name": "ac2g"})
    ev.append({"ph": "X", "cat": "user_annotation", "name": "step[DECODE bs=4]", "pid": 1, "tid": 7,
               "ts": 990.0, "dur": 500.0})
    ev.append({"ph": "X", "cat": "gpu_user_annotation", "name": "nccl:all_reduce", "pid": 0, "tid": 3,
               "ts": 995.0, "dur": 50.0})
    ev.append({"ph": "X", "cat": "kernel", "name": "bad", "ts": 5.0, "dur": 1e300 * 10})  # inf: dropped
    return ev


HEAD = {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H200", "computeMajor": 9,
                                                   "computeMinor": 0, "numSms": 132}],
        "distributedInfo": {"rank": 0, "world_size": 2}, "cuda_runtime_version": 12080}


def _docs() -> dict[str, bytes]:
    ev = _events()
    compact = json.dumps({**HEAD, "traceEvents": ev, "traceName": "t"}, separators=(",", ":")).encode()
    pretty = json.dumps({**HEAD, "traceEvents": ev, "traceName": "t"}, indent=2).replace("\n", "\r\n").encode()
    trailer = json.dumps({"schemaVersion": 1, "traceEvents": ev, **{k: v for k, v in HEAD.items()
                                                                    if k != "schemaVersion"}}).encode()
    decoy = json.dumps({"traceName": 'x "traceEvents": [ {"ph": "X"} ]', **HEAD, "traceEvents": ev}).encode()
    empty = json.dumps({**HEAD, "traceEvents": []}).encode()
    unicode = json.dumps({**HEAD, "traceEvents": ev + [{"ph": "X", "cat": "kernel", "name": "k\u00e9\u4e2d\\}{",
                                                        "ts": 1.0, "dur": 1.0}]}, ensure_ascii=True).encode()
    return {"compact": compact, "pretty_crlf": pretty, "trailer": trailer, "decoy": decoy, "empty": empty,
            "unicode": unicode}


def _set_read(monkeypatch: pytest.MonkeyPatch, name: str, value: Any) -> None:
    """A read setting where the streaming decoder and the raw read (the native scanner's) both see it."""
    monkeypatch.setattr(parse, name, value)
    monkeypatch.setattr(raw, name, value)


@pytest.mark.parametrize("piece", [64, 1000, 1 << 23])
@pytest.mark.parametrize("name", sorted(_docs()))
def test_streaming_equals_whole_document(name: str, piece: int, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _docs()[name]
    monkeypatch.setattr(parse, "PIECE", piece)
    whole = parse.parse_bytes_whole(data, Path("x.json"))
    assert_same(parse.parse_bytes(data, Path("x.json")), whole)
    if name != "empty":
        assert len(whole.kernels) and len(whole.cpu_ops) and whole.dropped == 1


@pytest.mark.parametrize("gz", [False, True])
def test_files_and_inflate_thread(gz: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _docs()["pretty_crlf"]
    f = tmp_path / ("t.json.gz" if gz else "t.json")
    f.write_bytes(gzip.compress(data) if gz else data)
    _set_read(monkeypatch, "PIECE", 512)
    _set_read(monkeypatch, "BLOCK", 256)
    _set_read(monkeypatch, "THREAD_MIN", 0)  # the second thread inflates even this small file
    assert_same(parse.parse_file(f), parse.parse_bytes_whole(data, f))


def test_real_fixture_streams_like_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    f = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    _set_read(monkeypatch, "PIECE", 1 << 16)
    assert_same(parse.parse_file(f), parse.parse_bytes_whole(gzip.decompress(f.read_bytes()), f))


@pytest.mark.parametrize("backend", ["default", "zlib"])
def test_gzip_members_and_damage(backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "zlib":  # the fallback when ISA-L is not installed
        _set_read(monkeypatch, "_zlib", zlib)
    data = _docs()["compact"]
    whole = parse.parse_bytes_whole(data, Path("x"))
    multi = tmp_path / "multi.json.gz"
    multi.write_bytes(gzip.compress(data[:1000]) + gzip.compress(data[1000:]))
    assert_same(parse.parse_file(multi), whole)
    padded = tmp_path / "padded.json.gz"
    padded.write_bytes(gzip.compress(data) + b"\0" * 100)
    assert_same(parse.parse_file(padded), whole)
    gz = gzip.compress(data)
    (tmp_path / "trunc.json.gz").write_bytes(gz[: len(gz) // 2])
    with pytest.raises(TraceInputError, match="truncated gzip"):
        parse.parse_file(tmp_path / "trunc.json.gz")
    bad = bytearray(gz)
    bad[len(bad) // 2] ^= 0xFF
    (tmp_path / "bad.json.gz").write_bytes(bytes(bad))
    with pytest.raises(TraceInputError, match="corrupt gzip|not valid JSON|not a Kineto"):
        parse.parse_file(tmp_path / "bad.json.gz")
    (tmp_path / "tail.json.gz").write_bytes(gz + b"garbage!")
    with pytest.raises(TraceInputError, match="corrupt gzip"):
        parse.parse_file(tmp_path / "tail.json.gz")
    with pytest.raises(TraceInputError, match="no such file"):
        parse.parse_file(tmp_path / "missing.json")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace(b'"traceEvents":', b'"traceEventz":', 1), "not a Kineto trace: no traceEvents array"),
    (lambda s: s.replace(b'"traceEvents":[', b'"traceEvents":{"a":[', 1)[:-1] + b"}}",
     "not a Kineto trace: no traceEvents array"),
    (lambda s: s.replace(b'"ts":1010.0', b'"ts":1010.0,,', 1), "not valid JSON"),
    (lambda s: s[: len(s) - 30], "not valid JSON"),
    (lambda s: b"[" + s + b"]", "not a Kineto trace"),
])
def test_broken_documents_fail_like_a_whole_decode(edit: Any, message: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = edit(_docs()["compact"])
    monkeypatch.setattr(parse, "PIECE", 256)
    with pytest.raises(TraceInputError, match=message) as streamed:
        parse.parse_bytes(data, Path("x.json"))
    with pytest.raises(TraceInputError) as whole:
        parse.parse_bytes_whole(data, Path("x.json"))
    assert str(streamed.value) == str(whole.value)


# --------------------------------------------------------------------------------------- cache


def test_cache_round_trip_is_exact(tmp_path: Path) -> None:
    f = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    fresh = parse.parse_file(f)
    cache.store(tmp_path, "ab" * 32, fresh)
    assert (tmp_path / f"v{cache.PARSER_VERSION}" / "ab" / ("ab" * 32) / "meta.json").is_file()
    back = cache.load(tmp_path, "ab" * 32)
    assert back is not None
    assert_same(back, fresh)
    dims = back.cpu_ops["input_dims"].dropna()
    assert len(dims) and all(isinstance(x, bytes) for x in dims)
    # equal values share one object, as after a parse
    assert len({id(x) for x in back.cpu_ops["name"]}) == back.cpu_ops["name"].nunique()


def test_damaged_cache_entry_is_a_miss(tmp_path: Path) -> None:
    f = fixture_dir("kv-full-cast-graph") / "fixture-TP-0.trace.json.gz"
    cache.store(tmp_path, "cd" * 32, parse.parse_file(f))
    entry = tmp_path / f"v{cache.PARSER_VERSION}" / "cd" / ("cd" * 32)
    (entry / "kernels.parquet").write_bytes(b"not parquet")
    assert cache.load(tmp_path, "cd" * 32) is None
    assert cache.load(tmp_path, "ef" * 32) is None


def test_load_trace_set_reads_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import traceinspect.load as load

    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "c"))
    d = fixture_dir("kv-full-cast-graph")
    first = load_trace_set(d, jobs=1)
    assert len(list((tmp_path / "c").rglob("meta.json"))) == 2

    def no_parse(*_: Any, **__: Any) -> None:
        raise AssertionError("parsed although cached")

    monkeypatch.setattr(load, "parse_file", no_parse)
    monkeypatch.setattr(load, "read_scan", no_parse)  # the native read
    second = load_trace_set(d, jobs=1)
    for t in TABLES:
        pd.testing.assert_frame_equal(getattr(first, t), getattr(second, t))
    assert [r.sha256 for r in first.ranks] == [r.sha256 for r in second.ranks]
    monkeypatch.setenv("TRACEINSPECT_CACHE", "off")
    with pytest.raises(AssertionError, match="parsed although cached"):
        load_trace_set(d, jobs=1)


def test_parallel_and_serial_loads_agree() -> None:
    d = fixture_dir("kv-full-cast-eager")
    a = load_trace_set(d, jobs=1, use_cache=False)
    b = load_trace_set(d, jobs=2, use_cache=False)
    for t in TABLES:
        pd.testing.assert_frame_equal(getattr(a, t), getattr(b, t))


def test_no_progress_bar_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from traceinspect.load import _progress

    advance, close = _progress([fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"], None)
    advance(0)
    close()
    assert capsys.readouterr().err == ""


# ------------------------------------------------------------------------------------ linking


def _ref_parents(ops: pd.DataFrame) -> np.ndarray:
    """The stack walk over ops sorted per thread by (ts, -dur)."""
    parent = np.full(len(ops), -1, dtype=np.int64)
    order = np.lexsort((-ops["dur"].to_numpy(), ops["ts"].to_numpy(), ops["tid"].to_numpy(),
                        ops["rank"].to_numpy()))
    ts, end = ops["ts"].to_numpy(), ops["end"].to_numpy()
    key = list(zip(ops["rank"], ops["tid"], strict=True))
    stack: list[int] = []
    cur = None
    for i in order:
        if key[i] != cur:
            stack.clear()
            cur = key[i]
        while stack and end[stack[-1]] < ts[i]:
            stack.pop()
        if stack:
            parent[i] = stack[-1]
        stack.append(i)
    return parent


def _ref_enclosing(ops: pd.DataFrame, rank: np.ndarray, tid: np.ndarray, t: np.ndarray) -> np.ndarray:
    out = np.full(len(t), -1, dtype=np.int64)
    for n in range(len(t)):
        o = ops[(ops["rank"] == rank[n]) & (ops["tid"] == tid[n])]
        o = o.iloc[np.lexsort((-o["dur"].to_numpy(), o["ts"].to_numpy()))]
        cand = o[o["ts"] <= t[n]]
        for j in range(len(cand) - 1, -1, -1):
            if cand["end"].iloc[j] >= t[n]:
                out[n] = cand.index[j]
                break
    return out


def _random_ops(rng: np.random.Generator, n: int) -> pd.DataFrame:
    # integer-valued times make equal starts and touching ends common
    ts = rng.integers(0, 60, n).astype(float)
    dur = rng.integers(0, 25, n).astype(float)
    return pd.DataFrame({"rank": rng.integers(0, 2, n), "tid": rng.integers(0, 3, n), "ts": ts, "dur": dur,
                         "end": ts + dur, "name": pd.Series([f"op{x}" for x in rng.integers(0, 4, n)], dtype=object)})


@pytest.mark.parametrize("seed", range(8))
def test_vectorised_op_tree_matches_stack_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    ops = _random_ops(rng, 300)
    tree = _OpTree(ops)
    np.testing.assert_array_equal(tree.parents(), _ref_parents(ops))
    m = 200
    r, tid, t = rng.integers(0, 2, m), rng.integers(0, 4, m), rng.integers(-5, 90, m).astype(float)
    key = (r.astype(np.int64) << 32) ^ tid.astype(np.int64)
    np.testing.assert_array_equal(tree.enclosing(key, t), _ref_enclosing(ops, r, tid, t))


def _ref_paths(op_idx: np.ndarray, parent: np.ndarray, names: np.ndarray) -> list[str]:
    out = []
    for i in op_idx:
        chain, j = [], int(i)
        while j >= 0 and len(chain) < 64:
            chain.append(names[j])
            j = int(parent[j])
        out.append(" > ".join(reversed(chain)))
    return out


@pytest.mark.parametrize("seed", range(4))
def test_op_paths_match_chain_walk(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = 400
    parent = np.arange(-1, n - 1)  # long chains: deeper than the 64 names a path keeps
    parent[rng.integers(0, n, 3)] = -1
    jump = rng.random(n) < 0.2
    parent[jump] = [rng.integers(-1, i) if i else -1 for i in np.nonzero(jump)[0]]
    names = np.array([f"m{rng.integers(0, 3)}" for _ in range(n)], dtype=object)
    ops = pd.DataFrame({"parent": parent, "name": pd.Series(names, dtype=object)})
    op_idx = rng.integers(-1, n, 1000)
    got = np.asarray(_paths(op_idx, ops), dtype=object)
    want = np.array(["" if i < 0 else p for i, p in zip(op_idx, _ref_paths(op_idx, parent, names), strict=True)],
                    dtype=object)
    np.testing.assert_array_equal(got, want)


def test_string_thread_ids_are_stable() -> None:
    assert parse._tid("PyTorch Profiler") == zlib.crc32(b"PyTorch Profiler") & 0x7FFFFFFF
    assert parse._tid("12") == 12 and parse._tid(5) == 5
    assert os.environ.get("PYTHONHASHSEED") is None or True  # stable whatever the hash seed
