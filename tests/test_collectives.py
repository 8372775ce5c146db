"""Collectives across ranks: wait vs transfer, clock offsets, stragglers and the critical path."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from types import SimpleNamespace as NS

import numpy as np
import pandas as pd
import pytest

from traceinspect.measure.collectives import analyze_collectives, collective_kind

ROOT = Path(__file__).resolve().parents[1]
FIX = ROOT / "fixtures"
SLOW = FIX / "slow-rank-eager"
# Graph replay: one launch per step, so the ranks' hosts cannot drift apart inside a step. The eager
# fixtures are host-bound and carry natural host skew between the ranks (fixtures/README.md).
BALANCED = FIX / "kv-gather-cast-graph"


def _need(d: Path) -> Path:
    if not (d / "manifest.json").is_file() or not list(d.glob("*-TP-*.trace.json.gz")):
        pytest.skip(f"fixture {d.name} is not present")
    return d


def _analyze(path: Path | list[Path]):
    from traceinspect.pipeline import analyze

    return analyze([str(p) for p in path] if isinstance(path, list) else str(path))


# ----------------------------------------------------------------------------- synthetic, exact
def _synthetic(skew1: float = 0.0):
    """Two ranks, one step, one allreduce. Rank 1's host launches its second GEMM 400 us after the GPU
    went idle, so rank 0 waits 500 us in the allreduce; the transfer is rank 1's 20 us."""
    rows = []

    def k(rank, name, ts, dur, stream, launch, cls, off):
        rows.append(dict(rank=rank, kind="kernel", name=name, ts=ts + off, dur=dur, end=ts + dur + off,
                         stream=stream, launch=launch + off, cls=cls))

    ar = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL"
    for r, off in ((0, 0.0), (1, skew1)):
        k(r, "gemm_a", 100, 100, 7, 50, "gemm", off)
        if r == 0:
            k(r, ar, 200, 520, 20, 60, "comm", off)
        else:
            k(r, "gemm_b", 600, 100, 7, 590, "gemm", off)  # launched 400 us after the GPU went idle
            k(r, ar, 700, 20, 20, 650, "comm", off)
        k(r, "gemm_c", 725, 100, 7, 70 if r == 0 else 660, "gemm", off)
    kern = pd.DataFrame(rows)
    rt = pd.DataFrame({"rank": kern["rank"], "name": "cudaLaunchKernel", "ts": kern["launch"], "dur": 5.0,
                       "end": kern["launch"] + 5.0, "tid": 1, "correlation": np.arange(len(kern)),
                       "external_id": -1})
    kern = kern.drop(columns="launch").assign(rt_idx=np.arange(len(kern)), graph_replay=False, op_idx=-1,
                                              step=lambda d: d["rank"])
    sel = pd.DataFrame({"rank": [0, 1], "idx": [1, 1], "span_us": [725.0, 725.0], "busy_us": [720.0, 320.0],
                        "cpu_start": [0.0, skew1]}, index=[0, 1])
    trace = NS(ranks=[NS(rank=0, dp=None, pp=None), NS(rank=1, dp=None, pp=None)], runtime=rt,
               annotations=pd.DataFrame(columns=["rank", "name", "ts", "dur", "end", "tid"]),
               cpu_ops=pd.DataFrame(columns=["rank", "name", "ts", "dur", "end", "tid", "external_id",
                                             "input_dims", "input_types", "concrete", "parent"]))
    return NS(n_ranks=2, trace=trace, selected=sel, kernels=kern)


