"""The pipeline: load -> link -> steps -> classify -> measure -> judge -> whatif, each stage a function from
named inputs to a typed result, and the one place the stages are put in order.

Inputs: trace paths (a directory, files or globs) and :class:`Options`.
Outputs: the analysis record filled by every stage (:func:`analyze`), or the stages up to one.

:func:`analyze` runs every stage into an :class:`~traceinspect.analysis.Analysis`; ``traceinspect doctor``,
``traceinspect classify`` and the rule tests run the stages up to the one they need (:func:`classified`,
:func:`analysed_steps`). A stage's warnings come back in its result; the caller adds them to the trace set's
warnings in stage order.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from traceinspect import link as link_stage
from traceinspect.analysis import Analysis, Options
from traceinspect.classify import ClassTable, GraphOps, classify_kernels, recover_graph_ops
from traceinspect.errors import TraceInputError
from traceinspect.judge import Finding, RuleSet, explain, load_rule_set
from traceinspect.judge.engine import findings_of
from traceinspect.judge.gaps import Gaps, find_gaps
from traceinspect.load import load_trace_set
from traceinspect.measure.clock import clock_warnings
from traceinspect.measure.collectives import analyze_collectives
from traceinspect.measure.comm_result import Collectives
from traceinspect.measure.gemm import Efficiency, measure_efficiency
from traceinspect.measure.host import HostActivity, host_activity
from traceinspect.measure.time import class_step_time, class_totals
from traceinspect.model import TraceSet
from traceinspect.model.run import RunModel, user_facts
from traceinspect.steps import build_steps
from traceinspect.steps.select import resolve_phase, run_kind, select_steps, step_count_warnings
from traceinspect.whatif.fixes import AllFixed, order_findings, replay_findings

__all__ = ["Analysis", "Classified", "Judged", "Measured", "Options", "Replayed", "Selected", "Stepped", "analyze",
           "analysed_steps", "classify", "classified", "collectives", "judge", "link", "load", "measure", "record",
           "select", "steps", "whatif"]


# ----------------------------------------------------------------------------- stage results


class Stepped(msgspec.Struct):
    """The steps stage: every step of every rank (:data:`traceinspect.steps.STEP_COLUMNS`), the phase
    analysed (``auto`` resolved) and what resolving it noted."""

    table: pd.DataFrame
    phase: str
    notes: list[str] = msgspec.field(default_factory=list)


class Classified(msgspec.Struct):
    """The classify stage: the kernels carry ``cls``, ``cls2`` and ``cls_evidence``; the CPU ops of their
    CUDA-graph replays recovered from the capture traces, and the run model decided on the way."""

    graph_ops: GraphOps
    run_model: RunModel


class Selected(msgspec.Struct):
    """The analysed steps, their kernels, and a warning when ranks recorded different numbers of them."""

    steps: pd.DataFrame
    kernels: pd.DataFrame
    warnings: list[str] = msgspec.field(default_factory=list)


class Measured(msgspec.Struct):
    """The measure stage: GEMM and memory efficiency, the collectives across ranks, the host activity of
    the analysed steps, and clock warnings."""

    efficiency: Efficiency
    collectives: Collectives
    host: HostActivity
    warnings: list[str] = msgspec.field(default_factory=list)


class Judged(msgspec.Struct):
    """The judge stage: the findings, each with its rule's fixes to replay, and what could not be decided."""

    rule_set: RuleSet
    findings: list[Finding]
    gaps: Gaps


class Replayed(msgspec.Struct):
    """The what-if stage: the findings with their fixes replayed (savings, shared causes; ordered), and the
    step with every finding fixed."""

    findings: list[Finding]
    all_fixed: AllFixed


# ----------------------------------------------------------------------------- the stages


def load(paths: Sequence[str | Path] | str | Path, *, phase: str = "decode", server_info: str | Path | None = None,
         jobs: int | None = None, use_cache: bool = True,
         require_kernels: bool = True, allow_mismatch: bool = False) -> TraceSet:
    """Stage 1, load: the rank files as typed tables, each rank linked where it was parsed (files that are
    not one run's ranks refused unless ``allow_mismatch``)."""
    return load_trace_set(paths, phase=phase, server_info=server_info, jobs=jobs,
                          use_cache=use_cache, require_kernels=require_kernels, prepare=link_stage.link_parsed,
                          allow_mismatch=allow_mismatch)


def link(ts: TraceSet) -> TraceSet:
    """Stage 2, link: kernel -> runtime call -> CPU op (a no-op for ranks the loader linked)."""
    return link_stage.link(ts)


def steps(ts: TraceSet, phase: str) -> Stepped:
    """Stage 3, steps: the decode/prefill steps of every rank and the phase to analyse."""
    table = build_steps(ts)
    resolved, notes = resolve_phase(table, phase)
    return Stepped(table, resolved, notes)


def classify(ts: TraceSet, stepped: Stepped, *, user: Mapping[str, tuple[int, str]] | None = None,
             table: ClassTable | None = None, phase: str | None = "decode") -> Classified:
    """Stage 4, classify: CUDA-graph ops recovered, every kernel labelled, the run model decided
    (``phase=None``: the default phase of the run model)."""
    graph_ops = recover_graph_ops(ts, table)
    kw: dict[str, Any] = {"phase": phase} if phase is not None else {}
    run_model = classify_kernels(ts, stepped.table, table, graph_ops=graph_ops, user=user, **kw)
    return Classified(graph_ops, run_model)


