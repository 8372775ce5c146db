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
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from traceinspect.errors import ConfigError
from traceinspect.model.edits import KINDS, SELECT_KEYS
from traceinspect.saferegex import RegexError, compile_safe
from traceinspect.tables import name_mask, text_values

if TYPE_CHECKING:
    from traceinspect.measure.replay.model import Model
    from traceinspect.measure.replay.sim import Params
    from traceinspect.model.analysis import Analysis


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
def op_mask(a: Analysis, m: Model, sel: Select) -> np.ndarray:
    """Ops of the model the selector picks."""
    mask = np.ones(m.n_ops, dtype=bool)
    if sel.kernels is not None:
        mask &= np.isin(m.g_kidx, sel.kernels)
    if sel.classes:
        mask &= np.isin(m.g_cls, list(sel.classes))
    if sel.ranks:
        mask &= np.isin(m.g_rank, list(sel.ranks))
    by_name = sel.name is not None or sel.not_name is not None
    by_op = sel.op is not None or sel.not_op is not None
    if not sel.kinds and not by_name and not by_op:
        return mask
    k = a.kernels.loc[m.g_kidx]  # only the columns' rows of the replayed ops, when a text test needs them
    if sel.kinds:
        mask &= np.isin(text_values(k["kind"]), list(sel.kinds))
    if by_name:
        mask &= name_mask(k["name"], sel.name, sel.not_name)
    if by_op:
        mask &= name_mask(k["op_path"] if "op_path" in k.columns else k["op_name"], sel.op, sel.not_op)
    return mask


def kv_rows(a: Analysis, cache: dict[str, Any] | None = None) -> tuple[float | None, float | None, str]:
    """(active rows, pool rows, where from or why not): the KV rows a decode step reads, from the ops that
    gather rows out of a pool-shaped tensor (recorded shapes, or the CUDA-graph capture trace); found
    once per ``cache``."""
    from traceinspect.measure.replay.kvrows import cached_active_kv_rows

    return cached_active_kv_rows(a, cache)


class Applied(msgspec.Struct):
    """Parameters after the edits, and what could not be decided."""

    params: Params
    undecided: list[str] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    floors: np.ndarray | None = None  # per op: the roofline floor after the edits (NaN: unknown)
    batch: Any = None  # the BatchPlan of a batch edit (measure.replay.batch)


def op_floors(a: Analysis, m: Model, cache: dict[str, Any] | None = None) -> np.ndarray:
    """Per replayed op: its roofline floor (us; :func:`~traceinspect.measure.roofline.kernel_floors`), at
    most its measured time (a model that overestimates the bytes, e.g. of a tensor the cache holds, never
    lengthens a kernel), NaN where the shapes are unknown and for collectives. Found once per ``cache``."""
    if cache is not None and "op_floors" in cache:
        return cache["op_floors"]
    from traceinspect.measure.roofline import kernel_floors

    kf = kernel_floors(a.efficiency) if getattr(a, "efficiency", None) is not None else None
    fl = np.full(m.n_ops, np.nan)
    if kf is not None and len(kf):
        fl = kf.reindex(m.g_kidx).to_numpy(dtype=np.float64)
    fl = np.where((m.g_inst >= 0) | ~np.isfinite(fl), np.nan, np.minimum(fl, m.g_dur))
    if cache is not None:
        cache["op_floors"] = fl
    return fl


