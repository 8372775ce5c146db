"""Ingest, rank detection, linking and step segmentation on CPU traces made by torch in the test."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest
from conftest import make_cpu_traces, raw_events

from traceinspect.errors import TraceInputError
from traceinspect.link import link
from traceinspect.load import load_trace_set
from traceinspect.load.discover import parse_name
from traceinspect.steps import build_steps, union_us


@pytest.fixture(scope="module")
def cpu_pair(tmp_path_factory, torch_mod) -> list[Path]:
    return make_cpu_traces(tmp_path_factory.mktemp("cpu"), world=2, steps=5)


def test_sglang_names() -> None:
    rf = parse_name(Path("triage-trace-1776848313.618158-TP-3-DP-1-EP-3-DECODE.trace.json.gz"))
    assert (rf.tp, rf.dp, rf.pp, rf.ep, rf.stage) == (3, 1, None, 3, "DECODE")
    assert rf.profile_id == "1776848313.618158"
    assert parse_name(Path("1700000000.1-TP-0.trace.json.gz")).tp == 0
    assert parse_name(Path("x-TP-2-prefill.trace.json.gz")).stage == "PREFILL"
    assert parse_name(Path("rank0.json")).tp is None


def test_ranks_from_distributed_info(cpu_pair: list[Path], tmp_path: Path) -> None:
    # names without -TP-<r>: ranks come from distributedInfo.rank, listed in reverse order
    a, b = tmp_path / "b.json", tmp_path / "a.json"
    shutil.copy(cpu_pair[0], a)
    shutil.copy(cpu_pair[1], b)
    ts = load_trace_set([a, b], require_kernels=False)
    assert [r.rank_source for r in ts.ranks] == ["distributedInfo", "distributedInfo"]
    assert {r.rank: r.path.name for r in ts.ranks} == {0: "b.json", 1: "a.json"}


def test_ranks_from_names_and_gzip_and_glob(cpu_pair: list[Path], tmp_path: Path) -> None:
    for i, p in enumerate(cpu_pair):
        with open(p, "rb") as src, gzip.open(tmp_path / f"run-TP-{1 - i}.trace.json.gz", "wb") as dst:
            dst.write(src.read())
    ts = load_trace_set(str(tmp_path / "*.trace.json.gz"), require_kernels=False)
    assert [(r.rank, r.rank_source) for r in ts.ranks] == [(0, "filename"), (1, "filename")]
    # rank 0 is the file that came from process 1
    assert ts.ranks[0].distributed_info["rank"] == 1


def test_guessed_ranks_are_reported(cpu_pair: list[Path], tmp_path: Path) -> None:
    import json

    for i, p in enumerate(cpu_pair):
        doc = json.loads(p.read_text())
        doc.pop("distributedInfo", None)
        (tmp_path / f"t{i}.json").write_text(json.dumps(doc))
    ts = load_trace_set(tmp_path, require_kernels=False)
    assert [r.rank_source for r in ts.ranks] == ["order", "order"]
    assert any("guessed" in w for w in ts.warnings)


def test_duplicate_rank_refused(cpu_pair: list[Path], tmp_path: Path) -> None:
    shutil.copy(cpu_pair[0], tmp_path / "a-TP-0.trace.json")
    shutil.copy(cpu_pair[1], tmp_path / "b-TP-0.trace.json")
    with pytest.raises(TraceInputError, match="same rank"):
        load_trace_set(tmp_path, require_kernels=False)


def test_cpu_trace_steps_and_links(cpu_pair: list[Path]) -> None:
    ts = load_trace_set(cpu_pair, require_kernels=False)
    link(ts)
    steps = build_steps(ts)
    assert steps.groupby("rank").size().tolist() == [5, 5]
    assert set(steps["phase"]) == {"decode"}
    assert steps.loc[steps["rank"] == 1, "bs"].unique().tolist() == [5]
    # only a first or last step can be partial (the recording's start and stop, timed by the processes), and
    # with no GPU kernels none is analysed
    assert set(steps.loc[steps["edge"], "idx"]) <= {0, 4} and not steps["included"].any()
    # cpu op nesting: aten::relu's children point back at it
    ops = ts.cpu_ops
    child = ops[ops["parent"] >= 0]
    assert len(child) and (ops.loc[child["parent"], "ts"].to_numpy() <= child["ts"].to_numpy()).all()
    # Input Dims stay raw until asked for
    mm = ops[ops["name"] == "aten::mm"].iloc[0]
    assert mm["input_dims"] == b"[[32, 64], [64, 64]]"


def test_no_kernels_is_an_error(cpu_pair: list[Path]) -> None:
    with pytest.raises(TraceInputError, match="no GPU kernel events"):
        load_trace_set(cpu_pair)


def test_union() -> None:
    import numpy as np

    assert union_us(np.array([0.0, 5, 20]), np.array([10.0, 8, 30])) == 20.0
    assert union_us(np.array([]), np.array([])) == 0.0


def test_raw_reader_agrees_on_event_count(cpu_pair: list[Path]) -> None:
    ts = load_trace_set(cpu_pair[:1], require_kernels=False)
    ev = raw_events(cpu_pair[0])
    assert len(ts.cpu_ops) == sum(1 for e in ev if e.get("cat") == "cpu_op" and e.get("ph") == "X")


def test_ranks_linked_where_parsed_equal_linking_the_stacked_tables() -> None:
    """The loader links each rank on its own (in its parse process); that must be what linking the
    stacked tables of all ranks gives, row offsets included."""
    import numpy as np
    import pandas as pd

    from traceinspect.load import _concat as concat
    from traceinspect.load import parse_file

    fix = Path(__file__).resolve().parents[1] / "fixtures" / "kv-full-cast-eager"
    files = sorted(fix.glob("*-TP-*.trace.json.gz"))
    if len(files) < 2:
        pytest.skip("fixture not present")
    from traceinspect.link import link_parsed

    ts = load_trace_set(fix, use_cache=False, prepare=link_parsed)
    assert ts.linked
    parsed = [parse_file(f) for f in files]
    ranks = list(range(len(parsed)))
    k = concat([p.kernels for p in parsed], ranks)
    rt = concat([p.runtime for p in parsed], ranks)
    ops = concat([p.cpu_ops for p in parsed], ranks)
    from traceinspect.link import link_tables

    link_tables(k, rt, ops)
    assert (k["rt_idx"] >= 0).mean() > 0.9 and (k["op_idx"] >= 0).mean() > 0.5  # real links to compare
    for c in ("rt_idx", "op_idx", "graph_replay"):
        np.testing.assert_array_equal(ts.kernels[c].to_numpy(), k[c].to_numpy())
    for c in ("rt_name", "op_name", "op_path"):
        assert ts.kernels[c].astype(str).tolist() == k[c].astype(str).tolist()
    np.testing.assert_array_equal(ts.cpu_ops["parent"].to_numpy(), ops["parent"].to_numpy())
    pd.testing.assert_frame_equal(ts.runtime.reset_index(drop=True), rt.reset_index(drop=True))
    assert link(ts) is ts and ts.linked  # already linked: nothing to redo


@pytest.mark.parametrize("native", ["1", "0"])
def test_op_names_number_the_stacked_op_name_column(native: str, cpu_pair: list[Path],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``TraceSet.op_names``: the loader's numbering of ``cpu_ops.name`` (every rank's, shifted as the
    tables are stacked), from the scanner's strings or from the msgspec path; else made on first use."""
    from traceinspect.link import link_parsed

    monkeypatch.setenv("TRACEINSPECT_NATIVE", native)
    fix = Path(__file__).resolve().parents[1] / "fixtures" / "kv-full-cast-eager"
    for paths in ([fix], cpu_pair):
        ts = load_trace_set(paths, use_cache=False, prepare=link_parsed, require_kernels=False)
        assert ts.n_ranks == 2 and ts.op_name_codes is not None
        codes, texts = ts.op_names()
        names = ts.cpu_ops["name"].to_numpy(dtype=object)
        assert len(codes) == len(names) > 0
        assert texts[codes].tolist() == names.tolist()
    ts = load_trace_set(cpu_pair, use_cache=False, require_kernels=False)  # not linked by the loader
    assert ts.op_name_codes is None
    codes, texts = ts.op_names()
    assert texts[codes].tolist() == ts.cpu_ops["name"].tolist() and len(set(texts.tolist())) == len(texts)
    assert ts.op_names()[0] is codes  # made once


