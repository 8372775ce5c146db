"""KV-cache evidence: dtype casts that read the KV pool become ``kv_cast``, scatters into it ``kv_write``,
casts to 8/4-bit floats before a quantized GEMM ``quantize``."""

from __future__ import annotations

import functools
import re
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import pandas as pd

from traceinspect.classify.graphs import CAPTURED_NOTE, captured_ops
from traceinspect.classify.runfacts import decide as decide_run
from traceinspect.classify.table import ATTENTION_OP, ClassTable, Promotion, default_table
from traceinspect.model import TraceSet
from traceinspect.model.run import RunModel
from traceinspect.model.shapes import OpInputs, decode_json, op_tensors
from traceinspect.tables import (
    factorize_text,
    groups,
    in_key_order,
    per_combination,
    per_distinct,
    set_object_column,
    text_isin,
)

if TYPE_CHECKING:
    from traceinspect.classify.graphs import GraphOps


# --- KV-cache evidence --------------------------------------------------------------------------

_NAME_DST = [  # (regex over a cast kernel's name, torch dtype it writes)
    (re.compile(r"float8_copy_kernel|to_fp8|fp8_copy"), "Float8"),
    (re.compile(r"bfloat16tofloat32|float16tofloat32"), "float"),
    (re.compile(r"bfloat16_copy_kernel"), "BFloat16"),
    (re.compile(r"float16_copy_kernel"), "Half"),
    (re.compile(r"direct_copy_kernel_cuda.*?lambda\((?:c10::)?(\w+)\)"), None),
]


@functools.lru_cache(maxsize=4096)
def _cast_destination(name: str) -> str | None:
    """The dtype a PyTorch cast kernel writes, read from its name (None if unknown)."""
    for pat, dst in _NAME_DST:
        m = pat.search(name)
        if m:
            return dst if dst is not None else m.group(1)
    return None


class _KvContext(msgspec.Struct):
    """What the trace says about the KV cache and the layer structure."""

    pool: int | None
    page: int
    kv_dtype: str | None
    layers: int | None
    layers_src: str
    included: np.ndarray  # per kernel row: in an included step
    pool_src: str = ""  # where the pool size came from
    steps_per_rank: dict[int, int] = msgspec.field(default_factory=dict)  # included steps per rank

    def pool_rows(self, rows: int) -> bool:
        return self.pool is not None and self.pool <= rows <= self.pool + 2 * max(self.page, 1)


def _context(ts: TraceSet, steps: pd.DataFrame, run: RunModel) -> _KvContext:
    k = ts.kernels
    step = k["step"].to_numpy() if "step" in k else np.full(len(k), -1)
    n_steps = len(steps) if steps is not None else 0
    inc_steps = (steps["included"].to_numpy(dtype=bool) if n_steps and "included" in steps
                 else np.ones(n_steps, dtype=bool))
    if n_steps and not inc_steps.any():
        inc_steps = np.ones(n_steps, dtype=bool)
    ok = (step >= 0) & (step < n_steps)
    included = np.zeros(len(k), dtype=bool)
    included[ok] = inc_steps[step[ok]]
    per_rank: dict[int, int] = {}
    if n_steps and "rank" in steps:
        per_rank = {int(r): int(c) for r, c in steps[inc_steps].groupby("rank").size().items()}
    return _KvContext(pool=run.value("kv_pool_tokens"), page=run.value("page_size") or 1,
                      kv_dtype=run.kv_torch_dtype, layers=run.value("layers"), layers_src=run.describe("layers"),
                      included=included, steps_per_rank=per_rank, pool_src=run.describe("kv_pool_tokens"))


