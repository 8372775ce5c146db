"""Before/after fixture pairs: the replay of each pair's fix on the before trace predicts the step measured
on the after trace within the tolerance of ``tests/data/replay_pairs.yaml``, with the two captures' host
speeds controlled (``host-speed``, measured from both traces: ``whatif/hostspeed.py``), beside the raw prediction and the rules'
own arithmetic; and the host-speed marker itself checked on repeated captures of one set (pure drift).

``python -m pytest tests/test_replay_pairs.py -s`` prints the pair table (``python tests/test_replay_pairs.py``
prints it alone).
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import FIXTURES, ROOT, analysed, fixture_dir, real_trace  # noqa: E402

from traceinspect.pipeline import Analysis  # noqa: E402
from traceinspect.whatif import Edit, parse_edit, replayer  # noqa: E402
from traceinspect.whatif.fixes import fix_edits  # noqa: E402
from traceinspect.whatif.hostspeed import HostSpeed, host_speed_ratio  # noqa: E402

PAIRS = yaml.safe_load((ROOT / "tests" / "data" / "replay_pairs.yaml").read_text())
TOL = float(PAIRS["tolerance"])
DRIFT = FIXTURES / "drift"
# repeated captures of one set: the drift fixtures (one alternate run, ABBA order) and the fixture sets they repeat
DRIFT_SETS = ("tp1-l6-full-eager", "tp1-l6-gather-eager", "tp1-l6-gather-eager-hostdelay", "tp1-l6-gather-eager-bs16")
DRIFT_GROUPS = {v: sorted(str(p) for p in DRIFT.glob(f"{v}-r*")) + [str(FIXTURES / v)]
                + ([str(FIXTURES / "tp1-l6-gather-eager-samehost")] if v == "tp1-l6-gather-eager" else [])
                for v in DRIFT_SETS}
# the pairs of the table whose halves were both captured repeatedly: every capture against every capture
CROSS = [
    ("tp1-l6-full-eager", "tp1-l6-gather-eager", {"fix": "kv-full-pool-cast:gather"}),
    ("tp1-l6-gather-eager-hostdelay", "tp1-l6-gather-eager", {"fix": "host-stall:remove"}),
    ("tp1-l6-gather-eager-bs16", "tp1-l6-gather-eager",
     {"edits": ["gemm-m class=moe_gemm {batch_ratio}", "gemm-m class=bf16_gemm {batch_ratio}",
                "gemm-m class=fp8_gemm {batch_ratio}"]}),
]


def _analysis(path: str) -> Analysis:
    return analysed(path, "decode")


def _fixture(name: str) -> Analysis:
    return _analysis(str(fixture_dir(name)))


@dataclass
class Row:
    """One pair: measured before/after, the replay's prediction raw and host-controlled, the rule's own."""

    pair: dict
    before_us: float
    after_us: float
    predicted_us: float
    host: HostSpeed
    controlled_us: float | None
    rule_saving_us: float | None  # the rule's local estimate (None: no rule's fix is the change)
    host_only_us: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.pair['before']} -> {self.pair['after']}"

    @property
    def change(self) -> str:
        if self.pair.get("fix"):
            return self.pair["fix"]
        ratio = _analysis_batch(self.pair["after"]) / _analysis_batch(self.pair["before"])
        kinds = sorted({e.split()[0] for e in self.pair["edits"]})
        return f"`{'/'.join(kinds)}` x {ratio:g} ({', '.join(e.split()[1] for e in self.pair['edits'])})"

    @property
    def raw_error(self) -> float:
        return self.predicted_us / self.after_us - 1.0

    @property
    def controlled_error(self) -> float | None:
        return None if self.controlled_us is None else self.controlled_us / self.after_us - 1.0

    @property
    def max_spread(self) -> float | None:
        s = [r.spread for r in self.host.ranks]
        return None if not s or any(x is None for x in s) else max(s)  # type: ignore[type-var]

    @property
    def judged_on(self) -> str:
        """'host-controlled' when the marker decides every rank within the tolerance, else 'raw' (the
        after's host speed could not be measured: no CPU op in its steps, or too few alike)."""
        if self.controlled_us is None:
            return "raw"
        return "host-controlled" if (self.max_spread or 0.0) <= TOL else "undecided"

    @property
    def judged_error(self) -> float | None:
        return {"raw": self.raw_error, "host-controlled": self.controlled_error}.get(self.judged_on)

    def rule_after(self, controlled: bool) -> float | None:
        if self.rule_saving_us is None:
            return None
        base = self.host_only_us if controlled and self.host_only_us is not None else self.before_us
        return base - self.rule_saving_us


def _fix(before: Analysis, pair: dict, after: Analysis | None = None) -> tuple[list[Edit], float | None]:
    """The pair's edits on the before trace and the rule's own estimate of the saving (None for edits)."""
    rp = replayer(before)
    if "edits" in pair:
        after = after if after is not None else _fixture(pair["after"])
        ratio = float(after.run_model.value("batch")) / float(before.run_model.value("batch"))
        return [parse_edit(e.format(batch_ratio=f"{ratio:g}")) for e in pair["edits"]], None
    rule_id, _, variant = pair["fix"].partition(":")
    rule = before.rule_set.get(rule_id)
    finding = next((f for f in before.findings if f.rule == rule_id), None)
    est: float | None = 0.0  # a rule that did not fire claims no saving
    if finding is None:  # the rule did not fire: its fix acts on what the rule selects
        from traceinspect.judge.engine import Finding, _fix_context
        from traceinspect.judge.metrics import Subject

        finding = Finding(rule=rule_id, severity=rule.severity, title=rule.title, message="", share=None,
                          est_saving_us_per_step=None, ranks=[], evidence={}, remediation="")
        finding.fix_context = _fix_context(rule, Subject(rule.select.scope, "", {}), {}, None)
    else:
        est = finding.evidence.get("rule_estimate_us_per_step")
    i = [f.variant for f in rule.fixes].index(variant)
    return list(fix_edits(rp, before, finding, rule, i)), (float(est) if est is not None else None)


def _analysis_batch(name: str) -> float:
    return float(_fixture(name).run_model.value("batch"))


@lru_cache(maxsize=32)
def pair_row(i: int) -> Row:
    pair = PAIRS["pairs"][i]
    before, after = _fixture(pair["before"]), _fixture(pair["after"])
    rp = replayer(before)
    edits, rule_est = _fix(before, pair)
    measured_after = replayer(after).as_measured().measured_step_us
    p = rp.predict(edits)
    host = host_speed_ratio(before, after)
    controlled = host_only = None
    if host.decided:
        hs = [parse_edit(e) for e in host.edits()]
        controlled = rp.predict(edits + hs).predicted_step_us
        host_only = rp.predict(hs).predicted_step_us
    return Row(pair=pair, before_us=p.measured_step_us, after_us=measured_after, predicted_us=float(p.predicted_step_us),
               host=host, controlled_us=controlled, rule_saving_us=rule_est, host_only_us=host_only)


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 100:+.1f}%"


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x / 1000:.2f} ms"


