"""What the HTML report's sections show, as plain values for the template, each from the analysis
document: the headline, finding cards with their evidence, run metadata, files, class rows, coverage,
memory-bound kernels, MoE and the collectives' and critical path's notes."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from traceinspect.render import kernel_label, kernel_labels
from traceinspect.render.palette import class_color, severity_color
from traceinspect.render.story import (
    Open,
    rank_steps,
    saving_share,
    saving_text,
    share_of_step,
    step_share,
    story,
)
from traceinspect.render.svg import get, isnum
from traceinspect.render.whatif import group_note, variant_lines
from traceinspect.units import fmt_bytes, fmt_count, fmt_pct, fmt_us
from traceinspect.version import __version__

_URL = re.compile(r"https?://[^\s<>\"')\]]+")


def fmt_value(key: str, v: Any) -> str:
    """A scalar evidence value as text, using the key's unit suffix (``_us``, ``share``, ``_bytes``)."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isnum(v):
        k = key.lower()
        if k.endswith("_us") or k.endswith("us_per_step") or k == "us":
            return fmt_us(float(v))
        if "share" in k or k.endswith("_frac") or k.endswith("fraction"):
            return fmt_pct(float(v)) if abs(float(v)) <= 1.5 else f"{float(v):,.3g}"
        if k.startswith("pct_") or k.endswith("_pct"):
            return fmt_pct(float(v) / 100)
        if "bytes" in k:
            return fmt_bytes(float(v))
        if k.endswith("per_step") or k.startswith("calls") or k in ("layers", "shapes", "names", "gaps"):
            return fmt_count(float(v))
        if isinstance(v, (int, np.integer)) or (float(v).is_integer() and abs(v) < 1e15):
            return f"{int(v):,}"
        if abs(float(v)) >= 1000:
            return f"{float(v):,.0f}"
        return f"{float(v):.4g}"
    return str(v)


@dataclass
class Headline:
    severity: str
    color: str
    text: str
    detail: str
    rule: str | None = None
    anchor: str | None = None
    others: list[dict[str, Any]] = field(default_factory=list)
    open: list[Open] = field(default_factory=list)
    basis: str = ""


def headline(doc: dict[str, Any], findings: list[dict[str, Any]]) -> Headline:
    """The banner: the lead finding of :func:`~traceinspect.render.story.story` (the one every output
    leads with), the others after it, and the classes or rules the findings leave open."""
    st = story(doc)
    if st.lead is not None:
        f = st.lead
        title = str(f.get("title") or f.get("rule") or "finding")
        detail = (f"Estimated saving: {st.saving}." if st.saving
                  else "Estimated saving: not available (the rule gives no estimate).")
        sev = str(f.get("severity") or "info")
        others = []
        for i, o in enumerate(findings[1:], start=1):
            others.append({"anchor": f"f-{i}", "severity": str(o.get("severity") or "info"),
                           "color": severity_color(str(o.get("severity") or "info")),
                           "title": str(o.get("title") or o.get("rule") or ""),
                           "saving": saving_text(o, doc)})
        return Headline(sev, severity_color(sev), title, detail, str(f.get("rule") or ""), "f-0", others,
                        st.open, st.basis)
    return Headline("none", "#2e7d32", st.quiet, "", open=st.open, basis=st.basis)


def finding_view(i: int, f: dict[str, Any], doc: dict[str, Any], labels: dict[Any, str]) -> dict[str, Any]:
    sev = str(f.get("severity") or "info")
    saving = f.get("est_saving_us_per_step")
    refs = []
    for r in f.get("references") or []:
        if isinstance(r, dict):
            text, url = str(r.get("title") or r.get("url") or ""), str(r.get("url") or "")
        else:
            text = str(r)
            m = _URL.search(text)
            url = m.group(0) if m else ""
        # only web links are clickable; anything else (javascript:, data:) is shown as text
        refs.append({"url": url if url.startswith(("https://", "http://")) else None, "title": text})
    ranks = f.get("ranks")
    ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
    return {
        "id": f"f-{i}", "n": i + 1, "rule": str(f.get("rule") or ""), "severity": sev,
        "color": severity_color(sev), "title": str(f.get("title") or f.get("rule") or ""),
        "message": str(f.get("message") or ""),
        "saving": fmt_us(float(saving)) if isnum(saving) else None,
        "saving_of_step": fmt_pct(saving_share(f, doc)) if isnum(saving) else None,
        # the impact's share of the step (``share`` itself is the replayed saving's)
        "share": fmt_pct(step_share(ev.get("impact_us_per_step"), doc)) if isnum(ev.get("impact_us_per_step"))
        else None,
        "impact": fmt_us(float(ev["impact_us_per_step"])) if isnum(ev.get("impact_us_per_step")) else None,
        "ranks": ", ".join(str(labels.get(r, r)) for r in ranks) if isinstance(ranks, list) and ranks else
        ("all" if ranks is None else str(ranks)),
        "evidence": _evidence_view(f.get("evidence") or {}),
        "remediation": str(f.get("remediation") or "").strip(),
        "why": str(f.get("why") or "").strip(),
        "references": refs,
        "variants": variant_lines(f),
        "group_note": group_note(f),
        "child": bool((f.get("group") or {}).get("parent")),
    }


