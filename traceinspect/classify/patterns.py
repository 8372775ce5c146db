"""Name patterns of the kernel class table: a regex split into the literal texts a name must hold before
the regex is searched (the class table asks these first), and the checks that keep a pattern's lookbehinds
within the regex engine's limits (:func:`name_pattern`)."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_META = frozenset("\\.^$*+?{}[]()|")


def _alternatives(text: str) -> list[str] | None:
    """The top-level ``|`` alternatives of a regex, or None when they cannot be told apart safely (an
    unbalanced group or class, or a global inline flag that would apply to all of them)."""
    if text.startswith("(?") and len(text) > 2 and text[2] in "aiLmsux":
        return None
    out, start, depth, i, n = [], 0, 0, 0, len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "[":  # a class: up to the first ']' that is not its first character
            j = i + 1
            if j < n and text[j] == "^":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 2 if text[j] == "\\" else 1
            if j >= n:
                return None
            i = j + 1
            continue
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                return None
        elif ch == "|" and depth == 0:
            out.append(text[start:i])
            start = i + 1
        i += 1
    if depth:
        return None
    out.append(text[start:])
    return out


@lru_cache(maxsize=1)
def _sre() -> tuple[Any, Any]:
    """The regex module's own parser and its op codes."""
    try:
        from re import _constants, _parser  # type: ignore[attr-defined]
    except ImportError:  # Python 3.10
        import sre_constants as _constants
        import sre_parse as _parser
    return _parser, _constants


def _better(a: tuple[str, ...] | None, b: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """Of two sets of texts one of which every match contains, the one a name is less likely to hold:
    the longer shortest text, then the fewer texts."""
    if a is None or b is None:
        return a or b
    return b if (min(map(len, b)), -len(b)) > (min(map(len, a)), -len(a)) else a


def _needed(items: Any) -> tuple[str, ...] | None:
    """Texts of ASCII literal characters one of which every match of the parsed sequence ``items``
    contains: a run of literals, or one run from each branch of an alternation, descending into groups
    and repeats that must match at least once (the set least likely to be in a name); None if none."""
    c = _sre()[1]
    best: tuple[str, ...] | None = None
    run: list[str] = []
    for op, av in [*items, (None, None)]:
        if op is c.LITERAL and av < 128:
            run.append(chr(av))
            continue
        if run:
            best, run = _better(best, ("".join(run),)), []
        if op is c.SUBPATTERN and not av[1] and not av[2]:  # a group without flags of its own
            best = _better(best, _needed(av[3]))
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT) and av[0] >= 1:
            best = _better(best, _needed(av[2]))
        elif op is c.BRANCH:
            each = [_needed(b) for b in av[1]]
            if all(each):
                best = _better(best, tuple(dict.fromkeys(t for e in each if e for t in e)))
    return best


def _needed_texts(regex: str, flags: int) -> tuple[tuple[str, bool], ...] | None:
    """Texts one of which every match of ``regex`` contains, each with whether it is compared case-folded
    (the regex's flags with its global inline ones), from the regex module's own parse; None when a match
    needs no particular text, or the parse is not one this reads (the caller then compiles the regex at
    once). An ASCII name that holds none of them cannot match; the texts are ASCII, so folding an ASCII
    name is ``str.lower``. A regex that compiling refuses raises :class:`re.error` here, as compiling does."""
    parser, c = _sre()
    try:
        tree = parser.parse(regex, flags)
        _check_lookbehinds(tree.data, c, parser.SubPattern)
        texts = _needed(tree.data)
    except re.error:
        raise
    except Exception:  # noqa: BLE001 - another parser layout, a pattern nested too deep: no prefilter
        return None
    if not texts:
        return None
    fold = bool(tree.state.flags & re.IGNORECASE)
    return tuple(dict.fromkeys((t.lower() if fold else t, fold) for t in texts))


_MAXCODE = (1 << 32) - 1  # the widest lookbehind the regex engine takes (its code words are 32 bits)


