"""``gate``: turn a diff into pass (0) / fail (1) / unusable input (2), one check at a time.

A metric regresses (fails) when its increase over the baseline
  1. exceeds one of its thresholds (``step:5%``, ``class.kv_cast:10%``, ``step:200us``), and
  2. exceeds the absolute floor (default 10 us per step), and
  3. is beyond step-to-step noise: a one-sided Mann-Whitney U test over the per-step samples is
     significant at ``alpha`` (default 0.05). When the samples cannot decide (too few), 1 and 2
     alone decide and the check says so.
A finding fails when it is new in the candidate (or escalated) at or above ``fail_on``.
Device, TP size, rank count or phase differing makes the comparison unusable (exit 2), or only a
warning with ``allow_mismatch``.
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
STATUSES = ("pass", "warn", "fail", "error")


def _signed_us(v: float) -> str:
    return fmt_us_signed(v)


@dataclass
class Check:
    """One gate check: a compatibility fact, a metric threshold or a finding."""

    id: str  # 'compat.device', 'step', 'class.kv_cast', 'finding.kv-full-pool-cast', 'input'
    kind: str  # 'compat' | 'regression' | 'finding' | 'input'
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

    @property
    def exit_code(self) -> int:
        statuses = {c.status for c in self.checks}
        return 2 if "error" in statuses else 1 if "fail" in statuses else 0

    @property
    def status(self) -> str:
        return {0: "pass", 1: "fail", 2: "error"}[self.exit_code]

    def failing(self) -> list[Check]:
        """The checks that decide the exit code (errors, else failures)."""
        want = "error" if self.exit_code == 2 else "fail"
        return [c for c in self.checks if c.status == want]

    def reasons(self) -> list[str]:
        """One line per failing check (empty on pass)."""
        return [f"{c.id}: {c.message}" for c in self.failing()]

    def verdict(self) -> str:
        """The one-line outcome, always printed."""
        if self.exit_code == 0:
            warns = [c for c in self.checks if c.status == "warn"]
            tail = f" ({len(warns)} warning(s))" if warns else ""
            return f"PASS: {len(self.checks)} check(s) passed{tail}"
        word = "FAIL" if self.exit_code == 1 else "ERROR (unusable input)"
        return f"{word}: " + "; ".join(c.summary or f"{c.id}: {c.message}" for c in self.failing())

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": "traceinspect.gate/1",
            "status": self.status,
            "exit_code": self.exit_code,
            "verdict": self.verdict(),
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
        """``thresholds`` are layered over the defaults metric by metric (pass ``replace_defaults``
        to use only them); a layered list from :func:`merge_thresholds` can be given as Threshold objects."""
        given = [t if isinstance(t, Threshold) else parse_threshold(t) for t in (thresholds or ())]
        base = [] if replace_defaults else [parse_threshold(t) for t in DEFAULT_THRESHOLDS]
        self.thresholds = merge_thresholds(base, given)
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
            "floor": self.floor.expr,
            "alpha": self.alpha,
            "noise_test": "one-sided Mann-Whitney U over per-step samples (exact permutation distribution "
                          "for small samples, else normal approximation with tie correction)",
            "fail_on": self.fail_on,
            "allow_mismatch": self.allow_mismatch,
            "disabled_rules": sorted(self.disabled_rules),
        }

    def run(self, base: dict[str, Any], cand: dict[str, Any]) -> GateResult:
        """Compare a candidate analysis document with its baseline."""
        diff = diff_documents(base, cand, self.disabled_rules)
        checks = self._compat(diff)
        floor_us = self.floor.us(diff.base_step_us)
        self._floor_desc = self.floor.describe(diff.base_step_us)
        checks.append(self._metric(diff.step, floor_us))
        if diff.classes_note:
            checks.append(Check("class.*", "regression", "warn", diff.classes_note))
        else:
            for m in diff.classes:
                if thresholds_for(m.metric, self.thresholds):
                    check = self._metric(m, floor_us)
                    checks.append(attribute_comm(check, diff) if m.metric == "class.comm" else check)
        checks.extend(self._findings(diff))
        return GateResult(checks, diff, self.settings())

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
                                     data))
        return out

    def _metric(self, m: MetricDelta, floor_us: float) -> Check:
        thresholds = thresholds_for(m.metric, self.thresholds)
        what = "median step" if m.metric == "step" else "per step"
        if m.base is None or m.cand is None:
            side = "baseline" if m.base is None else "candidate"
            return Check(m.metric, "regression", "warn", f"no value in the {side}: not compared",
                         {"base": m.base, "cand": m.cand})
        delta = m.cand - m.base
        pct = m.pct
        rel = fmt_pct_signed(pct / 100) if pct is not None else ("new" if m.base == 0 and m.cand > 0 else "n/a")
        change = f"{fmt_us(m.base)} -> {fmt_us(m.cand)} {what} ({_signed_us(delta)}, {rel})"
        data: dict[str, Any] = {"base": round(m.base, 3), "cand": round(m.cand, 3), "delta": round(delta, 3),
                                "pct": None if pct is None else round(pct, 3),
                                "thresholds": [t.expr for t in thresholds], "floor_us": round(floor_us, 3)}
        if not thresholds:
            return Check(m.metric, "regression", "pass", change + "; no threshold", data)
        exceeded = [t for t in thresholds if delta > t.allowed_us(m.base)]
        data["exceeded"] = [t.expr for t in exceeded]
        if not exceeded:
            limits = ", ".join(t.describe() for t in thresholds)
            verdict = "improved" if delta < 0 else f"within {limits}"
            return Check(m.metric, "regression", "pass", f"{change}; {verdict}", data)
        limits = ", ".join(t.describe() for t in exceeded)
        if delta <= floor_us:
            return Check(m.metric, "regression", "pass",
                         f"{change}; exceeds {limits} but not the floor of {self._floor_desc}",
                         data)
        noise = noise_test(m.base_samples, m.cand_samples, self.alpha)
        data["noise"] = noise.to_json()
        if m.pooled:
            data["noise"]["pooled"] = m.pooled
        if noise.decided and not noise.significant:
            return Check(m.metric, "regression", "pass", f"{change}; exceeds {limits} but {noise.reason}", data)
        return Check(m.metric, "regression", "fail",
                     f"regressed: {change}; exceeds {limits} and the {fmt_us(floor_us)} floor; {noise.reason}", data,
                     summary=f"{m.metric} regressed {fmt_us(m.base)} -> {fmt_us(m.cand)} {what} ({rel})")

    def _findings(self, diff: Diff) -> list[Check]:
        if diff.findings_note:
            return [Check("findings", "finding", "warn", diff.findings_note)]
        limit = None if self.fail_on == "never" else severity_rank(self.fail_on)
        out = []

        def at_or_above(sev: Any) -> tuple[bool, str]:
            r = severity_rank(sev)
            if r is None:  # unknown severity: fail safe rather than let it through
                return limit is not None, f" (unknown severity {sev!r} treated as critical)"
            return limit is not None and r >= limit, ""

        for f in diff.findings["added"]:
            hit, note = at_or_above(f.get("severity"))
            msg = f"new {f.get('severity')} finding {f.get('rule')}: {f.get('title') or f.get('message') or ''}{note}"
            status = "fail" if hit else "warn"
            if not hit and limit is not None:
                msg += f" (below --fail-on {self.fail_on})"
            out.append(Check(f"finding.{f.get('rule')}", "finding", status, msg, {"finding": f, "change": "added"},
                             summary=f"new {f.get('severity')} finding {f.get('rule')}"))
        for row in diff.findings["changed"] + diff.findings["unchanged"]:
            b, c = row["base"], row["cand"]
            hit, note = at_or_above(c.get("severity"))
            was, _ = at_or_above(b.get("severity"))
            rb, rc = severity_rank(b.get("severity")), severity_rank(c.get("severity"))
            escalated = hit and (not was or (rb is not None and rc is not None and rc > rb))
            if escalated:
                out.append(Check(f"finding.{row['rule']}", "finding", "fail",
                                 f"finding {row['rule']} escalated {b.get('severity')} -> {c.get('severity')}: "
                                 f"{c.get('title') or ''}{note}", {"finding": c, "change": "escalated"},
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
