"""Analyze a finished capture in place: ``report.html`` and ``analysis.json`` beside the traces."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from traceinspect.document import write_document
from traceinspect.pipeline import analyze
from traceinspect.render.html import write_html

ANALYSIS_JSON = "analysis.json"
REPORT_HTML = "report.html"


def analyze_into(out_dir: Path, phase: str = "decode", command: str | None = None) -> tuple[Any, list[Path]]:
    """Run :func:`traceinspect.pipeline.analyze` on ``out_dir`` and write ``report.html`` and
    ``analysis.json`` beside the traces.

    ``command`` is what the analysis records (otherwise it records sys.argv, which may hold --api-key).
    Returns the analysis and the paths written (``report.html`` first).
    """
    analysis = analyze(Path(out_dir), phase=phase, command=command)
    data = analysis.to_json()
    json.dumps(data, default=str)  # fail here, not half-way through a file
    written = [write_html(data, Path(out_dir) / REPORT_HTML)]
    written.append(write_document(Path(out_dir) / ANALYSIS_JSON, data))
    return analysis, written
