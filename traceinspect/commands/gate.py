"""``traceinspect diff`` and ``traceinspect gate``: compare a candidate run with a baseline, each given
as a trace set or as the JSON of ``traceinspect analyze --json``."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from traceinspect.commands.analyze import analysis_options, build_options
from traceinspect.fileio import write_text_atomic
from traceinspect.gate.core import FAIL_ON
from traceinspect.load import memory_settings
from traceinspect.render.terminal import plain_text

THRESHOLD_HELP = (
    "Allowed regression, METRIC:LIMIT (repeatable): step:5%, throughput:5%, class.kv_cast:10%, class.*:15%, "
    "step:200us, class.comm:off. Defaults: step:5%, throughput:5% and class.*:10%; a metric given here replaces "
    "the config file's and the default's thresholds for that metric. The step time and tokens/s decide; a "
    "class.NAME threshold written here or in the config file also fails the gate on its own."
)


def input_document(path: str, options: Callable[[], Any]) -> dict[str, Any]:
    """The analysis document of one input: a stored analysis JSON is read as it is; a trace set (directory,
    rank file or glob) is analysed with ``options()``. Unusable input raises TraceInputError."""
    from pathlib import Path

    from traceinspect.errors import TraceInputError
    from traceinspect.gate.document import is_analysis_file, labelled, load_document, validate_document

    p = Path(path)
    if p.is_file() and is_analysis_file(p):
        return load_document(p)
    if not p.exists() and not any(ch in str(p) for ch in "*?["):
        raise TraceInputError("no such file or directory", p)
    from traceinspect.pipeline import analyze

    return labelled(validate_document(analyze([str(path)], options()).to_json(), str(path)), str(path))


def _load_pair(base: str, cand: str, kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    # the analysis options, made when a trace set is to be analysed: two stored documents are compared
    # without importing the analysis
    options = functools.cache(lambda: build_options(**kw))
    return input_document(base, options), input_document(cand, options)


def _write_outputs(result: Any, junit: str | None, github: bool, markdown: str | None, json_out: str | None) -> None:
    from traceinspect.gate import outputs

    if json_out:
        write_text_atomic(json_out, outputs.gate_json(result))
    if junit:
        write_text_atomic(junit, outputs.junit_xml(result))
    md = outputs.gate_markdown(result) if (markdown or github) else None
    if markdown:
        write_text_atomic(markdown, md)
    if github:
        for line in outputs.github_annotations(result):
            click.echo(plain_text(line))
        outputs.append_step_summary(md)


@click.command("diff")
@click.argument("base")
@click.argument("cand")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the diff as JSON here.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), help="Write the diff as Markdown here.")
@click.option("--all", "show_all", is_flag=True, help="Also list unchanged classes, shapes and findings.")
@analysis_options
def diff_cmd(base: str, cand: str, json_out: str | None, md_out: str | None, show_all: bool, **kw: Any) -> None:
    """Show what changed from BASE to CAND: step time, GPU time per class per step, per-shape GEMM
    efficiency, findings added/removed/changed. Each side is a trace set (directory, rank files,
    glob) or an analysis JSON from `traceinspect analyze --json`. Never fails on a regression (see
    `traceinspect gate`); exits 2 on unusable input."""
    memory_settings()  # before numpy is imported
    from traceinspect.gate import diff_documents, outputs

    b, c = _load_pair(base, cand, kw)
    d = diff_documents(b, c, set(kw.get("disable") or ()))
    if json_out:
        write_text_atomic(json_out, outputs.diff_json(d))
    if md_out:
        write_text_atomic(md_out, outputs.diff_markdown(d))
    click.echo(plain_text(outputs.diff_text(d, show_all=show_all)), nl=False)


@click.command("gate")
@click.argument("base")
@click.argument("cand")
@click.option("--max-regression", "-r", "max_regression", multiple=True, metavar="EXPR", help=THRESHOLD_HELP)
@click.option("--floor", default=None, metavar="LIMIT",
              help="A regression must also exceed this (us, ms, or N% of the baseline's median step). "
                   "Default 10us.")
@click.option("--alpha", type=float, default=None,
              help="Significance level of the noise test (one-sided Mann-Whitney U over per-step "
                   "samples). Default 0.05.")
@click.option("--fail-on", type=click.Choice(FAIL_ON), default=None,
              help="New findings at or above this severity fail the gate. Default warning.")
@click.option("--config", "config", type=click.Path(dir_okay=False), default=None,
              help="Config file (default ./traceinspect.toml when present).")
@click.option("--no-config", is_flag=True, help="Ignore ./traceinspect.toml.")
@click.option("--junit", type=click.Path(dir_okay=False), help="Write JUnit XML (one testcase per check).")
@click.option("--github", is_flag=True,
              help="Print GitHub Actions annotations; append a summary to $GITHUB_STEP_SUMMARY when set.")
@click.option("--markdown", "md_out", type=click.Path(dir_okay=False), help="Write a Markdown report.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the verdict and diff as JSON.")
@click.option("--verbose", "-v", is_flag=True, help="List passing checks too.")
@click.option("--quiet", "-q", is_flag=True, help="Print only the verdict line.")
@analysis_options
def gate_cmd(base: str, cand: str, max_regression: tuple[str, ...], floor: str | None, alpha: float | None,
             fail_on: str | None, allow_mismatch: bool | None, config: str | None, no_config: bool,
             junit: str | None, github: bool, md_out: str | None, json_out: str | None, verbose: bool,
             quiet: bool, **kw: Any) -> None:
    """Fail (exit 1) when CAND regressed against BASE beyond thresholds, floor and step-to-step
    noise, or has new findings at or above --fail-on. The verdict is the median step time and,
    where both batches are known, tokens/s (alone where the batches differ); class changes are
    listed under it to explain it. Exit 0 on pass, 2 on unusable input (bad files, missing steps,
    different GPU/TP size/phase without --allow-mismatch). BASE and CAND are trace sets or
    analysis JSON files from `traceinspect analyze --json`."""
    memory_settings()  # before numpy is imported
    from traceinspect.errors import TraceInputError, TraceInspectError
    from traceinspect.gate import (
        DEFAULT_ALPHA,
        DEFAULT_FAIL_ON,
        DEFAULT_FLOOR,
        Gate,
        GateResult,
        merge_thresholds,
        parse_threshold,
    )
    from traceinspect.gate.config import find_config
    from traceinspect.gate.outputs import gate_text

    cfg = find_config(config, no_config)
    # the user's thresholds (config file, then command line); the gate layers them over its defaults and
    # knows which ones were written: a class threshold fails the gate on its own only when written
    thresholds = merge_thresholds(cfg.thresholds, [parse_threshold(t) for t in max_regression])
    disabled = sorted(set(cfg.disable) | set(kw.get("disable") or ()))
    kw["disable"] = tuple(disabled)
    kw["config"], kw["no_config"] = (str(cfg.path) if cfg.path else None), no_config  # its [model] facts
    allow_mismatch = bool(allow_mismatch if allow_mismatch is not None else cfg.allow_mismatch)
    kw["allow_mismatch"] = allow_mismatch  # (also for the trace sets analysed here)
    gate = Gate(
        thresholds,
        floor=floor if floor is not None else cfg.floor or DEFAULT_FLOOR,
        alpha=alpha if alpha is not None else cfg.alpha if cfg.alpha is not None else DEFAULT_ALPHA,
        fail_on=fail_on or cfg.fail_on or DEFAULT_FAIL_ON,
        allow_mismatch=allow_mismatch,
        disabled_rules=disabled,
    )
    settings = gate.settings()
    settings["config"] = str(cfg.path) if cfg.path else None
    try:
        b, c = _load_pair(base, cand, kw)
    except TraceInspectError as e:
        _write_outputs(GateResult.from_error(e.one_line(), settings), junit, github, md_out, json_out)
        raise
    result = gate.run(b, c)
    result.settings["config"] = settings["config"]
    _write_outputs(result, junit, github, md_out, json_out)
    click.echo(plain_text(result.verdict() if quiet else gate_text(result, verbose=verbose).rstrip("\n")))
    if result.exit_code == 2:
        raise TraceInputError("; ".join(result.reasons()))
    # SystemExit, not ctx.exit(): click's non-standalone main() returns ctx.exit()'s code instead of exiting
    sys.exit(result.exit_code)