def _host(r: Row) -> str:
    if not r.host.decided:
        why = next((x.reason for x in r.host.ranks if x.ratio is None), "")
        return "n/a (" + ("no CPU op in the steps of " + ("either" if why.startswith("neither") else "one")
                          if "CUDA-graph" in why else why) + ")"
    return ", ".join(f"r{x.rank} {x.ratio:.3f} [{x.q25:.3f}-{x.q75:.3f}]" for x in r.host.ranks)


def table() -> str:
    """The pair table (Markdown): measured before/after, the replay's prediction and error raw and with the
    host speeds controlled, and the rule's own arithmetic (before minus its local estimate) likewise."""
    head = ("| pair | fix | before | after | predicted | error | host speed before/after [quartiles] | "
            "predicted, host-controlled | error | rule arithmetic | error | host-controlled error | judged on |")
    lines = [head, "|" + "---|" * 2 + "---:|" * 4 + "---|" + "---:|" * 5 + "---|"]
    for i in range(len(PAIRS["pairs"])):
        r = pair_row(i)
        ra, rc = r.rule_after(False), r.rule_after(True)
        lines.append(
            f"| {r.label} | {r.change} | {_ms(r.before_us)} | {_ms(r.after_us)} | {_ms(r.predicted_us)} | "
            f"{_pct(r.raw_error)} | {_host(r)} | {_ms(r.controlled_us)} | {_pct(r.controlled_error)} | {_ms(ra)} | "
            f"{_pct(None if ra is None else ra / r.after_us - 1)} | "
            f"{_pct(None if rc is None or r.controlled_us is None else rc / r.after_us - 1)} | {r.judged_on} |")
    return "\n".join(lines)


