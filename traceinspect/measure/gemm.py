"""GEMM and memory efficiency from recorded shapes: FLOPs, bytes, achieved TFLOP/s and GB/s and the
share of the device's peak, per kernel call and per (class, shape); per-expert M of MoE GEMMs.

Shapes come from the ``Input Dims`` / ``Input type`` / ``Concrete Inputs`` of the CPU op that
launched a kernel (``record_shapes=True``). CUDA-graph replays have no CPU op: their shapes are
taken from the ops that :mod:`traceinspect.classify.graphs` recovered from a graph-capture trace when one is
given, else reported as unknown. Formulas are in ``docs/metrics.md``.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.measure.attention import attention_calls, attention_json, attention_table
from traceinspect.measure.gemm_shapes import gemm_shapes
from traceinspect.measure.roofline import apply_to_calls, roof_json
from traceinspect.measure.specs import GpuSpec, resolve_gpu
from traceinspect.model.classes import GEMM_CLASSES
from traceinspect.model.shapes import (  # noqa: F401 - importable from here
    _RANK,
    Shape,
    ShapeCache,
    dtype_of,
    op_handler,
)
from traceinspect.tables import (
    combine_codes,
    factorize_text,
    first_rows,
    per_distinct,
    text_codes,
    text_values,
)
from traceinspect.units import json_num

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis
from traceinspect.measure.gemm_tables import (
    _HOST_LINK,
    _gemm_table,
    _memory_table,
    _obj,
)
from traceinspect.measure.moe import _moe, cross_check

# an fp32 GEMM on tensor cores computes in tf32: measured against the tf32 peak, not the fp32 (SIMT) one
_TF32_KERNEL = re.compile(r"tf32|s1688gemm(?!_(bf16|f16|h))", re.IGNORECASE)
MOE_PATH = re.compile(r"moe|expert", re.IGNORECASE)
_PEAK_KEY = {"fp4": "fp4", "fp8": "fp8", "fp16": "fp16", "bf16": "bf16", "fp32": "fp32", "tf32": "tf32"}

CALL_COLUMNS = [
    "rank", "step", "kernel", "name", "cls", "op_name", "kind", "batch", "groups", "m", "n", "k", "dtype",
    "flops", "bytes", "us", "tflops", "gbps", "pct_peak", "pct_bw", "shape_source", "reason", "moe",
    "peak_tflops", "confidence",
]
MODEL_CONFIG_HINT = ("their shapes follow from the model: pass --model-config config.json (the model's Hugging Face "
                     "config), or capture with `traceinspect capture` on the server's host, which saves it in "
                     "server_info.json")
# how sure a shape is, by where it came from (a shape from the model config carries its match's confidence)
SOURCE_CONFIDENCE = {"shapes": "high", "graph_capture": "high"}


class Efficiency(msgspec.Struct, eq=False):
    """GEMM and memory efficiency of the analysed kernels."""

    calls: pd.DataFrame
    gemm: pd.DataFrame
    memory_bound: pd.DataFrame
    moe: dict[str, Any] = msgspec.field(default_factory=dict)
    spec: GpuSpec | None = None
    attention: pd.DataFrame | None = None  # per attention kernel family and shape (measure/attention.py)
    attention_calls: pd.DataFrame | None = None
    spec_reason: str = ""
    _gemm_calls: pd.DataFrame | None = None
    _shapes: tuple[pd.DataFrame | None] | None = None

    def gemm_calls(self) -> pd.DataFrame:
        """The GEMM rows of ``calls``, selected once (the GEMM table, the judge's shape rows and the
        replay's GEMM edits all read them)."""
        if self._gemm_calls is None:
            self._gemm_calls = _gemm_rows(self.calls)
        return self._gemm_calls

    def shapes(self) -> pd.DataFrame | None:
        """The GEMM calls aggregated per shape (:func:`~traceinspect.measure.gemm_shapes.gemm_shapes`, made
        once; callers only read it): the rows of the judge's ``gemm`` scope."""
        if self._shapes is None:
            self._shapes = (gemm_shapes(self.gemm_calls()),)
        return self._shapes[0]

    def to_json(self) -> dict[str, Any]:
        """The ``gemm``, ``memory_bound``, ``moe`` and ``gpu`` sections of the analysis JSON."""
        gemm = []
        for r in self.gemm.itertuples(index=False):
            gemm.append({
                "cls": r.cls, "op": r.op_name or None, "dtype": r.dtype if isinstance(r.dtype, str) else None,
                "m": _int(r.m), "n": _int(r.n), "k": _int(r.k), "batch": _int(r.batch), "groups": _int(r.groups),
                "calls": int(r.calls), "us": json_num(r.us), "mean_us": json_num(r.mean_us),
                "gflop": json_num(r.flops / 1e9 if r.flops == r.flops else None),
                "tflops": json_num(r.tflops), "pct_peak": json_num(r.pct_peak, 2), "gbps": json_num(r.gbps),
                "shape_source": r.shape_source, "confidence": r.confidence or None, "reason": r.reason or None,
                **roof_json(r),
            })
        mem = []
        for r in self.memory_bound.itertuples(index=False):
            mem.append({
                "family": r.family, "cls": r.cls, "dtypes": r.dtypes, "calls": int(r.calls),
                "bytes": json_num(r.bytes, 0), "us": json_num(r.us), "gbps": json_num(r.gbps), "pct_bw": json_num(r.pct_bw, 2),
                "reason": r.reason or None, **roof_json(r),
            })
        spec = self.spec
        gpu: dict[str, Any] = ({**spec.to_json(), "matched_by": self.spec_reason} if spec
                               else {"name": None, "reason": self.spec_reason})
        return {"gemm": gemm, "attention": attention_json(self.attention), "memory_bound": mem,
                "moe": _json_safe(self.moe), "gpu": gpu}


def _int(x: Any) -> int | None:
    if x is None or (isinstance(x, float) and not np.isfinite(x)):
        return None
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _json_safe(v: Any) -> Any:
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_json_safe(x) for x in v]
    return json_num(v, 3)