def _recurrence(k: pd.DataFrame, rows: np.ndarray, ctx: _KvContext) -> dict[tuple[int, str], str]:
    """(rank, name) of candidate rows that recur exactly once per layer in most included steps (never
    more), with at least one other kernel between consecutive occurrences; value: evidence text."""
    out: dict[tuple[int, str], str] = {}
    if ctx.layers is None or not len(rows):
        return out
    sel = rows[ctx.included[rows]]
    if not len(sel):
        return out
    rank, name = k["rank"].to_numpy()[sel], k["name"].to_numpy(dtype=object)[sel]
    step = k["step"].to_numpy()[sel]
    pair, first = groups(pd.factorize(rank)[0], factorize_text(name)[0])
    in_step, at = groups(pair, pd.factorize(step)[0])  # the rows of each (rank, name, step)
    calls = np.bincount(in_step)
    step_pair = pair[at]
    exact = np.bincount(step_pair, weights=calls == ctx.layers, minlength=len(first)).astype(np.int64)
    over = np.bincount(step_pair, weights=calls > ctx.layers, minlength=len(first)) > 0
    adjacent = _adjacent(k, sel, pair, step)
    for p, i in enumerate(first.tolist()):
        n_steps = ctx.steps_per_rank.get(int(rank[i]), 0)
        if n_steps == 0 or exact[p] * 2 < n_steps or over[p] or p in adjacent:
            continue
        out[(rank[i], name[i])] = (f"{ctx.layers} per step in {exact[p]}/{n_steps} included steps = once per "
                                   f"layer, with other kernels between (layers: {ctx.layers_src})")
    return out


