"""How fast one trace's host ran against another's, from host work both did alike.

The marker: the CPU ops both traces run at the same place of a step (the k-th top-level call of an op
name in the step, on the rank's launching thread), each op's own host time: its duration minus the
runtime calls inside it (a launch can wait for the GPU, and the GPU is what a fix changes). Ops around a
blocking call (``blocking_calls`` in ``rules/tables/replay.yaml``) are left out: they wait for the GPU.
What a fix does to the host lies in a few places (a busy wait between ops, an op more or less) or in no
op at all (GPU work), so the median over all places reads the host's speed. Per place: the median over
the analysed steps (a host that switches speed within a capture makes single calls bimodal); per rank:
the time-weighted median of the places' ratios, the weighted quartiles as its spread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

MIN_PLACES = 10  # fewer places than this: undecided


@dataclass
class RankSpeed:
    """Rank ``rank``: ``ratio`` = the first trace's marker time over the second's (above 1: the first
    host ran slower), ``q25``/``q75`` the weighted quartiles of the places' ratios."""

    rank: int
    ratio: float | None
    q25: float | None = None
    q75: float | None = None
    places: int = 0  # places (op name, k-th call in the step) compared
    marker_us_per_step: float = 0.0  # the second trace's marker time per step
    reason: str = ""

    @property
    def spread(self) -> float | None:
        """Half the quartile range over the ratio (a relative +-)."""
        if self.ratio is None or self.q25 is None or self.q75 is None:
            return None
        return (self.q75 - self.q25) / 2.0 / self.ratio

    def to_json(self) -> dict[str, Any]:
        def r(x: float | None) -> float | None:
            return None if x is None else round(float(x), 4)

        return {"rank": self.rank, "ratio": r(self.ratio), "q25": r(self.q25), "q75": r(self.q75),
                "spread": r(self.spread), "places": self.places,
                "marker_us_per_step": round(self.marker_us_per_step, 1), "reason": self.reason or None}


@dataclass
class HostSpeed:
    """The host-speed ratio of two traces, rank by rank."""

    ranks: list[RankSpeed] = field(default_factory=list)

    @property
    def decided(self) -> bool:
        return bool(self.ranks) and all(r.ratio is not None for r in self.ranks)

    def edits(self) -> list[str]:
        """``host-speed`` edits that give the first trace the second's host speed, per rank."""
        return [f"host-speed {r.ratio:.4f} rank={r.rank}" for r in self.ranks if r.ratio is not None]

    def to_json(self) -> dict[str, Any]:
        return {"decided": self.decided, "ranks": [r.to_json() for r in self.ranks]}


def _weighted_quantile(v: np.ndarray, w: np.ndarray, q: float) -> float:
    o = np.argsort(v, kind="stable")
    cw = np.cumsum(w[o])
    return float(v[o][min(int(np.searchsorted(cw, q * cw[-1], side="left")), len(v) - 1)])


