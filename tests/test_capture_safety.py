"""Capture safety beyond tests/test_capture.py: with ``--analyze`` against a server that needs API keys,
no key reaches any file (traces, server_info.json, capture.json, analysis.json, report.html) or the
output; and nothing is written outside ``--out`` (the parent directory is unchanged)."""

from __future__ import annotations

import gzip
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_capture import (
    ADMIN_SECRET,
    CAPTURE_TIMEOUT,
    GPU_FIXTURE,
    HAS_AIOHTTP,
    HAS_TORCH,
    SAFETY_S,
    SECRET,
    Standin,
    capture_args,
    run_cli,
)


@pytest.fixture(scope="module")
def keyed_gpu(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Standin]:
    """A stand-in that serves recorded GPU traces and requires both API keys."""
    if not (HAS_TORCH and HAS_AIOHTTP):
        pytest.skip("the stand-in SGLang server needs torch and aiohttp")
    if not sorted(GPU_FIXTURE.glob("fixture-TP-*.trace.json.gz")):
        pytest.skip(f"no recorded GPU traces in {GPU_FIXTURE}")
    s = Standin("keyed-gpu", ["--gpu-trace-from", str(GPU_FIXTURE), "--api-key", SECRET,
                              "--admin-api-key", ADMIN_SECRET], tmp_path_factory.mktemp("standin-keyed"))
    try:
        s.wait_ready(time.monotonic() + 300)
        yield s
    finally:
        s.stop()


def _files(d: Path) -> dict[Path, bytes]:
    out = {}
    for f in d.rglob("*"):
        if f.is_file():
            data = f.read_bytes()
            if f.name.endswith(".gz"):
                data += gzip.decompress(data)
            out[f] = data
    return out


@pytest.mark.timeout(SAFETY_S)
def test_keys_never_reach_the_analysis_or_the_report(keyed_gpu: Standin, tmp_path: Path) -> None:
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "neighbour.txt").write_text("unchanged")
    out = parent / "cap"
    p = run_cli(*capture_args(keyed_gpu.url, out, "--analyze", "--timeout", CAPTURE_TIMEOUT, "--api-key", SECRET),
                env={"TRACEINSPECT_ADMIN_API_KEY": ADMIN_SECRET}, timeout=SAFETY_S - 60)
    assert p.returncode == 0, p.stderr
    for key in (SECRET, ADMIN_SECRET):
        assert key not in p.stdout + p.stderr
    files = _files(out)
    names = {f.name for f in files}
    assert {"analysis.json", "capture.json", "server_info.json"} <= names, names
    for f, data in files.items():
        for key in (SECRET, ADMIN_SECRET):
            assert key.encode() not in data, f
    # the command recorded in the analysis is the capture's, with the key redacted
    cmd = json.loads((out / "analysis.json").read_text())["source"]["command"]
    assert cmd and "--api-key" in cmd and "<redacted>" in cmd, cmd
    # nothing was written beside --out
    assert sorted(p.name for p in parent.iterdir()) == ["cap", "neighbour.txt"]
    assert (parent / "neighbour.txt").read_text() == "unchanged"
