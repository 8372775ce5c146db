"""The metric namespace that rules are written against, built from an :class:`Analysis`.

Metrics come in scopes. ``run`` metrics are one value per analysis and are visible to every rule;
the other scopes are *subjects* a rule's ``select:`` iterates over:

``kernels``  one kernel family (kernels picked by class / name regex / op regex), optionally one
             subject per kernel name or per class
``gemm``     GEMM shapes from the efficiency stage, filtered and aggregated
``rank``     one subject per rank (busy time, step time, collective wait/transfer)
``class``    one subject per kernel class

Every metric has a name, a unit and a definition (shown by ``traceinspect rules show``). A value
that cannot be derived from the trace is ``None`` and the reason is kept in ``Subject.missing``;
a rule condition over it is "cannot decide".

Per-step quantities are per rank per analysed step (mean), unless stated otherwise; shares are of
the GPU time (kernels + memcpy + memset) of the analysed steps on all ranks.

Modules: :mod:`~traceinspect.judge.metrics.registry` (declarations, :class:`Subject`) and one module per scope
(``run``, ``kernels``, ``gemm``, ``rank``, ``classes``), each declaring its metrics beside the code that
maps the measured results to them; :class:`MetricContext` combines the scopes for one analysis.
"""

from traceinspect.judge.metrics.context import MetricContext
from traceinspect.judge.metrics.registry import (
    SCOPES,
    Metric,
    Subject,
    class_ids,
    known,
    own_metrics,
    registry,
)

__all__ = ["SCOPES", "Metric", "MetricContext", "Subject", "class_ids", "known", "own_metrics",
           "registry"]
