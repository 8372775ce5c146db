"""The class table: ordered, prioritised regex rules over kernel names, CPU op paths and event kinds
(``rules/tables/kernel_classes.yaml``), loaded and applied to one kernel name."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from traceinspect.classify.patterns import NamePattern, name_pattern
from traceinspect.errors import RuleError
from traceinspect.model.classes import CLASSES
from traceinspect.resources import lazy_module, safe_loader, tables_dir

yaml = lazy_module("yaml")

if TYPE_CHECKING:
    pass

DEFAULT_FILE = "kernel_classes.yaml"
RULE_KEYS = {"id", "class", "secondary", "priority", "name", "not_name", "op", "not_op", "has_op", "kind",
             "case_sensitive", "verify", "note"}
VERIFY = ("experts",)
MATCHERS = ("name", "not_name", "op", "not_op", "has_op", "kind")
PROMOTE_KEYS = {"from", "name", "next", "note"}
PROMOTE_TARGETS = ("kv_cast", "kv_write", "consumer")
UNMATCHED = "no rule matched"
MACRO = re.compile(r"\$\{(\w+)\}")
ATTENTION_OP = re.compile(r"attention|attn|mla|flash|sdpa|scaled_dot_product", re.IGNORECASE)
_CACHE_MAX = 500_000
_NAME_HITS_MAX = 100_000  # distinct names whose pattern results are kept
MAX_MATCH_CHARS = 4096  # real kernel names stay under ~1.5 kB; CPU op paths under a few kB


class Label(msgspec.Struct, frozen=True):
    """The class of one kernel: primary ``cls``, secondary ``cls2`` ('' unless fused), and why."""

    cls: str
    cls2: str
    evidence: str


class Rule(msgspec.Struct, frozen=True):
    """One compiled entry of a class table."""

    id: str
    cls: str
    cls2: str
    priority: int
    order: int
    source: str
    line: int
    name: tuple[NamePattern, ...] = ()
    not_name: tuple[NamePattern, ...] = ()
    op: re.Pattern[str] | None = None
    not_op: re.Pattern[str] | None = None
    has_op: bool | None = None
    kind: re.Pattern[str] | None = None
    verify: str | None = None

    def match(self, name: str, op_path: str, kind: str,
              hit: Callable[[NamePattern], bool] | None = None) -> str | None:
        """The evidence string if this rule matches, else None. ``hit(pattern)``, when given, says
        whether a name pattern matches ``name`` (a memo shared by the rules)."""
        if self.kind is not None and not self.kind.search(kind):
            return None
        if self.has_op is not None and self.has_op != bool(op_path):
            return None
        if hit is None:
            def hit(p: NamePattern) -> bool:
                return p.matches(name)
        for p in self.name:
            if not hit(p):
                return None
        for p in self.not_name:
            if hit(p):
                return None
        if self.not_op is not None and self.not_op.search(op_path):
            return None
        what = []
        if self.op is not None:
            m = self.op.search(op_path)
            if not m:
                return None
            what.append("op " + _segment(op_path, m.start()))
        if self.name:
            what.append("name")
        if self.kind is not None:
            what.append("kind " + kind)
        if self.has_op is not None:
            what.append("with op" if self.has_op else "no op")
        return f"rule {self.id} ({', '.join(what)})"


class Promotion(msgspec.Struct, frozen=True):
    """Which labels may be promoted to an evidence-based class (``kv_cast``, ``kv_write``)."""

    target: str
    sources: tuple[str, ...]
    name: re.Pattern[str] | None = None
    next: dict[str, str] = msgspec.field(default_factory=dict)  # consumer: class of the next kernel -> new class


class ClassTable(msgspec.Struct):
    """Compiled class rules, highest priority first; ``source`` is the main YAML file."""

    rules: list[Rule]
    source: Path
    extra: tuple[Path, ...] = ()
    promote: dict[str, Promotion] = msgspec.field(default_factory=dict)
    _cache: dict[tuple[str, str, str], Label] = msgspec.field(default_factory=dict)
    _name_hits: dict[str, dict[NamePattern, bool]] = msgspec.field(default_factory=dict)

    def classify(self, name: str, op_path: str = "", kind: str = "kernel") -> Label:
        """Label of one (name, op_path, kind) triple; memoised."""
        key = (name, op_path, kind)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        # the patterns see a bounded head of each string: a hostile 100 kB name costs what a real one does
        name, op_path = name[:MAX_MATCH_CHARS], op_path[-MAX_MATCH_CHARS:]
        # a name pattern is searched once per distinct name (several rules share patterns, and one name
        # comes with many op paths and kinds)
        hits = self._name_hits.get(name)
        if hits is None:
            hits = {} if len(self._name_hits) >= _NAME_HITS_MAX else self._name_hits.setdefault(name, {})

        lower = name.lower()

        def hit(p: NamePattern) -> bool:
            v = hits.get(p)
            if v is None:
                v = hits[p] = p.matches(name, lower)
            return v

        label = Label("other", "", UNMATCHED)
        for rule in self.rules:
            ev = rule.match(name, op_path, kind, hit)
            if ev is not None:
                label = Label(rule.cls, rule.cls2, ev)
                break
        if len(self._cache) < _CACHE_MAX:
            self._cache[key] = label
        return label

    def rule(self, rule_id: str) -> Rule:
        """The rule with this id (KeyError if none)."""
        for r in self.rules:
            if r.id == rule_id:
                return r
        raise KeyError(rule_id)


def _segment(op_path: str, pos: int) -> str:
    """The ' > '-separated op name of ``op_path`` that contains character ``pos``."""
    start = op_path.rfind(" > ", 0, pos + 1)
    start = 0 if start < 0 else start + 3
    end = op_path.find(" > ", pos)
    return op_path[start:] if end < 0 else op_path[start:end]


# ----------------------------------------------------------------------------- loading


class _File:
    """One YAML class file, composed into nodes so that errors can name a line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RuleError("no such class table", path) from None
        except (OSError, UnicodeDecodeError) as e:
            raise RuleError(f"cannot read class table: {e}", path) from None
        try:
            self.loader = safe_loader()(text)
            self.root = self.loader.get_single_node()
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            line = mark.line + 1 if mark is not None else 1
            raise RuleError(f"YAML syntax error: {e.problem or e}", f"{path}:{line}") from None
        except yaml.YAMLError as e:
            raise RuleError(f"YAML error: {e}", path) from None

    def error(self, node: yaml.Node | None, reason: str) -> RuleError:
        line = node.start_mark.line + 1 if node is not None else 1
        return RuleError(reason, f"{self.path}:{line}")

    def value(self, node: yaml.Node) -> Any:
        try:
            return self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as e:
            raise self.error(node, f"bad value: {e}") from None

    def mapping(self, node: yaml.Node | None, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.error(node, f"{what} must be a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            key = self.value(k)
            if not isinstance(key, str):
                raise self.error(k, f"{what}: keys must be strings, got {key!r}")
            if key in out:
                raise self.error(k, f"{what}: duplicate key '{key}'")
            out[key] = (k, v)
        return out


def _pattern_text(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], key: str) -> str:
    if not isinstance(raw, str) or not raw.strip():
        raise f.error(node, f"'{key}' must be a non-empty regex string")

    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in macros:
            raise f.error(node, f"'{key}': unknown macro ${{{m.group(1)}}} (known: {', '.join(sorted(macros))})")
        return macros[m.group(1)]

    text = MACRO.sub(sub, raw)
    return re.sub(r"\s*\|\s*", "|", text).strip()  # long alternations may be folded over lines


def _pattern(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], flags: int, key: str) -> re.Pattern[str]:
    text = _pattern_text(f, node, raw, macros, key)
    try:
        return re.compile(text, flags)
    except re.error as e:
        raise f.error(node, f"'{key}': bad regex: {e}") from None


