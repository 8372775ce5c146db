"""The reference the segment-wise replay (:func:`traceinspect.whatif.sim.simulate`) is checked against: the
plain loop of one event per host call and GPU operation, in the order of the measured times."""

from __future__ import annotations

import numpy as np

from traceinspect.whatif.model import Model
from traceinspect.whatif.sim import BY_ANCHOR, BY_LAUNCH, BY_STREAM, BY_XSTREAM, Params, Run

# event types, in tie order at equal times
_HOST, _OP, _BLOCK_END, _INST = 0, 1, 2, 3


def event_order(m: Model) -> tuple[list[int], list[int]]:
    """(types, indices) of all events sorted by measured time (ties: host, op, block end, instance)."""
    H, G, nI = len(m.h_t), m.n_ops, len(m.i_members)
    blk = np.nonzero(m.h_block)[0]
    key = np.concatenate([m.h_t, m.g_t, m.h_end[blk], m.i_key + 1e-6])
    typ = np.concatenate([np.full(H, _HOST), np.full(G, _OP), np.full(len(blk), _BLOCK_END), np.full(nI, _INST)])
    idx = np.concatenate([np.arange(H), np.arange(G), blk, np.arange(nI)])
    o = np.lexsort((typ, key))
    return typ[o].tolist(), idx[o].tolist()


def simulate_events(m: Model, p: Params) -> Run:
    """Replay the model with parameters ``p`` one event per host call and GPU operation."""
    types, idxs = event_order(m)
    H, G = len(m.h_t), m.n_ops
    nan = float("nan")
    hs = [nan] * H
    he = [nan] * H
    gs = [nan] * G
    ge = [nan] * G
    bind = [BY_ANCHOR] * G
    last_op = [-1] * G
    waited = [False] * H
    h_prev = m.h_prev.tolist()
    h_t = m.h_t.tolist()
    gap, hdur, block, rr = p.gap.tolist(), p.hdur.tolist(), p.block.tolist(), p.r.tolist()
    h_wait = m.h_wait.tolist()
    g_launch, g_prev, g_x = m.g_launch.tolist(), m.g_prev.tolist(), m.g_xprev.tolist()
    g_const, g_anchor = m.g_launch_const.tolist(), m.g_anchor.tolist()
    lA, lS, lX = p.lA.tolist(), p.lS.tolist(), m.g_lX.tolist()
    dur, res = p.dur.tolist(), p.res.tolist()
    g_inst = m.g_inst.tolist()
    g_t = m.g_t.tolist()
    inf_ = float("inf")
    members = m.i_members
    conflicts = 0
    inst_done = [False] * len(members)
    ninf = -float("inf")

    def resolve(j: int) -> None:
        nonlocal conflicts
        mem = members[j]
        best, arg = ninf, -1
        for q in mem:
            s = gs[q]
            if s != s:  # an arrival not computed yet: measured order broke (clock noise)
                conflicts += 1
                s = float(m.g_t[q])
                gs[q] = s
            if s > best:
                best, arg = s, q
        for q in mem:
            ge[q] = best + res[q]
            last_op[q] = arg
        inst_done[j] = True

    def finish_block(i: int) -> None:
        nonlocal conflicts
        w = ge[h_wait[i]]
        if w != w:
            conflicts += 1
            w = ninf
        s = hs[i]
        if w >= s:
            he[i], waited[i] = w + rr[i], True
        else:
            he[i] = s + rr[i]

    for typ, i in zip(types, idxs, strict=True):
        if typ == _OP:
            L = g_launch[i]
            a = hs[L] + lA[i] if L >= 0 else g_const[i]
            pv = g_prev[i]
            if pv >= 0:
                pe = ge[pv]
                if pe != pe:
                    j = g_inst[pv]
                    if j >= 0 and not inst_done[j]:
                        resolve(j)
                        pe = ge[pv]
                    else:
                        conflicts += 1
                        pe = ninf
                b = pe + lS[i]
            else:
                b = g_anchor[i] + lS[i]
            if a >= b:
                s, how = a, BY_LAUNCH
            else:
                s, how = b, (BY_STREAM if pv >= 0 else BY_ANCHOR)
            x = g_x[i]
            if x >= 0:
                xe = ge[x]
                if xe == xe and xe + lX[i] > s:
                    s, how = xe + lX[i], BY_XSTREAM
            if not -inf_ < s < inf_:  # neither launch nor stream known yet (it was measured before its launch)
                conflicts += 1
                s, how = g_t[i], BY_ANCHOR
            gs[i] = s
            bind[i] = how
            if g_inst[i] < 0:
                ge[i] = s + dur[i]
        elif typ == _HOST:
            pv = h_prev[i]
            if pv >= 0 and he[pv] != he[pv] and block[pv]:
                finish_block(pv)  # a blocking call ending exactly when this one starts
            s = he[pv] + gap[i] if pv >= 0 else h_t[i]
            hs[i] = s
            if not block[i]:
                he[i] = s + hdur[i]
        elif typ == _BLOCK_END:
            if block[i] and he[i] != he[i]:
                finish_block(i)
        else:
            if not inst_done[i]:
                resolve(i)
    return Run(g_start=np.array(gs), g_end=np.array(ge), h_start=np.array(hs), h_end=np.array(he),
               bind=np.array(bind, dtype=np.int8), last_rank_op=np.array(last_op, dtype=np.int64),
               h_waited=np.array(waited, dtype=bool), order_conflicts=conflicts)
