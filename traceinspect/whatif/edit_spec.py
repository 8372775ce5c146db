"""Edits of a replay, as data: what a fix changes in the measured step.

Text form (``traceinspect whatif --edit``) and mapping form (a rule's ``fixes:`` in YAML):

| edit | text | what it does |
|---|---|---|
| ``scale`` | ``scale SEL F`` | selected GPU operations take F times as long (collectives: their transfer) |
| ``remove`` | ``remove SEL`` | selected operations go, with their launch call and their op's host time before it |
| ``transfer`` | ``transfer [SEL] F`` | collective transfer (after the last arrival) scaled by F |
| ``host-gaps`` | ``host-gaps US [rank=R]`` | host gaps between runtime calls of a step capped at US (a CUDA graph) |
| ``host-stalls`` | ``host-stalls US [rank=R]`` | host stalls (stretches of at least US outside every CPU op and runtime call) removed |
| ``launch-cost`` | ``launch-cost US [rank=R]`` | launch calls capped at US each |
| ``host-speed`` | ``host-speed F [rank=R]`` | the host runs F times as fast: host gaps and host call durations / F |
| ``host-from`` | ``host-from DST SRC`` | rank DST gets rank SRC's host timeline (gaps and call times) |
| ``async`` | ``async [SEL]`` | blocking calls (by name: ``name~=Synchronize``) no longer wait for the GPU |
| ``kv-rows`` | ``kv-rows SEL`` | the selected cast reads only the active KV rows: time x active rows / pool rows |
| ``trim`` | ``trim SEL US`` | the selected operations lose US per step in total, in proportion to their time |
| ``graph-gaps`` | ``graph-gaps [rank=R]`` | gaps between kernels that ran back to back capped at this GPU's CUDA-graph kernel gap (``rules/tables/replay.yaml``) |
| ``gemm-m`` | ``gemm-m SEL F`` | the selected GEMMs at F times their M (a batch change), from the measured M-efficiency curve |
| ``to-roofline`` | ``to-roofline SEL PCT`` | the selected kernels at PCT% of their roofline (floor / (PCT / 100)), none slower than measured |
| ``batch`` | ``batch N, batch Fx, batch max [max-running-requests=R]`` | the decode step at running batch N (F x the observed one; max: the largest the server holds), every kernel scaled by what it depends on (:mod:`.batch`) |

No edit makes a kernel shorter than its roofline floor (:mod:`traceinspect.measure.roofline`): after the
edits, every kernel with a floor is held at it (``remove`` takes the work away, ``kv-rows`` and ``gemm-m``
change the work and with it the floor).

``SEL`` is ``key=value`` / ``key~=regex`` / ``key!~=regex`` terms joined by commas: ``class``,
``name``, ``op`` (the enclosing CPU-op path), ``kind``, ``rank``; as in a rule's ``select:``.
"""

from __future__ import annotations

import hashlib
import re
import shlex
from typing import Any

import msgspec
import numpy as np

from traceinspect.errors import ConfigError
from traceinspect.model.edits import KINDS, SELECT_KEYS
from traceinspect.saferegex import RegexError, compile_safe


class EditError(ConfigError):
    """An edit that cannot be parsed."""


class Select(msgspec.Struct):
    """Which GPU operations (or host calls) an edit touches."""

    classes: tuple[str, ...] = ()
    name: re.Pattern[str] | None = None
    not_name: re.Pattern[str] | None = None
    op: re.Pattern[str] | None = None
    not_op: re.Pattern[str] | None = None
    kinds: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    text: dict[str, Any] = msgspec.field(default_factory=dict)
    kernels: np.ndarray | None = None  # kernel rows (a finding's own subject; not in the text form)

    def to_json(self) -> dict[str, Any]:
        return dict(self.text)


class Edit(msgspec.Struct):
    kind: str
    select: Select = msgspec.field(default_factory=Select)
    value: float | None = None
    src: int | None = None  # host-from: the rank whose timeline is given
    dst: int | None = None
    text: str = ""
    times: bool = False  # batch: value is a factor of the observed batch
    cap: float | None = None  # batch: max_running_requests assumed instead of server_info's

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"edit": self.kind, "text": self.text or self.describe()}
        if self.select.text:
            out["select"] = self.select.to_json()
        if self.value is not None:
            out["value"] = self.value
        if self.kind == "host-from":
            out["rank"], out["from"] = self.dst, self.src
        if self.kind == "batch":
            out["times"] = self.times
            if self.cap is not None:
                out["max_running_requests"] = self.cap
        return out

    def describe(self) -> str:
        sel = ",".join(f"{k}{'~=' if k in ('name', 'op') else '!~=' if k.startswith('not_') else '='}{v}"
                       for k, v in self.select.text.items())
        parts = [self.kind]
        if self.kind == "batch":
            parts.append("max" if self.value is None else f"{self.value:g}" + ("x" if self.times else ""))
            if self.cap is not None:
                parts.append(f"max-running-requests={self.cap:g}")
            return " ".join(parts)
        if self.kind == "host-from":
            parts += [str(self.dst), str(self.src)]
        else:
            if sel:
                parts.append(sel)
            if self.value is not None:
                parts.append(f"{self.value:g}")
        return " ".join(parts)