@pytest.mark.parametrize("i", [
    pytest.param(i, id=f"{p['before']}->{p['after']}:{p.get('fix', 'edits')}",
                 marks=[pytest.mark.xfail(reason=p["known_miss"], strict=True)] if p.get("known_miss") else [])
    for i, p in enumerate(PAIRS["pairs"])])
def test_fix_predicts_after_fixture(i: int) -> None:
    r = pair_row(i)
    assert r.judged_on != "undecided", f"host-speed marker spread {r.max_spread:.3f} over the tolerance"
    err = r.judged_error
    assert err is not None and abs(err) <= TOL, (r.label, r.before_us, r.after_us, r.predicted_us, r.controlled_us)


def test_pair_table_printed() -> None:
    """The closing table, from the traces (``-s`` shows it)."""
    t = table()
    print("\n" + t)
    rows = t.splitlines()[2:]
    assert len(rows) == len(PAIRS["pairs"])
    eager = [pair_row(i) for i in range(len(rows)) if "eager" in PAIRS["pairs"][i]["after"]]
    assert eager and all(r.host.decided for r in eager)  # every eager after has CPU ops to compare


def test_host_speed_edit_scales_the_host_timeline() -> None:
    """``host-speed 2`` halves a host-bound eager step's host gaps and call times (the step follows), and
    leaves a CUDA-graph step, bound by the GPU, nearly as it was."""
    a = _fixture("tp1-l6-full-eager")
    rp = replayer(a)
    p = rp.predict([parse_edit("host-speed 2")])
    assert 0.45 * p.replayed_step_us < p.predicted_step_us < 0.6 * p.replayed_step_us
    slow = rp.predict([parse_edit("host-speed 0.5")])
    assert slow.predicted_step_us > 1.8 * slow.replayed_step_us
    g = replayer(_fixture("tp1-l6-full-graph")).predict([parse_edit("host-speed 2")])
    assert abs(g.saving_us) < 0.05 * g.replayed_step_us
    # rank= limits it to one rank: the other rank's host keeps its time
    two = replayer(_fixture("kv-gather-cast-eager"))
    one = two.predict([parse_edit("host-speed 2 rank=1")])
    both = two.predict([parse_edit("host-speed 2")])
    assert both.predicted_step_us < one.predicted_step_us <= one.replayed_step_us + 1.0
    assert parse_edit("host-speed 1.5").value == 1.5
    # with a removal, in either order: the removed op's host time goes at the edited host speed
    one_way = rp.predict([parse_edit("host-speed 2"), parse_edit("remove class=kv_cast")]).predicted_step_us
    other = rp.predict([parse_edit("remove class=kv_cast"), parse_edit("host-speed 2")]).predicted_step_us
    assert one_way == pytest.approx(other, rel=1e-6) and one_way < p.predicted_step_us


def test_host_speed_ratio_of_a_trace_with_itself_is_one() -> None:
    a = _fixture("kv-full-cast-eager")
    hs = host_speed_ratio(a, a)
    assert hs.decided and [r.rank for r in hs.ranks] == [0, 1]
    assert all(r.ratio == pytest.approx(1.0) and r.places >= 100 for r in hs.ranks)
    # a CUDA-graph step runs no CPU op inside its steps: the marker cannot be decided, and says why
    g = host_speed_ratio(_fixture("tp1-l6-full-eager"), _fixture("tp1-l6-full-graph"))
    assert not g.decided and "runs a CPU op" in g.ranks[0].reason


@pytest.mark.parametrize("name,host_bound", [
    ("tracelens__b200__eager_trace.json.gz", True),  # eager, the GPU waits for the host
    ("tracelens__h100__Qwen_Qwen1.5-0.5B-Chat__1016005.json.gz", False),
    ("param__dlrm_8rank", None),  # 8 ranks, several streams
])
def test_host_speed_on_real_traces(name: str, host_bound: bool | None) -> None:
    """Traces other systems wrote: the marker of a trace against itself is 1 on every rank, and a host twice
    as fast halves a host-bound step and hardly moves a GPU-bound one."""
    a = _analysis_all(str(real_trace(name)))
    hs = host_speed_ratio(a, a)
    assert hs.decided and len(hs.ranks) == a.n_ranks
    assert all(r.ratio == pytest.approx(1.0) and r.places >= 100 for r in hs.ranks)
    p = replayer(a).predict([parse_edit("host-speed 2")])
    share = p.predicted_step_us / p.replayed_step_us
    if host_bound is True:
        assert 0.45 < share < 0.6
    elif host_bound is False:
        assert share > 0.9
    else:
        assert share < 1.0