def _evidence_view(ev: Any) -> list[dict[str, Any]]:
    """Evidence as rows for the template: scalars, small tables (lists of dicts) and nested dicts."""
    if not isinstance(ev, dict):
        return [{"key": "evidence", "kind": "text", "value": str(ev)}]
    rows: list[dict[str, Any]] = []
    for key, v in ev.items():
        key = str(key)
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            cols: list[str] = []
            for x in v[:50]:
                cols.extend(str(c) for c in x if str(c) not in cols)
            body = [[_cell(c, x.get(c)) for c in cols] for x in v[:50]]
            rows.append({"key": key, "kind": "table", "cols": cols, "rows": body, "more": max(len(v) - 50, 0)})
        elif isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            rows.append({"key": key, "kind": "table", "cols": ["key", "value"],
                         "rows": [[{"text": str(k2)}, _cell(str(k2), x)] for k2, x in v.items()], "more": 0})
        elif isinstance(v, list) and all(not isinstance(x, (dict, list)) for x in v):
            rows.append({"key": key, "kind": "text", "value": ", ".join(fmt_value(key, x) for x in v[:50])
                         + (f", … ({len(v) - 50} more)" if len(v) > 50 else "")})
        elif isinstance(v, (dict, list)):
            rows.append({"key": key, "kind": "code", "value": json.dumps(v, indent=1, default=str)[:4000]})
        else:
            cell = _cell(key, v, "value")
            rows.append({"key": key, "kind": "text", "wide": len(cell.get("full") or cell["value"]) > 34, **cell})
    # long values get a full row of the evidence grid, after the short ones
    return sorted(rows, key=lambda r: bool(r.get("wide")))


def _cell(key: str, v: Any, field_: str = "text") -> dict[str, Any]:
    text = fmt_value(key, v) if not isinstance(v, (dict, list)) else json.dumps(v, default=str)
    if len(text) > 90:
        return {field_: kernel_label(text, 90), "full": text}
    return {field_: text}


def meta_rows(doc: dict[str, Any]) -> list[tuple[str, str, bool]]:
    run, steps = doc.get("run") or {}, doc.get("steps") or {}
    gpu = doc.get("gpu") if isinstance(doc.get("gpu"), dict) else {}

    def val(v: Any, unknown: str = "unknown") -> str:
        return unknown if v is None or v == "" else str(v)

    found = ", ".join(f"{k} {v}" for k, v in sorted((steps.get("found") or {}).items()))
    src = steps.get("source")
    src = ", ".join(src) if isinstance(src, list) else src
    dev = val(run.get("device"))
    if run.get("compute_capability"):
        dev += f" (sm {run['compute_capability']})"
    rows: list[tuple[str, str, bool]] = [
        ("Model", val(run.get("model")), False),
        ("Device", dev, False),
        ("TP size", val(run.get("tp_size")) + (f" ({run.get('ranks')} rank files)" if run.get("ranks") else ""),
         False),
        ("KV cache dtype", val(run.get("kv_cache_dtype"), "unknown (no server_info)"), False),
        ("Batch (median bs)", f"{run['batch_median']:g}" if isnum(run.get("batch_median")) else
         val(run.get("batch_median")), False),
        ("Attention backend", val(run.get("attention_backend")), False),
        ("KV pool tokens", f"{run['kv_pool_tokens']:,}" if isnum(run.get("kv_pool_tokens")) else
         val(run.get("kv_pool_tokens")), False),
        ("CUDA graph", "yes (kernels replayed from graphs)" if run.get("cuda_graph") else "no (eager launches)",
         False),
        (f"{str(steps.get('phase', 'decode')).capitalize()} step",
         f"median {fmt_us(steps.get('median_us'))}, p90 {fmt_us(steps.get('p90_us'))} (slowest rank's GPU span)",
         False),
        ("CUDA runtime / driver", f"{_cuda_version(run.get('cuda_runtime_version'))} / "
                                  f"{_cuda_version(run.get('cuda_driver_version'))}", False),
        ("Steps", f"{steps.get('count')} {steps.get('phase')} steps per rank analysed; found (all ranks): "
                  f"{found or 'none'}; edge steps excluded: {steps.get('excluded_edge')}; step source: {src}", True),
    ]
    if gpu:
        if gpu.get("name"):
            peaks = gpu.get("peak_tflops") if isinstance(gpu.get("peak_tflops"), dict) else {}
            specs = ", ".join(f"{k} {v:g}" for k, v in peaks.items() if isnum(v))
            bw = gpu.get("mem_bw_gbps")
            text = (f"{gpu['name']}: dense peak TFLOP/s {specs or 'unknown'}; memory "
                    + (f"{bw:,.0f} GB/s" if isnum(bw) else "bandwidth unknown"))
            if gpu.get("matched_by") or gpu.get("source"):
                text += f" ({gpu.get('matched_by') or gpu.get('source')})"
        else:
            text = f"none: {gpu.get('reason') or 'the device is not in the GPU spec table'}"
        rows.append(("GPU spec used", text, True))
    tool = doc.get("tool") or {}
    rows.append(("Tool", f"{tool.get('name', 'traceinspect')} {tool.get('version', __version__)} "
                         f"(JSON schema {doc.get('schema')})", True))
    return rows


