"""The pipeline: load -> link -> steps -> classify -> measure -> judge, each stage a function from named inputs
to a typed result, and the one place the stages are put in order.

:func:`analyze` runs every stage into an :class:`~traceinspect.analysis.Analysis`; ``traceinspect doctor``,
``traceinspect classify`` and the rule tests run the stages up to the one they need (:func:`classified`,
:func:`analysed_steps`). A stage's warnings come back in its result; the caller adds them to the trace set's
warnings in stage order.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import msgspec
import pandas as pd

from traceinspect import link as link_stage
from traceinspect.analysis import Analysis, Options
from traceinspect.classify import ClassTable, GraphOps, classify_kernels, default_table, recover_graph_ops
from traceinspect.classify.table import adopt_default_table
from traceinspect.document.build import keep_trace_sections, trace_sections
from traceinspect.errors import TraceInputError
from traceinspect.judge import Finding, RuleSet, explain, load_rule_set
from traceinspect.judge.engine import findings_of
from traceinspect.judge.fixes import order_findings, replay_findings
from traceinspect.judge.gaps import Gaps, find_gaps
from traceinspect.load import early, load_trace_set
from traceinspect.load.raw import Sha256After
from traceinspect.measure.clock import clock_warnings
from traceinspect.measure.collectives import Collectives, analyze_collectives
from traceinspect.measure.gemm import Efficiency, measure_efficiency
from traceinspect.measure.host import HostActivity, host_activity
from traceinspect.measure.replay import ReplayBase, replay_base, replayed_steps
from traceinspect.measure.replay.edits import kv_rows
from traceinspect.measure.specs import adopt_default_gpu_specs, default_gpu_specs
from traceinspect.measure.time import class_step_time, class_totals
from traceinspect.model import RankInfo, TraceSet
from traceinspect.model.run import RunModel, user_facts
from traceinspect.parallel import Beside
from traceinspect.resources import adopt_documents
from traceinspect.steps import (
    build_steps,
    resolve_phase,
    run_kind,
    select_steps,
    step_count_warnings,
)

__all__ = ["Analysis", "Classified", "Judged", "Measured", "Options", "Selected", "Stepped", "Tables", "analyze",
           "analysed_steps", "classify", "classified", "collectives", "judge", "link", "load", "measure", "record",
           "select", "steps"]


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
    side: Beside[Any] | None = None  # the second core, on the replay model and table sections


class Judged(msgspec.Struct):
    """The judge stage: the findings (ordered), the step with every finding fixed, and what could not be
    decided."""

    rule_set: RuleSet
    findings: list[Finding]
    all_fixed: Any
    gaps: Gaps


# ----------------------------------------------------------------------------- the stages


def load(paths: Sequence[str | Path] | str | Path, *, phase: str = "decode", server_info: str | Path | None = None,
         jobs: int | None = None, executor: str = "local", use_cache: bool = True,
         require_kernels: bool = True, allow_mismatch: bool = False) -> TraceSet:
    """Stage 1, load: the rank files as typed tables, each rank linked where it was parsed (files that are
    not one run's ranks refused unless ``allow_mismatch``)."""
    return load_trace_set(paths, phase=phase, server_info=server_info, jobs=jobs, executor=executor,
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


def _beside_gemm(a: Analysis, samples: pd.DataFrame) -> tuple[Collectives, HostActivity]:
    """The measures that do not read the GEMM efficiency: collectives and host activity."""
    c = analyze_collectives(a)
    a.collectives = c  # (in the side's copy: the replay model reads the clock offsets)
    return c, host_activity(a)


def _after_hash(info: RankInfo, told: tuple[int, int]) -> None:
    """In the process forked beside the GEMM measure: wait until this process has hashed the file of the
    rank ``info`` (the second core is the hash's until then) and take its digest
    (:meth:`~traceinspect.load.raw.Sha256After.told`)."""
    digest = Sha256After.heard(told)
    if digest is not None:
        info.digest = digest


def _replay_beside(a: Analysis, samples: pd.DataFrame) -> ReplayBase:
    if a.collectives is None:  # (the side's collectives part failed: as the serial run has them)
        a.collectives = analyze_collectives(a)
    base = replay_base(a)
    with contextlib.suppress(Exception):  # found ahead, for the KV-row edits; else where an edit needs them
        base.facts["kv_rows"] = kv_rows(a, {"steps": replayed_steps(a, base.model)})
    return base


def _sections_beside(a: Analysis, samples: pd.DataFrame) -> dict[str, Any]:
    return trace_sections(a)  # (with the step samples made there)


# the parts of the side's work after its first (the step samples, which the rules and these parts read), by
# position for Beside.then_result
SIDE_MEASURES, SIDE_REPLAY, SIDE_SECTIONS = 0, 1, 2


def measure(a: Analysis) -> Measured:
    """Stage 5, measure: on a second core, the step samples, then the collectives analysis and the host
    activity, while this one measures GEMMs; for one rank whose file is still being hashed (the cache off),
    once the hash is through (the second core is the hash's until then, and this one makes the step samples
    meanwhile). The second core then builds the what-if replay model (``a.replay_base``) and the document's
    sections made from the tables alone while this one goes on to the rules."""
    ranks = a.trace.ranks
    told = ranks[0].digest.told() if len(ranks) == 1 and ranks[0].hashing else None
    try:
        side = Beside(Analysis.step_samples, a, jobs=a.options.jobs,
                      then=(partial(_beside_gemm, a), partial(_replay_beside, a), partial(_sections_beside, a)),
                      before=partial(_after_hash, ranks[0], told) if told is not None else None)
    finally:
        if told is not None:
            os.close(told[0])  # (the process forked beside has its copy)
    eff = measure_efficiency(a)
    eff.shapes()  # the judge's GEMM shape rows, made while the other core works
    if told is not None:
        a.step_samples()  # (the side makes them after the hash)
    else:
        a.keep_step_samples(side.result())  # (made here when nothing was forked)
    c, host = side.then_result(SIDE_MEASURES)
    a.replay_base = partial(side.then_result, SIDE_REPLAY)
    return Measured(eff, c, host, clock_warnings(c, a.trace.ranks), side=side)


def judge(a: Analysis, rule_set: RuleSet) -> Judged:
    """Stage 6, judge: the rules over the measured analysis, their fixes replayed."""
    outcomes = explain(a, rule_set)
    findings = findings_of(a, rule_set, outcomes)
    all_fixed = replay_findings(a, findings, rule_set)
    return Judged(rule_set, order_findings(findings), all_fixed, find_gaps(a, rule_set, outcomes))


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
    tables = Tables(opts)
    if not tables.early:
        # rules and stated facts first: a bad rule or config file is reported before the traces are read
        tables.rule_set()
        default_table()  # the kernel class and GPU spec tables too (read once): on a large trace, while its scan runs
        default_gpu_specs()
    try:
        user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config, model_config=opts.model_config)
        ts = load(paths, phase=opts.phase, server_info=opts.server_info, jobs=opts.jobs, executor=opts.executor,
                  use_cache=opts.use_cache, allow_mismatch=opts.allow_mismatch)
        # the loaded tables hold ~1e6 long-lived objects: keep the cyclic garbage collector from rescanning
        # them during the analysis (and from touching their pages in the process forked beside it)
        gc.freeze()
        try:
            return _analyze_loaded(ts, opts, tables)
        finally:
            gc.unfreeze()
    except Exception:
        tables.rule_set()  # (a rule file's error first, as when the rules are read before the traces)
        raise


class Tables:
    """The rule set and the shipped kernel class, GPU spec and settings tables of one analysis: read here,
    or taken from the early-read process of the CLI (:mod:`traceinspect.load.early`), which reads them
    beside this process's imports once its file is read (``traceinspect.commands.analyze.read_tables``,
    then ``read_rules``); taken when they are needed, if they have come by then (the tables waited for
    briefly: :data:`TABLES_WAIT_S`), else read here."""

    def __init__(self, opts: Options) -> None:
        self.opts = opts
        self.early = early.beside_expected()
        self._rules: RuleSet | None = None
        self._tables = False  # whether the early-read process's first part (the shipped tables) was taken

    def adopt(self, wait: float = 0.0) -> None:
        """Take the parts of the early-read process's work that have come (the shipped tables, then the
        rule set), waiting up to ``wait`` seconds for the tables; when its rule set failed there, read
        the rule set here at once (a rule file's error is then reported as early as it can be)."""
        while self.early:
            got = early.beside_result(0.0 if self._tables else wait)
            if got is None:
                self.early = early.beside_expected()
                return
            self._tables = True  # (the first part: the tables, or their failure there; not waited for again)
            if got[0] != "ok":
                if not early.beside_expected():  # (the rule set was the part that failed, or the process died)
                    self.early = False
                    self.rule_set()
                continue
            if got[1][0] == "tables":
                _, table, specs, documents = got[1]
                adopt_default_table(table)
                adopt_default_gpu_specs(specs)
                adopt_documents(documents)
            else:
                _, key, rule_set = got[1]
                o = self.opts
                if self._rules is None and key == (tuple(str(r) for r in o.rules), tuple(o.only), tuple(o.disable)):
                    self._rules = rule_set

    def rule_set(self) -> RuleSet:
        """The analysis's rule set (:func:`~traceinspect.judge.load_rule_set` of its options)."""
        self.adopt()
        if self._rules is None:
            self._rules = load_rule_set(extra=self.opts.rules, only=self.opts.only, disable=self.opts.disable)
        return self._rules


# How long the analysis waits, once the traces are loaded, for the shipped tables from the CLI's early-read
# process, which reads them after its file: read here instead, they take about 50 ms (the YAML module's
# import, the class table, the first search of each name pattern), and they are usually a few ms away.
TABLES_WAIT_S = 0.06


def _analyze_loaded(ts: TraceSet, opts: Options, tables: Tables) -> Analysis:
    tables.adopt(wait=TABLES_WAIT_S)
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
    tables.adopt()
    measured = measure(a)
    a.efficiency, a.collectives, a.host = measured.efficiency, measured.collectives, measured.host
    ts.warnings += measured.warnings
    try:
        judged = judge(a, tables.rule_set())
        if measured.side is not None and measured.side.forked:
            keep_trace_sections(a, measured.side.then_result(SIDE_SECTIONS))
    finally:
        a.replay_base = None
        if measured.side is not None:
            measured.side.close()
    a.rule_set, a.findings, a.all_fixed, a.gaps = judged.rule_set, judged.findings, judged.all_fixed, judged.gaps
    return a
