"""The document's ``report`` section: what the reports show that the rest of the document does not hold, so
that every report is made from the document alone (``traceinspect report analysis.json``).

- ``kernels`` and ``ops``: the per-kernel-name and per-CPU-op tables (column lists; the per-step columns
  of the report's tables and CSV files are derived from them by :mod:`traceinspect.render.tables`);
- ``timeline``: the representative step's kernels, one lane per (rank, stream), as the page draws them;
- ``after_timeline``: that step as the replay of the top finding's fix places it;
- ``rules``: the ``why`` and ``references`` of each rule that has a finding.

Kernel names in the timelines are indices into ``kernels.name``, so each name is written once.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.tables import factorize_text, groups, sorted_text_codes, text_values
from traceinspect.units import short_name

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

# kernels a report timeline carries (over all lanes): keeps the document and report of a long multi-rank
# step small; the longest kernels are kept and the caption says so
TIMELINE_KERNEL_BUDGET = 150_000
SHAPE_TEXT_WIDTH = 160


def launching_ops(kernels: Any) -> dict[tuple[str, str], str]:
    """For each (kernel name, class), the CPU op that launches it most often (none when no op is linked,
    as for CUDA-graph replays). ``kernels`` is the analysis' kernels table."""
    if kernels is None or not len(kernels) or "op_name" not in kernels.columns:
        return {}
    ops = kernels["op_name"]
    linked = text_values(ops) != ""
    if not linked.any():
        return {}
    # counted on integer codes of the three text columns; ties go to the op name that sorts first
    nc, nu = factorize_text(kernels["name"].to_numpy(dtype=object)[linked])
    cc, cu = factorize_text(text_values(kernels["cls"])[linked])
    oc, ou = factorize_text(ops[linked])
    pair, first = groups(nc, cc, oc)
    n = np.bincount(pair)
    best: dict[tuple[str, str], tuple[int, str]] = {}
    for i, c in zip(first.tolist(), n.tolist(), strict=True):
        key, op = (str(nu[nc[i]]), str(cu[cc[i]])), str(ou[oc[i]])
        b = best.get(key)
        if b is None or c > b[0] or (c == b[0] and op < b[1]):
            best[key] = (c, op)
    return {key: best[key][1] for key in sorted(best)}


def _columns(df: pd.DataFrame, cols: list[str]) -> dict[str, list[Any]]:
    return {c: df[c].tolist() for c in cols}


