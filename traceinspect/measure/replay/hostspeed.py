"""How fast one trace's host ran against another's, from CPU work both did alike.

The marker: CPU ops that launch nothing (no runtime call inside any instance, no GPU work attributed
to them: ``aten::slice``, ``aten::view``, ``aten::empty``...) and that both traces run equally often per
step. Their host time depends on the host's speed alone, not on what the GPU does, so the ratio of their
time in two traces is the ratio of the two hosts' speeds. Per op name: the median over the analysed
steps of its time per step (each rank apart); per rank: the time-weighted median of the names' ratios,
with the weighted quartiles as the spread. Medians over steps, not over single calls, because a host
that switches speed within a capture makes single calls bimodal while the step median is one step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from traceinspect.analysis import Analysis

MIN_OPS = 3  # fewer marker op names than this: undecided


@dataclass
class RankSpeed:
    """Rank ``rank``: ``ratio`` = the first trace's marker time over the second's (above 1: the first
    host ran slower), ``q25``/``q75`` the weighted quartiles of the names' ratios."""

    rank: int
    ratio: float | None
    q25: float | None = None
    q75: float | None = None
    names: int = 0
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
                "spread": r(self.spread), "names": self.names,
                "marker_us_per_step": round(self.marker_us_per_step, 1), "reason": self.reason or None}


@dataclass
class HostSpeed:
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
    """Per rank and CPU-only op name: calls per step and median host time per step over the analysed
    steps (``rank, name, calls, us``), and whether every call launched nothing (``cpu_only``)."""
    ts, sel = a.trace, a.selected
    ops, rt = ts.cpu_ops, ts.runtime
    cols = ["rank", "name", "calls", "us", "cpu_only"]
    if sel is None or not len(sel) or ops is None or not len(ops):
        return pd.DataFrame(columns=cols)
    launched = np.zeros(len(ops), dtype=bool)
    k = a.kernels
    if "op_idx" in k.columns:
        oi = k["op_idx"].to_numpy()
        oi = oi[(oi >= 0) & (oi < len(ops))].astype(np.int64)
        launched[oi] = True
    out: list[pd.DataFrame] = []
    o_rank, o_tid = ops["rank"].to_numpy(), ops["tid"].to_numpy()
    o_ts, o_end = ops["ts"].to_numpy(dtype=np.float64), ops["end"].to_numpy(dtype=np.float64)
    names = ops["name"].to_numpy(dtype=object)
    for r, g in sel.groupby("rank"):
        lo = g["cpu_start"].to_numpy(dtype=np.float64)
        hi = g["cpu_end"].to_numpy(dtype=np.float64)
        ok = np.isfinite(lo) & np.isfinite(hi)
        lo, hi = lo[ok], hi[ok]
        if not len(lo):
            continue
        order = np.argsort(lo)
        lo, hi = lo[order], hi[order]
        idx = np.nonzero(o_rank == r)[0]
        w = np.searchsorted(lo, o_ts[idx], side="right") - 1
        inside = (w >= 0) & (o_ts[idx] < hi[np.maximum(w, 0)])
        idx, w = idx[inside], w[inside]
        if not len(idx):
            continue
        has_rt = launched[idx].copy()
        if rt is not None and len(rt):
            rr = rt[rt["rank"].to_numpy() == r]
            for tid in np.unique(o_tid[idx]):
                m = o_tid[idx] == tid
                rts = np.sort(rr["ts"].to_numpy(dtype=np.float64)[rr["tid"].to_numpy() == tid])
                n_in = np.searchsorted(rts, o_end[idx[m]], side="left") - np.searchsorted(rts, o_ts[idx[m]], side="left")
                has_rt[m] |= n_in > 0
        df = pd.DataFrame({"name": names[idx], "step": w, "dur": ops["dur"].to_numpy(dtype=np.float64)[idx],
                           "launches": has_rt})
        per = df.groupby(["name", "step"], sort=False).agg(us=("dur", "sum"), calls=("dur", "size"))
        full = per.unstack("step", fill_value=0)  # steps where a name is absent count 0
        t = pd.DataFrame({"rank": int(r), "name": full.index,
                          "calls": np.median(full["calls"].reindex(columns=range(len(lo)), fill_value=0), axis=1),
                          "us": np.median(full["us"].reindex(columns=range(len(lo)), fill_value=0.0), axis=1),
                          "cpu_only": ~df.groupby("name", sort=False)["launches"].any().reindex(full.index).to_numpy()})
        out.append(t)
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=cols)


def host_speed_ratio(first: Analysis, second: Analysis) -> HostSpeed:
    """Per rank present in both: ``first``'s host time over ``second``'s on the marker ops (see the
    module docstring). ``host-speed RATIO rank=R`` on ``first`` gives it ``second``'s host speed."""
    a, b = marker_table(first), marker_table(second)
    out = HostSpeed()
    for r in sorted(set(a["rank"]) | set(b["rank"])):
        ta, tb = a[a["rank"] == r].set_index("name"), b[b["rank"] == r].set_index("name")
        if not len(ta) or not len(tb):
            out.ranks.append(RankSpeed(int(r), None, reason=f"rank {r} is not in both traces"))
            continue
        j = ta.merge(tb, left_index=True, right_index=True, how="inner", suffixes=("_a", "_b"))
        j = j[j["cpu_only_a"] & j["cpu_only_b"] & (j["calls_a"] == j["calls_b"]) & (j["calls_a"] > 0)
              & (j["us_a"] > 0) & (j["us_b"] > 0)]
        if len(j) < MIN_OPS:
            none = next((w for w, t in (("first", ta), ("second", tb)) if not t["cpu_only"].any()), None)
            out.ranks.append(RankSpeed(int(r), None, names=len(j), reason=(
                f"the {none} trace runs no CPU-only op inside its steps on rank {r} (a CUDA-graph replay runs none)"
                if none else f"only {len(j)} CPU-only op names run equally often in both traces on rank {r} "
                f"(at least {MIN_OPS} needed)")))
            continue
        ratio = (j["us_a"] / j["us_b"]).to_numpy(dtype=np.float64)
        wt = ((j["us_a"] + j["us_b"]) / 2.0).to_numpy(dtype=np.float64)
        out.ranks.append(RankSpeed(int(r), _weighted_quantile(ratio, wt, 0.5), _weighted_quantile(ratio, wt, 0.25),
                                   _weighted_quantile(ratio, wt, 0.75), names=len(j),
                                   marker_us_per_step=float(j["us_b"].sum())))
    return out
