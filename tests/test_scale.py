"""Scale: a 16-rank trace set (rank numbers past 9: ordered as numbers, not text) parsed in a pool of processes
gives the same JSON as parsed in this process."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import fixture_dir

from traceinspect.pipeline import analyze

FIXTURE = "kv-gather-cast-graph"
RANKS = 16


def _set(tmp: Path) -> Path:
    """RANKS rank files: the fixture's two ranks copied round-robin as -TP-0..RANKS-1, with its server_info
    and graph-capture traces."""
    src = fixture_dir(FIXTURE)
    files = sorted(src.glob("*-TP-*.trace.json.gz"))
    assert len(files) == 2
    d = tmp / f"set{RANKS}"
    d.mkdir()
    for r in range(RANKS):
        shutil.copyfile(files[r % 2], d / f"fixture-TP-{r}.trace.json.gz")
    shutil.copyfile(src / "server_info.json", d / "server_info.json")
    if (src / "graph_capture_profile").is_dir():
        shutil.copytree(src / "graph_capture_profile", d / "graph_capture_profile")
    return d


def _comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """The document without what may differ between two runs of the same analysis."""
    doc = dict(doc)
    doc["source"] = {k: v for k, v in doc["source"].items() if k != "command"}
    return doc


@pytest.mark.timeout(900)
def test_parse_pool_matches_one_process_on_many_ranks(tmp_path: Path) -> None:
    d = _set(tmp_path)
    # no cache: each run must parse every file itself
    alone = analyze(d, use_cache=False, jobs=1, command="x").to_json()
    assert alone["run"]["ranks"] == RANKS
    assert [f["rank"] for f in alone["source"]["files"]] == list(range(RANKS))
    assert len({f["sha256"] for f in alone["source"]["files"]}) == 2
    pooled = analyze(d, use_cache=False, jobs=2, command="y").to_json()
    assert _comparable(pooled) == _comparable(alone)