def _check_lookbehinds(items: Any, c: Any, subpattern: type) -> None:
    """Raise :class:`re.error` for a lookbehind of the parsed ``items`` that is not of one fixed width (or
    is too wide): what compiling a parsed regex checks beyond the parse."""
    for op, av in items:
        if op in (c.ASSERT, c.ASSERT_NOT) and av[0] < 0:
            lo, hi = av[1].getwidth()
            if lo > _MAXCODE:
                raise re.error("looks too much behind")
            if lo != hi:
                raise re.error("look-behind requires fixed-width pattern")
        for sub in _subpatterns(av, subpattern):
            _check_lookbehinds(sub.data, c, subpattern)


def _subpatterns(av: Any, subpattern: type) -> list[Any]:
    """The parsed sub-patterns among an op's arguments (nested in tuples and lists)."""
    if isinstance(av, subpattern):
        return [av]
    if isinstance(av, (list, tuple)):
        return [s for x in av for s in _subpatterns(x, subpattern)]
    return []


class NamePattern:
    """A kernel-name pattern of the class table, asked only whether it matches anywhere. Its top-level
    alternatives that are plain ASCII text are found by substring search, which on long kernel names
    is many times faster than the regex engine trying every alternative at every position; the other
    alternatives form one regex (parsed at load, so a bad one is reported there), searched only in a
    name that holds a text each of them needs (:func:`_needed_texts`) and compiled when the first such
    name comes (most names of a trace hold none of the texts of most patterns). A name that is not ASCII
    goes through the whole pattern, compiled on first use, so case-folding stays the regex's."""

    __slots__ = ("_full", "_fold", "_literals", "_needs", "_rest", "_rest_text", "flags", "pattern")

    def __init__(self, pattern: str, flags: int) -> None:
        self.pattern, self.flags = pattern, flags
        self._fold = bool(flags & re.IGNORECASE)
        self._full: re.Pattern[str] | None = None
        alts = _alternatives(pattern)
        plain = [a for a in alts or () if a and a.isascii() and not _META.intersection(a)]
        rest = [a for a in alts or () if a not in plain] if alts is not None else [pattern]
        self._literals = tuple(dict.fromkeys(a.lower() if self._fold else a for a in plain))
        self._rest_text = "|".join(rest) if rest else None
        self._needs = _needed_texts(self._rest_text, flags) if rest else None
        # compiled now when every ASCII name goes through it, else when a name first holds a needed text
        self._rest = re.compile(self._rest_text, flags) if rest and self._needs is None else None

    def matches(self, text: str, lower: str | None = None) -> bool:
        """Whether the pattern matches anywhere in ``text`` (``re.search(...) is not None``); ``lower``,
        when given, is ``text.lower()`` (made once by a caller that asks many patterns about one name)."""
        if not text.isascii():
            if self._full is None:
                self._full = re.compile(self.pattern, self.flags)
            return self._full.search(text) is not None
        if self._literals:
            if self._fold:
                folded = lower = text.lower() if lower is None else lower
            else:
                folded = text
            for lit in self._literals:
                if lit in folded:
                    return True
        if self._rest_text is None:
            return False
        if self._needs is not None:  # no match without one of these texts: most names have none of them
            if lower is None:
                lower = text.lower()
            for lit, fold in self._needs:
                if lit in (lower if fold else text):
                    break
            else:
                return False
        if self._rest is None:
            self._rest = re.compile(self._rest_text, self.flags)
        return self._rest.search(text) is not None

    def __repr__(self) -> str:
        return f"NamePattern({self.pattern!r})"


_NAME_PATTERNS: dict[tuple[str, int], NamePattern] = {}


def name_pattern(text: str, flags: int) -> NamePattern:
    """The one :class:`NamePattern` of a pattern text and flags (shared, like ``re.compile``'s cache, so
    that the rules that use one macro share its per-name results)."""
    key = (text, flags)
    p = _NAME_PATTERNS.get(key)
    if p is None:
        p = _NAME_PATTERNS[key] = NamePattern(text, flags)
    return p
