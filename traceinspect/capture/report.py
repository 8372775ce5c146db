"""Analyze a finished capture in place: ``analysis.json`` always, ``report.html`` when the HTML renderer exists."""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

from traceinspect.document import write_document

ANALYSIS_JSON = "analysis.json"
REPORT_HTML = "report.html"


def analyze_into(out_dir: Path, phase: str = "decode", command: str | None = None) -> tuple[Any, list[Path]]:
    """Run ``traceinspect.analysis.analyze(out_dir)`` and write what it yields beside the traces.

    Returns the analysis and the paths written (``report.html`` first when written).
    """
    analysis_mod = importlib.import_module("traceinspect.analysis")
    analyze = analysis_mod.analyze
    kw: dict[str, Any] = {}
    params = _params(analyze)
    if params is None or "phase" in params or "kw" in params:
        kw["phase"] = phase
    if command is not None and (params is None or "command" in params or "kw" in params):
        kw["command"] = command  # otherwise the analysis records sys.argv, which may hold --api-key
    analysis = analyze(Path(out_dir), **kw)
    data = analysis.to_json()
    json.dumps(data, default=str)  # fail here, not half-way through a file
    written: list[Path] = []
    try:
        html = importlib.import_module("traceinspect.render.html")
    except ModuleNotFoundError as e:
        if e.name not in ("traceinspect.render", "traceinspect.render.html"):
            raise
        html = None
    write_html = getattr(html, "write_html", None) if html is not None else None
    if callable(write_html):
        path = Path(out_dir) / REPORT_HTML
        tmp = Path(out_dir) / f".{REPORT_HTML}.tmp"
        write_html(data, tmp)
        tmp.replace(path)
        written.append(path)
    path = Path(out_dir) / ANALYSIS_JSON
    write_document(path, data)
    written.append(path)
    return analysis, written


def _params(fn: Any) -> set[str] | None:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
