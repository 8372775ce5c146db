"""Checks that the rank files of a loaded trace set belong together: files that are not one run's ranks
(:func:`mismatch_reasons`: different GPUs, workloads or captures) stop the load unless asked otherwise; the
rest are warnings that say what was done.

Traces come from other teams, other versions and half-finished runs: a rank may be missing, a file may
come from another capture, ranks may have recorded different numbers of steps, and hosts' clocks may
differ by seconds. Beyond files that are plainly not one run's, none of these stops an analysis; each is
reported with what the analysis did about it.
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from traceinspect.model.run import ServerInfo

if TYPE_CHECKING:
    from traceinspect.load.columns import ParsedRank
    from traceinspect.model import TraceSet

_DIGITS = re.compile(r"\d+")


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


# ----------------------------------------------------------------------------- files that are not one run


@lru_cache(maxsize=1)
def _set_rules() -> tuple[float, float, re.Pattern[str]]:
    from traceinspect.resources import settings_document

    doc = settings_document("traceset.yaml")
    return (float(doc["max_start_apart_s"]), float(doc["min_kernel_name_overlap"]),
            re.compile(doc["training_ops"]))


def training_ops() -> re.Pattern[str]:
    """The op names that make a trace a training run (``training_ops`` in rules/tables/traceset.yaml)."""
    return _set_rules()[2]


class _FileFacts(msgspec.Struct):
    name: str
    gpus: frozenset[str]
    start_us: float | None
    training: bool
    kernels: frozenset[str]


def _facts(path: Path, p: ParsedRank) -> _FileFacts:
    import pandas as pd

    gpus = frozenset(d.name for d in p.devices if d.name and d.name.strip() and d.name != "unknown")
    import numpy as np

    # the recording's middle (median event time), not its first event: a few events far from the rest
    # (a clock glitch) do not move it
    ts = np.concatenate([t["ts"].to_numpy(dtype=np.float64) for t in (p.kernels, p.runtime) if len(t)] or [[]])
    ts = ts[np.isfinite(ts)]
    pat = training_ops()
    training = False
    for t in (p.cpu_ops, p.annotations):
        if len(t) and any(pat.search(str(n)) for n in pd.unique(t["name"].to_numpy(dtype=object))):
            training = True
            break
    k = p.kernels
    names = pd.unique(k.loc[(k["kind"] == "kernel").to_numpy(), "name"].to_numpy(dtype=object)) if len(k) else []
    return _FileFacts(path.name, gpus, float(np.median(ts)) if len(ts) else None, training,
                      frozenset(_DIGITS.sub("#", str(n)) for n in names))


def _groups(facts: list[_FileFacts], key: Callable[[_FileFacts], Any]) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = defaultdict(list)
    for f in facts:
        out[key(f)].append(f.name)
    return out


def _listed(groups: dict[Any, list[str]], say: Callable[[Any], str]) -> str:
    return "; ".join(f"{_files(v)}: {say(k)}" for k, v in groups.items())


def _files(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def mismatch_reasons(paths: list[Path], parsed: list[ParsedRank]) -> list[str]:
    """Why the given rank files are not the ranks of one run, or [] (one file, or files that agree): files
    on different GPUs (deviceProperties), training files beside inference ones, recordings that start
    (median event times) further apart than ``max_start_apart_s`` (different captures), and kernel mixes that hardly overlap
    (different workloads); ``rules/tables/traceset.yaml`` holds the thresholds."""
    if len(parsed) < 2:
        return []
    apart_s, min_overlap, _ = _set_rules()
    facts = [_facts(path, p) for path, p in zip(paths, parsed, strict=True)]
    out: list[str] = []
    named = [f for f in facts if f.gpus]
    gpus = _groups(named, lambda f: f.gpus)
    if len(gpus) > 1 and not set.intersection(*(set(g) for g in gpus)):
        out.append("different GPUs (" + _listed(gpus, lambda g: ", ".join(sorted(g))) + ")")
    kinds = _groups(facts, lambda f: f.training)
    if len(kinds) > 1:
        out.append("a training run beside an inference one (" + _listed(
            kinds, lambda t: "backward / optimizer ops" if t else "no backward ops") + ")")
    timed = sorted((f for f in facts if f.start_us is not None), key=lambda f: f.start_us or 0.0)
    if len(timed) > 1:
        first, last = timed[0], timed[-1]
        gap_s = ((last.start_us or 0.0) - (first.start_us or 0.0)) / 1e6
        if gap_s > apart_s:
            out.append(f"recordings {gap_s:.3g} s apart (median event times; {first.name} first, {last.name} "
                       f"last; the ranks of one capture lie within {apart_s:g} s): different captures")
    ref = max(facts, key=lambda f: len(f.kernels))
    low = []
    for f in facts:
        if f is ref or not f.kernels or not ref.kernels:
            continue
        share = len(f.kernels & ref.kernels) / min(len(f.kernels), len(ref.kernels))
        if share < min_overlap:
            low.append(f"{f.name} {share:.0%}")
    if low:
        out.append(f"different workloads (kernel names shared with {ref.name}: {', '.join(low[:3])}"
                   f"{'…' if len(low) > 3 else ''}; ranks of one run share most)")
    return out
