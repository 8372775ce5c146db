"""Scale-out: a 16-rank trace set (rank numbers past 9: ordered as numbers, not text) analysed with the dask
executor gives the same JSON as the local run."""

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
def test_dask_executor_matches_local_on_many_ranks(tmp_path: Path) -> None:
    pytest.importorskip("dask.distributed")
    d = _set(tmp_path)
    # no cache: each executor must parse every file itself
    local = analyze(d, use_cache=False, executor="local", command="x").to_json()
    assert local["run"]["ranks"] == RANKS
    assert [f["rank"] for f in local["source"]["files"]] == list(range(RANKS))
    assert len({f["sha256"] for f in local["source"]["files"]}) == 2
    remote = analyze(d, use_cache=False, executor="dask", jobs=2, command="y").to_json()
    assert _comparable(remote) == _comparable(local)


def test_unknown_executor_is_an_input_error(tmp_path: Path) -> None:
    from traceinspect.errors import TraceInputError

    with pytest.raises(TraceInputError, match="unknown executor"):
        analyze(fixture_dir(FIXTURE), executor="ray", use_cache=False)


def test_unreachable_scheduler_is_an_input_error(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("dask.distributed")
    monkeypatch.setenv("TRACEINSPECT_DASK_TIMEOUT", "2")
    from traceinspect.errors import TraceInputError
    from traceinspect.load import load_trace_set

    with pytest.raises(TraceInputError, match="dask scheduler"):
        load_trace_set(fixture_dir(FIXTURE), executor="dask://127.0.0.1:9", use_cache=False)


@pytest.mark.timeout(300)
def test_running_scheduler_address(tmp_path: Path) -> None:
    """``dask://HOST:PORT``: a scheduler started elsewhere (here a local cluster's) parses the files."""
    pytest.importorskip("dask.distributed")
    import pandas as pd
    from dask.distributed import LocalCluster

    from traceinspect.load import load_trace_set

    d = fixture_dir(FIXTURE)
    local = load_trace_set(d, use_cache=False)
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        address = cluster.scheduler_address.split("://", 1)[1]
        remote = load_trace_set(d, use_cache=False, executor=f"dask://{address}")
    for t in ("kernels", "runtime", "cpu_ops", "annotations", "gpu_annotations"):
        pd.testing.assert_frame_equal(getattr(local, t), getattr(remote, t))
    assert [(r.rank, r.sha256, r.size_bytes) for r in local.ranks] == \
        [(r.rank, r.sha256, r.size_bytes) for r in remote.ranks]
