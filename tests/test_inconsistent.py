"""Multi-rank inconsistencies on the H200 fixtures: different step counts per rank, a rank file from
another run, a rank missing, clocks seconds apart. Each gives an analysis and a warning that says what
was done about it."""

from __future__ import annotations

import gzip
import json
import shutil
from functools import lru_cache
from pathlib import Path
from typing import Any

import pytest
from conftest import fixture_dir, run_cli

from traceinspect.errors import TraceInputError
from traceinspect.measure.clock import CLOCK_WARN_US
from traceinspect.pipeline import analyze

EAGER = "kv-full-cast-eager"
OTHER = "kv-gather-cast-eager"  # another capture of the same setup


@lru_cache(maxsize=8)
def _doc(variant: str, rank: int) -> str:
    with gzip.open(fixture_dir(variant) / f"fixture-TP-{rank}.trace.json.gz", "rt") as f:
        return f.read()


def doc(variant: str, rank: int) -> dict[str, Any]:
    return json.loads(_doc(variant, rank))


def write_set(d: Path, files: dict[str, dict[str, Any] | str], server_info: str | None = EAGER) -> Path:
    """Write rank documents under the given file names (plain JSON) and a fixture's server_info."""
    d.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (d / name).write_text(content if isinstance(content, str) else json.dumps(content))
    if server_info:
        shutil.copy(fixture_dir(server_info) / "server_info.json", d / "server_info.json")
    return d


def run(d: Path, allow_mismatch: bool = False):
    return analyze(str(d), jobs=1, use_cache=False, command="test", allow_mismatch=allow_mismatch)


def warning(a, *needles: str) -> str:
    hits = [w for w in a.trace.warnings if all(n in w for n in needles)]
    assert hits, (needles, a.trace.warnings)
    return hits[0]


def steps_of(d: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted((e for e in d["traceEvents"] if e.get("cat") == "user_annotation"
                   and str(e.get("name", "")).startswith("step[")), key=lambda e: e["ts"])


# ----------------------------------------------------------------------------- step counts

def test_different_step_counts_warn_and_align(tmp_path: Path) -> None:
    """TP1 recorded two steps fewer: the first N aligned steps are analysed and the warning says so."""
    d1 = doc(EAGER, 1)
    cut = {id(s) for s in steps_of(d1)[-2:]}
    d1["traceEvents"] = [e for e in d1["traceEvents"] if id(e) not in cut]
    a = run(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0), "fixture-TP-1.trace.json": d1}))
    per = a.selected.groupby("rank").size().to_dict()
    # two markers fewer; TP1's last remaining step is complete (its recording goes on after it), TP0's last
    # one may be cut by the end of the recording and is then excluded
    assert per[1] < per[0] <= per[1] + 2
    w = warning(a, "different numbers of complete decode steps")
    assert f"TP0: {per[0]}, TP1: {per[1]}" in w
    assert f"analysed the first {per[1]} aligned steps" in w
    assert a.steps_per_rank() == per[1] and len(a.step_samples()) == per[1]
    doc_ = a.to_json()
    assert doc_["steps"]["count"] == per[1] and w in doc_["warnings"]
    assert a.collectives.steps_aligned == per[1]


def test_equal_step_counts_do_not_warn(tmp_path: Path) -> None:
    a = run(write_set(tmp_path / "s", {f"fixture-TP-{r}.trace.json": _doc(EAGER, r) for r in (0, 1)}))
    assert not [w for w in a.trace.warnings if "different numbers" in w or "clock" in w or "missing" in w
                or "overlap" in w or "captures" in w], a.trace.warnings


# ----------------------------------------------------------------------------- another run

