"""``traceinspect classify``: the kernel name -> class table, for audit."""

from __future__ import annotations

from typing import Any

import click

from traceinspect.commands.analyze import PHASES, allow_mismatch_option
from traceinspect.fileio import write_text_atomic

LABEL_WIDTH = 60  # characters of a kernel name in the table (kernel_labels)


@click.command("classify")
@click.argument("paths", nargs=-1, required=True)
@click.option("--unknown", is_flag=True, help="Only kernels that fell into 'other'.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write the table as CSV.")
@click.option("--all-steps", is_flag=True, help="Every kernel of the trace, not only the analysed steps.")
@click.option("--phase", type=PHASES, default="auto", show_default=True,
              help="Steps to analyse (auto: decode, else the one phase the trace holds).")
@click.option("--server-info", type=click.Path(dir_okay=False), default=None,
              help="server_info.json to use (default: the one beside the traces).")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Model layers (per pipeline stage); wins over server_info and the trace's structure.")
@click.option("--experts", type=click.IntRange(min=1), default=None,
              help="Routed experts of the MoE layers; wins over server_info.")
@click.option("--top-k", "top_k", type=click.IntRange(min=1), default=None,
              help="Experts per token (MoE top-k); wins over server_info.")
@click.option("--table", "tables", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Extra class table YAML (its rules come before the shipped ones).")
@click.option("--limit", type=int, default=40, show_default=True, help="Rows to print (0: all).")
@allow_mismatch_option
def classify_cmd(paths: tuple[str, ...], unknown: bool, csv_out: str | None, all_steps: bool, phase: str,
                 server_info: str | None, layers: int | None, experts: int | None, top_k: int | None,
                 tables: tuple[str, ...], limit: int, allow_mismatch: bool | None) -> None:
    """Print each kernel name with its class, evidence, time and calls."""
    from pathlib import Path

    from traceinspect.analysis import Options
    from traceinspect.classify import load_class_table
    from traceinspect.render.terminal import make_console

    table = load_class_table(extra=[Path(t) for t in tables]) if tables else None
    opts = Options(phase=phase, server_info=server_info, layers=layers, experts=experts, top_k=top_k,
                   allow_mismatch=bool(allow_mismatch))
    a, step_us, rank_steps = classified_analysis(paths, opts, table)
    rows = render_classify(a, step_us, rank_steps, make_console(), unknown=unknown, all_steps=all_steps, limit=limit)
    if csv_out:
        write_text_atomic(csv_out, rows.to_csv(index=False))


def render_classify(a: Any, step_us: float | None, rank_steps: int, con: Any, unknown: bool = False,
                    all_steps: bool = False, limit: int = 40) -> Any:
    """Print the (kernel name, class) table of the analysis ``a`` (:func:`classified_analysis`); returns
    its rows (all of them, not only those printed)."""
    from rich.table import Table

    from traceinspect.classify import class_table_rows
    from traceinspect.render import kernel_labels, short_name
    from traceinspect.render.terminal import escape
    from traceinspect.units import GPU_BASIS, SHARE_BASIS, fmt_count, fmt_pct, fmt_us

    k = a.trace.kernels if all_steps else a.kernels
    rows = class_table_rows(k)
    # per step and of the step time as every other output; every kernel of the trace: of GPU time
    per_step = not all_steps and step_us is not None
    if per_step:
        rows["us_per_step"] = rows["us"] / rank_steps
        rows["share_of_step"] = rows["us_per_step"] / step_us
    if unknown:
        rows = rows[rows["cls"] == "other"]
    scope = "all kernels" if all_steps else f"the {a.phase} steps"
    if unknown and not len(rows):
        con.print(f"No unknown kernels: every kernel in {scope} has a class (class 'other' is empty).")
        return rows
    title = (f"Kernel classes ({scope}; calls and total over the analysed steps of all ranks)" if not all_steps
             else "Kernel classes (all kernels of the trace)")
    t = Table(title=title, title_justify="left")
    cols = ["kernel", "class", "2nd", "evidence", "calls", "total"]
    cols += ["time per step", f"of the {SHARE_BASIS}"] if per_step else [f"of {GPU_BASIS}"]
    for col in cols:
        t.add_column(col, justify="left" if col in ("kernel", "class", "2nd", "evidence") else "right",
                     overflow="fold")
    shown = rows if limit <= 0 else rows.head(limit)
    names = kernel_labels(shown["name"].tolist(), LABEL_WIDTH)
    for r in shown.itertuples():
        cells = [escape(names[r.name]), r.cls, r.cls2 or "", escape(short_name(str(r.evidence), 50)),
                 fmt_count(r.calls), fmt_us(r.us)]
        cells += [fmt_us(r.us_per_step), fmt_pct(r.share_of_step)] if per_step else [fmt_pct(r.share)]
        t.add_row(*cells)
    con.print(t)
    other: Any = rows.loc[rows["cls"] == "other", "share"].sum() if len(rows) else 0.0
    con.print(f"{len(rows)} (kernel name, class) row(s); class 'other': {fmt_pct(other)} of {GPU_BASIS}"
              + (f"; {len(rows) - len(shown)} more not shown (--limit 0)" if len(rows) > len(shown) else ""))
    if per_step:
        con.print(f"Shares are of the {a.phase} {SHARE_BASIS}: median {fmt_us(step_us)} per step (the slowest "
                  f"rank's GPU span); times per step are means per rank.")
    return rows


def classified_analysis(paths: tuple[str, ...], opts: Any, table: Any = None) -> tuple[Any, float | None, int]:
    """The analysis record up to the step selection (no measures, no rules), classified as ``analyze``
    classifies it (with an extra class ``table``): the record, the median step time (the document's
    ``steps.median_us``) and the analysed rank-steps (``steps.rank_steps``)."""
    from traceinspect import pipeline
    from traceinspect.measure.time import percentile
    from traceinspect.model.run import user_facts

    ts = pipeline.load(list(paths), phase=opts.phase, server_info=opts.server_info,
                       allow_mismatch=opts.allow_mismatch)
    pipeline.link(ts)
    stepped = pipeline.steps(ts, opts.phase)
    opts.phase = stepped.phase
    user = user_facts(opts.layers, opts.experts, opts.top_k, config=opts.config)
    labels = pipeline.classify(ts, stepped, user=user, table=table, phase=opts.phase)
    selected = pipeline.select(ts, stepped, opts.phase)
    a = pipeline.record(ts, opts, stepped, labels, selected)
    step = percentile(a.step_samples()["step_us"], 50) if len(a.selected) else float("nan")
    return a, (step if step == step and step > 0 else None), max(len(a.selected), 1)
