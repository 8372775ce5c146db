"""Attention's performance model: per attention op instance, FLOPs and bytes over its KV lengths, from the
recorded shapes of the op that launched it (live or recovered from the CUDA-graph capture trace), and per
attention kernel family the achieved TFLOP/s and TB/s beside the roofline (:mod:`.roofline`).

FLOPs: 2·B·H·Sq·Sk·(D + Dv) (QK^T and PV; 4·B·H·ctx·D per layer for decode, Sq = 1 and Dv = D; half the
pairs under a causal mask over equal lengths). Bytes: Q, K, V and the output at their dtypes. Forms:

- PyTorch SDPA ops (``[B, H, S, D]``) and ``aten::_flash_attention_forward`` (``[B, S, H, D]``);
- ``aiter::mha_batch_prefill`` (ragged ``[T, H, D]``), where every sequence has the recorded maximum
  length (T = B x max_seqlen_q and max_seqlen_k = max_seqlen_q): else the lengths are not recorded;
- attention written as batched GEMMs, QK^T (``bmm [B, H, D] x [B, D, ctx]``), a softmax, then PV
  (``bmm [B, H, ctx] x [B, ctx, Dv]``), as MLA's absorbed (latent) form runs it: D = 576 latent + rope,
  Dv = 512; the two GEMMs' own FLOPs and bytes (Q, K, scores; probabilities, V, output).

Paged decode kernels read the KV lengths from a tensor's values (``kv_indptr``, ``seq_lens``), which a
trace does not record: their rows are listed with the reason and no floor."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.measure.roofline import floors, group_roofline
from traceinspect.model.shapes import _decode, dtype_of
from traceinspect.tables import per_distinct

if TYPE_CHECKING:
    from traceinspect.measure.specs import GpuSpec
    from traceinspect.model.analysis import Analysis

ATTENTION_COLUMNS = ["family", "cls", "op_name", "dtype", "batch", "heads", "q_len", "ctx", "d", "dv", "calls", "us",
                     "mean_us", "flops", "bytes", "tflops", "gbps", "pct_peak", "pct_bw", "floor_us", "bound",
                     "pct_roofline", "shape_source", "reason"]
CALL_COLUMNS = ["rank", "kernel", "family", "op_name", "dtype", "batch", "heads", "q_len", "ctx", "d", "dv", "flops",
                "bytes", "us", "shape_source", "reason"]
BMM_FAMILY = "bmm attention (QK^T, softmax, PV)"
_TEMPLATE = re.compile(r"<[^<>]*>")
_SDPA = {  # op -> (layout, index of is_causal in Concrete Inputs)
    "aten::_scaled_dot_product_flash_attention": ("bhsd", 4),
    "aten::_scaled_dot_product_flash_attention_for_cpu": ("bhsd", 3),
    "aten::_scaled_dot_product_efficient_attention": ("bhsd", 6),
    "aten::_scaled_dot_product_cudnn_attention": ("bhsd", 6),
    "aten::scaled_dot_product_attention": ("bhsd", 5),
    "aten::_flash_attention_forward": ("bshd", 8),
    "aten::_efficient_attention_forward": ("bshd", 7),
}


def family(name: str) -> str:
    """A kernel's family: its name without return type, namespaces, template arguments and parameters."""
    s = str(name)
    for _ in range(8):
        t = _TEMPLATE.sub("", s)
        if t == s:
            break
        s = t
    s = s.split("(", 1)[0].strip()
    s = s.rsplit(" ", 1)[-1]
    return s.rsplit("::", 1)[-1] or str(name)[:80]


def _truthy(v: Any) -> bool:
    return str(v).strip().lower() in ("true", "1")


def _el(t: Any) -> tuple[str, float] | None:
    return dtype_of(t) if isinstance(t, str) else None