def apply_edits(a: Analysis, m: Model, edits: list[Edit], base: Params,
                cache: dict[str, Any] | None = None) -> Applied:
    """Apply ``edits`` in order to a copy of ``base`` (``cache``: facts found once per replayer)."""
    hspeed = base.hspeed.copy() if base.hspeed is not None else np.ones(len(m.h_t))
    p = msgspec.structs.replace(base, dur=base.dur.copy(), res=base.res.copy(), lA=base.lA.copy(), lS=base.lS.copy(),
                                gap=base.gap.copy(), hdur=base.hdur.copy(), block=base.block.copy(),
                                r=base.r.copy(), hspeed=hspeed)
    out = Applied(params=p)
    coll = m.g_inst >= 0
    floor = op_floors(a, m, cache).copy()
    for e in edits:
        if e.kind in ("scale", "remove", "transfer", "kv-rows", "trim", "gemm-m", "to-roofline"):
            mask = op_mask(a, m, e.select)
            if not mask.any():
                out.notes.append(f"{e.describe()}: no operation in the replayed steps matched")
                continue
            if e.kind == "kv-rows":
                active, pool, why = kv_rows(a, cache)
                if active is None or pool is None or pool <= 0:
                    out.undecided.append(f"{e.describe()}: the active KV row count cannot be decided ({why})")
                    continue
                factor = min(active / pool, 1.0)
                out.notes.append(f"{e.describe()}: time x {active:,.0f} active / {pool:,.0f} pool rows = "
                                 f"{factor:.4f} at the kernel's measured bandwidth ({why})")
                _scale(p, mask, coll, factor)
                floor[mask] *= factor  # the floor of the work that is left
            elif e.kind == "to-roofline":
                sel = mask & ~coll
                unknown = sel & ~np.isfinite(floor)
                if unknown.any():
                    out.undecided.append(f"{e.describe()}: {int(unknown.sum())} of {int(sel.sum())} selected kernels "
                                         "have no roofline floor (shapes unknown or no peak and bandwidth for this GPU)")
                    continue
                pct = float(e.value or 100.0)
                if pct <= 0:
                    out.undecided.append(f"{e.describe()}: the share of the roofline must be above 0")
                    continue
                p.dur[sel] = np.minimum(p.dur[sel], floor[sel] / min(pct / 100.0, 1.0))
            elif e.kind == "trim":
                total = float(p.dur[mask & ~coll].sum() + p.res[mask & coll].sum())
                per_step = total / max(len(m.pos) * len(m.ranks), 1)
                if e.value is None:
                    out.undecided.append(f"{e.describe()}: the time to remove is not known")
                    continue
                factor = max(1.0 - e.value / per_step, 0.0) if per_step > 0 else 1.0
                _scale(p, mask, coll, factor)
            elif e.kind == "gemm-m":
                from traceinspect.measure.replay.gemm_m import scale_m

                n_, u_ = scale_m(a, m, mask & ~coll, float(e.value or 1.0), p.dur, floor)
                out.notes += [f"{e.describe()}: {x}" for x in n_]
                out.undecided += [f"{e.describe()}: {x}" for x in u_]
            elif e.kind == "scale":
                _scale(p, mask, coll, float(e.value or 0.0))
            elif e.kind == "transfer":
                p.res[mask & coll] *= float(e.value or 0.0)
            else:  # remove
                floor[mask] = 0.0
                p.dur[mask & ~coll] = 0.0
                p.res[mask & coll] = 0.0
                p.lS[mask] = 0.0
                _remove_launches(m, p, mask)
        elif e.kind in ("host-gaps", "launch-cost"):
            hm = np.ones(len(m.h_t), dtype=bool)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            v = float(e.value or 0.0)
            if e.kind == "host-gaps":
                hm &= m.h_prev >= 0
                p.gap[hm] = np.minimum(p.gap[hm], v)
            else:
                hm &= m.h_launches & ~p.block
                p.hdur[hm] = np.minimum(p.hdur[hm], v)
        elif e.kind == "host-speed":
            hm = np.ones(len(m.h_t), dtype=bool)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            f = float(e.value or 1.0)
            # a blocking call that waited ends on the GPU: only its own time (the non-waiting ones) scales
            p.gap[hm] /= f
            nb = hm & ~p.block
            p.hdur[nb] /= f
            p.hspeed[hm] *= f
        elif e.kind == "batch":
            _batch(a, m, p, e, cache, out, floor)
        elif e.kind == "host-stalls":
            _remove_stalls(a, m, p, e, cache, out)
        elif e.kind == "graph-gaps":
            gap, why = graph_gap(a)
            if gap is None:
                out.notes.append(f"{e.describe()}: {why}; the measured gaps are kept")
                continue
            gm = np.ones(m.n_ops, dtype=bool)
            if e.select.ranks:
                gm &= np.isin(m.g_rank, list(e.select.ranks))
            p.lS[gm] = np.minimum(p.lS[gm], gap)
            out.notes.append(f"{e.describe()}: gaps between back-to-back kernels capped at {gap:g} us ({why})")
        elif e.kind == "host-from":
            why = _host_from(m, p, e)
            if why:
                out.undecided.append(f"{e.describe()}: {why}")
        elif e.kind == "async":
            hm = p.block.copy()
            if e.select.name is not None:
                hm &= name_mask(m.h_name, e.select.name, None)
            if e.select.ranks:
                hm &= np.isin(m.h_rank, list(e.select.ranks))
            p.block[hm] = False
            p.hdur[hm] = p.r[hm]
    held = np.isfinite(floor) & ~coll & (p.dur < floor - 1e-9)
    if held.any():
        steps = max(len(m.pos) * len(m.ranks), 1)
        out.notes.append(f"{held.sum() / steps:,.1f} kernel(s) per rank per step held at their roofline floor "
                         f"({float((floor[held] - p.dur[held]).sum()) / steps:,.1f} us per rank per step that the "
                         "edits would have taken below what the GPU's peaks allow)")
        p.dur[held] = floor[held]
    out.floors = floor
    return out