@pytest.mark.parametrize("skew", [0.0, 1000.0, -2345.5])
def test_synthetic_wait_transfer_offset_and_path(skew: float) -> None:
    c = analyze_collectives(_synthetic(skew))
    assert c.applicable, c.reason
    assert c.offsets[1] == pytest.approx(skew, abs=1e-6)
    inst = c.instances.set_index("rank")
    assert inst.loc[0, "transfer_us"] == inst.loc[1, "transfer_us"] == 20
    assert inst.loc[0, "wait_us"] == 500 and inst.loc[1, "wait_us"] == 0
    assert bool(inst.loc[1, "last_arrival"]) and not bool(inst.loc[0, "last_arrival"])
    assert inst.loc[1, "launch_lateness_us"] == pytest.approx(590)
    assert c.straggler["rank"] == 1
    cp = c.critical_path
    # path: gemm_a 100 -> host 400 (rank 1) -> gemm_b 100 (rank 1) -> transfer 20 -> idle 5 -> gemm_c 100
    assert cp["total_us_median"] == pytest.approx(725)
    assert cp["median_step"]["span_us"] == pytest.approx(725)
    assert cp["composition"]["host"]["us_per_step"] == pytest.approx(400)
    assert cp["composition"]["comm"]["us_per_step"] == pytest.approx(20)
    assert cp["composition"]["idle"]["us_per_step"] == pytest.approx(5)
    assert "comm_wait" not in cp["composition"]
    assert cp["host_by_rank"] == {"1": {"us_per_step": 400.0, "share_of_host": 1.0}}
    assert cp["bounding_rank"] == 1
    json.dumps(c.to_json(), allow_nan=False)


def test_synthetic_single_rank_has_reason_but_a_path() -> None:
    a = _synthetic()
    a.n_ranks = 1
    a.trace.ranks = a.trace.ranks[:1]
    a.selected = a.selected.iloc[:1]
    a.kernels = a.kernels[a.kernels["rank"] == 0]
    c = analyze_collectives(a)
    assert not c.applicable and "single rank" in c.reason
    doc = c.to_json()
    assert doc["collectives"]["applicable"] is False and doc["collectives"]["reason"]
    assert "per_rank" not in doc["collectives"]
    assert doc["critical_path"]["applicable"] is True


@pytest.mark.parametrize(("name", "kind"), [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "allreduce"),
    ("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL", "reducescatter"),
    ("ncclDevKernel_AllGather_RING_LL", "allgather"),
    ("void cross_device_reduce_1stage<__nv_bfloat16, 8>(...)", "allreduce"),
    ("all_reduce", "allreduce"), ("_reduce_scatter_base", "reducescatter"),
    ("ncclDevKernel_SendRecv", "sendrecv"), ("ncclDevKernel_Broadcast_RING_LL", "broadcast"),
    ("vectorized_elementwise_kernel", None),
])
def test_collective_kind(name: str, kind: str | None) -> None:
    assert collective_kind(name) == kind


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def slow():
    d = _need(SLOW)
    return _analyze(d), json.loads((d / "manifest.json").read_text())


@pytest.fixture(scope="module")
def balanced():
    return _analyze(_need(BALANCED))


def test_slow_rank_fast_rank_waits(slow) -> None:
    a, man = slow
    c = a.collectives
    assert c is not None and c.applicable, c.reason if c else None
    slowed = man["slowed_rank"]
    for r in man["ranks"]:
        row = c.rank_row(r)
        if r == slowed:
            assert row["wait_share"] < 0.3
        else:
            assert row["wait_share"] > 0.5, row
            # the planted host delay is slow_us per layer: most of it shows up as this rank's wait
            assert row["wait_us_per_step"] > 0.5 * man["slow_us"] * man["layers"]


def test_slow_rank_named_straggler(slow) -> None:
    a, man = slow
    c = a.collectives
    assert c.straggler["rank"] == man["slowed_rank"], c.straggler
    row = c.rank_row(man["slowed_rank"])
    assert row["late_share"] >= 0.75
    assert row["launch_lateness_us_median"] > 0.5 * man["slow_us"]


def test_slow_rank_critical_path_runs_through_its_host_work(slow) -> None:
    a, man = slow
    cp = a.collectives.critical_path
    slowed = str(man["slowed_rank"])
    assert cp["applicable"]
    host = cp["host_by_rank"]
    assert host[slowed]["share_of_host"] > 0.8, host
    # the planted delay (slow_us per layer) is on the path as host time of the slowed rank
    assert host[slowed]["us_per_step"] > 0.8 * man["slow_us"] * man["layers"]
    assert cp["bounding_rank"] == man["slowed_rank"]
    doc = a.to_json()
    assert doc["critical_path"]["median_step"]["host_by_rank"][slowed] > 0
    assert doc["collectives"]["straggler"]["rank"] == man["slowed_rank"]
    json.dumps(doc, allow_nan=False)


