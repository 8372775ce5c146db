"""Inputs of diff and gate: analysis documents (``traceinspect.analysis/1``), loaded from stored JSON files,
and the few accessors the comparisons need. The gate reads documents only; analysing a trace set into one
is the caller's (``traceinspect.commands.gate`` for the CLI)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from traceinspect.document.read import is_analysis_file, load_json_document, validate_document
from traceinspect.errors import TraceInputError

__all__ = ["is_analysis_file", "labelled", "load_document", "load_json_document", "validate_document"]


def load_document(path: str | Path) -> dict[str, Any]:
    """A stored analysis document (the JSON of ``traceinspect analyze --json``, plain or gzipped), checked
    against the schema; unusable input raises TraceInputError. A trace set is analysed by the caller
    (``traceinspect.analyze(paths).to_json()``; the ``diff`` and ``gate`` commands do it for a path that
    is not an analysis JSON)."""
    p = Path(path)
    if p.is_file() and not is_analysis_file(p):
        raise TraceInputError("a trace, not an analysis JSON (write one with `traceinspect analyze TRACES --json "
                              "FILE`)", p)
    return labelled(load_json_document(p), str(p))


def labelled(doc: dict[str, Any], source: str) -> dict[str, Any]:
    """``doc``, named after where it came from (unless it names itself): :func:`label` reads it."""
    doc.setdefault("_source_label", source)
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


def batch_value(doc: dict[str, Any]) -> float | None:
    """The decode batch (the median ``bs=N`` of the analysed steps' annotations), or None when unknown."""
    b = num((doc.get("run") or {}).get("batch_median"))
    return b if b is not None and b > 0 else None


def finding_classes(f: dict[str, Any]) -> list[str]:
    """The kernel classes a finding is about: the classes its replayed fixes edit (none for a finding
    about the host or the run as a whole)."""
    out: list[str] = []
    for fix in f.get("fixes") or []:
        for edit in (fix.get("edits") or []) if isinstance(fix, dict) else []:
            sel = edit.get("select") if isinstance(edit, dict) else None
            cls = sel.get("class") if isinstance(sel, dict) else None
            for c in [cls] if isinstance(cls, str) else cls if isinstance(cls, list) else []:
                if isinstance(c, str) and c not in out:
                    out.append(c)
    return out


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