def _name_pattern(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], flags: int, key: str) -> NamePattern:
    text = _pattern_text(f, node, raw, macros, key)
    try:
        return name_pattern(text, flags)
    except re.error as e:
        raise f.error(node, f"'{key}': bad regex: {e}") from None


def _patterns(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], flags: int,
              key: str) -> tuple[NamePattern, ...]:
    items = raw if isinstance(raw, list) else [raw]
    nodes = node.value if isinstance(node, yaml.SequenceNode) else [node] * len(items)
    if not items:
        raise f.error(node, f"'{key}' must not be empty")
    return tuple(_name_pattern(f, n, r, macros, flags, key) for n, r in zip(nodes, items, strict=True))


def _class_id(f: _File, node: yaml.Node, raw: Any, key: str) -> str:
    if not isinstance(raw, str) or raw not in CLASSES:
        raise f.error(node, f"'{key}': unknown class id {raw!r} (known: {', '.join(CLASSES)})")
    return raw


def _parse_rule(f: _File, node: yaml.Node, index: int, macros: dict[str, str]) -> dict[str, Any]:
    m = f.mapping(node, f"rules[{index}]")
    for key, (kn, _) in m.items():
        if key not in RULE_KEYS:
            raise f.error(kn, f"rules[{index}]: unknown key '{key}' (known: {', '.join(sorted(RULE_KEYS))})")
    if "class" not in m:
        raise f.error(node, f"rules[{index}]: 'class' is required")
    if "priority" not in m:
        raise f.error(node, f"rules[{index}]: 'priority' is required")
    if not any(k in m for k in MATCHERS):
        raise f.error(node, f"rules[{index}]: needs at least one matcher ({', '.join(MATCHERS)})")
    vals = {k: f.value(v) for k, (_, v) in m.items()}
    vnode = {k: v for k, (_, v) in m.items()}
    line = node.start_mark.line + 1
    cls = _class_id(f, vnode["class"], vals["class"], "class")
    cls2 = _class_id(f, vnode["secondary"], vals["secondary"], "secondary") if "secondary" in m else ""
    prio = vals["priority"]
    if isinstance(prio, bool) or not isinstance(prio, int):
        raise f.error(vnode["priority"], f"'priority' must be an integer, got {prio!r}")
    cs = vals.get("case_sensitive", False)
    if not isinstance(cs, bool):
        raise f.error(vnode["case_sensitive"], "'case_sensitive' must be true or false")
    has_op = vals.get("has_op")
    if has_op is not None and not isinstance(has_op, bool):
        raise f.error(vnode["has_op"], "'has_op' must be true or false")
    verify = vals.get("verify")
    if verify is not None and verify not in VERIFY:
        raise f.error(vnode["verify"], f"'verify' must be one of {', '.join(VERIFY)}, got {verify!r}")
    rid = vals.get("id", f"{cls}@{line}")
    if not isinstance(rid, str) or not rid:
        raise f.error(vnode.get("id", node), "'id' must be a non-empty string")
    flags = 0 if cs else re.IGNORECASE
    out: dict[str, Any] = {"id": rid, "cls": cls, "cls2": cls2, "priority": prio, "line": line,
                           "source": str(f.path), "has_op": has_op, "verify": verify}
    for key in ("name", "not_name"):
        if key in m:
            out[key] = _patterns(f, vnode[key], vals[key], macros, flags, key)
    for key in ("op", "not_op"):
        if key in m:
            out[key] = _pattern(f, vnode[key], vals[key], macros, flags, key)
    if "kind" in m:
        out["kind"] = _pattern(f, vnode["kind"], vals["kind"], macros, re.IGNORECASE, "kind")
    return out


