"""Regression thresholds in the pytest-benchmark ``--benchmark-compare-fail`` style: ``METRIC:LIMIT``.

METRIC  ``step``          median decode-step time (the slowest rank's GPU span per step)
        ``throughput``    tokens/s (batch x 1e6 / step us), where both runs' batch is known; a % only
        ``class.NAME``    GPU time per step of one kernel class (e.g. ``class.kv_cast``)
        ``class.*``       every class that has no threshold of its own
LIMIT   ``5%``            the candidate may be at most 5 % slower than the baseline (tokens/s: 5 % lower)
        ``200us``         ... at most 200 us slower (units: us, ms, s)
        ``off``           remove the thresholds of this metric (e.g. a default)

``step`` and ``throughput`` decide the verdict; class thresholds say which class changes explain it (a class
fails the gate on its own only with a ``class.NAME`` threshold the user wrote).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from traceinspect.errors import ConfigError

DEFAULT_THRESHOLDS: tuple[str, ...] = ("step:5%", "throughput:5%", "class.*:10%")
DEFAULT_FLOOR = "10us"

_METRIC = re.compile(r"^(step|throughput|class\.(\*|[A-Za-z_][A-Za-z0-9_.\-]*))$")
_LIMIT = re.compile(r"^(?P<num>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(?P<unit>%|us|µs|ms|s)$")
_UNIT_US = {"us": 1.0, "µs": 1.0, "ms": 1e3, "s": 1e6}


@dataclass(frozen=True)
class Threshold:
    """One ``METRIC:LIMIT`` expression."""

    metric: str  # 'step' | 'throughput' | 'class.NAME' | 'class.*'
    kind: str  # 'pct' | 'abs' | 'off'
    value: float  # percent for 'pct', microseconds for 'abs'
    expr: str

    def allowed_us(self, base: float) -> float:
        """The largest increase (us) this threshold allows over a baseline value."""
        return base * self.value / 100.0 if self.kind == "pct" else self.value

    def describe(self) -> str:
        return f"{self.value:g}%" if self.kind == "pct" else f"{self.value:g} us"


def _limit(text: str, what: str, allow_pct: bool = True) -> tuple[str, float]:
    t = text.strip()
    m = _LIMIT.match(t)
    if not m:
        if re.fullmatch(r"[0-9]*\.?[0-9]+", t):
            raise ConfigError(f"{what}: {t!r} has no unit: write e.g. {t}% or {t}us (units: %, us, ms, s)")
        raise ConfigError(f"{what}: cannot read limit {t!r} (expected e.g. 5%, 200us, 0.2ms)")
    value = float(m.group("num"))
    unit = m.group("unit")
    if unit == "%":
        if not allow_pct:
            raise ConfigError(f"{what}: a percentage is not allowed here")
        return "pct", value
    return "abs", value * _UNIT_US[unit]


def parse_threshold(expr: str) -> Threshold:
    """Parse ``METRIC:LIMIT`` (``step:5%``, ``class.kv_cast:10%``, ``class.*:15%``, ``step:200us``,
    ``step:off``). Raise ConfigError with the reason when it cannot be read."""
    if not isinstance(expr, str):
        raise ConfigError(f"threshold {expr!r}: expected a string like 'step:5%'")
    text = expr.strip()
    metric, sep, limit = text.rpartition(":")
    what = f"threshold {expr!r}"
    if not sep or not metric:
        raise ConfigError(f"{what}: expected METRIC:LIMIT, e.g. step:5%, class.kv_cast:10%, step:200us")
    metric = metric.strip()
    if not _METRIC.match(metric):
        raise ConfigError(f"{what}: unknown metric {metric!r} (expected step, throughput, class.NAME or class.*)")
    if limit.strip().lower() == "off":
        return Threshold(metric, "off", 0.0, text)
    kind, value = _limit(limit, what)
    if metric == "throughput" and kind != "pct":
        raise ConfigError(f"{what}: a throughput limit is a percentage (e.g. throughput:5%: tokens/s may drop "
                          "by at most 5%)")
    return Threshold(metric, kind, value, text)


@dataclass(frozen=True)
class Floor:
    """The smallest increase that can fail a check, whatever the percentage: absolute (us) or a
    percentage of the baseline's median step time."""

    kind: str  # 'abs' | 'pct_of_step'
    value: float
    expr: str

    def us(self, base_step_us: float | None) -> float:
        if self.kind == "abs":
            return self.value
        return (base_step_us or 0.0) * self.value / 100.0

    def describe(self, base_step_us: float | None) -> str:
        if self.kind == "abs":
            return f"{self.value:g} us"
        return f"{self.value:g}% of baseline step = {self.us(base_step_us):.1f} us"


def parse_floor(expr: str | float | int) -> Floor:
    """Parse a floor: ``10us``, ``0.1ms``, ``0`` or ``0.5%`` (of the baseline's median step time)."""
    if isinstance(expr, (int, float)) and not isinstance(expr, bool) and expr == 0:
        return Floor("abs", 0.0, "0")
    text = str(expr).strip()
    if text == "0":
        return Floor("abs", 0.0, text)
    kind, value = _limit(text, f"floor {expr!r}")
    if value < 0:
        raise ConfigError(f"floor {expr!r}: must not be negative")
    return Floor("abs" if kind == "abs" else "pct_of_step", value, text)


def merge_thresholds(*layers: Iterable[Threshold]) -> list[Threshold]:
    """Later layers replace earlier ones metric by metric (defaults < config file < command line);
    within a layer every expression of a metric is kept (all must pass); ``off`` removes a metric."""
    merged: dict[str, list[Threshold]] = {}
    for layer in layers:
        fresh: dict[str, list[Threshold]] = {}
        for t in layer:
            fresh.setdefault(t.metric, []).append(t)
        for metric, items in fresh.items():
            offs = [t for t in items if t.kind == "off"]
            # an 'off' is kept as a marker, so 'class.X:off' also hides 'class.*' from class X
            merged[metric] = offs[:1] if offs else items
    return [t for items in merged.values() for t in items]


def thresholds_for(metric: str, thresholds: list[Threshold]) -> list[Threshold]:
    """The thresholds that apply to a concrete metric: its own, else (for a class) ``class.*``;
    none when the metric is switched off."""
    own = [t for t in thresholds if t.metric == metric]
    if not own and metric.startswith("class.") and metric != "class.*":
        own = [t for t in thresholds if t.metric == "class.*"]
    return [t for t in own if t.kind != "off"]
