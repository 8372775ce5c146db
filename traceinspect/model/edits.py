"""The vocabulary of what-if edits, shared by the rule files' ``fixes:`` (checked when a rule loads) and
the replay that applies them (:mod:`traceinspect.whatif.edits`)."""

from __future__ import annotations

KINDS = ("scale", "remove", "transfer", "host-gaps", "host-stalls", "launch-cost", "host-speed", "host-from", "async",
         "kv-rows", "trim", "gemm-m", "graph-gaps", "to-roofline", "batch")
SELECT_KEYS = ("class", "name", "not_name", "op", "not_op", "kind", "rank")
