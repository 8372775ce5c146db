"""Stage 7, document: the ``traceinspect.analysis/1`` document built from the pipeline's results (the
only place it is assembled; see the README's JSON contract)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.document import REPORT, SCHEMA
from traceinspect.document.report import report_section
from traceinspect.measure.between import between_steps
from traceinspect.measure.time import percentile, top_kernels
from traceinspect.model.classes import CLASSES
from traceinspect.units import json_num
from traceinspect.version import __version__

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


def _coverage(a: Analysis) -> dict[str, Any]:
    k = a.kernels
    total = float(k["dur"].sum()) or 1.0
    unknown = k[k["cls"] == "other"]
    top_unknown = (unknown.groupby("name")["dur"].agg(us="sum", calls="count")
                   .sort_values("us", ascending=False).head(10).reset_index())
    all_k = a.trace.kernels
    return {
        "unknown_share": json_num(unknown["dur"].sum() / total, 6),
        "top_unknown": [{"name": r.name, "us": json_num(r.us), "calls": int(r.calls)}
                        for r in top_unknown.itertuples()],
        "graph_replay_share": json_num(k.loc[k["graph_replay"], "dur"].sum() / total),
        "cpu_op_linked_share": json_num(k.loc[k["op_idx"] >= 0, "dur"].sum() / total),
        "runtime_linked_share": json_num(k.loc[k["rt_idx"] >= 0, "dur"].sum() / total),
        "kernels_outside_steps": int((all_k["step"] < 0).sum()),
        "kernels_analysed": len(k),
        "step_source": sorted(a.steps["source"].unique().tolist()),
        # per rank: were the CPU ops of graph-replayed kernels recovered from a capture trace, and why not
        "graph_capture": a.graph_ops.to_json()["graph_ops"] if a.graph_ops is not None else [],
    }


def _run_meta(a: Analysis) -> dict[str, Any]:
    si = a.server_info
    info = a.trace.ranks[0]
    dev = info.device
    rm = a.run_model
    return {
        "model": si.get("served_model_name") or si.get("model_path"),
        "tp_size": rm.value("tp_size") or a.n_ranks,
        "ranks": a.n_ranks,
        "device": dev.name if dev else None,
        "compute_capability": dev.compute_capability if dev else None,
        "kv_cache_dtype": rm.value("kv_cache_dtype"),
        "kv_pool_tokens": rm.value("kv_pool_tokens"),
        "attention_backend": si.get("attention_backend"),
        "batch_median": json_num(rm.value("batch")),
        "cuda_graph": bool(a.kernels["graph_replay"].mean() > 0.5) if len(a.kernels) else False,
        "cuda_runtime_version": info.cuda_runtime_version,
        "cuda_driver_version": info.cuda_driver_version,
        **(a.run_kind.to_json() if a.run_kind is not None else {"kind": None, "kind_evidence": "not decided"}),
        "facts": rm.to_json(),
    }


# server_info keys that describe the moment, not the configuration (left out of server_config)
_VOLATILE = re.compile(r"throughput|utilization|timestamp|_time$|^time|uptime|num_running|num_queue|"
                       r"queue_|memory_usage|^status$|^load", re.I)


def server_config(si: dict[str, Any] | None) -> dict[str, Any]:
    """The server's resolved configuration: the scalar keys of server_info (nested ``internal_states``
    of newer SGLang flattened in from its first entry), without the keys that change from one moment to
    the next (throughput, queue lengths, times). ``diff`` and ``gate`` list the keys that differ."""
    si = si or {}
    out: dict[str, Any] = {}
    states = si.get("internal_states")
    if isinstance(states, list) and states and isinstance(states[0], dict):
        out.update({k: v for k, v in states[0].items() if isinstance(v, (str, int, float, bool)) or v is None})
    for k, v in si.items():
        if isinstance(v, (str, int, float, bool)) or v is None:
            out[k] = v
    return {k: out[k] for k in sorted(out) if not _VOLATILE.search(k)}


def _step_samples(samples: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per aligned step: the TP step time and the mean per-rank time of each class."""
    cls_cols = [c for c in samples.columns if str(c).startswith("class.")]
    step = samples["step_us"].to_numpy(dtype=np.float64) if len(samples) else np.zeros(0)
    values = samples[cls_cols].to_numpy(dtype=np.float64) if cls_cols else np.zeros((len(samples), 0))
    names = [str(c)[6:] for c in cls_cols]
    return [{"step_us": json_num(st), "classes": {c: json_num(v) for c, v in zip(names, row, strict=True)}}
            for st, row in zip(step, values, strict=True)]


