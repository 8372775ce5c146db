"""The analysis document (``traceinspect.analysis/1``): the one versioned record of an analysis that every
report, ``diff`` and ``gate`` read.

Inputs: the analysis record after the what-if stage (or a stored document).
Outputs: the ``traceinspect.analysis/1`` document, written or read back validated.

``traceinspect.document.build`` assembles it from the pipeline's results (the only place it is built, its
``report`` section by ``traceinspect.document.report``); ``traceinspect.document.read`` loads and
validates a stored one. This module holds what they share, and how the document is written.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from traceinspect.fileio import write_text_atomic

SCHEMA_NAME = "traceinspect.analysis"
SCHEMA_VERSION = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
REPORT = "report"  # the section of what only the reports draw (timelines, tables, rule texts)

__all__ = ["REPORT", "SCHEMA", "SCHEMA_NAME", "SCHEMA_VERSION", "NonFiniteNumber", "dumps", "nonfinite_path",
           "write_document"]


class NonFiniteNumber(ValueError):
    """A NaN or infinity in a document about to be written: an internal error of the stage that computed it
    (every number of the document is finite), not a property of the input."""


def nonfinite_path(obj: Any, path: str = "$") -> tuple[str, float] | None:
    """The JSON path (``$.report.timeline.span``, ``$.findings[2].fixes[0].saving_share``) and value of the
    first non-finite float in ``obj`` (dicts, lists and tuples walked in order), or None."""
    stack: list[tuple[Any, str]] = [(obj, path)]
    while stack:
        o, p = stack.pop()
        if isinstance(o, float):
            if not math.isfinite(o):
                return p, o
        elif isinstance(o, dict):
            stack.extend((v, f"{p}.{k}") for k, v in reversed(list(o.items())))
        elif isinstance(o, (list, tuple)):
            stack.extend((v, f"{p}[{i}]") for i, v in reversed(list(enumerate(o))))
    return None


def dumps(doc: dict[str, Any]) -> str:
    """The document as JSON text: indented two spaces, but its ``report`` section (bulk arrays: timeline
    lanes, table columns) written last, on one line, so the file stays small and the rest readable.
    A NaN or infinity anywhere raises :class:`NonFiniteNumber` naming its JSON path (JSON has no such
    numbers, and a reader would take ``NaN`` for a measurement)."""
    try:
        return _dumps(doc)
    except ValueError as e:
        found = nonfinite_path(doc)
        if found is None:
            raise
        where, value = found
        raise NonFiniteNumber(f"internal error: the analysis document holds the non-finite number {value} at "
                              f"{where}; it was not written") from e


def _dumps(doc: dict[str, Any]) -> str:
    body = {k: v for k, v in doc.items() if k != REPORT}
    text = json.dumps(body, indent=2, allow_nan=False)
    if REPORT not in doc or not body:
        return json.dumps(doc, indent=2, allow_nan=False) + "\n"
    report = json.dumps(doc[REPORT], allow_nan=False, separators=(",", ":"))
    return f'{text[:-2]},\n  "{REPORT}": {report}\n}}\n'


def write_document(path: str | Path, doc: dict[str, Any]) -> Path:
    """Write the document atomically (nothing half-written) as :func:`dumps` writes it."""
    write_text_atomic(path, dumps(doc))
    return Path(path)