def _enclosing_by_hand(key: list[int], ts: list[float], dur: list[float], qkey: list[int],
                       qts: list[float], strict_self: bool) -> list[int]:
    """Per query: the nearest op before it in (thread, ts, -dur, row) order whose end is not before its ts."""
    order = sorted(range(len(ts)), key=lambda i: (key[i], ts[i], -dur[i], i))
    out = []
    for q, (k, t) in enumerate(zip(qkey, qts, strict=True)):
        best = -1
        for i in order:
            if key[i] != k:
                continue
            before = (ts[i], -dur[i], i) < (ts[q], -dur[q], q) if strict_self else ts[i] <= t
            if before and ts[i] + dur[i] >= t:
                best = i  # the last such op in the order: the innermost
        out.append(best)
    return out


@pytest.mark.parametrize("threads", [1, 3])
def test_op_tree_finds_the_innermost_enclosing_op_in_any_row_order(threads: int) -> None:
    """Each op's parent and each event's enclosing op are those a walk over the ops finds, for one thread's
    ops in time order (the loader's order, linked without a sort) and for the same rows shuffled."""
    import numpy as np
    import pandas as pd

    from traceinspect.link import _OpTree

    rng = np.random.default_rng(threads)
    rows = []
    for tid in range(threads):
        t = 0.0
        for _ in range(60):  # nested calls, equal starts and zero durations among them
            t += float(rng.integers(0, 3))
            depth_end = t + float(rng.integers(0, 12))
            rows.append((tid, t, depth_end - t))
            for _ in range(int(rng.integers(0, 3))):
                s = t + float(rng.integers(0, 2))
                rows.append((tid, s, max(0.0, min(depth_end, s + float(rng.integers(0, 6))) - s)))
    # (no two equal ops: which of two equal ones encloses the other follows the row order)
    ops = pd.DataFrame(rows, columns=["tid", "ts", "dur"]).drop_duplicates()
    ops = ops.sort_values("ts", kind="stable", ignore_index=True)
    ops["rank"] = 0
    ops["end"] = ops["ts"] + ops["dur"]
    key = ops["tid"].tolist()
    qts = (rng.random(200) * ops["end"].max()).round(1).tolist()
    qkey = rng.integers(0, threads, 200).tolist()
    want_parent = _enclosing_by_hand(key, ops["ts"].tolist(), ops["dur"].tolist(), key, ops["ts"].tolist(), True)
    want_enclosing = _enclosing_by_hand(key, ops["ts"].tolist(), ops["dur"].tolist(), qkey, qts, False)
    assert sum(p >= 0 for p in want_parent) > 20  # nesting to find
    by_thread = np.lexsort((ops["ts"].to_numpy(), ops["tid"].to_numpy()))  # rows in (thread, ts) order: no sort
    for perm in (np.arange(len(ops)), by_thread, rng.permutation(len(ops))):
        shuffled = ops.iloc[perm].reset_index(drop=True)
        tree = _OpTree(shuffled)
        back = np.argsort(perm)  # row of the original table -> row of the shuffled one
        got = tree.parents()[back]
        assert [perm[g] if g >= 0 else -1 for g in got.tolist()] == want_parent
        enc = tree.enclosing(np.asarray(qkey, dtype=np.int64), np.asarray(qts))
        assert [perm[g] if g >= 0 else -1 for g in enc.tolist()] == want_enclosing
