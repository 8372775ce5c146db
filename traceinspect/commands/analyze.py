"""``traceinspect analyze``: the post-run diagnostics command."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

import click

from traceinspect.load import memory_settings

PHASES = click.Choice(["auto", "decode", "prefill", "all"])
MODEL_CONFIG_OPT = click.option(
    "--model-config", "model_config", type=click.Path(dir_okay=False), default=None,
    help="The model's Hugging Face config.json: GEMM shapes (M, N, K, dtype) of CUDA-graph-replayed kernels follow "
         "from it, the parallel sizes and each step's batch; wins over server_info's model_config.")


allow_mismatch_option = click.option(
    "--allow-mismatch/--no-allow-mismatch", "allow_mismatch", default=None,
    help="Analyse files that are not one run's ranks (different GPUs, workloads or captures) together, with a "
         "warning instead of exit 2 (gate and diff: also compare runs that differ).")


def analysis_options(f: Any) -> Any:
    """Options shared by analyze, report, whatif, diff and gate."""
    for opt in reversed([
        click.option("--phase", type=PHASES, default="auto", show_default=True,
                     help="Steps to analyse (auto: decode, else the one phase the trace holds)."),
        click.option("--server-info", type=click.Path(dir_okay=False), default=None,
                     help="server_info.json to use (default: the one beside the traces)."),
        click.option("--gpu", default=None, help="GPU spec: a name from rules/tables/gpus.yaml or a YAML file."),
        click.option("--rules", "rules", multiple=True, type=click.Path(), help="Extra rule file or directory."),
        click.option("--only", multiple=True, help="Run only this rule id (repeatable)."),
        click.option("--disable", multiple=True, help="Disable this rule id (repeatable)."),
        click.option("--jobs", "-j", type=int, default=None, help="Rank-file parse processes (default: one per two CPUs; 1: this process)."),
        click.option("--no-cache", is_flag=True, help="Do not read or write the parsed-table cache."),
        click.option("--layers", type=click.IntRange(min=1), default=None,
                     help="Model layers (per pipeline stage); wins over server_info and the trace's structure."),
        click.option("--experts", type=click.IntRange(min=1), default=None,
                     help="Routed experts of the MoE layers; wins over server_info."),
        click.option("--top-k", "top_k", type=click.IntRange(min=1), default=None,
                     help="Experts per token (MoE top-k); wins over server_info."),
        allow_mismatch_option,
        MODEL_CONFIG_OPT,
    ]):
        f = opt(f)
    return f


def build_options(**kw: Any) -> Any:
    """Options for :func:`traceinspect.pipeline.analyze` from CLI keyword arguments."""
    from traceinspect.analysis import Options

    return Options(
        phase=kw["phase"], server_info=kw.get("server_info"), gpu=kw.get("gpu"), rules=kw.get("rules") or (),
        only=kw.get("only") or (), disable=kw.get("disable") or (), jobs=kw.get("jobs"),
        use_cache=not kw.get("no_cache", False),
        command="traceinspect " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        layers=kw.get("layers"), experts=kw.get("experts"), top_k=kw.get("top_k"), config=_config_path(kw),
        allow_mismatch=bool(kw.get("allow_mismatch")),
        model_config=kw.get("model_config"),
    )


def _config_path(kw: dict[str, Any]) -> str | None:
    """The traceinspect.toml whose [model] table states run facts: --config, else ./traceinspect.toml."""
    from traceinspect.model.run import CONFIG_NAME

    if kw.get("no_config"):
        return None
    if kw.get("config"):
        return str(kw["config"])
    return CONFIG_NAME if Path(CONFIG_NAME).is_file() else None


@click.command("analyze")
@click.argument("paths", nargs=-1, required=True)
@analysis_options
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the analysis JSON here.")
@click.option("--html", "html_out", type=click.Path(dir_okay=False), help="Also write the HTML report.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), help="Also write a Markdown summary.")
@click.option("--csv", "csv_dir", type=click.Path(file_okay=False),
              help="Also write the kernels, GEMM-shape and CPU-op tables as DIR/kernels.csv, gemm.csv, ops.csv.")
@click.option("--quiet", "-q", is_flag=True, help="No terminal summary.")
def analyze_cmd(paths: tuple[str, ...], json_out: str | None, html_out: str | None, md_out: str | None,
                csv_dir: str | None, quiet: bool, **kw: Any) -> None:
    """Analyse the decode steps of a trace set (a directory, rank files, or globs)."""
    memory_settings()  # before numpy is imported
    from traceinspect.pipeline import analyze

    a = analyze(list(paths), build_options(**kw))
    # the report section serves the files; the terminal summary does not read it
    doc = a.to_json(report=bool(json_out or html_out or md_out or csv_dir))
    written: list[tuple[str, Path]] = []
    if json_out:
        from traceinspect.document import write_document

        written.append(("analysis JSON", write_document(json_out, doc)))
    if html_out:
        from traceinspect.render.html import write_html

        written.append(("HTML report", write_html(doc, html_out)))
    if md_out:
        from traceinspect.render.markdown import write_markdown

        written.append(("Markdown summary", write_markdown(doc, md_out)))
    if csv_dir:
        from traceinspect.render.tables import report_tables, write_csv

        written += [("CSV table", p) for p in write_csv(report_tables(doc), csv_dir)]
    if not quiet:
        from traceinspect.render.terminal import render

        render(doc)
    for what, p in written:  # on stderr: stdout stays the summary
        click.echo(f"wrote {what}: {p}", err=True)
