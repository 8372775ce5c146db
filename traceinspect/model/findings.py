"""Findings and gaps as the judge makes them and every later stage reads them (:class:`Finding`,
:class:`Gaps`), and the one order of findings, shared by the judge (which sorts its findings) and every
renderer (which sorts a document's): severity, estimated saving, share, rule id; a finding that shares
another's cause follows it. Imports no pandas: the rule listings read it."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import numpy as np

from traceinspect.units import finite

SEVERITIES = ("critical", "warning", "info")
SEVERITY_RANK = {"critical": 0, "warning": 1, "info": 2}


def quantity(v: Any) -> float | None:
    """A finite float, or None (booleans are not quantities here)."""
    return None if isinstance(v, (bool, np.bool_)) else finite(v)


def finding_order(severity: Any, saving: Any, share: Any = None, rule: Any = "") -> tuple[Any, ...]:
    """The sort key of a finding: by severity (critical first), then by estimated saving per step (largest
    first; unknown last), then share, then rule id."""
    sv, sh = quantity(saving), quantity(share)
    return (SEVERITY_RANK.get(str(severity), 9), sv is None, -(sv or 0.0), -(sh or 0.0), str(rule or ""))


def group_children(ranked: Iterable[Any], rule_of: Callable[[Any], Any], parent_of: Callable[[Any], Any]) -> list[Any]:
    """``ranked`` with every finding that shares a parent's cause moved right after that parent."""
    ranked = list(ranked)
    present = {rule_of(f) for f in ranked}
    kids: dict[Any, list[Any]] = {}
    for f in ranked:
        p = parent_of(f)
        if p and p in present:
            kids.setdefault(p, []).append(f)
    out: list[Any] = []
    for f in ranked:
        p = parent_of(f)
        if p and p in present:
            continue
        out.append(f)
        out.extend(kids.get(rule_of(f), []))
    return out


MAX_EVIDENCE_TEXT = 600  # characters of a text value in a finding's evidence


class Finding(msgspec.Struct):
    """One problem found by one rule (on one subject, or on several merged ranks)."""

    rule: str
    severity: str
    title: str
    message: str
    share: float | None
    est_saving_us_per_step: float | None
    ranks: list[int]
    evidence: dict[str, Any]
    remediation: str
    # what the rule's fixes act on: the subject's selection, ranks and the fix edits' values
    fix_context: dict[str, Any] = msgspec.field(default_factory=dict)
    # replays of the rule's fixes (traceinspect.whatif.fixes): variant, label, predicted step, saving, edits
    fixes: list[dict[str, Any]] = msgspec.field(default_factory=list)
    estimate_source: str = "rule"  # 'replay' when the saving comes from replaying a fix
    parent: str | None = None  # the finding (rule id) sharing this one's cause with the larger saving
    children: list[str] = msgspec.field(default_factory=list)
    prediction: Any = None  # the replay behind the estimate (not serialised)

    @property
    def id(self) -> str:
        return self.rule

    def to_json(self) -> dict[str, Any]:
        """The documented JSON form (``findings`` list of ``traceinspect.analysis/1``)."""
        return {
            "rule": self.rule, "severity": self.severity, "title": self.title, "message": self.message,
            "share": _round(self.share), "est_saving_us_per_step": _round(self.est_saving_us_per_step),
            "estimate_source": self.estimate_source,
            "fixes": list(self.fixes),
            "group": {"parent": self.parent, "children": list(self.children)},
            "ranks": list(self.ranks), "evidence": {k: _json_value(v) for k, v in self.evidence.items()},
            "remediation": self.remediation,
        }


def _round(x: Any) -> Any:
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (int, np.integer)):
        return int(x)
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return None
        x = float(x)
        if x.is_integer() and abs(x) < 2**53:
            return int(x)
        if abs(x) >= 100:
            return round(x, 1)
        return float(f"{x:.6g}")  # enough digits that a share prints as the message printed it
    return x


def _json_value(v: Any) -> Any:
    if isinstance(v, str):
        return v if len(v) <= MAX_EVIDENCE_TEXT else v[:MAX_EVIDENCE_TEXT] + "…"
    if isinstance(v, (list, tuple)):
        return [_json_value(x) for x in v]
    return _round(v)


class Gaps(msgspec.Struct):
    """``undecided``: [{rule, subject, share, missing, how_to_supply}]; ``unexplained``:
    [{cls, share, explain_with}]; both largest share first."""

    undecided: list[dict[str, Any]] = msgspec.field(default_factory=list)
    unexplained: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"undecided": self.undecided, "unexplained": self.unexplained}
