"""What the rules could not say: rules that could not decide on a large share of GPU time
(``undecided``), and large classes of GPU time no finding is about (``unexplained``), each with the
exact way to supply what is missing. Texts and thresholds: ``rules/tables/evidence.yaml``."""

from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

import msgspec

from traceinspect.errors import RuleError
from traceinspect.model.classes import GEMM_CLASSES
from traceinspect.model.findings import Gaps
from traceinspect.resources import lazy_module, settings_document, tables_dir

yaml = lazy_module("yaml")

if TYPE_CHECKING:
    from traceinspect.judge.engine import Outcome
    from traceinspect.judge.rule import Rule, RuleSet
    from traceinspect.model.analysis import Analysis

EVIDENCE_FILE = "evidence.yaml"
# a derived metric is missing because of what it is computed from: supply that instead
DERIVED = {"kv_pool_bytes_per_layer": ("kv_pool_tokens", "kv_row_bytes"), "kv_row_bytes": ("kv_pool_tokens",),
           "calls_per_layer": ("layers",)}


# the serving engines the supply texts of rules/tables/evidence.yaml may be written for (``any``: the rest)
ENGINE_KEYS = frozenset({"sglang", "vllm", "any"})
# CPU-op namespaces (``ns::op``) each engine registers
_ENGINE_OPS = {"sglang": ("sglang", "sgl_kernel", "sglang_profiler"), "vllm": ("vllm", "_vllm_", "_C_cache_ops")}


def serving_engine(op_names: Any, step_sources: Any, server_info: Any = None) -> str | None:
    """The serving engine that wrote a trace set: ``sglang`` (its ``step[...]`` spans, its ops, or a
    server_info.json beside the traces), ``vllm`` (its ``execute_model`` forward markers or its ops), or
    None (another program, or not known)."""
    sources = {str(s) for s in step_sources}
    names = {str(n).split("::", 1)[0] for n in op_names if "::" in str(n)}
    votes = {e: any(n == p or (p.endswith("_") and n.startswith(p)) for n in names for p in prefixes)
             for e, prefixes in _ENGINE_OPS.items()}
    if "step_span" in sources or server_info:
        votes["sglang"] = True
    if "forward_marker" in sources:
        votes["vllm"] = True
    found = [e for e, v in votes.items() if v]
    return found[0] if len(found) == 1 else None


def analysis_engine(a: Analysis) -> str | None:
    """:func:`serving_engine` of an analysis."""
    ops = a.trace.cpu_ops
    names = ops["name"].astype(str).unique() if len(ops) else []
    return serving_engine(names, a.steps["source"].unique(), a.server_info)


class EvidenceTable(msgspec.Struct, frozen=True):
    """rules/tables/evidence.yaml, read."""

    undecided_share: float
    unexplained_share: float
    supply: dict[str, Any]
    about: dict[str, tuple[str, ...]]

    def how(self, metric: str, graph: bool, engine: str | None = None) -> str:
        """How to supply ``metric``: the text for the serving ``engine`` (``sglang``, ``vllm``) when the
        table has one, else its ``any`` text; of that, the ``graph`` or ``eager`` text."""
        v = self.supply.get(metric, self.supply.get("default", ""))
        if isinstance(v, dict) and set(v) & ENGINE_KEYS:
            v = v.get(engine or "any", v.get("any", ""))
        if isinstance(v, dict):
            v = v.get("graph" if graph else "eager") or next(iter(v.values()), "")
        return " ".join(str(v).split())

    def classes_of(self, metrics: set[str]) -> set[str]:
        return {c for c, prefixes in self.about.items() for m in metrics if m.startswith(prefixes)}


@lru_cache(maxsize=1)
def evidence_table() -> EvidenceTable:
    path = tables_dir() / EVIDENCE_FILE
    try:
        doc = settings_document(EVIDENCE_FILE)
    except (OSError, yaml.YAMLError) as e:
        raise RuleError(f"cannot read the evidence table: {e}", path) from None
    if not isinstance(doc, dict):
        raise RuleError("the evidence table must be a mapping", path)
    th = doc.get("thresholds") or {}
    about = {str(c): tuple(str(p) for p in ps) for c, ps in (doc.get("about") or {}).items()}
    return EvidenceTable(float(th.get("undecided_share", 0.05)), float(th.get("unexplained_share", 0.30)),
                         dict(doc.get("supply") or {}), about)