# ----------------------------------------------------------------------------- measure

def _device(a: Analysis) -> tuple[str | None, str | None, str]:
    devs = {(r.device.name, r.device.compute_capability) for r in a.trace.ranks if r.device is not None}
    if not devs:
        return None, None, ""
    name, cc = sorted(devs, key=lambda d: (d[0] or "", d[1] or ""))[0]
    note = f" (ranks report {len(devs)} different devices; the first is used)" if len(devs) > 1 else ""
    return name, cc, note


def measure_efficiency(a: Analysis) -> Efficiency:
    """FLOPs/bytes per GEMM and memory-op call of the analysed kernels, aggregated per shape and per
    kernel family, the per-expert M of MoE GEMMs, and the GPU spec used for the percentages."""
    name, cc, note = _device(a)
    spec, why = resolve_gpu(name, cc, a.options.gpu)
    why += note
    k = a.kernels
    cols = ["rank", "step", "ts", "dur", "name", "cls", "graph_replay", "op_idx", "op_path"]
    src = _op_sources(a, k.loc[k["kind"].eq("kernel").to_numpy(), [c for c in cols if c in k.columns]])
    calls = pd.concat([_calls(src), _copy_events(k)], ignore_index=True) if len(k) else \
        pd.DataFrame(columns=CALL_COLUMNS)
    _rates(calls, spec)
    apply_to_calls(calls, spec)
    gemm_calls = _gemm_rows(calls)
    a.trace.warnings += cross_check(a, gemm_calls)
    att_calls, att = attention_table(attention_calls(a, gemm_calls), spec)
    return Efficiency(calls=calls, gemm=_gemm_table(gemm_calls, spec), memory_bound=_memory_table(calls, spec),
                      moe=_moe(a, calls), spec=spec, spec_reason=why, _gemm_calls=gemm_calls, attention=att,
                      attention_calls=att_calls)


def _gemm_rows(calls: pd.DataFrame) -> pd.DataFrame:
    return calls[calls["kind"].to_numpy() == "gemm"] if len(calls) else calls