def _analysis_all(path: str) -> Analysis:
    return analysed(path, "all")


def drift_rows() -> list[tuple[str, str, float, float, float, float]]:
    """Every ordered pair of repeated captures of one set (no fix, only the host's drift): (first, second,
    marker ratio, its half quartile range over the ratio, raw error, host-controlled error) of the replay
    of the first predicting the second's step."""
    out = []
    for group in DRIFT_GROUPS.values():
        for x, y in itertools.permutations(group, 2):
            a, b = _analysis(x), _analysis(y)
            hs = host_speed_ratio(a, b)
            rp = replayer(a)
            meas = replayer(b).as_measured().measured_step_us
            pred = rp.predict([parse_edit(e) for e in hs.edits()]).predicted_step_us
            r = hs.ranks[0]
            out.append((Path(x).name, Path(y).name, float(r.ratio), float(r.spread or 0.0),
                        rp.as_measured().measured_step_us / meas - 1, pred / meas - 1))
    return out


@pytest.mark.parametrize("before,after,change", CROSS, ids=[f"{b}->{a}" for b, a, _ in CROSS])
def test_every_capture_against_every_capture(before: str, after: str, change: dict) -> None:
    """Not only the chosen pair: each of the 5 captures of the before set replayed with the fix predicts
    each of the 5 captures of the after set (25 pairs, host speeds 0.5-2x apart), host speeds controlled."""
    raw, ctl = [], []
    for x, y in itertools.product(DRIFT_GROUPS[before], DRIFT_GROUPS[after]):
        a, b = _analysis(x), _analysis(y)
        edits, _ = _fix(a, {"before": before, "after": after, **change}, after=b)
        rp = replayer(a)
        meas = replayer(b).as_measured().measured_step_us
        hs = host_speed_ratio(a, b)
        assert hs.decided
        raw.append(rp.predict(edits).predicted_step_us / meas - 1)
        ctl.append(rp.predict(edits + [parse_edit(e) for e in hs.edits()]).predicted_step_us / meas - 1)
    r, c = np.abs(raw), np.abs(ctl)
    print(f"\n{before} -> {after}, {len(r)} pairs: |error| median raw {np.median(r):.1%}, host-controlled "
          f"{np.median(c):.1%}; 90th percentile raw {np.percentile(r, 90):.1%}, host-controlled "
          f"{np.percentile(c, 90):.1%}; largest host-controlled {c.max():.1%}; within 10%: raw {np.mean(r <= TOL):.0%}, "
          f"host-controlled {np.mean(c <= TOL):.0%}")
    assert len(r) == 25
    assert np.median(c) < 0.07 and np.median(c) < np.median(r) / 2
    assert np.mean(c <= TOL) >= 0.75


def test_host_speed_marker_on_repeated_captures() -> None:
    """The marker's own error: repeated captures of one eager set (the same work, the host's speed alone
    differs; 4 sets, 5 captures each) predicted from one another. Controlling the host speed must cut the error well down."""
    rows = drift_rows()
    assert len(rows) == 80
    raw = np.abs([r[4] for r in rows])
    ctl = np.abs([r[5] for r in rows])
    print(f"\n{len(rows)} pairs of repeated captures: |error| median raw {np.median(raw):.1%}, host-controlled "
          f"{np.median(ctl):.1%}; 90th percentile raw {np.percentile(raw, 90):.1%}, host-controlled "
          f"{np.percentile(ctl, 90):.1%}; within 10%: raw {np.mean(raw <= TOL):.0%}, host-controlled "
          f"{np.mean(ctl <= TOL):.0%}")
    assert np.median(raw) > 0.15  # the drift is real
    assert np.median(ctl) < 0.05 and np.median(ctl) < np.median(raw) / 3
    assert np.percentile(ctl, 90) < TOL and np.mean(ctl <= TOL) > 0.85


if __name__ == "__main__":
    print(table())
