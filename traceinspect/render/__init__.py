"""Stage 7, render: an :class:`~traceinspect.analysis.Analysis` as terminal text, HTML, Markdown, JSON or a
merged Chrome trace. Each format lives in its own module and is imported only when used."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from traceinspect.tables import combine_codes, factorize_text, text_values


def fmt_us(v: float | None) -> str:
    """A duration in microseconds as text: '812.3 µs', '12.4 ms', or 'n/a'."""
    if v is None or v != v:
        return "n/a"
    if abs(v) >= 10_000:
        return f"{v / 1000:,.1f} ms"
    if abs(v) >= 100:
        return f"{v:,.0f} µs"
    return f"{v:,.1f} µs"


def fmt_pct(v: float | None, digits: int = 1) -> str:
    """A fraction as a percentage: 0.123 -> '12.3%'."""
    if v is None or v != v:
        return "n/a"
    return f"{100 * v:.{digits}f}%"


def short_name(name: str, width: int = 80) -> str:
    """A kernel name cut to ``width`` characters, keeping its head (the family) and its tail."""
    name = " ".join(str(name).split())
    if len(name) <= width:
        return name
    head = width * 2 // 3
    return name[:head] + "…" + name[-(width - head - 1):]


def launching_ops(kernels: Any) -> dict[str, str]:
    """For each kernel name, the CPU op that launches it most often ('' when none is linked, as for
    CUDA-graph replays). ``kernels`` is the analysis' kernels table."""
    if kernels is None or not len(kernels) or "op_name" not in kernels.columns:
        return {}
    ops = kernels["op_name"]
    linked = text_values(ops) != ""
    if not linked.any():
        return {}
    # counted on integer codes of the two text columns; ties go to the op name that sorts first
    nc, nu = factorize_text(kernels["name"].to_numpy(dtype=object)[linked])
    oc, ou = factorize_text(ops[linked])
    pair = combine_codes(nc, oc)
    _, first, n = np.unique(pair, return_index=True, return_counts=True)
    best: dict[str, tuple[int, str]] = {}
    for i, c in zip(first.tolist(), n.tolist(), strict=True):
        name, op = str(nu[nc[i]]), str(ou[oc[i]])
        b = best.get(name)
        if b is None or c > b[0] or (c == b[0] and op < b[1]):
            best[name] = (c, op)
    return {name: best[name][1] for name in sorted(best)}


_NAMESPACE = re.compile(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::(?!\w*\()(?=[A-Za-z_~])")
_LAMBDA = re.compile(r"\{lambda\([^()]*\)#\d+\}")


def kernel_label(name: str, width: int = 80) -> str:
    """A kernel name for a table cell: no ``void``; when too long, no namespaces and lambdas as ``λ``;
    then shortened (the full name stays available to the reader: hover text, JSON)."""
    name = " ".join(str(name).split())
    if name.startswith("void "):
        name = name[5:]
    if len(name) > width:
        name = _LAMBDA.sub("λ", name).replace("::operator()() const", "")
        name = _NAMESPACE.sub("", name).replace("> >", ">>").replace("> >", ">>")
    return short_name(name, width)
