"""Stage 3b, graphs: recover the CPU ops of CUDA-graph-replayed kernels from graph-capture traces.

A replayed kernel shares the correlation id of its ``cudaGraphLaunch``, so linking gives it no CPU
op. A graph-capture trace (SGLang's ``graph_capture_profile/cuda_graph_capture-*-TP-<r>.json.gz``,
recorded with ``record_shapes=True``) holds no kernel events for the captured work: nothing runs
while a stream is captured, so CUPTI reports only the launch API calls (cudaLaunchKernel,
cuLaunchKernelEx, cudaMemcpyAsync, cudaMemsetAsync, ...), each linked to the CPU op (with its shapes)
that issued it. A replay runs one node per captured call, in capture order. So the GPU events of one
replay (one ``cudaGraphLaunch``) are matched to the captured calls by position, and every pair is
checked: same kind (kernel / memcpy / memset), a GEMM-class kernel only where a GEMM or MoE op
launched (and a GEMM op's launch holds a GEMM-class kernel), a communication kernel only where a
collective launched (and the reverse). Kernel categories come from the names alone (the real
classification needs the recovered ops, so it runs after this stage).

The result (:class:`GraphOps`) gives, per replayed GPU event, the captured op's row in that rank's
capture ``cpu_ops`` table and its op path; classification uses the op paths, the GEMM measurements
the shapes. Nothing is read when there are no replayed kernels; capture traces are read only for
ranks that have some.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.classify.table import ClassTable, classify_name
from traceinspect.errors import TraceInputError
from traceinspect.link import link
from traceinspect.load.parse import parse_file
from traceinspect.model import KERNEL_COLUMNS, RankInfo, TraceSet
from traceinspect.model.classes import GEMM_CLASSES
from traceinspect.model.shapes import OpInputs, op_handler
from traceinspect.tables import combine_codes, factorize_text

GRAPH_COLUMNS = ["rank", "replay", "cap_op", "cap_op_path", "reason"]
NO_CAPTURE = ("CUDA-graph replay: kernels have no CPU op and no graph-capture trace was found "
              "(graph_capture_profile/cuda_graph_capture-*-TP-<r>.json.gz)")
NOT_MATCHED = "CUDA-graph replay not matched to the capture trace: "
NO_CAPTURED_OP = "CUDA-graph replay: the captured launch has no CPU op"

_BEGIN_CAPTURE = re.compile(r"^(?:cuda|cu|hip)StreamBeginCapture")
_END_CAPTURE = re.compile(r"^(?:cuda|cu|hip)StreamEndCapture")
_LAUNCH_API = re.compile(r"LaunchKernel|LaunchCooperativeKernel|^cuLaunch|^hipExtLaunch|^hipModuleLaunch")
_MEMCPY_API = re.compile(r"^(?:cuda|cu|hip)Memcpy\w*Async")
_MEMSET_API = re.compile(r"^(?:cuda|cu|hip)Memset\w*Async")
COMM_PATH = re.compile(r"nccl|rccl|c10d::|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast|"
                       r"custom_ar|cross_device_reduce", re.IGNORECASE)
_KIND_CODE = {"kernel": 0, "memcpy": 1, "memset": 2}
_CAT_OTHER, _CAT_GEMM, _CAT_COMM, _CAT_MOE = 0, 1, 2, 3
_CAT_NAME = {_CAT_OTHER: "other work", _CAT_GEMM: "a GEMM", _CAT_COMM: "a collective", _CAT_MOE: "a fused MoE op"}


@dataclass
class CaptureTrace:
    """One rank's graph-capture trace: the captured GPU work calls in order and their ops."""

    kind: np.ndarray  # _KIND_CODE per captured call
    cat: np.ndarray  # _CAT_* of the op that issued it
    window: np.ndarray  # capture (Begin..EndCapture) number per call
    op_idx: np.ndarray  # the op's row in ``ops``, or -1
    op_path: np.ndarray  # the op's path (outer -> inner, ' > ' joined), '' if none
    ops: pd.DataFrame  # the capture trace's cpu_ops (model columns, with ``parent``)
    reason: str = ""  # why the trace is unusable ('' if usable)
    path: Path | None = None
    parsed: Any = None  # the ParsedRank read from the file (None when it could not be read)
    # replay signature -> (captured op rows, op paths, reason); reason '' when matched
    alignments: dict[tuple[bytes, bytes], tuple[np.ndarray, np.ndarray, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        ops = self.ops
        self.n_ops = len(ops) + 1
        empty = np.array([], dtype=object)
        self.names = ops["name"].to_numpy(dtype=object) if len(ops) else empty
        self.dims = ops["input_dims"].to_numpy(dtype=object) if len(ops) else empty
        self.types = ops["input_types"].to_numpy(dtype=object) if len(ops) else empty
        self.conc = ops["concrete"].to_numpy(dtype=object) if len(ops) else empty


class RankStatus(msgspec.Struct, frozen=True):
    """How the ops of one rank's replayed kernels were recovered."""

    rank: int
    status: str  # 'recovered' (every replay) | 'partial' | 'unknown'
    reason: str  # '' when recovered; else why (the most frequent reason)
    replays: int  # graph launches with replayed GPU events
    matched: int  # of those, matched to the capture trace
    capture: str | None  # the capture trace's path, if one was found

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "status": self.status, "reason": self.reason or None, "replays": self.replays,
                "matched": self.matched, "capture_trace": self.capture}


class GraphOps(msgspec.Struct):
    """CPU ops of graph-replayed GPU events recovered from the capture traces.

    ``kernels`` has one row per graph-replayed event of ``ts.kernels`` (same index): ``rank``,
    ``replay`` (row in ``runtime`` of its ``cudaGraphLaunch``), ``cap_op`` (row of the captured op in
    ``captures[rank].ops``, -1 if unknown or ambiguous), ``cap_op_path`` (outer -> inner, ' > '
    joined; '' if unknown; kept when several capture windows match with the same ops but different
    shapes) and ``reason`` (why ``cap_op`` is -1, '' otherwise).
    """

    kernels: pd.DataFrame
    captures: dict[int, CaptureTrace] = msgspec.field(default_factory=dict)
    ranks: dict[int, RankStatus] = msgspec.field(default_factory=dict)

    @classmethod
    def empty(cls) -> GraphOps:
        return cls(pd.DataFrame({c: pd.Series(dtype=t) for c, t in zip(
            GRAPH_COLUMNS, (np.int64, np.int64, np.int64, object, object), strict=True)}))

    def op_paths(self) -> pd.Series:
        """Recovered op path per replayed event (index of ``ts.kernels``), only where known."""
        p = self.kernels["cap_op_path"]
        return p[p.astype(bool)]

    def capture_ops(self, rank: int) -> pd.DataFrame | None:
        """The capture trace's cpu_ops of ``rank`` (None when none was read)."""
        cap = self.captures.get(rank)
        return cap.ops if cap is not None else None

    def to_json(self) -> dict[str, Any]:
        """Per-rank status, for reports."""
        return {"graph_ops": [s.to_json() for _, s in sorted(self.ranks.items())]}


# ----------------------------------------------------------------------------- capture traces


def _op_cat(op_name: str, op_path: str) -> int:
    h = op_handler(op_name) if op_name else None
    if h is not None and h[0] == "gemm":
        return _CAT_GEMM
    if h is not None and h[0] == "moe":
        return _CAT_MOE
    if COMM_PATH.search(op_path):
        return _CAT_COMM
    return _CAT_OTHER


def _unusable(path: Path, reason: str, parsed: Any = None) -> CaptureTrace:
    empty = np.array([], dtype=np.int64)
    return CaptureTrace(empty, empty, empty, empty, np.array([], dtype=object),
                        parsed.cpu_ops if parsed is not None else pd.DataFrame(), reason, path, parsed=parsed)


def load_capture(path: Path, rank: int) -> CaptureTrace:
    """Read and link a graph-capture trace: one synthetic GPU event per captured work call (named by
    its API), linked to its CPU op with the same code as the profiled trace."""
    try:
        pr = parse_file(path)
    except TraceInputError as e:
        return _unusable(path, f"capture trace unusable: {e.reason}")
    rt = pr.runtime.sort_values("ts", kind="stable").reset_index(drop=True)
    names = rt["name"]
    kind = np.where(names.str.contains(_LAUNCH_API), "kernel",
                    np.where(names.str.contains(_MEMCPY_API), "memcpy",
                             np.where(names.str.contains(_MEMSET_API), "memset", "")))
    # capture windows: work calls between a BeginCapture and the next EndCapture
    ts = rt["ts"].to_numpy()
    begins = ts[names.str.contains(_BEGIN_CAPTURE).to_numpy()]
    ends = ts[names.str.contains(_END_CAPTURE).to_numpy()]
    window = np.full(len(rt), -1, dtype=np.int64)
    if len(begins):
        for w, b in enumerate(begins):
            later = ends[ends > b]
            e = later[0] if len(later) else np.inf
            window[(ts > b) & (ts < e)] = w
    else:
        window[:] = 0  # no capture markers: the whole trace is one candidate
    work = rt[(kind != "") & (window >= 0)]
    wkind = kind[work.index.to_numpy()]
    if not len(work):
        return _unusable(path, f"capture trace {path.name} records no captured kernel launches", pr)
    syn = pd.DataFrame({
        "rank": rank, "kind": pd.Categorical(wkind, categories=["kernel", "memcpy", "memset"]),
        "name": work["name"].to_numpy(), "ts": work["ts"].to_numpy(), "dur": 0.0, "end": work["ts"].to_numpy(),
        "device": -1, "stream": -1, "correlation": work["correlation"].to_numpy(),
        "external_id": work["external_id"].to_numpy(), "grid": "", "block": "", "bytes": -1.0,
    })[KERNEL_COLUMNS]
    tabs = {"kernels": syn}
    for key in ("runtime", "cpu_ops", "annotations", "gpu_annotations"):
        df = (rt if key == "runtime" else getattr(pr, key)).copy()
        df.insert(0, "rank", rank)
        tabs[key] = df
    info = RankInfo(rank=rank, label=f"capture-TP{rank}", path=path, rank_source="capture")
    tset = TraceSet(ranks=[info], **tabs)
    link(tset)
    k = tset.kernels
    paths = k["op_path"].to_numpy(dtype=object)
    cats = np.array([_op_cat(n, p) for n, p in zip(k["op_name"].to_numpy(dtype=object), paths, strict=True)],
                    dtype=np.int64)
    return CaptureTrace(np.array([_KIND_CODE[x] for x in wkind], dtype=np.int64), cats,
                        window[work.index.to_numpy()], k["op_idx"].to_numpy(), paths, tset.cpu_ops, path=path,
                        parsed=pr)


def _compatible(ck: np.ndarray, cc: np.ndarray, rk: np.ndarray, rc: np.ndarray) -> np.ndarray:
    """Pairwise: the replayed event can be the node of the captured call."""
    gemm_ok = (rc != _CAT_GEMM) | (cc == _CAT_GEMM) | (cc == _CAT_MOE)
    gemm_rev = (cc != _CAT_GEMM) | (rc == _CAT_GEMM) | (rk != 0)
    comm_ok = (rc == _CAT_COMM) == (cc == _CAT_COMM)
    return (ck == rk) & gemm_ok & gemm_rev & comm_ok


def align(cap: CaptureTrace, rkind: np.ndarray, rcat: np.ndarray) -> tuple[list[int], str]:
    """Offsets o where the captured calls ``o .. o+len(replay)`` match the replayed events pairwise
    (a whole capture window first; any window of the right length inside one otherwise), or none and
    why."""
    m, n = len(rkind), len(cap.kind)
    if m == 0:
        return [], "no replayed events"
    if m > n:
        return [], f"one replay has {m} GPU events, the capture trace only {n} captured calls"
    starts = [int(i) for i in np.nonzero(np.r_[True, cap.window[1:] != cap.window[:-1]])[0]]
    sizes = np.diff(np.r_[starts, n])
    exact = [o for o, sz in zip(starts, sizes, strict=True) if sz == m]
    # other windows inside one capture; cheap pre-filter on the first and last pair before the full check
    o = np.arange(n - m + 1)
    ok_ends = ((cap.window[o] == cap.window[o + m - 1])
               & _compatible(cap.kind[o], cap.cat[o], rkind[0], rcat[0])
               & _compatible(cap.kind[o + m - 1], cap.cat[o + m - 1], rkind[-1], rcat[-1]))
    ok_ends[exact] = False
    others = [int(x) for x in np.nonzero(ok_ends)[0]]
    best = (-1, -1, "")
    for group in (exact, others):
        hits = []
        for o in group:
            ok = _compatible(cap.kind[o:o + m], cap.cat[o:o + m], rkind, rcat)
            if ok.all():
                hits.append(o)
            else:
                j = int(np.argmin(ok))
                if j > best[0]:
                    why = (f"replayed event {j} is a {('kernel', 'memcpy', 'memset')[rkind[j]]} of "
                           f"{_CAT_NAME[int(rcat[j])]}, the captured call there one of "
                           f"{_CAT_NAME[int(cap.cat[o + j])]}")
                    best = (j, o, why)
        if hits:
            return hits, ""
    if best[0] < 0:
        sizes_s = ", ".join(str(int(x)) for x in sizes[:5])
        return [], (f"one replay has {m} GPU events; the capture windows have {sizes_s}"
                    + (" ..." if len(sizes) > 5 else "") + " captured calls")
    return [], (f"replay and capture disagree after {best[0]} matching events (capture position "
                f"{best[1]}): {best[2]}")


def _same_shapes(cap: CaptureTrace, hits: list[int], m: int) -> bool:
    """Whether every matching capture window records the same ops with the same shapes."""
    def sig(o: int) -> list[tuple | None]:
        c = cap.op_idx[o:o + m]
        return [(cap.names[i], cap.dims[i], cap.types[i], cap.conc[i]) if i >= 0 else None for i in c]
    ref = sig(hits[-1])
    return all(sig(o) == ref for o in hits[:-1])


def _match(cap: CaptureTrace, rkind: np.ndarray, rcat: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
    """Captured op rows and op paths for one replay's events, and why the rows are unknown ('' if not)."""
    m = len(rkind)
    none_op = np.full(m, -1, dtype=np.int64)
    hits, reason = align(cap, rkind, rcat)
    if not hits:
        return none_op, np.full(m, "", dtype=object), NOT_MATCHED + reason
    if len(hits) > 1 and not _same_shapes(cap, hits, m):
        # several graphs captured with the same launches (e.g. one per batch size): the shapes are
        # ambiguous, but op paths the matching windows agree on still tell what each kernel is
        paths = np.array([cap.op_path[o:o + m] for o in hits], dtype=object)
        agree = (paths == paths[-1]).all(axis=0)
        return none_op, np.where(agree, paths[-1], ""), (
            NOT_MATCHED + f"it matches {len(hits)} places of the capture trace that record different shapes "
            "(several graphs captured with the same launches): ambiguous")
    o = hits[-1]
    return cap.op_idx[o:o + m].astype(np.int64), cap.op_path[o:o + m].astype(object), ""


# ----------------------------------------------------------------------------- the stage


def _name_categories(rk: pd.DataFrame, table: ClassTable | None) -> tuple[np.ndarray, np.ndarray]:
    """Kind codes and name-only kernel categories (GEMM / collective / other) of replayed events."""
    # decided once per distinct (name, kind), on integer codes of the two columns
    nc, names = factorize_text(rk["name"].to_numpy(dtype=object))
    kc, kinds = factorize_text(rk["kind"].astype(object).to_numpy(dtype=object))
    pair = combine_codes(nc, kc)
    _, first = np.unique(pair, return_index=True)
    cats = []
    for i in first.tolist():
        cls = classify_name(str(names[nc[i]]), "", str(kinds[kc[i]]), table=table).cls
        cats.append(_CAT_GEMM if cls in GEMM_CLASSES else _CAT_COMM if cls == "comm" else _CAT_OTHER)
    cat = np.asarray(cats, dtype=np.int64)[pair] if len(rk) else np.empty(0, dtype=np.int64)
    kind = np.array([_KIND_CODE.get(str(x), 0) for x in kinds], dtype=np.int64)[kc] if len(rk) else \
        np.empty(0, dtype=np.int64)
    return kind, cat


def recover_graph_ops(ts: TraceSet, table: ClassTable | None = None) -> GraphOps:
    """Recover the captured CPU op (row and path) of every CUDA-graph-replayed GPU event of a linked
    trace set from its ranks' graph-capture traces (``ts.capture_traces``). ``table`` is the class
    table whose name-only labels give the kernel categories of the pairwise check."""
    k = ts.kernels
    if not len(k) or "graph_replay" not in k:
        return GraphOps.empty()
    replay = k["graph_replay"].to_numpy(dtype=bool)
    if not replay.any():
        return GraphOps.empty()
    rep = k.loc[replay, ["rank", "rt_idx", "ts", "name", "kind"]]  # the columns read below
    n = len(rep)
    cap_op = np.full(n, -1, dtype=np.int64)
    cap_path = np.full(n, "", dtype=object)
    reason = np.full(n, "", dtype=object)
    launch = rep["rt_idx"].to_numpy().astype(np.int64)
    captures: dict[int, CaptureTrace] = {}
    ranks: dict[int, RankStatus] = {}
    rank_col = rep["rank"].to_numpy()
    for rank in np.unique(rank_col):
        rank = int(rank)
        rows = np.nonzero(rank_col == rank)[0]
        n_replays = len(np.unique(launch[rows]))
        path = ts.capture_traces.get(rank)
        if not path:
            reason[rows] = NO_CAPTURE
            ranks[rank] = RankStatus(rank, "unknown", NO_CAPTURE, n_replays, 0, None)
            continue
        cap = captures[rank] = load_capture(Path(path), rank)
        if cap.reason:
            reason[rows] = cap.reason
            ranks[rank] = RankStatus(rank, "unknown", cap.reason, n_replays, 0, str(path))
            continue
        rk = rep.iloc[rows]
        kind, cat = _name_categories(rk, table)
        # one replay = the GPU events of one cudaGraphLaunch, in time order
        order = np.lexsort((rk["ts"].to_numpy(), launch[rows]))
        srt = rows[order]
        bounds = np.r_[0, np.nonzero(np.diff(launch[srt]))[0] + 1, len(srt)]
        matched = 0
        for a, b in zip(bounds[:-1], bounds[1:], strict=True):
            sel, rkind, rcat = srt[a:b], kind[order[a:b]], cat[order[a:b]]
            key = (rkind.tobytes(), rcat.tobytes())
            if key not in cap.alignments:
                cap.alignments[key] = _match(cap, rkind, rcat)
            ops_i, paths_i, why = cap.alignments[key]
            cap_op[sel] = ops_i
            cap_path[sel] = paths_i
            if why:
                reason[sel] = why
            else:
                matched += 1
                reason[sel[ops_i < 0]] = NO_CAPTURED_OP
        status = "recovered" if matched == n_replays else "partial" if matched else "unknown"
        why_rank = ""
        if status != "recovered":
            unmatched = pd.Series(reason[rows])
            unmatched = unmatched[unmatched.str.startswith(NOT_MATCHED)]
            why_rank = str(unmatched.mode().iloc[0]) if len(unmatched) else ""
        ranks[rank] = RankStatus(rank, status, why_rank, n_replays, matched, str(path))
    # text columns stay object (as in GraphOps.empty): pandas 3 would convert every row of them
    table_out = pd.DataFrame({"rank": rank_col.astype(np.int64), "replay": launch, "cap_op": cap_op,
                              "cap_op_path": pd.Series(cap_path, index=rep.index, dtype=object),
                              "reason": pd.Series(reason, index=rep.index, dtype=object)}, index=rep.index)
    return GraphOps(table_out, captures, ranks)


CAPTURED_NOTE = "op from graph capture trace"


def captured_rows(k: pd.DataFrame, graph_ops: GraphOps | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions in ``k`` of graph-replayed kernels with a recovered op path, and those paths."""
    if graph_ops is None or not len(graph_ops.kernels) or "graph_replay" not in k:
        return None
    paths = graph_ops.op_paths()
    if not len(paths):
        return None
    pos = k.index.get_indexer(paths.index)
    ok = pos >= 0
    pos, vals = pos[ok], paths.to_numpy(dtype=object)[ok]
    keep = k["graph_replay"].to_numpy(dtype=bool)[pos]
    return (pos[keep], vals[keep]) if keep.any() else None


def captured_ops(k: pd.DataFrame, graph_ops: GraphOps | None
                  ) -> tuple[np.ndarray, np.ndarray, dict[int, OpInputs]]:
    """Per kernel row: replayed with a recovered op path, and the captured op's row in its rank's
    capture ``cpu_ops`` (-1 if unknown); per rank, the capture trace's recorded shapes."""
    captured = np.zeros(len(k), dtype=bool)
    cap_op = np.full(len(k), -1, dtype=np.int64)
    inputs: dict[int, OpInputs] = {}
    rows_paths = captured_rows(k, graph_ops)
    if rows_paths is not None:
        captured[rows_paths[0]] = True
    if graph_ops is not None and len(graph_ops.kernels) and "cap_op" in graph_ops.kernels:
        pos = k.index.get_indexer(graph_ops.kernels.index)
        ok = pos >= 0
        cap_op[pos[ok]] = graph_ops.kernels["cap_op"].to_numpy(dtype=np.int64)[ok]
        for rank, cap in graph_ops.captures.items():
            if cap.ops is not None and len(cap.ops):
                inputs[int(rank)] = OpInputs(cap.ops.reset_index(drop=True))
    return captured, cap_op, inputs