def test_balanced_wait_small(balanced) -> None:
    c = balanced.collectives
    assert c.applicable, c.reason
    # wait is judged against the step: a 13 us allreduce makes wait_share jump on a few us of jitter
    assert (c.per_rank["wait_step_fraction"] < 0.05).all(), c.per_rank[["rank", "wait_step_fraction"]]
    assert (c.per_rank["transfer_us"] > 0).all()
    assert c.straggler["rank"] is None, c.straggler
    # single host: one clock; the estimated offsets are tiny
    assert all(abs(v) < 50 for v in c.offsets.values()), c.offsets


def test_single_rank_file_has_no_collective_analysis() -> None:
    d = _need(BALANCED)
    a = _analyze(sorted(d.glob("*-TP-0.trace.json.gz"))[0])
    c = a.collectives
    assert c is not None and not c.applicable
    assert "single rank" in c.reason
    doc = a.to_json()["collectives"]
    assert doc["applicable"] is False and "single rank" in doc["reason"]


SKEW = {0: 0.0, 1: 0.0, 2: 2500.0, 3: -1800.25, 4: 40.0, 5: 7.5, 6: 123456.0, 7: -333.0}


def _shifted_copy(src: Path, dst: Path, skew: float) -> None:
    doc = json.loads(gzip.decompress(src.read_bytes()))
    if skew:
        for ev in doc["traceEvents"]:
            if isinstance(ev, dict) and isinstance(ev.get("ts"), (int, float)):
                ev["ts"] = ev["ts"] + skew
    dst.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))


def test_eight_ranks_recover_injected_clock_skew(tmp_path: Path, balanced) -> None:
    d = _need(BALANCED)
    srcs = sorted(d.glob("*-TP-*.trace.json.gz"))
    assert len(srcs) == 2
    base = balanced.collectives.offsets  # the real offset between the two source ranks
    for r in range(8):
        _shifted_copy(srcs[r % 2], tmp_path / f"fixture-TP-{r}.trace.json.gz", SKEW[r])
    info = json.loads((d / "server_info.json").read_text())
    info["tp_size"] = 8
    (tmp_path / "server_info.json").write_text(json.dumps(info))
    a = _analyze(tmp_path)
    c = a.collectives
    assert c.applicable, c.reason
    assert c.groups == [list(range(8))]
    for r in range(8):
        expected = SKEW[r] + base[r % 2]
        assert c.offsets[r] == pytest.approx(expected, abs=2.0), (r, c.offsets[r], expected)
        assert c.offsets[r] == pytest.approx(SKEW[r], abs=10.0)
    # after correction the ends of every instance agree across the 8 ranks
    spread = c.instances.groupby("instance")["end"].agg(lambda e: e.max() - e.min())
    assert spread.median() < 5.0
    # replicated ranks keep the 2-rank wait/transfer split: per-step transfer matches the source run
    t8 = c.per_rank.set_index("rank")["transfer_us_per_step"]
    t2 = balanced.collectives.per_rank.set_index("rank")["transfer_us_per_step"]
    for r in range(8):
        assert t8[r] == pytest.approx(t2[r % 2], abs=1e-6)
    assert c.to_json()["collectives"]["clock"]["offsets_us"]["6"] == pytest.approx(SKEW[6] + base[0], abs=2.0)


# ----------------------------------------------------------------------------- longest path
def _nx_longest(G, src: int, sink: int) -> list[int]:
    """networkx's answer for a step graph (edges weighted with their source node's weight)."""
    import networkx as nx

    n = len(G.weight)
    has_out, has_in = np.zeros(n, dtype=bool), np.zeros(n, dtype=bool)
    for u, v in G.edges:
        has_out[u] = has_in[v] = True
    extra = [(u, sink) for u in range(n) if not has_out[u] and u != sink]
    extra += [(src, v) for v in range(n) if not has_in[v] and v != src]
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    g.add_weighted_edges_from((u, v, G.weight[u]) for u, v in G.edges + extra)
    return nx.dag_longest_path(g, weight="weight", default_weight=0.0)


