"""The analysis record with its document: :class:`Analysis` is the record of
:mod:`traceinspect.model.analysis` that the pipeline fills, and ``Analysis.to_json()`` its document, the
versioned public contract (``traceinspect.analysis/1``, built by :mod:`traceinspect.document.build`)."""

from __future__ import annotations

from typing import Any

from traceinspect.document import SCHEMA
from traceinspect.document.build import build_document
from traceinspect.model import analysis as record
from traceinspect.model.analysis import Options

__all__ = ["SCHEMA", "Analysis", "Options"]


class Analysis(record.Analysis, eq=False):
    """Everything measured about one trace set (:class:`traceinspect.model.analysis.Analysis`), and its
    document."""

    def to_json(self, report: bool = True) -> dict[str, Any]:
        """The analysis as the documented JSON contract (``report=False``: without its ``report`` section)."""
        return build_document(self, report=report)
