"""A large plain JSON rank file is scanned in two halves on two threads (``raw._scan_split``); the result
is the one scanning the whole file gives, byte for byte, wherever the split falls, and a malformed file
fails with the whole scan's message."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from conftest import FIXTURES, REAL_TRACES

from traceinspect.errors import TraceInputError
from traceinspect.load import load_rank_file, raw

pytestmark = pytest.mark.skipif(raw._native is None, reason="the native scanner is not built")


def _plain(src: Path, dst: Path) -> Path:
    dst.write_bytes(gzip.decompress(src.read_bytes()))
    return dst


def _norm(res: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in res.items() if k != "kinds"}
    out["kinds"] = [{k: bytes(v) if isinstance(v, raw.COLUMN_TYPES) else v for k, v in d.items()}
                    for d in res["kinds"]]
    return out


def _whole(path: Path) -> dict[str, Any]:
    return _norm(raw.scan(raw._blocks(path), path))


def _outcome(fn: Any) -> Any:
    try:
        return _norm(fn())
    except TraceInputError as e:
        return ("error", str(e))


def _joined(data: bytes, at: int) -> tuple[bool, dict[str, Any] | None]:
    """Scan data[:at] and data[at:] with two scanners and join them when the first ends between events."""
    first, rest = raw._scanner(), raw._scanner(inside_events=True, offset=at)
    first.feed(data[:at])
    if not first.at_event_boundary():
        return False, None
    rest.feed(data[at:], final=True)
    first.join(rest)
    return True, _norm(first.result())


FIXTURE = FIXTURES / "kv-full-cast-graph" / "fixture-TP-0.trace.json.gz"


def test_split_point_is_between_two_events_and_the_join_is_the_whole_scan(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = _plain(FIXTURE, tmp_path / "r-TP-0.trace.json")
    monkeypatch.setattr(raw, "SPLIT_MIN", 0)
    at = raw.split_point(path)
    assert at is not None and path.read_bytes()[at:at + 1] == b"{"
    ok, got = _joined(path.read_bytes(), at)
    want = _whole(path)
    assert ok and got == want
    assert _norm(raw._scan_split(path, at)) == want
    assert _norm(raw.read_scan(path)) == want  # the path the loader takes


def test_split_anywhere_gives_the_whole_scan(tmp_path: Path) -> None:
    """Split points between events are joined; any other place (inside an event, before traceEvents, in
    the keys after it) falls back to one scan: the result is the same either way."""
    path = _plain(FIXTURE, tmp_path / "r-TP-0.trace.json")
    data = path.read_bytes()
    want = _whole(path)
    starts = [i for i in range(len(data)) if data.startswith(b"\n  {\n", i)]
    points = sorted({1, 2, 40, data.index(b"traceEvents"), len(data) - 3, len(data) - 40, len(data) // 3,
                     *(s + 3 for s in starts[:: max(1, len(starts) // 12)]),
                     *(s + 20 for s in starts[1:: max(1, len(starts) // 6)])})
    joined = 0
    for at in points:
        ok, got = _joined(data, at)
        if ok:
            joined += 1
            assert got == want, at
        assert _norm(raw._scan_split(path, at)) == want, at
    assert joined >= 10  # most event starts are joinable; the other places are not


def test_split_on_real_traces_from_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = sorted(REAL_TRACES.glob("*.json.gz")) if REAL_TRACES.is_dir() else []
    if not files:
        pytest.skip("no real traces beside this checkout")
    monkeypatch.setattr(raw, "SPLIT_MIN", 0)
    split = 0
    for src in files:
        path = _plain(src, tmp_path / (src.name[:-3]))
        at = raw.split_point(path)
        want = _outcome(lambda p=path: raw.scan(raw._blocks(p), p))
        assert _outcome(lambda p=path: raw.read_scan(p)) == want, src.name
        if at is not None and _joined(path.read_bytes(), at)[0]:
            split += 1
    assert split >= 3  # Kineto's layout (one event per group of lines) is split where it is written


def test_tables_identical_through_the_loader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _plain(FIXTURE, tmp_path / "r-TP-0.trace.json")
    digest, size, whole = load_rank_file(path, use_cache=False)
    monkeypatch.setattr(raw, "SPLIT_MIN", 0)
    assert raw.split_point(path) is not None
    digest2, size2, halves = load_rank_file(path, use_cache=False)
    for t in ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations"):
        pd.testing.assert_frame_equal(getattr(whole, t), getattr(halves, t))
    assert (digest, size) == (digest2, size2) == (hashlib.sha256(path.read_bytes()).hexdigest(), len(path.read_bytes()))


def _doc_bytes(events: list[Any], tail: str = "") -> bytes:
    body = ",\n".join("  " + json.dumps(e) for e in events)
    return ('{"schemaVersion": 1,\n  "traceEvents": [\n' + body + "\n]" + tail + "}").encode()


def _events(n: int) -> list[dict[str, Any]]:
    return [{"ph": "X", "cat": "kernel" if i % 3 else "cpu_op", "name": f"k{i % 17}", "ts": i * 1.5, "dur": 1,
             "tid": "stream 7" if i % 5 == 0 else 7,
             "args": {"correlation": i, "grid": [i % 4, 1, 1], "Input Dims": [[i % 3, 2]]}} for i in range(n)]


@pytest.mark.parametrize("where", ["first", "second", "truncated", "trailing"])
def test_a_malformed_file_fails_with_the_whole_scans_message(tmp_path: Path, where: str) -> None:
    data = _doc_bytes(_events(400), ', "traceName": "x"')
    mid = data.index(b"\n  {", len(data) // 2) + 3
    if where == "first":
        data = data.replace(b'"ts": 30.0', b'"ts": 30..0', 1)
    elif where == "second":
        data = data[:mid + 200] + b"@" + data[mid + 201:]
    elif where == "truncated":
        data = data[:mid + len(data) // 4]
    else:
        data += b" x"
    path = tmp_path / "r-TP-0.trace.json"
    path.write_bytes(data)
    want = _outcome(lambda: raw.scan(raw._blocks(path), path))
    assert want[0] == "error"
    assert _outcome(lambda: raw._scan_split(path, mid)) == want


def test_a_second_trace_events_key_after_the_split_is_read_as_one_scan_reads_it(tmp_path: Path) -> None:
    evs = _events(200)
    data = _doc_bytes(evs, ', "traceEvents": [' + json.dumps(evs[5]) + '], "traceName": "t"')
    path = tmp_path / "r-TP-0.trace.json"
    path.write_bytes(data)
    mid = data.index(b"\n  {", len(data) // 2) + 3
    got = _norm(raw._scan_split(path, mid))
    assert got == _whole(path) and got["n_events"] == 1


def test_join_refuses_misuse() -> None:
    first, rest = raw._scanner(), raw._scanner(inside_events=True, offset=3)
    with pytest.raises(TypeError):
        first.join(first)
    with pytest.raises(TypeError):
        first.join(object())
    first.feed(b'{"traceEvents": [{"ph": "X"}, ')
    assert first.at_event_boundary()
    with pytest.raises(ValueError):
        first.join(rest)  # the other has not scanned to the end yet
    other = raw._scanner()
    other.feed(b'{"traceEvents": []}', final=True)
    with pytest.raises(ValueError):
        first.join(other)  # not begun inside traceEvents
    rest.feed(b'{"ph": "X"}]}', final=True)
    inner = raw._scanner()
    inner.feed(b'{"traceEvents": [{"ph": "X", "args": {"a": [')
    assert not inner.at_event_boundary()
    with pytest.raises(ValueError):
        inner.join(rest)
    first.join(rest)
    assert first.result()["n_events"] == 2
    with pytest.raises(RuntimeError):
        rest.result()  # its tables went to the first
    again = raw._scanner()
    again.feed(b'{"traceEvents": [{"ph": "X"}, ')
    with pytest.raises(ValueError):
        again.join(rest)  # joined once


def test_small_and_gzipped_files_are_not_split(tmp_path: Path) -> None:
    assert raw.split_point(FIXTURE) is None  # gzipped
    path = _plain(FIXTURE, tmp_path / "r-TP-0.trace.json")
    assert path.stat().st_size < raw.SPLIT_MIN and raw.split_point(path) is None