def _class_matrix(cs: pd.DataFrame, steps: pd.Index) -> tuple[list[str], list[bool], np.ndarray | None]:
    """The class time table (one row per rank, step and class) as one row per step of ``steps`` and one
    column per class (observed classes in the column's order, 0.0 where a step has none of a class): the
    class names, whether each step has any row, and the matrix (None when there are no classes)."""
    if not len(cs):
        return [], [False] * len(steps), None
    cls = cs["cls"]
    if isinstance(cls.dtype, pd.CategoricalDtype):
        codes = cls.cat.codes.to_numpy().astype(np.int64)
        seen = np.unique(codes[codes >= 0])
        names = [str(c) for c in cls.cat.categories[seen]]
        col = np.searchsorted(seen, codes)
        ok = codes >= 0
    else:
        names_arr, col = np.unique(cls.to_numpy(dtype=object).astype(str), return_inverse=True)
        names, ok = [str(c) for c in names_arr], np.ones(len(cs), dtype=bool)
    row = steps.get_indexer(cs["step"].to_numpy())
    ok &= row >= 0
    values = np.zeros((len(steps), len(names)), dtype=np.float64)
    np.add.at(values, (row[ok], col[ok]), cs["us"].to_numpy(dtype=np.float64)[ok])  # (one row per cell)
    present = np.zeros(len(steps), dtype=bool)
    present[row[ok]] = True
    return names, present.tolist(), values


def _rank_samples(a: Analysis) -> list[dict[str, Any]]:
    """One entry per analysed step of each rank: the rank's GPU span and its time per class. The gate
    pools these across ranks for classes whose time on one rank does not depend on the others."""
    sel = a.selected
    cols, present, values = _class_matrix(a.class_steps, sel.index)
    out = []
    for i, (rank, span) in enumerate(zip(sel["rank"].tolist(), sel["span_us"].tolist(), strict=True)):
        row = zip(cols, values[i], strict=True) if present[i] and values is not None else ()
        out.append({"rank": int(rank), "step_us": json_num(span),
                    "classes": {c: json_num(v) for c, v in row if v}})
    return out


def _timeline_step(a: Analysis) -> dict[str, Any]:
    """The step the report's timeline draws: each rank's GPU window, busy and idle time in it."""
    pos, rows = a.representative_step()
    labels = {r.rank: r.label for r in a.trace.ranks}
    out = []
    for rank, i in sorted(rows.items()):
        s = a.steps.loc[i]
        out.append({"rank": rank, "label": labels.get(rank, str(rank)), "gpu_start_us": json_num(s["gpu_start"]),
                    "span_us": json_num(s["span_us"]), "busy_us": json_num(s["busy_us"]), "idle_us": json_num(s["idle_us"])})
    return {"step_index": pos, "ranks": out}