def _parse_file(path: Path, base_macros: dict[str, str]) -> tuple[list[dict[str, Any]], dict[str, Promotion],
                                                                 dict[str, str]]:
    f = _File(path)
    if f.root is None:
        raise RuleError("empty class table", f"{path}:1")
    top = f.mapping(f.root, "class table")
    known = {"version", "macros", "rules", "promote"}
    for key, (kn, _) in top.items():
        if key not in known:
            raise f.error(kn, f"unknown top-level key '{key}' (known: {', '.join(sorted(known))})")
    if "version" in top:
        ver = f.value(top["version"][1])
        if ver != 1:
            raise f.error(top["version"][1], f"unsupported version {ver!r} (this traceinspect reads version 1)")
    macros = dict(base_macros)
    if "macros" in top:
        for name, (_, vn) in f.mapping(top["macros"][1], "macros").items():
            raw = f.value(vn)
            if not isinstance(raw, str):
                raise f.error(vn, f"macro '{name}' must be a string")
            macros[name] = MACRO.sub(lambda m: macros.get(m.group(1), m.group(0)), raw)
            _name_pattern(f, vn, macros[name], macros, 0, f"macros.{name}")
    rules: list[dict[str, Any]] = []
    if "rules" in top:
        seq = top["rules"][1]
        if not isinstance(seq, yaml.SequenceNode):
            raise f.error(seq, "'rules' must be a list of entries")
        rules = [_parse_rule(f, n, i, macros) for i, n in enumerate(seq.value)]
    promote: dict[str, Promotion] = {}
    if "promote" in top:
        for target, (kn, vn) in f.mapping(top["promote"][1], "promote").items():
            if target not in PROMOTE_TARGETS:
                raise f.error(kn, f"promote: unknown target '{target}' (known: {', '.join(PROMOTE_TARGETS)})")
            pm = f.mapping(vn, f"promote.{target}")
            for key, (pk, _) in pm.items():
                if key not in PROMOTE_KEYS:
                    raise f.error(pk, f"promote.{target}: unknown key '{key}'")
            if "from" not in pm:
                raise f.error(vn, f"promote.{target}: 'from' is required")
            src = f.value(pm["from"][1])
            src = [src] if isinstance(src, str) else src
            if not isinstance(src, list) or not src:
                raise f.error(pm["from"][1], f"promote.{target}: 'from' must be a class id or a list of them")
            sources = tuple(_class_id(f, pm["from"][1], s, "from") for s in src)
            pat = (_pattern(f, pm["name"][1], f.value(pm["name"][1]), macros, re.IGNORECASE, "name")
                   if "name" in pm else None)
            nxt: dict[str, str] = {}
            if target == "consumer":
                if "next" not in pm:
                    raise f.error(vn, "promote.consumer: 'next' is required")
                for a, (an, bn) in f.mapping(pm["next"][1], "promote.consumer.next").items():
                    nxt[_class_id(f, an, a, "next")] = _class_id(f, bn, f.value(bn), "next")
            elif "next" in pm:
                raise f.error(pm["next"][0], f"promote.{target}: 'next' is only for 'consumer'")
            promote[target] = Promotion(target, sources, pat, nxt)
    return rules, promote, macros


