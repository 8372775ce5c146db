"""traceinspect: find out why LLM inference is slow, from torch-profiler traces of decode steps.

Public API::

    import traceinspect
    a = traceinspect.analyze("traces/")      # a traceinspect.Analysis (see traceinspect.notebook)
    a.findings, a.classes, a.kernels         # pandas DataFrames
    a.to_json()                               # the versioned JSON contract
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traceinspect.version import __version__

if TYPE_CHECKING:
    from traceinspect.load import load_trace_set
    from traceinspect.notebook import Analysis, analyze

__all__ = ["__version__", "analyze", "Analysis", "load_trace_set"]


def __getattr__(name: str) -> Any:
    # heavy modules (pandas) load on first use, keeping `import traceinspect` and the CLI fast
    if name in ("analyze", "Analysis"):
        from traceinspect import notebook

        return getattr(notebook, name)
    if name == "load_trace_set":
        from traceinspect.load import load_trace_set

        return load_trace_set
    if name == "capture":
        from traceinspect.capture import capture

        return capture
    raise AttributeError(name)
