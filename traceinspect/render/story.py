"""What every output leads with, decided once: the findings in their one order, the lead finding and
its saving as text, the basis of every share, and the classes or rules the findings leave open.

The terminal summary, the HTML banner and the Markdown summary all take their headline from
:func:`story`, so they cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from traceinspect.model.findings import finding_order, group_children
from traceinspect.units import SHARE_BASIS, fmt_pct, fmt_us, is_number


def _num(v: Any) -> float | None:
    return float(v) if is_number(v) else None


def ordered_findings(findings: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Findings (JSON form) in the one order of every output: severity, then estimated saving; a finding
    that shares its cause with another (``group.parent``) follows that one."""
    ranked = sorted(findings or [], key=lambda f: finding_order(f.get("severity"), f.get("est_saving_us_per_step"),
                                                                f.get("share"), f.get("rule")))
    return group_children(ranked, lambda f: f.get("rule"), lambda f: (f.get("group") or {}).get("parent"))


def step_us_of(doc: dict[str, Any]) -> float | None:
    """The step time every share is a fraction of: the median step (slowest rank's GPU span)."""
    return _num((doc.get("steps") or {}).get("median_us"))


def step_share(us_per_step: Any, doc: dict[str, Any]) -> float | None:
    """``us_per_step`` as a fraction of the step time."""
    us, step = _num(us_per_step), step_us_of(doc)
    return us / step if us is not None and step else None


def rank_steps(doc: dict[str, Any]) -> int:
    """The analysed steps of all ranks: the divisor of every per-step figure (``steps.rank_steps``; in an
    older document, the sum of ``ranks[].steps``)."""
    n = (doc.get("steps") or {}).get("rank_steps")
    if not is_number(n):
        n = sum(r.get("steps") or 0 for r in doc.get("ranks") or []
                if isinstance(r, dict) and is_number(r.get("steps")))
    return max(int(n), 1)


def share_of_step(entry: dict[str, Any], doc: dict[str, Any]) -> float | None:
    """The share of the step time of a ``classes`` or ``top_kernels`` entry: the document's
    ``share_of_step`` (an older document: its time per step over the step time)."""
    v = _num(entry.get("share_of_step"))
    if v is not None:
        return v
    us = _num(entry.get("us_per_step"))
    if us is None and _num(entry.get("us")) is not None:
        us = float(entry["us"]) / rank_steps(doc)
    return step_share(us, doc)


def saving_share(f: dict[str, Any], doc: dict[str, Any]) -> float | None:
    """A finding's estimated saving as a fraction of the step time (the judge's figure when it gave one)."""
    ev = f.get("evidence") if isinstance(f.get("evidence"), dict) else {}
    share = _num(ev.get("saving_share"))
    return share if share is not None else step_share(f.get("est_saving_us_per_step"), doc)


def saving_text(f: dict[str, Any], doc: dict[str, Any]) -> str | None:
    """'3,599 µs per step (38.0% of the step time)', or None when the rule gives no estimate."""
    saving = _num(f.get("est_saving_us_per_step"))
    if saving is None:
        return None
    share = saving_share(f, doc)
    return f"{fmt_us(saving)} per step" + (f" ({fmt_pct(share)} of the {SHARE_BASIS})" if share is not None else "")


def source_text(source: Any) -> str:
    """Where the steps came from (``steps.source``: one source or a list of them) as text."""
    if isinstance(source, (list, tuple)):
        return ", ".join(str(x) for x in source) or "none"
    return str(source) if source not in (None, "") else "none"


def basis_text(doc: dict[str, Any]) -> str:
    """The one sentence that says what shares are of."""
    steps = doc.get("steps") or {}
    phase = steps.get("phase", "decode")
    return (f"Shares are of the {phase} {SHARE_BASIS}: median {fmt_us(step_us_of(doc))} per step "
            "(the slowest rank's GPU span); sizes are in decimal units (1 MB = 10^6 bytes).")


@dataclass
class Open:
    """A class no finding explains, a rule that could not be decided, or a straggler rank no finding is about:
    shown beside the headline."""

    kind: str  # "unexplained" | "undecided" | "straggler"
    text: str
    subject: str
    share: float | None = None


@dataclass
class Story:
    findings: list[dict[str, Any]]  # in the one order
    lead: dict[str, Any] | None
    saving: str | None  # the lead's saving as text (see saving_text)
    basis: str
    open: list[Open] = field(default_factory=list)
    quiet: str = ""  # the headline when nothing fired


