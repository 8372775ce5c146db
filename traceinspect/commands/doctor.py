"""``traceinspect doctor``: what is usable in a trace set, before analysing it.

Runs the pipeline's early stages (load without requiring kernels, link, steps, graph-op recovery,
classification, and the collectives for clock offsets) and prints a checklist: files and ranks,
devices, kernels per rank, steps per phase, recorded shapes, CUDA-graph replay and capture traces,
server_info fields and the rules that need them, clock offsets between ranks, classification
coverage, and warnings. Exit 0 when ``traceinspect analyze`` would work on the set, 2 otherwise.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import click

from traceinspect.commands.analyze import MODEL_CONFIG_OPT, PHASES, allow_mismatch_option
from traceinspect.units import fmt_bytes, fmt_us, fmt_us_signed

OK, WARN, FAIL, INFO = "ok", "warn", "FAIL", "info"
CUPTI_HINT = ("no GPU kernel events: CUPTI may have failed to start, or the profile ran without the CUDA "
              "activity (torch.profiler activities=[CPU, CUDA]; SGLang: activities CPU,GPU)")
STEP_HINT = ("mark steps with SGLang's step[...] spans (a recent SGLang adds them), torch.profiler's "
             "schedule (ProfilerStep#N), or replay decode from CUDA graphs (one cudaGraphLaunch per step)")
# server_info fields behind metrics that rules use: metric -> [(field, what it gives, fallback)]
SERVER_INFO_METRICS: dict[str, list[tuple[str, str]]] = {
    "kv_pool_tokens": [("max_total_num_tokens", "KV pool size")],
    "kv_pool_bytes_per_layer": [("max_total_num_tokens", "KV pool size")],
    "kv_cache_dtype": [("kv_cache_dtype", "KV cache dtype")],
    "layers": [("model_info.num_hidden_layers", "layer count (else the period of the step's kernel sequence)")],
    "per_expert_m": [("model_info experts (n_routed_experts, num_experts, ...)",
                      "per-expert M when MoE shapes are not recorded"),
                     ("model_info top-k (num_experts_per_tok, top_k, ...)",
                      "per-expert M when MoE shapes are not recorded")],
    "tp_size": [("tp_size", "tensor-parallel size (else the number of rank files)")],
}


@dataclass
class Check:
    """One line of the checklist, with detail lines under it."""

    name: str
    status: str
    summary: str
    details: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "summary": self.summary, "details": self.details}


def _pct(x: float) -> str:
    from traceinspect.units import fmt_pct

    return fmt_pct(x)


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


# metrics that need the evidence a check found missing: what each warning leaves undecided
SHAPE_METRICS = ("bytes_per_call", "rows_per_call", "gbps", "kv_row_bytes", "kv_pool_bytes_per_layer", "m",
                 "per_expert_m", "tflops", "pct_peak")
FACT_METRICS = {"kv_pool_tokens": ("kv_pool_tokens", "kv_pool_bytes_per_layer"),
                "kv_row_bytes": ("kv_row_bytes", "kv_pool_bytes_per_layer"), "kv_cache_dtype": ("kv_cache_dtype",),
                "layers": ("layers", "calls_per_layer"), "experts": ("per_expert_m",), "top_k": ("per_expert_m",),
                "batch": ("batch",)}


def rules_needing(metrics: Sequence[str]) -> list[str]:
    """Ids of the rules whose selector or conditions read one of ``metrics`` (directly or through
    ``let``): the rules a missing piece of evidence can leave undecided."""
    from traceinspect.judge import load_rule_set
    from traceinspect.judge.gaps import _condition_metrics

    try:
        rules = list(load_rule_set())
    except Exception:  # noqa: BLE001 - the rule set is not what doctor checks
        return []
    want = set(metrics)
    out = []
    for r in rules:
        read = _condition_metrics(r) | (set(r.select.where.names) if r.select.where is not None else set())
        if read & want:
            out.append(r.id)
    return sorted(out)


def _undecided_line(metrics: Sequence[str]) -> str | None:
    ids = rules_needing(metrics)
    return f"leaves undecided: {', '.join(ids)}" if ids else None


def _si_value(si: dict[str, Any], key: str) -> Any:
    from traceinspect.model.run import EXPERT_KEYS, LAYER_KEYS, TOPK_KEYS, model_int

    if key.startswith("model_info experts"):
        return model_int(si, EXPERT_KEYS)[0]
    if key.startswith("model_info top-k"):
        return model_int(si, TOPK_KEYS)[0]
    if key == "model_info.num_hidden_layers":
        return model_int(si, LAYER_KEYS)[0]
    v = si.get(key)
    if isinstance(v, bool) or v is None:
        return None
    if isinstance(v, (int, float)):
        return v if v > 0 else None
    return v if isinstance(v, str) and v else None


def _file_errors(paths: Sequence[str], phase: str) -> list[str]:
    """Per rank file, why it cannot be read (each file on its own, so every bad file is named)."""
    from traceinspect.errors import TraceInspectError
    from traceinspect.load import discover, parse_file

    out = []
    try:
        files = discover(list(paths), phase=phase).files
    except TraceInspectError as e:
        return [e.one_line()]
    for f in files:
        try:
            parse_file(f.path)
        except TraceInspectError as e:
            out.append(e.one_line())
    return out


def diagnose(paths: Sequence[str], phase: str = "auto", server_info: str | None = None,
             use_cache: bool = True, allow_mismatch: bool = False,
             model_config: str | None = None) -> tuple[list[Check], bool]:
    """The checklist of a trace set and whether ``analyze`` can use it."""
    from traceinspect import pipeline
    from traceinspect.errors import TraceInspectError
    from traceinspect.steps import SOURCES_TRIED

    checks: list[Check] = []
    try:
        ts = pipeline.load(list(paths), phase=phase, server_info=server_info, require_kernels=False,
                           use_cache=use_cache, allow_mismatch=allow_mismatch)
    except TraceInspectError as e:
        errors = _file_errors(paths, phase) or [e.one_line()]
        checks.append(Check("files", FAIL, "the trace set cannot be read", errors))
        return checks, False

    label = {i.rank: i.label for i in ts.ranks}
    sources = sorted({i.rank_source for i in ts.ranks})
    src_text = {"filename": "from file names (-TP-<r>)", "distributedInfo": "from distributedInfo.rank",
                "order": "guessed from file order"}
    checks.append(Check(
        "files", WARN if "order" in sources and ts.n_ranks > 1 else OK,
        f"{_plural(ts.n_ranks, 'rank file')} ({', '.join(label[i.rank] for i in ts.ranks)}), ranks "
        + ", ".join(src_text.get(s, s) for s in sources),
        [f"{i.label}: {i.path} ({fmt_bytes(i.size_bytes)}, {i.n_events:,} events)" for i in ts.ranks]))

    devs = {i.label: (f"{i.device.name} (compute capability {i.device.compute_capability})"
                      if i.device and i.device.compute_capability else (i.device.name if i.device else None))
            for i in ts.ranks}
    names = {d for d in devs.values() if d}
    if not names:
        checks.append(Check("device", WARN, "no deviceProperties in the traces: GPU peak numbers need --gpu NAME"))
    elif len(names) == 1:
        checks.append(Check("device", OK, f"{next(iter(names))} on every rank"))
    else:
        checks.append(Check("device", WARN, "ranks report different devices",
                            [f"{k}: {v or 'unknown'}" for k, v in devs.items()]))

    k = ts.kernels
    kinds = k[k["kind"] == "kernel"] if len(k) else k
    per_rank = kinds.groupby("rank").size().to_dict() if len(kinds) else {}
    empty = [i.label for i in ts.ranks if not per_rank.get(i.rank)]
    counts = ", ".join(f"{i.label} {per_rank.get(i.rank, 0):,}" for i in ts.ranks)
    if empty:
        checks.append(Check("kernels", FAIL, f"{', '.join(empty)}: {CUPTI_HINT}", [f"GPU kernels: {counts}"]))
    else:
        checks.append(Check("kernels", OK, f"GPU kernels: {counts}"))

    pipeline.link(ts)
    try:
        stepped = pipeline.steps(ts, phase)
    except TraceInspectError as e:
        checks.append(Check("steps", FAIL, f"no steps found (tried {SOURCES_TRIED})", [e.reason, STEP_HINT]))
        checks.append(_warnings_check(ts.warnings))
        return checks, False

    from traceinspect.judge.gaps import serving_engine

    phase = stepped.phase  # (auto: the phase the steps were taken for)
    ops = ts.cpu_ops
    engine = serving_engine(ops["name"].astype(str).unique() if len(ops) else [], stepped.table["source"].unique(),
                            ts.server_info)
    from traceinspect.model.run import user_facts

    labels = pipeline.classify(ts, stepped, phase=phase, user=user_facts(model_config=model_config))
    recovered, run = labels.graph_ops, labels.run_model
    sel = pipeline.select(ts, stepped, phase)
    selected, steps = sel.steps, stepped.table
    ts.warnings += sel.warnings
    checks.append(_steps_check(ts, steps, selected, phase, label))
    checks.append(_shapes_check(ts, selected, engine))
    checks.append(_graph_check(ts, selected, recovered, label, engine))
    checks.append(_server_info_check(ts, engine))
    graph = bool(len(ts.kernels)) and bool(ts.kernels["graph_replay"].mean() > 0.5)
    checks.append(_run_model_check(run, graph, engine))
    analysable = not empty and len(selected) > 0
    if len(selected):
        checks.append(_clock_check(ts, stepped, sel, phase, label, labels))
        checks.append(_coverage_check(ts, selected))
    checks.append(_warnings_check(ts.warnings))
    return checks, analysable


def _steps_check(ts: Any, steps: Any, selected: Any, phase: str, label: dict[int, str]) -> Check:
    src_text = {"step_span": "step[...] spans", "profiler_step": "ProfilerStep#N", "profiler_step_gpu":
                "ProfilerStep#N on the GPU timeline", "forward_marker": "the serving engine's forward markers",
                "iteration": "repeated iteration annotations", "iteration_gpu": "repeated GPU iteration annotations",
                "graph_launch": "one cudaGraphLaunch per step", "gpu_gaps": "periodic GPU idle gaps (no CPU step "
                "markers)", "whole_capture": f"nothing (no step marker: the whole capture is one step; {STEP_HINT})"}
    sources = ", ".join(src_text.get(s, s) for s in sorted(steps["source"].unique()))
    kind = "complete step" if phase in ("all", "unknown") else f"complete {phase} step"
    details = []
    for i in ts.ranks:
        rs = steps[steps["rank"] == i.rank]
        phases = ", ".join(f"{p} {n}" for p, n in rs.groupby("phase").size().items())
        n_sel = int((selected["rank"] == i.rank).sum())
        n_edge = int(rs["edge"].sum()) if "edge" in rs else 0
        details.append(f"{i.label}: {_plural(len(rs), 'step')} found ({phases or 'none'}); "
                       f"{_plural(n_sel, kind)} to analyse"
                       + (f"; {_plural(n_edge, 'step')} at the edges of the capture left out as partial"
                          if n_edge else ""))
    n = selected.groupby("rank").size()
    if not len(selected):
        found = steps.groupby("phase").size().to_dict()
        return Check("steps", FAIL, f"no complete {phase} steps (found per phase: {found or 'none'}); "
                     "the first and the last step of a capture are left out as partial"
                     + ("; try --phase all" if phase != "all" else ""), details)
    status = WARN if {"gpu_gaps", "whole_capture"} & set(steps["source"]) or n.nunique() > 1 or int(n.min()) < 3 \
        else OK
    return Check("steps", status, f"{_plural(int(n.min()), kind)} per rank, from {sources}",
                 details)


# how to record shapes, by serving engine (None: any other program)
RECORD_SHAPES_HINT = {"sglang": "SGLang: SGLANG_PROFILE_RECORD_SHAPES=1 / --profile-record-shapes",
                      "vllm": "vLLM: VLLM_TORCH_PROFILER_RECORD_SHAPES=1",
                      None: "torch.profiler(record_shapes=True)"}


def _shapes_check(ts: Any, selected: Any, engine: str | None = None) -> Check:
    from traceinspect.measure.gemm import GEMM_CLASSES

    k = ts.kernels
    k = k[k["step"].isin(selected.index)] if len(selected) else k
    ops = ts.cpu_ops
    any_dims = bool(len(ops)) and bool(ops["input_dims"].notna().any())
    gemm = k[k["cls"].isin(GEMM_CLASSES) & ~k["graph_replay"]] if "cls" in k else k.iloc[:0]
    if not len(gemm):
        return Check("record_shapes", INFO if any_dims else WARN,
                     "no eager GEMM kernels to check; CPU ops " + ("carry" if any_dims else "carry no")
                     + " recorded shapes (Input Dims)",
                     [] if any_dims else [x for x in [_undecided_line(SHAPE_METRICS)] if x])
    oi = gemm["op_idx"].to_numpy()
    dims = ops["input_dims"].to_numpy(dtype=object)
    has = sum(1 for o in oi if o >= 0 and dims[o] is not None)
    share = has / len(gemm)
    if share >= 0.9:
        return Check("record_shapes", OK, f"{_pct(share)} of eager GEMM kernels have their op's recorded shapes")
    return Check("record_shapes", WARN, f"only {_pct(share)} of eager GEMM kernels have their op's recorded shapes: "
                 f"GEMM efficiency and KV-pool sizes need record_shapes=True ({RECORD_SHAPES_HINT[engine]})",
                 [x for x in [_undecided_line(SHAPE_METRICS)] if x])


def _graph_check(ts: Any, selected: Any, recovered: Any, label: dict[int, str], engine: str | None = None) -> Check:
    k = ts.kernels
    k = k[k["step"].isin(selected.index)] if len(selected) else k
    total = float(k["dur"].sum()) or 1.0
    share = float(k.loc[k["graph_replay"], "dur"].sum()) / total if len(k) else 0.0
    caps = ts.capture_traces
    cap_text = ", ".join(label.get(r, f"R{r}") for r in sorted(caps)) or "none"
    if share == 0:
        return Check("cuda_graphs", OK, "no CUDA-graph replays (eager): kernels link to their CPU ops",
                     [f"graph-capture traces: {cap_text}"] if caps else [])
    replaying = sorted(int(r) for r in k.loc[k["graph_replay"], "rank"].unique())
    details = [f"graph-capture traces: {cap_text}"]
    if recovered is not None and getattr(recovered, "ranks", None):
        for r, st in sorted(recovered.ranks.items()):
            details.append(f"{label.get(r, r)}: ops {st.status} ({st.matched}/{st.replays} replays matched)"
                           + (f": {st.reason}" if st.reason else ""))
    missing = [label.get(r, f"R{r}") for r in replaying if r not in caps]
    if missing:
        if (line := _undecided_line(SHAPE_METRICS)) is not None:
            details.append(line)
        how = {"sglang": "start SGLang with --enable-profile-cuda-graph so graph_capture_profile/ capture traces "
                         "lie beside the rank files",
               "vllm": "vLLM writes no capture trace: profile with --enforce-eager to record them"}.get(
            engine, "profile with CUDA graphs off to record them")
        return Check("cuda_graphs", WARN, f"{_pct(share)} of GPU time is replayed from CUDA graphs and "
                     f"{', '.join(missing)} ha{'s' if len(missing) == 1 else 've'} no graph-capture trace: "
                     f"the replayed kernels' shapes and ops are unknown ({how})", details)
    return Check("cuda_graphs", OK, f"{_pct(share)} of GPU time is replayed from CUDA graphs; capture traces "
                 "are present, so shapes can be recovered", details)


def _server_info_check(ts: Any, engine: str | None = None) -> Check:
    from traceinspect.judge import load_rule_set

    si = ts.server_info
    try:
        rules = list(load_rule_set())
    except Exception:  # noqa: BLE001 - the rule set is not what doctor checks
        rules = []
    need: dict[str, tuple[str, set[str]]] = {}
    for r in rules:
        for m in r.metric_names():
            for fld, what in SERVER_INFO_METRICS.get(m, []):
                need.setdefault(fld, (what, set()))[1].add(r.id)
    if si is None:
        details = [f"{fld}: needed by {', '.join(sorted(ids))} ({what})" for fld, (what, ids) in sorted(need.items())]
        how = ("--server-info FILE; `traceinspect capture` saves it" if engine == "sglang" else
               "--server-info FILE, a JSON object with the fields below; --layers, --experts, --top-k"
               + ("; vLLM writes none" if engine == "vllm" else ""))
        return Check("server_info", WARN, f"no server_info.json beside the traces ({how}): rules that need "
                     "server metadata cannot decide", details)
    details, absent = [], []
    for fld, (what, ids) in sorted(need.items()):
        v = _si_value(si, fld)
        if v is None:
            absent.append(fld)
        details.append(f"{fld}: {v if v is not None else 'absent'} — {what}; used by {', '.join(sorted(ids))}")
    summary = f"{ts.server_info_path}" + (f"; absent: {', '.join(absent)}" if absent else "; every field rules use "
                                                                                           "is present")
    return Check("server_info", WARN if absent else OK, summary, details)


def _run_model_check(run: Any, graph: bool, engine: str | None = None) -> Check:
    """The run model's facts: value, source and confidence; an undecided fact names the rules it
    leaves undecided and how to supply it."""
    from traceinspect.judge.gaps import evidence_table

    table = evidence_table()
    details, undecided = [], []
    for name, f in run.facts.items():
        if f.value is None:
            metrics = FACT_METRICS.get(name)
            line = _undecided_line(metrics) if metrics else None
            if line is not None:
                undecided.append(name)
            details.append(f"{name}: undecided ({f.detail})" + (f"; {line}; supply: {table.how(name, graph, engine)}"
                                                                 if line else ""))
        else:
            details.append(f"{name}: {f.value} ({f.source}, {f.confidence}: {f.detail})")
    if undecided:
        return Check("run_model", WARN, f"undecided: {', '.join(undecided)} (how to supply each: below)", details)
    return Check("run_model", OK, "every fact the rules read is decided", details)


def _clock_check(ts: Any, stepped: Any, sel: Any, phase: str, label: dict[int, str], labels: Any) -> Check:
    if ts.n_ranks < 2:
        return Check("clocks", INFO, "single rank: no clock offsets to measure")
    from traceinspect import pipeline
    from traceinspect.measure.clock import CLOCK_WARN_US, clock_warnings

    a = pipeline.record(ts, pipeline.Options(phase=phase, command="traceinspect doctor"), stepped, labels, sel)
    c = pipeline.collectives(a)
    if not c.applicable:
        return Check("clocks", INFO, f"clock offsets not measured: {c.reason}")
    details = []
    for r, off in sorted(c.offsets.items()):
        ref = c.reference_rank.get(r, r)
        if r == ref:
            continue
        applied = c.offsets_applied.get(r, 0.0)
        details.append(f"{label.get(r, r)} vs {label.get(ref, ref)}: {fmt_us_signed(off)} (spread "
                       f"{fmt_us(c.offset_noise.get(r))}; {'corrected' if applied else 'not corrected'})")
    warn = clock_warnings(c, ts.ranks)
    ts.warnings += warn
    big = max((abs(v) for v in c.offsets.values() if v == v), default=0.0)
    if warn:
        return Check("clocks", WARN, f"ranks' clocks differ by up to {fmt_us(big)} (more than {fmt_us(CLOCK_WARN_US)}): "
                     "offsets from matched collectives are applied where they stand out of the noise", details)
    return Check("clocks", OK, f"ranks' clocks agree within {fmt_us(big)}", details)


def _coverage_check(ts: Any, selected: Any) -> Check:
    k = ts.kernels[ts.kernels["step"].isin(selected.index)]
    total = float(k["dur"].sum())
    if not total:
        return Check("coverage", WARN, "the analysed steps hold no GPU kernel time")
    unknown = k[k["cls"] == "other"]
    share = float(unknown["dur"].sum()) / total
    top = unknown.groupby("name")["dur"].sum().sort_values(ascending=False).head(3)
    details = [f"unclassified: {n[:100]} ({_pct(us / total)})" for n, us in top.items()]
    status = OK if share < 0.05 else WARN
    return Check("coverage", status, f"{_pct(1 - share)} of GPU time classified"
                 + ("" if status == OK else " (add patterns with a class table: traceinspect classify)"), details)


def _warnings_check(warnings: list[str]) -> Check:
    if not warnings:
        return Check("warnings", OK, "none")
    return Check("warnings", WARN, _plural(len(warnings), "warning"), list(warnings))


MARK = {OK: "[ok]  ", WARN: "[warn]", FAIL: "[FAIL]", INFO: "[info]"}
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _clean(text: str) -> str:
    """One line of plain text: control characters (terminal escapes, line breaks) shown as escapes."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                        else f"\\u{ord(m.group()):04x}", text)


