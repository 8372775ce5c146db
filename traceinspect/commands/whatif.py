"""``traceinspect whatif``: replay the analysed steps with a rule's fix or hand-written edits and print
the measured, replayed and predicted step time per rank and for the TP step."""

from __future__ import annotations

from typing import Any

import click

from traceinspect.commands.analyze import analysis_options, build_options
from traceinspect.errors import ConfigError
from traceinspect.fileio import write_json_atomic
from traceinspect.units import fmt_pct_signed, fmt_us, fmt_us_signed


def _fix_edits(a: Any, spec: str) -> tuple[list[Any], str]:
    """The edits of ``RULE[:VARIANT]`` for this analysis, and the variant's name and label."""
    from traceinspect.judge.engine import Finding
    from traceinspect.whatif import EditError, replayer
    from traceinspect.whatif.fixes import fix_edits

    rule_id, _, variant = spec.partition(":")
    rule = a.rule_set.get(rule_id) if a.rule_set is not None else None
    if rule is None:
        raise ConfigError(f"--fix {spec}: no rule {rule_id!r} (see `traceinspect rules list`)")
    if not rule.fixes:
        raise ConfigError(f"--fix {spec}: rule {rule_id!r} declares no fixes")
    names = [f.variant for f in rule.fixes]
    i = names.index(variant) if variant in names else (0 if not variant else -1)
    if i < 0:
        raise ConfigError(f"--fix {spec}: rule {rule_id!r} has no variant {variant!r} (it has {', '.join(names)})")
    finding = next((f for f in a.findings if f.rule == rule_id), None)
    if finding is None:
        # the rule did not fire: its fix acts on what the rule selects, without a subject's values
        from traceinspect.judge.engine import _fix_context
        from traceinspect.judge.metrics import Subject

        finding = Finding(rule=rule_id, severity=rule.severity, title=rule.title, message="", share=None,
                          est_saving_us_per_step=None, ranks=[], evidence={}, remediation="")
        finding.fix_context = _fix_context(rule, Subject(rule.select.scope, "", {}), {}, None)
    try:
        edits = fix_edits(replayer(a), a, finding, rule, i)
    except EditError as e:
        raise ConfigError(f"--fix {spec}: {e}") from None
    return edits, f"{rule_id}:{rule.fixes[i].variant} ({rule.fixes[i].label})"


@click.command("whatif")
@click.argument("paths", nargs=-1, required=True)
@analysis_options
@click.option("--fix", "fixes", multiple=True, metavar="RULE[:VARIANT]",
              help="Apply a fix a rule declares (repeatable), e.g. kv-full-pool-cast:gather.")
@click.option("--edit", "edits", multiple=True, metavar="EXPR",
              help="Apply an edit (repeatable), e.g. 'scale class=kv_cast 0.2', 'remove name~=foo', 'host-gaps 0', "
                   "'host-speed 1.5' (the host 1.5x as fast). Edits: scale, remove, transfer, host-gaps, host-stalls, "
                   "launch-cost, host-speed, host-from, async, kv-rows, trim, gemm-m, graph-gaps (docs/whatif.md).")
@click.option("--host-speed-of", "host_of", type=click.Path(exists=True), metavar="PATH",
              help="Give the trace the host speed of another capture of the same work (PATH), per rank, measured "
                   "on the own host time of the CPU ops both run at the same place of a step ('host-speed' edits); "
                   "undecided where they share too few (a CUDA-graph capture runs none).")
@click.option("--batch", "batch", metavar="N|Fx|max",
              help="The decode step at another running batch: N requests, F times the observed batch ('4x'), or "
                   "'max' (the largest the KV pool holds); every kernel scaled by what it depends on (GEMMs by M, "
                   "attention and KV reads by the active tokens, per-token kernels by the batch), capped by the KV "
                   "pool and max_running_requests. Prints tokens/s beside the step.")
@click.option("--max-running-requests", "max_running", type=click.IntRange(min=1), metavar="R",
              help="With --batch: assume the server runs at most R requests (instead of server_info.json's "
                   "max_running_requests), e.g. to ask what raising it gives.")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the prediction as JSON here.")
