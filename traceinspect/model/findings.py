"""The one order of findings, shared by the judge (which sorts its findings) and every renderer (which
sorts a document's): severity, estimated saving, share, rule id; a finding that shares another's cause
follows it."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

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
