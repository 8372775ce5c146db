"""``traceinspect report``: the self-contained HTML report, plus optional Markdown, JSON and a merged
Chrome trace for Perfetto, from a trace set or from a stored analysis JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from traceinspect.commands.analyze import analysis_options, build_options
from traceinspect.load import memory_settings


def _size(path: str | Path) -> str:
    n = Path(path).stat().st_size
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


def _stored_document(paths: tuple[str, ...]) -> dict[str, Any] | None:
    """The document of a stored analysis JSON given as the only input, else None (a trace set)."""
    from traceinspect.document.read import is_analysis_file, load_json_document

    if len(paths) != 1 or not Path(paths[0]).is_file() or not is_analysis_file(Path(paths[0])):
        return None
    return load_json_document(paths[0])


@click.command("report")
@click.argument("paths", nargs=-1, required=True)
@click.option("--output", "-o", "html_out", type=click.Path(dir_okay=False), default="report.html",
              show_default=True, help="Write the HTML report here.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False),
              help="Also write a short Markdown summary (PR comments, CI step summaries).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the analysis JSON.")
@click.option("--perfetto", "perfetto_out", type=click.Path(dir_okay=False),
              help="Also write all ranks merged into one Chrome trace (gzipped if the name ends in .gz), "
                   "kernels labelled with their class and findings marked, for Perfetto or chrome://tracing "
                   "(needs the traces, not a stored analysis JSON).")
@analysis_options
def report_cmd(paths: tuple[str, ...], html_out: str, md_out: str | None, json_out: str | None,
               perfetto_out: str | None, **kw: Any) -> None:
    """Write the HTML report of a trace set (a directory, rank files, or globs) or of a stored analysis
    JSON (``analyze --json``; the same page as from its traces): the top finding, run metadata, findings
    with evidence and fixes, time by class per rank, a step timeline, GEMM efficiency, collectives, top
    kernels, classification coverage and the command that made it. The file needs no network to open."""
    doc = _stored_document(paths)
    if doc is None:
        memory_settings()  # before numpy is imported
    from traceinspect.errors import TraceInputError
    from traceinspect.render.html import write_html

    a = None
    if doc is None:
        from traceinspect.pipeline import analyze

        a = analyze(list(paths), build_options(**kw))
        doc = a.to_json()
    elif perfetto_out:
        raise TraceInputError("--perfetto needs the traces: an analysis JSON holds no raw trace events", paths[0])
    written = [write_html(doc, html_out)]
    if md_out:
        from traceinspect.render.markdown import write_markdown

        written.append(write_markdown(doc, md_out))
    if json_out:
        from traceinspect.document import write_document

        written.append(write_document(json_out, doc))
    if perfetto_out and a is not None:
        from traceinspect.render.perfetto import write_perfetto

        written.append(write_perfetto(a, perfetto_out, doc))
    from traceinspect.render.story import story

    findings = story(doc).findings
    top = f"; top finding: {findings[0].get('title')}" if findings else "; no findings"
    click.echo(f"{len(findings)} finding(s){top}")
    for p in written:
        click.echo(f"wrote {p} ({_size(p)})")