def _rank_time_order(rank: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Row order by (rank, start time), equal keys in row order: ``np.lexsort((ts, rank))``, skipped
    when the rows are already in that order."""
    return np.arange(len(rank)) if in_key_order(rank, ts) else np.lexsort((ts, rank))


def _adjacent(k: pd.DataFrame, rows: np.ndarray, pair: np.ndarray, step: np.ndarray) -> set[int]:
    """The ``pair`` codes of ``rows`` (of ``k``) with two occurrences in one step and no other kernel of
    the rank between them on its GPU timeline (ordered by start time)."""
    rank, ts = k["rank"].to_numpy(), k["ts"].to_numpy()
    if in_key_order(rank, ts):
        p = rows
    else:
        pos = np.empty(len(k), dtype=np.int64)
        pos[np.lexsort((ts, rank))] = np.arange(len(k))  # rank boundaries never make two positions adjacent
        p = pos[rows]
    o = np.lexsort((p, step, pair))
    c, st, pp = pair[o], step[o], p[o]
    same = (c[1:] == c[:-1]) & (st[1:] == st[:-1])
    return set(np.unique(c[1:][same & (np.diff(pp) < 2)]).tolist())


def promote_kv(ts: TraceSet, steps: pd.DataFrame, table: ClassTable | None = None,
               graph_ops: GraphOps | None = None, run: RunModel | None = None) -> None:
    """Promote dtype casts that read KV-cache data to ``kv_cast``, scatters into the KV pool to
    ``kv_write``, and casts to 8/4-bit floats to their consumer's class (needs the ``cls`` columns;
    the reason goes to ``cls_evidence``). A graph-replayed kernel whose op ``graph_ops`` recovered
    from the capture trace is judged on that op's recorded shapes, as an eager kernel is; other
    kernels without shapes by their recurrence. A copy that keeps the dtype is never ``kv_cast``."""
    table = table or default_table()
    k = ts.kernels
    if not len(k) or "cls" not in k or not table.promote:
        return
    run = run if run is not None else decide_run(ts, steps, graph_ops)
    ctx = _context(ts, steps, run)
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    eager = OpInputs(ts.cpu_ops) if len(ts.cpu_ops) else None
    captured, cap_op, cap_inputs = captured_ops(k, graph_ops)
    cls = k["cls"].to_numpy(dtype=object).copy()
    ev = k["cls_evidence"].to_numpy(dtype=object).copy()
    names = k["name"].to_numpy(dtype=object)
    ranks = k["rank"].to_numpy()
    is_kernel = (k["kind"] == "kernel").to_numpy() if "kind" in k else np.ones(len(k), dtype=bool)
    pool_shapes: dict[int, set[tuple[int, ...]]] = {}
    for target in ("kv_cast", "kv_write"):
        promo = table.promote.get(target)
        if promo is None:
            continue
        cand = text_isin(cls, promo.sources) & is_kernel
        if promo.name is not None and cand.any():
            at = np.nonzero(cand)[0]  # the name test only where the class test passed
            cand[at] = per_distinct(names[at], promo.name.search)
        if target == "kv_cast" and cand.any():
            at = np.nonzero(cand)[0]
            cand[at] = ~per_distinct(names[at], _NOCAST.search)
        rows = np.nonzero(cand)[0]
        if not len(rows):
            continue
        reason = _candidate_evidence(rows, target, _recurrence(k, rows, ctx), ctx, eager, captured, cap_op,
                                     cap_inputs, op_idx, names, ranks, pool_shapes)
        hit = np.array([x is not None for x in reason.tolist()], dtype=bool)
        at, why = rows[hit], reason[hit]
        if len(at):
            ev[at] = per_combination(lambda w, c, e, t=target: f"{t}: {w}; was {c} by {e}", why, cls[at], ev[at])
            cls[at] = target
    consumer = table.promote.get("consumer")
    if consumer is not None:
        _promote_consumers(k, consumer, ctx, eager, cls, ev, is_kernel)
    set_object_column(k, "cls", cls)
    set_object_column(k, "cls_evidence", ev)


_NOCAST = re.compile(r"_nocast<")  # PyTorch's same-dtype elementwise path: no dtype change


def _candidate_evidence(rows: np.ndarray, target: str, recur: dict[tuple[int, str], str], ctx: _KvContext,
                        eager: OpInputs | None, captured: np.ndarray, cap_op: np.ndarray,
                        cap_inputs: dict[int, OpInputs], op_idx: np.ndarray, names: np.ndarray,
                        ranks: np.ndarray, pool_shapes: dict[int, set[tuple[int, ...]]]) -> np.ndarray:
    """Per candidate row of ``target``, the evidence that it reads (kv_cast) or writes (kv_write) the KV
    pool, else None: from the recorded shapes of its op (a graph replay: of the op recovered from the
    capture trace), else from its recurrence. Ops that recorded the same chain of names and shapes get
    the same answer, and so do kernels without shapes of one (rank, name): each judged once."""
    n = len(rows)
    rank = ranks[rows]
    use_cap = captured[rows] & (cap_op[rows] >= 0)
    src = np.where(use_cap, rank, -1).astype(np.int64)
    o = np.where(use_cap, cap_op[rows], op_idx[rows]).astype(np.int64)

    def inputs_of(s: int) -> OpInputs | None:
        return eager if s < 0 else cap_inputs.get(s)

    # the recurrence text of each row's (rank, name)
    pair, first = groups(pd.factorize(rank)[0], factorize_text(names[rows])[0])
    rec = np.empty(len(first), dtype=object)
    rec[:] = [recur.get((rank[i], names[rows[i]])) for i in first.tolist()]
    rec_code = factorize_text(rec)[0][pair]
    rec = rec[pair]
    # the recorded chain of each row's op, where there is one
    sig = np.full(n, -1, dtype=np.int64)
    for s in np.unique(src).tolist():
        inputs = inputs_of(s)
        at = np.nonzero((src == s) & (o >= 0))[0]
        if inputs is not None and len(at):
            sig[at] = inputs.signature_codes(o[at])
    src_code = pd.factorize(src)[0]
    shapes = np.zeros(n, dtype=bool)
    at = np.nonzero(sig >= 0)[0]
    if len(at):
        g, first = groups(src_code[at], sig[at])
        has = np.array([inputs_of(int(src[i])).has_shapes(int(o[i])) for i in at[first].tolist()], dtype=bool)
        shapes[at] = has[g]
    reason = np.full(n, None, dtype=object)
    attn_cache: dict[tuple[int, int], bool] = {}
    at = np.nonzero(shapes)[0]
    if len(at):
        g, first = groups(src_code[at], sig[at], rec_code[at])
        per = np.empty(len(first), dtype=object)
        for n_, i in enumerate(at[first].tolist()):
            s = int(src[i])
            why = _shape_evidence(inputs_of(s), int(o[i]), s, ctx, target, rec[i], attn_cache, pool_shapes)
            per[n_] = None if why is None else (f"graph replay, {CAPTURED_NOTE}: " if s >= 0 else "") + why
        reason[at] = per[g]
    at = np.nonzero(~shapes)[0]
    if len(at):
        graph, cap = op_idx[rows[at]] < 0, captured[rows[at]]
        g, first = groups(pair[at], graph, cap)
        per = np.empty(len(first), dtype=object)
        per[:] = [_recurrence_evidence(names[rows[i]], rec[i], bool(graph[j]), target, ctx, captured=bool(cap[j]))
                  for i, j in zip(at[first].tolist(), first.tolist(), strict=True)]
        reason[at] = per[g]
    return reason


def _shape_evidence(inputs: OpInputs, o: int, src: int, ctx: _KvContext, target: str, rec: str | None,
                    attn_cache: dict[tuple[int, int], bool], pool_shapes: dict[int, set[tuple[int, ...]]]
                    ) -> str | None:
    """Evidence from recorded shapes (eager, or the capture trace's ``src`` rank; -1: eager) that a
    candidate reads (kv_cast) or writes (kv_write) the KV pool."""
    if target == "kv_cast" and _keeps_dtype(inputs, o):
        return None
    reason = _pool_evidence(inputs, o, ctx, target)
    if reason is not None or rec is None or target != "kv_cast":
        return reason
    if (src, o) not in attn_cache:
        attn_cache[(src, o)] = any(ATTENTION_OP.search(str(inputs.names[j])) for j in inputs.chain(o, 8))
    if attn_cache[(src, o)]:
        return f"op inside attention, {rec}"
    if src not in pool_shapes:
        pool_shapes[src] = _pool_row_shapes(inputs.ops, ctx)
    return _kv_rows_evidence(inputs, o, ctx, pool_shapes[src], rec)


def _keeps_dtype(inputs: OpInputs, o: int) -> bool:
    """The launching copy_ writes the dtype it reads (a same-dtype copy, not a cast)."""
    for j in inputs.chain(o, 2):
        if str(inputs.names[j]) in ("aten::copy_", "aten::copy"):
            t = {a: d for a, _, d in inputs.tensors(j)}
            return bool(0 in t and 1 in t and t[0] and t[0] == t[1])
    return False


_LOW_FLOAT = ("Float8", "Float4")


def _written_dtype(name: str, o: int, inputs: OpInputs | None) -> str | None:
    """The dtype a cast kernel writes: from its name, else from its copy_ op's destination."""
    dst = _cast_destination(name)
    if dst is None and inputs is not None and o >= 0:
        for j in inputs.chain(o, 2):
            if str(inputs.names[j]) in ("aten::copy_", "aten::copy"):
                t = [d for a, _, d in inputs.tensors(j) if a == 0]
                if t and t[0]:
                    return t[0]
    return dst


def _promote_consumers(k: pd.DataFrame, promo: Promotion, ctx: _KvContext, inputs: OpInputs | None,
                       cls: np.ndarray, ev: np.ndarray, is_kernel: np.ndarray) -> None:
    """A cast to an 8/4-bit float takes its consumer's purpose: when one of the next two kernels on
    its stream is of a class in ``promo.next`` (a quantized GEMM: quantize; a KV write of the KV
    dtype: kv_write)."""
    names = k["name"].to_numpy(dtype=object)
    cand = text_isin(cls, promo.sources) & is_kernel
    if promo.name is not None and cand.any():
        at = np.nonzero(cand)[0]
        cand[at] = per_distinct(names[at], promo.name.search)
    if not cand.any():
        return
    idx = np.nonzero(is_kernel)[0]
    stream = k["stream"].to_numpy()[idx] if "stream" in k else np.zeros(len(idx), dtype=np.int64)
    rank = k["rank"].to_numpy()[idx]
    # by (rank, stream, ts): a stable sort by (rank, stream) of the rows in (rank, ts) order
    by_time = _rank_time_order(rank, k["ts"].to_numpy()[idx])
    s_codes = pd.factorize(stream[by_time], sort=True)[0]
    key = rank[by_time].astype(np.int64) * (int(s_codes.max(initial=0)) + 1) + s_codes
    if len(key) and key.min() >= 0 and key.max() < 1 << 15:
        key = key.astype(np.int16)  # numpy sorts 16-bit integers stably by radix, in linear time
    lane = by_time[np.argsort(key, kind="stable")]
    order = idx[lane]
    rank_s, stream_s = rank[lane], stream[lane]
    where = np.full(len(k), -1, dtype=np.int64)
    where[order] = np.arange(len(order))
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    rows = np.nonzero(cand)[0]
    # the next two kernels of each candidate's lane (-1 past its end): lanes are runs of ``order``
    pos = where[rows]
    after = []
    for step in (1, 2):
        j = np.minimum(pos + step, len(order) - 1)
        same = (pos + step < len(order)) & (rank_s[j] == rank_s[pos]) & (stream_s[j] == stream_s[pos])
        after.append(np.where(same, order[j], -1))
    n1, n2 = after
    # rows are judged in row order: one whose next kernels hold a candidate judged before it reads that
    # candidate's new class, so then row by row
    earlier = np.zeros(len(rows), dtype=bool)
    for nxt in (n1, n2):
        earlier |= (nxt >= 0) & cand[np.maximum(nxt, 0)] & (nxt < rows)
    if earlier.any():
        for i in range(len(rows)):
            _consume(rows[i:i + 1], n1[i:i + 1], n2[i:i + 1], promo, ctx, inputs, names, op_idx, cls, ev)
    else:
        _consume(rows, n1, n2, promo, ctx, inputs, names, op_idx, cls, ev)


def _consume(rows: np.ndarray, n1: np.ndarray, n2: np.ndarray, promo: Promotion, ctx: _KvContext,
             inputs: OpInputs | None, names: np.ndarray, op_idx: np.ndarray, cls: np.ndarray,
             ev: np.ndarray) -> None:
    """Promote (in place) the casts ``rows`` whose next kernel ``n1`` or, when that one's class is not in
    ``promo.next``, second-next ``n2`` (-1: none in the lane) is of a class in ``promo.next``, if they
    write an 8/4-bit float (for a KV write: the KV dtype)."""
    def target_of(nxt: np.ndarray) -> np.ndarray:
        out = np.full(len(nxt), None, dtype=object)
        ok = nxt >= 0
        if ok.any():
            codes, uniq = factorize_text(cls[nxt[ok]])
            out[ok] = np.fromiter((promo.next.get(u) for u in uniq.tolist()), dtype=object, count=len(uniq))[codes]
        return out

    t1 = target_of(n1)
    t2 = target_of(np.where(n1 >= 0, n2, -1))
    first = np.array([t is not None for t in t1.tolist()], dtype=bool)
    nxt, target = np.where(first, n1, n2), np.where(first, t1, t2)
    at = np.flatnonzero([t is not None for t in target.tolist()])
    if not len(at):
        return
    r, nxt, target = rows[at], nxt[at], target[at]
    dst = per_combination(_cast_destination, names[r])
    for i in np.flatnonzero([d is None for d in dst.tolist()]).tolist():  # not in the name: the copy_ op's
        dst[i] = _written_dtype(names[r[i]], int(op_idx[r[i]]), inputs)
    kv = ctx.kv_dtype
    ok = np.array([d is not None and d.startswith(_LOW_FLOAT) and not (t == "kv_write" and kv is not None
                                                                        and not kv.startswith(d))
                   for d, t in zip(dst.tolist(), target.tolist(), strict=True)], dtype=bool)
    r, nxt, target, dst = r[ok], nxt[ok], target[ok], dst[ok]
    if not len(r):
        return
    ev[r] = per_combination(lambda t, d, c, nm, was, old: f"{t}: casts to {d} right before {c} kernel "
                            f"{str(nm)[:60]!r}; was {was} by {old}", target, dst, cls[nxt], names[nxt], cls[r], ev[r])
    cls[r] = target


def _recurrence_evidence(name: str, rec: str | None, graph: bool, target: str, ctx: _KvContext,
                         captured: bool = False) -> str | None:
    """Evidence for a kernel without recorded shapes: once per layer per step, and (for casts) not
    a cast into the KV dtype (that is the write side). ``captured``: a graph replay whose op was
    recovered from the capture trace without recorded shapes."""
    if rec is None:
        return None
    if target == "kv_cast":
        dst = _cast_destination(name)
        if dst is not None and ctx.kv_dtype is not None and ctx.kv_dtype.startswith(dst):
            return None
    how = (f"graph replay ({CAPTURED_NOTE}, without recorded shapes)" if captured else
           "graph replay, no CPU op" if graph else "no recorded shapes")
    return f"{how}: same kernel {rec}"


def _pool_evidence(inputs: OpInputs, o: int, ctx: _KvContext, target: str) -> str | None:
    if ctx.pool is None:
        return None
    hits: list[tuple[int, list[int], str]] = []
    for j in inputs.chain(o):
        tensors = inputs.written(j) if target == "kv_write" else inputs.read(j)
        hits += [(j, shape, dtype) for shape, dtype in tensors if len(shape) >= 2 and ctx.pool_rows(shape[0])]
    if not hits:
        return None
    # report the KV-dtype tensor (the cast's source) when there is one
    j, shape, dtype = next((h for h in hits if h[2] == ctx.kv_dtype), hits[0])
    pad = shape[0] - (ctx.pool or 0)
    return (f"{inputs.names[j]} input {shape} {dtype or '?'}: {shape[0]} rows = KV pool of {ctx.pool} tokens"
            f"{f' + {pad} padding' if pad else ''} ({ctx.pool_src})")


def _pool_row_shapes(ops: pd.DataFrame, ctx: _KvContext) -> set[tuple[int, ...]]:
    """Trailing dims of tensors with the KV pool's row count anywhere in the recorded shapes."""
    out: set[tuple[int, ...]] = set()
    if ctx.pool is None or "input_dims" not in ops:
        return out
    probes = [f"[{ctx.pool + d},".encode() for d in range(0, 2 * max(ctx.page, 1) + 1)]
    for raw in ops["input_dims"].to_numpy(dtype=object):
        if raw is None:
            continue
        b = raw if isinstance(raw, bytes | bytearray) else str(raw).encode()
        if not any(p in b for p in probes):
            continue
        for _, shape, _ in op_tensors(decode_json(b), None):
            if len(shape) >= 2 and ctx.pool_rows(shape[0]):
                out.add(tuple(shape[1:]))
    return out


def _kv_rows_evidence(inputs: OpInputs, o: int, ctx: _KvContext, pool_shapes: set[tuple[int, ...]],
                      rec: str) -> str | None:
    if ctx.kv_dtype is None or not pool_shapes:
        return None
    for j in inputs.chain(o):
        for shape, dtype in inputs.read(j):
            if dtype == ctx.kv_dtype and len(shape) >= 2 and tuple(shape[1:]) in pool_shapes:
                return (f"{inputs.names[j]} reads {shape} {dtype} = KV-dtype rows of the pool's row shape, "
                        f"{rec}")
    return None
