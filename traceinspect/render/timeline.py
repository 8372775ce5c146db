"""The report's two timelines, from the document's ``report.timeline`` and ``report.after_timeline``: the
data the page's ``Timeline`` script draws (kernel lanes, class colours, names and shapes), a caption, or
the reason there is none."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from markupsafe import Markup

from traceinspect.render.palette import class_color
from traceinspect.render.svg import get, script_json
from traceinspect.units import fmt_us

NO_SECTION = "the analysis JSON has no report section (written by an older traceinspect: analyse the traces again)"


@dataclass
class TimelineInfo:
    """A timeline for the report: its data (drawn in the page by ``Timeline`` in the report's script),
    a caption, or the reason there is none."""

    data: dict[str, Any] = field(default_factory=dict)
    caption: str = ""
    reason: str | None = None
    kernels: int = 0
    lanes: int = 0

    @property
    def json(self) -> Markup:
        return script_json(self.data)


def _names(doc: dict[str, Any]) -> list[str]:
    return [str(n) for n in get(doc, "report", "kernels", "name", default=None) or []]


def _payload(tl: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The page's timeline data from a document timeline (kernel names looked up in the kernel table)."""
    classes = [str(c) for c in tl.get("classes") or []]
    return {"title": "", "span": tl.get("span"), "lanes": tl.get("lanes") or [], "classes": classes,
            "colors": [class_color(c) for c in classes],
            "names": [names[i] if isinstance(i, int) and 0 <= i < len(names) else "" for i in tl.get("names") or []],
            "shapes": [str(s) for s in tl.get("shapes") or []], "kernels": tl.get("kernels") or 0,
            "marks": tl.get("marks") or []}


def _usable(tl: Any) -> bool:
    return isinstance(tl, dict) and isinstance(tl.get("lanes"), list) and isinstance(tl.get("span"), (int, float))


def timeline_svg(doc: dict[str, Any]) -> TimelineInfo:
    """The timeline of one representative step: kernel lanes (one per stream of each rank) on one clock,
    drawn in the page as the busy fraction of every pixel column, so idle time shows at any zoom."""
    tl = get(doc, "report", "timeline")
    if not isinstance(tl, dict):
        return TimelineInfo(reason=NO_SECTION)
    if tl.get("reason") or not _usable(tl):
        return TimelineInfo(reason=str(tl.get("reason") or "the document's timeline is incomplete"))
    data = _payload(tl, _names(doc))
    n = int(tl.get("kernels_in_step") or data["kernels"])
    pos = get(doc, "timeline", "step_index")
    caption = (f"Step {int(pos) + 1 if isinstance(pos, int) else '?'} of {get(doc, 'steps', 'count')} analysed per "
               f"rank (its time is closest to the median), {n:,} kernels over {fmt_us(data['span'])}.")
    if data["kernels"] < n:
        caption += f" Only the {data['kernels']:,} longest kernels are drawn (a size budget)."
    return TimelineInfo(data=data, caption=caption, kernels=n, lanes=len(data["lanes"]))


def after_timeline(doc: dict[str, Any]) -> tuple[TimelineInfo | None, str]:
    """The representative step as the replay of the top finding's fix places it, on the measured step's
    time axis; (None, reason) when there is nothing to show."""
    tl = get(doc, "report", "after_timeline")
    if not isinstance(tl, dict):
        return None, NO_SECTION
    if tl.get("reason") or not _usable(tl):
        return None, str(tl.get("reason") or "the document's after-fix timeline is incomplete")
    data = _payload(tl, _names(doc))
    pos = get(doc, "timeline", "step_index")
    label = str(tl.get("label") or tl.get("rule") or "")
    caption = (f"{tl.get('rule')}: {label}. Step {int(pos) + 1 if isinstance(pos, int) else '?'} as the replay "
               f"places it with the fix applied, on the measured step's time axis; the TP step goes from "
               f"{fmt_us(tl.get('replayed_step_us'))} replayed to {fmt_us(tl.get('predicted_step_us'))} predicted "
               "(medians over the replayed steps).")
    return TimelineInfo(data=data, caption=caption, kernels=int(data["kernels"]), lanes=len(data["lanes"])), label
