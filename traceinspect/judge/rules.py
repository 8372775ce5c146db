"""Rule files: loading and validation into the :mod:`~traceinspect.judge.rule` types (re-exported here).

A rule file is YAML with a top-level ``rules:`` list (see ``docs/rules/format.md`` for the format); every
YAML file of a rules directory is one (the shipped data tables live in ``rules/tables/``). Every problem is
reported as ``RuleError("<file>:<line>: <reason>")``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from traceinspect import units
from traceinspect.errors import ConfigError, RuleError
from traceinspect.judge import metrics as M
from traceinspect.judge.expr import Expr, ExprError, parse
from traceinspect.judge.rule import (
    EDIT_KEYS,
    FIX_KEYS,
    FORMAT_SPEC,
    GEMM_SELECT_KEYS,
    GROUP_BY,
    ID_RE,
    KERNEL_SELECT_KEYS,
    MAX_TEXT,
    OPTIONAL,
    PLACEHOLDER,
    RANK_REFS,
    REMOVES,
    REQUIRED,
    RULE_PHASES,
    SHARE_OF,
    Fix,
    FixEdit,
    Placeholder,
    Rule,
    RuleSet,
    Selector,
    split_test,
)
from traceinspect.judge.yamlsrc import LDict, LList, line_of, read_yaml
from traceinspect.model.edits import KINDS, SELECT_KEYS
from traceinspect.model.findings import SEVERITIES, SEVERITY_RANK  # noqa: F401 - importable from here too
from traceinspect.resources import rules_dir
from traceinspect.saferegex import RegexError, compile_safe


# ============================================================================= parsing helpers
class _Ctx:
    def __init__(self, path: Path) -> None:
        self.path = path

    def err(self, line: int, reason: str) -> RuleError:
        return RuleError(reason, f"{self.path}:{line}" if line else self.path)


def _text(ctx: _Ctx, rule: LDict, key: str, rid: str, required: bool = True) -> str:
    v = rule.get(key)
    if v is None:
        if required:
            raise ctx.err(line_of(rule), f"rule {rid!r}: missing {key!r}")
        return ""
    if isinstance(v, LList) and key in ("why", "remediation", "notes") and all(isinstance(x, str) for x in v):
        v = "\n".join(f"- {x}" for x in v)
    if not isinstance(v, str):
        raise ctx.err(line_of(rule, key), f"rule {rid!r}: {key!r} must be text")
    if not v.strip() and required:
        raise ctx.err(line_of(rule, key), f"rule {rid!r}: {key!r} is empty")
    if len(v) > MAX_TEXT:
        raise ctx.err(line_of(rule, key), f"rule {rid!r}: {key!r} is longer than {MAX_TEXT} characters")
    return str(v)


def _expr(ctx: _Ctx, src: Any, line: int, rid: str, key: str, scope: str, params: dict[str, Any]) -> Expr:
    if isinstance(src, bool) or not isinstance(src, (str, int, float)):
        raise ctx.err(line, f"rule {rid!r}: {key} must be an expression string")
    scope_metrics = M.registry(scope)

    def known(name: str) -> bool:
        return name in params or name in scope_metrics

    try:
        return parse(str(src), known)
    except ExprError as e:
        hint = ""
        msg = str(e)
        if msg.startswith("unknown metric"):
            name = msg.split("'")[1] if "'" in msg else ""
            other = [s for s in M.SCOPES if s != scope and name in M.registry(s)]
            if other:
                hint = f" (it is a metric of the {other[0]!r} scope; this rule selects {scope!r})"
            else:
                close = _close(name, list(scope_metrics) + list(params))
                hint = f" (did you mean {close!r}?)" if close else " (see `traceinspect rules metrics`)"
        raise ctx.err(line, f"rule {rid!r}: {key}: {msg}{hint}") from None


def _close(name: str, options: Iterable[str]) -> str | None:
    import difflib

    hit = difflib.get_close_matches(name, list(options), n=1, cutoff=0.75)
    return hit[0] if hit else None


def _regex(ctx: _Ctx, sel: LDict, key: str, rid: str) -> re.Pattern[str] | None:
    v = sel.get(key)
    if v is None:
        return None
    if isinstance(v, LList):
        if not v or not all(isinstance(x, str) for x in v):
            raise ctx.err(line_of(sel, key), f"rule {rid!r}: select.{key} must be a regex or a list of regexes")
        v = "|".join(f"(?:{x})" for x in v)
    if not isinstance(v, str):
        raise ctx.err(line_of(sel, key), f"rule {rid!r}: select.{key} must be a regex")
    try:
        return compile_safe(v)
    except RegexError as e:
        raise ctx.err(line_of(sel, key), f"rule {rid!r}: select.{key}: {e}") from None


def _str_list(ctx: _Ctx, parent: LDict, key: str, rid: str, what: str) -> list[str]:
    v = parent.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [str(v)]
    if not isinstance(v, LList) or not all(isinstance(x, str) for x in v):
        raise ctx.err(line_of(parent, key), f"rule {rid!r}: {what} must be a string or a list of strings")
    return [str(x) for x in v]


def _selector(ctx: _Ctx, rule: LDict, rid: str, params: dict[str, Any]) -> Selector:
    raw = rule.get("select")
    if raw is None or raw == "run":
        return Selector(scope="run", text={"run": True})
    line = line_of(rule, "select")
    if isinstance(raw, str) and raw in ("rank", "class"):
        return Selector(scope=raw, group_by=raw, text={raw: True})
    if not isinstance(raw, LDict):
        raise ctx.err(line, f"rule {rid!r}: select must be a mapping with one of: run, kernels, gemm, rank, class")
    scopes = [s for s in ("run", "kernels", "gemm", "rank", "class") if s in raw]
    unknown = set(raw) - {"run", "kernels", "gemm", "rank", "class", "group_by"}
    if unknown:
        raise ctx.err(line_of(raw, sorted(unknown)[0]),
                      f"rule {rid!r}: unknown select key {sorted(unknown)[0]!r} "
                      "(expected one of run, kernels, gemm, rank, class, and group_by)")
    if len(scopes) != 1:
        raise ctx.err(line, f"rule {rid!r}: select needs exactly one of run, kernels, gemm, rank, class")
    scope = scopes[0]
    body = raw[scope]
    sel = Selector(scope=scope, text=dict(raw))
    gb = raw.get("group_by", "none" if scope in ("kernels", "gemm", "run") else scope)
    if gb not in GROUP_BY[scope]:
        raise ctx.err(line_of(raw, "group_by"), f"rule {rid!r}: group_by for {scope} must be one of "
                      f"{', '.join(GROUP_BY[scope])}")
    sel.group_by = str(gb)
    if scope == "kernels":
        if not isinstance(body, LDict) or not body:
            raise ctx.err(line_of(raw, scope), f"rule {rid!r}: select.kernels needs at least one of "
                          f"{', '.join(sorted(KERNEL_SELECT_KEYS))}")
        bad = set(body) - KERNEL_SELECT_KEYS
        if bad:
            k = sorted(bad)[0]
            raise ctx.err(line_of(body, k), f"rule {rid!r}: unknown select.kernels key {k!r} "
                          f"(expected {', '.join(sorted(KERNEL_SELECT_KEYS))})")
        sel.classes = tuple(_classes(ctx, body, "class", rid))
        sel.name = _regex(ctx, body, "name", rid)
        sel.not_name = _regex(ctx, body, "not_name", rid)
        sel.op = _regex(ctx, body, "op", rid)
        sel.not_op = _regex(ctx, body, "not_op", rid)
        kinds = _str_list(ctx, body, "kind", rid, "select.kernels.kind")
        for kd in kinds:
            if kd not in ("kernel", "memcpy", "memset"):
                raise ctx.err(line_of(body, "kind"), f"rule {rid!r}: kind must be kernel, memcpy or memset")
        sel.kinds = tuple(kinds)
        g = body.get("graph")
        if g is not None and not isinstance(g, bool):
            raise ctx.err(line_of(body, "graph"), f"rule {rid!r}: select.kernels.graph must be true or false")
        sel.graph = g
    elif scope == "gemm":
        if body in (None, True):
            body = LDict()
        if not isinstance(body, LDict):
            raise ctx.err(line_of(raw, scope), f"rule {rid!r}: select.gemm must be a mapping")
        bad = set(body) - GEMM_SELECT_KEYS
        if bad:
            k = sorted(bad)[0]
            raise ctx.err(line_of(body, k), f"rule {rid!r}: unknown select.gemm key {k!r} "
                          f"(expected {', '.join(sorted(GEMM_SELECT_KEYS))})")
        moe = body.get("moe")
        if moe is not None and not isinstance(moe, bool):
            raise ctx.err(line_of(body, "moe"), f"rule {rid!r}: select.gemm.moe must be true or false")
        sel.moe = moe
        sel.classes = tuple(_classes(ctx, body, "class", rid))
        if "where" in body:
            sel.where = _expr(ctx, body["where"], line_of(body, "where"), rid, "select.gemm.where", "gemm", params)
    elif scope == "class":
        if body not in (None, True):
            if isinstance(body, LDict):
                sel.classes = tuple(_classes(ctx, body, "class", rid))
            else:
                holder = LDict(cls=body)
                holder.line = line_of(raw, scope)
                holder.lines = {"cls": line_of(raw, scope)}
                sel.classes = tuple(_classes(ctx, holder, "cls", rid))
    elif scope in ("rank", "run") and body not in (None, True, {}):
        raise ctx.err(line_of(raw, scope), f"rule {rid!r}: select.{scope} takes no options (write `{scope}: true`)")
    return sel


def _classes(ctx: _Ctx, parent: LDict, key: str, rid: str) -> list[str]:
    vals = _str_list(ctx, parent, key, rid, f"select {key}")
    ids = M.class_ids()
    for c in vals:
        if c not in ids:
            raise ctx.err(line_of(parent, key), f"rule {rid!r}: unknown kernel class {c!r} (known: {', '.join(ids)})")
    return vals


def _params(ctx: _Ctx, rule: LDict, rid: str) -> dict[str, float]:
    raw = rule.get("params")
    if raw is None:
        return {}
    if not isinstance(raw, LDict):
        raise ctx.err(line_of(rule, "params"), f"rule {rid!r}: params must map names to numbers")
    out: dict[str, float] = {}
    every = M.registry(None)
    for k, v in raw.items():
        if not re.match(r"^[a-z][a-z0-9_]*$", k):
            raise ctx.err(line_of(raw, k), f"rule {rid!r}: param name {k!r} must be lower_snake_case")
        if k in every:
            raise ctx.err(line_of(raw, k), f"rule {rid!r}: param {k!r} has the name of a metric")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ctx.err(line_of(raw, k), f"rule {rid!r}: param {k!r} must be a number")
        out[k] = v
    return out


def _let(ctx: _Ctx, rule: LDict, rid: str, scope: str, params: dict[str, float]) -> dict[str, Expr]:
    raw = rule.get("let")
    if raw is None:
        return {}
    if not isinstance(raw, LDict):
        raise ctx.err(line_of(rule, "let"), f"rule {rid!r}: let must map names to expressions")
    out: dict[str, Expr] = {}
    every = M.registry(None)
    for k, v in raw.items():
        if not re.match(r"^[a-z][a-z0-9_]*$", k):
            raise ctx.err(line_of(raw, k), f"rule {rid!r}: let name {k!r} must be lower_snake_case")
        if k in every or k in params:
            raise ctx.err(line_of(raw, k), f"rule {rid!r}: let name {k!r} is already a metric or param")
        # a let may use metrics, params and the lets defined above it
        out[k] = _expr(ctx, v, line_of(raw, k), rid, f"let.{k}", scope, {**params, **out})
    return out


def _message(ctx: _Ctx, text: str, line: int, rid: str, scope: str, params: dict[str, Any]) -> list[Placeholder]:
    out = []
    stripped = PLACEHOLDER.sub("", text)
    if "{" in stripped or "}" in stripped:
        raise ctx.err(line, f"rule {rid!r}: message has an unbalanced '{{' or '}}' (write '{{{{' for a literal brace)")
    for m in PLACEHOLDER.finditer(text):
        body = m.group(1)
        if body is None:
            continue
        expr_src, _, spec = body.partition(":")
        if not expr_src.strip():
            raise ctx.err(line, f"rule {rid!r}: message has an empty placeholder '{{}}'")
        if "!" in expr_src.replace("!=", ""):
            raise ctx.err(line, f"rule {rid!r}: message placeholder {{{body}}}: conversions ('!r') are not allowed")
        if spec and spec not in units.SPECS and not FORMAT_SPEC.match(spec):
            raise ctx.err(line, f"rule {rid!r}: message placeholder {{{body}}}: format spec {spec!r} is not "
                          "allowed (use us, pct, bytes, count, or e.g. .1f, .0%, ,.0f, d, s)")
        out.append(Placeholder(_expr(ctx, expr_src, line, rid, f"message placeholder {{{body}}}", scope, params),
                               spec))
    return out


def _tests(ctx: _Ctx, rule: LDict, rid: str) -> dict[str, list[str]]:
    raw = rule.get("tests")
    if raw is None:
        return {}
    if not isinstance(raw, LDict):
        raise ctx.err(line_of(rule, "tests"), f"rule {rid!r}: tests must be a mapping with 'fires' and 'silent'")
    bad = set(raw) - {"fires", "silent", "undecided"}
    if bad:
        k = sorted(bad)[0]
        raise ctx.err(line_of(raw, k), f"rule {rid!r}: unknown tests key {k!r} (expected fires, silent, undecided)")
    out = {}
    for k in ("fires", "silent", "undecided"):
        if k == "undecided" and k not in raw:
            continue
        out[k] = _str_list(ctx, raw, k, rid, f"tests.{k}")
        for p in (x for e in out[k] for x in split_test(e) if x is not None):
            # fixtures are trace sets beside the rules: relative paths that stay inside their roots
            if Path(p).is_absolute() or ".." in Path(p).parts or not p.strip():
                raise ctx.err(line_of(raw, k), f"rule {rid!r}: tests.{k}: {p!r} must be a relative path without "
                              "'..' (resolved against the rule file's directory, its parent, or the working directory)")
    return out


def parse_rule(ctx: _Ctx, rule: Any, index: int, line: int) -> Rule:
    """Validate one entry of a ``rules:`` list."""
    if not isinstance(rule, LDict):
        raise ctx.err(line, f"rules[{index}] must be a mapping")
    rid_raw = rule.get("id")
    if not isinstance(rid_raw, str) or not ID_RE.match(rid_raw):
        raise ctx.err(line_of(rule, "id") or line, f"rules[{index}]: 'id' must be kebab-case "
                      f"(like 'kv-full-pool-cast'), got {rid_raw!r}")
    rid = str(rid_raw)
    unknown = set(rule) - set(REQUIRED) - set(OPTIONAL)
    if unknown:
        k = sorted(unknown)[0]
        raise ctx.err(line_of(rule, k), f"rule {rid!r}: unknown key {k!r}")
    if "scope" in rule:  # the older name of phase
        if "phase" in rule:
            raise ctx.err(line_of(rule, "scope"), f"rule {rid!r}: give 'phase' only ('scope' is its older name)")
        rule["phase"] = rule["scope"]
        rule.lines["phase"] = rule.lines.get("scope", rule.line)
    for key in REQUIRED:
        if key not in rule:
            raise ctx.err(line_of(rule), f"rule {rid!r}: missing {key!r}")
    sev = rule["severity"]
    if sev not in SEVERITIES:
        raise ctx.err(line_of(rule, "severity"), f"rule {rid!r}: severity must be one of {', '.join(SEVERITIES)}")
    phase = rule["phase"]
    if phase not in RULE_PHASES:
        key = "phase" if "scope" not in rule else "scope"
        raise ctx.err(line_of(rule, key), f"rule {rid!r}: {key} must be one of {', '.join(RULE_PHASES)}")
    params = _params(ctx, rule, rid)
    sel = _selector(ctx, rule, rid, params)
    s = sel.scope
    let = _let(ctx, rule, rid, s, params)
    names: dict[str, Any] = {**params, **let}
    when_raw = rule["when"]
    if isinstance(when_raw, str):
        when = [_expr(ctx, when_raw, line_of(rule, "when"), rid, "when", s, names)]
    elif isinstance(when_raw, LList) and when_raw:
        when = [_expr(ctx, w, line_of(when_raw, i), rid, f"when[{i}]", s, names) for i, w in enumerate(when_raw)]
    else:
        raise ctx.err(line_of(rule, "when"), f"rule {rid!r}: when must be an expression or a non-empty list of them")
    estimate = _expr(ctx, rule["estimate"], line_of(rule, "estimate"), rid, "estimate", s, names)
    impact = None
    if "impact" in rule:
        impact = _expr(ctx, rule["impact"], line_of(rule, "impact"), rid, "impact", s, names)
    elif s not in ("kernels", "gemm", "class"):
        raise ctx.err(line_of(rule), f"rule {rid!r}: rules that select {s!r} need 'impact' (the time per step "
                      "of what the rule points at)")
    message = _text(ctx, rule, "message", rid)
    placeholders = _message(ctx, message, line_of(rule, "message"), rid, s, names)
    refs = rule["references"]
    if isinstance(refs, str):
        refs = [refs]
    if not isinstance(refs, list) or not all(isinstance(x, str) for x in refs):
        raise ctx.err(line_of(rule, "references"), f"rule {rid!r}: references must be a list of strings")
    evidence: dict[str, Expr] = {}
    ev_raw = rule.get("evidence")
    if ev_raw is not None:
        if isinstance(ev_raw, LList):
            for i, e in enumerate(ev_raw):
                if not isinstance(e, str) or not re.match(r"^[A-Za-z_]\w*$", e):
                    raise ctx.err(line_of(ev_raw, i), f"rule {rid!r}: evidence list items must be metric names "
                                  "(use a mapping label: expression for computed evidence)")
                evidence[str(e)] = _expr(ctx, e, line_of(ev_raw, i), rid, f"evidence[{i}]", s, names)
        elif isinstance(ev_raw, LDict):
            for k, e in ev_raw.items():
                if not re.match(r"^[a-z][a-z0-9_]*$", k):
                    raise ctx.err(line_of(ev_raw, k), f"rule {rid!r}: evidence label {k!r} must be lower_snake_case")
                evidence[k] = _expr(ctx, e, line_of(ev_raw, k), rid, f"evidence.{k}", s, names)
        else:
            raise ctx.err(line_of(rule, "evidence"), f"rule {rid!r}: evidence must be a list of metric names "
                          "or a mapping label: expression")
    share_of = rule.get("share_of", "step_time")
    if share_of not in SHARE_OF:
        raise ctx.err(line_of(rule, "share_of"), f"rule {rid!r}: share_of must be step_time (every share is of "
                      "the step time)")
    removes = rule.get("removes", "time")
    if removes not in REMOVES:
        raise ctx.err(line_of(rule, "removes"), f"rule {rid!r}: removes must be one of {', '.join(REMOVES)}")
    override = rule.get("override", False)
    if not isinstance(override, bool):
        raise ctx.err(line_of(rule, "override"), f"rule {rid!r}: override must be true or false")
    return Rule(
        id=rid, title=_text(ctx, rule, "title", rid), severity=str(sev), phase=str(phase), select=sel,
        when=when, estimate=estimate, impact=impact, message=message, placeholders=placeholders,
        why=_text(ctx, rule, "why", rid), remediation=_text(ctx, rule, "remediation", rid),
        references=[str(x) for x in refs], evidence=evidence, params=params, tests=_tests(ctx, rule, rid),
        example=_text(ctx, rule, "example", rid, required=False), notes=_text(ctx, rule, "notes", rid, required=False),
        source=ctx.path, line=line, override=override, let=let, share_of=str(share_of), removes=str(removes),
        fixes=_fixes(ctx, rule, rid, s, names),
    )


def _fixes(ctx: _Ctx, rule: LDict, rid: str, scope: str, names: dict[str, Any]) -> list[Fix]:
    """``fixes:``: a list of ``{variant, label, edits: [{edit, select, value, rank, from}]}``."""
    raw = rule.get("fixes")
    if raw is None:
        return []
    if not isinstance(raw, LList) or not raw:
        raise ctx.err(line_of(rule, "fixes"), f"rule {rid!r}: fixes must be a non-empty list")
    out: list[Fix] = []
    for i, fx in enumerate(raw):
        ln = line_of(raw, i)
        if not isinstance(fx, LDict):
            raise ctx.err(ln, f"rule {rid!r}: fixes[{i}] must be a mapping with variant, label and edits")
        bad = set(fx) - FIX_KEYS
        if bad:
            raise ctx.err(line_of(fx, sorted(bad)[0]), f"rule {rid!r}: fixes[{i}]: unknown key {sorted(bad)[0]!r}")
        variant, label, edits = fx.get("variant"), fx.get("label"), fx.get("edits")
        if not isinstance(variant, str) or not ID_RE.match(variant):
            raise ctx.err(ln, f"rule {rid!r}: fixes[{i}].variant must be kebab-case, got {variant!r}")
        if variant in {f.variant for f in out}:
            raise ctx.err(ln, f"rule {rid!r}: fix variant {variant!r} is declared twice")
        if not isinstance(label, str) or not label.strip():
            raise ctx.err(ln, f"rule {rid!r}: fixes[{i}].label must be text")
        if not isinstance(edits, LList) or not edits:
            raise ctx.err(ln, f"rule {rid!r}: fixes[{i}].edits must be a non-empty list")
        fes: list[FixEdit] = []
        for j, ed in enumerate(edits):
            el = line_of(edits, j)
            where = f"rule {rid!r}: fixes[{i}].edits[{j}]"
            if not isinstance(ed, LDict):
                raise ctx.err(el, f"{where} must be a mapping")
            bad = set(ed) - EDIT_KEYS
            if bad:
                raise ctx.err(line_of(ed, sorted(bad)[0]), f"{where}: unknown key {sorted(bad)[0]!r}")
            if ed.get("edit") not in KINDS:
                raise ctx.err(el, f"{where}: edit must be one of {', '.join(KINDS)}")
            sel = ed.get("select")
            if sel is not None and sel != "subject" and (not isinstance(sel, LDict) or set(sel) - set(SELECT_KEYS)):
                raise ctx.err(line_of(ed, "select"), f"{where}: select must be 'subject' or a mapping of "
                              f"{', '.join(SELECT_KEYS)}")
            for key in ("rank", "from"):
                v = ed.get(key)
                if v is not None and v not in RANK_REFS and not isinstance(v, int):
                    raise ctx.err(line_of(ed, key), f"{where}: {key} must be a rank number or one of "
                                  f"{', '.join(RANK_REFS)}")
            value = None
            if ed.get("value") is not None:
                value = _expr(ctx, ed["value"], line_of(ed, "value"), rid, f"fixes[{i}].edits[{j}].value", scope,
                              names)
            spec = {k: (dict(v) if isinstance(v, LDict) else v) for k, v in ed.items() if k != "value"}
            fes.append(FixEdit(spec=spec, value=value))
        out.append(Fix(variant=str(variant), label=" ".join(str(label).split()), edits=fes))
    return out


# ============================================================================= files
def load_rule_file(path: str | Path) -> list[Rule]:
    """Load and validate one rule file."""
    p = Path(path)
    ctx = _Ctx(p)
    doc = read_yaml(p)
    if not isinstance(doc, LDict) or "rules" not in doc:
        raise ctx.err(1, "not a rule file: expected a mapping with a top-level 'rules:' list")
    extra = set(doc) - {"rules", "version", "description"}
    if extra:
        k = sorted(extra)[0]
        raise ctx.err(line_of(doc, k), f"unknown top-level key {k!r} (expected rules, version, description)")
    rules = doc["rules"]
    if not isinstance(rules, LList):
        raise ctx.err(line_of(doc, "rules"), "'rules' must be a list")
    out = []
    seen: dict[str, int] = {}
    for i, r in enumerate(rules):
        rule = parse_rule(ctx, r, i, line_of(rules, i))
        if rule.id in seen:
            raise ctx.err(rule.line, f"duplicate rule id {rule.id!r} (first defined at line {seen[rule.id]})")
        seen[rule.id] = rule.line
        out.append(rule)
    return out


def rule_files(path: Path) -> list[Path]:
    """Rule files of a directory (every ``*.yaml``/``*.yml`` in it, sorted: the shipped data tables live in
    ``rules/tables/``, not beside the rules) or the file itself."""
    if path.is_dir():
        return sorted(c for c in [*path.glob("*.yaml"), *path.glob("*.yml")] if c.is_file())
    if path.is_file():
        return [path]
    raise RuleError("rule file or directory not found", path)


def shipped_rules_dir() -> Path:
    """The shipped rules directory."""
    return rules_dir()


def load_rule_set(extra: Sequence[str | Path] = (), only: Sequence[str] = (), disable: Sequence[str] = (),
                  shipped: bool = True) -> RuleSet:
    """The shipped rules plus user rule files/directories in ``extra``, filtered by ``only`` /
    ``disable`` (unknown ids are a ConfigError). A user rule with a shipped rule's id replaces it
    when it says ``override: true`` and is an error otherwise."""
    rules: list[Rule] = []
    files: list[Path] = []
    by_id: dict[str, Rule] = {}
    sources: list[tuple[Path, bool]] = []
    if shipped:
        sources += [(f, True) for f in rule_files(shipped_rules_dir())]
    for e in extra:
        sources += [(f, False) for f in rule_files(Path(e))]
    for f, is_shipped in sources:
        files.append(f)
        for r in load_rule_file(f):
            r.shipped = is_shipped
            prev = by_id.get(r.id)
            if prev is not None:
                if not r.override:
                    raise RuleError(f"rule id {r.id!r} is already defined at {prev.where} "
                                    "(add `override: true` to replace it)", f"{r.source}:{r.line}")
                rules[rules.index(prev)] = r
            else:
                rules.append(r)
            by_id[r.id] = r
    for flag, ids in (("--only", only), ("--disable", disable)):
        for i in ids:
            if i not in by_id:
                raise ConfigError(f"{flag} {i}: no such rule (known: {', '.join(sorted(by_id))})")
    if only:
        rules = [r for r in rules if r.id in set(only)]
    if disable:
        rules = [r for r in rules if r.id not in set(disable)]
    return RuleSet(rules=rules, files=files)
