"""How numbers read, decided once for every output (terminal, HTML, Markdown, rule messages, CSV).

- durations in microseconds: ``812 µs``, ``12.4 ms``;
- shares are printed with one decimal (``38.0%``) and always say what they are of: the step time
  (:data:`SHARE_BASIS`, the median step, the slowest rank's GPU span) or, where the step time is not
  the basis, all GPU kernel time (:data:`GPU_BASIS`);
- changes carry their sign (``+4.2%``, ``-3,147 µs``) and nothing reads as ``-0.0``;
- sizes in decimal units (kB, MB, GB, TB: powers of 1000), three significant digits: ``906 MB``;
- counts per step as integers (``4``, ``390``); a mean below 10 that is not whole keeps one decimal (``1.5``).

Rule messages use the same formats through the ``us``, ``pct``, ``bytes`` and ``count`` format specs
(``{bytes_per_call:bytes}``), so a message and the evidence table beside it show the same text.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

SIZE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")  # decimal: a message's MB is the evidence table's MB
SIZE_BASE = 1000
SHARE_BASIS = "step time"  # what the outputs' shares are a fraction of ("of the step time")
GPU_BASIS = "GPU time"  # all GPU kernel time of the analysed steps ("of GPU time")


def json_num(x: Any, nd: int = 3) -> Any:
    """A JSON-safe scalar: NaN and inf -> None, numpy scalars -> Python, floats rounded to ``nd`` decimals;
    anything else as it is."""
    if x is None:
        return None
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return round(float(x), nd) if math.isfinite(x) else None
    return x


def is_number(v: Any) -> bool:
    """A finite real number (numpy scalars included; not a bool)."""
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)) \
        and math.isfinite(v)


def finite(x: Any) -> float | None:
    """``x`` as a finite float (numpy scalars and numeric text included), else None: the one test of "is
    this a measured number" the stages and the judge share."""
    if x is None:
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def fmt_us(v: float | None) -> str:
    """A duration in microseconds as text: '812.3 µs', '3,599 µs', '12.4 ms', or 'n/a'."""
    if not _finite(v):
        return "n/a"
    v = float(v)  # type: ignore[arg-type]
    if abs(v) >= 10_000:
        text = f"{v / 1000:,.1f} ms"
    elif abs(v) >= 100:
        text = f"{v:,.0f} µs"
    else:
        text = f"{v:,.1f} µs"
    return text[1:] if text.startswith("-") and not any(ch in "123456789" for ch in text) else text


def fmt_pct(v: float | None, digits: int = 1) -> str:
    """A fraction as a percentage: 0.123 -> '12.3%' (a negative one that rounds to zero as '0.0%')."""
    if not _finite(v):
        return "n/a"
    text = f"{100 * float(v):.{digits}f}%"  # type: ignore[arg-type]
    return text[1:] if text.startswith("-") and not any(ch in "123456789" for ch in text) else text


def _signed(text: str, v: float) -> str:
    """``text`` (of ``abs(v)``) with the sign of ``v``; none when it reads as zero (never '-0.0')."""
    if not any(ch in "123456789" for ch in text.split(" ")[0]):
        return text
    return ("+" if v > 0 else "-") + text


def fmt_us_signed(v: float | None) -> str:
    """A change of a duration with its sign: '+3,147 µs', '-12.4 ms', '0.0 µs' (no sign when it reads as
    zero, so never '-0.0 µs')."""
    if not _finite(v):
        return "n/a"
    return _signed(fmt_us(abs(float(v))), float(v))  # type: ignore[arg-type]


def fmt_pct_signed(v: float | None, digits: int = 1) -> str:
    """A change as a signed percentage: '+4.2%', '-48.3%', '0.0%' (never '-0.0%')."""
    if not _finite(v):
        return "n/a"
    return _signed(fmt_pct(abs(float(v)), digits), float(v))  # type: ignore[arg-type]


def fmt_bytes(v: float | None) -> str:
    """A size in decimal units with three significant digits: 906e6 -> '906 MB', 3.02e7 -> '30.2 MB'."""
    if not _finite(v):
        return "n/a"
    v = float(v)  # type: ignore[arg-type]
    unit = SIZE_UNITS[0]
    for unit in SIZE_UNITS:
        if abs(v) < 999.5 or unit == SIZE_UNITS[-1]:
            break
        v /= SIZE_BASE
    if unit == "B":
        return f"{v:,.0f} B"
    return f"{v:.3g} {unit}" if abs(v) < 100 else f"{v:,.0f} {unit}"


def fmt_count(v: float | None) -> str:
    """A count (or a mean count per step): an integer, except a mean below 10 that is not whole (1.5)."""
    if not _finite(v):
        return "n/a"
    v = float(v)  # type: ignore[arg-type]
    if abs(v - round(v)) < 0.05 or abs(v) >= 10:
        return f"{int(round(v)):,}"
    return f"{v:,.1f}"


# format specs a rule message may use besides Python's own: {metric:us}, {metric:pct}, ...
SPECS = {"us": fmt_us, "pct": fmt_pct, "bytes": fmt_bytes, "count": fmt_count, "dus": fmt_us_signed,
         "dpct": fmt_pct_signed}


def format_spec(v: Any, spec: str) -> str | None:
    """``v`` formatted with one of :data:`SPECS`, or None when ``spec`` is not one of them."""
    fn = SPECS.get(spec)
    return fn(v) if fn is not None else None


def clamp_estimate(est: float | None, *bounds: float | None) -> tuple[float | None, list[float]]:
    """An estimated saving no larger than any of ``bounds`` (the time of what it fixes, the step time,
    the idle time it could fill, ...) and not negative. Returns the estimate and the bounds that cut it."""
    if est is None or not _finite(est):
        return None, []
    out = max(float(est), 0.0)
    cut: list[float] = []
    for b in bounds:
        if b is not None and _finite(b) and out > float(b):
            out = max(float(b), 0.0)
            cut.append(float(b))
    return out, cut


def short_name(name: str, width: int = 80) -> str:
    """A name (kernel, op, shapes) cut to ``width`` characters, keeping its head (the family) and its tail."""
    name = " ".join(str(name).split())
    if len(name) <= width:
        return name
    head = width * 2 // 3
    return name[:head] + "…" + name[-(width - head - 1):]
