"""Savings from replays: each finding's estimate is the step time its rule's fix saves when the step
is replayed with the fix's edits (:mod:`traceinspect.whatif`); findings whose fixes overlap
share a cause and are grouped under the one that saves most; the step with every finding fixed is
one replay of all the fixes together, never a sum of savings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from traceinspect.model.findings import SEVERITY_RANK, group_children
from traceinspect.whatif import EditError, Prediction, Replayer, replayer
from traceinspect.whatif.edit_spec import Edit, edit_from_mapping

if TYPE_CHECKING:
    from traceinspect.judge.rule import Rule, RuleSet
    from traceinspect.model.analysis import Analysis
    from traceinspect.model.findings import Finding

# two findings share a cause when fixing both saves less than the sum of their savings by at least this
# share of the smaller saving (their savings overlap)
OVERLAP_SHARE = 0.5


def _r(x: float | None) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), 1)


class AllFixed(msgspec.Struct):
    """The step with every finding's (first decided) fix applied together, from one replay."""

    prediction: Prediction | None
    fixes: list[str] = msgspec.field(default_factory=list)
    undecided: list[str] = msgspec.field(default_factory=list)
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "fixes": list(self.fixes),
            "measured_step_us": _r(p.measured_step_us) if p else None,
            "replayed_step_us": _r(p.replayed_step_us) if p else None,
            "predicted_step_us": _r(p.predicted_step_us) if p else None,
            "saving_us_per_step": _r(p.saving_us) if p else None,
            "saving_share": _r_share(p),
            "undecided": list(self.undecided),
            "reason": self.reason,
        }


def _r_share(p: Prediction | None) -> float | None:
    if p is None or p.saving_us is None or not p.replayed_step_us:
        return None
    return round(float(p.saving_us / p.replayed_step_us), 4)


def _rank_refs(rp: Replayer, a: Analysis, subject_ranks: list[int]) -> dict[str, int | None]:
    """``fastest``: the rank with the least host time per step (not the subject); ``latest``: the rank
    arriving last at most collectives."""
    m = rp.model
    host: dict[int, float] = {}
    for r in m.ranks:
        idx = np.nonzero(m.h_rank == r)[0]
        if len(idx):
            per = {}
            for q in np.unique(m.h_pos[idx]):
                j = idx[m.h_pos[idx] == q]
                per[int(q)] = float(m.h_end[j].max() - m.h_t[j].min())
            host[r] = float(np.median(list(per.values())))
    others = {r: v for r, v in host.items() if r not in subject_ranks}
    fastest = min(others, key=lambda r: others[r]) if others else None
    latest = None
    coll = a.collectives
    if coll is not None and coll.applicable and len(coll.per_rank):
        pr = coll.per_rank.sort_values(["late_arrivals", "rank"], ascending=[False, True])
        latest = int(pr["rank"].iloc[0])
    return {"fastest_rank": fastest, "latest_rank": latest}


def fix_edits(rp: Replayer, a: Analysis, f: Finding, rule: Rule, i: int) -> list[Edit]:
    """The edits of fix ``i`` of ``rule`` for finding ``f``."""
    ctx = dict(f.fix_context)
    ctx.update(_rank_refs(rp, a, list(f.ranks)))
    values = ctx.get("values") or []
    edits = []
    for j, fe in enumerate(rule.fixes[i].edits):
        spec = dict(fe.spec)
        if fe.value is not None:
            v = values[i][j] if i < len(values) and j < len(values[i]) else None
            if v is None:
                raise EditError(f"the value of {spec.get('edit')} ({fe.value.source}) cannot be decided")
            spec["value"] = max(float(v), 0.0)
        edits.append(edit_from_mapping(spec, ctx))
    return edits