def trace_sections(a: Analysis) -> dict[str, Any]:
    """The sections of the document made from the trace tables and the step selection alone (ranks,
    steps, classes, top kernels, timeline, coverage): what no measure and no rule changes, so that they
    are the same whatever the rules found."""
    ts = a.trace
    samples = a.step_samples()
    n_steps = a.steps_per_rank()
    ranks = []
    # each rank's kernel time, from the columns (not a copy of the rank's rows of every column)
    k_rank, k_dur = ts.kernels["rank"].to_numpy(), ts.kernels["dur"].to_numpy()
    is_kernel = (ts.kernels["kind"] == "kernel").to_numpy()
    for info in ts.ranks:
        sel = a.selected[a.selected["rank"] == info.rank]
        ct = a.class_totals[a.class_totals["rank"] == info.rank]
        rk_dur = pd.Series(k_dur[(k_rank == info.rank) & is_kernel])
        rsteps = a.steps[a.steps["rank"] == info.rank]
        ns = max(len(sel), 1)
        ranks.append({
            "rank": info.rank,
            "label": info.label,
            "device": info.device.name if info.device else None,
            "steps": len(sel),
            "steps_found": {str(k): int(v) for k, v in rsteps.groupby("phase").size().items()},
            "steps_excluded_edge": int(rsteps["edge"].sum()),
            "step_us": {"median": json_num(percentile(sel["span_us"], 50)), "p90": json_num(percentile(sel["span_us"], 90))},
            "gpu_busy_us": json_num(percentile(sel["busy_us"], 50)),
            "idle_us": json_num(percentile(sel["idle_us"], 50)),
            "kernel_us": json_num(float(sel["kernel_us"].sum())),
            "kernel_us_total": json_num(float(rk_dur.sum())),
            "classes": {r.cls: {"us": json_num(r.us), "us_per_step": json_num(r.us / ns), "share": json_num(r.share, 6),
                                "calls": int(r.calls)} for r in ct.itertuples()},
        })
    total = float(a.kernels["dur"].sum()) or 1.0
    per_cls = a.kernels.groupby("cls", observed=True)["dur"].agg(["sum", "count"])
    # the divisor of every per-step figure: the analysed steps of all ranks (a.kernels are their kernels)
    denom = max(len(a.selected), 1)
    step_us = percentile(samples["step_us"], 50)
    # the step time as the document gives it (steps.median_us): a share the reports compute from the document
    # (their kernel and op tables) is then the same number, not one rounded differently
    of_step = json_num(step_us) if np.isfinite(step_us) and step_us > 0 else None

    def step_share(us_per_step: float) -> Any:
        return json_num(float(us_per_step) / of_step, 15) if of_step else None

    classes = {
        c: {"us_per_step": json_num(per_cls.loc[c, "sum"] / denom), "share": json_num(per_cls.loc[c, "sum"] / total, 6),
            "share_of_step": step_share(per_cls.loc[c, "sum"] / denom),
            "calls_per_step": json_num(per_cls.loc[c, "count"] / denom)}
        for c in CLASSES if c in per_cls.index
    }
    step_sources = sorted(a.steps["source"].unique().tolist())
    return {
        "ranks": ranks,
        "steps": {
            "phase": a.phase,
            "count": n_steps,
            "rank_steps": len(a.selected),
            "median_us": json_num(step_us),
            "p90_us": json_num(percentile(samples["step_us"], 90)),
            "source": step_sources[0] if len(step_sources) == 1 else step_sources,
            "found": {str(k): int(v) for k, v in a.steps.groupby("phase").size().items()},
            "analysed": {str(k): int(v) for k, v in a.selected.groupby("phase").size().items()},
            "excluded_edge": int(a.steps["edge"].sum()),
            "excluded": [{"rank": int(r.rank), "idx": int(r.idx), "why": str(r.excluded_why)}
                         for r in a.steps[~a.steps["included"]].itertuples()],
            "samples": _step_samples(samples),
            "rank_samples": _rank_samples(a),
            **between_steps(a.steps, a.phase),
        },
        "classes": classes,
        "top_kernels": [{"name": r.name, "cls": r.cls, "calls": int(r.calls), "us": json_num(r.us),
                         "mean_us": json_num(r.mean_us), "share": json_num(r.share, 6),
                         "us_per_step": json_num(r.us / denom), "calls_per_step": json_num(r.calls / denom),
                         "share_of_step": step_share(r.us / denom)}
                        for r in top_kernels(a.kernels).itertuples()],
        "timeline": _timeline_step(a),
        "coverage": _coverage(a),
    }


def build_document(a: Analysis, report: bool = True) -> dict[str, Any]:
    """Build the ``traceinspect.analysis/1`` document (``report=False``: without the ``report`` section,
    for a caller that only prints the terminal summary, which does not read it)."""
    ts = a.trace
    sec = trace_sections(a)
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "tool": {"name": "traceinspect", "version": __version__},
        "source": {
            "paths": ts.sources,
            "files": [{"path": str(r.path), "rank": r.rank, "label": r.label, "sha256": r.sha256,
                       "size_bytes": r.size_bytes, "rank_source": r.rank_source} for r in ts.ranks],
            "server_info": str(ts.server_info_path) if ts.server_info_path else None,
            "capture_traces": {str(k): str(v) for k, v in sorted(ts.capture_traces.items())},
            "command": a.options.command,
        },
        "run": _run_meta(a),
        "ranks": sec["ranks"],
        "steps": sec["steps"],
        "server_config": server_config(a.server_info),
        "classes": sec["classes"],
        "top_kernels": sec["top_kernels"],
        "findings": [f.to_json() for f in a.findings],
        **a.gaps.to_json(),
        "timeline": sec["timeline"],
        "coverage": sec["coverage"],
        "warnings": list(ts.warnings),
    }
    if a.efficiency is not None:
        doc.update(a.efficiency.to_json())
        from traceinspect.measure.roofline import class_roofline

        roof = class_roofline(a.kernels, a.efficiency, max(a.steps_per_rank(), 1) * a.n_ranks)
        doc["classes"] = {c: {**v, **roof.get(c, {})} for c, v in doc["classes"].items()}
    if a.collectives is not None:
        doc.update(a.collectives.to_json())
    doc["replay"] = replay_json(a)
    if report:
        doc[REPORT] = report_section(a)  # last: written on one line (traceinspect.document.dumps)
    return doc


def replay_json(a: Analysis) -> dict[str, Any]:
    """``replay``: the replay model's size and fidelity, and the step with every finding fixed."""
    out: dict[str, Any] = {"all_fixed": a.all_fixed.to_json() if a.all_fixed is not None else None}
    rp = a.replay
    if rp is not None:
        base = rp.as_measured()
        out["model"] = rp.describe()
        out["measured_step_us"] = json_num(base.measured_step_us, 1)
        out["replayed_step_us"] = json_num(base.replayed_step_us, 1)
        out["ranks"] = base.rank_rows()
    return out
