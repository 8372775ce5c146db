"""Kernel family names: what the GEMM and memory tables group kernels by. (The recorded op shapes themselves
are decoded by :mod:`traceinspect.model.shapes`.)"""

from __future__ import annotations

import re

_SHORT_INNER = re.compile(r"\b([A-Za-z_]\w*_kernel_cuda|[A-Za-z_]\w*Functor\w*|LoadWithCast)\b")


def short_name(name: str) -> str:
    """A kernel family name: the function name without namespaces, templates and arguments, plus the
    functor that identifies PyTorch's generic elementwise kernels (``direct_copy_kernel_cuda``, ...)."""
    s = name[5:] if name.startswith("void ") else name
    s = s.replace("(anonymous namespace)::", "")
    cut = len(s)
    for ch in "<(":
        i = s.find(ch)
        if 0 <= i < cut:
            cut = i
    head = s[:cut].strip()
    head = head.rsplit("::", 1)[-1] if "::" in head else head
    head = head or s[:60]
    inner = []
    for m in _SHORT_INNER.finditer(s[cut:]):
        w = m.group(1)
        if w not in inner:
            inner.append(w)
        if len(inner) == 2:
            break
    return f"{head}<{','.join(inner)}>" if inner else head


# ----------------------------------------------------------------------------- result
