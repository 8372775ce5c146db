"""``gate``: turn a diff into pass (0) / fail (1) / unusable input (2).

The verdict is the run's speed as its users see it: the median decode step time and, where both runs' batch
is known, tokens/s (batch x 1e6 / step us). Where the batches differ, tokens/s alone decides (a larger batch
makes each step longer and the run faster). A verdict metric regresses (fails) when its change
  1. exceeds one of its thresholds (``step:5%``, ``step:200us``, ``throughput:5%``), and
  2. exceeds the absolute floor (default 10 us per step), and
  3. is beyond step-to-step noise: a one-sided Mann-Whitney U test over the per-step samples is
     significant at ``alpha`` (default 0.05). When the samples cannot decide (too few), 1 and 2
     alone decide and the check says so.
Class and collective changes (``class.*``, ``late-rank.*``) explain the verdict: judged the same way, they
fail only with it, or on their own where the user wrote a threshold for that class (``class.kv_cast:10%``).
A finding fails when it is new in the candidate (or escalated) at or above ``fail_on``, unless the verdict
improved by :data:`FIX_IMPROVEMENT_PCT` or more and none of the finding's classes grew.
Device, TP size, rank count or phase differing makes the comparison unusable (exit 2, and nothing else is
judged), or only a warning with ``allow_mismatch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from traceinspect.gate.diff import Diff, MetricDelta, diff_documents, severity_rank
from traceinspect.gate.stats import DEFAULT_ALPHA, noise_test
from traceinspect.gate.thresholds import (
    DEFAULT_FLOOR,
    DEFAULT_THRESHOLDS,
    Floor,
    Threshold,
    merge_thresholds,
    parse_floor,
    parse_threshold,
    thresholds_for,
)
from traceinspect.render import fmt_us
from traceinspect.units import fmt_pct_signed, fmt_us_signed

FAIL_ON = ("critical", "warning", "info", "never")
DEFAULT_FAIL_ON = "warning"
# a candidate whose verdict metric improved by this much is a fix: a new finding fails it only if its class grew
FIX_IMPROVEMENT_PCT = 5.0
VERDICT_METRICS = ("step", "throughput")
EXPLAINED_BY = 3  # classes named in the verdict line


def _signed_us(v: float) -> str:
    return fmt_us_signed(v)


def fmt_rate(v: float | None) -> str:
    """Tokens/s for the outputs."""
    if v is None:
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _pct_text(pct: float | None) -> str:
    return "n/a" if pct is None else f"{pct:+.1f}%"


@dataclass
class Check:
    """One gate check: a compatibility fact, a verdict metric, a class change or a finding."""

    id: str  # 'compat.device', 'step', 'throughput', 'class.kv_cast', 'late-rank.TP1', 'finding.kv-full-pool-cast'
    kind: str  # 'compat' | 'regression' (step, throughput) | 'class' (explains the verdict) | 'finding' | 'input'
    status: str  # 'pass' | 'warn' | 'fail' | 'error'
    message: str  # one line
    data: dict[str, Any] = field(default_factory=dict)
    summary: str | None = None  # a few words for the verdict line (default: the message)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "status": self.status, "message": self.message,
                "summary": self.summary or self.message, **self.data}


@dataclass
class GateResult:
    """The gate's verdict: every check, the diff it was computed from, and the settings used."""

    checks: list[Check]
    diff: Diff | None
    settings: dict[str, Any]
    headline: str = ""  # the verdict metrics' change, for the PASS line
    explanation: str | None = None  # the classes that grew most, for the FAIL line

    @property
    def exit_code(self) -> int:
        statuses = {c.status for c in self.checks}
        return 2 if "error" in statuses else 1 if "fail" in statuses else 0

    @property
    def status(self) -> str:
        return {0: "pass", 1: "fail", 2: "error"}[self.exit_code]

    @property
    def comparable(self) -> bool:
        """False when the runs differ in GPU, TP size, rank count or phase (and that was not allowed)."""
        return not any(c.kind == "compat" and c.status == "error" for c in self.checks)

    def failing(self) -> list[Check]:
        """The checks that decide the exit code (errors, else failures)."""
        want = "error" if self.exit_code == 2 else "fail"
        return [c for c in self.checks if c.status == want]

    def warnings(self) -> list[Check]:
        return [c for c in self.checks if c.status == "warn"]

    def reasons(self) -> list[str]:
        """One line per failing check (empty on pass)."""
        return [f"{c.id}: {c.message}" for c in self.failing()]

    def verdict(self) -> str:
        """The one-line outcome, always printed, the same in every output. It starts with the word that the
        exit code stands for: PASS (0), FAIL (1), ERROR (2)."""
        if self.exit_code == 0:
            warns = self.warnings()
            tail = f"; {len(warns)} warning(s): {', '.join(c.id for c in warns[:5])}" if warns else ""
            if len(warns) > 5:
                tail += f" and {len(warns) - 5} more"
            return f"PASS: {self.headline or f'{len(self.checks)} check(s) passed'}{tail}"
        if self.exit_code == 2:
            if not self.comparable:
                return ("ERROR (not comparable): " + "; ".join(c.summary or c.message for c in self.failing())
                        + "; use --allow-mismatch to compare anyway")
            return "ERROR (unusable input): " + "; ".join(c.summary or c.message for c in self.failing())
        failing = self.failing()
        metrics = [c for c in failing if c.id in VERDICT_METRICS]
        parts = [", ".join(c.summary or c.message for c in metrics)] if metrics else []
        if metrics and self.explanation:
            parts[0] += f"; {self.explanation}"
        # a class that fails with the verdict is in the explanation; one with its own threshold is named
        parts += [c.summary or f"{c.id}: {c.message}" for c in failing if c not in metrics
                  and not (metrics and c.kind == "class" and not c.data.get("own_threshold"))]
        return "FAIL: " + "; ".join(dict.fromkeys(parts))  # (a rule that fires twice is named once)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "traceinspect.gate/1",
            "status": self.status,
            "exit_code": self.exit_code,
            "verdict": self.verdict(),
            "headline": self.headline,
            "explanation": self.explanation,
            "reasons": self.reasons(),
            "settings": self.settings,
            "checks": [c.to_json() for c in self.checks],
            "diff": self.diff.to_json() if self.diff is not None else None,
        }

    @classmethod
    def from_error(cls, reason: str, settings: dict[str, Any] | None = None) -> GateResult:
        """A result for input that could not be used at all (exit 2)."""
        return cls([Check("input", "input", "error", reason)], None, settings or {})


