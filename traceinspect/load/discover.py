"""Find rank files, the server_info.json and CUDA-graph capture traces of a trace set."""

from __future__ import annotations

import glob
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceinspect.errors import TraceInputError

# {prefix-}{profile_id}-TP-{r}[-DP-{d}][-PP-{p}][-EP-{e}][-EXTEND|-DECODE].trace.json.gz
SGLANG_NAME = re.compile(
    r"^(?P<stem>.*?)-TP-(?P<tp>\d+)(?:-DP-(?P<dp>\d+))?(?:-PP-(?P<pp>\d+))?(?:-EP-(?P<ep>\d+))?"
    r"(?:-(?P<stage>EXTEND|DECODE|prefill|decode))?(?:\.pt)?\.trace\.json(?:\.gz)?$"
)
# SGLang's graph-capture traces: cuda_graph_capture-<Runner>-TP-<r>.json.gz or <Runner>_bs_<N>[_v]_rank<r>.json.gz
CAPTURE_NAME = re.compile(r"(?:-TP-(?P<tp>\d+)|_rank(?P<rank>\d+))(?:\.trace)?\.json(?:\.gz)?$")
CAPTURE_DIR = "graph_capture_profile"
TRACE_SUFFIXES = (".trace.json.gz", ".trace.json", ".json.gz", ".json")
NOT_TRACES = {"server_info.json", "model_info.json", "manifest.json", "server_args.json", "capture.json",
              "analysis.json", "execution_details.json"}
_SIDE_FILES = tuple(sorted(NOT_TRACES))  # also under a prefix (copies named <source>__server_info.json)


@dataclass
class RankFile:
    """A rank file and the identity its name gives."""

    path: Path
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None
    profile_id: str | None = None


@dataclass
class Discovery:
    """What was found at the given paths."""

    files: list[RankFile]
    server_info_path: Path | None
    capture_traces: dict[int, Path]
    notes: list[str]
    capture_json_path: Path | None = None  # what `traceinspect capture` recorded beside server_info.json


def parse_name(path: Path) -> RankFile:
    """Take the rank identity from an SGLang-style file name, where it has one."""
    m = SGLANG_NAME.match(path.name)
    if not m:
        return RankFile(path=path)

    def num(key: str) -> int | None:
        v = m.group(key)
        return int(v) if v is not None else None

    stage = m.group("stage")
    stem = m.group("stem")
    return RankFile(
        path=path, tp=num("tp"), dp=num("dp"), pp=num("pp"), ep=num("ep"),
        stage=stage.upper() if stage else None,
        profile_id=stem.rsplit("-", 1)[-1] if stem else None,
    )


def _is_trace_name(p: Path) -> bool:
    return not p.name.endswith(_SIDE_FILES) and p.name.endswith(TRACE_SUFFIXES)


def _capture_traces(directory: Path) -> dict[int, Path]:
    out: dict[int, Path] = {}
    cdir = directory / CAPTURE_DIR
    if not cdir.is_dir():
        return out
    for p in sorted(cdir.iterdir()):
        m = CAPTURE_NAME.search(p.name)
        if m and p.is_file():
            r = int(m.group("tp") if m.group("tp") is not None else m.group("rank"))
            out.setdefault(r, p)
    return out