def whatif_cmd(paths: tuple[str, ...], fixes: tuple[str, ...], edits: tuple[str, ...], host_of: str | None,
               batch: str | None, max_running: int | None, json_out: str | None, **kw: Any) -> None:
    """Predict the step time after a fix by replaying the trace with edits (none: replay as measured)."""
    from traceinspect.pipeline import analyze
    from traceinspect.whatif import EditError, parse_edit, replayer

    try:
        parsed = [parse_edit(e) for e in edits]  # bad edits are reported before the traces are read
        if batch is not None:
            parsed.append(parse_edit(f"batch {batch}" + (f" max-running-requests={max_running}" if max_running else "")))
        elif max_running is not None:
            raise EditError("--max-running-requests needs --batch")
    except EditError as e:
        raise ConfigError(str(e)) from None
    a = analyze(list(paths), build_options(**kw))
    all_edits: list[Any] = []
    labels: list[str] = []
    for spec in fixes:
        ed, label = _fix_edits(a, spec)
        all_edits += ed
        labels.append(label)
    all_edits += parsed
    labels += [e.describe() for e in parsed]
    host_undecided: list[str] = []
    host_json = None
    if host_of:
        from traceinspect.whatif.hostspeed import host_speed_ratio

        hs = host_speed_ratio(a, analyze([host_of], build_options(**kw)))
        host_json = hs.to_json()
        if hs.decided:
            all_edits += [parse_edit(e) for e in hs.edits()]
            labels.append(f"host speed of {host_of}")
        else:
            host_undecided = [f"the host speed of {host_of}: " + "; ".join(r.reason for r in hs.ranks if r.reason)]
    rp = replayer(a)
    p = rp.predict(all_edits, label="; ".join(labels))
    if host_undecided:
        from msgspec.structs import replace

        p = replace(p, undecided=list(p.undecided) + host_undecided)
    doc = p.to_json()
    if host_json is not None:
        doc["host_speed_of"] = {"path": host_of, **host_json}
    doc["fixes"] = list(fixes)
    doc["model"] = rp.describe()
    if json_out:
        write_json_atomic(json_out, doc)
    _print(p, doc, labels)


def _tps(v: float | None) -> str:
    return "n/a" if v is None else f"{v:,.0f}"


def tokens_lines(doc: dict[str, Any]) -> list[str]:
    """Tokens per second of the TP step (batch x steps per second), when the batch is known."""
    b = doc.get("batch") or {}
    if doc.get("measured_tokens_per_s") is None and not b:
        return []
    out: list[str] = []
    obs, new = b.get("observed"), b.get("predicted")
    if b:
        head = (f"batch {obs:,.0f} -> {new:,.0f}" if obs is not None and new is not None
                else "batch " + (f"{obs:,.0f}" if obs is not None else "unknown"))
    else:
        head = "same batch"
    out.append(f"  {'tokens/s':10s} {_tps(doc.get('measured_tokens_per_s')):>12s} "
               f"{_tps(doc.get('replayed_tokens_per_s')):>12s} {_tps(doc.get('predicted_tokens_per_s')):>12s}  ({head})")
    m, p = doc.get("replayed_tokens_per_s"), doc.get("predicted_tokens_per_s")
    if b and m and p:
        out.append(f"  predicted tokens/s: {p:,.0f} against {m:,.0f} replayed ({fmt_pct_signed(p / m - 1)})")
    return out


def _print(p: Any, doc: dict[str, Any], labels: list[str]) -> None:
    for line in whatif_lines(doc, labels):
        click.echo(line)


def whatif_lines(doc: dict[str, Any], labels: list[str]) -> list[str]:
    """The prediction ``doc`` (a replay's JSON form) as the lines ``whatif`` prints."""
    out: list[str] = []
    echo = out.append
    echo("what-if: " + ("; ".join(labels) if labels else "no edits (replay as measured)"))
    for e in doc["edits"]:
        echo(f"  edit: {e['text']}")
    for r in (doc.get("host_speed_of") or {}).get("ranks", []):
        if r["ratio"] is not None:
            echo(f"  host speed: rank {r['rank']} ran {r['ratio']:.3f}x the time of the other capture's host on "
                 f"{r['places']} CPU ops run alike (quartiles {r['q25']:.3f}-{r['q75']:.3f})")
    for n in doc["notes"]:
        echo(f"  note: {n}")
    for u in doc["undecided"]:
        echo(f"  cannot be decided: {u}")
    echo(f"  {'':10s} {'measured':>12s} {'replayed':>12s} {'predicted':>12s}")
    for r in doc["ranks"]:
        echo(f"  {'rank ' + str(r['rank']):10s} {fmt_us(r['measured_step_us']):>12s} "
             f"{fmt_us(r['replayed_step_us']):>12s} {fmt_us(r['predicted_step_us']):>12s}")
    echo(f"  {'TP step':10s} {fmt_us(doc['measured_step_us']):>12s} {fmt_us(doc['replayed_step_us']):>12s} "
         f"{fmt_us(doc['predicted_step_us']):>12s}")
    out += tokens_lines(doc)
    sv = doc["saving_us_per_step"]
    if sv is not None and doc["replayed_step_us"]:
        echo(f"  predicted change: {fmt_us_signed(-sv)} per step ({fmt_pct_signed(-sv / doc['replayed_step_us'])} "
             "of the replayed step time)")
    moved = doc["critical_path"]["moved_onto"]
    if moved:
        echo("  moved onto the critical path: " + ", ".join(
            f"{m['what']} {fmt_us_signed(m['us_per_step'])} per step" for m in moved))
    elif doc["edits"] and doc["predicted_step_us"] is not None:  # undecided: nothing to say about the path
        echo("  moved onto the critical path: nothing new")
    echo(f"  medians over {doc['steps_replayed']} replayed step(s) of {doc['model']['steps_available']}")
    return out