def _op_sources(a: Analysis, kk: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per kernel: the op instance whose shapes describe it (``inst``, -1 if none) with that op's name,
    raw shape args and whether its op path names a MoE op (``moe_path``), where they came from
    (``source``) and, without an op, why (``why``)."""
    n = len(kk)
    ops = a.trace.cpu_ops
    inst = np.full(n, -1, dtype=np.int64)
    source = np.full(n, "", dtype=object)
    why = np.full(n, "", dtype=object)
    op_name = np.full(n, "", dtype=object)
    moe_path = np.zeros(n, dtype=bool)  # the op path names a MoE op (no op: the empty path, no)
    dims = np.full(n, None, dtype=object)
    types = np.full(n, None, dtype=object)
    conc = np.full(n, None, dtype=object)

    replay = kk["graph_replay"].to_numpy(dtype=bool)
    op_idx = kk["op_idx"].to_numpy()
    live = ~replay & (op_idx >= 0)
    if live.any() and len(ops):
        oi = _model_ops(ops, op_idx[live], names=a.trace.op_names())
        inst[live] = oi
        source[live] = "shapes"
        op_name[live] = ops["name"].to_numpy(dtype=object)[oi]
        path_code, paths = text_codes(kk["op_path"])
        moe_path[live] = np.array([bool(MOE_PATH.search(p)) for p in paths.tolist()], dtype=bool)[path_code[live]]
        dims[live] = ops["input_dims"].to_numpy(dtype=object)[oi]
        types[live] = ops["input_types"].to_numpy(dtype=object)[oi]
        conc[live] = ops["concrete"].to_numpy(dtype=object)[oi]
    why[~replay & (op_idx < 0)] = "no CPU op linked to this kernel (no shapes)"

    if replay.any():
        _replay_sources(a, kk, replay, inst, source, why, op_name, moe_path, dims, types, conc)
    src_code, src_uniq = pd.factorize(source)  # a kernel without a source: code -1, the last entry
    confidence = np.array([*(SOURCE_CONFIDENCE.get(s) for s in src_uniq.tolist()), SOURCE_CONFIDENCE.get(None)],
                          dtype=object)[src_code]
    model_shape = _model_sources(a, kk, inst, source, why, op_name, moe_path, confidence)
    cls_code, cls_text = text_codes(kk["cls"])
    return {
        "kernel": kk.index.to_numpy(), "rank": kk["rank"].to_numpy(), "step": kk["step"].to_numpy(),
        "ts": kk["ts"].to_numpy(dtype=float), "name": kk["name"].to_numpy(dtype=object),
        "cls": cls_text[cls_code], "cls_code": cls_code, "cls_text": cls_text, "dur": kk["dur"].to_numpy(dtype=float),
        "inst": inst, "source": source, "why": why, "op_name": op_name, "moe_path": moe_path, "dims": dims,
        "types": types, "conc": conc, "model_shape": model_shape, "confidence": confidence,
    }


def _model_sources(a: Analysis, kk: pd.DataFrame, inst: np.ndarray, source: np.ndarray, why: np.ndarray,
                   op_name: np.ndarray, moe_path: np.ndarray, confidence: np.ndarray) -> np.ndarray:
    """The shapes the model config gives the kernels that have no recorded ones
    (:mod:`traceinspect.classify.modelshapes`): per kernel its Shape, or None. Those kernels take the model
    GEMM's name as their op, ``model_config`` as their shape source and the match's confidence."""
    out = np.full(len(kk), None, dtype=object)
    mg = a.run_model.gemms if a.run_model is not None else None
    t = getattr(mg, "table", None)
    blind = np.flatnonzero((inst < 0) & kk["graph_replay"].to_numpy(dtype=bool)) if len(kk) else np.zeros(0, int)
    if len(blind):  # what would give the shapes of replayed kernels that have none
        how = (f"; the model config's GEMMs were not matched to these kernels: {mg.reason}" if mg is not None and
               mg.reason else "" if mg is not None else f"; {MODEL_CONFIG_HINT}")
        if how:
            why[blind] = np.array([f"{w}{how}" if w else w for w in why[blind].tolist()], dtype=object)
    if t is None or not len(t) or not len(kk):
        return out
    pos = t.index.get_indexer(kk.index)
    hit = np.flatnonzero((pos >= 0) & (inst < 0))
    if not len(hit):
        return out
    p = pos[hit]
    out[hit] = t["shape"].to_numpy(dtype=object)[p]
    source[hit] = "model_config"
    why[hit] = ""
    op_name[hit] = t["gemm"].to_numpy(dtype=object)[p]
    moe_path[hit] |= t["moe"].to_numpy(dtype=bool)[p]
    confidence[hit] = t["confidence"].to_numpy(dtype=object)[p]
    return out


def _model_ops(ops: pd.DataFrame, idx: np.ndarray, levels: int = 2,
               names: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """The op whose shapes describe a kernel: the launching op, or, when that one has no model (e.g.
    ``aten::gather`` under ``aten::index_select``), the nearest enclosing op that has one. ``names``: the
    ops' names as (codes, texts) (:meth:`~traceinspect.model.TraceSet.op_names`), when known."""
    out = idx.copy()
    if not len(ops) or not len(idx):
        return out
    parent = ops["parent"].to_numpy() if "parent" in ops else np.full(len(ops), -1)
    codes, texts = names if names is not None else factorize_text(ops["name"].to_numpy(dtype=object))
    # whether an op has a model: decided once per distinct name
    modelled = np.fromiter((isinstance(t, str) and op_handler(t) is not None for t in texts.tolist()), dtype=bool,
                           count=len(texts))
    sel = np.nonzero(idx >= 0)[0]
    j = idx[sel].astype(np.int64)
    hit = j.copy()
    live = np.ones(len(sel), dtype=bool)
    for _ in range(levels + 1):  # the op itself, then up to ``levels`` enclosing ops
        found = live.copy()
        found[live] = modelled[codes[j[live]]]
        hit[found] = j[found]
        live &= ~found
        j = np.where(live, parent[np.maximum(j, 0)], -1)
        live &= j >= 0
    out[sel] = hit
    return out


def _replay_sources(a: Analysis, kk: pd.DataFrame, replay: np.ndarray, inst: np.ndarray, source: np.ndarray,
                    why: np.ndarray, op_name: np.ndarray, moe_path: np.ndarray, dims: np.ndarray,
                    types: np.ndarray, conc: np.ndarray) -> None:
    """Fill the op columns of graph-replayed kernels from the ops the graphs stage recovered from the
    capture trace (one op instance per captured op and replay)."""
    g = a.graph_ops
    pos = np.nonzero(replay)[0]
    rec = g.kernels.reindex(kk.index[pos])
    known = rec["rank"].notna().to_numpy()
    why[pos[~known]] = "CUDA-graph replay: not covered by the graph-capture recovery"
    pos, rec = pos[known], rec[known]
    cop = rec["cap_op"].to_numpy().astype(np.int64)
    why[pos[cop < 0]] = rec["reason"].to_numpy(dtype=object)[cop < 0]
    has = cop >= 0
    if not has.any():
        return
    pos, rec, cop = pos[has], rec[has], cop[has]
    ranks = rec["rank"].to_numpy().astype(np.int64)
    width = max(c.n_ops for c in g.captures.values())
    replays = rec["replay"].to_numpy().astype(np.int64)
    paths = rec["cap_op_path"].to_numpy(dtype=object)
    for rank in np.unique(ranks):
        cap = g.captures[int(rank)]
        sel = ranks == rank
        p = pos[sel]
        c = _model_ops(cap.ops, cop[sel])
        # live op instances are rows of cpu_ops; these sit above them, one per (replay, captured op)
        inst[p] = (1 << 40) + replays[sel] * width + c
        source[p] = "graph_capture"
        op_name[p] = cap.names[c]
        moe_path[p] = per_distinct(paths[sel], MOE_PATH.search)
        dims[p] = cap.dims[c]
        types[p] = cap.types[c]
        conc[p] = cap.conc[c]


_HKINDS = ("", "gemm", "memory", "moe")  # the handler kinds of an op, as integer codes


def _calls(col: dict[str, np.ndarray]) -> pd.DataFrame:
    """One row per GEMM / memory op instance (its kernels' time summed), one per GEMM kernel of a fused
    MoE op, and one per GEMM-class kernel whose shapes are unknown."""
    # numpy arrays throughout: pandas string columns are slow to take/gather at 1e5 rows; what depends
    # on an op's shapes is decided once per distinct (op, shapes) key and spread with integer codes
    n = len(col["inst"])
    if not n:
        return pd.DataFrame(columns=CALL_COLUMNS)
    inst, dur, ts = col["inst"], col["dur"], col["ts"]
    src = col
    has = inst >= 0
    row_key = np.full(n, -1, dtype=np.int64)  # the row's distinct key, -1: no op instance
    k_hk = np.zeros(0, dtype=np.int8)
    k_shapes: list[tuple[Shape, ...]] = []
    k_reason = np.zeros(0, dtype=object)
    if has.any():
        codes, uniq = pd.factorize(inst[has])
        first = first_rows(codes)
        fi = np.nonzero(has)[0][first]
        # instances recorded with the same op and shapes (every replay of a captured op, every layer)
        # are modelled once
        parts = [factorize_text(col[c][fi]) for c in ("op_name", "dims", "types", "conc")]
        key_codes = combine_codes(*(c for c, _ in parts))
        at = first_rows(key_codes)  # the first call of each distinct key
        keys = [tuple(u[c[i]] for c, u in parts) for i in at.tolist()]
        cache = ShapeCache()
        k_hk = np.zeros(len(keys), dtype=np.int8)
        k_reason = np.full(len(keys), "", dtype=object)
        for j, (nm, dims, types, conc) in enumerate(keys):
            h = op_handler(nm)
            k_hk[j] = _HKINDS.index(h[0]) if h is not None else 0
            shp, k_reason[j] = cache.get(nm, dims, types, conc)  # says why when there is no model
            k_shapes.append(shp)
        row_key[has] = key_codes[codes]
    hk = np.where(row_key >= 0, np.append(k_hk, 0)[row_key], 0)
    reason = np.append(k_reason, "")[row_key]  # row_key -1 -> the last slot, ""
    gemm_cls = col["gemm_cls"] = _class_test(col, GEMM_CLASSES.__contains__)
    moe = col["moe_path"] | _class_test(col, lambda c: c == "moe_gemm")
    parts = []

    # ops with one model for the whole call: time of all their kernels, the longest one stands for it
    sel = ((hk == 1) & ~_class_test(col, ("memcpy", "comm").__contains__)) | (hk == 2)
    if sel.any():
        pi = np.nonzero(sel)[0]
        # by instance, the longest kernel first (ties in row order, NaN last: a stable sort on -dur)
        pi = pi[np.lexsort((-dur[pi], inst[pi]))]
        si = inst[pi]
        new_inst = np.concatenate([[True], si[1:] != si[:-1]])
        start = np.flatnonzero(new_inst)
        pos = pi[start]
        us = pd.Series(dur[pi]).groupby(np.cumsum(new_inst) - 1, sort=False).sum()  # as grouping by inst sums
        any_gemm, any_moe = np.logical_or.reduceat(gemm_cls[pi], start), np.logical_or.reduceat(moe[pi], start)
        k_known = np.array([bool(s) for s in k_shapes] + [False], dtype=bool)
        keep = (hk[pos] == 2) | k_known[row_key[pos]] | any_gemm
        pos = pos[keep]
        # the call's shape: the first of its op's shapes (one distinct Shape per key)
        first_shape = [s[0] if s else None for s in k_shapes] + [None]
        parts.append(_rows(src, col, pos, first_shape, np.where(row_key[pos] >= 0, row_key[pos], len(k_shapes)),
                           reason[pos], us.to_numpy()[keep], any_moe[keep]))

    # fused MoE ops: their GEMM kernels in launch order <-> the op's GEMM shapes in order
    sel = (hk == 3) & gemm_cls
    if sel.any():
        pi = np.nonzero(sel)[0]
        pi = pi[np.lexsort((ts[pi], inst[pi]))]
        f = pd.DataFrame({"inst": inst[pi]})
        order = f.groupby("inst", sort=False).cumcount().to_numpy()
        cnt = f.groupby("inst", sort=False)["inst"].transform("size").to_numpy()
        shp = [k_shapes[k] for k in row_key[pi].tolist()]
        rs = reason[pi].copy()
        ok = np.array([bool(sh) and len(sh) == c for sh, c in zip(shp, cnt, strict=True)], dtype=bool)
        for j in np.nonzero(~ok & (rs == ""))[0]:
            rs[j] = (f"{col['op_name'][pi[j]]} launched {cnt[j]} GEMM kernels, its shapes describe "
                     f"{len(shp[j]) if shp[j] else 0}: cannot tell which is which")
        distinct, codes = _distinct([sh[o] if k else None for sh, o, k in zip(shp, order, ok, strict=True)])
        parts.append(_rows(src, col, pi, distinct, codes, rs, dur[pi], np.ones(len(pi), dtype=bool)))

    # GEMM-class kernels without recorded shapes whose shapes the model config gives
    mshape = col["model_shape"]
    modelled = gemm_cls & (hk == 0) & (inst < 0) & np.array([s is not None for s in mshape.tolist()], dtype=bool)
    if modelled.any():
        pi = np.nonzero(modelled)[0]
        distinct, codes = _distinct(mshape[pi].tolist())
        parts.append(_rows(src, col, pi, distinct, codes, np.full(len(pi), "", dtype=object), dur[pi],
                           moe[pi] | col["moe_path"][pi]))
    # GEMM-class kernels no model covers: listed as unknown, with the reason
    sel = gemm_cls & (hk == 0) & ~modelled
    if sel.any():
        pi = np.nonzero(sel)[0]
        rs = np.where(col["why"][pi] != "", col["why"][pi], reason[pi])
        parts.append(_rows(src, col, pi, [None], np.zeros(len(pi), dtype=np.int64), rs, dur[pi], moe[pi]))
    parts = [p for p in parts if len(p)]
    if len(parts) == 1:  # built with a fresh range index: as concatenating it alone would give
        return parts[0]
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=CALL_COLUMNS)


