"""``traceinspect rules``: list, show, test and explain the rules, and print the metric namespace."""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from traceinspect.commands.analyze import analysis_options, build_options
from traceinspect.units import fmt_pct, fmt_us

RULES_OPT = click.option("--rules", "rules", multiple=True, type=click.Path(),
                         help="Extra rule file or directory (repeatable).")


def _load(rules: tuple[str, ...], only: tuple[str, ...] = (), shipped: bool = True) -> Any:
    from traceinspect.judge import load_rule_set

    return load_rule_set(extra=rules, only=only, shipped=shipped)


def _console() -> Any:
    from traceinspect.render.terminal import make_console

    return make_console()


@click.group("rules")
def rules_cmd() -> None:
    """List, show, test and explain the diagnostic rules (rules/*.yaml)."""


@rules_cmd.command("list")
@RULES_OPT
def list_cmd(rules: tuple[str, ...]) -> None:
    """Every rule: id, severity, steps it applies to, title and file."""
    from rich.markup import escape
    from rich.table import Table

    rs = _load(rules)
    t = Table(title=f"{len(rs)} rules", title_justify="left")
    for col in ("id", "severity", "steps", "select", "title", "file"):
        t.add_column(col, overflow="fold")
    for r in rs:
        t.add_row(r.id, r.severity, r.phase, r.select.scope, escape(r.title),
                  escape(f"{r.source.name}:{r.line}" if r.source else ""))
    _console().print(t)


@rules_cmd.command("show")
@click.argument("rule_id")
@RULES_OPT
def show_cmd(rule_id: str, rules: tuple[str, ...]) -> None:
    """The full text of one rule with the definitions of the metrics it uses."""
    from traceinspect.errors import ConfigError
    from traceinspect.judge.docs import rule_markdown

    rs = _load(rules)
    rule = rs.get(rule_id)
    if rule is None:
        raise ConfigError(f"no rule {rule_id!r} (known: {', '.join(sorted(rs.ids))})")
    click.echo(rule_markdown(rule, generated_note=False))


@rules_cmd.command("metrics")
@click.argument("scope", required=False,
                type=click.Choice(["run", "kernels", "gemm", "rank", "class"]))
def metrics_cmd(scope: str | None) -> None:
    """The metric namespace rules are written against (all scopes, or one)."""
    from traceinspect.judge import metrics as M

    for s in [scope] if scope else list(M.SCOPES):
        click.echo(f"[{s}]" + ("  (visible to every rule)" if s == "run" else f"  (rules with select: {s})"))
        for m in M.own_metrics(s).values():
            click.echo(f"  {m.name:<28} {m.unit:<8} {m.definition}")
        click.echo("")


@rules_cmd.command("docs")
@click.argument("out_dir", type=click.Path(file_okay=False), default="docs/rules")
@RULES_OPT
def docs_cmd(out_dir: str, rules: tuple[str, ...]) -> None:
    """Write the rule documentation pages (one per rule, an index and the metric list)."""
    from traceinspect.fileio import write_text_atomic as write_atomic
    from traceinspect.judge.docs import index_markdown, metrics_markdown, rule_markdown

    rs = _load(rules)
    out = Path(out_dir)
    for r in rs:
        write_atomic(out / f"{r.id}.md", rule_markdown(r))
    write_atomic(out / "index.md", index_markdown(rs))
    write_atomic(out / "metrics.md", metrics_markdown())
    click.echo(f"wrote {len(rs) + 2} pages to {out}")


@rules_cmd.command("check")
@click.argument("paths", nargs=-1, required=True, type=click.Path())
def check_cmd(paths: tuple[str, ...]) -> None:
    """Validate rule files or directories (exit 2 with file:line: reason on the first error)."""
    from traceinspect.judge.rules import load_rule_file, rule_files

    n = 0
    for p in paths:
        for f in rule_files(Path(p)):
            rules = load_rule_file(f)
            n += len(rules)
            click.echo(f"{f}: {len(rules)} rule(s) OK")
    if not n:
        click.echo("no rules found")


@rules_cmd.command("explain")
@click.argument("paths", nargs=-1, required=True)
@analysis_options
def explain_cmd(paths: tuple[str, ...], **kw: Any) -> None:
    """Analyse a trace set and say, for every rule, whether it fired and why (or why not)."""
    from traceinspect.pipeline import analyze

    a = analyze(list(paths), build_options(**kw))
    rs = a.rule_set if a.rule_set is not None else _load(tuple(kw.get("rules") or ()), tuple(kw.get("only") or ()))
    render_explain(a, rs, a.to_json(report=False), _console())