def load_class_table(path: str | Path | None = None, extra: Sequence[Path] = ()) -> ClassTable:
    """Load and compile a class table (default: the shipped ``rules/tables/kernel_classes.yaml``).

    ``extra`` files add rules (and may use the main file's macros); on equal priority their rules
    win over the main file's. Raises :class:`RuleError` naming file and line on a malformed file.
    """
    main = Path(path) if path is not None else tables_dir() / DEFAULT_FILE
    raw, promote, macros = _parse_file(main, {})
    extras = tuple(Path(p) for p in extra)
    ordered: list[dict[str, Any]] = []
    for p in extras:
        r, pr, _ = _parse_file(p, macros)
        ordered.extend(r)
        promote.update(pr)
    ordered.extend(raw)
    rules = [Rule(order=i, **d) for i, d in enumerate(ordered)]
    rules.sort(key=lambda r: (-r.priority, r.order))
    return ClassTable(rules=rules, source=main, extra=extras, promote=promote)


_DEFAULT: list[ClassTable] = []  # the shipped table, once read


def default_table() -> ClassTable:
    """The shipped class table, read once per process."""
    if not _DEFAULT:
        _DEFAULT.append(load_class_table())
    return _DEFAULT[0]


def classify_name(name: str, op_path: str = "", kind: str = "kernel", table: ClassTable | None = None) -> Label:
    """Class of one kernel from its name, its enclosing CPU op path (outer -> inner, ' > '-joined,
    '' when none) and its event kind (kernel | memcpy | memset)."""
    return (table or default_table()).classify(name, op_path or "", kind or "kernel")
