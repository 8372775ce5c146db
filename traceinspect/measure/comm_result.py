"""The result of the collectives analysis (:mod:`traceinspect.measure.collectives`): its tables, clock
offsets, straggler and critical path, and their JSON sections (defined in ``docs/collectives.md``)."""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.measure.comm_settings import (
    INSTANCE_COLUMNS,
    INSTANCES_JSON_MAX,
    PER_RANK_COLUMNS,
    PER_STEP_COLUMNS,
)
from traceinspect.units import json_num


class Collectives(msgspec.Struct):
    """The tensor-parallel view of an analysis (see the module docstring and docs/collectives.md)."""

    n_ranks: int
    reason: str | None = None  # why there is no collective analysis (None when there is one)
    groups: list[list[int]] = msgspec.field(default_factory=list)
    instances: pd.DataFrame = msgspec.field(default_factory=lambda: pd.DataFrame(columns=INSTANCE_COLUMNS))
    per_rank: pd.DataFrame = msgspec.field(default_factory=lambda: pd.DataFrame(columns=PER_RANK_COLUMNS))
    per_step: pd.DataFrame = msgspec.field(default_factory=lambda: pd.DataFrame(columns=PER_STEP_COLUMNS))
    offsets: dict[int, float] = msgspec.field(default_factory=dict)  # estimated clock offset per rank (us)
    offsets_applied: dict[int, float] = msgspec.field(default_factory=dict)  # the offset subtracted (0 if not)
    offset_noise: dict[int, float] = msgspec.field(default_factory=dict)
    reference_rank: dict[int, int] = msgspec.field(default_factory=dict)  # rank -> its group's reference rank
    straggler: dict[str, Any] = msgspec.field(default_factory=dict)
    critical_path: dict[str, Any] = msgspec.field(default_factory=dict)
    steps_aligned: int = 0
    notes: list[str] = msgspec.field(default_factory=list)

    @property
    def applicable(self) -> bool:
        return self.reason is None

    @property
    def straggler_rank(self) -> int | None:
        return self.straggler.get("rank")

    def rank_row(self, rank: int) -> dict[str, Any] | None:
        """The ``per_rank`` row of one rank as a dict, or None."""
        hit = self.per_rank[self.per_rank["rank"] == rank]
        return hit.iloc[0].to_dict() if len(hit) else None

    def by_kind(self) -> pd.DataFrame:
        """Per collective kind: instances per step, median transfer, median bytes and bus bandwidth."""
        inst = self.instances
        if not len(inst):
            return pd.DataFrame(columns=["kind", "instances", "instances_per_step", "transfer_us_median",
                                         "wait_us_mean", "bytes_median", "busbw_gbps_median"])
        one = inst.drop_duplicates("instance")
        g = one.groupby("kind")
        out = pd.DataFrame({
            "instances": g.size(),
            "transfer_us_median": g["transfer_us"].median(),
            "bytes_median": g["bytes"].median(),
            "busbw_gbps_median": g["busbw_gbps"].median(),
        })
        out["wait_us_mean"] = inst.groupby("kind")["wait_us"].mean()
        out["instances_per_step"] = out["instances"] / max(self.steps_aligned, 1)
        return out.reset_index()

    def to_json(self) -> dict[str, Any]:
        """``{"collectives": {...}, "critical_path": {...}}`` as documented in docs/collectives.md."""
        coll: dict[str, Any] = {
            "applicable": self.applicable,
            "reason": self.reason,
            "ranks": self.n_ranks,
            "groups": self.groups,
            "steps_aligned": self.steps_aligned,
            "notes": list(self.notes),
        }
        if self.applicable:
            coll["clock"] = {
                "method": "median over matched collectives of (end on rank - end on the group's reference rank)",
                "reference_rank": {str(r): int(v) for r, v in sorted(self.reference_rank.items())},
                "offsets_us": {str(r): json_num(v) for r, v in sorted(self.offsets.items())},
                "noise_us": {str(r): json_num(v) for r, v in sorted(self.offset_noise.items())},
                "applied_us": {str(r): json_num(v) for r, v in sorted(self.offsets_applied.items())},
            }
            coll["per_rank"] = [{k: json_num(v) for k, v in row.items()} for row in self.per_rank.to_dict("records")]
            coll["by_kind"] = [{k: json_num(v) for k, v in row.items()} for row in self.by_kind().to_dict("records")]
            coll["per_step"] = [{k: json_num(v) for k, v in row.items()} for row in self.per_step.to_dict("records")]
            coll["instances"] = _instances_json(self.instances)
            coll["instances_truncated"] = bool(self.instances["instance"].nunique() > INSTANCES_JSON_MAX)
            coll["straggler"] = {k: json_num(v) if not isinstance(v, (dict, list)) else v
                                 for k, v in self.straggler.items()}
        return {"collectives": coll, "critical_path": self.critical_path}


def _instances_json(inst: pd.DataFrame) -> list[dict[str, Any]]:
    """One entry per collective instance (not per rank): the cross-rank summary, the first
    INSTANCES_JSON_MAX instances by id."""
    if not len(inst):
        return []
    inst = inst.sort_values("instance", kind="stable")  # rows of an instance keep their order
    ids = inst["instance"].to_numpy()
    starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
    bounds = np.r_[starts, len(ids)][: INSTANCES_JSON_MAX + 1]
    col = {c: inst[c].to_numpy().tolist() for c in ("instance", "pos", "seq", "kind", "name", "group",
                                                     "transfer_us", "bytes", "busbw_gbps", "last_arrival",
                                                     "rank", "start", "wait_us")}
    out = []
    for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist(), strict=True):
        last = next((col["rank"][i] for i in range(a, b) if col["last_arrival"][i]), None)
        start = col["start"][a:b]
        out.append({
            "instance": int(col["instance"][a]), "pos": int(col["pos"][a]), "seq": int(col["seq"][a]),
            "kind": col["kind"][a], "name": col["name"][a], "group": int(col["group"][a]),
            "transfer_us": json_num(col["transfer_us"][a]), "bytes": json_num(col["bytes"][a]),
            "busbw_gbps": json_num(col["busbw_gbps"][a]),
            "last_rank": int(last) if last is not None else None,
            "arrival_skew_us": json_num(float(max(start) - min(start))),
            "wait_us": {str(int(r)): json_num(w) for r, w in zip(col["rank"][a:b], col["wait_us"][a:b], strict=True)},
        })
    return out


# ----------------------------------------------------------------------------- main entry