def test_rank_file_from_another_capture_by_profile_id(tmp_path: Path) -> None:
    """The other capture's file (recorded 17 s later) is refused, naming both files; asked to, the two are
    analysed together with the warnings that say what is off."""
    d = write_set(tmp_path / "s", {"run-1700000001-TP-0.trace.json": _doc(EAGER, 0),
                                   "run-1700000999-TP-1.trace.json": _doc(OTHER, 1)})
    with pytest.raises(TraceInputError, match=r"not the ranks of one run: recordings 1[67](\.\d)? s apart "
                                              r"\(median event times; run-1700000001-TP-0.trace.json first, "
                                              r"run-1700000999-TP-1"):
        run(d)
    r = run_cli("analyze", str(d), "-q")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "--allow-mismatch" in r.stderr
    a = run(d, allow_mismatch=True)
    warning(a, "different captures", "1700000001", "1700000999", "analysed together as given")
    warning(a, "not the ranks of one run", "as --allow-mismatch asks")


def test_rank_file_from_another_run_with_the_same_name(tmp_path: Path) -> None:
    """TP1 is from another capture but named like this one's: its recording starts 17 s later, and its
    time range does not overlap."""
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0),
                                   "fixture-TP-1.trace.json": _doc(OTHER, 1)})
    with pytest.raises(TraceInputError, match="different captures"):
        run(d)
    a = run(d, allow_mismatch=True)
    w = warning(a, "time ranges of TP0 and TP1 do not overlap", "different runs")
    assert " s " in w  # the gap is given in seconds
    assert len(a.to_json()["ranks"]) == 2


def test_copied_rank_file_claims_the_same_distributed_rank(tmp_path: Path) -> None:
    a = run(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0),
                                       "fixture-TP-1.trace.json": _doc(EAGER, 0)}))
    warning(a, "TP0, TP1 all say distributedInfo.rank=0", "another run")


def test_world_sizes_disagree(tmp_path: Path) -> None:
    d1 = doc(EAGER, 1)
    d1["distributedInfo"]["world_size"] = 4
    a = run(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0), "fixture-TP-1.trace.json": d1}))
    warning(a, "disagree on distributedInfo.world_size ([2, 4])")


# ----------------------------------------------------------------------------- a rank missing

def test_rank_missing_per_server_info(tmp_path: Path) -> None:
    a = run(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0)}))
    warning(a, "server_info says tp_size=2 but 1 rank file(s) were found", "ranks present are analysed")
    assert a.n_ranks == 1


def test_gap_in_tp_numbers(tmp_path: Path) -> None:
    """TP-0 and TP-2 (TP-1 lost): the gap is named even though server_info's count is not short."""
    d2 = doc(EAGER, 1)
    si = json.loads((fixture_dir(EAGER) / "server_info.json").read_text())
    si["tp_size"] = 2
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0), "fixture-TP-2.trace.json": d2},
                  server_info=None)
    (d / "server_info.json").write_text(json.dumps(si))
    a = run(d)
    warning(a, "no file for TP1 (files for TP0, TP2)", "that rank is missing")
    assert sorted(r.rank for r in a.trace.ranks) == [0, 2]
    assert a.to_json()["ranks"][1]["label"] == "TP2"


def test_rank_missing_per_distributed_info_without_server_info(tmp_path: Path) -> None:
    a = run(write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0)}, server_info=None))
    warning(a, "distributedInfo says world_size=2 but no file holds rank(s) 1")


def test_server_info_sizes_of_the_wrong_type_are_ignored(tmp_path: Path) -> None:
    d = write_set(tmp_path / "s", {"fixture-TP-0.trace.json": _doc(EAGER, 0)}, server_info=None)
    (d / "server_info.json").write_text(json.dumps({"tp_size": 2, "dp_size": "x", "pp_size": {"a": 1}}))
    a = run(d)
    warning(a, "server_info says tp_size=2 but 1 rank file(s)")


# ----------------------------------------------------------------------------- clock skew

def _skewed(tmp_path: Path, shift_us: float) -> Path:
    d1 = doc(EAGER, 1)
    for e in d1["traceEvents"]:
        if isinstance(e.get("ts"), (int, float)):
            e["ts"] += shift_us
    return write_set(tmp_path / f"skew{shift_us:g}", {"fixture-TP-0.trace.json": _doc(EAGER, 0),
                                                      "fixture-TP-1.trace.json": d1})


