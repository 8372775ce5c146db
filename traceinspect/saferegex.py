"""Regexes from rule files, restricted so that matching stays fast on hostile kernel names.

Refused: backreferences, look-behind/ahead with repeats inside, nested unbounded repeats
(``(a+)+``), unbounded repeats of alternations (``(a|ab)*``), more than three unbounded repeats,
and patterns longer than 300 characters. Names are matched on their first 4096 characters.
"""

from __future__ import annotations

import re
from typing import Any

try:  # Python >= 3.11
    import re._constants as _c  # type: ignore[import-not-found]
    import re._parser as _p  # type: ignore[import-not-found]
except ImportError:  # pragma: no cover - Python 3.10
    import sre_constants as _c  # type: ignore[no-redef]
    import sre_parse as _p  # type: ignore[no-redef]

MAX_PATTERN = 300
MAX_UNBOUNDED = 3
MAX_TEXT = 4096


class RegexError(ValueError):
    """A pattern is invalid or could match slowly."""


def _walk(items: Any, inside_unbounded: bool, counter: list[int]) -> None:
    for op, av in items:
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT, getattr(_c, "POSSESSIVE_REPEAT", None)):
            lo, hi, body = av
            unbounded = hi == _c.MAXREPEAT or hi > 1000
            if unbounded:
                counter[0] += 1
                if inside_unbounded:
                    raise RegexError("nested unbounded repeats (like '(a+)+') are not allowed")
                if _has(body, (_c.BRANCH,)):
                    raise RegexError("an unbounded repeat of an alternation (like '(a|b)*') is not allowed")
            _walk(body, inside_unbounded or unbounded, counter)
        elif op == _c.GROUPREF or op == getattr(_c, "GROUPREF_EXISTS", None):
            raise RegexError("backreferences are not allowed")
        elif op == _c.SUBPATTERN:
            _walk(av[-1], inside_unbounded, counter)
        elif op == _c.BRANCH:
            for alt in av[1]:
                _walk(alt, inside_unbounded, counter)
        elif op in (_c.ASSERT, _c.ASSERT_NOT):
            _walk(av[1], inside_unbounded, counter)
        elif op == getattr(_c, "ATOMIC_GROUP", None):
            _walk(av, inside_unbounded, counter)


def _has(items: Any, ops: tuple[Any, ...]) -> bool:
    for op, av in items:
        if op in ops:
            return True
        if op == _c.SUBPATTERN and _has(av[-1], ops):
            return True
        if op in (_c.MAX_REPEAT, _c.MIN_REPEAT) and _has(av[2], ops):
            return True
    return False


def compile_safe(pattern: str, ignore_case: bool = True) -> re.Pattern[str]:
    """Compile a rule-file regex after checking it cannot backtrack catastrophically."""
    if not isinstance(pattern, str):
        raise RegexError(f"expected a regex string, got {type(pattern).__name__}")
    if len(pattern) > MAX_PATTERN:
        raise RegexError(f"regex is {len(pattern)} characters long (limit {MAX_PATTERN})")
    flags = re.IGNORECASE if ignore_case else 0
    try:
        parsed = _p.parse(pattern, flags)
    except (re.error, OverflowError) as e:
        raise RegexError(f"invalid regex {pattern!r}: {e}") from None
    except RecursionError:
        raise RegexError("regex is nested too deeply") from None
    counter = [0]
    _walk(parsed, False, counter)
    if counter[0] > MAX_UNBOUNDED:
        raise RegexError(f"regex has {counter[0]} unbounded repeats (limit {MAX_UNBOUNDED})")
    try:
        return re.compile(pattern, flags)
    except (re.error, RecursionError, OverflowError) as e:
        raise RegexError(f"invalid regex {pattern!r}: {e}") from None


def search(rx: re.Pattern[str], text: str) -> bool:
    """``rx.search`` on the first :data:`MAX_TEXT` characters of ``text``."""
    return rx.search(text[:MAX_TEXT]) is not None
