"""The metric registry: every metric's name, unit, scope and definition, declared beside the code that computes
it (the scope modules of this package), and the :class:`Subject` a rule is evaluated on."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
import numpy as np

from traceinspect.model.classes import CLASSES


def class_ids() -> tuple[str, ...]:
    """The kernel class ids (the ``class`` subjects' names)."""
    return CLASSES


class Metric(msgspec.Struct, frozen=True):
    """One documented metric."""

    name: str
    unit: str
    scope: str
    definition: str


SCOPES = ("run", "kernels", "gemm", "rank", "class")
_REG: dict[str, dict[str, Metric]] = {s: {} for s in SCOPES}


def declare(scope: str, name: str, unit: str, definition: str) -> None:
    """Declare a metric (where the code that computes it is)."""
    _REG[scope][name] = Metric(name, unit, scope, " ".join(definition.split()))


_CLASS_METRICS_DONE = False


def _ensure_class_metrics() -> None:
    global _CLASS_METRICS_DONE
    if _CLASS_METRICS_DONE:
        return
    for c in class_ids():
        declare("run", f"cls_{c}_us_per_step", "us", f"GPU time of class {c} per rank per step.")
        declare("run", f"cls_{c}_share", "ratio", f"Share of all GPU time in class {c}.")
        declare("run", f"cls_{c}_calls_per_step", "count", f"Calls of class {c} per rank per step.")
    _CLASS_METRICS_DONE = True


def registry(scope: str | None = None) -> dict[str, Metric]:
    """Metrics of a scope (``run`` metrics included), or of every scope when ``scope`` is None."""
    _ensure_class_metrics()
    if scope is None:
        out: dict[str, Metric] = {}
        for s in SCOPES:
            out.update(_REG[s])
        return out
    out = dict(_REG["run"])
    out.update(_REG[scope])
    return out


def own_metrics(scope: str) -> dict[str, Metric]:
    """Metrics defined in ``scope`` itself (without the run metrics every scope sees)."""
    _ensure_class_metrics()
    return dict(_REG[scope])


def known(scope: str, name: str) -> bool:
    """Is ``name`` a metric visible to rules of ``scope``?"""
    _ensure_class_metrics()
    return name in _REG["run"] or name in _REG[scope]


class Subject(msgspec.Struct):
    """One thing a rule is evaluated on: its metric values, label, ranks and the reasons why some
    metrics are unavailable."""

    scope: str
    label: str
    values: dict[str, Any]
    ranks: list[int] = msgspec.field(default_factory=list)
    missing: dict[str, str] = msgspec.field(default_factory=dict)
    classes: tuple[str, ...] = ()  # kernel classes of the subject's kernels (kernels, gemm, class scopes)
    kernels: Any = None  # the subject's kernel rows, where known (gemm scope): what its fixes select


def _median(values: Iterable[float]) -> float | None:
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    return float(np.median(arr)) if len(arr) else None


def _weighted_median(values: np.ndarray, weights: np.ndarray) -> float | None:
    if not len(values):
        return None
    order = np.argsort(values)
    v, w = values[order], weights[order]
    if w.sum() <= 0:
        return float(np.median(v))
    c = np.cumsum(w)
    return float(v[np.searchsorted(c, 0.5 * c[-1])])


def _fmt_num(x: Any) -> str:
    return "?" if x is None else f"{x:g}"


def _first(row: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if key in row and row[key] is not None:
            return row[key]
    return None