def model_op(name: str, dims: list[Any], types: list[Any], conc: list[Any]) -> tuple[dict[str, Any] | None, str]:
    """(B, H, Sq, ctx, D, Dv, dtype, FLOPs, bytes) of one attention op from its recorded inputs, or why not."""
    def t4(i: int) -> list[int] | None:
        d = dims[i] if i < len(dims) else None
        return d if isinstance(d, list) and all(isinstance(x, int) for x in d) else None

    if name in _SDPA:
        layout, ci = _SDPA[name]
        q, k, v = t4(0), t4(1), t4(2)
        eq, ek, ev = (_el(types[i]) if i < len(types) else None for i in range(3))
        if not (q and k and v and len(q) == len(k) == len(v) == 4 and eq and ek and ev):
            return None, f"{name}: q, k, v are not recorded as 4-D tensors of known dtype"
        if layout == "bhsd":
            (b, h, sq, d), (_, hk, sk, _), dv = q, k, v[3]
        else:
            (b, sq, h, d), (_, sk, hk, _), dv = q, k, v[3]
        causal = ci < len(conc) and _truthy(conc[ci])
        return _attn(b, h, hk, sq, sk, d, dv, eq, ek, ev, causal), ""
    if name.endswith("mha_batch_prefill"):
        q, k, cu = t4(0), t4(1), t4(3)
        eq, ek = _el(types[0]) if types else None, _el(types[1]) if len(types) > 1 else None
        try:
            mq, mk = int(conc[6]), int(conc[7])
        except (IndexError, TypeError, ValueError):
            return None, f"{name}: max_seqlen_q / max_seqlen_k not recorded"
        if not (q and k and cu and len(q) == 3 and eq and ek):
            return None, f"{name}: q, k or cu_seqlens_q not recorded"
        b = cu[0] - 1
        if b <= 0 or q[0] != b * mq or mk != mq:
            return None, (f"{name}: sequence lengths vary (T {q[0]} != {b} sequences x max_seqlen_q {mq}, or "
                          "max_seqlen_k differs): the lengths are tensor values, not recorded")
        causal = len(conc) > 12 and _truthy(conc[12])
        return _attn(b, q[1], k[-2], mq, mk, q[2], k[-1], eq, ek, ek, causal), ""
    return None, (f"{name}: the KV lengths of this attention op are tensor values (sequence lengths, page "
                  "indices), not recorded: no FLOPs, bytes or floor")


def _attn(b: int, h: int, hk: int, sq: int, sk: int, d: int, dv: int, eq: tuple[str, float], ek: tuple[str, float],
          ev: tuple[str, float], causal: bool) -> dict[str, Any]:
    pairs = float(sq) * sk * ((sk + 1) / (2.0 * sk) if causal and sq == sk else 1.0)
    flops = 2.0 * b * h * pairs * (d + dv)
    nbytes = b * (sq * h * d * eq[1] + sk * hk * d * ek[1] + sk * hk * dv * ev[1] + sq * h * dv * eq[1])
    return {"batch": b, "heads": h, "q_len": sq, "ctx": sk, "d": d, "dv": dv, "dtype": eq[0], "flops": flops,
            "bytes": float(nbytes)}


def attention_calls(a: Analysis, calls: pd.DataFrame) -> pd.DataFrame:
    """One row per attention op instance (its kernels' time summed) and per QK^T/softmax/PV GEMM pair."""
    rows = _bmm_pairs(a, calls) + _attention_ops(a)
    return pd.DataFrame(rows, columns=CALL_COLUMNS) if rows else pd.DataFrame(columns=CALL_COLUMNS)


