"""``traceinspect classify``: the kernel name -> class table, for audit."""

from __future__ import annotations

from typing import Any

import click

from traceinspect.commands.analyze import PHASES, allow_mismatch_option
from traceinspect.fileio import write_text_atomic


@click.command("classify")
@click.argument("paths", nargs=-1, required=True)
@click.option("--unknown", is_flag=True, help="Only kernels that fell into 'other'.")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), help="Write the table as CSV.")
@click.option("--all-steps", is_flag=True, help="Every kernel of the trace, not only the analysed steps.")
@click.option("--phase", type=PHASES, default="decode", show_default=True)
@click.option("--server-info", type=click.Path(dir_okay=False), default=None)
@click.option("--table", "tables", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Extra class table YAML (its rules come before the shipped ones).")
@click.option("--limit", type=int, default=40, show_default=True, help="Rows to print (0: all).")
@allow_mismatch_option
def classify_cmd(paths: tuple[str, ...], unknown: bool, csv_out: str | None, all_steps: bool, phase: str,
                 server_info: str | None, tables: tuple[str, ...], limit: int, allow_mismatch: bool | None) -> None:
    """Print each kernel name with its class, evidence, time and calls."""
    from pathlib import Path

    from rich.table import Table

    from traceinspect import pipeline
    from traceinspect.classify import class_table_rows, load_class_table
    from traceinspect.render import short_name
    from traceinspect.render.terminal import escape, make_console

    table = load_class_table(extra=[Path(t) for t in tables]) if tables else None
    ts, stepped, _ = pipeline.classified(paths, phase=phase, server_info=server_info, table=table,
                                         allow_mismatch=bool(allow_mismatch))
    k = ts.kernels if all_steps else pipeline.select(ts, stepped, phase).kernels
    rows = class_table_rows(k)
    if unknown:
        rows = rows[rows["cls"] == "other"]
    if csv_out:
        write_text_atomic(csv_out, rows.to_csv(index=False))
    con = make_console()
    if unknown and not len(rows):
        scope = "all kernels" if all_steps else f"the {phase} steps"
        con.print(f"No unknown kernels: every kernel in {scope} has a class (class 'other' is empty).")
        return
    t = Table(title=f"Kernel classes ({'all kernels' if all_steps else phase + ' steps'})", title_justify="left")
    for col in ("kernel", "class", "2nd", "evidence", "calls", "us", "share"):
        t.add_column(col, justify="right" if col in ("calls", "us", "share") else "left", overflow="fold")
    shown = rows if limit <= 0 else rows.head(limit)
    for r in shown.itertuples():
        t.add_row(escape(short_name(r.name, 60)), r.cls, r.cls2 or "", escape(short_name(str(r.evidence), 50)),
                  str(r.calls), f"{r.us:,.1f}", f"{100 * r.share:.2f}%")
    con.print(t)
    other: Any = rows.loc[rows["cls"] == "other", "share"].sum() if len(rows) else 0.0
    con.print(f"{len(rows)} kernel name(s); other: {100 * other:.2f}% of kernel time"
              + (f"; {len(rows) - len(shown)} more not shown (--limit 0)" if len(rows) > len(shown) else ""))
