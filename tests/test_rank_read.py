"""The read of one rank file (traceinspect.load): errors and their precedence in the CLI, a warm cache read
and not scanned, the hash after the scan, the memory settings of the commands."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, fixture_dir

import traceinspect.load as load
from traceinspect.cli import main
from traceinspect.errors import TraceInputError
from traceinspect.load import load_rank_file
from traceinspect.load.raw import native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="the native read")


def _analysis(args: list[str], out: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    main(["analyze", *args, "-q", "--json", str(out)])
    capsys.readouterr()
    return json.loads(out.read_text())


def _truncated(tmp_path: Path) -> Path:
    src = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    data = src.read_bytes()
    p = tmp_path / "cut" / "cut-TP-0.trace.json.gz"
    p.parent.mkdir()
    p.write_bytes(data[: len(data) // 2])
    return p


def _error(fn: Any) -> str:
    with pytest.raises(TraceInputError) as ei:
        fn()
    return str(ei.value)


def test_cli_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _truncated(tmp_path)
    for args in ([str(cut.parent)], [str(cut)], [str(tmp_path / "missing-TP-0.trace.json.gz")]):
        with pytest.raises(SystemExit) as ei:
            main(["analyze", *args, "--no-cache", "-q"])
        assert ei.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("traceinspect: error: ")
        assert str(cut) in err[0] or "missing-TP-0" in err[0]


def test_a_rule_file_error_wins_over_a_trace_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cut = _truncated(tmp_path)
    rules = tmp_path / "bad.yaml"
    rules.write_text("rules:\n  - id: r\n    severity: high\n")
    for cmd in (["analyze", str(cut), "-q"], ["report", str(cut), "-o", str(tmp_path / "r.html")]):
        with pytest.raises(SystemExit) as ei:
            main([*cmd, "--no-cache", "--rules", str(rules)])
        assert ei.value.code == 2
        err = capsys.readouterr().err
        assert str(rules) in err and "truncated" not in err
    with pytest.raises(SystemExit):
        main(["analyze", str(cut), "-q", "--no-cache"])
    assert "truncated gzip" in capsys.readouterr().err


def test_a_warm_cache_is_read_not_scanned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "set"
    shutil.copytree(fixture_dir("kv-full-cast-eager"), d)
    cold = _analysis([str(d), "--jobs", "1"], tmp_path / "cold.json", capsys)  # scanned, stored by the loader
    assert len(list((tmp_path / "cache").rglob("meta.json"))) == 2

    def no_scan(*_: Any, **__: Any) -> None:
        raise AssertionError("scanned although cached")

    monkeypatch.setattr(load, "read_scan", no_scan)
    monkeypatch.setattr(load, "parse_file", no_scan)
    warm = _analysis([str(d), "--jobs", "1"], tmp_path / "warm.json", capsys)
    for doc in (cold, warm):
        doc["source"].pop("command")
    assert warm == cold


def test_parse_processes() -> None:
    from traceinspect.load.raw import parse_processes

    assert parse_processes(8, 3) == 3 and parse_processes(2, 8) == 2 and parse_processes(1, None) == 1
    assert parse_processes(8, 0) == 1
    cpus = os.cpu_count() or 1
    assert parse_processes(64, None) == max(1, cpus // 2)


_HUGEPAGE = """
import os, sys
from traceinspect.load import memory_settings
memory_settings()
import numpy as np
print(os.environ.get("NUMPY_MADVISE_HUGEPAGE"), int(np._core.multiarray._get_madvise_hugepage()))
"""


@pytest.mark.parametrize("env, want", [(None, "0 0"), ("1", "1 1")], ids=["default", "set-by-the-user"])
def test_the_commands_keep_numpy_arrays_on_small_pages(env: str | None, want: str) -> None:
    """What the commands set before numpy is imported (a setting in the environment is kept)."""
    e = {k: v for k, v in os.environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    if env is not None:
        e["NUMPY_MADVISE_HUGEPAGE"] = env
    e["PYTHONPATH"] = str(ROOT)
    r = subprocess.run([sys.executable, "-c", _HUGEPAGE, str(fixture_dir("tp1-l6-gather-eager"))], env=e,
                       capture_output=True, text=True, check=True, cwd=ROOT)
    assert r.stdout.split() == want.split()


def test_without_the_cache_the_hash_runs_after_the_scan_and_is_the_files(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", "off")
    src = fixture_dir("kv-full-cast-eager") / "fixture-TP-0.trace.json.gz"
    path = tmp_path / "plain-TP-0.trace.json"
    path.write_bytes(gzip.decompress(src.read_bytes()))
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    order: list[str] = []
    real_scan = load.read_scan

    def scan(*a: Any, **k: Any) -> Any:
        order.append("scan")
        return real_scan(*a, **k)

    real_later = load.hash_later

    def later(*a: Any) -> Any:
        order.append("hash")
        return real_later(*a)

    monkeypatch.setattr(load, "read_scan", scan)
    monkeypatch.setattr(load, "hash_later", later)
    ts = load.load_trace_set([path], use_cache=False, jobs=1)
    assert isinstance(ts.ranks[0].digest, Future)
    assert order == ["scan", "hash"]  # the hash begun once the scan is over
    assert ts.ranks[0].sha256 == want and ts.ranks[0].digest == want  # resolved once, then the text
    assert load_rank_file(path, use_cache=False)[0] == want  # the loader's own callers get the text
    # the file hashed is the one opened before the scan, even if its name is taken away meanwhile
    f = path.open("rb")
    path.rename(tmp_path / "moved.trace.json")
    path.write_bytes(b"{}")
    assert real_later(f, path).result() == want and f.closed
    # a read that fails is said where the digest is asked for, never waited on for ever
    f = path.open("rb")
    f.close()
    with pytest.raises(ValueError, match="closed file"):
        real_later(f, path).result(timeout=30)


@pytest.mark.parametrize("size", [0, 1, 4095, 4096, 10_000, 65_537, 300_001])
@pytest.mark.parametrize("start", [0, 1, 4097])
def test_file_hash_through_mappings_is_the_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int,
                                                 start: int) -> None:
    """A file hashed through memory mappings, a window at a time (windows and the starting position not
    aligned to pages), gives hashlib's digest of its bytes from the position on; files below the size
    for mappings, and files that cannot be mapped, are read instead, with the same digest."""
    from traceinspect import fileio

    monkeypatch.setattr(fileio, "MAP_MIN", 1)
    monkeypatch.setattr(fileio, "MAP_WINDOW", 3 * 4096 + 100 if size > 20_000 else 4096)
    data = os.urandom(size)
    path = tmp_path / "t.json"
    path.write_bytes(data)
    want = hashlib.sha256(data[start:]).hexdigest()
    mapped: list[int] = []
    real = fileio._sha256_mapped
    monkeypatch.setattr(fileio, "_sha256_mapped", lambda fd, at, h: mapped.append(at) or real(fd, at, h))
    with path.open("rb") as f:
        f.seek(start)
        assert fileio.sha256_of(f, 1000) == want
    assert mapped == [start]
    with path.open("rb") as f:  # a file the mapping refuses: read as before
        f.seek(start)
        monkeypatch.setattr(fileio.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError("no mappings")))
        assert fileio.sha256_of(f, 1000) == want
    r, w = os.pipe()  # not a regular file: read
    os.write(w, data[:4096])
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert fileio.sha256_of(f, 1000) == hashlib.sha256(data[:4096]).hexdigest()


def test_a_bad_rule_file_fails_the_cli_with_a_good_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rules = tmp_path / "bad.yaml"
    rules.write_text("rules:\n  - id: r\n    severity: high\n")
    out = tmp_path / "a.json"
    with pytest.raises(SystemExit) as ei:
        main(["analyze", str(fixture_dir("kv-full-cast-eager")), "-q", "--no-cache", "--rules", str(rules),
              "--json", str(out)])
    assert ei.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(rules) in err[0] and not out.exists()
