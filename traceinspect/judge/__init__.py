"""Stage 6, judge: rules from ``rules/*.yaml`` evaluated over the metric namespace of an analysis.

Inputs: the measured analysis record and a rule set.
Outputs: the findings, each with its rule's fixes still to replay, and what the rules could not decide.

Public API: :class:`Finding`, :class:`Rule`, :class:`RuleSet`, :func:`load_rule_set`,
:func:`evaluate` (findings sorted by estimated saving) and :func:`explain` (every rule's outcome
and the reasons, for ``--explain``-style output).
"""

from __future__ import annotations

from traceinspect.judge.engine import Finding, Outcome, evaluate, explain
from traceinspect.judge.rule import Rule, RuleSet
from traceinspect.judge.rules import load_rule_file, load_rule_set

__all__ = ["Finding", "Outcome", "Rule", "RuleSet", "evaluate", "explain", "load_rule_file", "load_rule_set"]