def _words(v: Any) -> str:
    """A text or a list of texts as one phrase."""
    if isinstance(v, (list, tuple)):
        return "; ".join(str(x).strip().rstrip(".") for x in v if str(x).strip())
    return str(v or "").strip().rstrip(".")


def gpu_to_step_share(share: float | None, doc: dict[str, Any]) -> float | None:
    """A share of all GPU kernel time (as ``classes[].share``) as a share of the step time."""
    step = step_us_of(doc)
    kernel = sum(_num(v.get("us_per_step")) or 0.0 for v in (doc.get("classes") or {}).values())
    return share * kernel / step if share is not None and step and kernel else None


def gap_share(entry: dict[str, Any], doc: dict[str, Any]) -> float | None:
    """An ``unexplained`` or ``undecided`` entry's share (the analysis gives it of GPU time) as a share of
    the step time: an unexplained class's as the class tables give it, the rest converted."""
    cls = entry.get("cls")
    c = (doc.get("classes") or {}).get(str(cls)) if cls else None
    share = share_of_step(c, doc) if isinstance(c, dict) else None
    return share if share is not None else gpu_to_step_share(_num(entry.get("share")), doc)


def _open_items(doc: dict[str, Any]) -> list[Open]:
    out: list[Open] = []
    for u in doc.get("unexplained") or []:
        if not isinstance(u, dict) or not u.get("cls"):
            continue
        cls = str(u["cls"])
        share = gap_share(u, doc)
        how = _words(u.get("explain_with"))
        out.append(Open("unexplained", f"Unexplained: {cls} takes {fmt_pct(share)} of the {SHARE_BASIS} and no "
                        "finding explains it" + (f"; what would explain it: {how}" if how else "") + ".", cls, share))
    for u in doc.get("undecided") or []:
        if not isinstance(u, dict) or not u.get("rule"):
            continue
        share = gap_share(u, doc)  # (the analysis gives it of GPU time)
        text = f"Undecided: {u['rule']}" + (f" (at stake: {fmt_pct(share)} of the {SHARE_BASIS})"
                                            if share is not None else "")
        missing = _words(u.get("missing"))
        text += " could not be decided" + (f": missing {missing}" if missing else "")
        how = _words(u.get("how_to_supply"))
        if how:
            text += f"; to decide it: {how}"
        out.append(Open("undecided", text + ".", str(u["rule"]), share))
    return out


STRAGGLER_RULE = "rank-straggler"


def straggler_item(doc: dict[str, Any]) -> Open | None:
    """The rank the collectives analysis names as the straggler (``collectives.straggler``), when no finding
    is about it (a training run, whose rules are not applied, or below the rule's thresholds)."""
    coll = doc.get("collectives")
    st = coll.get("straggler") if isinstance(coll, dict) and coll.get("applicable") is not False else None
    if not isinstance(st, dict) or _num(st.get("rank")) is None:
        return None
    if any(isinstance(f, dict) and f.get("rule") == STRAGGLER_RULE for f in doc.get("findings") or []):
        return None
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or [] if isinstance(r, dict)}
    who = str(labels.get(st["rank"]) or f"rank {st['rank']}")
    text = f"Straggler: {who} arrives last at {fmt_pct(_num(st.get('late_share')))} of the collectives"
    wait = _num(st.get("wait_caused_us_per_step"))
    if wait is not None:
        text += f" and causes {fmt_us(wait)} of waiting per step on the other ranks"
    return Open("straggler", text + ".", who, _num(st.get("late_share")))


def story(doc: dict[str, Any]) -> Story:
    """The headline of an analysis document (or of a document an older version wrote)."""
    findings = ordered_findings(doc.get("findings"))
    lead = findings[0] if findings else None
    quiet = ""
    if lead is None:
        classes = doc.get("classes") or {}
        if classes:
            top, v = max(classes.items(), key=lambda kv: _num(kv[1].get("us_per_step")) or 0.0)
            quiet = (f"No findings. The largest class is {top}: {fmt_us(v.get('us_per_step'))} per step, "
                     f"{fmt_pct(step_share(v.get('us_per_step'), doc))} of the {SHARE_BASIS}.")
        else:
            quiet = "No findings, and no classified kernel time."
    return Story(findings=findings, lead=lead, saving=saving_text(lead, doc) if lead else None,
                 basis=basis_text(doc), open=[*_open_items(doc), *filter(None, [straggler_item(doc)])], quiet=quiet)
