"""Diff two analyses and gate a candidate against its baseline (for CI).

Public API::

    base = load_document("baseline.json")              # a stored analysis JSON
    cand = traceinspect.analyze("traces/").to_json()   # or the document of a trace set
    d = diff_documents(base, cand)                     # what changed
    r = Gate(["step:5%", "class.kv_cast:10%"]).run(base, cand)
    r.exit_code, r.reasons()                           # 0 pass, 1 regression/finding, 2 unusable
"""

from traceinspect.gate.core import DEFAULT_FAIL_ON, FAIL_ON, Check, Gate, GateResult, gate_documents
from traceinspect.gate.diff import Diff, MetricDelta, diff_documents
from traceinspect.gate.document import load_document, validate_document
from traceinspect.gate.stats import DEFAULT_ALPHA, NoiseTest, noise_test
from traceinspect.gate.thresholds import (
    DEFAULT_FLOOR,
    DEFAULT_THRESHOLDS,
    Floor,
    Threshold,
    merge_thresholds,
    parse_floor,
    parse_threshold,
)

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_FAIL_ON", "DEFAULT_FLOOR", "DEFAULT_THRESHOLDS", "FAIL_ON",
    "Check", "Diff", "Floor", "Gate", "GateResult", "MetricDelta", "NoiseTest", "Threshold",
    "diff_documents", "gate_documents", "load_document", "merge_thresholds", "noise_test",
    "parse_floor", "parse_threshold", "validate_document",
]
