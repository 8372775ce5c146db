"""Evaluate rules over an analysis: subjects from the selector, conditions, the savings estimate
and the finding.

Savings follow Nsight Compute's GLOBAL speedup estimates: a rule's ``impact`` is the time per step
of what it points at (a kernel family, a rank's collective wait, idle time) and ``share`` is that
impact over the step time; ``estimate`` is the time per step that fixing it would save, capped by
the impact (a child never claims more than its parent) and by the step time.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from traceinspect import units
from traceinspect.judge import metrics as M
from traceinspect.judge.expr import Expr, ExprError, evaluate_explain
from traceinspect.judge.rule import Rule, RuleSet
from traceinspect.model.findings import Finding, _round, finding_order, quantity

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

MAX_MESSAGE = 2000
MAX_TEXT_VALUE = 160  # characters of a text metric inside a message


class Outcome(msgspec.Struct):
    """What one rule concluded on one subject: fired, silent, undecided, skipped or error, and why."""

    rule: str
    status: str
    subject: str = ""
    reasons: list[str] = msgspec.field(default_factory=list)
    finding: Finding | None = None
    values: dict[str, Any] = msgspec.field(default_factory=dict)
    # undecided: the unavailable metrics the undecided conditions read (through ``let``), and why
    missing: dict[str, str] = msgspec.field(default_factory=dict)
    classes: tuple[str, ...] = ()  # kernel classes of the subject's kernels


def _fmt_value(v: Any, spec: str) -> str:
    if v is None:
        return "n/a"
    if spec in units.SPECS and not isinstance(v, (str, bool, np.bool_)):
        return units.format_spec(v, spec) or "n/a"
    if isinstance(v, str):
        s = " ".join(v.split())
        return s if len(s) <= MAX_TEXT_VALUE else s[:MAX_TEXT_VALUE - 1] + "…"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    try:
        if spec.endswith("d") and isinstance(v, float):
            v = int(round(v))
        return format(v, spec)
    except (ValueError, TypeError):
        return str(_round(v))


def _describe_values(expr: Expr, env: dict[str, Any], rule: Rule) -> str:
    """``name=value`` for the metrics an expression reads (through the rule's ``let`` names too)."""
    parts: list[str] = []
    seen: set[str] = set()

    def add(names: frozenset[str]) -> None:
        for n in sorted(names):
            if n in rule.params or n in seen:
                continue
            seen.add(n)
            v = env.get(n)
            parts.append(f"{n}={_fmt_value(v, '')!r}" if isinstance(v, str) else f"{n}={_round(v)}")
            if n in rule.let:
                add(rule.let[n].names)

    add(expr.names)
    return ", ".join(parts)


class _Subjects:
    """Builds the subjects of a selector from the metric context."""

    def __init__(self, ctx: M.MetricContext) -> None:
        self.ctx = ctx

    def of(self, rule: Rule) -> tuple[list[M.Subject], str | None]:
        sel = rule.select
        ctx = self.ctx
        if sel.scope == "run":
            return [ctx.run_subject()], None
        if sel.scope == "rank":
            return ctx.rank_subjects(), None
        if sel.scope == "class":
            subs = ctx.class_subjects(sel.classes or None)
            return subs, (None if subs else "no GPU time in the selected classes")
        if sel.scope == "kernels":
            k = ctx.k
            if not len(k):
                return [], "no kernels in the analysed steps"
            from traceinspect.tables import name_mask, text_isin

            mask = np.ones(len(k), dtype=bool)
            if sel.classes:
                mask &= text_isin(k["cls"], sel.classes)
            if sel.kinds:
                mask &= text_isin(k["kind"], sel.kinds)
            if sel.graph is not None:
                mask &= (k["graph_replay"].to_numpy() == sel.graph)
            if sel.name is not None or sel.not_name is not None:
                mask &= name_mask(k["name"], sel.name, sel.not_name)
            if sel.op is not None or sel.not_op is not None:
                mask &= name_mask(k["op_path"] if "op_path" in k.columns else k["op_name"], sel.op, sel.not_op)
            subs = ctx.kernel_subjects(mask, sel.group_by)
            return subs, (None if subs else "no kernel matched the selector")
        if sel.scope == "gemm":
            rows = ctx.gemm_rows()
            if rows is None:
                return [], "GEMM efficiency is unavailable (" + _eff_reason(ctx) + ")"
            if sel.moe is not None:
                rows = rows[rows["is_moe"].astype(bool) == sel.moe]
            if sel.classes:
                rows = rows[rows["cls"].isin(sel.classes)]
            unknown = rows[~rows["known"].astype(bool)]
            known_all = rows[rows["known"].astype(bool)]
            if sel.where is not None and len(rows):
                keep = np.zeros(len(rows), dtype=bool)
                known = rows["known"].to_numpy(dtype=bool)
                cols = ctx.gemm_columns(rows)
                for i in range(len(rows)):
                    if not known[i]:
                        continue
                    env = dict(ctx.run)
                    env.update(ctx.gemm_row_values(cols, i))
                    env.update(rule.params)
                    keep[i] = bool(sel.where.evaluate(env))
                rows = rows[keep]
            subs = ctx.gemm_subjects(rows, sel.group_by, unknown)
            # GEMMs whose shapes are all unknown cannot be selected or judged: undecided, not silent
            subs += ctx.gemm_unknown_subjects(unknown, sel.group_by, known_all)
            return subs, (None if subs else "no GEMM matched the selector")
        return [], f"unknown scope {sel.scope}"


def _eff_reason(ctx: M.MetricContext) -> str:
    eff = ctx.a.efficiency
    if eff is None:
        return "the efficiency stage did not run"
    return getattr(eff, "reason", None) or "no GEMM shapes were recovered"


def _evaluate_rule(rule: Rule, ctx: M.MetricContext, subjects: _Subjects, phase: str) -> list[Outcome]:
    # steps whose phase no marker states count for decode and prefill alike (as in select_steps); the
    # analysis warns that their phase was not marked
    if rule.phase != "all" and rule.phase != phase and not (phase == "unknown" and rule.phase in ("decode", "prefill")):
        return [Outcome(rule.id, "skipped", reasons=[f"rule applies to {rule.phase} steps; the analysis is of "
                                                      f"{phase} steps"])]
    subs, why_none = subjects.of(rule)
    if not subs:
        return [Outcome(rule.id, "silent", reasons=[why_none or "nothing selected"])]
    out = []
    for sub in subs:
        if sub.scope == "gemm" and sub.values.get("shapes") == 0:
            why = sub.missing.get("m", "GEMM shapes unknown")
            where = f"select.gemm.where `{rule.select.where.source}`" if rule.select.where is not None else "the rule"
            out.append(Outcome(rule.id, "undecided", sub.label, [f"{where} cannot be decided: m unavailable: {why}"],
                               values=sub.values, missing={"m": why}, classes=sub.classes))
            continue
        env: dict[str, Any] = dict(ctx.run)
        env.update(sub.values)
        env.update(rule.params)
        missing = dict(ctx.run_missing)
        missing.update(sub.missing)
        for name, expr in rule.let.items():
            val, why = evaluate_explain(expr, env)
            env[name] = val
            if val is None:
                missing[name] = _explain_none(expr, why, missing)
        out.append(_judge(rule, sub, env, missing, ctx))
    return out


def _explain_none(expr: Expr, reason: str | None, missing: dict[str, str]) -> str:
    names = [n for n in sorted(expr.names) if n in missing]
    if names:
        return "; ".join(f"{n} unavailable: {missing[n]}" for n in names)
    return reason or "cannot decide"


def _judge(rule: Rule, sub: M.Subject, env: dict[str, Any], missing: dict[str, str],
           ctx: M.MetricContext) -> Outcome:
    reasons: list[str] = []
    undecided: list[str] = []
    leaves: dict[str, str] = {}
    for i, cond in enumerate(rule.when):
        try:
            val, why = evaluate_explain(cond, env)
        except ExprError as e:
            return Outcome(rule.id, "error", sub.label, [f"when[{i}]: {e}"])
        label = f"when[{i}] `{cond.source}`"
        if val is None:
            undecided.append(f"{label} cannot be decided: {_explain_none(cond, why, missing)}")
            leaves.update(_missing_leaves(cond.names, rule, missing))
        elif not val:
            reasons.append(f"{label} is false ({_describe_values(cond, env, rule)})")
    if reasons:
        return Outcome(rule.id, "silent", sub.label, reasons + undecided, values=sub.values, classes=sub.classes)
    if undecided:
        return Outcome(rule.id, "undecided", sub.label, undecided, values=sub.values, missing=leaves,
                       classes=sub.classes)
    return Outcome(rule.id, "fired", sub.label, [], _finding(rule, sub, env, missing, ctx), values=sub.values,
                   classes=sub.classes)


def _missing_leaves(names: frozenset[str], rule: Rule, missing: dict[str, str],
                    seen: set[str] | None = None) -> dict[str, str]:
    """The unavailable metrics behind ``names``: a ``let`` name stands for the metrics it reads."""
    seen = set() if seen is None else seen
    out: dict[str, str] = {}
    for n in sorted(names):
        if n in seen or n in rule.params:
            continue
        seen.add(n)
        if n in rule.let:
            out.update(_missing_leaves(rule.let[n].names, rule, missing, seen))
        elif n in missing:
            out[n] = missing[n]
    return out


def _default_impact(sub: M.Subject) -> float | None:
    for key in ("us_per_step", "class_us_per_step"):
        if key in sub.values:
            return quantity(sub.values[key])
    return None


def bound_estimate(rule: Rule, est: float | None, impact: float | None, step_us: float | None,
                   ctx: M.MetricContext) -> tuple[float | None, list[str]]:
    """The estimate a finding may claim: never negative, never more than the time of what it fixes
    (its impact), than the step time, or, for a rule that removes GPU idle time (``removes: idle``),
    than the idle inside the step. Returns the estimate and the names of the bounds that cut it."""
    bounds = {"impact": impact, "step time": step_us}
    if rule.removes == "idle":
        bounds["idle inside the step"] = quantity(ctx.run.get("idle_us_per_step"))
    out, cut = units.clamp_estimate(est, *bounds.values())
    names = [n for n, b in bounds.items() if b is not None and b in cut]
    return out, names


def _finding(rule: Rule, sub: M.Subject, env: dict[str, Any], missing: dict[str, str],
             ctx: M.MetricContext) -> Finding:
    evidence: dict[str, Any] = {"subject": sub.label}
    notes: list[str] = []
    # every share is of the step time (the slowest rank's GPU span, median over the analysed steps)
    step_us = quantity(ctx.run.get("step_us"))
    if rule.impact is not None:
        impact_v, why = evaluate_explain(rule.impact, env)
        impact = quantity(impact_v)
        if impact is None:
            notes.append("impact unavailable: " + _explain_none(rule.impact, why, missing))
    else:
        impact = _default_impact(sub)
    if impact is not None:  # the time of what it points at fits in the step (and in its idle, for idle)
        idle = quantity(ctx.run.get("idle_us_per_step")) if rule.removes == "idle" else None
        impact, _ = units.clamp_estimate(impact, step_us, idle)
    est_v, why = evaluate_explain(rule.estimate, env)
    est = quantity(est_v)
    if est is None:
        notes.append("estimate unavailable: " + _explain_none(rule.estimate, why, missing))
    est, cut = bound_estimate(rule, est, impact, step_us, ctx)
    if cut:
        evidence["estimate_capped_at"] = cut
    share = impact / step_us if impact is not None and step_us else None
    evidence["impact_us_per_step"] = impact
    evidence["step_us"] = step_us
    evidence["saving_share"] = est / step_us if est is not None and step_us else None
    names = list(rule.evidence) if rule.evidence else [n for n in rule.metric_names() if n not in evidence]
    for n in names:
        expr = rule.evidence.get(n)
        if expr is not None:
            try:
                v, _ = evaluate_explain(expr, env)
            except ExprError:
                v = None
        else:
            v = env.get(n)
        evidence[n] = v
        if v is None and n in missing:
            notes.append(f"{n} unavailable: {missing[n]}")
    if notes:
        evidence["unavailable"] = notes
    return Finding(
        rule=rule.id, severity=rule.severity, title=rule.title, message=format_message(rule, env),
        share=share, est_saving_us_per_step=est, ranks=list(sub.ranks), evidence=evidence,
        remediation=" ".join(rule.remediation.split()) if "\n-" not in rule.remediation
        else rule.remediation.strip(), fix_context=_fix_context(rule, sub, env, est),
    )


def _fix_context(rule: Rule, sub: M.Subject, env: dict[str, Any], est: float | None) -> dict[str, Any]:
    """What ``select: subject`` / ``rank: subject`` and the ``value`` expressions of the rule's fixes
    resolve to for this subject."""
    sel = rule.select
    ctx: dict[str, Any] = {"ranks": list(sub.ranks), "rule_estimate_us_per_step": est}
    spec: dict[str, Any] = {}
    if sel.scope == "kernels":
        body = sel.text.get("kernels") or {}
        for key in ("class", "name", "not_name", "op", "not_op", "kind"):
            if key in body:
                v = body[key]
                spec[key] = "|".join(f"(?:{x})" for x in v) if isinstance(v, list) and key not in ("class", "kind") \
                    else (list(v) if isinstance(v, list) else v)
        if sel.group_by == "name" and isinstance(sub.values.get("name"), str):
            spec["name"] = "^" + re.escape(sub.values["name"]) + "$"
        elif sel.group_by == "cls" and isinstance(sub.values.get("cls"), str):
            spec["class"] = sub.values["cls"]
    elif sel.scope == "gemm":
        spec["class"] = ["moe_gemm"] if sub.values.get("is_moe") else ["fp4_gemm", "fp8_gemm", "bf16_gemm", "moe_gemm"]
        if sub.kernels is not None:
            spec["kernels"] = sub.kernels
    elif sel.scope == "class" and isinstance(sub.values.get("cls"), str):
        spec["class"] = sub.values["cls"]
    ctx["select"] = spec
    if sel.scope == "rank" and sub.ranks:
        ctx["rank"] = sub.ranks[0]
    values: list[list[float | None]] = []
    for fx in rule.fixes:
        row: list[float | None] = []
        for fe in fx.edits:
            if fe.value is None:
                row.append(None)
                continue
            try:
                v, _ = evaluate_explain(fe.value, env)
            except ExprError:
                v = None
            row.append(quantity(v))
        values.append(row)
    ctx["values"] = values
    return ctx


_PLACE = re.compile(r"\{\{|\}\}|\{[^{}]*\}")


def format_message(rule: Rule, env: dict[str, Any]) -> str:
    """The rule's message with its placeholders filled from ``env`` (None -> 'n/a')."""
    it = iter(rule.placeholders)

    def sub(m: re.Match[str]) -> str:
        tok = m.group(0)
        if tok == "{{":
            return "{"
        if tok == "}}":
            return "}"
        ph = next(it)
        try:
            v, _ = evaluate_explain(ph.expr, env)
        except ExprError:
            v = None
        return _fmt_value(v, ph.spec)

    text = " ".join(_PLACE.sub(sub, rule.message).split())
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


def _merge_ranks(rule: Rule, outcomes: list[Outcome]) -> list[Finding]:
    """Rank-scope findings of one rule become one finding: the largest one, naming every rank."""
    fired = [o.finding for o in outcomes if o.finding is not None]
    if rule.select.scope != "rank" or len(fired) <= 1:
        return fired  # type: ignore[return-value]
    fired.sort(key=lambda f: -(f.est_saving_us_per_step or 0.0))  # type: ignore[union-attr]
    top = fired[0]
    assert top is not None
    ranks = sorted({r for f in fired for r in f.ranks})  # type: ignore[union-attr]
    top.ranks = ranks
    top.evidence["ranks_firing"] = ranks
    return [top]


def explain(analysis: Analysis, rule_set: RuleSet) -> list[Outcome]:
    """Every rule's outcome on every subject, with the reasons it did or did not fire."""
    try:
        ctx = M.MetricContext(analysis)
    except Exception as e:  # noqa: BLE001 - a metric bug must not hide the rest of the analysis
        return [Outcome(r.id, "error", reasons=[f"metrics could not be computed: {type(e).__name__}: {e}"])
                for r in rule_set]
    subjects = _Subjects(ctx)
    out: list[Outcome] = []
    for rule in rule_set:
        try:
            out.extend(_evaluate_rule(rule, ctx, subjects, analysis.rule_phase))
        except Exception as e:  # noqa: BLE001
            out.append(Outcome(rule.id, "error", reasons=[f"{type(e).__name__}: {e}"]))
    return out


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Findings in :func:`finding_order`."""
    return sorted(findings, key=lambda f: finding_order(f.severity, f.est_saving_us_per_step, f.share, f.rule))


def evaluate(analysis: Analysis, rule_set: RuleSet) -> list[Finding]:
    """The findings of ``rule_set`` on ``analysis``, in :func:`finding_order`."""
    return findings_of(analysis, rule_set, explain(analysis, rule_set))


def findings_of(analysis: Analysis, rule_set: RuleSet, outcomes: list[Outcome]) -> list[Finding]:
    """The findings among ``outcomes`` (of :func:`explain`), rank findings merged, in
    :func:`finding_order`; rule errors become warnings of the analysis."""
    findings: list[Finding] = []
    for rule in rule_set:
        mine = [o for o in outcomes if o.rule == rule.id]
        findings.extend(_merge_ranks(rule, mine))
        for o in mine:
            if o.status == "error":
                analysis.trace.warnings.append(f"rule {rule.id} could not be evaluated: {'; '.join(o.reasons)}")
    return sort_findings(findings)