def _variant_json(rule: Rule, i: int, p: Prediction | None, why: str | None) -> dict[str, Any]:
    fx = rule.fixes[i]
    out: dict[str, Any] = {"variant": f"{rule.id}:{fx.variant}", "label": fx.label}
    if p is None:
        out.update({"predicted_step_us": None, "saving_us_per_step": None, "edits": [], "undecided": [why or ""]})
        return out
    out.update({
        "predicted_step_us": _r(p.predicted_step_us), "saving_us_per_step": _r(p.saving_us),
        "saving_share": _r_share(p),
        "edits": [e.to_json() for e in p.edits], "undecided": list(p.undecided), "notes": list(p.notes),
    })
    if throughput_fix(fx):  # a batch change: its gain is tokens/s at a longer step, not a shorter step
        rep, pred = p.tokens_per_s("replayed"), p.tokens_per_s("predicted")
        out.update({"replayed_tokens_per_s": _r(rep), "predicted_tokens_per_s": _r(pred),
                    "tokens_per_s_gain": round(pred / rep - 1.0, 4) if rep and pred else None,
                    "batch": p.batch.to_json() if p.batch is not None else None})
    return out


def throughput_fix(fx: Any) -> bool:
    """A fix that changes the running batch (``batch`` edit): it is judged by tokens/s, never by the step
    time it saves, so it never gives a finding's step saving."""
    return any(str(fe.spec.get("edit", "")).lower() == "batch" for fe in fx.edits)


def replay_findings(a: Analysis, findings: list[Finding], rule_set: RuleSet) -> AllFixed:
    """Replace each finding's estimate by its replayed fix, group findings that share a cause and replay
    all fixes together."""
    try:
        rp = replayer(a)
    except Exception as e:  # noqa: BLE001 - a replay failure keeps the rules' own estimates, said so
        a.trace.warnings.append(f"the what-if replay could not be built ({type(e).__name__}: {e}); savings are "
                                "the rules' own estimates")
        return AllFixed(None, reason=f"replay unavailable: {type(e).__name__}: {e}")
    chosen: dict[int, tuple[Finding, list[Edit], Prediction]] = {}
    for n, f in enumerate(findings):
        rule = rule_set.get(f.rule)
        f.evidence["rule_estimate_us_per_step"] = f.est_saving_us_per_step
        if rule is None or not rule.fixes:
            f.estimate_source = "rule"
            continue
        f.fixes = []
        best: tuple[list[Edit], Prediction] | None = None
        for i, fx in enumerate(rule.fixes):
            try:
                edits = fix_edits(rp, a, f, rule, i)
            except EditError as e:
                f.fixes.append(_variant_json(rule, i, None, str(e)))
                continue
            p = rp.predict(edits, label=fx.label)
            f.fixes.append(_variant_json(rule, i, p, None))
            if best is None and p.decided and not throughput_fix(fx):
                best = (edits, p)
                f.fixes[-1]["moved_onto_critical_path"] = p.moved_onto_path()
        f.estimate_source = "replay"
        if best is None:
            why = "; ".join(u for fx in f.fixes for u in fx.get("undecided", []) if u)
            f.est_saving_us_per_step = None
            f.share = None
            f.evidence.setdefault("unavailable", []).append(f"no fix could be replayed: {why}")
            continue
        edits, p = best
        f.prediction = p
        saving = max(float(p.saving_us or 0.0), 0.0)
        f.est_saving_us_per_step = saving
        f.share = saving / p.replayed_step_us if p.replayed_step_us else None
        f.evidence["saving_share"] = f.share
        f.evidence["replayed_step_us"] = _r(p.replayed_step_us)
        f.evidence["predicted_step_us"] = _r(p.predicted_step_us)
        _explain_saving(rp, f, p, saving)
        _cap_severity(f, saving, p.replayed_step_us)
        chosen[n] = (f, edits, p)
    _group(rp, chosen)
    # all fixed: one replay of every chosen fix (host timelines first, so later edits act on them)
    if not chosen:
        return AllFixed(None, reason="no finding has a replayable fix" if findings else "no findings")
    order = sorted(chosen)
    all_edits = [e for n in order for e in chosen[n][1] if e.kind == "host-from"]
    all_edits += [e for n in order for e in chosen[n][1] if e.kind != "host-from"]
    p = rp.predict(all_edits, label="all findings fixed")
    if p.predicted_step_us is not None and len(order) > 1:
        for n in order:  # a lowered finding: what its fix saves once the others are fixed
            f = chosen[n][0]
            if "rule_severity" not in f.evidence:
                continue
            mine = {id(e) for e in chosen[n][1]}
            rest = rp.predict([e for e in all_edits if id(e) not in mine])
            if rest.predicted_step_us is None:
                continue
            gain = max(float(rest.predicted_step_us - p.predicted_step_us), 0.0)
            f.evidence["saving_with_others_fixed_us_per_step"] = _r(gain)
            f.message = (f"{f.message} With the other findings fixed too, it saves {gain:,.0f} µs more per step "
                         f"({rest.predicted_step_us:,.0f} -> {p.predicted_step_us:,.0f} µs).")
    return AllFixed(p, fixes=[_variant_of(chosen[n][0]) for n in order], undecided=list(p.undecided))


