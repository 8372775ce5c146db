"""Inputs of diff and gate: an analysis JSON document (``traceinspect.analysis/1``), loaded from a
stored JSON file or computed from a trace set, and the few accessors the comparisons need."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from traceinspect.document.read import is_analysis_file, load_json_document, validate_document
from traceinspect.errors import TraceInputError

__all__ = ["load_document", "load_json_document", "validate_document"]

if TYPE_CHECKING:
    from traceinspect.analysis import Options


def load_document(path: str | Path | list[str | Path], options: Options | None = None) -> dict[str, Any]:
    """The analysis document of an input: a stored analysis JSON file is read as it is; a trace set
    (directory, rank files or globs) is analysed with ``options``. Unusable input raises
    TraceInputError."""
    paths = [path] if isinstance(path, (str, Path)) else list(path)
    if not paths:
        raise TraceInputError("no input given")
    if len(paths) == 1:
        p = Path(paths[0])
        if p.is_file() and is_analysis_file(p):
            doc = load_json_document(p)
            doc.setdefault("_source_label", str(p))
            return doc
        if not p.exists() and not any(ch in str(p) for ch in "*?["):
            raise TraceInputError("no such file or directory", p)
    from traceinspect.analysis import Options, analyze

    doc = analyze([str(x) for x in paths], options or Options()).to_json()
    doc = validate_document(doc, ", ".join(str(x) for x in paths))
    doc["_source_label"] = ", ".join(str(x) for x in paths)
    return doc


def label(doc: dict[str, Any]) -> str:
    """A short name for a document: where it came from."""
    lab = doc.get("_source_label")
    if lab:
        return str(lab)
    paths = (doc.get("source") or {}).get("paths") or []
    return ", ".join(map(str, paths)) or "(analysis JSON)"


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


def num(x: Any) -> float | None:
    """A finite number or None."""
    return float(x) if _is_number(x) else None


def step_value(doc: dict[str, Any]) -> float | None:
    """The median step time in us."""
    return num((doc.get("steps") or {}).get("median_us"))


def step_samples(doc: dict[str, Any]) -> list[float] | None:
    """Per-step TP step times (us), or None when the document has no samples."""
    samples = (doc.get("steps") or {}).get("samples")
    if not isinstance(samples, list) or not samples:
        return None
    vals = [num(s.get("step_us")) for s in samples if isinstance(s, dict)]
    return [v for v in vals if v is not None] or None


def class_values(doc: dict[str, Any]) -> dict[str, float] | None:
    """us per step of every class, or None when the document has no class section."""
    classes = doc.get("classes")
    if not isinstance(classes, dict):
        return None
    out = {}
    for name, row in classes.items():
        v = num(row.get("us_per_step")) if isinstance(row, dict) else None
        if v is not None:
            out[str(name)] = v
    return out


# classes whose time on one rank depends on the other ranks (a collective waits for the last to arrive):
# their per-rank samples are not independent draws, so they are never pooled across ranks
NOT_POOLED = frozenset({"comm"})


def rank_class_samples(doc: dict[str, Any], cls: str) -> list[float] | None:
    """Per-rank per-step us of one class (0 where it did not run), pooled over the ranks, or None when
    the document has no per-rank samples or the class is one that cannot be pooled."""
    if cls in NOT_POOLED:
        return None
    samples = (doc.get("steps") or {}).get("rank_samples")
    if not isinstance(samples, list) or not samples:
        return None
    out = []
    for s in samples:
        per = s.get("classes") if isinstance(s, dict) else None
        if not isinstance(per, dict):
            return None
        v = num(per.get(cls, 0.0))
        out.append(v if v is not None else 0.0)
    return out or None


def server_config(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The server configuration recorded in a document (None when it has none)."""
    sc = doc.get("server_config")
    return sc if isinstance(sc, dict) and sc else None


def comm_split(doc: dict[str, Any]) -> dict[str, Any] | None:
    """Collective time per step split into waiting and transfer (mean over ranks), and the wait each
    rank causes on the others by arriving late, from the ``collectives`` section."""
    coll = doc.get("collectives")
    if not isinstance(coll, dict) or coll.get("applicable") is False:
        return None
    per = [r for r in coll.get("per_rank") or [] if isinstance(r, dict)]
    waits = [num(r.get("wait_us_per_step")) for r in per]
    xfers = [num(r.get("transfer_us_per_step")) for r in per]
    if not per or any(v is None for v in waits + xfers):
        return None
    labels = {r.get("rank"): r.get("label") for r in doc.get("ranks") or [] if isinstance(r, dict)}
    caused = {int(r["rank"]): num(r.get("wait_caused_us_per_step")) or 0.0 for r in per
              if isinstance(r.get("rank"), int)}
    st = coll.get("straggler") if isinstance(coll.get("straggler"), dict) else {}
    return {"wait_us": sum(waits) / len(waits), "transfer_us": sum(xfers) / len(xfers),  # type: ignore[arg-type]
            "caused_us": caused, "labels": {k: str(v) for k, v in labels.items()},
            "straggler": st.get("rank") if isinstance(st.get("rank"), int) else None}


def class_samples(doc: dict[str, Any], cls: str) -> list[float] | None:
    """Per-step us of one class (0 in steps where it did not run), or None without samples."""
    samples = (doc.get("steps") or {}).get("samples")
    if not isinstance(samples, list) or not samples:
        return None
    out = []
    for s in samples:
        if not isinstance(s, dict):
            continue
        per = s.get("classes")
        if not isinstance(per, dict):
            return None
        v = per.get(cls, 0.0)
        out.append(num(v) if v is not None else 0.0)
    return [v for v in out if v is not None] or None
