"""Stage 8, render: the analysis document (``traceinspect.document``) as terminal text, HTML or Markdown,
read from the document alone; and, from the traces themselves, a merged Chrome trace (``perfetto``, which
needs the raw events). Each format lives in its own module and is imported only when used.

Inputs: an analysis document (and, for the merged Chrome trace, the trace set).
Outputs: terminal text, HTML, Markdown, a merged Chrome trace.
"""

from __future__ import annotations

import re

from traceinspect.units import fmt_bytes, fmt_count, fmt_pct, fmt_us, short_name

__all__ = ["fmt_bytes", "fmt_count", "fmt_pct", "fmt_us", "kernel_label", "kernel_labels", "short_name"]


_NAMESPACE = re.compile(r"\(anonymous namespace\)::|\b[A-Za-z_]\w*::(?!\w*\()(?=[A-Za-z_~])")
_LAMBDA = re.compile(r"\{lambda\(([^()]*)\)#(\d+)\}")
# a parameter list after a function or template name (not a lambda's: those carry the dtype)
_PARAMS = re.compile(r"(?<=[A-Za-z0-9_>])\((?:[^()]|\([^()]*\))*\)")
_KEEP = re.compile(r"λ\(|\d+x\d+|BFloat16|Half|float|double|Float8|e4m3|e5m2|e2m1|bf16|fp8|fp16|fp4|f16|f32|"
                   r"int8|uint8|__nv_bfloat16|__half|^-?\d+$")


def _lambda(m: re.Match[str]) -> str:
    arg = m.group(1).strip()
    return f"λ({arg})" if arg else f"λ{m.group(2)}"


def _compact(name: str) -> str:
    """A kernel name without ``void``, namespaces, ``operator()`` and parameter lists; lambdas as
    ``λ`` with their argument type (the dtype of a dispatch) or their number."""
    name = " ".join(str(name).split())
    if name.startswith("void "):
        name = name[5:]
    name = name.replace("::operator()() const", "").replace("::operator()", "")
    name = _LAMBDA.sub(_lambda, name).replace("(anonymous namespace)::", "")
    prev = None
    while prev != name:
        prev, name = name, _PARAMS.sub("", name)
    name = _NAMESPACE.sub("", name)
    name = re.sub(r"(?:λ\d+::)+(?=λ)", "", name)  # dispatch levels before the lambda that names the dtype
    while "> >" in name:
        name = name.replace("> >", ">>")
    return name.replace("c10::", "")


def _split_args(s: str) -> list[str]:
    """Top-level comma-separated parts of a template argument list."""
    out, depth, cur = [], 0, []
    for ch in s:
        if ch in "<([":
            depth += 1
        elif ch in ">)]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        out.append("".join(cur).strip())
    return out


def _elide(name: str, width: int) -> str:
    """``base<args>`` shortened to ``width`` by leaving out the template arguments that tell least
    (kept first: lambdas with a dtype, tile sizes, dtypes, numbers; then the first and the last)."""
    if len(name) <= width:
        return name
    i = name.find("<")
    j = name.rfind(">")
    if i <= 0 or j < i:
        return short_name(name, width)
    base, tail = name[:i], name[j + 1:]
    args = _split_args(name[i + 1:j])
    n = len(args)

    def score(k: int) -> tuple[int, int]:
        a = args[k]
        keep = 3 if "λ(" in a else 2 if _KEEP.search(a) else 1 if k in (0, n - 1) else 0
        return (-keep, k)

    order = sorted(range(n), key=score)
    room = width - len(base) - len(tail) - 2
    keep: list[int] = []
    used = 0
    for i_, k in enumerate(order):
        if used + len(args[k]) + 2 > room and i_ == 0 and room > 16:  # the most telling one, itself shortened
            args[k] = _elide(args[k], room - 5) if "<" in args[k] else short_name(args[k], room - 5)
        if used + len(args[k]) + 2 <= room:
            keep.append(k)
            used += len(args[k]) + 2
    while True:
        parts: list[str] = []
        for k in range(n):
            if k in keep:
                parts.append(args[k])
            elif not parts or parts[-1] != "…":
                parts.append("…")
        out = f"{base}<{', '.join(parts)}>{tail}"
        if len(out) <= width or len(keep) <= 1:
            break
        keep.pop()  # the least telling of those kept
    return out if len(out) <= width else short_name(out, width)


def kernel_label(name: str, width: int = 80) -> str:
    """A kernel name for a table cell: without ``void``, namespaces and parameter lists, and when still
    too long, its middle template arguments left out, keeping those that tell kernels apart (the dtype
    of a lambda, tile sizes). The full name stays available to the reader (hover text, JSON, CSV)."""
    full = " ".join(str(name).split())
    if full.startswith("void "):
        full = full[5:]
    if len(full) <= width:
        return full
    return _elide(_compact(full), width)


def kernel_labels(names: list[str] | tuple[str, ...], width: int = 80) -> dict[str, str]:
    """Labels for a set of kernel names that stay distinct: where two names shorten alike, their labels
    get longer until they differ, and a number when even the compact names are equal."""
    names = list(dict.fromkeys(str(n) for n in names))
    out = {n: kernel_label(n, width) for n in names}
    for w in (int(width * 1.5), width * 2, width * 4):
        clash = _clashes(out)
        if not clash:
            return out
        for n in clash:
            out[n] = kernel_label(n, w)
    seen: dict[str, int] = {}
    for n in names:
        label = out[n]
        if label in seen:
            seen[label] += 1
            out[n] = f"{label} #{seen[label]}"
        else:
            seen[label] = 1
    return out


def _clashes(labels: dict[str, str]) -> list[str]:
    by: dict[str, list[str]] = {}
    for n, label in labels.items():
        by.setdefault(label, []).append(n)
    return [n for group in by.values() if len(group) > 1 for n in group]
