"""MoE evidence: routing kernels checked against the expert count, plain GEMMs that run once per expert
marked ``moe_gemm``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.classify.graphs import captured_ops
from traceinspect.classify.runfacts import decide as decide_run
from traceinspect.classify.runfacts import op_names
from traceinspect.classify.table import ClassTable, default_table
from traceinspect.model import TraceSet
from traceinspect.model.run import RunModel
from traceinspect.model.shapes import OpInputs, ShapeCache
from traceinspect.tables import (
    factorize_text,
    groups,
    per_combination,
    set_object_column,
    text_isin,
    text_values,
    unique_text,
)

if TYPE_CHECKING:
    from traceinspect.classify.graphs import GraphOps


# --- routing labels that must work on the expert dimension ---------------------------------------

_RULE_ID = re.compile(r"^rule (\S+) \(")
_SOFTMAX_WARP = re.compile(r"softmax_warp_forward<[^,<>]+, [^,<>]+, [^,<>]+, (\d+),")
_SIZE_OPS = ("aten::_softmax", "aten::softmax", "aten::topk", "aten::_log_softmax", "aten::log_softmax")


def _routing_size(name: str, o: int, inputs: OpInputs | None) -> tuple[int | None, str]:
    """Elements per row a softmax / top-k works on: recorded shapes, else the kernel template."""
    if inputs is not None and o >= 0:
        for j in inputs.chain(o, 4):
            if str(inputs.names[j]) in _SIZE_OPS:
                t = inputs.tensors(j)
                if t:
                    return t[0][1][-1], f"{inputs.names[j]} input {t[0][1]}"
    m = _SOFTMAX_WARP.search(name)
    if m:
        n = 1 << int(m.group(1))
        return n, f"softmax_warp_forward log2_elements={m.group(1)} (rows of <= {n})"
    return None, ""


_MOE_OPS = re.compile(r"moe|expert|deep_ep|select_experts|fused_topk", re.IGNORECASE)


def model_has_experts(ts: TraceSet, table: ClassTable | None = None, run: RunModel | None = None
                      ) -> tuple[bool, str]:
    """Whether the model has experts (MoE), and the evidence: the run model's expert count (the user,
    server_info, or the router's recorded top-k shapes), else expert GEMMs, MoE routing kernels named as
    such, or MoE ops in the trace. The one place this is decided: routing labels of generic softmax /
    top-k / sort kernels stand only where it is true."""
    run = run if run is not None else decide_run(ts)
    n_exp = run.value("experts")
    if n_exp is not None:
        return n_exp > 1, f"{n_exp} experts ({run.describe('experts')})"
    table = table or default_table()
    generic = {r.id for r in table.rules if r.verify == "experts"}
    k = ts.kernels
    if len(k) and "cls" in k:
        cls = text_values(k["cls"])
        if (cls == "moe_gemm").any():
            return True, "expert GEMM kernels in the trace"
        ev = k["cls_evidence"].to_numpy(dtype=object)
        named = {e for e in unique_text(ev[cls == "moe_dispatch"])
                 if (m := _RULE_ID.match(str(e))) and m.group(1) not in generic}
        if named:
            return True, "MoE routing / dispatch kernels in the trace"
    if len(ts.cpu_ops) and pd.Series(op_names(ts)[1], dtype=object).str.contains(_MOE_OPS, na=False).any():
        return True, "MoE ops in the trace"
    return False, "no expert count (server_info, --experts, router shapes) and no expert GEMM, MoE routing kernel or MoE op in the trace"


def verify_experts(ts: TraceSet, table: ClassTable | None = None, run: RunModel | None = None) -> None:
    """Re-label kernels of ``verify: experts`` rules where the model has no experts (-> elementwise), or
    whose softmax / top-k size is known and is not the model's expert count (vocabulary-wide ->
    sampling, else elementwise)."""
    table = table or default_table()
    ids = {r.id for r in table.rules if r.verify == "experts"}
    k = ts.kernels
    if not ids or not len(k):
        return
    run = run if run is not None else decide_run(ts)
    ev = k["cls_evidence"].to_numpy(dtype=object)
    ev_codes, uniq = factorize_text(ev)
    hit = np.array([bool((m := _RULE_ID.match(str(e))) and m.group(1) in ids) for e in uniq.tolist()], dtype=bool)
    if not hit.any():
        return
    rows = np.nonzero(hit[ev_codes])[0]
    cls = k["cls"].to_numpy(dtype=object).copy()
    ev = ev.copy()
    has, why = model_has_experts(ts, table, run)
    if not has:
        ev[rows] = per_combination(lambda was, old: f"elementwise: not MoE routing, the model has no experts "
                                   f"({why}); was {was} by {old}", cls[rows], ev[rows])
        cls[rows] = "elementwise"
        set_object_column(k, "cls", cls)
        set_object_column(k, "cls_evidence", ev)
        return
    n_exp, exp_src = run.value("experts"), run.describe("experts")
    if n_exp is None:
        return
    vocab = run.value("vocab_size")
    names = k["name"].to_numpy(dtype=object)
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    inputs = OpInputs(ts.cpu_ops) if len(ts.cpu_ops) else None
    pow2 = 1 << max(n_exp - 1, 0).bit_length()
    # one answer per (name, recorded chain of the op; None without recorded shapes), on its first row
    o = op_idx[rows].astype(np.int64)
    recorded = np.zeros(len(rows), dtype=np.int64)  # 0: no recorded shapes, else 1 + chain code
    at = np.nonzero(o >= 0)[0] if inputs is not None else np.zeros(0, dtype=np.int64)
    if len(at):
        sig, first = groups(inputs.signature_codes(o[at], 4))
        shaped = np.array([inputs.has_shapes(int(o[i])) for i in at[first].tolist()], dtype=bool)[sig]
        recorded[at[shaped]] = 1 + sig[shaped]
    key, first = groups(factorize_text(names[rows])[0], recorded)
    memo: list[tuple[str, str] | None] = []
    for i in first.tolist():
        r = int(rows[i])
        size, how = _routing_size(names[r], int(o[i]) if recorded[i] else -1, inputs)
        if size is None:
            memo.append(None)
        elif size == n_exp or (how.startswith("softmax_warp") and size == pow2):
            memo.append((cls[r], f"{how} matches {n_exp} experts ({exp_src})"))
        else:
            label = "sampling" if vocab and size >= vocab else "elementwise"
            memo.append((label, f"{how} is not the {n_exp} experts ({exp_src}): not MoE routing"))
    # the answer of each row's group, spread: rows with equal (group, class, evidence) read alike
    hit = np.array([m is not None for m in memo], dtype=bool)[key]
    rows, key = rows[hit], key[hit]
    to = [m[0] if m is not None else "" for m in memo]
    said = [m[1] if m is not None else "" for m in memo]
    ev[rows] = per_combination(lambda g, was, old: f"{old}; {said[g]}" if to[g] == was else
                               f"{to[g]}: {said[g]}; was {was} by {old}", key, cls[rows], ev[rows])
    cls[rows] = np.array(to, dtype=object)[key]
    set_object_column(k, "cls", cls)
    set_object_column(k, "cls_evidence", ev)


# --- expert GEMMs from the structure ----------------------------------------------------------

DENSE_GEMM_CLASSES = ("bf16_gemm", "fp8_gemm", "fp4_gemm")
MIN_EXPERTS = 4  # a GEMM shape repeated this often per layer (experts unknown) is an expert loop


def mark_experts(ts: TraceSet, steps: pd.DataFrame | None, run: RunModel, graph_ops: GraphOps | None = None) -> None:
    """GEMMs of a MoE built from plain GEMMs become ``moe_gemm``: a GEMM shape (op, N, K, dtype) that
    runs once per expert in every layer (per-expert ``mm`` loop: calls per layer = the experts on this
    rank, or at least MIN_EXPERTS when the expert count is unknown), or a batched GEMM whose batch is the
    expert count (``bmm`` over ``[experts, rows, hidden]``) and whose K or N is the hidden size. Shapes
    come from the launching op (eager) or the op recovered from the capture trace (graph replay)."""
    k = ts.kernels
    layers = run.value("layers")
    if not len(k) or "cls" not in k or layers is None:
        return
    cls = k["cls"].to_numpy(dtype=object)
    cand = text_isin(cls, DENSE_GEMM_CLASSES)
    if "kind" in k:
        cand &= (k["kind"] == "kernel").to_numpy()
    if "step" in k:
        cand &= (k["step"] >= 0).to_numpy()
    if not cand.any():
        return
    experts, hidden = run.value("experts"), run.value("hidden_size")
    ep = run.value("ep_size") or 1
    local = experts // ep if experts and ep > 1 and experts % ep == 0 else experts
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    captured, cap_op, _ = captured_ops(k, graph_ops)
    rows = np.nonzero(cand)[0]
    frames: dict[int, pd.DataFrame] = {-1: ts.cpu_ops}
    if graph_ops is not None:
        frames.update({int(r): c.ops.reset_index(drop=True) for r, c in graph_ops.captures.items()
                       if c.ops is not None and len(c.ops)})
    cols: dict[int, tuple[np.ndarray, ...]] = {}
    for src, f in frames.items():
        if f is not None and len(f) and "input_dims" in f:
            cols[src] = (f["name"].to_numpy(dtype=object), f["input_dims"].to_numpy(dtype=object),
                         f["input_types"].to_numpy(dtype=object) if "input_types" in f else np.full(len(f), None),
                         f["concrete"].to_numpy(dtype=object) if "concrete" in f else np.full(len(f), None))
    ranks, step = k["rank"].to_numpy(), k["step"].to_numpy()
    use_cap = captured[rows] & (cap_op[rows] >= 0)
    src_col = np.where(use_cap, ranks[rows], -1).astype(np.int64)
    o_col = np.where(use_cap, cap_op[rows], op_idx[rows]).astype(np.int64)
    # distinct (source, op) pairs in lexicographic order, through one integer key per row
    s0, o0 = int(src_col.min(initial=0)), int(o_col.min(initial=0))
    span = int(o_col.max(initial=0)) - o0 + 1
    uniq, inverse = np.unique((src_col - s0) * span + (o_col - o0), return_inverse=True)
    pairs = np.stack([uniq // span + s0, uniq % span + o0], axis=1)
    pair_id, keys = _shape_ids(pairs, cols)
    row_id = pair_id[inverse.reshape(-1)] if len(pair_id) else np.zeros(0, dtype=np.int64)
    on = row_id >= 0
    kr, ki = rows[on], row_id[on]
    order = np.argsort(ki, kind="stable")
    cut = np.searchsorted(ki[order], np.arange(len(keys) + 1))
    _, first = np.unique(ki, return_index=True)
    by_key = {keys[i]: kr[order[cut[i]:cut[i + 1]]].tolist() for i in np.argsort(first, kind="stable").tolist()}
    ev = k["cls_evidence"].to_numpy(dtype=object).copy()
    new_cls = cls.copy()
    exp_src = run.describe("experts")
    for (op, n, kk, batch, _dtype), members in by_key.items():
        m = np.asarray(members)
        per_step = np.bincount(groups(pd.factorize(ranks[m])[0], pd.factorize(step[m])[0])[0])  # calls per step
        per_layer = float(np.median(per_step)) / layers
        hid = hidden is None or hidden in (n, kk)
        why = None
        if batch and batch > 1:
            if local and batch == local and hidden is not None and hid:
                why = (f"batched GEMM {op} with batch {batch} = the experts on this rank ({exp_src}) and "
                       f"{'K' if kk == hidden else 'N'} = hidden size {hidden}")
        elif local:
            if 0.5 * local <= per_layer <= local + 1e-9 and hid:
                why = (f"{per_layer:g} {op} calls per layer with N={n} K={kk} = one per expert "
                       f"({local} on this rank: {exp_src}; {layers} layers)")
        elif per_layer >= MIN_EXPERTS and float(per_layer).is_integer() and hid and len(np.unique(per_step)) == 1:
            why = (f"{per_layer:g} {op} calls per layer with N={n} K={kk} in every step: one per expert "
                   f"(expert count unknown; {layers} layers)")
        if why is None:
            continue
        for r in members:
            ev[r] = f"moe_gemm: {why}; was {new_cls[r]} by {ev[r]}"
            new_cls[r] = "moe_gemm"
    set_object_column(k, "cls", new_cls)
    set_object_column(k, "cls_evidence", ev)


def _shape_ids(pairs: np.ndarray, cols: dict[int, tuple[np.ndarray, ...]]
               ) -> tuple[np.ndarray, list[tuple[Any, ...]]]:
    """Per (source, op) pair, the number of its GEMM shape key (op, N, K, batch, dtype), -1 for an op
    that is not one GEMM, and the keys in order of their first pair. Each distinct recorded (name,
    dims, types, concrete) is decoded once."""
    n = len(pairs)
    raw = [np.full(n, None, dtype=object) for _ in range(4)]  # name, dims, types, concrete
    valid = np.zeros(n, dtype=bool)
    for src in np.unique(pairs[:, 0]).tolist() if n else []:
        c = cols.get(src)
        if c is None:
            continue
        at = np.nonzero(pairs[:, 0] == src)[0]
        o = pairs[at, 1]
        ok = (o >= 0) & (o < len(c[0]))
        at, o = at[ok], o[ok]
        valid[at] = True
        for dst, col in zip(raw, c, strict=True):
            dst[at] = col[o]
    pair_id = np.full(n, -1, dtype=np.int64)
    ids: dict[tuple[Any, ...], int] = {}
    vi = np.nonzero(valid)[0]
    if len(vi):
        code, first = groups(*(factorize_text(v[vi])[0] for v in raw))
        cache = ShapeCache()
        code_id = np.full(len(first), -1, dtype=np.int64)
        for j, i in enumerate(vi[first].tolist()):  # in order of first pair: keys numbered as they appear
            name = str(raw[0][i])
            shapes, _ = cache.get(name, raw[1][i], raw[2][i], raw[3][i])
            sh = shapes[0] if len(shapes) == 1 and shapes[0].kind == "gemm" else None
            if sh is not None:
                code_id[j] = ids.setdefault((name, sh.n, sh.k, sh.batch, sh.dtype), len(ids))
        pair_id[vi] = code_id[code]
    return pair_id, list(ids)
