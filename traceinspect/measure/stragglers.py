"""The straggler: the rank that arrives last at collectives and causes the others' wait."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from traceinspect.measure.comm_settings import _median, load_settings
from traceinspect.units import fmt_pct

if TYPE_CHECKING:
    from traceinspect.measure.comm_result import Collectives


def _straggler(res: Collectives) -> dict[str, Any]:
    pr = res.per_rank
    if not len(pr) or pr["arrivals"].sum() == 0:
        return {"rank": None, "reason": "no matched collectives"}
    total_wait = float(pr["wait_us"].sum())
    cand = pr.sort_values(["wait_caused_us", "late_arrivals"], ascending=False).iloc[0]
    n_group = max((len(g) for g in res.groups), default=1)
    cfg = load_settings()
    min_late = max(cfg.straggler_min_late_share, 1.5 / n_group)
    step_med = _median(res.per_step.groupby("pos")["step_us"].max()) if len(res.per_step) else float("nan")
    caused_share = float(cand["wait_caused_us"]) / total_wait if total_wait > 0 else 0.0
    step_frac = float(cand["wait_caused_us_per_step"]) / step_med if step_med > 0 else float("nan")
    label = f"rank {int(cand['rank'])}"
    checks = {
        f"{label} arrives last at {fmt_pct(float(cand['late_share']))} of the collectives": (
            float(cand["late_share"]), min_late, f"{fmt_pct(min_late)} or more"),
        f"it causes {fmt_pct(caused_share)} of the waiting": (
            caused_share, cfg.straggler_min_wait_share, f"{fmt_pct(cfg.straggler_min_wait_share)} or more"),
        f"the wait it causes is {fmt_pct(step_frac)} of the step time": (
            step_frac, cfg.straggler_min_step_fraction, f"{fmt_pct(cfg.straggler_min_step_fraction)} or more"),
    }
    failed = [f"{what} (a straggler: {need})" for what, (v, lim, need) in checks.items() if not (v >= lim)]
    others = pr[pr["rank"] != cand["rank"]]
    return {
        "rank": None if failed else int(cand["rank"]),
        "candidate": int(cand["rank"]),
        "late_arrivals": int(cand["late_arrivals"]),
        "arrivals": int(cand["arrivals"]),
        "late_share": float(cand["late_share"]),
        "late_share_min": min_late,
        "wait_caused_us_per_step": float(cand["wait_caused_us_per_step"]),
        "wait_caused_share": caused_share,
        "wait_caused_step_fraction": step_frac,
        "step_us_median": step_med,
        "launch_lateness_us_median": float(cand["launch_lateness_us_median"]),
        "busy_us_median": float(cand["busy_us_median"]),
        "others_busy_us_median": _median(others["busy_us_median"]),
        "reason": ("; ".join(failed) if failed else None),
    }