def render_explain(a: Any, rs: Any, doc: dict[str, Any], con: Any) -> None:
    """Every rule's outcome on the analysis ``a``, with the finding as the document ``doc`` (of ``a``) has
    it: the saving replayed, rank findings merged, as every other output shows it."""
    from rich.markup import escape

    from traceinspect.judge import explain
    from traceinspect.render.story import saving_text

    style = {"fired": "bold red", "silent": "green", "undecided": "yellow", "skipped": "dim", "error": "bold magenta"}
    for o in explain(a, rs):
        subj = f" [{escape(o.subject)}]" if o.subject else ""
        con.print(f"[{style.get(o.status, '')}]{o.status:9}[/] [bold]{o.rule}[/bold]{subj}")
        if o.finding is not None:
            con.print(f"          {escape(o.finding.message)}")
            f = _document_finding(doc, o.finding.rule, o.finding.ranks, o.finding.evidence.get("subject"))
            saving = saving_text(f, doc) if f is not None else None
            if f is not None and saving is not None:
                con.print(f"          est. saving {escape(saving)}")
            elif f is not None:
                con.print("          est. saving: not available (no fix could be replayed)")
        for why in o.reasons:
            con.print(f"          - {escape(why)}")


def _document_finding(doc: dict[str, Any], rule: str, ranks: list[int], subject: Any = None) -> dict[str, Any] | None:
    """The document's finding of ``rule`` on ``subject``, else the one that covers ``ranks`` (a rank
    finding is merged into one finding naming every rank it fired on)."""
    mine = [f for f in doc.get("findings") or [] if f.get("rule") == rule]
    for f in mine:
        if subject is not None and (f.get("evidence") or {}).get("subject") == subject:
            return f
    for f in mine:
        if set(ranks) <= set(f.get("ranks") or []):
            return f
    return mine[0] if mine else None


@dataclass
class _Case:
    rule: str
    expect: str  # 'fires' | 'silent'
    path: Path
    written: str
    model_config: Path | None = None


def _cases(rs: Any) -> tuple[list[_Case], list[str]]:
    """Every rule on every trace set any rule names: its own ``tests`` say what it must do there; a
    set whose manifest.json plants the rule (``planted``) must make it fire; elsewhere it only has to
    run without error (``runs``)."""
    cases, problems = [], []
    declared: dict[tuple[str, Path, Path | None], str] = {}
    sets: dict[tuple[Path, Path | None], str] = {}
    for r in rs:
        for kind in ("fires", "silent", "undecided"):
            written = r.tests.get(kind, [])
            for w, p, mc in zip(written, r.test_paths(kind), r.test_model_configs(kind), strict=True):
                declared[(r.id, p, mc)] = kind
                sets.setdefault((p, mc), w)
            if not written and kind != "undecided":
                problems.append(f"{r.id}: names no fixture it must {'fire on' if kind == 'fires' else 'stay silent on'}")
    for (p, mc), w in sets.items():
        planted = _planted(p) if mc is None else set()
        for r in rs:
            kind = declared.get((r.id, p, mc)) or ("fires" if r.id in planted else "runs")
            cases.append(_Case(r.id, kind, p, w, mc))
    return cases, problems