def discover(paths: list[str | Path], phase: str = "decode") -> Discovery:
    """Expand directories, globs and file lists into rank files.

    Capture traces under ``graph_capture_profile/`` are never returned as ranks; a merged
    trace (``merged-*``) is skipped when per-rank files are present. In a directory holding files named
    ``*-TP-<r>*`` (SGLang's layout), those are the ranks (the others are named in a note); otherwise every
    trace file there is taken, and the loader refuses files that are not one run's ranks.
    """
    if not paths:
        raise TraceInputError("no trace path given")
    files: list[Path] = []
    dirs: list[Path] = []
    notes: list[str] = []
    for raw in paths:
        s = str(raw)
        if any(ch in s for ch in "*?[") and not Path(s).exists():
            hits = sorted(Path(h) for h in glob.glob(s, recursive=True))
            hits = [h for h in hits if h.is_file() and _is_trace_name(h) and CAPTURE_DIR not in h.parts]
            if not hits:
                raise TraceInputError("glob matched no trace files", s)
            files.extend(hits)
            continue
        p = Path(s)
        if not p.exists():
            raise TraceInputError("no such file or directory", p)
        if p.is_dir():
            dirs.append(p)
            found = sorted(c for c in p.iterdir() if c.is_file() and _is_trace_name(c))
            ranked = [c for c in found if SGLANG_NAME.match(c.name) or c.name.startswith("merged-")]
            if ranked and len(ranked) < len(found):  # SGLang's layout: the -TP-<r> files are the ranks
                others = [c.name for c in found if c not in ranked]
                notes.append(f"not loaded from {p}: {', '.join(others[:5])}{'…' if len(others) > 5 else ''} "
                             "(no -TP-<r> in the name, beside rank files that have one)")
                found = ranked
            if not found:
                raise TraceInputError("directory holds no trace files (*.trace.json.gz or *.json[.gz])", p)
            files.extend(found)
        else:
            files.append(p)

    # de-duplicate while keeping order
    seen: set[Path] = set()
    files = [f for f in files if not (f.resolve() in seen or seen.add(f.resolve()))]

    merged = [f for f in files if f.name.startswith("merged-")]
    if merged and len(merged) < len(files):
        notes.append(f"skipped merged trace(s) {', '.join(m.name for m in merged)}: per-rank files are present")
        files = [f for f in files if f not in merged]

    rank_files = [parse_name(f) for f in files]
    stages = {rf.stage for rf in rank_files if rf.stage}
    if len(stages) > 1:
        want = "EXTEND" if phase == "prefill" else "DECODE"
        notes.append(f"both EXTEND and DECODE captures present; using the {want} files for phase '{phase}'")
        rank_files = [rf for rf in rank_files if rf.stage in (want, None)]

    server_info = capture_json = None
    capture: dict[int, Path] = {}
    for d in dirs or sorted({f.parent for f in files}):
        si = d / "server_info.json"
        if server_info is None and si.is_file():
            server_info = si
        if capture_json is None and (d / "capture.json").is_file():
            capture_json = d / "capture.json"
        for r, cp in _capture_traces(d).items():
            capture.setdefault(r, cp)
    return Discovery(files=rank_files, server_info_path=server_info, capture_traces=capture, notes=notes,
                     capture_json_path=capture_json)


def read_server_info(path: Path) -> dict[str, Any]:
    """Read a server_info.json (what ``capture`` saves from ``/server_info``)."""
    try:
        data = json.loads(path.read_text(), parse_constant=lambda c: None)  # NaN/Infinity: unknown
    except FileNotFoundError:
        raise TraceInputError("no such file", path) from None
    except (OSError, ValueError, RecursionError) as e:  # ValueError: bad JSON, UTF-8 or a 5000-digit int
        raise TraceInputError(f"not a readable server_info JSON file: {e}", path) from None
    if not isinstance(data, dict):
        raise TraceInputError("server_info must be a JSON object", path)
    return data


def read_capture_json(path: Path, warnings: list[str]) -> dict[str, Any] | None:
    """The ``capture.json`` a capture wrote beside its traces; an unreadable one is a warning (it is evidence
    beside the traces, not needed to analyse them)."""
    try:
        data = json.loads(path.read_text(), parse_constant=lambda c: None)
    except (OSError, ValueError, RecursionError) as e:
        warnings.append(f"{path}: not a readable capture.json, ignored ({type(e).__name__}: {str(e)[:120]})")
        return None
    if not isinstance(data, dict):
        warnings.append(f"{path}: capture.json is not a JSON object, ignored")
        return None
    return data
