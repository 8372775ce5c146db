"""The metric values of one analysis: every scope's metrics, computed lazily and once."""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceinspect.judge.metrics.classes import ClassMetrics
from traceinspect.judge.metrics.gemm import GemmMetrics
from traceinspect.judge.metrics.kernels import KernelMetrics
from traceinspect.judge.metrics.rank import RankMetrics
from traceinspect.judge.metrics.registry import _ensure_class_metrics
from traceinspect.judge.metrics.run import RunMetrics

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis


class MetricContext(RunMetrics, KernelMetrics, GemmMetrics, RankMetrics, ClassMetrics):
    """Computes metric values for one analysis, lazily and once."""

    def __init__(self, analysis: Analysis) -> None:
        _ensure_class_metrics()
        self.a = analysis
        k = analysis.kernels
        self.k = k
        self.n_step_rows = max(len(analysis.selected), 1)  # (rank, step) pairs analysed
        self.total_us = float(k["dur"].sum()) if len(k) else 0.0
        self.run_missing: dict[str, str] = {}
        from traceinspect.measure.families import FamilyShapes

        self.shapes = FamilyShapes(analysis.efficiency, analysis.trace.cpu_ops, getattr(analysis, "graph_ops", None))
        self.run = self._run_metrics()