def marker_table(a: Analysis) -> pd.DataFrame:
    """Per rank and place (``name``, ``k``: the k-th top-level call of that op name in a step, on the
    rank's launching thread): the median over the analysed steps of the op's own host time (``us``:
    duration minus the runtime calls inside it); ops around a blocking call are left out."""
    from traceinspect.measure.replay_settings import load_settings
    from traceinspect.tables import per_distinct

    ts, sel = a.trace, a.selected
    ops, rt = ts.cpu_ops, ts.runtime
    cols = ["rank", "name", "k", "us"]
    if sel is None or not len(sel) or ops is None or not len(ops):
        return pd.DataFrame(columns=cols)
    blocking = load_settings().blocking
    out: list[pd.DataFrame] = []
    top = ops[ops["parent"].to_numpy() < 0] if "parent" in ops.columns else ops
    for r, g in sel.groupby("rank"):
        lo = g["cpu_start"].to_numpy(dtype=np.float64)
        hi = g["cpu_end"].to_numpy(dtype=np.float64)
        ok = np.isfinite(lo) & np.isfinite(hi)
        lo, hi = np.sort(lo[ok]), np.sort(hi[ok])
        o = top[top["rank"].to_numpy() == r]
        if not len(lo) or not len(o):
            continue
        tid = o["tid"].value_counts().index[0]  # the launching thread: the one running most ops
        o = o[o["tid"].to_numpy() == tid]
        o_ts = o["ts"].to_numpy(dtype=np.float64)
        o_end = o_ts + o["dur"].to_numpy(dtype=np.float64)
        w = np.searchsorted(lo, o_ts, side="right") - 1
        inside = (w >= 0) & (o_ts < hi[np.maximum(w, 0)])
        own = o["dur"].to_numpy(dtype=np.float64).copy()
        blocked = np.zeros(len(o), dtype=bool)
        if rt is not None and len(rt):
            rr = rt[(rt["rank"].to_numpy() == r) & (rt["tid"].to_numpy() == tid)].sort_values("ts")
            r_ts = rr["ts"].to_numpy(dtype=np.float64)
            cum = np.r_[0.0, np.cumsum(rr["dur"].to_numpy(dtype=np.float64))]
            i0 = np.searchsorted(r_ts, o_ts, side="left")
            i1 = np.searchsorted(r_ts, o_end, side="left")
            own -= cum[i1] - cum[i0]
            b_ts = r_ts[per_distinct(rr["name"], lambda x: bool(blocking.search(str(x))))] if len(rr) else r_ts
            blocked = np.searchsorted(b_ts, o_end, side="left") > np.searchsorted(b_ts, o_ts, side="left")
        keep = inside & ~blocked
        df = pd.DataFrame({"name": o["name"].to_numpy(dtype=object)[keep], "step": w[keep], "us": own[keep]})
        if not len(df):
            continue
        df["k"] = df.groupby(["step", "name"], sort=False).cumcount()
        per = df.groupby(["name", "k"], sort=False)["us"].median().reset_index()
        per.insert(0, "rank", int(r))
        out.append(per)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def host_speed_ratio(first: Analysis, second: Analysis) -> HostSpeed:
    """Per rank present in both: ``first``'s host time over ``second``'s on the marker (see the module
    docstring). ``host-speed RATIO rank=R`` on ``first`` gives it ``second``'s host speed."""
    a, b = marker_table(first), marker_table(second)
    out = HostSpeed()
    ranks = set(a["rank"]) | set(b["rank"]) | {int(x) for x in first.selected["rank"]} | \
        {int(x) for x in second.selected["rank"]}
    for r in sorted(ranks):
        ta, tb = a[a["rank"] == r], b[b["rank"] == r]
        if not len(ta) or not len(tb):
            which = "neither trace runs" if not len(ta) and not len(tb) else \
                f"the {'first' if not len(ta) else 'second'} trace runs"
            out.ranks.append(RankSpeed(int(r), None, reason=(
                f"{which} a CPU op inside its steps on rank {r} (a CUDA-graph replay runs none)")))
            continue
        j = ta.merge(tb, on=["name", "k"], how="inner", suffixes=("_a", "_b"))
        j = j[(j["us_a"] > 0) & (j["us_b"] > 0)]
        if len(j) < MIN_PLACES:
            out.ranks.append(RankSpeed(int(r), None, places=len(j), reason=(
                f"only {len(j)} CPU ops run at the same place of a step in both traces on rank {r} "
                f"(at least {MIN_PLACES} needed)")))
            continue
        ratio = (j["us_a"] / j["us_b"]).to_numpy(dtype=np.float64)
        wt = ((j["us_a"] + j["us_b"]) / 2.0).to_numpy(dtype=np.float64)
        out.ranks.append(RankSpeed(int(r), _weighted_quantile(ratio, wt, 0.5), _weighted_quantile(ratio, wt, 0.25),
                                   _weighted_quantile(ratio, wt, 0.75), places=len(j),
                                   marker_us_per_step=float(j["us_b"].sum())))
    return out