def select(ts: TraceSet, stepped: Stepped, phase: str) -> Selected:
    """The analysed steps of ``phase`` and their kernels."""
    sel = select_steps(stepped.table, phase)
    return Selected(sel, ts.kernels[ts.kernels["step"].isin(sel.index)], step_count_warnings(sel, ts, phase))


def record(ts: TraceSet, opts: Options, stepped: Stepped, labels: Classified, selected: Selected) -> Analysis:
    """The analysis record the measure and judge stages read, from the earlier stages' results."""
    k = selected.kernels
    return Analysis(trace=ts, options=opts, steps=stepped.table, selected=selected.steps, kernels=k,
                    class_steps=class_step_time(k), class_totals=class_totals(k), graph_ops=labels.graph_ops,
                    run_model=labels.run_model, run_kind=run_kind(ts, stepped.table))


def collectives(a: Analysis) -> Collectives:
    """The collectives part of the measure stage alone (matching across ranks, clock offsets)."""
    return analyze_collectives(a)


def measure(a: Analysis) -> Measured:
    """Stage 5, measure: GEMM and memory efficiency, the collectives across ranks (their clock offsets
    kept in ``a`` for the host activity) and the host activity of the analysed steps."""
    eff = measure_efficiency(a)
    c = a.collectives = analyze_collectives(a)
    return Measured(eff, c, host_activity(a), clock_warnings(c, a.trace.ranks))


def judge(a: Analysis, rule_set: RuleSet) -> Judged:
    """Stage 6, judge: the rules over the measured analysis."""
    outcomes = explain(a, rule_set)
    return Judged(rule_set, findings_of(a, rule_set, outcomes), find_gaps(a, rule_set, outcomes))


def whatif(a: Analysis, judged: Judged) -> Replayed:
    """Stage 7, what-if: the judge's findings' fixes replayed on the analysed steps (each finding's saving,
    findings that share a cause grouped), then every fix together."""
    all_fixed = replay_findings(a, judged.findings, judged.rule_set)
    return Replayed(order_findings(judged.findings), all_fixed)


# ----------------------------------------------------------------------------- runs of the stages


def classified(paths: Sequence[str | Path], *, phase: str = "decode", server_info: str | Path | None = None,
               table: ClassTable | None = None, user: Mapping[str, tuple[int, str]] | None = None,
               classify_phase: str | None = "decode", allow_mismatch: bool = False,
               ) -> tuple[TraceSet, Stepped, Classified]:
    """Load, link, steps and classify (what ``traceinspect classify`` prints)."""
    ts = link(load(list(paths), phase=phase, server_info=server_info, allow_mismatch=allow_mismatch))
    stepped = steps(ts, phase)
    return ts, stepped, classify(ts, stepped, user=user, table=table, phase=classify_phase)


def analysed_steps(ts: TraceSet, opts: Options) -> tuple[Stepped, Classified, Selected]:
    """Link, steps, classify and the step selection of a loaded trace set; ``opts.phase`` becomes the phase
    analysed and the stages' warnings go into ``ts.warnings`` in stage order."""
    link(ts)
    stepped = steps(ts, opts.phase)
    opts.phase = stepped.phase
    ts.warnings += stepped.notes
    user = user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config, model_config=opts.model_config)
    labels = classify(ts, stepped, user=user, phase=opts.phase)
    ts.warnings += labels.run_model.warnings
    selected = select(ts, stepped, opts.phase)
    ts.warnings += selected.warnings
    return stepped, labels, selected


def analyze(paths: Sequence[str | Path] | str | Path, options: Options | None = None, **kw: Any) -> Analysis:
    """Run the whole pipeline on a trace set (a directory, files or globs)."""
    opts = options or Options(**kw)
    if opts.command is None:
        opts.command = "traceinspect " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    # rules and stated facts first: a bad rule or config file is reported before the traces are read
    rule_set = load_rule_set(extra=opts.rules, only=opts.only, disable=opts.disable)
    user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config, model_config=opts.model_config)
    ts = load(paths, phase=opts.phase, server_info=opts.server_info, jobs=opts.jobs,
              use_cache=opts.use_cache, allow_mismatch=opts.allow_mismatch)
    stepped, labels, selected = analysed_steps(ts, opts)
    if not len(selected.steps):
        found = stepped.table.groupby("phase").size().to_dict()
        raise TraceInputError(
            f"no complete {opts.phase} steps found (steps found per phase: {found or 'none'}; "
            f"first and last steps are excluded as partial)", ts.ranks[0].path.parent)
    a = record(ts, opts, stepped, labels, selected)
    kind = a.run_kind
    if kind is not None and kind.kind == "training":
        ts.warnings.append(f"a training run ({kind.evidence}): the rules, written for inference decode "
                           "steps, are not applied; classes and GEMM efficiency are measured as usual")
    measured = measure(a)
    a.efficiency, a.collectives, a.host = measured.efficiency, measured.collectives, measured.host
    ts.warnings += measured.warnings
    judged = judge(a, rule_set)
    replayed = whatif(a, judged)
    a.rule_set, a.findings, a.all_fixed, a.gaps = judged.rule_set, replayed.findings, replayed.all_fixed, judged.gaps
    return a
