"""Stage 7, what-if: rebuild each analysed step's dependency graph (host calls, GPU operations,
collectives), replay it as measured, and replay it with edits to predict the step a fix gives.

Inputs: the analysis record, and the judge's findings with their fixes (or edits given by hand).
Outputs: each replay's predicted step; the findings' savings and shared causes; every fix together.

``Replayer(a)`` builds the model once; ``predict(edits)`` replays with edits and returns a
:class:`Prediction` (per rank and step: measured, replayed and predicted span and busy time, the
TP step = the slowest rank's, medians over the replayed steps, and the replay's critical path).
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import pandas as pd

from traceinspect.load.native import native_available, native_module
from traceinspect.steps import group_unions
from traceinspect.tables import factorize_text
from traceinspect.whatif.edit_spec import Edit, EditError, parse_edit
from traceinspect.whatif.edits import apply_edits
from traceinspect.whatif.model import Model, build_model, describe
from traceinspect.whatif.sim import (
    BY_LAUNCH,
    BY_STREAM,
    BY_XSTREAM,
    Params,
    Run,
    measured_params,
    simulate,
)

if TYPE_CHECKING:
    from traceinspect.model.analysis import Analysis

__all__ = ["Edit", "EditError", "Prediction", "ReplayBase", "Replayer", "parse_edit", "replay_base", "replayer"]


def _i64(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.int64)


def _f64(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64)


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None or not np.isfinite(x) else round(float(x), nd)


class Prediction(msgspec.Struct, eq=False):
    """One replay with edits, beside the replay without them."""

    edits: list[Edit]
    per_step: pd.DataFrame  # rank, pos, measured_us, replayed_us, predicted_us, *_busy_us
    undecided: list[str] = msgspec.field(default_factory=list)
    notes: list[str] = msgspec.field(default_factory=list)
    run: Run | None = None
    label: str = ""
    params: Params | None = None  # the edited quantities the run replayed
    floors: np.ndarray | None = None  # per op: the roofline floor after the edits (NaN: unknown)
    _paths: Any = None  # () -> (path as replayed, path with the edits), computed on first use
    _path_cache: tuple[dict[str, float], dict[str, float]] | None = None
    _tp: dict[str, float] = msgspec.field(default_factory=dict)  # per_step is not changed
    observed_batch: float | None = None  # the running batch of the analysed steps (bs=N), when known
    batch: Any = None  # the BatchPlan of a batch edit (whatif.batch): the batch the prediction runs

    def _path_pair(self) -> tuple[dict[str, float], dict[str, float]]:
        if self._path_cache is None:
            self._path_cache = self._paths() if self._paths is not None else ({}, {})
        return self._path_cache

    @property
    def path_replayed(self) -> dict[str, float]:
        return self._path_pair()[0]

    @property
    def path_predicted(self) -> dict[str, float]:
        return self._path_pair()[1]

    @property
    def decided(self) -> bool:
        return not self.undecided

    def tp(self, col: str) -> float:
        """Median over step positions of the slowest rank's value."""
        got = self._tp.get(col)
        if got is None:
            if not len(self.per_step):
                return float("nan")
            pos = self.per_step["pos"].to_numpy()
            v = self.per_step[col].to_numpy(dtype=np.float64)
            o = np.argsort(pos, kind="stable")
            bounds = np.flatnonzero(np.r_[True, pos[o][1:] != pos[o][:-1]])
            got = self._tp[col] = float(np.median(np.maximum.reduceat(v[o], bounds)))
        return got

    @property
    def measured_step_us(self) -> float:
        return self.tp("measured_us")

    @property
    def replayed_step_us(self) -> float:
        return self.tp("replayed_us")

    @property
    def predicted_step_us(self) -> float | None:
        return self.tp("predicted_us") if self.decided else None

    @property
    def saving_us(self) -> float | None:
        """Replayed minus predicted TP step (the model's own error cancels)."""
        p = self.predicted_step_us
        return None if p is None else self.replayed_step_us - p

    @property
    def predicted_batch(self) -> float | None:
        """The running batch of the predicted step: a batch edit's, else the observed one."""
        if self.batch is not None:
            return self.batch.target
        return self.observed_batch

    def tokens_per_s(self, which: str) -> float | None:
        """Decode tokens per second of the TP step (batch x steps per second), ``which`` of measured,
        replayed, predicted; None where the batch or the step is unknown."""
        batch = self.predicted_batch if which == "predicted" else self.observed_batch
        step = {"measured": self.measured_step_us, "replayed": self.replayed_step_us,
                "predicted": self.predicted_step_us}[which]
        if not batch or step is None or not np.isfinite(step) or step <= 0:
            return None
        return float(batch) * 1e6 / float(step)

    def rank_rows(self) -> list[dict[str, Any]]:
        out = []
        for r, g in self.per_step.groupby("rank"):
            out.append({"rank": int(r), "measured_step_us": _r(float(g["measured_us"].median())),
                        "replayed_step_us": _r(float(g["replayed_us"].median())),
                        "predicted_step_us": _r(float(g["predicted_us"].median())) if self.decided else None,
                        "measured_busy_us": _r(float(g["measured_busy_us"].median())),
                        "replayed_busy_us": _r(float(g["replayed_busy_us"].median())),
                        "predicted_busy_us": _r(float(g["predicted_busy_us"].median())) if self.decided else None})
        return out

    def moved_onto_path(self, top: int = 3) -> list[dict[str, Any]]:
        """Classes whose time on the replay's critical path grew most with the edits."""
        keys = set(self.path_replayed) | set(self.path_predicted)
        d = [(k, self.path_predicted.get(k, 0.0) - self.path_replayed.get(k, 0.0)) for k in keys]
        d = [x for x in d if x[1] > 1.0]
        d.sort(key=lambda x: -x[1])
        return [{"what": k, "us_per_step": _r(v), "before_us": _r(self.path_replayed.get(k, 0.0)),
                 "after_us": _r(self.path_predicted.get(k, 0.0))} for k, v in d[:top]]

    def to_json(self) -> dict[str, Any]:
        return {
            "label": self.label or None,
            "measured_step_us": _r(self.measured_step_us),
            "replayed_step_us": _r(self.replayed_step_us),
            "predicted_step_us": _r(self.predicted_step_us),
            "saving_us_per_step": _r(self.saving_us),
            "measured_tokens_per_s": _r(self.tokens_per_s("measured")),
            "replayed_tokens_per_s": _r(self.tokens_per_s("replayed")),
            "predicted_tokens_per_s": _r(self.tokens_per_s("predicted")),
            "batch": self.batch.to_json() if self.batch is not None else None,
            "edits": [e.to_json() for e in self.edits],
            "undecided": list(self.undecided),
            "notes": list(self.notes),
            "ranks": self.rank_rows(),
            "steps_replayed": int(self.per_step["pos"].nunique()) if len(self.per_step) else 0,
            "critical_path": {"replayed_us": {k: _r(v) for k, v in sorted(self.path_replayed.items())},
                              "predicted_us": {k: _r(v) for k, v in sorted(self.path_predicted.items())},
                              "moved_onto": self.moved_onto_path()},
        }


