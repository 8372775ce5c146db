"""The analysis document (``traceinspect.analysis/1``): the one versioned record of an analysis that every
report, ``diff`` and ``gate`` read.

``traceinspect.document.build`` assembles it from the pipeline's results (the only place it is built, its
``report`` section by ``traceinspect.document.report``); ``traceinspect.document.read`` loads and
validates a stored one. This module holds what they share, and how the document is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from traceinspect.fileio import write_text_atomic

SCHEMA_NAME = "traceinspect.analysis"
SCHEMA_VERSION = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"
REPORT = "report"  # the section of what only the reports draw (timelines, tables, rule texts)

__all__ = ["REPORT", "SCHEMA", "SCHEMA_NAME", "SCHEMA_VERSION", "dumps", "write_document"]


def dumps(doc: dict[str, Any]) -> str:
    """The document as JSON text: indented two spaces, but its ``report`` section (bulk arrays: timeline
    lanes, table columns) written last, on one line, so the file stays small and the rest readable."""
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