def _attention_ops(a: Analysis) -> list[dict[str, Any]]:
    k = a.kernels
    sel = k[(k["cls"].astype(str) == "attention").to_numpy() & (k["kind"].astype(str) == "kernel").to_numpy()]
    if not len(sel):
        return []
    ops = a.trace.cpu_ops
    inst: list[Any] = []
    info: dict[Any, tuple[str, Any, Any, Any, str]] = {}
    rec = a.graph_ops.kernels.reindex(sel.index) if getattr(a, "graph_ops", None) is not None and \
        len(a.graph_ops.kernels) else None
    for pos, (idx, r) in enumerate(zip(sel.index.tolist(), sel.itertuples(index=False), strict=True)):
        key: Any = ("none", idx)
        if bool(r.graph_replay):
            cop = rec["cap_op"].iloc[pos] if rec is not None else np.nan
            if cop == cop and cop is not None and int(cop) >= 0:
                cap = a.graph_ops.captures[int(r.rank)]
                key = ("cap", int(r.rank), int(rec["replay"].iloc[pos]), int(cop))
                if key not in info:
                    c = int(cop)
                    info[key] = (str(cap.names[c]), cap.dims[c], cap.types[c], cap.conc[c], "graph_capture")
            elif key not in info:
                info[key] = ("", None, None, None, "unknown")
        elif int(r.op_idx) >= 0 and len(ops):
            oi = int(r.op_idx)
            key = ("op", int(r.rank), oi)
            if key not in info:
                info[key] = (str(ops["name"].iat[oi]), ops["input_dims"].iat[oi], ops["input_types"].iat[oi],
                             ops["concrete"].iat[oi], "shapes")
        elif key not in info:
            info[key] = ("", None, None, None, "unknown")
        inst.append(key)
    sel = sel.assign(_inst=pd.Series(inst, index=sel.index, dtype=object))
    memo: dict[tuple[Any, ...], tuple[dict[str, Any] | None, str]] = {}
    out = []
    for key, g in sel.groupby("_inst", sort=False):
        name, dims, types, conc, src = info[key]
        top = g.index[int(np.argmax(g["dur"].to_numpy()))]
        row = {"rank": int(g["rank"].iat[0]), "kernel": top, "family": family(str(k.at[top, "name"])),
               "op_name": name or None, "us": float(g["dur"].sum()), "shape_source": src}
        if not name:
            row["reason"] = "no CPU op (graph replay without a matched capture trace, or none linked): shapes unknown"
            row["shape_source"] = "unknown"
        else:
            mk = (name, dims, types, conc)
            if mk not in memo:
                memo[mk] = model_op(name, _decode(dims), _decode(types), _decode(conc)) if dims is not None else \
                    (None, f"{name}: shapes not recorded")
            m, why = memo[mk]
            if m is None:
                row["reason"], row["shape_source"] = why, "unknown"
            else:
                row.update(m)
                row["reason"] = ""
        out.append(row)
    return out


def _bmm_pairs(a: Analysis, calls: pd.DataFrame) -> list[dict[str, Any]]:
    """QK^T bmm, softmax, PV bmm on one rank, back to back among its batched GEMMs: one attention call."""
    if not len(calls):
        return []
    c = calls[calls["op_name"].to_numpy(dtype=object) == "aten::bmm"]
    if not len(c):
        return []
    b = pd.to_numeric(c["batch"], errors="coerce")
    c = c[(b > 1).to_numpy() & c["m"].notna().to_numpy()]
    if len(c) < 2:
        return []
    k = a.kernels
    ts = k.loc[c["kernel"].to_numpy(), "ts"].to_numpy(dtype=float)
    c = c.assign(t_start=ts).sort_values(["rank", "t_start"], kind="stable")
    # the softmax between them: by its op (eager) or its kernel's name (a CUDA-graph replay has no op)
    def has_softmax(v: Any) -> bool:
        return "softmax" in str(v).lower()

    soft_mask = np.asarray(per_distinct(k["name"], has_softmax), dtype=bool)
    if "op_path" in k:
        soft_mask = soft_mask | np.asarray(per_distinct(k["op_path"], has_softmax), dtype=bool)
    soft = k[soft_mask]
    soft_ts = {int(r): np.sort(g["ts"].to_numpy(dtype=float)) for r, g in soft.groupby("rank")}
    out = []
    rows = list(c.itertuples(index=False))
    i = 0
    while i + 1 < len(rows):
        q, p = rows[i], rows[i + 1]
        st = soft_ts.get(int(q.rank))
        ok = (q.rank == p.rank and q.batch == p.batch and q.m == p.m and q.n == p.k and st is not None
              and _between(st, q.t_start, p.t_start))
        if not ok:
            i += 1
            continue
        fl = _sum(q.flops, p.flops)
        by = _sum(q.bytes, p.bytes)
        out.append({"rank": int(q.rank), "kernel": q.kernel, "family": BMM_FAMILY, "op_name": "aten::bmm",
                    "dtype": q.dtype, "batch": int(q.batch), "heads": int(q.m), "q_len": 1, "ctx": int(q.n),
                    "d": int(q.k), "dv": int(p.n), "flops": fl, "bytes": by, "us": float(q.us) + float(p.us),
                    "shape_source": q.shape_source, "reason": "", "_pv_kernel": p.kernel})
        i += 2
    return out


def _between(sorted_ts: np.ndarray, lo: float, hi: float) -> bool:
    """Whether a time of ``sorted_ts`` lies strictly between ``lo`` and ``hi``."""
    i = int(np.searchsorted(sorted_ts, lo, side="right"))
    return i < len(sorted_ts) and bool(sorted_ts[i] < hi)


def _sum(x: Any, y: Any) -> float:
    try:
        return float(x) + float(y)
    except (TypeError, ValueError):
        return float("nan")