def kernel_rows(a: Analysis) -> dict[str, list[Any]]:
    """One entry per (kernel name, class), most total time first (launches of one name that got different
    classes are entries of their own, as in ``top_kernels``): the CPU op that launches it most often,
    calls, total and mean time over the analysed steps (µs)."""
    k = a.kernels
    cols = ["name", "cls", "launched_by", "calls", "total_us", "mean_us"]
    if not len(k):
        return {c: [] for c in cols}
    # grouped on codes numbered in the names' (then classes') sort order: the groups and their order are
    # those of grouping the two text columns, without hashing a string per kernel
    codes, names = sorted_text_codes(k["name"])
    ccodes, classes = sorted_text_codes(k["cls"])
    key = codes.astype(np.int64) * (len(classes) + 1) + ccodes
    g = pd.Series(k["dur"].to_numpy()).groupby(key).agg(["size", "sum", "mean"])
    g.columns = ["calls", "total_us", "mean_us"]
    gk = g.index.to_numpy()
    g.insert(0, "cls", classes[gk % (len(classes) + 1)])
    g.insert(0, "name", names[gk // (len(classes) + 1)])
    ops = launching_ops(k)
    g["launched_by"] = [ops.get((n, c), "") for n, c in zip(g["name"], g["cls"], strict=True)]
    return _columns(g.sort_values("total_us", ascending=False, kind="stable"), cols)


def op_rows(a: Analysis) -> dict[str, list[Any]]:
    """One entry per CPU op that launches GPU work, most total time first: its kernel names, calls, total
    time and classes (most time first). CUDA-graph replays, which have no CPU op, are one entry."""
    k = a.kernels
    cols = ["op", "kernels", "calls", "total_us", "classes"]
    if not len(k):
        return {c: [] for c in cols}
    # grouped on integer codes numbered in the texts' sort order: the groups and their order are those of
    # grouping the text columns, without a string per kernel
    oc, olabels = sorted_text_codes(k["op_name"])
    linked = (k["op_idx"].to_numpy() >= 0) & (olabels[oc] != "")
    unlinked = np.where(k["graph_replay"].to_numpy(), len(olabels), len(olabels) + 1)
    labels, inverse = np.unique(np.concatenate(
        [olabels, np.array(["(CUDA graph replay: no CPU op)", "(no CPU op linked)"], dtype=object)]),
        return_inverse=True)
    op = inverse.reshape(-1)[np.where(linked, oc, unlinked)]
    name, _ = sorted_text_codes(k["name"])
    cls, cls_labels = sorted_text_codes(k["cls"])
    dur = pd.Series(k["dur"].to_numpy())
    g = dur.groupby(op).agg(["size", "sum"]).rename(columns={"size": "calls", "sum": "total_us"})
    # distinct kernel names per op: the distinct (op, name) pairs, counted per op
    pairs = np.unique(op.astype(np.int64) * (int(name.max(initial=0)) + 1) + name)
    n_names = np.bincount(pairs // (int(name.max(initial=0)) + 1), minlength=len(labels))
    g.insert(0, "kernels", n_names[g.index.to_numpy()])
    # each op's classes, most time first (ties: class order), from the time per distinct (op, class)
    n_cls = len(cls_labels) + 1
    per = dur.groupby(op.astype(np.int64) * n_cls + cls).sum()
    p_op, p_cls, p_us = per.index.to_numpy() // n_cls, per.index.to_numpy() % n_cls, per.to_numpy()
    o = np.lexsort((-p_us, p_op))
    texts: dict[int, list[str]] = {}
    for q, c in zip(p_op[o].tolist(), cls_labels[p_cls[o]].tolist(), strict=True):
        texts.setdefault(q, []).append(c)
    g["classes"] = [", ".join(texts.get(q, ())) for q in g.index.tolist()]
    g = g.reset_index(names="op")
    g["op"] = labels[g["op"].to_numpy()]
    return _columns(g.sort_values("total_us", ascending=False), cols)


def _shapes_of(a: Analysis, k: pd.DataFrame) -> np.ndarray:
    """Input shapes of each kernel's launching CPU op as text ('' when none is linked)."""
    ops = a.trace.cpu_ops
    out = np.full(len(k), "", dtype=object)
    if not len(ops) or "input_dims" not in ops.columns or "op_idx" not in k.columns:
        return out
    idx = k["op_idx"].to_numpy()
    ok = (idx >= 0) & (idx < len(ops))
    dims = ops["input_dims"].to_numpy(dtype=object)
    cache: dict[int, str] = {}
    for j in np.flatnonzero(ok):
        i = int(idx[j])
        if i not in cache:
            v = dims[i]
            cache[i] = "" if v is None or (isinstance(v, float) and v != v) else short_name(
                json.dumps(v, default=str) if not isinstance(v, str) else v, SHAPE_TEXT_WIDTH)
        out[j] = cache[i]
    return out


def timeline_payload(a: Analysis, kernels: pd.DataFrame, name_index: dict[str, int], t0: float | None = None,
                     budget: int = TIMELINE_KERNEL_BUDGET) -> dict[str, Any]:
    """A timeline's kernels: one lane per (rank, stream), each kernel's start and duration relative to
    ``t0`` (µs), its class, name and launching op's shapes (as indices into shared lists; names into the
    kernel table, ``name_index``). ``kernels`` needs rank, stream, ts, end, dur, cls and name columns
    (op_idx for shapes); kernels with other times (a what-if) give another timeline of the same kind."""
    k = kernels.sort_values(["rank", "stream", "ts"], kind="stable")
    if len(k) > budget:  # the longest kernels carry the picture; the caption says so
        k = k.nlargest(budget, "dur").sort_values(["rank", "stream", "ts"], kind="stable")
    t0 = float(k["ts"].min()) if t0 is None else float(t0)
    span = max(float(k["end"].max()) - t0, 1e-3)
    labels = {r.rank: r.label for r in a.trace.ranks}
    cls_codes, cls_names = factorize_text(k["cls"])
    name_codes, names = factorize_text(k["name"])
    shp = _shapes_of(a, k)
    shp_codes, shapes = pd.factorize(pd.Series(shp, dtype=object))
    ts = np.round(k["ts"].to_numpy(dtype=np.float64) - t0, 3)
    dur = np.round(k["end"].to_numpy(dtype=np.float64) - k["ts"].to_numpy(dtype=np.float64), 3)
    ranks, streams = k["rank"].to_numpy(), k["stream"].to_numpy()
    lanes = []
    order = k.groupby(["rank", "stream"], sort=False)["dur"].sum().reset_index()
    order = order.sort_values(["rank", "dur"], ascending=[True, False])
    for rank, stream in zip(order["rank"].tolist(), order["stream"].tolist(), strict=True):
        m = (ranks == rank) & (streams == stream)
        lanes.append({"rank": int(rank), "stream": int(stream), "label": f"{labels.get(int(rank), rank)} s{stream}",
                      "ts": ts[m].tolist(), "dur": dur[m].tolist(), "cls": cls_codes[m].tolist(),
                      "name": name_codes[m].tolist(), "shape": shp_codes[m].tolist()})
    return {"span": round(span, 3), "lanes": lanes, "classes": [str(c) for c in cls_names],
            "names": [name_index[str(n)] for n in names], "shapes": [str(x) for x in shapes], "kernels": len(k)}


def _step_kernels(a: Analysis) -> tuple[int | None, dict[int, int], pd.DataFrame]:
    pos, rows = a.representative_step()
    if pos is None or not rows:
        return pos, rows, a.kernels.iloc[:0]
    return pos, rows, a.kernels[a.kernels["step"].isin(list(rows.values()))]


def timeline(a: Analysis, name_index: dict[str, int], budget: int = TIMELINE_KERNEL_BUDGET) -> dict[str, Any]:
    """The representative step (``timeline.step_index``): its kernel lanes on one clock, where each rank's
    step starts and ends (``marks``), and how many kernels it has (``kernels_in_step``; ``kernels`` are
    those drawn); ``{"reason"}`` when there is none."""
    pos, rows, k = _step_kernels(a)
    if pos is None or not rows:
        return {"reason": "no analysed step"}
    if not len(k):
        return {"reason": "the representative step has no kernels"}
    data = timeline_payload(a, k, name_index, budget=budget)
    t0 = float(k["ts"].min())
    labels = {r.rank: r.label for r in a.trace.ranks}
    marks = []
    for _, s in a.steps.loc[list(rows.values())].iterrows():
        if _finite(s["gpu_start"]):
            marks.append({"rank": int(s["rank"]), "label": labels.get(int(s["rank"]), str(s["rank"])),
                          "start": round(float(s["gpu_start"]) - t0, 3), "end": round(float(s["gpu_end"]) - t0, 3)})
    return {"kernels_in_step": len(k), **data, "marks": marks}


def after_timeline(a: Analysis, name_index: dict[str, int], budget: int = TIMELINE_KERNEL_BUDGET) -> dict[str, Any]:
    """The representative step as the replay of the top finding's fix places it, on the measured step's
    time axis (``span`` at least the measured step's); ``{"reason"}`` when there is nothing to show."""
    top = a.findings[0] if a.findings else None
    pred = getattr(top, "prediction", None) if top is not None else None
    if top is None or pred is None or pred.run is None or a.replay is None:
        return {"reason": "no finding with a replayed fix"}
    m = a.replay.model
    pos, rows, k = _step_kernels(a)
    mask = m.g_pos == pos if pos is not None else np.zeros(m.n_ops, dtype=bool)
    if not mask.any():
        return {"reason": "the representative step was not among the replayed steps"}
    t0, span = float(k["ts"].min()), float(k["end"].max() - k["ts"].min())
    after = k[k.index.isin(m.g_kidx[mask])].copy()
    after["ts"] = pd.Series(pred.run.g_start[mask], index=m.g_kidx[mask]).reindex(after.index).to_numpy()
    after["end"] = pd.Series(pred.run.g_end[mask], index=m.g_kidx[mask]).reindex(after.index).to_numpy()
    after["dur"] = after["end"] - after["ts"]
    t0 = min(t0, float(after["ts"].min()))
    data = timeline_payload(a, after, name_index, t0=t0, budget=budget)
    data["span"] = round(max(span, data["span"]), 3)  # the measured step's axis, so the saving shows
    labels = {r.rank: r.label for r in a.trace.ranks}
    data["marks"] = [{"rank": int(r), "label": labels.get(int(r), str(r)),
                      "start": round(float(g["ts"].min()) - t0, 3), "end": round(float(g["end"].max()) - t0, 3)}
                     for r, g in after.groupby("rank")]
    label = str(next((fx.get("label") for fx in top.fixes if fx.get("predicted_step_us") is not None), top.rule))
    return {"rule": str(top.rule), "label": label, "replayed_step_us": _float(pred.replayed_step_us),
            "predicted_step_us": _float(pred.predicted_step_us), **data}


def rule_texts(a: Analysis) -> dict[str, dict[str, Any]]:
    """The ``why`` and ``references`` of each rule with a finding (kept on the rule, shown by the report)."""
    rules = a.rule_set
    out: dict[str, dict[str, Any]] = {}
    if rules is None:
        return out
    for f in a.findings:
        rule = rules.get(str(f.rule))
        if rule is not None and str(f.rule) not in out:
            out[str(f.rule)] = {"why": getattr(rule, "why", ""),
                                "references": list(getattr(rule, "references", []) or [])}
    return out


def report_section(a: Analysis, budget: int = TIMELINE_KERNEL_BUDGET) -> dict[str, Any]:
    """The ``report`` section of the document."""
    kernels = kernel_rows(a)
    name_index: dict[str, int] = {}
    for i, n in enumerate(kernels["name"]):
        name_index.setdefault(n, i)  # a name's first row (of its classes, the one with the most time)
    return {"kernels": kernels, "ops": op_rows(a), "timeline": timeline(a, name_index, budget),
            "after_timeline": after_timeline(a, name_index, budget), "rules": rule_texts(a)}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and bool(np.isfinite(v))


def _float(v: Any) -> float | None:
    return float(v) if _finite(v) else None