def _in_order(f: pd.DataFrame) -> pd.DataFrame:
    """The calls frame with its columns in CALL_COLUMNS order (built in that order: no copy)."""
    return f if list(f.columns) == CALL_COLUMNS else f[CALL_COLUMNS]


def _class_test(col: dict[str, np.ndarray], test: Any) -> np.ndarray:
    """``test`` of each kernel's class, called once per distinct class."""
    texts = col["cls_text"]
    return np.fromiter((bool(test(c)) for c in texts.tolist()), dtype=bool, count=len(texts))[col["cls_code"]]




def _distinct(shape: list[Shape | None]) -> tuple[list[Shape | None], np.ndarray]:
    """The distinct Shape objects of a list (by identity) and each element's index among them."""
    slot: dict[int, int] = {}
    distinct: list[Shape | None] = []
    codes = np.empty(len(shape), dtype=np.int64)
    for i, s in enumerate(shape):
        j = slot.get(id(s))
        if j is None:
            j = slot[id(s)] = len(distinct)
            distinct.append(s)
        codes[i] = j
    return distinct, codes


def _rows(src: dict[str, np.ndarray], col: dict[str, np.ndarray], pos: np.ndarray, distinct: list[Shape | None],
          codes: np.ndarray, reason: np.ndarray, us: np.ndarray, moe: np.ndarray) -> pd.DataFrame:
    """Calls rows for the kernels at positions ``pos`` of ``src``, the Shape of each (or None) being
    ``distinct[codes[i]]``: each attribute is read once per distinct Shape and spread with the codes."""
    codes = np.asarray(codes, dtype=np.int64)

    def attr(a: str, missing: Any = None) -> np.ndarray:
        vals = np.empty(len(distinct), dtype=object)
        for j, s in enumerate(distinct):
            vals[j] = getattr(s, a) if s is not None else missing
        return vals[codes]

    cls = col["cls"][pos]
    known = np.array([s is not None for s in distinct], dtype=bool)[codes]
    kind = np.where(known, attr("kind"), np.where(col["gemm_cls"][pos], "gemm", "memory"))
    rs = np.asarray(reason, dtype=object)
    rs = np.where(rs.astype(bool), rs, attr("note", ""))
    out = pd.DataFrame({
        "rank": src["rank"][pos], "step": src["step"][pos], "kernel": src["kernel"][pos],
        "name": _obj(col["name"][pos]), "cls": _obj(cls),
        "op_name": _obj(col["op_name"][pos]), "kind": _obj(kind), "batch": attr("batch"), "groups": attr("groups"),
        "m": attr("m"), "n": attr("n"), "k": attr("k"), "dtype": _obj(attr("dtype")), "flops": attr("flops"),
        "bytes": attr("bytes"), "us": np.asarray(us, dtype=float), "tflops": np.nan, "gbps": np.nan,
        "pct_peak": np.nan, "pct_bw": np.nan,
        "shape_source": _obj(np.where(known, col["source"][pos], "unknown")), "reason": _obj(rs),
        "moe": np.asarray(moe, dtype=bool), "peak_tflops": np.nan,
        "confidence": _obj(np.where(known, col["confidence"][pos], None)),
    }, copy=False)  # fresh arrays: the consolidation into 2-D blocks that a copy makes costs more than all else here
    return _in_order(out)


