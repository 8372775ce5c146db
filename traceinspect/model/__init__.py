"""The bottom layer: what the stages pass each other, importing no stage.

Inputs: nothing of the stages: this package imports none.
Outputs: the types the stages pass each other and the analysis record they fill.

:mod:`~traceinspect.model.trace` (the trace tables and their column contract), :mod:`~traceinspect.model.run`
(the run model's types and the one reader of ``server_info.json``), :mod:`~traceinspect.model.shapes` (recorded
op inputs decoded once per distinct value, with the dtype table), :mod:`~traceinspect.model.classes` (the kernel
class ids).
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceinspect.model.trace import (
        ANNOTATION_COLUMNS,
        CPU_OP_COLUMNS,
        GPU_ANNOTATION_COLUMNS,
        KERNEL_COLUMNS,
        RUNTIME_COLUMNS,
        DeviceInfo,
        RankInfo,
        TraceSet,
    )

__all__ = ["ANNOTATION_COLUMNS", "CPU_OP_COLUMNS", "GPU_ANNOTATION_COLUMNS", "KERNEL_COLUMNS", "RUNTIME_COLUMNS",
           "DeviceInfo", "RankInfo", "TraceSet"]


def __getattr__(name: str) -> Any:
    """The trace table names, imported on first use: a module of this package that does not need the
    tables (the findings helpers that render documents) is imported without pandas."""
    if name in __all__:
        from traceinspect.model import trace

        return getattr(trace, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