def _assert_same_graph(ref, got) -> None:
    """Two StepGraphs with the same nodes (weight, class, rank, label), source, sink and edges in order."""
    assert (got.source, got.sink) == (ref.source, ref.sink)
    np.testing.assert_array_equal(got.weight, ref.weight)
    assert [got.cls_names[c] for c in got.cls] == [ref.cls_names[c] for c in ref.cls]
    np.testing.assert_array_equal(got.rank, ref.rank)
    assert [got.labels[i] for i in got.label] == [ref.labels[i] for i in ref.label]
    np.testing.assert_array_equal(got.src, ref.src)
    np.testing.assert_array_equal(got.dst, ref.dst)


def _check_steps(a, min_nodes: int = 100) -> int:
    """On every aligned step: the numpy graph equals the Python builder's, and the longest path (native
    where built, the Python loop, networkx) is one path."""
    from traceinspect.measure import collectives as C
    from traceinspect.measure import critical_path as CP

    sel, _ = C._aligned_steps(a)
    act = C._activities(a, sel, a.collectives)
    checked = 0
    for _, pa in act.groupby("pos"):
        G, src, sink, t0, t1 = C._step_graph(pa)
        assert len(G.weight) > min_nodes
        built = CP._step_arrays(pa)
        assert built is not None
        got, u0, u1 = built
        assert (u0, u1) == (t0, t1)
        _assert_same_graph(G.arrays(src, sink), got)
        path = G.longest_path(src, sink)
        assert path == _nx_longest(G, src, sink)
        assert got.longest_path() == path
        checked += 1
    return checked


def test_longest_path_matches_networkx_on_real_steps(slow) -> None:
    a, _ = slow
    assert _check_steps(a) >= 3


def test_activities_of_sampled_steps_equal_the_filtered_whole(slow) -> None:
    """The critical path builds activities only for the sampled steps: the same rows and values as
    building them for every aligned step and keeping the sampled ones."""
    from traceinspect.measure import collectives as C

    a, _ = slow
    sel, _ = C._aligned_steps(a)
    whole = C._activities(a, sel, a.collectives)
    positions = sorted(whole["pos"].unique())[1::2]
    assert positions
    pd.testing.assert_frame_equal(C._activities(a, sel, a.collectives, positions),
                                  whole[whole["pos"].isin(positions)])


@pytest.mark.parametrize("name", ["kv-full-cast-eager", "kv-full-cast-graph", "moe-small-m-eager"])
def test_step_arrays_equal_python_builder_on_fixtures(name: str) -> None:
    assert _check_steps(_analyze(_need(FIX / name))) >= 3


def test_step_arrays_equal_python_builder_on_real_trace() -> None:
    from conftest import real_trace

    a = _analyze(real_trace("param__dlrm_8rank"))
    assert a.n_ranks == 8
    assert _check_steps(a) >= 1


def _random_activities(rng: np.random.Generator) -> pd.DataFrame:
    """Activities of one step on a few ranks and streams, with integer times (equal starts and ends,
    durations under the ordering tolerance), matched collectives, late and missing launches."""
    n_ranks = int(rng.integers(1, 4))
    rows = []
    n_inst = int(rng.integers(0, 4))
    for r in range(n_ranks):
        for _ in range(int(rng.integers(1, 40))):
            ts = float(rng.integers(0, 60)) + (0.25 if rng.random() < 0.2 else 0.0)
            dur = float(rng.choice([0.0, 0.25, 0.5, 1.0, 3.0, 7.0]))
            inst = int(rng.integers(0, n_inst)) if n_inst and rng.random() < 0.25 else -1
            launch = ts - float(rng.integers(-3, 10)) if rng.random() < 0.8 else np.nan
            launch_end = launch + float(rng.integers(0, 6)) if rng.random() < 0.8 else np.nan
            rows.append(dict(rank=r, kind="kernel", name=f"k{int(rng.integers(0, 6))}", ts=ts, dur=dur, end=ts + dur,
                             stream=int(rng.integers(0, 3)), cls=str(rng.choice(["gemm", "comm", "other"])),
                             launch=launch, launch_end=launch_end, instance=inst,
                             transfer_us=float(rng.integers(-1, 5)) if inst >= 0 else np.nan,
                             residual_wait=float(rng.integers(0, 3)) if inst >= 0 else 0.0))
    return pd.DataFrame(rows).sample(frac=1.0, random_state=int(rng.integers(0, 1000)))