def _regex(v: str, what: str) -> re.Pattern[str]:
    try:
        return compile_safe(v)
    except RegexError as e:
        raise EditError(f"{what}: {e}") from None


def make_select(spec: dict[str, Any] | None) -> Select:
    """A selector from a mapping like a rule's ``select: kernels:`` (plus ``rank``)."""
    spec = dict(spec or {})
    kernels = spec.pop("kernels", None)
    bad = set(spec) - set(SELECT_KEYS)
    if bad:
        raise EditError(f"unknown selector key {sorted(bad)[0]!r} (expected {', '.join(SELECT_KEYS)})")

    def many(v: Any) -> tuple[Any, ...]:
        return tuple(v) if isinstance(v, (list, tuple)) else (v,)

    sel = Select(text={k: v for k, v in spec.items()})
    if "class" in spec:
        sel.classes = tuple(str(x) for x in many(spec["class"]))
    if "kind" in spec:
        sel.kinds = tuple(str(x) for x in many(spec["kind"]))
    if "rank" in spec:
        try:
            sel.ranks = tuple(int(x) for x in many(spec["rank"]))
        except (TypeError, ValueError):
            raise EditError(f"rank must be an integer, got {spec['rank']!r}") from None
    for key in ("name", "not_name", "op", "not_op"):
        if key in spec:
            setattr(sel, key, _regex(str(spec[key]), key))
    if kernels is not None:
        sel.kernels = np.unique(np.asarray(kernels, dtype=np.int64))
        digest = hashlib.blake2b(sel.kernels.tobytes(), digest_size=4).hexdigest()
        sel.text["kernels"] = f"{len(sel.kernels)}#{digest}"  # (the replay's memo tells subjects apart)
    return sel


_TERM = re.compile(r"^(class|name|op|kind|rank)(=|~=|!~=)(.+)$")


def parse_select(text: str) -> Select:
    """``class=kv_cast,name~=copy`` -> :class:`Select`."""
    spec: dict[str, Any] = {}
    for term in filter(None, (t.strip() for t in text.split(","))):
        m = _TERM.match(term)
        if not m:
            raise EditError(f"bad selector term {term!r} (expected class=ID, name~=REGEX, op~=REGEX, "
                            "name!~=REGEX, kind=kernel|memcpy|memset, rank=N)")
        key, op, val = m.groups()
        if op == "!~=":
            if key not in ("name", "op"):
                raise EditError(f"{key} cannot be negated")
            key = "not_" + key
        elif op == "~=" and key not in ("name", "op"):
            raise EditError(f"{key} takes '=', not '~='")
        elif op == "=" and key in ("name", "op"):
            val = "^" + re.escape(val) + "$"
        if key in ("class", "kind", "rank") and key in spec:
            prev = spec[key] if isinstance(spec[key], list) else [spec[key]]
            spec[key] = prev + [val]
        else:
            spec[key] = val
    return make_select(spec)


def _float(tok: str, what: str) -> float:
    try:
        v = float(tok)
    except ValueError:
        raise EditError(f"{what} must be a number, got {tok!r}") from None
    if not np.isfinite(v) or v < 0:
        raise EditError(f"{what} must be a finite number >= 0, got {tok!r}")
    return v


