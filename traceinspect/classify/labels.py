"""Labels of a whole trace: one class per distinct (name, op path, kind), then the evidence checks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from traceinspect.classify.experts import mark_experts, verify_experts
from traceinspect.classify.graphs import CAPTURED_NOTE, captured_rows
from traceinspect.classify.kv import promote_kv
from traceinspect.classify.modelshapes import model_gemms
from traceinspect.classify.runfacts import decide as decide_run
from traceinspect.classify.table import ClassTable, Label, default_table
from traceinspect.model import TraceSet
from traceinspect.model.run import RunModel
from traceinspect.tables import (
    factorize_text,
    groups,
    set_object_column,
    string_column,
    text_values,
)

if TYPE_CHECKING:
    from traceinspect.classify.graphs import GraphOps


# ----------------------------------------------------------------------------- whole traces


def classify_kernels(ts: TraceSet, steps: pd.DataFrame, table: ClassTable | None = None,
                     graph_ops: GraphOps | None = None, run: RunModel | None = None,
                     user: Mapping[str, tuple[int, str]] | None = None, phase: str = "decode") -> RunModel:
    """Add ``cls``, ``cls2`` and ``cls_evidence`` to ``ts.kernels`` in place, decide the run model
    (:func:`traceinspect.classify.runfacts.decide`, on the name-based classes; ``run`` given: that one), then
    apply the trace-evidence checks (:func:`mark_experts`, :func:`verify_experts`, :func:`promote_kv`).
    ``steps`` is the steps table (rank, idx, included); ``ts.kernels.step`` indexes its rows.
    ``graph_ops`` (from :func:`traceinspect.classify.graphs.recover_graph_ops`) gives graph-replayed kernels the
    op path and the recorded shapes of their captured op. Returns the run model."""
    table = table or default_table()
    k = ts.kernels
    n = len(k)
    if n == 0:
        for c in ("cls", "cls2", "cls_evidence"):
            k[c] = pd.Series([], dtype=object)
        return run if run is not None else decide_run(ts, steps, graph_ops, user, phase)
    # one label per distinct (name, op path, kind): the three columns are factorized on their own and
    # their codes combined
    names = text_values(k["name"])
    name_codes, _ = factorize_text(k["name"] if isinstance(k["name"].dtype, pd.CategoricalDtype) else names)
    if "op_path" in k:
        ops = k["op_path"].fillna("")
        captured = captured_rows(k, graph_ops)
        if captured is not None:
            arr = ops.astype(str).to_numpy(dtype=object).copy()
            arr[captured[0]] = captured[1]
            ops = arr
        op_codes, op_uniq = pd.factorize(ops)
    else:
        captured = None
        op_codes, op_uniq = np.zeros(n, dtype=np.int64), np.array([""], dtype=object)
    kind_codes, kind_uniq = _kinds(k)
    codes, first = groups(name_codes, op_codes, kind_codes)
    op_uniq, kind_uniq = np.asarray(op_uniq, dtype=object), np.asarray(kind_uniq, dtype=object)
    labels = [table.classify(names[i], str(op_uniq[op_codes[i]]), str(kind_uniq[kind_codes[i]])) for i in first]
    per_label = {"cls": np.array([lb.cls for lb in labels], dtype=object),
                 "cls2": np.array([lb.cls2 for lb in labels], dtype=object),
                 "cls_evidence": np.array([lb.evidence for lb in labels], dtype=object)}
    evidence = per_label["cls_evidence"][codes]
    if captured is not None:
        _note_captured(table, names, kind_uniq[kind_codes], captured[0], labels, codes, evidence)
    # object columns while the checks below rewrite them (a categorical would need every new value as
    # a category first), categoricals once they are final
    set_object_column(k, "cls", per_label["cls"][codes])
    set_object_column(k, "cls2", per_label["cls2"][codes])
    set_object_column(k, "cls_evidence", evidence)
    if run is None:
        run = decide_run(ts, steps, graph_ops, user, phase)
    mark_experts(ts, steps, run, graph_ops)
    verify_experts(ts, table, run)
    promote_kv(ts, steps, table, graph_ops=graph_ops, run=run)
    model_gemms(ts, steps, run, phase)
    for c, uniq in per_label.items():
        k[c] = _categorical(k[c].to_numpy(dtype=object), codes, uniq)
    return run


def _kinds(k: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(codes, texts) of the rows' event kinds, a missing kind read as ``kernel``; a categorical column
    by its codes (a missing one: a code of its own, for the same text)."""
    if "kind" not in k:
        return np.zeros(len(k), dtype=np.int64), np.array(["kernel"], dtype=object)
    col = k["kind"]
    if isinstance(col.dtype, pd.CategoricalDtype):
        codes = col.cat.codes.to_numpy().astype(np.int64)
        uniq = np.array([*col.cat.categories.tolist(), "kernel"], dtype=object)
        codes[codes < 0] = len(uniq) - 1
        return codes, uniq
    kind_codes, kind_uniq = pd.factorize(col.astype(object).fillna("kernel").to_numpy(dtype=object))
    return kind_codes, np.asarray(kind_uniq, dtype=object)


def _categorical(values: np.ndarray, codes: np.ndarray, uniq: np.ndarray) -> pd.Categorical:
    """``values`` as a categorical, given that most rows still hold ``uniq[codes]`` (the label of their
    name): only the rows the evidence checks rewrote are factorized."""
    changed = np.nonzero(values != uniq[codes])[0]
    if len(changed):
        new_codes, new_uniq = factorize_text(values[changed])
        codes = codes.copy()
        codes[changed] = len(uniq) + new_codes
        uniq = np.concatenate([uniq, new_uniq])
    return string_column(codes, uniq)


def _note_captured(table: ClassTable, names: np.ndarray, kinds: np.ndarray, rows: np.ndarray,
                   labels: list[Label], codes: np.ndarray, evidence: np.ndarray) -> None:
    """Say so in the evidence where a recovered op path changed the label (the rule used the op)."""
    rows = np.asarray(rows)
    # one check per label, on the first captured row that has it
    uniq, first = np.unique(codes[rows], return_index=True)
    changed = [c for c, r in zip(uniq.tolist(), rows[first].tolist(), strict=True)
               if labels[c] != table.classify(names[r], "", str(kinds[r]))]
    if changed:
        hit = rows[np.isin(codes[rows], changed)]
        evidence[hit] = [f"{e}; {CAPTURED_NOTE}" for e in evidence[hit]]
