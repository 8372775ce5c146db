"""The gate's config file, ``traceinspect.toml``: thresholds and disabled rules kept next to a
repository's baseline. Command-line flags override it; it overrides the built-in defaults.

    [gate]
    max-regression = ["step:5%", "class.*:10%", "class.kv_cast:5%"]
    floor = "10us"            # or "0.5%" of the baseline's median step time
    alpha = 0.05              # noise test significance level
    fail-on = "warning"       # critical | warning | info | never
    allow-mismatch = false

    [rules]
    disable = ["small-m-gemm"]

Other top-level tables are left to other commands. Unknown keys inside ``[gate]`` and ``[rules]``
are errors (a typo must not silently loosen a gate).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from traceinspect.errors import ConfigError
from traceinspect.fileio import read_toml
from traceinspect.gate.thresholds import Floor, Threshold, parse_floor, parse_threshold

DEFAULT_CONFIG_NAME = "traceinspect.toml"
GATE_KEYS = {"max-regression", "floor", "alpha", "fail-on", "allow-mismatch"}
RULES_KEYS = {"disable"}


@dataclass
class GateConfig:
    """Values read from a config file (None: not set there)."""

    path: Path | None = None
    thresholds: list[Threshold] = field(default_factory=list)
    floor: Floor | None = None
    alpha: float | None = None
    fail_on: str | None = None
    allow_mismatch: bool | None = None
    disable: list[str] = field(default_factory=list)


def _expect(value: Any, typ: type | tuple[type, ...], key: str, path: Path) -> Any:
    if not isinstance(value, typ) or isinstance(value, bool) and typ is not bool:
        want = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
        raise ConfigError(f"{key} must be a {want}, not {type(value).__name__} ({value!r})", path)
    return value


def load_config(path: str | Path) -> GateConfig:
    """Read a ``traceinspect.toml``; raise ConfigError (exit 2) with the reason if it is unusable."""
    p = Path(path)
    data = read_toml(p)
    cfg = GateConfig(path=p)
    gate = data.get("gate", {})
    rules = data.get("rules", {})
    _expect(gate, dict, "[gate]", p)
    _expect(rules, dict, "[rules]", p)
    for table, keys, name in ((gate, GATE_KEYS, "gate"), (rules, RULES_KEYS, "rules")):
        unknown = sorted(set(table) - keys)
        if unknown:
            raise ConfigError(f"unknown key(s) in [{name}]: {', '.join(unknown)} (known: {', '.join(sorted(keys))})", p)
    try:
        if "max-regression" in gate:
            exprs = gate["max-regression"]
            exprs = [exprs] if isinstance(exprs, str) else _expect(exprs, list, "gate.max-regression", p)
            cfg.thresholds = [parse_threshold(_expect(e, str, "gate.max-regression entry", p)) for e in exprs]
        if "floor" in gate:
            cfg.floor = parse_floor(_expect(gate["floor"], (str, int, float), "gate.floor", p))
    except ConfigError as e:
        raise ConfigError(e.reason, p) from e
    if "alpha" in gate:
        cfg.alpha = float(_expect(gate["alpha"], (int, float), "gate.alpha", p))
        if not 0.0 < cfg.alpha < 1.0:
            raise ConfigError(f"gate.alpha must be between 0 and 1, not {cfg.alpha}", p)
    if "fail-on" in gate:
        from traceinspect.gate.core import FAIL_ON

        cfg.fail_on = _expect(gate["fail-on"], str, "gate.fail-on", p)
        if cfg.fail_on not in FAIL_ON:
            raise ConfigError(f"gate.fail-on must be one of {', '.join(FAIL_ON)}, not {cfg.fail_on!r}", p)
    if "allow-mismatch" in gate:
        cfg.allow_mismatch = _expect(gate["allow-mismatch"], bool, "gate.allow-mismatch", p)
    if "disable" in rules:
        cfg.disable = [_expect(r, str, "rules.disable entry", p) for r in _expect(rules["disable"], list,
                                                                                   "rules.disable", p)]
    return cfg


def find_config(explicit: str | Path | None, no_config: bool = False, cwd: str | Path | None = None) -> GateConfig:
    """The config to use: ``explicit`` (must exist), else ``./traceinspect.toml`` when present, else none."""
    if no_config:
        return GateConfig()
    if explicit is not None:
        return load_config(explicit)
    default = Path(cwd or ".") / DEFAULT_CONFIG_NAME
    return load_config(default) if default.is_file() else GateConfig()
