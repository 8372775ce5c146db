"""The MoE part of the efficiency measure: per-expert M of the MoE GEMMs, the experts per step, and the
cross-check of the recorded shapes against the model config's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.tables import unique_text

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


def _model_reason(a: Analysis) -> str:
    """How the model config gives the rows per expert."""
    rm = a.run_model
    p = getattr(rm.gemms, "plan", None)
    experts, topk = rm.value("experts"), rm.value("top_k")
    ep = getattr(p, "ep", None) or rm.value("ep_size") or 1
    return (f"tokens x top-k / (experts / ep) per step: bs=N of each step x {topk} / ({experts} / {ep}) "
            f"(top-k {rm.describe('top_k')}; experts {rm.describe('experts')}; shapes from the model config "
            f"{rm.config_source}; assumes balanced routing)")


def cross_check(a: Analysis, calls: pd.DataFrame, limit: int = 5) -> list[str]:
    """Warnings where a recorded GEMM shape differs from the one the model config gives the same kernel
    (the recorded shape is used)."""
    t = getattr(a.run_model.gemms, "table", None) if a.run_model is not None else None
    if t is None or not len(t) or not len(calls):
        return []
    g = calls[(calls["kind"].to_numpy() == "gemm") & calls["shape_source"].isin(("shapes", "graph_capture")).to_numpy()]
    if not len(g):
        return []
    pos = t.index.get_indexer(g["kernel"].to_numpy())
    on = pos >= 0
    if not on.any():
        return []
    g, pos = g[on], pos[on]
    model = t["shape"].to_numpy(dtype=object)[pos]
    names = t["gemm"].to_numpy(dtype=object)[pos]
    seen: dict[tuple[Any, ...], int] = {}
    for rec, mod, name, op, src in zip(g[["m", "n", "k", "batch", "groups"]].itertuples(index=False, name=None),
                                       model.tolist(), names.tolist(), g["op_name"].tolist(),
                                       g["shape_source"].tolist(), strict=True):
        m, n, k, b, grp = (x if x is None or x == x else None for x in rec)
        if m is None or n is None or k is None:
            continue
        per = float(m) / float(grp or 1)
        mm = float(mod.m or 0) / float(mod.groups or 1)
        if (int(n), int(k)) == (mod.n, mod.k) and abs(per - mm) <= 0.01 * max(mm, 1.0) and int(b or 1) == mod.batch:
            continue
        key = (name, op, src, per, int(n), int(k), mm, mod.n, mod.k)
        seen[key] = seen.get(key, 0) + 1
    out = []
    for (name, op, src, per, n, k, mm, mn, mk), c in sorted(seen.items(), key=lambda kv: -kv[1])[:limit]:
        where = "the capture trace" if src == "graph_capture" else "the recorded shapes"
        out.append(f"GEMM shape from {where} ({op} M={per:g} N={n} K={k}) differs from the model config's {name} "
                   f"(M={mm:g} N={mn} K={mk}, {a.run_model.config_source}) on {c} call(s): the recorded shape is used")
    return out

def _moe(a: Analysis, calls: pd.DataFrame) -> dict[str, Any]:
    rm = a.run_model
    experts, ekey = rm.value("experts"), rm.describe("experts")
    topk, tkey = rm.value("top_k"), rm.describe("top_k")
    sel = a.selected
    toks = sel["toks"].where(sel["toks"] >= 0, sel["bs"]) if "toks" in sel else sel["bs"]
    toks = toks[toks >= 0]
    tokens = float(np.median(toks)) if len(toks) else None
    out: dict[str, Any] = {"experts": experts, "topk": topk, "tokens": tokens,
                           "experts_key": ekey, "topk_key": tkey}
    mc = calls.loc[(calls["kind"].to_numpy() == "gemm") & calls["moe"].to_numpy().astype(bool),
                   ["m", "groups", "shape_source", "reason"]] if len(calls) else calls
    known = mc[mc["m"].notna()] if len(mc) else mc
    if len(known):
        groups = known["groups"].astype(float)
        m = known["m"].astype(float) / groups
        sources = sorted(unique_text(known["shape_source"]))
        grouped = bool((groups > 1).any())
        dist = m.round(2).value_counts().sort_index()
        out["per_expert_m"] = {
            "value": round(float(m.mean()), 2), "min": round(float(m.min()), 2), "max": round(float(m.max()), 2),
            "source": sources[0] if len(sources) == 1 else "+".join(sources),
            "reason": (_model_reason(a) if sources == ["model_config"] else
                       "shapes (mean over experts): rows of the grouped GEMM / experts" if grouped else
                       "M of each per-expert GEMM call, from its recorded shapes"
                       + (" (recovered from the graph-capture trace)" if "graph_capture" in sources else "")),
            "calls": len(known), "distribution": {str(k): int(v) for k, v in dist.items()},
        }
        if len(known) < len(mc):
            out["per_expert_m"]["reason"] += f"; {len(mc) - len(known)} MoE GEMM calls without shapes left out"
        return out
    if experts and topk and tokens is not None:
        v = tokens * topk / experts
        out["per_expert_m"] = {
            "value": round(v, 2), "min": None, "max": None, "source": "server_metadata",
            "reason": (f"tokens x top-k / experts = {tokens:g} x {topk} / {experts} (tokens: median bs= of the "
                       f"analysed steps; top-k {tkey}; experts {ekey}; assumes balanced routing)" + (f"; shapes unknown: {mc['reason'].iloc[0]}" if len(mc) else "")),
        }
        return out
    missing = [n for n, v in (("token count (bs= in step names)", tokens), ("experts", experts),
                              ("top-k", topk)) if v is None]
    g = calls[calls["kind"].to_numpy() == "gemm"] if len(calls) else calls
    blind = g[g["shape_source"] == "unknown"] if len(g) else g
    if not len(mc) and not len(blind) and experts is None:
        why = "no MoE GEMM kernels in the analysed steps and no expert count (server_info or --experts)"
    else:
        first = mc if len(mc) else blind
        why = ("could not be decided: no recorded shapes show the expert GEMMs"
               + (f" ({first['reason'].iloc[0]})" if len(first) else "")
               + f" and the server metadata lacks {', '.join(missing)}")
    out["per_expert_m"] = {"value": None, "min": None, "max": None, "source": "unknown", "reason": why}
    return out