def test_clock_skew_of_seconds_is_measured_corrected_and_reported(tmp_path: Path) -> None:
    base = run(write_set(tmp_path / "s", {f"fixture-TP-{r}.trace.json": _doc(EAGER, r) for r in (0, 1)}))
    a = run(_skewed(tmp_path, 2.5e6))
    off = a.collectives.offsets[1]
    assert off == pytest.approx(base.collectives.offsets[1] + 2.5e6, abs=50)
    w = warning(a, "the clock of TP1 is", "ahead of TP0's", "matched collectives", "subtracted +2,5")
    assert f"{off / 1e3:,.3f} ms" in w
    warning(a, "time ranges of TP0 and TP1 do not overlap")
    # corrected: the cross-rank results are those of the unshifted set
    b, c = base.collectives.per_rank.set_index("rank"), a.collectives.per_rank.set_index("rank")
    for col in ("wait_us", "transfer_us", "late_arrivals"):
        assert c[col].to_numpy() == pytest.approx(b[col].to_numpy(), rel=1e-6, abs=1e-3), col
    assert base.collectives.straggler.get("rank") == a.collectives.straggler.get("rank")


def test_clock_skew_behind(tmp_path: Path) -> None:
    a = run(_skewed(tmp_path, -3e6))
    w = warning(a, "the clock of TP1 is", "behind TP0's", "subtracted -")
    assert a.collectives.offsets[1] == pytest.approx(-3e6, abs=50)
    assert f"{abs(a.collectives.offsets[1]) / 1e3:,.3f} ms behind" in w


def test_small_clock_offsets_are_not_reported(tmp_path: Path) -> None:
    a = run(_skewed(tmp_path, CLOCK_WARN_US / 2))
    assert not [w for w in a.trace.warnings if "clock" in w], a.trace.warnings


def test_warnings_reach_the_cli_json(tmp_path: Path) -> None:
    d = _skewed(tmp_path, 2e6)
    out = tmp_path / "a.json"
    r = run_cli("analyze", str(d), "--json", str(out), "-q")
    assert r.returncode == 0, r.stderr
    ws = json.loads(out.read_text())["warnings"]
    assert any("the clock of TP1" in w for w in ws), ws


def test_files_of_different_gpus_or_workloads_are_not_one_run(tmp_path: Path) -> None:
    """A rank file recorded on another GPU, or one whose kernels are another workload's, stops the load
    with one line naming the files and why; --allow-mismatch analyses them together."""
    d1 = doc(EAGER, 1)
    for p in d1["deviceProperties"]:
        p["name"] = "Tesla V100-SXM2-32GB"
    d = write_set(tmp_path / "gpu", {"fixture-TP-0.trace.json": _doc(EAGER, 0), "fixture-TP-1.trace.json": d1})
    with pytest.raises(TraceInputError, match=r"different GPUs \(fixture-TP-0.trace.json: NVIDIA H200; "
                                              r"fixture-TP-1.trace.json: Tesla V100-SXM2-32GB\)"):
        run(d)
    r = run_cli("doctor", str(d))
    assert r.returncode == 2 and "different GPUs" in r.stdout + r.stderr
    assert run_cli("classify", str(d), "--allow-mismatch").returncode == 0

    d2 = doc(EAGER, 1)
    for i, e in enumerate(x for x in d2["traceEvents"] if x.get("cat") == "kernel"):
        e["name"] = f"other_model_kernel_{chr(97 + i % 26)}"
    w = write_set(tmp_path / "mix", {"fixture-TP-0.trace.json": _doc(EAGER, 0), "fixture-TP-1.trace.json": d2})
    with pytest.raises(TraceInputError, match=r"different workloads \(kernel names shared with"):
        run(w)
    assert len(run(w, allow_mismatch=True).trace.ranks) == 2