def attention_table(calls: pd.DataFrame, spec: GpuSpec | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the calls with their roofline, the rows per attention kernel family and shape)."""
    if not len(calls):
        return calls, pd.DataFrame(columns=ATTENTION_COLUMNS)
    calls = calls.copy()
    peak = np.array([spec.peak(d) if spec is not None and isinstance(d, str) else None
                     for d in calls["dtype"].tolist()], dtype=float)
    roof = floors(calls["flops"].to_numpy(), calls["bytes"].to_numpy(), calls["us"].to_numpy(), peak,
                  spec.mem_bw_gbps if spec is not None else None, np.ones(len(calls), dtype=bool))
    for c, v in roof.items():
        calls[c] = v
    calls["peak_tflops"] = peak
    keys = ["family", "op_name", "dtype", "batch", "heads", "q_len", "ctx", "d", "dv", "shape_source", "reason"]
    kf = calls[keys].astype(object).where(calls[keys].notna(), None)
    codes, uniq = pd.factorize(pd.Series(list(map(tuple, kf.to_numpy().tolist()))), sort=False)
    n = len(uniq)
    agg = pd.DataFrame([dict(zip(keys, u, strict=True)) for u in uniq])
    agg["cls"] = "attention"
    agg["calls"] = np.bincount(codes, minlength=n)
    us = calls["us"].to_numpy(dtype=float)
    agg["us"] = np.bincount(codes, weights=us, minlength=n)
    for c in ("flops", "bytes"):
        v = pd.to_numeric(calls[c], errors="coerce").to_numpy(dtype=float)
        s = np.bincount(codes, weights=np.nan_to_num(v), minlength=n)
        bad = np.bincount(codes, weights=~np.isfinite(v), minlength=n) > 0
        agg[c] = np.where(bad, np.nan, s)
    pk = np.array([spec.peak(d) if spec is not None and isinstance(d, str) else None for d in agg["dtype"].tolist()],
                  dtype=float)
    bw = spec.mem_bw_gbps if spec is not None and spec.mem_bw_gbps else np.nan
    with np.errstate(divide="ignore", invalid="ignore"):
        agg["mean_us"] = agg["us"] / agg["calls"]
        agg["tflops"] = np.where(agg["us"] > 0, agg["flops"] / agg["us"] / 1e6, np.nan)
        agg["gbps"] = np.where(agg["us"] > 0, agg["bytes"] / agg["us"] / 1e3, np.nan)
        agg["pct_peak"] = 100.0 * agg["tflops"] / pk
        agg["pct_bw"] = 100.0 * agg["gbps"] / bw
    for c, v in group_roofline(calls, codes, n).items():
        if c in ("floor_us", "bound", "pct_roofline"):
            agg[c] = v
    agg = agg.sort_values("us", ascending=False, kind="stable").reset_index(drop=True)
    return calls, agg[ATTENTION_COLUMNS]


def attention_json(t: pd.DataFrame | None) -> list[dict[str, Any]]:
    """The ``attention`` section of the analysis JSON."""
    from traceinspect.measure.roofline import roof_json
    from traceinspect.units import json_num

    out: list[dict[str, Any]] = []
    if t is None:
        return out
    for r in t.itertuples(index=False):
        def num(v: Any, nd: int = 3) -> Any:
            return json_num(v, nd) if v is not None else None

        def i(v: Any) -> int | None:
            try:
                f = float(v)
            except (TypeError, ValueError):
                return None
            return int(f) if np.isfinite(f) else None

        out.append({
            "family": r.family, "op": r.op_name if isinstance(r.op_name, str) else None,
            "dtype": r.dtype if isinstance(r.dtype, str) else None,
            "batch": i(r.batch), "heads": i(r.heads), "q_len": i(r.q_len), "ctx": i(r.ctx), "d": i(r.d),
            "dv": i(r.dv), "calls": int(r.calls), "us": num(r.us), "mean_us": num(r.mean_us),
            "gflop": num(r.flops / 1e9 if r.flops == r.flops else None), "bytes": num(r.bytes, 0),
            "tflops": num(r.tflops), "gbps": num(r.gbps), "pct_peak": num(r.pct_peak, 2),
            "shape_source": r.shape_source, "reason": r.reason if isinstance(r.reason, str) and r.reason else None,
            **roof_json(r)})
    return out
