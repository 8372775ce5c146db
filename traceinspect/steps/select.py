"""Which steps are analysed: the phase a request resolves to (and what the user is told about it), the
steps of that phase, the kind of run (decode, prefill, mixed, training), and a warning when ranks recorded
different numbers of steps."""

from __future__ import annotations

import numpy as np
import pandas as pd

from traceinspect.load.consistency import training_ops
from traceinspect.model import TraceSet
from traceinspect.model.analysis import RunKind
from traceinspect.tables import factorize_text


def resolve_phase(steps: pd.DataFrame, phase: str) -> tuple[str, list[str]]:
    """The phase to analyse for a request (``auto``: decode steps, else the one phase the trace holds)
    and what the user must be told about it: steps of unknown phase are analysed as the requested
    phase only with a note saying so, never silently relabelled."""
    inc = steps[steps["included"]]
    counts = inc.groupby("phase").size().to_dict()
    n_unknown = int(counts.pop("unknown", 0))
    known = {p: int(n) for p, n in counts.items() if n}
    notes: list[str] = []
    if phase == "auto":
        if "decode" in known or not (known or n_unknown):
            phase = "decode"
        elif len(known) == 1 and not n_unknown:
            phase = next(iter(known))
            notes.append(f"the trace holds no decode steps: analysed its {known[phase]} {phase} step(s) "
                         f"(--phase selects the phase)")
        elif not known:
            phase = "unknown"
            notes.append(f"no marker in the trace states the phase of its steps: analysed {n_unknown} step(s) "
                         "of unknown phase as they are (--phase decode or prefill treats them as that phase)")
        else:
            phase = "all"
            notes.append(f"the trace holds no decode steps: analysed all its steps "
                         f"({', '.join(f'{p} {n}' for p, n in sorted(known.items()))}"
                         f"{f', unknown {n_unknown}' if n_unknown else ''})")
    if phase in ("decode", "prefill") and n_unknown:
        notes.append(f"{n_unknown} analysed step(s) are of unknown phase (no marker in the trace states it): they "
                     f"are analysed as {phase} steps because --phase {phase} asks, not known to be {phase} steps")
    return phase, notes


def select_steps(steps: pd.DataFrame, phase: str) -> pd.DataFrame:
    """Included steps of the requested phase ('decode', 'prefill', 'unknown', 'all', or 'auto': see
    :func:`resolve_phase`); steps of unknown phase count for decode and prefill too."""
    s = steps[steps["included"]]
    if phase == "auto":
        phase = resolve_phase(steps, phase)[0]
    if phase == "all":
        return s
    if phase == "unknown":
        return s[s["phase"] == "unknown"]
    return s[(s["phase"] == phase) | (s["phase"] == "unknown")]




def run_kind(ts: TraceSet, steps: pd.DataFrame) -> RunKind:
    """Decide the run's kind once: training where backward ops, autograd's engine or optimizer steps
    appear; else from the phases of its steps."""
    hits: dict[str, int] = {}
    ann_codes, ann_names = factorize_text(ts.annotations["name"].to_numpy(dtype=object)) \
        if len(ts.annotations) else (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=object))
    for codes, texts in (ts.op_names(), (ann_codes, ann_names)):
        if not len(codes):
            continue
        hit = pd.Series(texts, dtype=object).str.contains(training_ops(), na=False).to_numpy(dtype=bool)
        if hit.any():
            found = set(texts[hit].tolist())
            hits[", ".join(sorted(found)[:3])] = int(np.count_nonzero(hit[codes]))
    if hits:
        what = "; ".join(f"{n} x {k}" for k, n in hits.items())
        return RunKind("training", f"backward / optimizer ops in the trace ({what})")
    inc = steps[steps["included"]] if len(steps) else steps
    phases = set(inc["phase"]) - {"idle"}
    if not phases:
        return RunKind(None, "no analysed steps")
    if "unknown" in phases:
        return RunKind(None, "no marker in the trace states the phase of its steps (SGLang step[...] spans "
                             "or a forward annotation with request counts); no backward or optimizer ops")
    if phases == {"decode"}:
        return RunKind("decode", "every step is a decode step")
    if phases == {"prefill"}:
        return RunKind("prefill", "every step is a prefill step")
    return RunKind("mixed", f"steps of phases {', '.join(sorted(phases))}")


def step_count_warnings(selected: pd.DataFrame, ts: TraceSet, phase: str) -> list[str]:
    """A warning when ranks have different numbers of analysed steps."""
    counts = selected.groupby("rank").size()
    present = {int(r): int(n) for r, n in counts.items()}
    if len(ts.ranks) < 2:
        return []
    per = {i.label: present.get(i.rank, 0) for i in ts.ranks}
    if len(set(per.values())) <= 1:
        return []
    n = min(per.values())
    detail = ", ".join(f"{k}: {v}" for k, v in per.items())
    return [f"ranks have different numbers of complete {phase} steps ({detail}): analysed the first {n} aligned "
            "steps (by position) for step times and cross-rank comparisons; per-rank totals use all of a "
            "rank's steps"]
