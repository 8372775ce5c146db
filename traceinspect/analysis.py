"""The pipeline: load -> link -> steps -> classify -> measure -> judge, and the :class:`Analysis`
it produces. ``Analysis.to_json()`` is its document, the versioned public contract (``traceinspect.analysis/1``,
built by :mod:`traceinspect.document.build`)."""

from __future__ import annotations

import gc
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from traceinspect.classify import classify_kernels
from traceinspect.consistency import clock_warnings, step_count_warnings
from traceinspect.document import SCHEMA
from traceinspect.document.build import build_document
from traceinspect.errors import TraceInputError
from traceinspect.graphs import GraphOps, recover_graph_ops
from traceinspect.judge.gaps import Gaps
from traceinspect.link import link
from traceinspect.load import load_trace_set
from traceinspect.measure.time import class_step_time, class_totals
from traceinspect.model import TraceSet
from traceinspect.runmodel import RunModel, user_facts
from traceinspect.steps import RunKind, build_steps, resolve_phase, run_kind, select_steps

if TYPE_CHECKING:
    from traceinspect.judge import Finding
    from traceinspect.measure.collectives import Collectives
    from traceinspect.measure.gemm import Efficiency

__all__ = ["SCHEMA", "Analysis", "Options", "analyze"]


@dataclass
class Options:
    """What an analysis was asked to do (also recorded in the JSON)."""

    phase: str = "auto"  # decode | prefill | all | auto (decode, else the one phase the trace holds)
    server_info: str | Path | None = None
    gpu: str | None = None  # GPU spec override: a name in rules/gpus.yaml or a YAML file
    rules: Sequence[str | Path] = ()
    only: Sequence[str] = ()
    disable: Sequence[str] = ()
    jobs: int | None = None
    executor: str = "local"  # local | dask | dask://HOST:PORT
    use_cache: bool = True
    command: str | None = None
    # facts the user states about the run (they win over everything the trace says)
    layers: int | None = None
    experts: int | None = None
    top_k: int | None = None
    config: str | Path | None = None  # a traceinspect.toml whose [model] table states them too


@dataclass
class Analysis:
    """Everything measured about one trace set, as tables, plus the findings."""

    trace: TraceSet
    options: Options
    steps: pd.DataFrame  # all steps of all ranks (see traceinspect.steps)
    selected: pd.DataFrame  # the analysed steps
    kernels: pd.DataFrame  # kernels of the analysed steps, classified
    class_steps: pd.DataFrame  # rank, step, cls, us, calls
    class_totals: pd.DataFrame  # rank, cls, us, calls, share
    efficiency: Efficiency | None = None
    collectives: Collectives | None = None
    findings: list[Finding] = field(default_factory=list)
    graph_ops: GraphOps | None = None  # CPU ops of CUDA-graph replays, from the capture traces
    run_model: RunModel = field(default_factory=RunModel)  # layers, KV pool, experts, ... (one place)
    gaps: Gaps = field(default_factory=Gaps)  # rules that could not decide, large classes nothing explains
    rule_set: Any = None  # the rules the findings were judged with (their texts go into the report)
    run_kind: RunKind | None = None  # decode, prefill, mixed or training, decided once (steps.run_kind)
    replay: Any = None  # the what-if replayer (traceinspect.measure.replay), built on first use
    all_fixed: Any = None  # the step with every finding fixed, from one replay (traceinspect.judge.fixes)

    @property
    def phase(self) -> str:
        return self.options.phase

    @property
    def rule_phase(self) -> str:
        """The steps rules are scoped by: the analysed phase, or ``training`` in a training run (whose
        steps no inference advice fits)."""
        return "training" if self.run_kind is not None and self.run_kind.kind == "training" else self.phase

    @property
    def n_ranks(self) -> int:
        return self.trace.n_ranks

    @property
    def server_info(self) -> dict[str, Any]:
        return self.trace.server_info or {}

    def steps_per_rank(self) -> int:
        """Number of analysed steps per rank (the smallest over ranks)."""
        counts = self.selected.groupby("rank").size()
        return int(counts.min()) if len(counts) else 0

    def step_samples(self) -> pd.DataFrame:
        """One row per aligned step index: the TP step time (slowest rank's GPU span) and the mean
        per-rank time of each class in that step. Used for medians and for the gate's noise test."""
        sel = self.selected.copy()
        sel["pos"] = sel.groupby("rank").cumcount()
        n = self.steps_per_rank()
        sel = sel[sel["pos"] < n]
        out = sel.groupby("pos").agg(step_us=("span_us", "max"), busy_us=("busy_us", "mean"),
                                     kernel_us=("kernel_us", "mean"), bs=("bs", "max"))
        if len(self.class_steps):
            cs = self.class_steps.merge(sel[["pos"]], left_on="step", right_index=True)
            wide = cs.pivot_table(index="pos", columns="cls", values="us", aggfunc="sum", fill_value=0.0,
                                  observed=True) / self.n_ranks
            out = out.join(wide.add_prefix("class."), how="left").fillna(0.0)
        return out

    def representative_step(self) -> tuple[int | None, dict[int, int]]:
        """The aligned step position whose TP step time is closest to the median (the step the report
        draws), and the row of that step in ``steps`` for each rank."""
        sel = self.selected.copy()
        if not len(sel):
            return None, {}
        sel["pos"] = sel.groupby("rank").cumcount()
        sel = sel[sel["pos"] < self.steps_per_rank()]
        per_pos = sel.groupby("pos")["span_us"].max()
        if not len(per_pos):
            return None, {}
        med = float(np.median(per_pos.to_numpy()))
        pos = int((per_pos - med).abs().idxmin())
        rows = sel[sel["pos"] == pos]
        return pos, {int(r): int(i) for i, r in zip(rows.index, rows["rank"], strict=True)}

    def device_name(self) -> str | None:
        for r in self.trace.ranks:
            if r.device is not None:
                return r.device.name
        return None

    def to_json(self) -> dict[str, Any]:
        """The analysis as the documented JSON contract."""
        return build_document(self)


