"""The analysis record every stage after the load reads and fills, and the types the stages share.

:class:`Options` (what an analysis was asked to do), :class:`Analysis` (everything measured, filled stage by
stage) and :class:`RunKind`; the findings and gaps are :mod:`traceinspect.model.findings`'s. Imports no stage:
a stage's own result types (the GEMM efficiency, the collectives, the recovered graph ops) are held here as
they come and described where they are made.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.model.findings import Finding, Gaps
from traceinspect.model.run import RunModel
from traceinspect.model.trace import TraceSet

__all__ = ["Analysis", "Finding", "Gaps", "Options", "RunKind"]

class RunKind(msgspec.Struct):
    """What kind of run the trace is: decode, prefill, mixed, training, or None (undecided) with why."""

    kind: str | None
    evidence: str

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "kind_evidence": self.evidence}


class Options(msgspec.Struct):
    """What an analysis was asked to do (also recorded in the JSON)."""

    phase: str = "auto"  # decode | prefill | all | auto (decode, else the one phase the trace holds)
    server_info: str | Path | None = None
    gpu: str | None = None  # GPU spec override: a name in rules/tables/gpus.yaml or a YAML file
    rules: Sequence[str | Path] = ()
    only: Sequence[str] = ()
    disable: Sequence[str] = ()
    jobs: int | None = None
    use_cache: bool = True
    command: str | None = None
    # facts the user states about the run (they win over everything the trace says)
    layers: int | None = None
    experts: int | None = None
    top_k: int | None = None
    config: str | Path | None = None  # a traceinspect.toml whose [model] table states them too
    allow_mismatch: bool = False  # analyse files that are not one run's ranks together (a warning, not exit 2)
    model_config: str | Path | None = None  # the model's Hugging Face config.json (GEMM shapes from the model)


class Analysis(msgspec.Struct, eq=False):
    """Everything measured about one trace set, as tables, plus the findings."""

    trace: TraceSet
    options: Options
    steps: pd.DataFrame  # all steps of all ranks (see traceinspect.steps)
    selected: pd.DataFrame  # the analysed steps
    kernels: pd.DataFrame  # kernels of the analysed steps, classified
    class_steps: pd.DataFrame  # rank, step, cls, us, calls
    class_totals: pd.DataFrame  # rank, cls, us, calls, share
    efficiency: Any = None  # GEMM and memory efficiency (the measure stage's traceinspect.measure.gemm.Efficiency)
    collectives: Any = None  # the collectives across ranks (the measure stage's measure.collectives.Collectives)
    host: Any = None  # stall stretches, syncs, GPU gaps of the analysed steps (the measure stage's measure.host)
    findings: list[Finding] = msgspec.field(default_factory=list)
    graph_ops: Any = None  # CPU ops of CUDA-graph replays, from the capture traces (classify.graphs.GraphOps)
    run_model: RunModel = msgspec.field(default_factory=RunModel)  # layers, KV pool, experts, ... (one place)
    gaps: Gaps = msgspec.field(default_factory=Gaps)  # rules that could not decide, large classes nothing explains
    rule_set: Any = None  # the rules the findings were judged with (their texts go into the report)
    run_kind: RunKind | None = None  # decode, prefill, mixed or training, decided once (steps.run_kind)
    replay: Any = None  # the what-if replayer (traceinspect.whatif), built on first use
    all_fixed: Any = None  # the step with every finding fixed, from one replay (traceinspect.whatif.fixes)
    _samples: Any = None  # (key, step_samples())

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
        per-rank time of each class in that step. Used for medians and for the gate's noise test (built
        once per pair of step and class tables; callers only read it)."""
        key = self._samples_key()
        if self._samples is None or self._samples[0] != key:
            self._samples = (key, self._step_samples())
        return self._samples[1]

    def _samples_key(self) -> tuple[int, int]:
        return id(self.selected), id(self.class_steps)  # the tables the samples are built from

    def _step_samples(self) -> pd.DataFrame:
        # one group-by reduction per column, and the class rows of the selected steps taken in their order
        # (what a named aggregation and an inner merge give, value for value, at half the cost)
        sel = self.selected
        pos = sel.groupby("rank").cumcount()
        keep = (pos < self.steps_per_rank()).to_numpy()
        sel, pos = sel[keep], pos[keep]
        g = sel.groupby(pos.rename("pos"))
        out = pd.DataFrame({"step_us": g["span_us"].max(), "busy_us": g["busy_us"].mean(),
                            "kernel_us": g["kernel_us"].mean(), "bs": g["bs"].max()})
        if len(self.class_steps):
            cs = self.class_steps
            at = pos.reindex(cs["step"].to_numpy())  # (the selected steps' index: unique step ids)
            hit = at.notna().to_numpy()
            cs = cs[hit]
            wide = cs.groupby([at[hit].to_numpy(dtype=np.int64), cs["cls"]], observed=True)["us"].sum()
            wide.index.names = ["pos", "cls"]
            wide = wide.unstack("cls", fill_value=0.0) / self.n_ranks
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
