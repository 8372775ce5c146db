"""The replay model of the analysed steps: host runtime calls, GPU operations and collectives as plain
arrays, with the measured offsets that make a replay without edits reproduce the trace.

Dependencies (all measured, per rank, times corrected by the collectives stage's clock offsets):

* host thread order: a runtime call starts ``gap`` after the previous call of its thread ends;
  calls that neither launch GPU work of the step nor block fold into the gaps;
* launch -> start: a GPU operation starts no earlier than ``lA`` after its launch call began
  (kernels replayed from a CUDA graph hang off their ``cudaGraphLaunch``);
* stream order: no earlier than ``lS`` after the previous operation on its stream ended;
* cross-stream: an operation that started when an operation of another stream ended, and that
  neither its launch nor its stream explains, waits for that operation (an event wait);
* host syncs: a blocking call (``blocking_calls`` in ``rules/tables/replay.yaml``) ends ``r`` after the GPU
  work it waited for, when it waited;
* collectives (matched by :mod:`traceinspect.measure.collectives`): each rank's kernel ends ``res``
  after the last rank arrived.

For each operation the constraint that bound it in the trace keeps its measured offset; the others
get their floor (the rank's launch latency floor, the rank's back-to-back gap on a stream), so a
replay without edits reproduces every start and end, and an edit moves what it frees.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.measure.replay_settings import Settings, load_settings
from traceinspect.tables import per_distinct, text_values

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

XSTREAM_TOL_US = 2.0  # an operation starting this close to another stream's end waits for it


class Model(msgspec.Struct):
    """Arrays of one replay: ``g_*`` per GPU operation, ``h_*`` per host call, ``i_*`` per collective
    instance. Index -1 means "none"; anchors are measured times used where a chain enters the window."""

    ranks: list[int]
    pos: np.ndarray  # aligned step positions replayed
    step_rows: pd.DataFrame  # rank, pos, step (row of the steps table), span_us, busy_us
    # GPU operations
    g_kidx: np.ndarray  # row label in analysis.kernels
    g_rank: np.ndarray
    g_pos: np.ndarray
    g_stream: np.ndarray
    g_t: np.ndarray  # measured (corrected) start
    g_dur: np.ndarray
    g_launch: np.ndarray  # host call index
    g_launch_const: np.ndarray  # launch term of ops launched outside the window: their measured start
    g_prev: np.ndarray  # previous op on the stream in the window
    g_anchor: np.ndarray  # measured end of the op before the window on the stream (-inf: none)
    g_xprev: np.ndarray  # op of another stream this one waited for
    g_lA: np.ndarray
    g_lS: np.ndarray
    g_lX: np.ndarray
    g_inst: np.ndarray  # collective instance
    g_res: np.ndarray  # collective: end minus the instance's last arrival
    g_cls: np.ndarray  # object
    # host calls
    h_rank: np.ndarray
    h_pos: np.ndarray
    h_tid: np.ndarray
    h_seq: np.ndarray  # order among the calls of its (rank, pos, thread)
    h_name: np.ndarray  # object
    h_t: np.ndarray
    h_dur: np.ndarray
    h_end: np.ndarray
    h_prev: np.ndarray
    h_gap: np.ndarray
    h_block: np.ndarray  # bool
    h_wait: np.ndarray  # op index the call waited for
    h_r: np.ndarray  # end minus the waited op's end
    h_launches: np.ndarray  # bool: launches GPU work of the window
    h_op_in: np.ndarray  # host time of the launching CPU op before the call (removable with the op)
    # collective instances
    i_members: list[list[int]] = msgspec.field(default_factory=list)
    i_key: np.ndarray = msgspec.field(default_factory=lambda: np.zeros(0))
    notes: list[str] = msgspec.field(default_factory=list)
    steps_available: int = 0

    @property
    def n_ops(self) -> int:
        return len(self.g_t)


def _aligned(a: Analysis) -> tuple[pd.DataFrame, int]:
    sel = a.selected.sort_values(["rank", "idx"]).copy()
    sel["pos"] = sel.groupby("rank").cumcount()
    counts = sel.groupby("rank").size()
    n = int(counts.min()) if len(counts) else 0
    return sel[sel["pos"] < n], n


def _sample(n: int, m: int) -> np.ndarray:
    if n <= m:
        return np.arange(n)
    return np.unique(np.round(np.linspace(0, n - 1, m)).astype(np.int64))


def _percentile(v: np.ndarray, q: float, default: float) -> float:
    v = v[np.isfinite(v)]
    return float(np.percentile(v, q)) if len(v) else default


def build_model(a: Analysis, settings: Settings | None = None, max_steps: int | None = None) -> Model:
    """The replay model of the analysed (aligned) steps of ``a``, at most ``max_steps`` of them."""
    st = settings or load_settings()
    sel, n_steps = _aligned(a)
    keep_pos = _sample(n_steps, max_steps or st.max_steps)
    sel = sel[sel["pos"].isin(keep_pos)]
    coll = a.collectives
    offsets = dict(coll.offsets_applied) if coll is not None else {}
    ts = a.trace
    k_all = ts.kernels
    rt = ts.runtime
    k = a.kernels
    step_pos = pd.Series(sel["pos"].to_numpy(), index=sel.index)
    km = k[k["step"].isin(sel.index)]
    pos = step_pos.reindex(km["step"]).to_numpy()
    kr = km["rank"].to_numpy()
    ur = np.unique(kr)
    off_k = np.array([offsets.get(int(r), 0.0) for r in ur])[np.searchsorted(ur, kr)] if len(kr) else np.zeros(0)
    order = np.lexsort((km["ts"].to_numpy(), km["stream"].to_numpy(), pos, km["rank"].to_numpy()))
    km = km.iloc[order]
    pos, off_k = pos[order], off_k[order]
    n = len(km)
    g_rank = km["rank"].to_numpy().astype(np.int64)
    g_stream = km["stream"].to_numpy().astype(np.int64)
    g_t = km["ts"].to_numpy(dtype=np.float64) - off_k
    g_dur = km["dur"].to_numpy(dtype=np.float64)
    g_end = g_t + g_dur
    g_kidx = km.index.to_numpy()
    g_cls = text_values(km["cls"]).astype(object)
    rt_idx = km["rt_idx"].to_numpy().astype(np.int64)
    notes: list[str] = []

    # stream predecessor inside the window, and the measured end of the op before the window
    same = np.zeros(n, dtype=bool)
    if n:
        same[1:] = (g_rank[1:] == g_rank[:-1]) & (g_stream[1:] == g_stream[:-1]) & (pos[1:] == pos[:-1])
    g_prev = np.where(same, np.arange(n) - 1, -1)
    g_anchor = np.full(n, -np.inf)
    first = np.nonzero(~same)[0]
    if len(first):
        ka = k_all[["rank", "stream", "ts", "end"]]
        for (r, s), grp in ka.groupby(["rank", "stream"], sort=False):
            idx = first[(g_rank[first] == r) & (g_stream[first] == s)]
            if not len(idx):
                continue
            off = offsets.get(int(r), 0.0)
            t0 = grp["ts"].to_numpy() - off
            e0 = np.maximum.accumulate(grp["end"].to_numpy()[np.argsort(t0, kind="stable")] - off)
            t0s = np.sort(t0)
            p = np.searchsorted(t0s, g_t[idx] - 1e-6, side="left") - 1
            ok = p >= 0
            g_anchor[idx[ok]] = e0[p[ok]]

    # host calls of each step window: those that launch the window's ops, and blocking ones
    launching = np.unique(rt_idx[rt_idx >= 0])
    rt_pos = np.arange(len(rt))
    labels = rt.index.to_numpy()
    rt_block = per_distinct(rt["name"], lambda x: bool(st.blocking.search(str(x))))  # a blocking call's name
    keep = np.isin(labels, launching) | rt_block
    rt_rank = rt["rank"].to_numpy()
    rt_t = rt["ts"].to_numpy(dtype=np.float64)
    picked: list[np.ndarray] = []
    picked_pos: list[np.ndarray] = []
    for r, g in sel.groupby("rank"):
        rows = rt_pos[keep & (rt_rank == r)]
        rows = rows[np.argsort(rt_t[rows], kind="stable")]
        t_r = rt_t[rows]
        lo, hi = g["cpu_start"].to_numpy(dtype=np.float64), g["cpu_end"].to_numpy(dtype=np.float64)
        ok = np.isfinite(lo) & np.isfinite(hi)
        a_ = np.searchsorted(t_r, lo[ok], side="left")
        b_ = np.searchsorted(t_r, hi[ok], side="right")
        for x, y, q in zip(a_.tolist(), b_.tolist(), g["pos"].to_numpy()[ok].tolist(), strict=True):
            picked.append(rows[x:y])
            picked_pos.append(np.full(y - x, q, dtype=np.int64))
    hp = np.concatenate(picked) if picked else np.zeros(0, dtype=np.int64)
    h_rank0 = rt_rank[hp].astype(np.int64)
    off_h = np.array([offsets.get(int(r), 0.0) for r in np.unique(h_rank0)]) if len(hp) else np.zeros(0)
    off_h = off_h[np.searchsorted(np.unique(h_rank0), h_rank0)] if len(hp) else off_h
    host = pd.DataFrame({"rt": labels[hp], "rank": h_rank0,
                         "pos": np.concatenate(picked_pos) if picked_pos else np.zeros(0, dtype=np.int64),
                         "tid": rt["tid"].to_numpy()[hp], "name": rt["name"].to_numpy(dtype=object)[hp],
                         "t": rt_t[hp] - off_h, "dur": rt["dur"].to_numpy(dtype=np.float64)[hp]})
    is_launch = np.isin(host["rt"].to_numpy(), launching)
    is_block = rt_block[hp]
    host = host[is_launch | is_block].copy()
    host["launches"] = is_launch[is_launch | is_block]
    host["block_cand"] = is_block[is_launch | is_block]
    host = host.sort_values(["rank", "pos", "tid", "t"], kind="stable").reset_index(drop=True)
    H = len(host)
    h_rank = host["rank"].to_numpy().astype(np.int64)
    h_pos = host["pos"].to_numpy().astype(np.int64)
    h_tid = host["tid"].to_numpy().astype(np.int64)
    h_t = host["t"].to_numpy(dtype=np.float64)
    h_dur = host["dur"].to_numpy(dtype=np.float64)
    h_end = h_t + h_dur
    hsame = np.zeros(H, dtype=bool)
    if H:
        hsame[1:] = (h_rank[1:] == h_rank[:-1]) & (h_pos[1:] == h_pos[:-1]) & (h_tid[1:] == h_tid[:-1])
    h_prev = np.where(hsame, np.arange(H) - 1, -1)
    h_gap = np.where(h_prev >= 0, h_t - h_end[np.maximum(h_prev, 0)], 0.0)
    h_seq = host.groupby(["rank", "pos", "tid"]).cumcount().to_numpy()

    # GPU op -> host call index
    rt_to_h = pd.Series(np.arange(H), index=host["rt"].to_numpy()) if H else pd.Series(dtype=np.int64)
    rt_to_h = rt_to_h[~rt_to_h.index.duplicated()]
    g_launch = np.where(rt_idx >= 0, rt_to_h.reindex(rt_idx).fillna(-1).to_numpy(), -1).astype(np.int64)
    # ops whose launch call lies outside the step window keep their measured start as the launch term
    no_launch = g_launch < 0

    # host time of the launching CPU op spent before the call (goes when the op is removed)
    h_op_in = np.zeros(H)
    if H and "op_idx" in km.columns:
        ops = ts.cpu_ops
        op_idx = km["op_idx"].to_numpy().astype(np.int64)
        has = (op_idx >= 0) & (g_launch >= 0)
        if has.any() and len(ops):
            op_ts = ops["ts"].to_numpy(dtype=np.float64)
            hi = g_launch[has]
            o_ts = op_ts[op_idx[has]] - off_k[has]
            prev_end = np.where(h_prev[hi] >= 0, h_end[np.maximum(h_prev[hi], 0)], -np.inf)
            h_op_in[hi] = np.clip(h_t[hi] - np.maximum(o_ts, prev_end), 0.0, None)

    # launch latency floor and back-to-back gap per rank
    h_t_pad = np.append(h_t, np.nan)  # index -1 reads NaN
    L = g_t - h_t_pad[g_launch]
    prev_end = np.where(g_prev >= 0, g_end[np.maximum(g_prev, 0)], g_anchor)
    S = g_t - prev_end
    graph = km["graph_replay"].to_numpy().astype(bool)
    g_lA = np.zeros(n)
    g_lS = np.zeros(n)
    for r in np.unique(g_rank):
        m = g_rank == r
        first_of_launch = m & (g_launch >= 0)
        if first_of_launch.any():
            # graph kernels: only the first of each replay measures a launch latency
            fl = first_of_launch.copy()
            gl = np.nonzero(first_of_launch & graph)[0]
            if len(gl):
                _, first_idx = np.unique(g_launch[gl], return_index=True)
                drop = np.setdiff1d(gl, gl[first_idx])
                fl[drop] = False
            lfloor = max(_percentile(L[fl], st.launch_floor_pct, 0.0), 0.0)
        else:
            lfloor = 0.0
        s_ok = m & np.isfinite(S) & (S >= 0)
        # back-to-back gap: the median measured gap of ops that started right after their predecessor
        tight = s_ok & (np.where(np.isfinite(L), L - lfloor, np.inf) > S)
        sfloor = max(_percentile(S[tight], 50, 0.0), 0.0)
        slack_a = np.where(np.isfinite(L), L - lfloor, np.inf)
        slack_s = np.where(np.isfinite(S), S - sfloor, np.inf)
        bind_a = m & (slack_a < slack_s)
        bind_s = m & ~bind_a
        g_lA[bind_a] = L[bind_a]
        g_lS[bind_a] = np.minimum(np.where(np.isfinite(S[bind_a]), S[bind_a], sfloor), sfloor)
        g_lS[bind_s] = np.where(np.isfinite(S[bind_s]), S[bind_s], 0.0)
        g_lA[bind_s] = np.minimum(np.where(np.isfinite(L[bind_s]), L[bind_s], lfloor), lfloor)
    g_lA[no_launch] = 0.0

    # cross-stream waits (ranks with several streams): an op that starts later than both its launch and its
    # stream allow, right when an op of another stream of the rank ended
    g_xprev = np.full(n, -1, dtype=np.int64)
    g_lX = np.zeros(n)
    explained = np.minimum(np.where(np.isfinite(L), L - g_lA, np.inf), np.where(np.isfinite(S), S - g_lS, np.inf))
    for r in np.unique(g_rank):
        m = np.nonzero(g_rank == r)[0]
        if len(np.unique(g_stream[m])) < 2:
            continue
        e_order = m[np.argsort(g_end[m], kind="stable")]
        ends = g_end[e_order]
        for i in m:
            if explained[i] <= XSTREAM_TOL_US:
                continue
            p = int(np.searchsorted(ends, g_t[i] + 1e-6, side="right")) - 1
            while p >= 0 and g_stream[e_order[p]] == g_stream[i]:
                p -= 1
            if p >= 0 and g_t[i] - ends[p] <= XSTREAM_TOL_US and pos[i] == pos[e_order[p]]:
                g_xprev[i] = e_order[p]
                g_lX[i] = g_t[i] - ends[p]

    # collectives: kernel end = the instance's last arrival + res
    g_inst = np.full(n, -1, dtype=np.int64)
    g_res = np.zeros(n)
    members: list[list[int]] = []
    keys: list[float] = []
    if coll is not None and coll.applicable and len(coll.instances):
        inst = coll.instances
        kpos = pd.Series(np.arange(n), index=g_kidx)
        gi = kpos.reindex(inst["kidx"].to_numpy()).to_numpy()
        ok = ~np.isnan(gi)
        inst_ok = inst[ok].assign(g=gi[ok].astype(np.int64))
        sizes = inst.groupby("instance").size()
        for iid, grp in inst_ok.groupby("instance", sort=True):
            gs = grp["g"].to_numpy()
            if len(gs) != sizes.get(iid, 0):
                continue  # an instance member outside the replayed steps
            j = len(members)
            members.append(gs.tolist())
            last = float(g_t[gs].max())
            g_inst[gs] = j
            g_res[gs] = g_end[gs] - last
            keys.append(last)
    model = Model(
        ranks=sorted({int(r) for r in sel["rank"]}), pos=keep_pos,
        step_rows=sel[["rank", "pos", "span_us", "busy_us"]].assign(step=sel.index.to_numpy()).reset_index(drop=True),
        g_kidx=g_kidx, g_rank=g_rank, g_pos=pos.astype(np.int64), g_stream=g_stream, g_t=g_t, g_dur=g_dur,
        g_launch=g_launch, g_launch_const=np.where(no_launch, g_t, -np.inf), g_prev=g_prev, g_anchor=g_anchor, g_xprev=g_xprev, g_lA=g_lA, g_lS=g_lS, g_lX=g_lX,
        g_inst=g_inst, g_res=g_res, g_cls=g_cls,
        h_rank=h_rank, h_pos=h_pos, h_tid=h_tid, h_seq=h_seq, h_name=host["name"].to_numpy(dtype=object),
        h_t=h_t, h_dur=h_dur, h_end=h_end, h_prev=h_prev, h_gap=h_gap,
        h_block=np.zeros(H, dtype=bool), h_wait=np.full(H, -1, dtype=np.int64), h_r=np.zeros(H),
        h_launches=host["launches"].to_numpy().astype(bool), h_op_in=h_op_in,
        i_members=members, i_key=np.array(keys), notes=notes, steps_available=n_steps,
    )
    _blocking(model, host["block_cand"].to_numpy().astype(bool), st)
    return model


def _blocking(m: Model, cand: np.ndarray, st: Settings) -> None:
    """Which candidate calls waited for the GPU in the trace, and for which op."""
    if not cand.any() or not m.n_ops:
        return
    g_end = m.g_t + m.g_dur
    launch_t = np.where(m.g_launch >= 0, m.h_t[np.maximum(m.g_launch, 0)], m.g_t)
    # the ops and the candidate calls of each (rank, step position), in index order: one sort each
    g_key = np.where((m.g_pos >= 0) & (m.g_pos < 1_000_000), m.g_rank.astype(np.int64) * 1_000_000 + m.g_pos, -1)
    g_order = np.argsort(g_key, kind="stable")
    g_sorted = g_key[g_order]
    h_key = m.h_rank.astype(np.int64) * 1_000_000 + m.h_pos
    hc = np.nonzero(cand)[0]
    hc = hc[np.argsort(h_key[hc], kind="stable")]
    hc_sorted = h_key[hc]
    for key in np.unique(h_key[cand]).tolist():
        ops = g_order[np.searchsorted(g_sorted, key, "left"):np.searchsorted(g_sorted, key, "right")]
        if not len(ops):
            continue
        o = ops[np.argsort(launch_t[ops], kind="stable")]
        lt = launch_t[o]
        run_end = np.maximum.accumulate(g_end[o])
        run_arg = o[_argmax_accumulate(g_end[o])]
        for h in hc[np.searchsorted(hc_sorted, key, "left"):np.searchsorted(hc_sorted, key, "right")]:
            q = int(np.searchsorted(lt, m.h_t[h], side="right")) - 1
            if q < 0:
                continue
            w_end = run_end[q]
            if w_end > m.h_t[h] and -1e-3 <= m.h_end[h] - w_end <= st.block_tol_us:
                m.h_block[h] = True
                m.h_wait[h] = run_arg[q]
                m.h_r[h] = m.h_end[h] - w_end


def _argmax_accumulate(v: np.ndarray) -> np.ndarray:
    """Index of the running maximum of ``v`` at each position."""
    idx = np.arange(len(v))
    best = np.where(v == np.maximum.accumulate(v), idx, 0)
    return np.maximum.accumulate(best)


def describe(m: Model) -> dict[str, Any]:
    """Counts of what the model holds (for notes and tests)."""
    return {"ops": m.n_ops, "host_calls": len(m.h_t), "blocking_calls": int(m.h_block.sum()),
            "collective_instances": len(m.i_members), "cross_stream_waits": int((m.g_xprev >= 0).sum()),
            "steps": len(m.pos), "steps_available": m.steps_available}