def _copy_events(k: pd.DataFrame) -> pd.DataFrame:
    """memcpy/memset events: their byte count is in the trace."""
    mc = k.loc[k["kind"].isin(("memcpy", "memset")).to_numpy() & (k["bytes"].to_numpy() >= 0),
               ["rank", "step", "name", "cls", "op_name", "bytes", "dur"]]
    n = len(mc)
    return _in_order(pd.DataFrame({
        "rank": mc["rank"].to_numpy(), "step": mc["step"].to_numpy(), "kernel": mc.index.to_numpy(),
        "name": _obj(mc["name"].to_numpy(dtype=object)), "cls": _obj(text_values(mc["cls"])),
        "op_name": _obj(mc["op_name"].to_numpy(dtype=object)), "kind": _obj(["memory"] * n), "batch": [None] * n,
        "groups": [None] * n, "m": [None] * n, "n": [None] * n, "k": [None] * n,
        "dtype": [None] * n, "flops": [None] * n, "bytes": mc["bytes"].to_numpy(dtype=float),
        "us": mc["dur"].to_numpy(dtype=float), "tflops": np.nan, "gbps": np.nan, "pct_peak": np.nan,
        "pct_bw": np.nan, "shape_source": _obj(["shapes"] * n), "reason": _obj([""] * n),
        "moe": np.zeros(n, dtype=bool),
        "peak_tflops": np.nan, "confidence": _obj(["high"] * n),
    }, copy=False))