class Gate:
    """A configured gate. ``Gate(...).run(base_doc, cand_doc)`` -> :class:`GateResult`."""

    def __init__(self, thresholds: Sequence[str | Threshold] | None = None, *, floor: str | Floor = DEFAULT_FLOOR,
                 alpha: float = DEFAULT_ALPHA, fail_on: str = DEFAULT_FAIL_ON, allow_mismatch: bool = False,
                 disabled_rules: Iterable[str] = (), replace_defaults: bool = False) -> None:
        """``thresholds`` are the user's (config file, command line): layered over the defaults metric by
        metric (pass ``replace_defaults`` to use only them). A ``class.NAME`` threshold among them gates that
        class on its own; the defaults' and ``class.*`` thresholds only explain the verdict."""
        given = [t if isinstance(t, Threshold) else parse_threshold(t) for t in (thresholds or ())]
        base = [] if replace_defaults else [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
        self.thresholds = merge_thresholds(base, given)
        self.explicit = {t.metric for t in given if t.kind != "off" and t.metric != "class.*"}
        self.floor = floor if isinstance(floor, Floor) else parse_floor(floor)
        if not 0.0 < float(alpha) < 1.0:
            from traceinspect.errors import ConfigError

            raise ConfigError(f"alpha {alpha!r}: must be between 0 and 1")
        self.alpha = float(alpha)
        if fail_on not in FAIL_ON:
            from traceinspect.errors import ConfigError

            raise ConfigError(f"fail-on {fail_on!r}: expected one of {', '.join(FAIL_ON)}")
        self.fail_on = fail_on
        self.allow_mismatch = allow_mismatch
        self.disabled_rules = set(disabled_rules)
        self._floor_desc = self.floor.describe(None)

    def settings(self) -> dict[str, Any]:
        return {
            "thresholds": [t.expr for t in self.thresholds],
            "gating_classes": sorted(m for m in self.explicit if m.startswith("class.")),
            "floor": self.floor.expr,
            "alpha": self.alpha,
            "noise_test": "one-sided Mann-Whitney U over per-step samples (exact permutation distribution "
                          "for small samples, else normal approximation with tie correction)",
            "fail_on": self.fail_on,
            "fix_improvement_pct": FIX_IMPROVEMENT_PCT,
            "allow_mismatch": self.allow_mismatch,
            "disabled_rules": sorted(self.disabled_rules),
        }

    def run(self, base: dict[str, Any], cand: dict[str, Any]) -> GateResult:
        """Compare a candidate analysis document with its baseline."""
        diff = diff_documents(base, cand, self.disabled_rules)
        checks = self._compat(diff)
        if any(c.status == "error" for c in checks):  # not comparable: no metric means anything
            return GateResult(checks, diff, self.settings())
        floor_us = self.floor.us(diff.base_step_us)
        self._floor_desc = self.floor.describe(diff.base_step_us)
        verdict = self._verdict_checks(diff, floor_us)
        regressed = [c for c in verdict if c.status == "fail"]
        classes = self._class_checks(diff, floor_us, bool(regressed))
        improved = self._improvement(diff)
        findings = self._findings(diff, improved, classes, floor_us)
        settings = dict(self.settings(), floor_us=round(floor_us, 3))
        # a verdict metric beyond its threshold that the noise test let pass: the PASS line says so
        noisy = [f"{'tokens/s' if c.id == 'throughput' else c.id} p={c.data['noise']['p_value']:.3g}" for c in verdict
                 if c.status == "pass" and (c.data.get("noise") or {}).get("significant") is False]
        head = headline(diff) + (f"; within step-to-step noise ({', '.join(noisy)})" if noisy else "")
        return GateResult(checks + verdict + classes + findings, diff, settings,
                          headline=head, explanation=explanation(diff, classes) if regressed else None)

    # -- checks ---------------------------------------------------------------------------------
    def _compat(self, diff: Diff) -> list[Check]:
        out = []
        for row in diff.context:
            if not row["compat"]:
                continue
            data = {"base": row["base"], "cand": row["cand"]}
            if row["same"] is None:
                side = "baseline" if row["base"] is None else "candidate"
                out.append(Check(f"compat.{row['field']}", "compat", "warn",
                                 f"{row['label']} unknown in the {side}: cannot check that both runs match", data))
            elif row["same"]:
                out.append(Check(f"compat.{row['field']}", "compat", "pass", f"{row['label']}: {row['cand']}", data))
            else:
                msg = f"{row['label']} differs: baseline {row['base']}, candidate {row['cand']}"
                if self.allow_mismatch:
                    out.append(Check(f"compat.{row['field']}", "compat", "warn", msg + " (allowed by --allow-mismatch)",
                                     data))
                else:
                    out.append(Check(f"compat.{row['field']}", "compat", "error",
                                     msg + "; the runs are not comparable (use --allow-mismatch to compare anyway)",
                                     data, summary=msg))
        return out

    def _verdict_checks(self, diff: Diff, floor_us: float) -> list[Check]:
        """``step`` and, where both batches are known, ``throughput``. Where the batches differ, the step time
        does not decide (each step does different work) unless the user set a step threshold."""
        step = self._metric(diff.step, floor_us, "regression")
        if diff.batch_changed and diff.throughput is not None and "step" not in self.explicit:
            b, c = diff.batch["base"], diff.batch["cand"]
            why = (f"the batch changed {b:g} -> {c:g}, so each step does different work and tokens/s is the verdict "
                   "(a step threshold you set gates the step time too)")
            if step.status == "fail":
                step = Check("step", "regression", "pass", f"{step.data['change']}; not failing: {why}",
                             dict(step.data, regressed=False))
            else:
                step.message += f"; {why}"
        out = [step]
        if diff.throughput is not None:
            out.append(self._throughput(diff, floor_us))
        return out

    def _throughput(self, diff: Diff, floor_us: float) -> Check:
        t = diff.throughput
        assert t is not None and t.base is not None and t.cand is not None
        bb, bc = diff.batch["base"], diff.batch["cand"]
        assert bb is not None and bc is not None
        pct = t.pct
        at = f"batch {bb:g}" + (f" -> {bc:g}" if bb != bc else "")
        change = f"{fmt_rate(t.base)} -> {fmt_rate(t.cand)} tokens/s ({_pct_text(pct)}) at {at}"
        thresholds = thresholds_for("throughput", self.thresholds)
        data: dict[str, Any] = {"metric": "throughput", "base": round(t.base, 3), "cand": round(t.cand, 3),
                                "pct": None if pct is None else round(pct, 3), "base_batch": bb, "cand_batch": bc,
                                "thresholds": [th.expr for th in thresholds], "change": change, "regressed": False}
        if not thresholds:
            return Check("throughput", "regression", "pass", change + "; no threshold", data)
        drop = -(pct or 0.0)
        exceeded = [th for th in thresholds if drop > th.value]
        data["exceeded"] = [th.expr for th in exceeded]
        if not exceeded:
            verdict = "improved" if drop < 0 else "within " + ", ".join(f"a {th.value:g}% drop" for th in thresholds)
            return Check("throughput", "regression", "pass", f"{change}; {verdict}", data)
        limits = ", ".join(f"a {th.value:g}% drop" for th in exceeded)
        # the floor, as step time: what the candidate's step takes beyond the baseline's time per token
        sb, sc = diff.step.base, diff.step.cand
        extra = (sc or 0.0) - (sb or 0.0) * bc / bb
        data["extra_step_us"] = round(extra, 3)
        if extra <= floor_us:
            return Check("throughput", "regression", "pass",
                         f"{change}; exceeds {limits} but costs {fmt_us(max(extra, 0.0))} per step, within the floor "
                         f"of {self._floor_desc}", data)
        # higher is better: is a baseline step's rate above a candidate step's?
        noise = noise_test(t.cand_samples, t.base_samples, self.alpha)
        data["noise"] = noise.to_json()
        if noise.decided and not noise.significant:
            return Check("throughput", "regression", "pass", f"{change}; exceeds {limits} but {noise.reason}", data)
        data["regressed"] = True
        return Check("throughput", "regression", "fail",
                     f"regressed: {change}; exceeds {limits} and the {fmt_us(floor_us)} floor; {noise.reason}", data,
                     summary=f"tokens/s fell {fmt_rate(t.base)} -> {fmt_rate(t.cand)} ({_pct_text(pct)}) at {at}")

    def _metric(self, m: MetricDelta, floor_us: float, kind: str) -> Check:
        thresholds = thresholds_for(m.metric, self.thresholds)
        what = "median step" if m.metric == "step" else "per token" if m.unit == "us/token" else "per step"
        if m.base is None or m.cand is None:
            side = "baseline" if m.base is None else "candidate"
            return Check(m.metric, kind, "warn", f"no value in the {side}: not compared",
                         {"metric": m.metric, "base": m.base, "cand": m.cand, "regressed": False})
        delta = m.cand - m.base
        pct = m.pct
        rel = fmt_pct_signed(pct / 100) if pct is not None else ("new" if m.base == 0 and m.cand > 0 else "n/a")
        change = f"{fmt_us(m.base)} -> {fmt_us(m.cand)} {what} ({_signed_us(delta)}, {rel})"
        data: dict[str, Any] = {"metric": m.metric, "base": round(m.base, 3), "cand": round(m.cand, 3),
                                "delta": round(delta, 3), "pct": None if pct is None else round(pct, 3),
                                "thresholds": [t.expr for t in thresholds], "floor_us": round(floor_us, 3),
                                "change": change, "regressed": False}
        if not thresholds:
            return Check(m.metric, kind, "pass", change + "; no threshold", data)
        exceeded = [t for t in thresholds if delta > t.allowed_us(m.base)]
        data["exceeded"] = [t.expr for t in exceeded]
        if not exceeded:
            limits = ", ".join(t.describe() for t in thresholds)
            verdict = "improved" if delta < 0 else f"within {limits}"
            return Check(m.metric, kind, "pass", f"{change}; {verdict}", data)
        limits = ", ".join(t.describe() for t in exceeded)
        if delta <= floor_us:
            return Check(m.metric, kind, "pass",
                         f"{change}; exceeds {limits} but not the floor of {self._floor_desc}", data)
        noise = noise_test(m.base_samples, m.cand_samples, self.alpha)
        data["noise"] = noise.to_json()
        if m.pooled:
            data["noise"]["pooled"] = m.pooled
        if noise.decided and not noise.significant:
            return Check(m.metric, kind, "pass", f"{change}; exceeds {limits} but {noise.reason}", data)
        data["regressed"] = True
        return Check(m.metric, kind, "fail",
                     f"regressed: {change}; exceeds {limits} and the {fmt_us(floor_us)} floor; {noise.reason}", data,
                     summary=f"{m.metric} regressed {fmt_us(m.base)} -> {fmt_us(m.cand)} {what} ({rel})")

    def _class_checks(self, diff: Diff, floor_us: float, verdict_regressed: bool) -> list[Check]:
        """Each class judged like a verdict metric. A class that regressed fails with a regressed verdict, or
        on its own with a threshold the user wrote for it; otherwise it is a warning that explains nothing
        failing."""
        if diff.classes_note:
            return [Check("class.*", "class", "warn", diff.classes_note)]
        out = []
        per_token = diff.batch_changed
        if per_token:  # the floor, per token of the candidate's batch
            floor_us = floor_us / float(diff.batch["cand"] or 1.0)
        for m in sorted(class_metrics(diff), key=lambda m: -(m.delta or 0.0)):
            if not thresholds_for(m.metric, self.thresholds):
                continue
            c = self._metric(m, floor_us, "class")
            if per_token:
                c.data["per_token"] = True
            if m.metric == "class.comm":
                c = attribute_comm(c, diff)
            if c.status == "fail" and m.metric in self.explicit:
                own = ", ".join(t.expr for t in thresholds_for(m.metric, self.thresholds))
                c.message += f"; fails on its own: you set {own}"
                c.data["own_threshold"] = True
                c.summary = f"{c.summary} (you set {own})"
            elif c.status == "fail" and not verdict_regressed:
                what = "tokens/s" if diff.batch_changed and diff.throughput is not None else "the step time"
                c.status = "warn"
                c.message += (f"; not failing: {what} did not regress, and a class change only explains the verdict "
                              f"(set {m.metric}:LIMIT to gate this class on its own)")
            out.append(c)
        return out

    def _improvement(self, diff: Diff) -> str | None:
        """'the step time improved by 48.4%' when the verdict metric's median improved by FIX_IMPROVEMENT_PCT or
        more (the words say whether the samples show it beyond step-to-step noise); else None."""
        if diff.batch_changed and diff.throughput is not None:
            m, sign, name = diff.throughput, 1.0, "tokens/s"
            noise = noise_test(m.base_samples, m.cand_samples, self.alpha)  # the candidate's rate above
        else:
            m, sign, name = diff.step, -1.0, "the step time"
            noise = noise_test(m.cand_samples, m.base_samples, self.alpha)  # the baseline's step above
        gain = None if m.pct is None else sign * m.pct
        if gain is None or gain < FIX_IMPROVEMENT_PCT:
            return None
        within = " (median; within step-to-step noise)" if noise.decided and not noise.significant else ""
        return f"{name} improved by {gain:.1f}%{within}"

    def _findings(self, diff: Diff, improved: str | None, classes: list[Check], floor_us: float) -> list[Check]:
        if diff.findings_note:
            return [Check("findings", "finding", "warn", diff.findings_note)]
        limit = None if self.fail_on == "never" else severity_rank(self.fail_on)
        out = []

        def at_or_above(sev: Any) -> tuple[bool, str]:
            r = severity_rank(sev)
            if r is None:  # unknown severity: fail safe rather than let it through
                return limit is not None, f" (unknown severity {sev!r} treated as critical)"
            return limit is not None and r >= limit, ""

        def excused(f: dict[str, Any]) -> str | None:
            """Why a new or escalated finding does not fail a fix: the verdict improved and its classes did not grow."""
            if improved is None:
                return None
            own = [c for c in f.get("classes") or []]
            grown = [c for c in own if _class_grew(c, classes, diff, floor_us)]
            if grown:
                return None
            what = (f"its class{'es' if len(own) > 1 else ''} {', '.join(own)} did not grow" if own
                    else "it names no kernel class that could have grown")
            return (f"not failing: {improved} and {what}: the faster step makes it a larger share, not a worse "
                    "problem; worth a look")

        for f in diff.findings["added"]:
            hit, note = at_or_above(f.get("severity"))
            msg = f"new {f.get('severity')} finding {f.get('rule')}: {f.get('title') or f.get('message') or ''}{note}"
            status = "fail" if hit else "warn"
            if not hit and limit is not None:
                msg += f" (below --fail-on {self.fail_on})"
            elif hit and (why := excused(f)):
                status, msg = "warn", f"{msg} ({why})"
            out.append(Check(f"finding.{f.get('rule')}", "finding", status, msg, {"finding": f, "change": "added"},
                             summary=f"new {f.get('severity')} finding {f.get('rule')}"))
        for row in diff.findings["changed"] + diff.findings["unchanged"]:
            b, c = row["base"], row["cand"]
            hit, note = at_or_above(c.get("severity"))
            was, _ = at_or_above(b.get("severity"))
            rb, rc = severity_rank(b.get("severity")), severity_rank(c.get("severity"))
            escalated = hit and (not was or (rb is not None and rc is not None and rc > rb))
            if escalated:
                msg = (f"finding {row['rule']} escalated {b.get('severity')} -> {c.get('severity')}: "
                       f"{c.get('title') or ''}{note}")
                why = excused(c)
                out.append(Check(f"finding.{row['rule']}", "finding", "warn" if why else "fail",
                                 f"{msg} ({why})" if why else msg, {"finding": c, "change": "escalated"},
                                 summary=f"finding {row['rule']} escalated to {c.get('severity')}"))
            else:
                tail = f" ({'; '.join(row['changes'])})" if row["changes"] else ""
                out.append(Check(f"finding.{row['rule']}", "finding", "pass",
                                 f"{c.get('severity')} finding {row['rule']} already in the baseline{tail}",
                                 {"finding": c, "change": "changed" if row["changes"] else "unchanged"}))
        for f in diff.findings["removed"]:
            out.append(Check(f"finding.{f.get('rule')}", "finding", "pass",
                             f"{f.get('severity')} finding {f.get('rule')} resolved (only in the baseline)",
                             {"finding": f, "change": "removed"}))
        if not out:
            out.append(Check("findings", "finding", "pass", "no findings in either run"))
        return out


def _class_grew(cls: str, classes: list[Check], diff: Diff, floor_us: float) -> bool:
    """Did class ``cls`` grow: its check regressed (threshold, floor, noise); without a check (its thresholds
    are off), its time per step grew by more than the floor."""
    for c in classes:
        if c.data.get("metric") == f"class.{cls}":
            return bool(c.data.get("regressed"))
    m = next((m for m in diff.classes if m.metric == f"class.{cls}"), None)
    return m is not None and m.delta is not None and m.delta > floor_us


def class_metrics(diff: Diff) -> list[MetricDelta]:
    """GPU time by class: per step, or per token (us per step / batch) where the batches differ, since a
    larger batch does more of every class's work in each step."""
    if not diff.batch_changed:
        return diff.classes
    bb, bc = float(diff.batch["base"] or 1.0), float(diff.batch["cand"] or 1.0)
    scale = lambda xs, b: None if xs is None else [x / b for x in xs]  # noqa: E731
    return [MetricDelta(m.metric, None if m.base is None else m.base / bb, None if m.cand is None else m.cand / bc,
                        scale(m.base_samples, bb), scale(m.cand_samples, bc), m.note, m.pooled, unit="us/token")
            for m in diff.classes]


def headline(diff: Diff) -> str:
    """The verdict metrics' change in a few words: the step, and tokens/s where both batches are known."""
    s, t = diff.step, diff.throughput
    step = (f"step {fmt_us(s.base)} -> {fmt_us(s.cand)} ({_pct_text(s.pct)})" if s.base is not None
            and s.cand is not None else "step not compared")
    if t is None:
        return step
    rate = f"tokens/s {fmt_rate(t.base)} -> {fmt_rate(t.cand)} ({_pct_text(t.pct)})"
    if diff.batch_changed:
        return (f"{rate} at batch {diff.batch['base']:g} -> {diff.batch['cand']:g}, the verdict; {step}, each step "
                "doing the work of its batch")
    return f"{step}, {rate} at batch {diff.batch['base']:g}"


def explanation(diff: Diff, classes: list[Check]) -> str:
    """The classes that grew most (GPU time per step), and how much of the step's growth is kernel time."""
    metrics = class_metrics(diff)
    what = "per token" if diff.batch_changed else "per step"
    grown = sorted((m for m in metrics if m.delta is not None and m.delta > 0), key=lambda m: -(m.delta or 0.0))
    late = {c.data.get("metric"): c.data.get("late_rank_label") for c in classes if c.data.get("late_rank_label")}
    names = []
    for m in grown[:EXPLAINED_BY]:
        who = f" ({late[m.metric]} arrives late)" if late.get(m.metric) else ""
        names.append(f"{m.metric} {_signed_us(m.delta or 0.0)} {what}{who}")
    text = f"grew most {what}: " + ", ".join(names) if names else f"no kernel class grew {what}"
    kernel = sum(m.delta or 0.0 for m in diff.classes if m.delta is not None)
    step = diff.step.delta
    if not diff.batch_changed and step is not None and step > 0 and kernel < step / 2:
        text += (f"; kernel time per step changed by {_signed_us(kernel)} of the step's {_signed_us(step)}: the rest "
                 "is time outside kernels (launches, host, synchronisation)")
    return text


def attribute_comm(check: Check, diff: Diff) -> Check:
    """A collective-time regression split into waiting and transfer. When the growth is waiting for a
    rank that arrives late, the failing check points at that rank (``late-rank.TP1``), not at the
    collectives: their transfer did not get slower."""
    split = diff.comm or {}
    b, c = split.get("base"), split.get("cand")
    if check.status != "fail" or not b or not c:
        return check
    dw, dt = c["wait_us"] - b["wait_us"], c["transfer_us"] - b["transfer_us"]
    data = dict(check.data, wait_delta_us=round(dw, 3), transfer_delta_us=round(dt, 3))
    if dw <= dt:
        return Check(check.id, check.kind, check.status,
                     f"{check.message}; the growth is transfer ({_signed_us(dt)} per step; waiting "
                     f"{_signed_us(dw)})", data, summary=check.summary)
    grown = {r: v - b["caused_us"].get(r, 0.0) for r, v in c["caused_us"].items()}
    late = max(grown, key=lambda r: grown[r]) if grown and max(grown.values()) > 0 else c.get("straggler")
    if late is None:
        return Check(check.id, check.kind, check.status,
                     f"{check.message}; the growth is waiting for other ranks ({_signed_us(dw)} per step), not "
                     f"transfer ({_signed_us(dt)}); no single rank arrives last", data, summary=check.summary)
    name = c["labels"].get(late) or f"rank {late}"
    data.update(late_rank=late, late_rank_label=name, caused_delta_us=round(grown.get(late, 0.0), 3))
    return Check(f"late-rank.{name}", check.kind, check.status,
                 f"{name} arrives late at the collectives: the other ranks wait {fmt_us(dw)} more per step "
                 f"({name} now causes {fmt_us(c['caused_us'].get(late, 0.0))} of waiting per step); the "
                 f"transfer itself changed by {_signed_us(dt)}. Look at what delays {name} (its compute, host "
                 f"launches, clocks), not at the collectives. [{check.message}]", data,
                 summary=f"{name} arrives late: collective wait {_signed_us(dw)} per step (class.comm)")


def gate_documents(base: dict[str, Any], cand: dict[str, Any], **kw: Any) -> GateResult:
    """Shorthand: ``Gate(**kw).run(base, cand)``."""
    return Gate(**kw).run(base, cand)
