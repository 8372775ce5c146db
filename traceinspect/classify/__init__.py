"""Stage 4, classify: give every GPU kernel a class id (and a second one for fused kernels).

Inputs: a linked :class:`~traceinspect.model.TraceSet`, its steps, the facts the user stated.
Outputs: every kernel's ``cls``, ``cls2`` and ``cls_evidence``, the recovered graph ops, the run model.

The class table is data (``rules/tables/kernel_classes.yaml``): ordered, prioritised regex rules over
the kernel name, the enclosing CPU op path and the event kind. Classification runs once per unique
(name, op_path, kind) triple. Then, on evidence from the whole trace:

- generic softmax / top-k kernels taken as MoE routing are checked against the expert count;
- dtype casts that read the KV cache become ``kv_cast`` and scatters into the KV pool ``kv_write``
  (recorded shapes against the KV pool size from server_info, or a once-per-layer-per-step
  recurrence under CUDA-graph replay);
- casts to 8/4-bit floats right before a quantized GEMM become ``quantize``, right before a KV
  write ``kv_write``.

CUDA-graph-replayed kernels have no CPU op; where :mod:`traceinspect.classify.graphs` recovered the op from a
graph-capture trace, its op path stands in for theirs (the evidence says so).

Every label carries its evidence (rule id and what matched, or the promotion's reason).


Modules: :mod:`~traceinspect.classify.table` (the class table and one name's label),
:mod:`~traceinspect.classify.graphs` (CPU ops of CUDA-graph replays, from capture traces),
:mod:`~traceinspect.classify.runfacts` (the run model, decided on the name-based labels),
:mod:`~traceinspect.classify.labels` (the whole trace), :mod:`~traceinspect.classify.experts` and
:mod:`~traceinspect.classify.kv` (evidence checks), :mod:`~traceinspect.classify.audit` (the coverage table).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from traceinspect.model.classes import CLASSES

if TYPE_CHECKING:
    from traceinspect.classify.audit import class_table_rows
    from traceinspect.classify.experts import mark_experts, model_has_experts, verify_experts
    from traceinspect.classify.graphs import GraphOps, recover_graph_ops
    from traceinspect.classify.kv import promote_kv
    from traceinspect.classify.labels import classify_kernels
    from traceinspect.classify.runfacts import decide as decide_run_model
    from traceinspect.classify.table import ClassTable, Label, classify_name, default_table, load_class_table

# the names above, imported when first asked for: the class table module alone (what a process that
# only reads the shipped tables needs) then loads without pandas
_EXPORTS = {
    "class_table_rows": ("audit", "class_table_rows"), "mark_experts": ("experts", "mark_experts"),
    "model_has_experts": ("experts", "model_has_experts"), "verify_experts": ("experts", "verify_experts"),
    "GraphOps": ("graphs", "GraphOps"), "recover_graph_ops": ("graphs", "recover_graph_ops"),
    "promote_kv": ("kv", "promote_kv"), "classify_kernels": ("labels", "classify_kernels"),
    "decide_run_model": ("runfacts", "decide"), "ClassTable": ("table", "ClassTable"), "Label": ("table", "Label"),
    "classify_name": ("table", "classify_name"), "default_table": ("table", "default_table"),
    "load_class_table": ("table", "load_class_table"),
}

__all__ = ["CLASSES", "ClassTable", "GraphOps", "Label", "class_table_rows", "classify_kernels", "classify_name",
           "decide_run_model", "default_table", "load_class_table", "mark_experts", "model_has_experts", "promote_kv",
           "recover_graph_ops", "verify_experts"]


def __getattr__(name: str) -> Any:
    where = _EXPORTS.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where[0]}"), where[1])
    globals()[name] = value
    return value