def _rates(calls: pd.DataFrame, spec: GpuSpec | None) -> None:
    if not len(calls):
        return
    us = calls["us"].astype(float).to_numpy()
    fl, by = _floats(calls["flops"]), _floats(calls["bytes"])
    with np.errstate(divide="ignore", invalid="ignore"):
        tf = np.where(us > 0, fl / us / 1e6, np.nan)
        gb = np.where(us > 0, by / us / 1e3, np.nan)
    calls["tflops"] = tf
    calls["gbps"] = gb
    dts = calls["dtype"].to_numpy(dtype=object)
    if (dts == "fp32").any():
        tf32 = (dts == "fp32") & per_distinct(calls["name"], lambda n: bool(_TF32_KERNEL.search(str(n))))
        if tf32.any():
            dts = np.where(tf32, "tf32", dts).astype(object)
            calls["dtype"] = dts
    codes, uniq = factorize_text(dts)  # the peak looked up once per distinct dtype
    peak = np.array([_peak(spec, d) for d in uniq], dtype=float)[codes]
    calls["peak_tflops"] = peak
    calls["pct_peak"] = np.where(calls["kind"].to_numpy() == "gemm", 100.0 * tf / peak, np.nan)
    bw = spec.mem_bw_gbps if spec and spec.mem_bw_gbps else np.nan
    host = per_distinct(calls["name"], lambda n: _HOST_LINK.search(str(n)))
    calls["pct_bw"] = np.where(host, np.nan, 100.0 * gb / bw)


def _floats(col: pd.Series) -> np.ndarray:
    """``pd.to_numeric(col, errors="coerce")`` as floats: a column of numbers and None (what the Shape
    attributes hold) converts directly, None becoming NaN; anything else goes through pandas."""
    v = col.to_numpy()
    if v.dtype == object:
        try:
            return np.asarray(v, dtype=float)
        except (TypeError, ValueError):
            pass
    return pd.to_numeric(col, errors="coerce").to_numpy(dtype=float)


def _peak(spec: GpuSpec | None, dtype: Any) -> float:
    if spec is None or not isinstance(dtype, str):
        return np.nan
    p = spec.peak(_PEAK_KEY.get(dtype))
    return p if p else np.nan


# ----------------------------------------------------------------------------- MoE