def _cuda_version(v: Any) -> str:
    """CUDA's integer version (12080) as 12.8; other text as it is."""
    if v is None or v == "":
        return "unknown"
    text = str(v)
    if text.isdigit() and len(text) >= 4:
        n = int(text)
        return f"{n // 1000}.{(n % 1000) // 10}"
    return text


def files_view(doc: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    for f in get(doc, "source", "files", default=[]) or []:
        out.append({"label": str(f.get("label", "")), "path": str(f.get("path", "")),
                    "sha256": str(f.get("sha256", "")), "size": fmt_bytes(float(f.get("size_bytes") or 0)),
                    "rank_source": str(f.get("rank_source", ""))})
    si = get(doc, "source", "server_info")
    if si:
        out.append({"label": "server_info", "path": str(si), "sha256": "", "size": "", "rank_source": ""})
    return out


def class_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c, v in sorted((doc.get("classes") or {}).items(), key=lambda kv: -(kv[1].get("us_per_step") or 0)):
        share = share_of_step(v, doc)
        rows.append({"cls": c, "color": class_color(c), "us": v.get("us_per_step"), "us_t": fmt_us(v.get("us_per_step")),
                     "share": share, "share_t": fmt_pct(share),
                     "calls": v.get("calls_per_step"),
                     "calls_t": fmt_count(v["calls_per_step"]) if isnum(v.get("calls_per_step")) else "n/a"})
    return rows


def coverage_view(doc: dict[str, Any]) -> dict[str, Any]:
    cov = doc.get("coverage") or {}
    unknown = cov.get("unknown_share")
    return {
        "classified": fmt_pct(1 - unknown) if isnum(unknown) else "n/a",
        "unknown": fmt_pct(unknown),
        "graph": fmt_pct(cov.get("graph_replay_share")),
        "cpu_op": fmt_pct(cov.get("cpu_op_linked_share")),
        "runtime": fmt_pct(cov.get("runtime_linked_share")),
        "outside": f"{cov.get('kernels_outside_steps', 0):,}",
        "analysed": f"{cov.get('kernels_analysed', 0):,}",
        "top_unknown": [{"name": str(u.get("name", "")), "short": kernel_label(str(u.get("name", "")), 90),
                         "us": fmt_us(u.get("us")), "calls": u.get("calls")} for u in cov.get("top_unknown") or []],
    }


def memory_view(doc: dict[str, Any]) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of the memory-bound kernel table (achieved bandwidth), or the reason there are none."""
    mem = doc.get("memory_bound")
    if mem is None:
        return [], "the analysis has no memory_bound section"
    if isinstance(mem, dict):
        if mem.get("available") is False or mem.get("applicable") is False:
            return [], str(mem.get("reason") or "not measured")
        mem = mem.get("rows") or []
    if not isinstance(mem, list) or not mem:
        return [], "no memory-bound kernel with known bytes moved (needs recorded shapes)"
    per = rank_steps(doc)
    rows = []
    labels = kernel_labels([str(r.get("family") or "") for r in mem[:20] if isinstance(r, dict)], 70)
    for r in mem[:20]:
        if not isinstance(r, dict):
            continue
        calls = r.get("calls") or 0
        us = r.get("us")
        fam = str(r.get("family") or "")
        dtypes = r.get("dtypes")
        rows.append({
            "name": fam, "short": labels.get(fam, kernel_label(fam, 70)), "cls": str(r.get("cls") or ""),
            "color": class_color(str(r.get("cls") or "")),
            "dtypes": ", ".join(str(d) for d in dtypes) if isinstance(dtypes, list) else str(dtypes or ""),
            "calls": calls,
            "bytes_call": fmt_bytes(float(r["bytes"]) / calls) if isnum(r.get("bytes")) and calls else "n/a",
            "us": us / per if isnum(us) else None, "us_t": fmt_us(us / per) if isnum(us) else "n/a",
            "gbps": f"{r['gbps']:,.0f}" if isnum(r.get("gbps")) else "n/a",
            "pct": r.get("pct_bw"), "pct_t": fmt_pct(r["pct_bw"] / 100) if isnum(r.get("pct_bw")) else "n/a",
            "note": str(r.get("reason") or ""),
        })
    return rows, None


def _isfloat(s: Any) -> bool:
    try:
        float(s)
    except (TypeError, ValueError):
        return False
    return True


def moe_view(doc: dict[str, Any]) -> tuple[list[tuple[str, str]], str | None]:
    moe = doc.get("moe")
    if not isinstance(moe, dict):
        return [], "the analysis has no moe section"
    if moe.get("available") is False or moe.get("applicable") is False:
        return [], str(moe.get("reason") or "not measured")
    pem = moe.get("per_expert_m") if isinstance(moe.get("per_expert_m"), dict) else {}
    rows = []
    if pem:
        v = pem.get("value")
        rng = (f" (min {pem.get('min'):g}, max {pem.get('max'):g})" if isnum(pem.get("min")) and
               isnum(pem.get("max")) else "")
        rows.append(("Tokens per expert per GEMM (M)", (f"{v:g}{rng}" if isnum(v) else "not decided")
                     + f" — source: {pem.get('source') or 'unknown'}"))
        if pem.get("reason"):
            rows.append(("How", str(pem["reason"])))
        dist = pem.get("distribution")
        if isinstance(dist, dict) and dist:
            items = sorted(dist.items(), key=lambda kv: -kv[1])[:12]
            rows.append(("M distribution (calls)", ", ".join(
                f"M={float(k):g}: {v}" if _isfloat(k) else f"M={k}: {v}" for k, v in items)))
    for key, label in (("experts", "Experts"), ("topk", "Top-k"), ("tokens", "Tokens per step (median)")):
        if moe.get(key) is not None:
            src = moe.get(f"{key}_key")
            rows.append((label, f"{moe[key]:g}" if isnum(moe[key]) else str(moe[key])) if not src else
                        (label, f"{moe[key]} ({src})"))
    if not rows:
        return [], "no MoE layers found"
    return rows, None


def add_rule_text(doc: dict[str, Any], findings: list[dict[str, Any]]) -> None:
    """Add each finding's rule ``why`` and ``references`` (the document's ``report.rules``)."""
    rules = get(doc, "report", "rules", default=None)
    if not isinstance(rules, dict):
        return
    for f in findings:
        rule = rules.get(str(f.get("rule")))
        if isinstance(rule, dict):
            f.setdefault("why", rule.get("why", ""))
            f.setdefault("references", list(rule.get("references") or []))


def coll_notes(doc: dict[str, Any]) -> list[str]:
    coll = doc.get("collectives")
    if not isinstance(coll, dict) or coll.get("applicable") is False:
        return []
    notes = []
    st = coll.get("straggler") or {}
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or []}
    if isnum(st.get("rank")):
        notes.append(f"Straggler: {labels.get(st['rank'], st['rank'])} arrives last at "
                     f"{fmt_pct(st.get('late_share'))} of collectives and causes "
                     f"{fmt_us(st.get('wait_caused_us_per_step'))} of waiting per step on the other ranks.")
    elif st.get("reason"):
        notes.append(f"No straggler ({st['reason']}).")
    for bk in coll.get("by_kind") or []:
        if isinstance(bk, dict) and bk.get("kind"):
            notes.append(f"{bk['kind']}: {fmt_count(bk.get('instances_per_step', 0))} per step on average, transfer "
                         f"{fmt_us(bk.get('transfer_us_median'))} median"
                         + (f", {fmt_bytes(float(bk['bytes_median']))}" if isnum(bk.get("bytes_median")) else "")
                         + (f", bus bandwidth {bk['busbw_gbps_median']:.1f} GB/s"
                            if isnum(bk.get("busbw_gbps_median")) else "") + ".")
    notes.extend(str(n) for n in coll.get("notes") or [])
    return notes


def cpath_notes(doc: dict[str, Any]) -> list[str]:
    cp = doc.get("critical_path")
    if not isinstance(cp, dict) or cp.get("applicable") is not True:
        return []
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or []}
    notes = [f"Critical path of a step: {fmt_us(cp.get('total_us_median'))} (median over {cp.get('steps')} "
             f"aligned steps)."]
    b = cp.get("bounding_rank")
    if isnum(b):
        notes.append(f"The path runs mostly on {labels.get(b, b)}" + (
            f" ({', '.join(f'{labels.get(int(r), r)}: {n} steps' for r, n in cp['bounding_rank_steps'].items())})"
            if isinstance(cp.get("bounding_rank_steps"), dict) and len(cp["bounding_rank_steps"]) > 1 else "")
            + ".")
    return notes

