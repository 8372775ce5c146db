"""Terminal summary of an analysis (rich tables; plain text when not a TTY)."""

from __future__ import annotations

import re
from typing import Any

from rich.console import Console
from rich.markup import escape as _markup_escape
from rich.table import Table

from traceinspect.render import fmt_count, kernel_labels
from traceinspect.render import fmt_pct as _pct
from traceinspect.render import fmt_us as _us
from traceinspect.render.story import saving_text, share_of_step, source_text, story
from traceinspect.render.whatif import all_fixed_line, group_note, variant_lines

KERNEL_LABEL_WIDTH = 70  # characters of a kernel name in the top-kernels table
SEVERITY_STYLE = {"critical": "bold red", "warning": "yellow", "info": "cyan"}
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # all but tab and newline


def plain_text(text: str) -> str:
    """Text safe to print on a terminal: control characters (escape sequences a trace's names may
    carry) become U+FFFD."""
    return _CONTROL.sub("\ufffd", text)


def escape(text: str) -> str:
    """Trace-derived text for rich: markup escaped and control characters made inert."""
    return _markup_escape(plain_text(text))


def make_console() -> Console:
    """A console for CLI output: the terminal's width on a TTY, a wide fixed width when piped (logs,
    CI) so tables are not folded into unreadable columns."""
    return Console(highlight=False, soft_wrap=False, width=None if Console().is_terminal else 140)


def render(doc: dict[str, Any], console: Console | None = None) -> None:
    """Print the summary of an analysis document: run, steps, time per class, top kernels, findings,
    warnings."""
    con = console or make_console()
    run, steps = doc["run"], doc["steps"]
    con.print(f"[bold]traceinspect[/bold] {escape(', '.join(doc['source']['paths']))}")
    con.print(
        f"  {run['ranks']} rank(s) on {escape(str(run['device'] or 'an unknown device'))}"
        f"  model {escape(str(run['model'] or 'unknown'))}"
        f"  KV dtype {escape(str(run['kv_cache_dtype'] or 'unknown'))}"
        f"  CUDA graph {'yes' if run['cuda_graph'] else 'no'}"
    )
    found = ", ".join(f"{k} {v}" for k, v in sorted(steps["found"].items()))
    con.print(f"  steps found per phase (all ranks): {escape(found)}; source: {escape(source_text(steps.get('source')))};"
              f" edge steps excluded: {steps['excluded_edge']}")
    con.print(f"  [bold]{steps['phase']} step[/bold] (slowest rank's GPU span): median {_us(steps['median_us'])},"
              f" p90 {_us(steps['p90_us'])} over {steps['count']} step(s) per rank")
    if steps.get("between_share") is not None:
        con.print(f"  between {steps['phase']} steps (scheduler and host work outside the forward): median "
                  f"{_us(steps['between_us'])}, {_pct(steps['between_share'])} of the {steps['phase']} cycle: the most "
                  "that batching decode steps (--num-continuous-decode-steps) can save")

    st = story(doc)
    if st.lead is not None:
        f = st.lead
        style = SEVERITY_STYLE.get(f["severity"], "")
        con.print(f"\n[{style}]{f['severity'].upper()}[/{style}] [bold]{escape(f['rule'])}[/bold]: "
                  f"[bold]{escape(str(f.get('title') or ''))}[/bold]"
                  + (f"; est. saving {escape(st.saving)}" if st.saving else ""))
    else:
        con.print(f"\n[green]{escape(st.quiet)}[/green]")
    for o in st.open:
        con.print(f"[magenta]{escape(o.text)}[/magenta]")
    con.print("")

    rt = Table(title="Ranks (per step, median)", title_justify="left")
    for col in ("rank", "device", "steps", "step", "p90", "GPU busy", "GPU idle"):
        rt.add_column(col, justify="right" if col not in ("device",) else "left")
    for r in doc["ranks"]:
        rt.add_row(escape(r["label"]), escape(str(r["device"] or "unknown")), str(r["steps"]), _us(r["step_us"]["median"]),
                   _us(r["step_us"]["p90"]), _us(r["gpu_busy_us"]), _us(r["idle_us"]))
    con.print(rt)

    ct = Table(title="GPU time by class (mean per rank per step)", title_justify="left")
    for col in ("class", "time per step", "of the step time", "calls per step"):
        ct.add_column(col, justify="left" if col == "class" else "right")
    for cls, v in sorted(doc["classes"].items(), key=lambda kv: -(kv[1]["us_per_step"] or 0)):
        ct.add_row(cls, _us(v["us_per_step"]), _pct(share_of_step(v, doc)), fmt_count(v["calls_per_step"]))
    con.print(ct)

    kt = Table(title="Top kernels (calls and total over the analysed steps of all ranks; share: of the step time)",
               title_justify="left")
    for col in ("kernel", "class", "calls", "total", "mean", "share"):
        kt.add_column(col, justify="left" if col in ("kernel", "class") else "right", overflow="fold")
    top = doc["top_kernels"][:12]
    labels = kernel_labels([k["name"] for k in top], KERNEL_LABEL_WIDTH)
    for k in top:
        kt.add_row(escape(labels[k["name"]]), k["cls"], fmt_count(k["calls"]), _us(k["us"]), _us(k["mean_us"]),
                   _pct(share_of_step(k, doc)))
    con.print(kt)

    _render_roofline(con, doc)

    cov = doc["coverage"]
    con.print(f"  classified: {_pct(1 - (cov['unknown_share'] or 0))} of GPU time"
              f" (other {_pct(cov['unknown_share'])}); graph-replayed {_pct(cov['graph_replay_share'])};"
              f" with CPU op {_pct(cov['cpu_op_linked_share'])}")
    con.print(f"  {escape(st.basis)}")

    if st.findings:
        con.print(f"\n[bold]Findings ({len(st.findings)})[/bold], most severe first, then by estimated saving")
        for f in st.findings:
            style = SEVERITY_STYLE.get(f["severity"], "")
            con.print(f"[{style}]{f['severity'].upper():8}[/{style}] [bold]{escape(f['rule'])}[/bold]: "
                      f"{escape(f['message'])}")
            saving = saving_text(f, doc)
            if saving is not None:
                con.print(f"          est. saving {escape(saving)}")
            for line in variant_lines(f):
                con.print(f"          {escape(line)}")
            note = group_note(f)
            if note:
                con.print(f"          {escape(note)}")
            con.print(f"          fix: {escape(str(f['remediation']).strip())}")
        line = all_fixed_line(doc)
        if line:
            con.print(f"\n[bold]{escape(line)}[/bold]")
    else:
        con.print(f"\n[green]{escape(st.quiet)}[/green]")
    _render_gaps(con, doc)
    for w in doc.get("warnings") or []:
        con.print(f"[yellow]warning:[/yellow] {escape(w)}")


