"""What the analysis could not decide, as plain items every output format renders the same way:
the JSON's ``undecided`` (a rule that could not decide on a large share of GPU time) and
``unexplained`` (a large class no finding is about) entries, each with how to supply the evidence. Their
shares are given of the step time, as the headline gives them (:func:`~traceinspect.render.story.gap_share`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from traceinspect.render import fmt_pct, kernel_label
from traceinspect.render.story import gap_share
from traceinspect.units import SHARE_BASIS


@dataclass(frozen=True)
class GapItem:
    """One entry: ``kind`` ('undecided' | 'unexplained'), a one-line ``head``, what is ``missing`` and
    ``how`` to supply it (or what would explain the time)."""

    kind: str
    head: str
    missing: tuple[str, ...]
    how: tuple[str, ...]
    anchor: str


def gap_items(doc: dict[str, Any]) -> list[GapItem]:
    """Undecided entries first (largest share first), then unexplained classes."""
    out: list[GapItem] = []
    for i, u in enumerate(doc.get("undecided") or []):
        subject = str(u.get("subject") or "")
        about = f" ({kernel_label(subject, 70)})" if subject and subject != "run" else ""
        out.append(GapItem(
            "undecided",
            f"{u.get('rule')} could not decide on {fmt_pct(gap_share(u, doc))} of the {SHARE_BASIS}{about}",
            tuple(str(m) for m in u.get("missing") or ()), tuple(str(h) for h in u.get("how_to_supply") or ()),
            f"undecided-{i}"))
    for i, x in enumerate(doc.get("unexplained") or []):
        out.append(GapItem(
            "unexplained",
            f"class {x.get('cls')} takes {fmt_pct(gap_share(x, doc))} of the {SHARE_BASIS} and no finding is "
            "about it",
            (), tuple(str(e) for e in x.get("explain_with") or ()), f"unexplained-{i}"))
    return out
