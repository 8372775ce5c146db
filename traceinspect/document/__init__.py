"""The analysis document (``traceinspect.analysis/1``): the one versioned record of an analysis that every
report, ``diff`` and ``gate`` read.

``traceinspect.document.build`` assembles it from the pipeline's results (the only place it is built);
``traceinspect.document.read`` loads and validates a stored one. This module holds what both share.
"""

from __future__ import annotations

SCHEMA_NAME = "traceinspect.analysis"
SCHEMA_VERSION = 1
SCHEMA = f"{SCHEMA_NAME}/{SCHEMA_VERSION}"

__all__ = ["SCHEMA", "SCHEMA_NAME", "SCHEMA_VERSION"]