def _cap_severity(f: Finding, saving_us: float, step_us: float) -> None:
    """A finding is at most as severe as its replayed saving supports (``severity_min_saving_share`` in
    ``rules/tables/replay.yaml``); a lowered severity says why in the message."""
    from traceinspect.measure.replay_settings import load_settings

    floors = load_settings().severity_floors
    if not floors or not step_us or f.severity not in SEVERITY_RANK:
        return
    share = saving_us / step_us
    earned = next((sev for sev, floor in floors if share >= floor), "info")
    if SEVERITY_RANK.get(earned, 9) <= SEVERITY_RANK[f.severity]:
        return
    need = dict(floors).get(f.severity)
    f.evidence["rule_severity"] = f.severity
    f.message = (f"{f.message} Severity {earned}, not the rule's {f.severity}: the replayed fix saves "
                 f"{saving_us:,.0f} µs per step ({share:.1%} of the step)"
                 + (f", under the {need:.0%} a {f.severity} finding needs" if need is not None else "") + ".")
    f.severity = earned


def _variant_of(f: Finding) -> str:
    for fx in f.fixes:
        if fx.get("predicted_step_us") is not None:
            return str(fx["variant"])
    return f.rule


def _group(rp: Replayer, chosen: dict[int, tuple[Finding, list[Edit], Prediction]]) -> None:
    """Findings whose fixes overlap (fixing both saves clearly less than the sum) share a cause: the one
    with the larger saving becomes the parent of the other."""
    items = [(n, f, e, float(p.saving_us or 0.0)) for n, (f, e, p) in sorted(chosen.items()) if (p.saving_us or 0) > 0]
    items.sort(key=lambda t: -t[3])  # parents first: a finding is grouped under the largest saving it overlaps
    for x in range(len(items)):
        for y in range(x + 1, len(items)):
            _, fa, ea, sa = items[x]
            _, fb, eb, sb = items[y]
            if fb.parent or fb.children:
                continue
            both = rp.predict(ea + eb)
            if both.saving_us is None:
                continue
            overlap = sa + sb - float(both.saving_us)
            if overlap >= OVERLAP_SHARE * min(sa, sb):
                parent, child = (fa, fb) if not fa.parent else (fb, fa)
                if parent.parent or child.children:
                    continue
                child.parent = parent.rule
                parent.children.append(child.rule)
                child.evidence["shares_cause_with"] = parent.rule
                child.evidence["overlap_us_per_step"] = _r(overlap)


def order_findings(findings: list[Finding]) -> list[Finding]:
    """In the judge's order (:func:`~traceinspect.judge.engine.sort_findings`), each parent followed by the
    findings that share its cause."""
    from traceinspect.judge.engine import sort_findings

    return group_children(sort_findings(findings), lambda f: f.rule, lambda f: f.parent)