class ReplayBase(msgspec.Struct):
    """What a :class:`Replayer` starts from: the replay model of an analysis and its replay as measured
    (made once)."""

    model: Model
    params: Params
    run: Run
    steps: pd.DataFrame  # per replayed step (see _step_table)
    facts: dict[str, Any] = msgspec.field(default_factory=dict)  # facts edits need, found ahead (see Replayer.cache)


def replay_base(a: Analysis, max_steps: int | None = None) -> ReplayBase:
    """The replay model of ``a`` (its analysed steps, the collectives' clock offsets) and its measured replay."""
    model = build_model(a, max_steps=max_steps)
    params = measured_params(model)
    run = simulate(model, params)
    return ReplayBase(model, params, run, _step_table(model, run))


def replayed_steps(a: Analysis, model: Model) -> pd.DataFrame:
    """The rows of the steps table that ``model`` replays."""
    return a.steps.loc[model.step_rows["step"].to_numpy()]


def _step_table(m: Model, run: Run) -> pd.DataFrame:
    """rank, pos, span_us and busy_us of each replayed step of ``run``."""
    if not m.n_ops:
        return pd.DataFrame(columns=["rank", "pos", "span_us", "busy_us"])
    key = m.g_rank * 1_000_000 + m.g_pos
    bounds = np.flatnonzero(np.r_[True, key[1:] != key[:-1], True])
    first = bounds[:-1]
    span = np.maximum.reduceat(run.g_end, first) - np.minimum.reduceat(run.g_start, first)
    busy = group_unions(run.g_start, run.g_end, bounds)
    return pd.DataFrame({"rank": m.g_rank[first].astype(np.int64), "pos": m.g_pos[first].astype(np.int64),
                         "span_us": span.astype(np.float64), "busy_us": busy})