@pytest.mark.parametrize("seed", range(60))
def test_step_arrays_equal_python_builder_with_ties(seed: int) -> None:
    from traceinspect.measure import critical_path as CP

    act = _random_activities(np.random.default_rng(seed))
    G, src, sink, t0, t1 = CP._step_graph(act)
    got, u0, u1 = CP._step_arrays(act)
    assert (u0, u1) == (t0, t1)
    _assert_same_graph(G.arrays(src, sink), got)
    try:
        path = G.longest_path(src, sink)
    except CP.Cycle:  # instances matched in inconsistent orders
        with pytest.raises(CP.Cycle):
            got.longest_path()
        return
    assert got.longest_path() == path == _nx_longest(G, src, sink)


def test_step_arrays_leaves_non_finite_times_to_the_python_builder() -> None:
    from traceinspect.measure import critical_path as CP

    act = _random_activities(np.random.default_rng(1))
    act.iloc[0, act.columns.get_loc("end")] = np.nan
    assert CP._step_arrays(act) is None


def _summary_records(s: dict) -> dict:
    return {**s, "segments": s["segments"].top(len(s["segments"].us))}


@pytest.mark.parametrize("seed", range(6))
def test_step_summaries_of_all_steps_at_once_equal_each_step_alone(seed: int) -> None:
    """The critical path reads every step's rows from one sort: the same summaries as building each
    step's graph from its own rows with the Python builder, steps with non-finite times and cycles too."""
    from traceinspect.measure import critical_path as CP

    rng = np.random.default_rng(seed)
    steps = []
    for pos in rng.permutation(8).tolist():
        one = _random_activities(rng).assign(pos=pos)
        if pos == 3:  # left to the Python builder
            one.iloc[0, one.columns.get_loc("end")] = np.nan
        steps.append(one)
    act = pd.concat(steps, ignore_index=True).sample(frac=1.0, random_state=seed)
    got, failed = CP._step_summaries(act)
    want, cycles = [], 0
    for pos, pa in act.groupby("pos"):
        G0, src, sink, t0, t1 = CP._step_graph(pa)
        G = G0.arrays(src, sink)
        try:
            path = G.longest_path()
        except CP.Cycle:
            cycles += 1
            continue
        if not path or path[0] != src:
            path = [src, *path]
        want.append({**CP._path_summary(G, path, t0, t1), "pos": int(pos)})
    assert failed == cycles and len(got) + failed == 8
    assert [_summary_records(x) for x in got] == [_summary_records(x) for x in want]


@pytest.mark.parametrize("seed", range(20))
def test_longest_path_matches_networkx_with_ties(seed: int) -> None:
    from traceinspect.measure.collectives import _Graph

    rng = np.random.default_rng(seed)
    G = _Graph()
    src = G.node(0.0, "start", None, "s")
    n = int(rng.integers(5, 60))
    # integer weights, many zeros: plenty of equally long paths
    nodes = [G.node(float(rng.integers(0, 3)), "x", 0, str(i)) for i in range(n)]
    for _ in range(int(rng.integers(0, 3 * n))):
        u, v = sorted(rng.choice(nodes, 2, replace=False).tolist())
        G.edge(u, v)
        if rng.random() < 0.2:
            G.edge(u, v)  # repeated edges count once
    sink = G.node(0.0, "end", None, "e")
    assert G.longest_path(src, sink) == _nx_longest(G, src, sink) == G.arrays(src, sink).longest_path()


def test_longest_path_cycle_raises() -> None:
    from traceinspect.measure.collectives import Cycle, _Graph

    G = _Graph()
    src = G.node(0.0, "start", None, "s")
    a, b = G.node(1.0, "x", 0, "a"), G.node(1.0, "x", 0, "b")
    G.edge(src, a)
    G.edge(a, b)
    G.edge(b, a)
    sink = G.node(0.0, "end", None, "e")
    with pytest.raises(Cycle):
        G.longest_path(src, sink)
    with pytest.raises(Cycle):
        G.arrays(src, sink).longest_path()