def saving_parts(rp: Replayer, p: Prediction) -> dict[str, Any] | None:
    """Where a replay's saving comes from, per rank and step: GPU idle removed, kernel time removed (each
    kernel at most to its roofline floor) and collective time removed (a rank's wait for another), and
    the bound no saving of the replay can exceed: the largest over the replayed steps and ranks of the
    replayed idle plus the time the edits took off the operations (``bound_us``). The medians are of the
    slowest rank of each step. None without a replay run."""
    run, base = p.run, rp.base
    if run is None or p.per_step is None or not len(p.per_step):
        return None
    m = rp.model
    d0, d1 = base.g_end - base.g_start, run.g_end - run.g_start
    cut = np.maximum(d0 - d1, 0.0)
    coll = m.g_inst >= 0
    key = m.g_rank.astype(np.int64) * 1_000_000 + m.g_pos.astype(np.int64)
    ks, inv = np.unique(key, return_inverse=True)
    kern = np.bincount(inv, weights=np.where(coll, 0.0, cut), minlength=len(ks))
    comm = np.bincount(inv, weights=np.where(coll, cut, 0.0), minlength=len(ks))
    ps = p.per_step
    rk = ps["rank"].to_numpy().astype(np.int64) * 1_000_000 + ps["pos"].to_numpy().astype(np.int64)
    at = np.searchsorted(ks, rk)
    at = np.clip(at, 0, max(len(ks) - 1, 0))
    found = ks[at] == rk if len(ks) else np.zeros(len(rk), dtype=bool)
    k_cut = np.where(found, kern[at], 0.0)
    c_cut = np.where(found, comm[at], 0.0)
    idle0 = (ps["replayed_us"] - ps["replayed_busy_us"]).to_numpy(dtype=float)
    idle1 = (ps["predicted_us"] - ps["predicted_busy_us"]).to_numpy(dtype=float)
    bound = idle0 + k_cut + c_cut
    # per step position: the slowest rank as replayed
    pos = ps["pos"].to_numpy()
    span = ps["replayed_us"].to_numpy(dtype=float)
    rows = [int(np.flatnonzero(pos == q)[np.argmax(span[pos == q])]) for q in np.unique(pos)]
    others = [float(np.max(c_cut[(pos == pos[i]) & (np.arange(len(pos)) != i)], initial=0.0)) for i in rows]
    med = {k: float(np.median(v[rows])) for k, v in
           (("idle_us", np.maximum(idle0 - idle1, 0.0)), ("kernel_us", k_cut), ("collective_us", c_cut),
            ("slowest_idle_us", idle0))}
    med["others_collective_us"] = float(np.median(others)) if others else 0.0
    slow = ps["rank"].to_numpy()[rows]
    vals, counts = np.unique(slow, return_counts=True)
    return {**{k: _r(v) for k, v in med.items()}, "bound_us": _r(float(bound.max())),
            "slowest_rank": int(vals[np.argmax(counts)])}


def _explain_saving(rp: Replayer, f: Finding, p: Prediction, saving: float) -> None:
    """Record where the saving comes from and its bound; a saving larger than the idle or class time the
    finding names says where the rest comes from, with the numbers."""
    parts = saving_parts(rp, p)
    if parts is None:
        return
    f.evidence["saving_from"] = {k: parts[k] for k in ("idle_us", "kernel_us", "collective_us",
                                                       "others_collective_us", "slowest_rank")}
    f.evidence["saving_bound_us_per_step"] = parts["bound_us"]
    named = f.evidence.get("impact_us_per_step")
    if not isinstance(named, (int, float)) or saving <= float(named) * 1.01 + 1.0:
        return
    what = "GPU idle (over the ranks)" if "idle_us_per_step" in f.evidence else "time"
    bits = []
    if (parts["idle_us"] or 0) > 0:
        bits.append(f"{parts['idle_us']:,.0f} µs of its {parts['slowest_idle_us']:,.0f} µs of GPU idle")
    if (parts["collective_us"] or 0) > 0:
        bits.append(f"{parts['collective_us']:,.0f} µs of its time inside collectives")
    if (parts["kernel_us"] or 0) > 0:
        bits.append(f"{parts['kernel_us']:,.0f} µs of kernel time (no kernel below its roofline floor)")
    tail = ""
    if (parts["others_collective_us"] or 0) > 0:
        tail = (f"; the other ranks' GPUs spend up to {parts['others_collective_us']:,.0f} µs of that time inside "
                "collectives waiting for it, which the fix removes too")
    if bits:
        f.message = (f"{f.message} The replayed saving ({saving:,.0f} µs per step) is more than the "
                     f"{float(named):,.0f} µs of {what} named above: the slowest rank, TP{parts['slowest_rank']}, "
                     "sets the step, and per step the fix removes " + ", ".join(bits) + tail + ".")