def parse_edit(text: str) -> Edit:
    """One ``--edit`` expression (see the module docstring)."""
    try:
        toks = shlex.split(text)
    except ValueError as e:
        raise EditError(f"edit {text!r}: {e}") from None
    if not toks:
        raise EditError("empty edit")
    kind, args = toks[0].lower(), toks[1:]
    if kind not in KINDS:
        raise EditError(f"edit {text!r}: unknown edit {kind!r} (expected {', '.join(KINDS)})")
    e = Edit(kind=kind, text=text.strip())
    try:
        if kind in ("scale", "trim", "gemm-m", "to-roofline"):
            if len(args) != 2:
                raise EditError(f"{kind} takes a selector and a number: '{kind} class=kv_cast 0.2'")
            e.select, e.value = parse_select(args[0]), _float(args[1], "the factor" if kind == "scale" else "US")
        elif kind in ("remove", "kv-rows"):
            if len(args) != 1:
                raise EditError(f"{kind} takes a selector: '{kind} class=kv_cast'")
            e.select = parse_select(args[0])
        elif kind == "transfer":
            if len(args) not in (1, 2):
                raise EditError("transfer takes [selector] factor: 'transfer 0.5'")
            e.select = parse_select(args[0]) if len(args) == 2 else make_select({"class": "comm"})
            e.value = _float(args[-1], "the factor")
        elif kind in ("host-gaps", "host-stalls", "launch-cost"):
            if len(args) not in (1, 2):
                raise EditError(f"{kind} takes microseconds and an optional rank=N: '{kind} 0'")
            e.value = _float(args[0], "US")
            if len(args) == 2:
                e.select = parse_select(args[1])
        elif kind == "host-speed":
            if len(args) not in (1, 2):
                raise EditError("host-speed takes a factor and an optional rank=N: 'host-speed 1.5' (the host "
                                "1.5 times as fast)")
            e.value = _float(args[0], "the factor")
            if e.value <= 0:
                raise EditError(f"the factor must be above 0, got {args[0]!r}")
            if len(args) == 2:
                e.select = parse_select(args[1])
        elif kind == "host-from":
            if len(args) != 2:
                raise EditError("host-from takes two ranks: 'host-from 1 0' (rank 1 gets rank 0's host timeline)")
            try:
                e.dst, e.src = int(args[0]), int(args[1])
            except ValueError:
                raise EditError("host-from takes two rank numbers") from None
        elif kind in ("async", "graph-gaps"):
            e.select = parse_select(args[0]) if args else Select()
        elif kind == "batch":
            _parse_batch(e, args)
    except EditError as err:
        raise EditError(f"edit {text!r}: {err}") from None
    return e


def parse_batch_value(tok: str) -> tuple[float | None, bool]:
    """``512`` -> (512, False); ``4x`` -> (4, True); ``max`` -> (None, False)."""
    t = tok.strip().lower()
    if t == "max":
        return None, False
    times = t.endswith("x")
    v = _float(t[:-1] if times else t, "the batch")
    if v <= 0:
        raise EditError(f"the batch must be above 0, got {tok!r}")
    return v, times


def _parse_batch(e: Edit, args: list[str]) -> None:
    if len(args) not in (1, 2):
        raise EditError("batch takes a batch (N, Fx or max) and an optional max-running-requests=R: 'batch 4x'")
    e.value, e.times = parse_batch_value(args[0])
    if len(args) == 2:
        key, _, v = args[1].partition("=")
        if key != "max-running-requests":
            raise EditError(f"unknown batch option {args[1]!r} (expected max-running-requests=R)")
        e.cap = _float(v, "max-running-requests")
        if e.cap < 1:
            raise EditError(f"max-running-requests must be at least 1, got {v!r}")


def edit_from_mapping(d: dict[str, Any], subject: dict[str, Any] | None = None) -> Edit:
    """An edit from its YAML form ``{edit: KIND, select: {...}, value: V, rank: R, from: S}``.
    ``select: subject`` takes the finding's own selection; ``rank``/``from`` may name ``subject`` (the
    finding's rank), ``fastest`` (the rank with the least host time per step, other than the subject)
    or ``latest`` (the rank arriving last at most collectives), resolved from ``subject``."""
    subject = subject or {}
    kind = str(d.get("edit", "")).lower()
    if kind not in KINDS:
        raise EditError(f"unknown edit {kind!r} (expected {', '.join(KINDS)})")
    bad = set(d) - {"edit", "select", "value", "rank", "from"}
    if bad:
        raise EditError(f"edit {kind}: unknown key {sorted(bad)[0]!r}")
    sel = d.get("select")
    if sel == "subject":
        sel = subject.get("select", {})
    e = Edit(kind=kind, select=make_select(sel if isinstance(sel, dict) else None))
    v = d.get("value")
    if kind == "batch":  # a batch, 'Fx' or 'max' (the default: the largest batch the server holds)
        e.value, e.times = (None, False) if v is None else parse_batch_value(str(v))
    else:
        e.value = None if v is None else _float(str(v), f"edit {kind}: value")

    def rank_of(ref: Any) -> int | None:
        if ref is None or isinstance(ref, int):
            return ref
        got = subject.get("rank" if ref == "subject" else f"{ref}_rank")
        return int(got) if got is not None else None

    if kind == "host-from":
        e.dst, e.src = rank_of(d.get("rank")), rank_of(d.get("from", "fastest"))
    e.text = e.describe()
    return e


# ----------------------------------------------------------------------------- application
