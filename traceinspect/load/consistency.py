"""Checks that the rank files of a loaded trace set belong together, as warnings that say what was done.

Traces come from other teams, other versions and half-finished runs: a rank may be missing, a file may
come from another capture, ranks may have recorded different numbers of steps, and hosts' clocks may
differ by seconds. None of these stops an analysis; each is reported with what the analysis did about it.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Any

from traceinspect.model.run import ServerInfo

if TYPE_CHECKING:
    from traceinspect.model import TraceSet


def _count(v: Any) -> int | None:
    """A positive count as a trace writes it (not a bool, not absurd), else None."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 31 else None


def _names(labels: list[str]) -> str:
    return ", ".join(labels)


def _spans(ts: TraceSet) -> dict[int, tuple[float, float]]:
    """Per rank: first start and last end of its GPU activity and runtime calls (us, its own clock)."""
    out: dict[int, tuple[float, float]] = {}
    for table in (ts.kernels, ts.runtime):
        if not len(table):
            continue
        g = table.groupby("rank", sort=False).agg(lo=("ts", "min"), hi=("end", "max"))
        for r, lo, hi in zip(g.index, g["lo"], g["hi"], strict=True):
            a, b = out.get(int(r), (math.inf, -math.inf))
            out[int(r)] = (min(a, float(lo)), max(b, float(hi)))
    return {r: s for r, s in out.items() if math.isfinite(s[0]) and math.isfinite(s[1])}


def rank_set_warnings(ts: TraceSet) -> list[str]:
    """Warnings about the rank files of a loaded trace set: captures that differ, ranks missing
    (server_info's sizes, gaps in the TP numbers, distributedInfo), two files of one distributed rank,
    and ranks whose time ranges do not overlap."""
    out: list[str] = []
    infos = ts.ranks
    label = {i.rank: i.label for i in infos}

    pids = {i.profile_id for i in infos if i.profile_id}
    if len(pids) > 1:
        out.append(f"rank files come from different captures (profile ids {sorted(pids)}); "
                   "analysed together as given")

    missing_said = False
    si = ServerInfo(ts.server_info)
    tp, dp, pp = si.count("tp_size"), si.size("dp_size"), si.size("pp_size")
    if tp is not None and tp * dp * pp != len(infos) and not (si.get("dp_size") and si.get("enable_dp_attention")):
        out.append(f"server_info says tp_size={tp}" + (f", dp_size={dp}" if dp > 1 else "")
                   + (f", pp_size={pp}" if pp > 1 else "")
                   + f" but {len(infos)} rank file(s) were found: ranks are missing; the ranks present are analysed")
        missing_said = True

    # gaps in the TP numbers of file names (TP-0, TP-2: TP1 is missing), per DP/PP group
    groups: dict[tuple[int, int], set[int]] = defaultdict(set)
    for i in infos:
        if i.rank_source == "filename" and i.tp is not None:
            groups[(i.dp or 0, i.pp or 0)].add(i.tp)
    for (d, p), tps in sorted(groups.items()):
        gap = sorted(set(range(max(tps) + 1)) - tps)
        if gap:
            where = (f" of DP{d}" if d else "") + (f" PP{p}" if p else "")
            out.append(f"no file for {_names([f'TP{t}' for t in gap[:8]])}{'…' if len(gap) > 8 else ''}{where} "
                       f"(files for {_names([f'TP{t}' for t in sorted(tps)])}): that rank is missing; "
                       "the ranks present are analysed")
            missing_said = True

    # distributedInfo: world sizes, ranks absent, and one distributed rank in two files
    dist = [(i, i.distributed_info.get("rank"), i.distributed_info.get("world_size")) for i in infos]
    worlds = {w for _, _, w in dist if _count(w)}
    if len(worlds) > 1:
        out.append(f"rank files disagree on distributedInfo.world_size ({sorted(worlds)}): they may come from "
                   "different runs; analysed together as given")
    seen = Counter(r for _, r, _ in dist if isinstance(r, int) and not isinstance(r, bool))
    dup = sorted(r for r, n in seen.items() if n > 1)
    if dup and infos and infos[0].rank_source != "distributedInfo":
        files = [i.label for i, r, _ in dist if r in dup]
        out.append(f"{_names(files)} all say distributedInfo.rank={dup[0]}: one of them may be a file from "
                   "another run (or a copy); analysed as the ranks their file names give")
    if len(worlds) == 1 and not missing_said and all(isinstance(r, int) for _, r, _ in dist):
        w = next(iter(worlds))
        absent = sorted(set(range(w)) - set(seen))
        if absent and len(seen) < w:
            out.append(f"distributedInfo says world_size={w} but no file holds rank(s) "
                       f"{_names([str(r) for r in absent[:8]])}{'…' if len(absent) > 8 else ''}: "
                       "those ranks are missing (or were not profiled); the ranks present are analysed")

    # time ranges that do not overlap: another run, or hosts whose clocks differ
    spans = _spans(ts) if len(infos) > 1 else {}  # (one rank: nothing to compare)
    if len(spans) > 1:
        ranks = sorted(spans)
        ref = ranks[0]
        for r in ranks[1:]:
            (a0, a1), (b0, b1) = spans[ref], spans[r]
            gap = max(b0 - a1, a0 - b1)
            if gap > 0:
                after = b0 > a1
                out.append(f"the time ranges of {label.get(ref, ref)} and {label.get(r, r)} do not overlap "
                           f"({label.get(r, r)} {'starts' if after else 'ends'} {gap / 1e6:.3g} s "
                           f"{'after' if after else 'before'} {label.get(ref, ref)} "
                           f"{'ends' if after else 'starts'}): the files may come from different runs, or from "
                           "hosts whose clocks differ (cross-rank times are corrected only where collectives "
                           "give a clock offset)")
    return out
