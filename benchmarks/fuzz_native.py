"""Fuzz the native Kineto scanner with atheris (libFuzzer), differentially against the msgspec path.

Each input is cut into pieces of a size the input chooses and fed to the scanner. The scanner must
either give the same tables as the msgspec path or, where that path rejects the text as a
``TraceInputError``, reject it too; any other outcome (a crash, another exception, different
tables) is a finding. The seed corpus is a few small real-shaped documents written at start.

    python benchmarks/fuzz_native.py -max_total_time=600          # a long run
    python benchmarks/fuzz_native.py -max_total_time=5 -seed=1    # the CI smoke run (tests/)

libFuzzer options pass through (``-runs=N``, ``-max_len=N``, a corpus directory). The C code is not
coverage-instrumented (gcc builds it), so the search is guided by the Python side and by mutation.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if not os.environ.get("PYTHONPATH"):  # (fuzz_native_asan.sh points PYTHONPATH at a sanitizer build)
    sys.path.insert(0, str(ROOT))

import atheris  # noqa: E402
import msgspec  # noqa: E402, F401 - libraries load uninstrumented: only the loader's own code is
import numpy  # noqa: E402, F401
import pandas  # noqa: E402, F401

with atheris.instrument_imports(include=["traceinspect"]):
    from traceinspect.errors import TraceInputError
    from traceinspect.load import parse

TABLES = ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations")


def _seeds() -> list[bytes]:
    f = ROOT / "fixtures" / "kv-full-cast-graph" / "fixture-TP-0.trace.json.gz"
    doc = json.loads(gzip.decompress(f.read_bytes()))
    evs = doc["traceEvents"]
    small = {**doc, "traceEvents": evs[:40]}
    rocm = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": "1.5", "dur": 2, "tid": "stream 1",
         "args": {"bytes": "32768", "correlation": "7", "grid": [1, 1, 1]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "hipMemcpy", "ts": 1, "dur": "1", "args": {"kind": "1"}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5, "tid": 3,
         "args": {"Input Dims": [[2, 3], [3, 4]], "Input type": ["float", "float"], "External id": 1}},
    ], "deviceProperties": [{"name": "MI300X"}]}
    return [json.dumps(small).encode(), json.dumps(small, indent=1).encode(), json.dumps(rocm).encode(),
            b"\xef\xbb\xbf" + json.dumps(rocm).encode(), b'{"traceEvents": []}']


def _python(data: bytes) -> parse.ParsedRank | None:
    try:
        return parse.parse_bytes_whole(data, Path("fuzz.json"))
    except TraceInputError:
        return None
    except Exception:  # the reference itself failed: nothing to compare with
        return _SKIP  # type: ignore[return-value]


_SKIP = object()


def _native(data: bytes, size: int) -> parse.ParsedRank | None:
    pieces = (data[i:i + size] for i in range(0, len(data), size))
    try:
        return parse._scan_native(pieces, Path("fuzz.json"))
    except TraceInputError:
        return None


def _columns(res: dict) -> dict:
    out = {k: v for k, v in res.items() if k != "kinds"}
    out["kinds"] = [{k: v if isinstance(v, int) else bytes(v) for k, v in d.items()} for d in res["kinds"]]
    return out


def _split(data: bytes, at: int) -> None:
    """The document scanned whole, and as data[:at] and data[at:] joined (when the first part ends between
    two events): the same result, or the join refused."""
    from traceinspect.load import raw as rawmod

    whole = _columns(rawmod.scan(iter([data]), Path("fuzz.json")))
    first, rest = rawmod._scanner(), rawmod._scanner(inside_events=True, offset=at)
    first.feed(data[:at])
    if not first.at_event_boundary():
        return
    rest.feed(data[at:], final=True)  # the whole document scanned: so does its rest
    try:
        first.join(rest)
    except ValueError:  # a second traceEvents key in the rest: the loader scans it whole
        return
    if _columns(first.result()) != whole:
        raise AssertionError(f"the scan split at byte {at} differs from the whole scan")


def test_one_input(raw: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(raw)
    size = fdp.ConsumeIntInRange(1, 1 << 16)
    cut = fdp.ConsumeIntInRange(0, 1 << 16)
    data = fdp.ConsumeBytes(fdp.remaining_bytes())
    got = _native(data, size)  # anything but a result or TraceInputError propagates: a finding
    if got is not None:
        _split(data, cut % (len(data) + 1))
    want = _python(data)
    if want is _SKIP:
        return
    if (got is None) != (want is None):
        raise AssertionError(f"native {'rejects' if got is None else 'reads'} what the msgspec path "
                             f"{'reads' if got is None else 'rejects'}")
    if got is not None:
        import pandas as pd

        for t in TABLES:
            pd.testing.assert_frame_equal(getattr(got, t), getattr(want, t))
        assert got.n_events == want.n_events and got.drops == want.drops


def main(argv: list[str]) -> None:
    if parse._native is None:
        raise SystemExit("the native scanner is not built")
    args = list(argv)
    dirs = [a for a in args[1:] if not a.startswith("-")]
    if not dirs:  # no corpus directory given: a temporary one
        dirs = [tempfile.mkdtemp(prefix="kineto-fuzz-")]
        args.append(dirs[0])
    for i, s in enumerate(_seeds()):  # the seeds, in the (first) corpus directory
        # the last 4 bytes choose the piece size (FuzzedDataProvider reads integers from the end)
        Path(dirs[0], f"seed{i}").write_bytes(s + (i * 977 + 1).to_bytes(4, "little"))
    if not any(a.startswith("-dict=") for a in args):
        args.append(f"-dict={Path(__file__).with_name('kineto.dict')}")
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