def analyze(paths: Sequence[str | Path] | str | Path, options: Options | None = None, **kw: Any) -> Analysis:
    """Run the whole pipeline on a trace set (a directory, files or globs)."""
    opts = options or Options(**kw)
    if opts.command is None:
        opts.command = "traceinspect " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv else None
    from traceinspect.judge import load_rule_set

    # rules and stated facts first: a bad rule or config file is reported before the traces are read
    rule_set = load_rule_set(extra=opts.rules, only=opts.only, disable=opts.disable)
    user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config)
    ts = load_trace_set(paths, phase=opts.phase, server_info=opts.server_info, jobs=opts.jobs,
                        executor=opts.executor, use_cache=opts.use_cache)
    # the loaded tables hold ~1e6 long-lived objects: keep the cyclic garbage collector from rescanning
    # them during the analysis (and from touching their pages in the process forked beside it)
    gc.freeze()
    try:
        return _analyze_loaded(ts, opts, rule_set)
    finally:
        gc.unfreeze()


def _analyze_loaded(ts: TraceSet, opts: Options, rule_set: Any) -> Analysis:
    link(ts)
    steps = build_steps(ts)
    recovered = recover_graph_ops(ts)
    opts.phase, notes = resolve_phase(steps, opts.phase)
    ts.warnings += notes
    user = user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config)
    run_model = classify_kernels(ts, steps, graph_ops=recovered, user=user, phase=opts.phase)
    selected = select_steps(steps, opts.phase)
    ts.warnings += step_count_warnings(selected, ts, opts.phase)
    if not len(selected):
        found = steps.groupby("phase").size().to_dict()
        raise TraceInputError(
            f"no complete {opts.phase} steps found (steps found per phase: {found or 'none'}; "
            f"first and last steps are excluded as partial)", ts.ranks[0].path.parent)
    kernels = ts.kernels[ts.kernels["step"].isin(selected.index)]
    result = Analysis(
        trace=ts, options=opts, steps=steps, selected=selected, kernels=kernels,
        class_steps=class_step_time(kernels), class_totals=class_totals(kernels), graph_ops=recovered,
        run_model=run_model, run_kind=run_kind(ts, steps),
    )
    if result.run_kind is not None and result.run_kind.kind == "training":
        ts.warnings.append(f"a training run ({result.run_kind.evidence}): the rules, written for inference decode "
                           "steps, are not applied; classes and GEMM efficiency are measured as usual")
    _measure_and_judge(result, rule_set)
    return result


def _measure_and_judge(result: Analysis, rule_set: Any = None) -> None:
    from traceinspect.judge import explain, load_rule_set
    from traceinspect.judge.engine import findings_of
    from traceinspect.judge.fixes import order_findings, replay_findings
    from traceinspect.judge.gaps import find_gaps
    from traceinspect.measure.collectives import analyze_collectives
    from traceinspect.measure.gemm import measure_efficiency
    from traceinspect.parallel import Beside

    # independent stages: the collectives analysis runs on a second core while this one measures GEMMs
    coll = Beside(analyze_collectives, result, jobs=result.options.jobs)
    result.efficiency = measure_efficiency(result)
    result.collectives = coll.result()
    result.trace.warnings += clock_warnings(result)
    opts = result.options
    if rule_set is None:
        rule_set = load_rule_set(extra=opts.rules, only=opts.only, disable=opts.disable)
    result.rule_set = rule_set
    outcomes = explain(result, rule_set)
    findings = findings_of(result, rule_set, outcomes)
    result.all_fixed = replay_findings(result, findings, rule_set)
    result.findings = order_findings(findings)
    result.gaps = find_gaps(result, rule_set, outcomes)