class Replayer:
    """The replay model of one analysis, its replay as measured, and replays with edits."""

    def __init__(self, a: Analysis, max_steps: int | None = None, base: ReplayBase | None = None) -> None:
        self.a = a
        base = base or replay_base(a, max_steps)
        self.model: Model = base.model
        self.base_params: Params = base.params
        self.base: Run = base.run
        self._base_steps = base.steps
        self._base_path: dict[str, float] | None = None
        self._walk: tuple[list[Any], ...] | None = None  # the model's links as lists, for path walks
        self._keys: tuple[Any, ...] | None = None  # the model's keys and step groups, for the native walk
        self._memo: dict[tuple[str, ...], Prediction] = {}
        # facts edits need, found once (e.g. the active KV rows), and the replayed steps' rows
        self.cache: dict[str, Any] = {"steps": replayed_steps(a, self.model), **base.facts}
        self.replays = 1

    def base_path(self) -> dict[str, float]:
        if self._base_path is None:
            self._base_path = self._path(self.base, self.base_params)
        return self._base_path

    def describe(self) -> dict[str, Any]:
        return describe(self.model)

    # ------------------------------------------------------------------ per step
    def _measured_vs_replayed(self) -> pd.DataFrame:
        """rank, pos, measured and replayed span and busy time, in the order of the step tables."""
        if "mvr" not in self.cache:
            meas = self.model.step_rows[["rank", "pos", "span_us", "busy_us"]].rename(
                columns={"span_us": "measured_us", "busy_us": "measured_busy_us"})
            base = self._base_steps.rename(columns={"span_us": "replayed_us", "busy_us": "replayed_busy_us"})
            self.cache["mvr"] = base[["rank", "pos"]].merge(meas, on=["rank", "pos"], how="left").assign(
                replayed_us=base["replayed_us"].to_numpy(), replayed_busy_us=base["replayed_busy_us"].to_numpy())
        return self.cache["mvr"]

    def predict(self, edits: list[Edit], label: str = "") -> Prediction:
        """The replay with ``edits`` (the same edits are replayed once)."""
        key = tuple(e.describe() for e in edits)
        hit = self._memo.get(key)
        if hit is not None:
            return Prediction(edits=list(edits), per_step=hit.per_step, undecided=hit.undecided, notes=hit.notes,
                              run=hit.run, label=label, params=hit.params, floors=hit.floors, _paths=hit._paths,
                              observed_batch=hit.observed_batch, batch=hit.batch)
        m = self.model
        applied = apply_edits(self.a, m, edits, self.base_params, self.cache)
        run = self.base if not edits else simulate(m, applied.params)
        self.replays += 1
        st = self._base_steps if not edits else _step_table(m, run)
        df = self._measured_vs_replayed()
        if len(df):
            df = df.assign(predicted_us=st["span_us"].to_numpy(), predicted_busy_us=st["busy_us"].to_numpy())
        notes = list(applied.notes)
        if run.order_conflicts:
            notes.append(f"{run.order_conflicts} dependencies were resolved out of measured order (clock noise)")
        obs = self.a.run_model.value("batch") if getattr(self.a, "run_model", None) is not None else None
        pred = Prediction(edits=list(edits), per_step=df, undecided=applied.undecided, notes=notes, run=run,
                          label=label, params=applied.params, floors=applied.floors,
                          observed_batch=float(obs) if obs and obs > 0 else None, batch=applied.batch,
                          _paths=lambda: (self.base_path(), self._path(run, applied.params)))
        self._memo[key] = pred
        return pred

    def as_measured(self) -> Prediction:
        return self.predict([])

    # ------------------------------------------------------------------ critical path
    def _path(self, run: Run, p: Params) -> dict[str, float]:
        """Mean per step of the time on the replay's critical path, by kernel class, 'comm' (transfer),
        'host', 'launch' (latency) and 'gap' (back-to-back gaps on a stream)."""
        m = self.model
        if not m.n_ops:
            return {}
        native = native_module() if native_available() else None
        if native is not None:
            return self._path_native(native, run, p)
        comp: dict[str, float] = defaultdict(float)
        # the walk reads single elements: Python lists read them several times faster than arrays
        if self._walk is None:
            self._walk = (m.g_inst.tolist(), [str(c) for c in m.g_cls.tolist()], m.g_prev.tolist(),
                          m.g_xprev.tolist(), m.g_launch.tolist(), m.h_wait.tolist(), m.h_prev.tolist())
        g_inst, g_cls, g_prev, g_xprev, g_launch, h_wait, h_prev = self._walk
        g_start, g_end, h_start = run.g_start.tolist(), run.g_end.tolist(), run.h_start.tolist()
        last_rank_op, bind, h_waited = run.last_rank_op.tolist(), run.bind.tolist(), run.h_waited.tolist()
        dur, r = p.dur.tolist(), p.r.tolist()
        steps = 0
        for q in np.unique(m.g_pos):
            idx = np.nonzero(m.g_pos == q)[0]
            cur = int(idx[np.argmax(run.g_end[idx])])
            steps += 1
            seen: set[int] = set()
            while cur >= 0 and cur not in seen:
                seen.add(cur)
                if g_inst[cur] >= 0:
                    last = last_rank_op[cur]
                    comp["comm"] += g_end[cur] - g_start[last]
                    cur = last
                else:
                    comp[g_cls[cur]] += dur[cur]
                how = bind[cur]
                if how == BY_STREAM:
                    comp["gap"] += max(g_start[cur] - g_end[g_prev[cur]], 0.0)
                    cur = g_prev[cur]
                elif how == BY_XSTREAM:
                    cur = g_xprev[cur]
                elif how == BY_LAUNCH and g_launch[cur] >= 0:
                    h = g_launch[cur]
                    comp["launch"] += max(g_start[cur] - h_start[h], 0.0)
                    cur = -1
                    while h >= 0:
                        if h_waited[h] and h_wait[h] >= 0:
                            comp["host"] += r[h]
                            cur = h_wait[h]
                            break
                        pv = h_prev[h]
                        if pv < 0:
                            break
                        comp["host"] += max(h_start[h] - h_start[pv], 0.0)
                        h = pv
                else:
                    cur = -1
        return {k: v / max(steps, 1) for k, v in comp.items()}

    def _path_native(self, native: Any, run: Run, p: Params) -> dict[str, float]:
        """:meth:`_path` by the native scanner's ``critical_walk``: the same walk, sums and key order."""
        m = self.model
        if self._keys is None:
            # one key per distinct text: a kernel class may share a name with a fixed key ("comm")
            canon: dict[str, int] = {}
            codes, uniq = factorize_text(m.g_cls)  # (distinct classes in order of first appearance)
            g_key = np.array([canon.setdefault(str(c), len(canon)) for c in uniq.tolist()], dtype=np.int64)[codes] \
                if len(codes) else np.zeros(0, dtype=np.int64)
            fixed = tuple(canon.setdefault(k, len(canon)) for k in ("comm", "gap", "launch", "host"))
            order = np.argsort(m.g_pos, kind="stable")  # the ops of each step position, in index order
            gp = m.g_pos[order]
            bounds = np.flatnonzero(np.r_[True, gp[1:] != gp[:-1], True]).astype(np.int64)
            self._keys = (list(canon), g_key, fixed, order.astype(np.int64), bounds)
        names, g_key, fixed, order, bounds = self._keys
        sums, first, steps = native.critical_walk(
            order, bounds, _i64(m.g_inst), g_key, _i64(m.g_prev), _i64(m.g_xprev), _i64(m.g_launch),
            _i64(run.bind), _i64(run.last_rank_op), _f64(run.g_start), _f64(run.g_end), _i64(m.h_wait),
            _i64(m.h_prev), _i64(run.h_waited), _f64(run.h_start), _f64(p.dur), _f64(p.r), (len(names), *fixed),
            (BY_STREAM, BY_XSTREAM, BY_LAUNCH))
        total, rank = np.frombuffer(sums, dtype=np.float64), np.frombuffer(first, dtype=np.int64)
        touched = np.flatnonzero(rank >= 0)
        return {names[k]: float(total[k]) / max(steps, 1) for k in touched[np.argsort(rank[touched])].tolist()}


def replayer(a: Analysis) -> Replayer:
    """The analysis's replayer, built on first use."""
    rp = getattr(a, "replay", None)
    if rp is None:
        rp = a.replay = Replayer(a)
    return rp
