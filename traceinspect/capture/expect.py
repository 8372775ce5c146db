"""The live server's configuration: ``--expect KEY=VALUE`` checked against ``/server_info`` before anything
is profiled, and the one line that describes the server."""

from __future__ import annotations

import json
from typing import Any

from traceinspect.capture.errors import ServerMismatch
from traceinspect.model.run import ServerInfo

_MISSING = object()


def server_value(info: dict[str, Any], key: str) -> Any:
    """A key of /server_info: ``a.b.0`` walks nested objects and lists; a plain key is read at the top
    level, or, when absent or null there, from the first ``internal_states`` entry (newer SGLang keeps
    resolved runtime values there)."""
    cur: Any = info
    parts = key.split(".")
    if len(parts) == 1:
        v = info.get(key, _MISSING)
        if v is _MISSING or v is None:
            states = info.get("internal_states")
            if isinstance(states, list) and states and isinstance(states[0], dict) and key in states[0]:
                return states[0][key]
        return v
    for p in parts:
        if isinstance(cur, dict) and p in cur:
            cur = cur[p]
        elif isinstance(cur, list) and p.isdigit() and int(p) < len(cur):
            cur = cur[int(p)]
        else:
            return _MISSING
    return cur


def _parse_expected(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _same(actual: Any, expected_text: str) -> bool:
    exp = _parse_expected(expected_text)
    if isinstance(actual, bool) or isinstance(exp, bool):
        return actual is exp or str(actual).lower() == expected_text.strip().lower()
    if isinstance(actual, (int, float)) and isinstance(exp, (int, float)):
        return float(actual) == float(exp)
    return actual == exp or str(actual) == expected_text


def check_expected(info: dict[str, Any], expect: tuple[tuple[str, str], ...]) -> None:
    """Raise :class:`ServerMismatch` naming every ``--expect`` key whose value on the live server differs
    (expected and actual), before anything is profiled."""
    bad = []
    for key, want in expect:
        v = server_value(info, key)
        if v is _MISSING:
            bad.append(f"{key}: expected {want}, actual: not in /server_info")
        elif not _same(v, want):
            bad.append(f"{key}: expected {want}, actual {json.dumps(v) if not isinstance(v, str) else v}")
    if bad:
        raise ServerMismatch("the server is not configured as --expect says (nothing profiled): " + "; ".join(bad))


def describe(info: dict[str, Any]) -> str:
    """One line about the server's configuration."""
    parts = []
    model = info.get("served_model_name") or info.get("model_path")
    if model:
        parts.append(str(model))
    si = ServerInfo(info)
    par = [f"{k.split('_')[0]}{n}" for k in ("tp_size", "dp_size", "ep_size", "pp_size")
           if (n := si.count(k)) is not None and (n > 1 or k == "tp_size")]
    parts += par
    for key in ("quantization", "kv_cache_dtype", "attention_backend"):
        if info.get(key):
            parts.append(f"{key}={info[key]}")
    if info.get("version"):
        parts.append(f"sglang {info['version']}")
    return ", ".join(parts) or "(no details)"
