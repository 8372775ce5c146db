"""``traceinspect report``: the self-contained HTML report, plus optional Markdown, JSON and a merged
Chrome trace for Perfetto."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from traceinspect.commands.analyze import analysis_options, build_options


def _size(path: str | Path) -> str:
    n = Path(path).stat().st_size
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} KB"


@click.command("report")
@click.argument("paths", nargs=-1, required=True)
@click.option("--output", "-o", "html_out", type=click.Path(dir_okay=False), default="report.html",
              show_default=True, help="Write the HTML report here.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False),
              help="Also write a short Markdown summary (PR comments, CI step summaries).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Also write the analysis JSON.")
@click.option("--perfetto", "perfetto_out", type=click.Path(dir_okay=False),
              help="Also write all ranks merged into one Chrome trace (gzipped if the name ends in .gz), "
                   "kernels labelled with their class and findings marked, for Perfetto or chrome://tracing.")
@analysis_options
def report_cmd(paths: tuple[str, ...], html_out: str, md_out: str | None, json_out: str | None,
               perfetto_out: str | None, **kw: Any) -> None:
    """Analyse a trace set (a directory, rank files, or globs) and write the HTML report: the top
    finding, run metadata, findings with evidence and fixes, time by class per rank, a step timeline,
    GEMM efficiency, collectives, top kernels, classification coverage and the command that made it.
    The file needs no network to open."""
    from traceinspect.pipeline import analyze
    from traceinspect.render.html import write_html

    a = analyze(list(paths), build_options(**kw))
    doc = a.to_json()
    written = [write_html(a, html_out, doc)]
    if md_out:
        from traceinspect.render.markdown import write_markdown

        written.append(write_markdown(a, md_out, doc))
    if json_out:
        from traceinspect.fileio import write_json_atomic

        write_json_atomic(json_out, doc)
        written.append(Path(json_out))
    if perfetto_out:
        from traceinspect.render.perfetto import write_perfetto

        written.append(write_perfetto(a, perfetto_out, doc))
    from traceinspect.render.story import story

    findings = story(doc).findings
    top = f"; top finding: {findings[0].get('title')}" if findings else "; no findings"
    click.echo(f"{len(findings)} finding(s){top}")
    for p in written:
        click.echo(f"wrote {p} ({_size(p)})")