def _render_roofline(con: Console, doc: dict[str, Any]) -> None:
    """The kernel rows with shapes against the roofline (the longest first)."""
    from traceinspect.render.roofline import fmt_rate, fmt_share, no_floor_note, roofline_rows

    rows = roofline_rows(doc, 10)
    if rows:
        t = Table(title="Roofline (kernel rows with shapes, per rank per step)", title_justify="left")
        for col in ("kind", "kernel / shape", "time", "TFLOP/s", "GB/s", "% of BW", "floor", "bound", "% of roofline"):
            t.add_column(col, justify="left" if col in ("kind", "kernel / shape", "bound") else "right", overflow="fold")
        for r in rows:
            t.add_row(r["kind"], escape(r["label"]), _us(r["us"]), fmt_rate(r["tflops"], "").strip(),
                      fmt_rate(r["gbps"], "").strip(), fmt_share(r["pct_bw"]), _us(r["floor"]), r["bound"],
                      fmt_share(r["pct_roofline"]))
        con.print(t)
    note = no_floor_note(doc)
    if note:
        con.print(f"  {escape(note)}")


def _render_gaps(con: Console, doc: dict[str, Any]) -> None:
    """Rules that could not decide and large classes nothing explains, with how to supply the evidence."""
    from traceinspect.render.gaps import gap_items

    items = gap_items(doc)
    if not items:
        return
    con.print(f"\n[bold]Not decided ({len(items)})[/bold]")
    for it in items:
        con.print(f"[magenta]{it.kind.upper():11}[/magenta] {escape(it.head)}")
        for m in it.missing:
            con.print(f"          missing: {escape(m)}")
        for h in it.how:
            con.print(f"          {'supply' if it.kind == 'undecided' else 'explain'}: {escape(h)}")
