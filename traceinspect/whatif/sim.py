"""Discrete-event simulation of a :class:`~traceinspect.whatif.model.Model`.

Events are processed in the order of the measured times (every dependency of a quantity was measured
before it, so that order is a topological order of the dependency graph). A collective instance
resolves once every member has arrived. The binding constraint of each operation is recorded, so the
replay's critical path can be walked back from the step's end.

:func:`simulate` visits only the points where chains couple: host segments (runs of host calls
between blocking calls) are cumulative sums, and GPU segments (runs of operations on a stream between
collectives, cross-stream waits, waited-for operations and changes of host segment) are max-plus
scans, ``start_k = P_k + max(S0, B + M_k)`` with ``P`` the cumulative durations and gaps, ``B`` the
host segment's start and ``M`` the running maximum of launch offsets minus ``P``. Only each segment's
entry ``S0`` needs the event loop; every start and end then follows in a few array operations.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pandas as pd

from traceinspect.whatif.model import Model

# binding constraint of an op
BY_LAUNCH, BY_STREAM, BY_XSTREAM, BY_ANCHOR = 0, 1, 2, 3


class Params(msgspec.Struct):
    """The editable quantities of a replay (copies of the model's measured ones)."""

    dur: np.ndarray
    res: np.ndarray
    lA: np.ndarray
    lS: np.ndarray
    gap: np.ndarray
    hdur: np.ndarray
    block: np.ndarray
    r: np.ndarray
    hspeed: np.ndarray | None = None  # per host call: the host's speed factor (host-speed), 1 as measured


def measured_params(m: Model) -> Params:
    return Params(dur=m.g_dur.copy(), res=m.g_res.copy(), lA=m.g_lA.copy(), lS=m.g_lS.copy(),
                  gap=m.h_gap.copy(), hdur=m.h_dur.copy(), block=m.h_block.copy(), r=m.h_r.copy(),
                  hspeed=np.ones(len(m.h_t)))


class Run(msgspec.Struct):
    """Replayed times: op starts/ends, host call starts/ends, and what bound each op."""

    g_start: np.ndarray
    g_end: np.ndarray
    h_start: np.ndarray
    h_end: np.ndarray
    bind: np.ndarray  # BY_* per op
    last_rank_op: np.ndarray  # collective ops: the op of the rank that arrived last (else -1)
    h_waited: np.ndarray  # bool: the blocking call ended on its GPU work (not on its own start)
    order_conflicts: int = 0


def _seg_cumsum(incr: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Cumulative sum of ``incr`` restarting at 0 where ``first`` is set (segments are contiguous)."""
    c = np.cumsum(incr)
    start = np.maximum.accumulate(np.where(first, np.arange(len(incr)), 0))
    return c - c[start] if len(c) else c


def simulate(m: Model, p: Params) -> Run:
    """Replay the model with parameters ``p`` (see the module docstring)."""
    H, G = len(m.h_t), m.n_ops
    ninf = -np.inf
    # ---------------------------------------------------------------- host segments
    blk = p.block
    hprev = m.h_prev
    hfirst = (hprev < 0) | blk[np.maximum(hprev, 0)] if H else np.zeros(0, dtype=bool)
    hseg = np.cumsum(hfirst) - 1
    incr = np.zeros(H)
    nf = ~hfirst
    incr[nf] = p.hdur[hprev[nf]] + p.gap[nf]
    off = _seg_cumsum(incr, hfirst)
    nH = int(hseg[-1]) + 1 if H else 0
    base = np.full(nH, np.nan)
    heads = np.nonzero(hfirst)[0]
    chain_head = heads[hprev[heads] < 0]
    base[hseg[chain_head]] = m.h_t[chain_head]
    # ---------------------------------------------------------------- GPU segments
    L = m.g_launch
    has = L >= 0
    gh = np.where(has, hseg[np.maximum(L, 0)] if H else -1, -1)
    c = np.where(has, (off[np.maximum(L, 0)] if H else 0.0) + p.lA, m.g_launch_const)
    gprev = m.g_prev
    inst = m.g_inst
    terminal = np.zeros(G, dtype=bool)
    wait_ops = m.h_wait[blk & (m.h_wait >= 0)]
    terminal[wait_ops] = True
    terminal[m.g_xprev[m.g_xprev >= 0]] = True
    terminal |= inst >= 0
    pv = np.maximum(gprev, 0)
    gfirst = (gprev < 0) | (inst >= 0) | (m.g_xprev >= 0)
    gfirst |= terminal[pv] & (gprev >= 0)
    gfirst |= (gh != gh[pv]) & (gprev >= 0)
    gseg = np.cumsum(gfirst) - 1
    nG = int(gseg[-1]) + 1 if G else 0
    w = np.zeros(G)
    ng = ~gfirst
    w[ng] = p.dur[gprev[ng]] + p.lS[ng]
    P = _seg_cumsum(w, gfirst)
    v = np.where(gfirst, ninf, c - P)
    M = pd.Series(v).groupby(gseg).cummax().to_numpy() if G else v
    heads_g = np.nonzero(gfirst)[0]
    last_g = np.r_[heads_g[1:] - 1, G - 1] if G else heads_g
    # ---------------------------------------------------------------- coupling events
    S0 = np.full(nG, np.nan)
    Bs = np.full(nG, np.nan)
    how = np.full(nG, BY_ANCHOR, dtype=np.int8)
    blocks = np.nonzero(blk)[0]
    nI = len(m.i_members)
    key = np.concatenate([m.g_t[heads_g], m.h_end[blocks], m.i_key + 1e-6])
    typ = np.concatenate([np.zeros(len(heads_g), dtype=np.int8), np.ones(len(blocks), dtype=np.int8),
                          np.full(nI, 2, dtype=np.int8)])
    idx = np.concatenate([np.arange(len(heads_g)), blocks, np.arange(nI)])
    order = np.lexsort((typ, key))
    # scalar views for the loop: per segment head / last op, and the ends of terminal ops by index
    hd = heads_g
    lt = last_g
    h_c, h_gh, h_prev = c[hd].tolist(), gh[hd].tolist(), gprev[hd].tolist()
    h_lS, h_anchor = p.lS[hd].tolist(), m.g_anchor[hd].tolist()
    h_x, h_lX = m.g_xprev[hd].tolist(), m.g_lX[hd].tolist()
    h_t0, pinf = m.g_t[hd].tolist(), np.inf
    l_op, l_P, l_M, l_dur = lt.tolist(), P[lt].tolist(), M[lt].tolist(), p.dur[lt].tolist()
    l_coll = (inst[lt] >= 0).tolist()
    op_inst = {int(q): int(inst[q]) for q in np.nonzero(inst >= 0)[0]}
    base_l = base.tolist()
    ge_d: dict[int, float] = {}
    S0_l, B_l, how_l = S0.tolist(), Bs.tolist(), how.tolist()
    last_op_l: dict[int, int] = {}
    he_d: dict[int, float] = {}
    waited = np.zeros(H, dtype=bool)
    members = m.i_members
    mem_seg = [[int(gseg[q]) for q in mem] for mem in members]
    res = p.res
    done = [False] * nI
    conflicts = 0
    gt = m.g_t
    hseg_a, off_a, r_a, gap_a, hprev_a, hwait_a = hseg, off, p.r, p.gap, hprev, m.h_wait

    def resolve(j: int) -> None:
        nonlocal conflicts
        best, arg = ninf, -1
        for q, sg in zip(members[j], mem_seg[j], strict=True):
            s = S0_l[sg]
            if s != s:
                conflicts += 1
                s = float(gt[q])
            if s > best:
                best, arg = s, q
        for q in members[j]:
            ge_d[q] = best + float(res[q])
            last_op_l[q] = arg
        done[j] = True

    for t, i in zip(typ[order].tolist(), idx[order].tolist(), strict=True):
        if t == 0:  # a GPU segment: its entry, and its last op's end
            hs_ = h_gh[i]
            B = base_l[hs_] if hs_ >= 0 else 0.0
            if B != B:
                conflicts += 1
                B = ninf
            a = B + h_c[i]
            q = h_prev[i]
            if q >= 0:
                e = ge_d.get(q, ninf)
                if e == ninf:
                    j = op_inst.get(q, -1)
                    if j >= 0 and not done[j]:
                        resolve(j)
                        e = ge_d[q]
                    else:
                        conflicts += 1
                b = e + h_lS[i]
            else:
                b = h_anchor[i] + h_lS[i]
            if a >= b:
                s0, hw = a, BY_LAUNCH
            else:
                s0, hw = b, (BY_STREAM if q >= 0 else BY_ANCHOR)
            x = h_x[i]
            if x >= 0:
                xe = ge_d.get(x)
                if xe is not None and xe + h_lX[i] > s0:
                    s0, hw = xe + h_lX[i], BY_XSTREAM
            if not ninf < s0 < pinf:  # as in simulate_events: the op's measured start
                conflicts += 1
                s0, hw = h_t0[i], BY_ANCHOR
            S0_l[i], B_l[i], how_l[i] = s0, B, hw
            if not l_coll[i]:
                mk = l_M[i]
                ge_d[l_op[i]] = l_P[i] + (s0 if s0 >= B + mk else B + mk) + l_dur[i]
        elif t == 1:  # a blocking call ends after the GPU work it waits for
            hs_i = base_l[int(hseg_a[i])] + float(off_a[i])
            wend = ge_d.get(int(hwait_a[i]))
            if wend is None:
                conflicts += 1
                wend = ninf
            if wend >= hs_i:
                he = wend + float(r_a[i])
                waited[i] = True
            else:
                he = hs_i + float(r_a[i])
            he_d[i] = he
            n = i + 1
            if n < H and hprev_a[n] == i:
                base_l[int(hseg_a[n])] = he + float(gap_a[n])
        else:
            if not done[i]:
                resolve(i)
    S0 = np.array(S0_l)
    Bs = np.array(B_l)
    base = np.array(base_l)
    # ---------------------------------------------------------------- every start and end
    sB = Bs[gseg] + M
    g_start = P + np.maximum(S0[gseg], sB)
    g_end = g_start + p.dur
    for q in op_inst:
        g_end[q] = ge_d.get(q, np.nan)
    bind = np.where(gfirst, np.array(how_l, dtype=np.int8)[gseg], BY_STREAM).astype(np.int8)
    launch_won = ~gfirst & (Bs[gseg] + c >= g_start - 0.01)  # ties within rounding: the launch
    bind[launch_won] = BY_LAUNCH
    h_start = base[hseg] + off if H else np.zeros(0)
    h_end = h_start + p.hdur
    for q, v in he_d.items():
        h_end[q] = v
    last_rank = np.full(G, -1, dtype=np.int64)
    for q, v in last_op_l.items():
        last_rank[q] = v
    return Run(g_start=g_start, g_end=g_end, h_start=h_start, h_end=h_end, bind=bind,
               last_rank_op=last_rank, h_waited=waited, order_conflicts=conflicts)