def render(paths: Sequence[str], checks: list[Check], analysable: bool, phase: str = "auto") -> str:
    """The checklist as plain text (trace-derived strings are printed as text, never interpreted)."""
    lines = [f"traceinspect doctor: {' '.join(paths)}"]
    for c in checks:
        lines.append(f"{MARK.get(c.status, c.status)} {c.name}: {c.summary}")
        lines += [f"         {d}" for d in c.details]
    cmd = "traceinspect analyze " + " ".join(shlex.quote(p) for p in paths) + (
        f" --phase {phase}" if phase != "auto" else "")
    lines.append("verdict: " + (f"analysable ({cmd})" if analysable else "not analysable: fix the [FAIL] items above"))
    return "\n".join(_clean(line) for line in lines)


@click.command("doctor")
@click.argument("paths", nargs=-1, required=True)
@click.option("--phase", type=PHASES, default="auto", show_default=True,
              help="Steps to check for (auto: decode, else the one phase the trace holds).")
@click.option("--server-info", type=click.Path(dir_okay=False), default=None,
              help="server_info.json to use (default: the one beside the traces).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the checklist as JSON.")
@click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-table cache.")
@allow_mismatch_option
@MODEL_CONFIG_OPT
def doctor_cmd(paths: tuple[str, ...], phase: str, server_info: str | None, json_out: str | None,
               no_cache: bool, allow_mismatch: bool | None, model_config: str | None) -> None:
    """Explain what is usable in a trace set before analysing it: ranks, steps, recorded shapes, CUDA-graph
    replay and capture traces, server_info, clock offsets, classification coverage. Exits 0 when
    `traceinspect analyze` can use the set, 2 otherwise."""
    checks, ok = diagnose(list(paths), phase=phase, server_info=server_info, use_cache=not no_cache,
                          allow_mismatch=bool(allow_mismatch), model_config=model_config)
    click.echo(render(list(paths), checks, ok, phase))
    if json_out:
        from traceinspect.fileio import write_json_atomic

        write_json_atomic(json_out, {"schema": "traceinspect.doctor/1", "paths": list(paths), "analysable": ok,
                              "checks": [c.to_json() for c in checks]})
    if not ok:
        first = next((c for c in checks if c.status == FAIL), None)
        reason = "no complete steps to analyse"
        if first is not None:
            reason = f"{first.name}: " + (first.details[0] if first.name == "files" and first.details else first.summary)
        click.echo(f"traceinspect: error: not analysable: {_clean(reason)}", err=True)
        raise SystemExit(2)