def _planted(path: Path) -> set[str]:
    """Rule ids a trace set's manifest.json says were planted in it (none when it has no manifest)."""
    import json

    try:
        man = json.loads((path / "manifest.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    planted = man.get("planted") if isinstance(man, dict) else None
    return {str(x) for x in planted} if isinstance(planted, list) else set()


@rules_cmd.command("test")
@RULES_OPT
@click.option("--only", multiple=True, help="Test only this rule id (repeatable).")
@click.option("--no-shipped", is_flag=True, help="Test only the rules of --rules, not the shipped ones.")
@click.option("--allow-missing", is_flag=True,
              help="Skip (instead of fail) fixtures that are not present and rules without fixtures.")
@click.option("--jobs", "-j", type=int, default=None, help="Rank-file parse processes (default: one per two CPUs; 1: this process).")
def test_cmd(rules: tuple[str, ...], only: tuple[str, ...], no_shipped: bool, allow_missing: bool,
             jobs: int | None) -> None:
    """Run every rule on every trace set the rules name: a rule must fire on each of its `tests.fires`
    sets and on every set whose manifest.json plants it, stay silent on each of its `tests.silent`
    sets (like `semgrep --test`), be undecided (and not fire) on each of its `tests.undecided` sets
    (evidence missing there), and run without error everywhere else. Exit 1 if any check fails."""
    from rich.markup import escape

    from traceinspect.errors import ConfigError, TraceInputError
    from traceinspect.judge import explain
    from traceinspect.pipeline import Options, analyze

    rs = _load(rules, only, shipped=not no_shipped)
    con = _console()
    cases, problems = _cases(rs)
    failed = skipped = passed = 0
    for p in problems:
        if allow_missing:
            skipped += 1
            con.print(f"[yellow]SKIP[/yellow] {escape(p)}")
        else:
            failed += 1
            con.print(f"[red]FAIL[/red] {escape(p)}")
    by_fixture: dict[tuple[Path, str, Path | None], list[_Case]] = defaultdict(list)
    for c in cases:
        rule = rs.get(c.rule)
        phase = rule.phase if rule.phase != "all" else "decode"
        by_fixture[(c.path, phase, c.model_config)].append(c)
    for (path, phase, mc), group in sorted(by_fixture.items(),
                                           key=lambda kv: (str(kv[0][0]), kv[0][1], str(kv[0][2] or ""))):
        if not path.exists():
            for c in group:
                tag = "[yellow]SKIP[/yellow]" if allow_missing else "[red]FAIL[/red]"
                skipped += allow_missing
                failed += not allow_missing
                con.print(f"{tag} {c.rule} {c.expect} {escape(c.written)}: fixture not found ({escape(str(path))})")
            continue
        try:
            a = analyze([str(path)], Options(phase=phase, jobs=jobs, command="traceinspect rules test",
                                             model_config=str(mc) if mc is not None else None))
        except (TraceInputError, ConfigError) as e:
            for c in group:
                failed += 1
                con.print(f"[red]FAIL[/red] {c.rule} {c.expect} {escape(c.written)}: cannot analyse: "
                          f"{escape(e.one_line())}")
            continue
        outcomes = explain(a, rs)
        for c in group:
            mine = [o for o in outcomes if o.rule == c.rule]
            fired = [o for o in mine if o.status == "fired"]
            errors = [o for o in mine if o.status == "error"]
            if c.expect == "runs":
                if errors:
                    failed += 1
                    con.print(f"[red]FAIL[/red] {c.rule} errored on {escape(c.written)}: "
                              f"{escape('; '.join(errors[0].reasons))}")
                else:
                    passed += 1
                    status = "fired" if fired else ("undecided" if any(o.status == "undecided" for o in mine)
                                                    else "silent")
                    con.print(f"[dim]RAN [/dim] {c.rule} on {escape(c.written)}: {status}")
                continue
            undecided = [o for o in mine if o.status == "undecided"]
            ok = not errors and (bool(fired) if c.expect == "fires" else
                                 not fired and bool(undecided) if c.expect == "undecided" else not fired)
            if ok:
                passed += 1
                detail = ""
                if fired:
                    f = fired[0].finding
                    assert f is not None
                    detail = (f" ({fmt_pct(f.share)} of the step time, est. saving "
                              f"{fmt_us(f.est_saving_us_per_step)} per step)")
                con.print(f"[green]PASS[/green] {c.rule} {c.expect} on {escape(c.written)}{detail}")
            else:
                failed += 1
                should = {"fires": "fired", "undecided": "been undecided"}.get(c.expect, "stayed silent")
                con.print(f"[red]FAIL[/red] {c.rule} should have {should}"
                          f" on {escape(c.written)}")
                for o in errors or fired or mine:
                    msg = o.finding.message if o.finding is not None else "; ".join(o.reasons)
                    con.print(f"       {o.status}{' [' + escape(o.subject) + ']' if o.subject else ''}: {escape(msg)}")
    con.print(f"\n{passed} passed, {failed} failed, {skipped} skipped ({len(rs)} rules)")
    if failed:
        # SystemExit, not click's Exit: the non-standalone main() would return its code instead of exiting
        sys.exit(1)