def _share(o: Outcome) -> float | None:
    for key in ("share", "class_share"):
        v = o.values.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def _condition_metrics(rule: Rule) -> set[str]:
    """Metrics the rule's conditions read (through its ``let`` names)."""
    out: set[str] = set()
    todo = [n for c in rule.when for n in c.names]
    seen: set[str] = set()
    while todo:
        n = todo.pop()
        if n in seen or n in rule.params:
            continue
        seen.add(n)
        if n in rule.let:
            todo.extend(rule.let[n].names)
        else:
            out.add(n)
    return out


def _supply(metrics: dict[str, str], run_missing: dict[str, str], graph: bool, table: EvidenceTable,
            engine: str | None = None) -> list[str]:
    out: dict[str, None] = {}
    for m in metrics:
        roots = [d for d in DERIVED.get(m, ()) if d in run_missing] or [m]
        for r in roots:
            roots2 = [d for d in DERIVED.get(r, ()) if d in run_missing] or [r]
            for r2 in roots2:
                out.setdefault(table.how(r2, graph, engine), None)
    return [s for s in out if s]


def find_gaps(a: Analysis, rule_set: RuleSet, outcomes: list[Outcome]) -> Gaps:
    """The undecided and unexplained entries of an analysis (see the module docstring)."""
    table = evidence_table()
    gaps = Gaps()
    rules = {r.id: r for r in rule_set}
    rm = a.run_model
    engine = analysis_engine(a)
    run_missing = {n: why for n in rm.facts if (why := rm.missing(n)) is not None}
    for o in outcomes:
        if o.status != "undecided":
            continue
        share = _share(o)
        if share is None or share < table.undecided_share:
            continue
        graph = float(o.values.get("graph_share") or 0.0) > 0.5 or (
            o.values.get("graph_share") is None and bool(len(a.kernels)) and bool(a.kernels["graph_replay"].mean() > 0.5))
        rule = rules.get(o.rule)
        gaps.undecided.append({
            "rule": o.rule, "title": rule.title if rule is not None else "", "subject": o.subject,
            "share": round(share, 6),
            "missing": [f"{m}: {why}" for m, why in o.missing.items()] or list(o.reasons),
            "how_to_supply": _supply(o.missing, run_missing, graph, table, engine),
        })
    gaps.undecided.sort(key=lambda u: -u["share"])

    k = a.kernels
    total = float(k["dur"].sum()) if len(k) else 0.0
    if total <= 0:
        return gaps
    shares = k.groupby("cls", observed=True)["dur"].sum() / total
    about: dict[str, list[Outcome]] = {}
    for o in outcomes:
        rule = rules.get(o.rule)
        cls = set(o.classes)
        if rule is not None:
            cls |= set(rule.select.classes or ()) | table.classes_of(_condition_metrics(rule))
            if rule.select.scope == "gemm" and not rule.select.classes:  # a GEMM-scope rule is about the GEMMs
                cls |= ({"moe_gemm"} if rule.select.moe else set(GEMM_CLASSES) - {"moe_gemm"}
                        if rule.select.moe is False else set(GEMM_CLASSES))
        for c in cls:
            about.setdefault(c, []).append(o)
    for c, sh in shares.sort_values(ascending=False).items():
        if sh <= table.unexplained_share:
            break
        mine = about.get(str(c), [])
        if any(o.status == "fired" for o in mine):
            continue
        explain: list[str] = []
        for o in mine:
            if o.status == "undecided":
                miss = ", ".join(o.missing) or "; ".join(o.reasons)
                sup = _supply(o.missing, run_missing, bool(k["graph_replay"].mean() > 0.5), table, engine)
                explain.append(f"rule {o.rule} could not decide (missing: {miss})"
                               + (f": {sup[0]}" if sup else ""))
            elif o.status == "silent":
                explain.append(f"rule {o.rule} is silent: {o.reasons[0] if o.reasons else 'its conditions are false'}")
        if str(c) == "other":
            explain.append("`traceinspect classify PATH --unknown` lists the unclassified kernels; patterns for "
                           "them go into a class table of your own (rules/tables/kernel_classes.yaml format)")
        elif not mine:
            explain.append(f"no rule is about class {c}: `traceinspect classify PATH` lists its kernels; a rule "
                           "file of your own can judge them (docs/rules/format.md)")
        gaps.unexplained.append({"cls": str(c), "share": round(float(sh), 6), "explain_with": explain})
    return gaps