def _batch(a: Analysis, m: Model, p: Params, e: Edit, cache: dict[str, Any] | None, out: Applied,
           floor: np.ndarray) -> None:
    """The step at another running batch (:mod:`.batch`); ``floor`` (per op) follows the work: the new
    floors of the kernels the batch model rescales from their shapes, the others' in proportion to time."""
    from traceinspect.measure.replay.batch import plan_batch, scale_batch
    from traceinspect.measure.replay.model import load_settings

    plan, notes = plan_batch(a, e, cache)
    out.batch = plan
    out.notes += [f"{e.describe()}: {x}" for x in notes]
    if plan.why is not None or plan.factor is None:
        out.undecided.append(f"{e.describe()}: {plan.why or 'the batch cannot be decided'}")
        return
    capped = f"; capped by {plan.bound_by}" if plan.bound_by else ""
    out.notes.append(f"{e.describe()}: batch {plan.observed:,.0f} -> {plan.target:,.0f} ({plan.how}{capped})")
    coll = m.g_inst >= 0
    before, old = p.dur.copy(), floor.copy()
    n_, u_ = scale_batch(a, m, p.dur, coll, plan, load_settings(), floor)
    kept = (floor == old) & (before > 0) & (p.dur != before)
    with np.errstate(divide="ignore", invalid="ignore"):
        floor[kept] = old[kept] * p.dur[kept] / before[kept]
    out.notes += [f"{e.describe()}: {x}" for x in n_]
    out.undecided += [f"{e.describe()}: {x}" for x in u_]


def _remove_stalls(a: Analysis, m: Model, p: Params, e: Edit, cache: dict[str, Any] | None, out: Applied) -> None:
    """Host stalls of at least ``e.value`` us leave the host gaps they lie in (:mod:`.stalls`)."""
    from traceinspect.measure.replay.stalls import overlap_us, stall_stretches

    v = float(e.value or 0.0)
    key = f"stalls:{v:g}"
    st = cache.get(key) if cache is not None else None
    if st is None and getattr(a, "host", None) is not None:
        st = a.host.stalls_at(v)  # measured by the measure stage at the settings' threshold
    if st is None:
        st = stall_stretches(a, v)
        if cache is not None:
            cache[key] = st
    hm = m.h_prev >= 0
    if e.select.ranks:
        hm &= np.isin(m.h_rank, list(e.select.ranks))
    idx = np.nonzero(hm)[0]
    coll = a.collectives
    offsets = dict(coll.offsets_applied) if coll is not None else {}
    off = np.array([offsets.get(int(r), 0.0) for r in m.h_rank[idx]], dtype=np.float64)
    lo = m.h_end[m.h_prev[idx]] + off
    hi = m.h_t[idx] + off
    cut = overlap_us(st, m.h_rank[idx], m.h_tid[idx], lo, hi)
    p.gap[idx] = np.maximum(p.gap[idx] - cut, 0.0)
    steps = max(len(m.pos) * (len(e.select.ranks) or len(m.ranks)), 1)
    n = int(np.count_nonzero(cut > 0))
    out.notes.append(f"{e.describe()}: {cut.sum() / steps:,.0f} us per rank per step of host stalls (stretches of at least "
                     f"{v:g} us outside every CPU op and runtime call; {n / steps:.1f} per rank per step) removed"
                     if n else f"{e.describe()}: no host stall of at least {v:g} us in the replayed steps")


