"""The parsed-table cache's size limit (least recently used entries go first) and ``traceinspect cache``."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from conftest import fixture_dir

from traceinspect.cli import main
from traceinspect.load import cache, parse


@pytest.fixture(scope="module")
def parsed() -> parse.ParsedRank:
    return parse.parse_file(fixture_dir("kv-full-cast-graph") / "fixture-TP-0.trace.json.gz")


def _store(root: Path, key: str, p: parse.ParsedRank, when: float) -> Path:
    cache.store(root, key * 32, p)
    d = root / f"v{cache.PARSER_VERSION}" / key / (key * 32)
    os.utime(d / "meta.json", (when, when))
    return d


def test_max_bytes_units(monkeypatch: pytest.MonkeyPatch) -> None:
    for text, want in [("2GB", 2 * 10**9), ("500 MB", 500 * 10**6), ("1.5gib", int(1.5 * 2**30)), ("123", 123),
                       ("", cache.DEFAULT_MAX_BYTES), ("lots", cache.DEFAULT_MAX_BYTES)]:
        monkeypatch.setenv("TRACEINSPECT_CACHE_MAX", text)
        assert cache.max_bytes() == want, text


def test_least_recently_used_entries_go_first(tmp_path: Path, parsed: parse.ParsedRank,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    now = time.time()
    a = _store(tmp_path, "aa", parsed, now - 300)
    b = _store(tmp_path, "bb", parsed, now - 200)
    one = cache._dir_bytes(a)
    stale = tmp_path / "v0" / "cc" / ("cc" * 32)  # an entry of an older parser: always removed
    stale.mkdir(parents=True)
    (stale / "meta.json").write_text("{}")
    assert cache.load(tmp_path, "aa" * 32) is not None  # a read is a use: a is now the newest
    monkeypatch.setenv("TRACEINSPECT_CACHE_MAX", str(int(2.5 * one)))
    c = _store(tmp_path, "dd", parsed, now)  # three entries > 2.5 entries: the least recently used goes
    assert a.is_dir() and c.is_dir() and not b.exists() and not stale.exists()
    assert not (tmp_path / "v0").exists()
    assert cache.load(tmp_path, "bb" * 32) is None
    info = cache.info(tmp_path)
    assert info["entries"] == 2 and info["bytes"] <= 2.5 * one and info["stale_entries"] == 0


def test_cache_command(tmp_path: Path, parsed: parse.ParsedRank, monkeypatch: pytest.MonkeyPatch,
                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("TRACEINSPECT_CACHE", str(tmp_path))
    _store(tmp_path, "aa", parsed, time.time())
    (tmp_path / "user-file.txt").write_text("not ours")
    main(["cache", "info", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert doc["entries"] == 1 and doc["bytes"] > 0 and doc["root"] == str(tmp_path)
    main(["cache", "clear"])
    assert "removed" in capsys.readouterr().out
    assert cache.info(tmp_path)["entries"] == 0
    assert (tmp_path / "user-file.txt").read_text() == "not ours"  # only the cache's own entries go
    main(["cache", "info"])
    assert "entries: 0" in capsys.readouterr().out
    monkeypatch.setenv("TRACEINSPECT_CACHE", "off")
    main(["cache", "info"])
    assert "off" in capsys.readouterr().out