def graph_gap(a: Analysis) -> tuple[float | None, str]:
    """This GPU's kernel-to-kernel gap in a CUDA-graph replay from ``rules/tables/replay.yaml``, or why not."""
    from traceinspect.measure.replay.model import load_settings

    dev = a.device_name() or ""
    for rx, us, src in load_settings().graph_gaps:
        if rx.search(dev):
            return us, src
    return None, f"no CUDA-graph kernel gap for {dev or 'an unknown GPU'} in rules/tables/replay.yaml"


def _scale(p: Params, mask: np.ndarray, coll: np.ndarray, f: float) -> None:
    p.dur[mask & ~coll] *= f
    p.res[mask & coll] *= f


def _remove_launches(m: Model, p: Params, mask: np.ndarray) -> None:
    """A removed op's launch call goes too, with its op's host time before it, when that call launches
    nothing else (a CUDA-graph launch stays)."""
    L = m.g_launch
    has = L >= 0
    if not has.any():
        return
    n = len(p.gap)  # (one per host call: a launch's index)
    gone = np.flatnonzero((np.bincount(L[has & mask], minlength=n) > 0) & (np.bincount(L[has & ~mask], minlength=n) == 0))
    if not len(gone):
        return
    gone = gone[~p.block[gone]]
    speed = p.hspeed[gone] if p.hspeed is not None else 1.0  # the op's host time at the edited host speed
    p.gap[gone] = np.maximum(p.gap[gone] - m.h_op_in[gone] / speed, 0.0)
    p.hdur[gone] = 0.0


def _host_from(m: Model, p: Params, e: Edit) -> str | None:
    """Give rank ``e.dst`` the host gaps and call times of rank ``e.src``, call by call, on each rank's
    busiest thread. Refused when the two ranks' call sequences differ."""
    if e.dst is None or e.src is None:
        return "which rank's host timeline to give is not known"
    if e.dst == e.src:
        return "a rank cannot take its own host timeline"
    for r in (e.dst, e.src):
        if r not in m.ranks:
            return f"rank {r} is not in the replayed trace set"

    def main_calls(r: int) -> dict[int, np.ndarray]:
        idx = np.nonzero(m.h_rank == r)[0]
        tids, counts = np.unique(m.h_tid[idx], return_counts=True)
        if not len(tids):
            return {}
        tid = tids[np.argmax(counts)]
        idx = idx[m.h_tid[idx] == tid]
        return {int(q): idx[m.h_pos[idx] == q] for q in np.unique(m.h_pos[idx])}

    dst, src = main_calls(e.dst), main_calls(e.src)
    done = 0
    for q, di in dst.items():
        si = src.get(q)
        if si is None or len(si) != len(di) or bool((m.h_name[di] != m.h_name[si]).any()):
            return (f"the host call sequences of ranks {e.dst} and {e.src} differ in step position {q} "
                    f"({len(di)} vs {0 if si is None else len(si)} calls)")
        keep = m.h_prev[di] >= 0
        p.gap[di[keep]] = p.gap[si[keep]]
        nb = ~p.block[di] & ~p.block[si]
        p.hdur[di[nb]] = p.hdur[si[nb]]
        done += 1
    return None if done else f"rank {e.dst} has no host calls in the replayed steps"
