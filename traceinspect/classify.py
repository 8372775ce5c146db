"""Stage 4, classify: give every GPU kernel a class id (and a second one for fused kernels).

The class table is data (``rules/kernel_classes.yaml``): ordered, prioritised regex rules over
the kernel name, the enclosing CPU op path and the event kind. Classification runs once per unique
(name, op_path, kind) triple. Then, on evidence from the whole trace:

- generic softmax / top-k kernels taken as MoE routing are checked against the expert count;
- dtype casts that read the KV cache become ``kv_cast`` and scatters into the KV pool ``kv_write``
  (recorded shapes against the KV pool size from server_info, or a once-per-layer-per-step
  recurrence under CUDA-graph replay);
- casts to 8/4-bit floats right before a quantized GEMM become ``quantize``, right before a KV
  write ``kv_write``.

CUDA-graph-replayed kernels have no CPU op; where :mod:`traceinspect.graphs` recovered the op from a
graph-capture trace, its op path stands in for theirs (the evidence says so).

Every label carries its evidence (rule id and what matched, or the promotion's reason).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import yaml

from traceinspect.errors import RuleError
from traceinspect.model import TraceSet
from traceinspect.resources import rules_dir
from traceinspect.runmodel import RunModel
from traceinspect.runmodel import decide as decide_run
from traceinspect.tables import (
    combine_codes,
    factorize_text,
    per_distinct,
    string_column,
    text_values,
    unique_text,
)

if TYPE_CHECKING:
    from traceinspect.graphs import GraphOps

CLASSES: tuple[str, ...] = (
    "fp4_gemm", "fp8_gemm", "bf16_gemm", "fp32_gemm", "conv", "moe_gemm", "moe_dispatch", "attention", "kv_write",
    "kv_cast", "dtype_cast", "comm", "norm", "activation", "rotary", "quantize", "sampling", "memcpy",
    "elementwise", "other",
)
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


@dataclass(frozen=True)
class Label:
    """The class of one kernel: primary ``cls``, secondary ``cls2`` ('' unless fused), and why."""

    cls: str
    cls2: str
    evidence: str


@dataclass(frozen=True)
class Rule:
    """One compiled entry of a class table."""

    id: str
    cls: str
    cls2: str
    priority: int
    order: int
    source: str
    line: int
    name: tuple[re.Pattern[str], ...] = ()
    not_name: tuple[re.Pattern[str], ...] = ()
    op: re.Pattern[str] | None = None
    not_op: re.Pattern[str] | None = None
    has_op: bool | None = None
    kind: re.Pattern[str] | None = None
    verify: str | None = None

    def match(self, name: str, op_path: str, kind: str,
              hit: Callable[[re.Pattern[str]], bool] | None = None) -> str | None:
        """The evidence string if this rule matches, else None. ``hit(pattern)``, when given, says
        whether a name pattern matches ``name`` (a memo shared by the rules)."""
        if self.kind is not None and not self.kind.search(kind):
            return None
        if self.has_op is not None and self.has_op != bool(op_path):
            return None
        if hit is None:
            def hit(p: re.Pattern[str]) -> bool:
                return p.search(name) is not None
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


@dataclass(frozen=True)
class Promotion:
    """Which labels may be promoted to an evidence-based class (``kv_cast``, ``kv_write``)."""

    target: str
    sources: tuple[str, ...]
    name: re.Pattern[str] | None = None
    next: dict[str, str] = field(default_factory=dict)  # consumer: class of the next kernel -> new class


@dataclass
class ClassTable:
    """Compiled class rules, highest priority first; ``source`` is the main YAML file."""

    rules: list[Rule]
    source: Path
    extra: tuple[Path, ...] = ()
    promote: dict[str, Promotion] = field(default_factory=dict)
    _cache: dict[tuple[str, str, str], Label] = field(default_factory=dict, repr=False)
    _name_hits: dict[str, dict[re.Pattern[str], bool]] = field(default_factory=dict, repr=False)

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

        def hit(p: re.Pattern[str]) -> bool:
            v = hits.get(p)
            if v is None:
                v = hits[p] = p.search(name) is not None
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
            self.loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)
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


def _pattern(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], flags: int, key: str) -> re.Pattern[str]:
    if not isinstance(raw, str) or not raw.strip():
        raise f.error(node, f"'{key}' must be a non-empty regex string")

    def sub(m: re.Match[str]) -> str:
        if m.group(1) not in macros:
            raise f.error(node, f"'{key}': unknown macro ${{{m.group(1)}}} (known: {', '.join(sorted(macros))})")
        return macros[m.group(1)]

    text = MACRO.sub(sub, raw)
    text = re.sub(r"\s*\|\s*", "|", text).strip()  # long alternations may be folded over lines
    try:
        return re.compile(text, flags)
    except re.error as e:
        raise f.error(node, f"'{key}': bad regex: {e}") from None


def _patterns(f: _File, node: yaml.Node, raw: Any, macros: dict[str, str], flags: int,
              key: str) -> tuple[re.Pattern[str], ...]:
    items = raw if isinstance(raw, list) else [raw]
    nodes = node.value if isinstance(node, yaml.SequenceNode) else [node] * len(items)
    if not items:
        raise f.error(node, f"'{key}' must not be empty")
    return tuple(_pattern(f, n, r, macros, flags, key) for n, r in zip(nodes, items, strict=True))


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
            _pattern(f, vn, macros[name], macros, 0, f"macros.{name}")
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
    """Load and compile a class table (default: the shipped ``rules/kernel_classes.yaml``).

    ``extra`` files add rules (and may use the main file's macros); on equal priority their rules
    win over the main file's. Raises :class:`RuleError` naming file and line on a malformed file.
    """
    main = Path(path) if path is not None else rules_dir() / DEFAULT_FILE
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


@lru_cache(maxsize=1)
def _default_table() -> ClassTable:
    return load_class_table()


def classify_name(name: str, op_path: str = "", kind: str = "kernel", table: ClassTable | None = None) -> Label:
    """Class of one kernel from its name, its enclosing CPU op path (outer -> inner, ' > '-joined,
    '' when none) and its event kind (kernel | memcpy | memset)."""
    return (table or _default_table()).classify(name, op_path or "", kind or "kernel")


# ----------------------------------------------------------------------------- whole traces


def classify_kernels(ts: TraceSet, steps: pd.DataFrame, table: ClassTable | None = None,
                     graph_ops: GraphOps | None = None, run: RunModel | None = None,
                     user: Mapping[str, tuple[int, str]] | None = None, phase: str = "decode") -> RunModel:
    """Add ``cls``, ``cls2`` and ``cls_evidence`` to ``ts.kernels`` in place, decide the run model
    (:func:`traceinspect.runmodel.decide`, on the name-based classes; ``run`` given: that one), then
    apply the trace-evidence checks (:func:`mark_experts`, :func:`verify_experts`, :func:`promote_kv`).
    ``steps`` is the steps table (rank, idx, included); ``ts.kernels.step`` indexes its rows.
    ``graph_ops`` (from :func:`traceinspect.graphs.recover_graph_ops`) gives graph-replayed kernels the
    op path and the recorded shapes of their captured op. Returns the run model."""
    table = table or _default_table()
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
        captured = _captured_rows(k, graph_ops)
        if captured is not None:
            arr = ops.astype(str).to_numpy(dtype=object).copy()
            arr[captured[0]] = captured[1]
            ops = arr
        op_codes, op_uniq = pd.factorize(ops)
    else:
        captured = None
        op_codes, op_uniq = np.zeros(n, dtype=np.int64), np.array([""], dtype=object)
    kinds = k["kind"].astype(object).fillna("kernel") if "kind" in k else pd.Series("kernel", index=k.index)
    kind_codes, kind_uniq = pd.factorize(kinds.to_numpy(dtype=object))
    codes = combine_codes(name_codes, op_codes, kind_codes)
    _, first = np.unique(codes, return_index=True)
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
    _set_text(k, "cls", per_label["cls"][codes])
    _set_text(k, "cls2", per_label["cls2"][codes])
    _set_text(k, "cls_evidence", evidence)
    if run is None:
        run = decide_run(ts, steps, graph_ops, user, phase)
    mark_experts(ts, steps, run, graph_ops)
    verify_experts(ts, table, run)
    promote_kv(ts, steps, table, graph_ops=graph_ops, run=run)
    for c, uniq in per_label.items():
        k[c] = _categorical(k[c].to_numpy(dtype=object), codes, uniq)
    return run


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


def _set_text(k: pd.DataFrame, col: str, values: np.ndarray) -> None:
    """Set an object column (pandas 3 would convert an object array of str to its string dtype)."""
    k[col] = pd.Series(values, index=k.index, dtype=object, copy=False)


CAPTURED_NOTE = "op from graph capture trace"


def _captured_rows(k: pd.DataFrame, graph_ops: GraphOps | None) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions in ``k`` of graph-replayed kernels with a recovered op path, and those paths."""
    if graph_ops is None or not len(graph_ops.kernels) or "graph_replay" not in k:
        return None
    paths = graph_ops.op_paths()
    if not len(paths):
        return None
    pos = k.index.get_indexer(paths.index)
    ok = pos >= 0
    pos, vals = pos[ok], paths.to_numpy(dtype=object)[ok]
    keep = k["graph_replay"].to_numpy(dtype=bool)[pos]
    return (pos[keep], vals[keep]) if keep.any() else None


def _note_captured(table: ClassTable, names: np.ndarray, kinds: np.ndarray, rows: np.ndarray,
                   labels: list[Label], codes: np.ndarray, evidence: np.ndarray) -> None:
    """Say so in the evidence where a recovered op path changed the label (the rule used the op)."""
    memo: dict[int, bool] = {}
    for r in rows:
        c = int(codes[r])
        if c not in memo:
            lb = labels[c]
            memo[c] = lb != table.classify(names[r], "", str(kinds[r]))
        if memo[c]:
            evidence[r] = f"{evidence[r]}; {CAPTURED_NOTE}"


# --- routing labels that must work on the expert dimension ---------------------------------------

_RULE_ID = re.compile(r"^rule (\S+) \(")
_SOFTMAX_WARP = re.compile(r"softmax_warp_forward<[^,<>]+, [^,<>]+, [^,<>]+, (\d+),")
_SIZE_OPS = ("aten::_softmax", "aten::softmax", "aten::topk", "aten::_log_softmax", "aten::log_softmax")


def _routing_size(name: str, o: int, inputs: _OpInputs | None) -> tuple[int | None, str]:
    """Elements per row a softmax / top-k works on: recorded shapes, else the kernel template."""
    if inputs is not None and o >= 0:
        for j in inputs.chain(o, 4):
            if str(inputs.names[j]) in _SIZE_OPS:
                t = inputs.tensors(j)
                if t:
                    return t[0][1][-1], f"{inputs.names[j]} input {t[0][1]}"
    m = _SOFTMAX_WARP.search(name)
    if m:
        n = 1 << int(m.group(1))
        return n, f"softmax_warp_forward log2_elements={m.group(1)} (rows of <= {n})"
    return None, ""


_MOE_OPS = re.compile(r"moe|expert|deep_ep|select_experts|fused_topk", re.IGNORECASE)


def model_has_experts(ts: TraceSet, table: ClassTable | None = None, run: RunModel | None = None
                      ) -> tuple[bool, str]:
    """Whether the model has experts (MoE), and the evidence: the run model's expert count (the user,
    server_info, or the router's recorded top-k shapes), else expert GEMMs, MoE routing kernels named as
    such, or MoE ops in the trace. The one place this is decided: routing labels of generic softmax /
    top-k / sort kernels stand only where it is true."""
    run = run if run is not None else decide_run(ts)
    n_exp = run.value("experts")
    if n_exp is not None:
        return n_exp > 1, f"{n_exp} experts ({run.describe('experts')})"
    table = table or _default_table()
    generic = {r.id for r in table.rules if r.verify == "experts"}
    k = ts.kernels
    if len(k) and "cls" in k:
        cls = text_values(k["cls"])
        if (cls == "moe_gemm").any():
            return True, "expert GEMM kernels in the trace"
        ev = k["cls_evidence"].to_numpy(dtype=object)
        named = {e for e in unique_text(ev[cls == "moe_dispatch"])
                 if (m := _RULE_ID.match(str(e))) and m.group(1) not in generic}
        if named:
            return True, "MoE routing / dispatch kernels in the trace"
    if len(ts.cpu_ops):
        names = pd.Series(unique_text(ts.cpu_ops["name"].to_numpy(dtype=object)), dtype=object)
        if names.str.contains(_MOE_OPS).any():
            return True, "MoE ops in the trace"
    return False, "no expert count (server_info, --experts, router shapes) and no expert GEMM, MoE routing kernel or MoE op in the trace"


def verify_experts(ts: TraceSet, table: ClassTable | None = None, run: RunModel | None = None) -> None:
    """Re-label kernels of ``verify: experts`` rules where the model has no experts (-> elementwise), or
    whose softmax / top-k size is known and is not the model's expert count (vocabulary-wide ->
    sampling, else elementwise)."""
    table = table or _default_table()
    ids = {r.id for r in table.rules if r.verify == "experts"}
    k = ts.kernels
    if not ids or not len(k):
        return
    run = run if run is not None else decide_run(ts)
    ev = k["cls_evidence"].to_numpy(dtype=object)
    uniq = unique_text(ev)
    hit = {e for e in uniq if (m := _RULE_ID.match(str(e))) and m.group(1) in ids}
    if not hit:
        return
    rows = np.nonzero(np.isin(ev, list(hit)))[0]
    cls = k["cls"].to_numpy(dtype=object).copy()
    ev = ev.copy()
    has, why = model_has_experts(ts, table, run)
    if not has:
        for r in rows:
            ev[r] = f"elementwise: not MoE routing, the model has no experts ({why}); was {cls[r]} by {ev[r]}"
            cls[r] = "elementwise"
        _set_text(k, "cls", cls)
        _set_text(k, "cls_evidence", ev)
        return
    n_exp, exp_src = run.value("experts"), run.describe("experts")
    if n_exp is None:
        return
    vocab = run.value("vocab_size")
    names = k["name"].to_numpy(dtype=object)
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    inputs = _OpInputs(ts.cpu_ops) if len(ts.cpu_ops) else None
    pow2 = 1 << max(n_exp - 1, 0).bit_length()
    memo: dict[tuple[str, int], tuple[str, str] | None] = {}
    for r in rows:
        o = int(op_idx[r])
        key = (names[r], o if inputs is not None and o >= 0 and inputs.has_shapes(o) else -1)
        if key not in memo:
            size, how = _routing_size(names[r], key[1], inputs)
            if size is None:
                memo[key] = None
            elif size == n_exp or (how.startswith("softmax_warp") and size == pow2):
                memo[key] = (cls[r], f"{how} matches {n_exp} experts ({exp_src})")
            else:
                new = "sampling" if vocab and size >= vocab else "elementwise"
                memo[key] = (new, f"{how} is not the {n_exp} experts ({exp_src}): not MoE routing")
        res = memo[key]
        if res is not None:
            ev[r] = f"{ev[r]}; {res[1]}" if res[0] == cls[r] else f"{res[0]}: {res[1]}; was {cls[r]} by {ev[r]}"
            cls[r] = res[0]
    _set_text(k, "cls", cls)
    _set_text(k, "cls_evidence", ev)


# --- expert GEMMs from the structure ----------------------------------------------------------

DENSE_GEMM_CLASSES = ("bf16_gemm", "fp8_gemm", "fp4_gemm")
MIN_EXPERTS = 4  # a GEMM shape repeated this often per layer (experts unknown) is an expert loop


def mark_experts(ts: TraceSet, steps: pd.DataFrame | None, run: RunModel, graph_ops: GraphOps | None = None) -> None:
    """GEMMs of a MoE built from plain GEMMs become ``moe_gemm``: a GEMM shape (op, N, K, dtype) that
    runs once per expert in every layer (per-expert ``mm`` loop: calls per layer = the experts on this
    rank, or at least MIN_EXPERTS when the expert count is unknown), or a batched GEMM whose batch is the
    expert count (``bmm`` over ``[experts, rows, hidden]``) and whose K or N is the hidden size. Shapes
    come from the launching op (eager) or the op recovered from the capture trace (graph replay)."""
    from traceinspect.measure.gemm import ShapeCache

    k = ts.kernels
    layers = run.value("layers")
    if not len(k) or "cls" not in k or layers is None:
        return
    cls = k["cls"].to_numpy(dtype=object)
    cand = np.isin(cls, DENSE_GEMM_CLASSES)
    if "kind" in k:
        cand &= (k["kind"] == "kernel").to_numpy()
    if "step" in k:
        cand &= (k["step"] >= 0).to_numpy()
    if not cand.any():
        return
    experts, hidden = run.value("experts"), run.value("hidden_size")
    ep = run.value("ep_size") or 1
    local = experts // ep if experts and ep > 1 and experts % ep == 0 else experts
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    captured, cap_op, _ = _captured_ops(k, graph_ops)
    rows = np.nonzero(cand)[0]
    cache = ShapeCache()
    frames: dict[int, pd.DataFrame] = {-1: ts.cpu_ops}
    if graph_ops is not None:
        frames.update({int(r): c.ops.reset_index(drop=True) for r, c in graph_ops.captures.items()
                       if c.ops is not None and len(c.ops)})
    cols: dict[int, tuple[np.ndarray, ...]] = {}
    for src, f in frames.items():
        if f is not None and len(f) and "input_dims" in f:
            cols[src] = (f["name"].to_numpy(dtype=object), f["input_dims"].to_numpy(dtype=object),
                         f["input_types"].to_numpy(dtype=object) if "input_types" in f else np.full(len(f), None),
                         f["concrete"].to_numpy(dtype=object) if "concrete" in f else np.full(len(f), None))
    ranks, step = k["rank"].to_numpy(), k["step"].to_numpy()
    use_cap = captured[rows] & (cap_op[rows] >= 0)
    src_col = np.where(use_cap, ranks[rows], -1).astype(np.int64)
    o_col = np.where(use_cap, cap_op[rows], op_idx[rows]).astype(np.int64)
    pairs, inverse = np.unique(np.stack([src_col, o_col], axis=1), axis=0, return_inverse=True)
    pair_key: list[tuple[Any, ...] | None] = []  # one shape decode per distinct (source, op)
    for src, o in pairs.tolist():
        c = cols.get(src)
        if c is None or o < 0 or o >= len(c[0]):
            pair_key.append(None)
            continue
        shapes, _ = cache.get(str(c[0][o]), c[1][o], c[2][o], c[3][o])
        sh = shapes[0] if len(shapes) == 1 and shapes[0].kind == "gemm" else None
        pair_key.append(None if sh is None else (str(c[0][o]), sh.n, sh.k, sh.batch, sh.dtype))
    by_key: dict[tuple[Any, ...], list[int]] = {}
    for r, p in zip(rows.tolist(), inverse.reshape(-1).tolist(), strict=True):
        key = pair_key[p]
        if key is not None:
            by_key.setdefault(key, []).append(r)
    ev = k["cls_evidence"].to_numpy(dtype=object).copy()
    new_cls = cls.copy()
    exp_src = run.describe("experts")
    for (op, n, kk, batch, _dtype), members in by_key.items():
        m = np.asarray(members)
        per_step = pd.Series(1, index=pd.MultiIndex.from_arrays([ranks[m], step[m]])).groupby(level=[0, 1]).size()
        per_layer = float(per_step.median()) / layers
        hid = hidden is None or hidden in (n, kk)
        why = None
        if batch and batch > 1:
            if local and batch == local and hidden is not None and hid:
                why = (f"batched GEMM {op} with batch {batch} = the experts on this rank ({exp_src}) and "
                       f"{'K' if kk == hidden else 'N'} = hidden size {hidden}")
        elif local:
            if 0.5 * local <= per_layer <= local + 1e-9 and hid:
                why = (f"{per_layer:g} {op} calls per layer with N={n} K={kk} = one per expert "
                       f"({local} on this rank: {exp_src}; {layers} layers)")
        elif per_layer >= MIN_EXPERTS and float(per_layer).is_integer() and hid and per_step.nunique() == 1:
            why = (f"{per_layer:g} {op} calls per layer with N={n} K={kk} in every step: one per expert "
                   f"(expert count unknown; {layers} layers)")
        if why is None:
            continue
        for r in members:
            ev[r] = f"moe_gemm: {why}; was {new_cls[r]} by {ev[r]}"
            new_cls[r] = "moe_gemm"
    _set_text(k, "cls", new_cls)
    _set_text(k, "cls_evidence", ev)


# --- KV-cache evidence --------------------------------------------------------------------------

_NAME_DST = [  # (regex over a cast kernel's name, torch dtype it writes)
    (re.compile(r"float8_copy_kernel|to_fp8|fp8_copy"), "Float8"),
    (re.compile(r"bfloat16tofloat32|float16tofloat32"), "float"),
    (re.compile(r"bfloat16_copy_kernel"), "BFloat16"),
    (re.compile(r"float16_copy_kernel"), "Half"),
    (re.compile(r"direct_copy_kernel_cuda.*?lambda\((?:c10::)?(\w+)\)"), None),
]


def _cast_destination(name: str) -> str | None:
    """The dtype a PyTorch cast kernel writes, read from its name (None if unknown)."""
    for pat, dst in _NAME_DST:
        m = pat.search(name)
        if m:
            return dst if dst is not None else m.group(1)
    return None


@dataclass
class _KvContext:
    """What the trace says about the KV cache and the layer structure."""

    pool: int | None
    page: int
    kv_dtype: str | None
    layers: int | None
    layers_src: str
    included: np.ndarray  # per kernel row: in an included step
    pool_src: str = ""  # where the pool size came from
    steps_per_rank: dict[int, int] = field(default_factory=dict)  # included steps per rank

    def pool_rows(self, rows: int) -> bool:
        return self.pool is not None and self.pool <= rows <= self.pool + 2 * max(self.page, 1)


def _context(ts: TraceSet, steps: pd.DataFrame, run: RunModel) -> _KvContext:
    k = ts.kernels
    step = k["step"].to_numpy() if "step" in k else np.full(len(k), -1)
    n_steps = len(steps) if steps is not None else 0
    inc_steps = (steps["included"].to_numpy(dtype=bool) if n_steps and "included" in steps
                 else np.ones(n_steps, dtype=bool))
    if n_steps and not inc_steps.any():
        inc_steps = np.ones(n_steps, dtype=bool)
    ok = (step >= 0) & (step < n_steps)
    included = np.zeros(len(k), dtype=bool)
    included[ok] = inc_steps[step[ok]]
    per_rank: dict[int, int] = {}
    if n_steps and "rank" in steps:
        per_rank = {int(r): int(c) for r, c in steps[inc_steps].groupby("rank").size().items()}
    return _KvContext(pool=run.value("kv_pool_tokens"), page=run.value("page_size") or 1,
                      kv_dtype=run.kv_torch_dtype, layers=run.value("layers"), layers_src=run.describe("layers"),
                      included=included, steps_per_rank=per_rank, pool_src=run.describe("kv_pool_tokens"))


def _json(raw: Any) -> Any:
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except (TypeError, ValueError):
        return None


_CAST_SOURCE_ARG = {"aten::copy_": 1, "aten::copy": 1, "aten::to": 0, "aten::_to_copy": 0, "aten::type_as": 0}


def _tensors(dims: Any, types: Any) -> list[tuple[int, list[int], str]]:
    """(argument index, shape, dtype) of each tensor argument of one op."""
    out: list[tuple[int, list[int], str]] = []
    if not isinstance(dims, list):
        return out
    types = types if isinstance(types, list) else []
    for i, d in enumerate(dims):
        t = types[i] if i < len(types) and isinstance(types[i], str) else ""
        if isinstance(d, list) and d and all(isinstance(x, int) for x in d):
            out.append((i, d, t.replace("c10::", "")))
    return out


class _OpInputs:
    """Decoded recorded shapes of CPU ops (lazily, per op row)."""

    def __init__(self, ops: pd.DataFrame) -> None:
        self.ops = ops
        self.parent = ops["parent"].to_numpy() if "parent" in ops else np.full(len(ops), -1)
        self.dims = ops["input_dims"].to_numpy(dtype=object) if "input_dims" in ops else None
        self.types = ops["input_types"].to_numpy(dtype=object) if "input_types" in ops else None
        self.names = ops["name"].to_numpy(dtype=object)
        self._cache: dict[int, list[tuple[int, list[int], str]]] = {}
        self._decoded: dict[tuple[Any, Any], list[tuple[int, list[int], str]]] = {}

    def tensors(self, i: int) -> list[tuple[int, list[int], str]]:
        if i not in self._cache:
            if self.dims is None:
                self._cache[i] = []
            else:
                key = (self.dims[i], self.types[i] if self.types is not None else None)
                try:
                    hit = self._decoded.get(key)  # ops recorded with equal shapes decode once
                except TypeError:  # not raw JSON bytes: decode as is
                    hit = _tensors(_json(key[0]), _json(key[1]))
                if hit is None:
                    hit = self._decoded[key] = _tensors(_json(key[0]), _json(key[1]))
                self._cache[i] = hit
        return self._cache[i]

    def chain(self, i: int, depth: int = 3) -> list[int]:
        """The op and up to ``depth`` enclosing ops."""
        out = []
        while i >= 0 and len(out) <= depth:
            out.append(int(i))
            i = int(self.parent[i])
        return out

    def has_shapes(self, i: int) -> bool:
        return any(self.tensors(j) for j in self.chain(i))

    def read(self, i: int) -> list[tuple[list[int], str]]:
        """Tensors op ``i`` reads as a cast source (copy_'s src; else every tensor argument)."""
        name = str(self.names[i])
        arg = _CAST_SOURCE_ARG.get(name)
        return [(s, d) for a, s, d in self.tensors(i) if arg is None or a == arg]

    def written(self, i: int) -> list[tuple[list[int], str]]:
        """The tensor an in-place scatter op writes (its first argument)."""
        return [(s, d) for a, s, d in self.tensors(i) if a == 0]


def _recurrence(k: pd.DataFrame, rows: np.ndarray, ctx: _KvContext) -> dict[tuple[int, str], str]:
    """(rank, name) of candidate rows that recur exactly once per layer in most included steps (never
    more), with at least one other kernel between consecutive occurrences; value: evidence text."""
    out: dict[tuple[int, str], str] = {}
    if ctx.layers is None or not len(rows):
        return out
    sel = rows[ctx.included[rows]]
    if not len(sel):
        return out
    sub = k.iloc[sel]
    counts = sub.groupby(["rank", "name", "step"]).size()
    adjacent = _adjacent(k, sub)
    for (rank, name), c in counts.groupby(level=[0, 1]):
        n_steps = ctx.steps_per_rank.get(int(rank), 0)
        exact = int((c == ctx.layers).sum())
        if n_steps == 0 or exact * 2 < n_steps or (c > ctx.layers).any():
            continue
        if (rank, name) in adjacent:
            continue
        out[(rank, name)] = (f"{ctx.layers} per step in {exact}/{n_steps} included steps = once per layer, "
                             f"with other kernels between (layers: {ctx.layers_src})")
    return out


def _rank_time_order(rank: np.ndarray, ts: np.ndarray) -> np.ndarray:
    """Row order by (rank, start time), equal keys in row order: ``np.lexsort((ts, rank))``, skipped
    when the rows are already in that order (as the loader leaves them)."""
    if len(rank) < 2 or (np.all(rank[1:] >= rank[:-1])
                         and np.all((ts[1:] >= ts[:-1]) | (rank[1:] != rank[:-1]))):
        return np.arange(len(rank))
    return np.lexsort((ts, rank))


def _adjacent(k: pd.DataFrame, sub: pd.DataFrame) -> set[tuple[Any, Any]]:
    """(rank, name) pairs of ``sub`` (rows of ``k``) with two occurrences in one step and no other kernel
    of the rank between them on its GPU timeline (ordered by start time)."""
    order = _rank_time_order(k["rank"].to_numpy(), k["ts"].to_numpy())
    pos = np.empty(len(k), dtype=np.int64)
    pos[order] = np.arange(len(k))  # rank boundaries never make two positions of one rank adjacent
    rows = k.index.get_indexer(sub.index)
    codes, uniq = pd.factorize(pd.MultiIndex.from_arrays([sub["rank"].to_numpy(), sub["name"].to_numpy(dtype=object)]))
    step = sub["step"].to_numpy()
    p = pos[rows]
    o = np.lexsort((p, step, codes))
    c, st, pp = codes[o], step[o], p[o]
    same = (c[1:] == c[:-1]) & (st[1:] == st[:-1])
    bad = np.unique(c[1:][same & (np.diff(pp) < 2)])
    return {tuple(uniq[i]) for i in bad}


def promote_kv(ts: TraceSet, steps: pd.DataFrame, table: ClassTable | None = None,
               graph_ops: GraphOps | None = None, run: RunModel | None = None) -> None:
    """Promote dtype casts that read KV-cache data to ``kv_cast``, scatters into the KV pool to
    ``kv_write``, and casts to 8/4-bit floats to their consumer's class (needs the ``cls`` columns;
    the reason goes to ``cls_evidence``). A graph-replayed kernel whose op ``graph_ops`` recovered
    from the capture trace is judged on that op's recorded shapes, as an eager kernel is; other
    kernels without shapes by their recurrence. A copy that keeps the dtype is never ``kv_cast``."""
    table = table or _default_table()
    k = ts.kernels
    if not len(k) or "cls" not in k or not table.promote:
        return
    run = run if run is not None else decide_run(ts, steps, graph_ops)
    ctx = _context(ts, steps, run)
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    eager = _OpInputs(ts.cpu_ops) if len(ts.cpu_ops) else None
    captured, cap_op, cap_inputs = _captured_ops(k, graph_ops)
    cls = k["cls"].to_numpy(dtype=object).copy()
    ev = k["cls_evidence"].to_numpy(dtype=object).copy()
    names = k["name"].to_numpy(dtype=object)
    ranks = k["rank"].to_numpy()
    is_kernel = (k["kind"] == "kernel").to_numpy() if "kind" in k else np.ones(len(k), dtype=bool)
    pool_shapes: dict[int, set[tuple[int, ...]]] = {}
    for target in ("kv_cast", "kv_write"):
        promo = table.promote.get(target)
        if promo is None:
            continue
        cand = np.isin(cls, promo.sources) & is_kernel
        if promo.name is not None and cand.any():
            at = np.nonzero(cand)[0]  # the name test only where the class test passed
            cand[at] = per_distinct(names[at], promo.name.search)
        if target == "kv_cast" and cand.any():
            at = np.nonzero(cand)[0]
            cand[at] = ~per_distinct(names[at], _NOCAST.search)
        rows = np.nonzero(cand)[0]
        if not len(rows):
            continue
        recur = _recurrence(k, rows, ctx)
        attn_cache: dict[tuple[int, int], bool] = {}
        memo: dict[tuple[Any, str, bool, bool], str | None] = {}
        shaped: dict[tuple[int, int, Any], str | None] = {}
        for r in rows:
            rec = recur.get((ranks[r], names[r]))
            if captured[r] and cap_op[r] >= 0:
                inputs, o, src, how = cap_inputs.get(int(ranks[r])), int(cap_op[r]), int(ranks[r]), \
                    f"graph replay, {CAPTURED_NOTE}: "
            else:
                inputs, o, src, how = eager, int(op_idx[r]), -1, ""
            if inputs is not None and o >= 0 and inputs.has_shapes(o):
                key3 = (src, o, rec)
                if key3 not in shaped:
                    shaped[key3] = _shape_evidence(inputs, o, src, ctx, target, rec, attn_cache, pool_shapes)
                reason = shaped[key3]
                reason = how + reason if reason is not None else None
            else:
                key = (ranks[r], names[r], int(op_idx[r]) < 0, bool(captured[r]))
                if key not in memo:
                    memo[key] = _recurrence_evidence(names[r], rec, key[2], target, ctx, captured=key[3])
                reason = memo[key]
            if reason is not None:
                ev[r] = f"{target}: {reason}; was {cls[r]} by {ev[r]}"
                cls[r] = target
    consumer = table.promote.get("consumer")
    if consumer is not None:
        _promote_consumers(k, consumer, ctx, eager, cls, ev, is_kernel)
    _set_text(k, "cls", cls)
    _set_text(k, "cls_evidence", ev)


_NOCAST = re.compile(r"_nocast<")  # PyTorch's same-dtype elementwise path: no dtype change


def _captured_ops(k: pd.DataFrame, graph_ops: GraphOps | None
                  ) -> tuple[np.ndarray, np.ndarray, dict[int, _OpInputs]]:
    """Per kernel row: replayed with a recovered op path, and the captured op's row in its rank's
    capture ``cpu_ops`` (-1 if unknown); per rank, the capture trace's recorded shapes."""
    captured = np.zeros(len(k), dtype=bool)
    cap_op = np.full(len(k), -1, dtype=np.int64)
    inputs: dict[int, _OpInputs] = {}
    rows_paths = _captured_rows(k, graph_ops)
    if rows_paths is not None:
        captured[rows_paths[0]] = True
    if graph_ops is not None and len(graph_ops.kernels) and "cap_op" in graph_ops.kernels:
        pos = k.index.get_indexer(graph_ops.kernels.index)
        ok = pos >= 0
        cap_op[pos[ok]] = graph_ops.kernels["cap_op"].to_numpy(dtype=np.int64)[ok]
        for rank, cap in graph_ops.captures.items():
            if cap.ops is not None and len(cap.ops):
                inputs[int(rank)] = _OpInputs(cap.ops.reset_index(drop=True))
    return captured, cap_op, inputs


def _shape_evidence(inputs: _OpInputs, o: int, src: int, ctx: _KvContext, target: str, rec: str | None,
                    attn_cache: dict[tuple[int, int], bool], pool_shapes: dict[int, set[tuple[int, ...]]]
                    ) -> str | None:
    """Evidence from recorded shapes (eager, or the capture trace's ``src`` rank; -1: eager) that a
    candidate reads (kv_cast) or writes (kv_write) the KV pool."""
    if target == "kv_cast" and _keeps_dtype(inputs, o):
        return None
    reason = _pool_evidence(inputs, o, ctx, target)
    if reason is not None or rec is None or target != "kv_cast":
        return reason
    if (src, o) not in attn_cache:
        attn_cache[(src, o)] = any(ATTENTION_OP.search(str(inputs.names[j])) for j in inputs.chain(o, 8))
    if attn_cache[(src, o)]:
        return f"op inside attention, {rec}"
    if src not in pool_shapes:
        pool_shapes[src] = _pool_row_shapes(inputs.ops, ctx)
    return _kv_rows_evidence(inputs, o, ctx, pool_shapes[src], rec)


def _keeps_dtype(inputs: _OpInputs, o: int) -> bool:
    """The launching copy_ writes the dtype it reads (a same-dtype copy, not a cast)."""
    for j in inputs.chain(o, 2):
        if str(inputs.names[j]) in ("aten::copy_", "aten::copy"):
            t = {a: d for a, _, d in inputs.tensors(j)}
            return bool(0 in t and 1 in t and t[0] and t[0] == t[1])
    return False


_LOW_FLOAT = ("Float8", "Float4")


def _written_dtype(name: str, o: int, inputs: _OpInputs | None) -> str | None:
    """The dtype a cast kernel writes: from its name, else from its copy_ op's destination."""
    dst = _cast_destination(name)
    if dst is None and inputs is not None and o >= 0:
        for j in inputs.chain(o, 2):
            if str(inputs.names[j]) in ("aten::copy_", "aten::copy"):
                t = [d for a, _, d in inputs.tensors(j) if a == 0]
                if t and t[0]:
                    return t[0]
    return dst


def _promote_consumers(k: pd.DataFrame, promo: Promotion, ctx: _KvContext, inputs: _OpInputs | None,
                       cls: np.ndarray, ev: np.ndarray, is_kernel: np.ndarray) -> None:
    """A cast to an 8/4-bit float takes its consumer's purpose: when one of the next two kernels on
    its stream is of a class in ``promo.next`` (a quantized GEMM: quantize; a KV write of the KV
    dtype: kv_write)."""
    names = k["name"].to_numpy(dtype=object)
    cand = np.isin(cls, promo.sources) & is_kernel
    if promo.name is not None and cand.any():
        at = np.nonzero(cand)[0]
        cand[at] = per_distinct(names[at], promo.name.search)
    if not cand.any():
        return
    idx = np.nonzero(is_kernel)[0]
    stream = k["stream"].to_numpy()[idx] if "stream" in k else np.zeros(len(idx), dtype=np.int64)
    rank = k["rank"].to_numpy()[idx]
    # by (rank, stream, ts): a stable sort by (rank, stream) of the rows in (rank, ts) order
    by_time = _rank_time_order(rank, k["ts"].to_numpy()[idx])
    s_codes = pd.factorize(stream[by_time], sort=True)[0]
    lane = by_time[np.argsort(rank[by_time].astype(np.int64) * (int(s_codes.max(initial=0)) + 1) + s_codes,
                              kind="stable")]
    order = idx[lane]
    rank_s, stream_s = rank[lane], stream[lane]
    where = np.full(len(k), -1, dtype=np.int64)
    where[order] = np.arange(len(order))
    op_idx = k["op_idx"].to_numpy() if "op_idx" in k else np.full(len(k), -1)
    rows = np.nonzero(cand)[0]
    # Python lists: the loop reads single elements, and a numpy scalar read costs ~10x more
    pos = where[rows].tolist()
    order_l, rank_l, stream_l = order.tolist(), rank_s.tolist(), stream_s.tolist()
    n_lane = len(order_l)
    for r, i in zip(rows.tolist(), pos, strict=True):
        for step in (1, 2):
            j = i + step
            if j >= n_lane or rank_l[j] != rank_l[i] or stream_l[j] != stream_l[i]:
                break
            nxt = order_l[j]
            target = promo.next.get(cls[nxt])
            if target is None:
                continue
            dst = _written_dtype(names[r], int(op_idx[r]), inputs)
            if dst is None or not dst.startswith(_LOW_FLOAT):
                break
            if target == "kv_write" and ctx.kv_dtype is not None and not ctx.kv_dtype.startswith(dst):
                break
            ev[r] = (f"{target}: casts to {dst} right before {cls[nxt]} kernel {str(names[nxt])[:60]!r}; "
                     f"was {cls[r]} by {ev[r]}")
            cls[r] = target
            break


def _recurrence_evidence(name: str, rec: str | None, graph: bool, target: str, ctx: _KvContext,
                         captured: bool = False) -> str | None:
    """Evidence for a kernel without recorded shapes: once per layer per step, and (for casts) not
    a cast into the KV dtype (that is the write side). ``captured``: a graph replay whose op was
    recovered from the capture trace without recorded shapes."""
    if rec is None:
        return None
    if target == "kv_cast":
        dst = _cast_destination(name)
        if dst is not None and ctx.kv_dtype is not None and ctx.kv_dtype.startswith(dst):
            return None
    how = (f"graph replay ({CAPTURED_NOTE}, without recorded shapes)" if captured else
           "graph replay, no CPU op" if graph else "no recorded shapes")
    return f"{how}: same kernel {rec}"


def _pool_evidence(inputs: _OpInputs, o: int, ctx: _KvContext, target: str) -> str | None:
    if ctx.pool is None:
        return None
    hits: list[tuple[int, list[int], str]] = []
    for j in inputs.chain(o):
        tensors = inputs.written(j) if target == "kv_write" else inputs.read(j)
        hits += [(j, shape, dtype) for shape, dtype in tensors if len(shape) >= 2 and ctx.pool_rows(shape[0])]
    if not hits:
        return None
    # report the KV-dtype tensor (the cast's source) when there is one
    j, shape, dtype = next((h for h in hits if h[2] == ctx.kv_dtype), hits[0])
    pad = shape[0] - (ctx.pool or 0)
    return (f"{inputs.names[j]} input {shape} {dtype or '?'}: {shape[0]} rows = KV pool of {ctx.pool} tokens"
            f"{f' + {pad} padding' if pad else ''} ({ctx.pool_src})")


def _pool_row_shapes(ops: pd.DataFrame, ctx: _KvContext) -> set[tuple[int, ...]]:
    """Trailing dims of tensors with the KV pool's row count anywhere in the recorded shapes."""
    out: set[tuple[int, ...]] = set()
    if ctx.pool is None or "input_dims" not in ops:
        return out
    probes = [f"[{ctx.pool + d},".encode() for d in range(0, 2 * max(ctx.page, 1) + 1)]
    for raw in ops["input_dims"].to_numpy(dtype=object):
        if raw is None:
            continue
        b = raw if isinstance(raw, bytes | bytearray) else str(raw).encode()
        if not any(p in b for p in probes):
            continue
        for _, shape, _ in _tensors(_json(b), None):
            if len(shape) >= 2 and ctx.pool_rows(shape[0]):
                out.add(tuple(shape[1:]))
    return out


def _kv_rows_evidence(inputs: _OpInputs, o: int, ctx: _KvContext, pool_shapes: set[tuple[int, ...]],
                      rec: str) -> str | None:
    if ctx.kv_dtype is None or not pool_shapes:
        return None
    for j in inputs.chain(o):
        for shape, dtype in inputs.read(j):
            if dtype == ctx.kv_dtype and len(shape) >= 2 and tuple(shape[1:]) in pool_shapes:
                return (f"{inputs.names[j]} reads {shape} {dtype} = KV-dtype rows of the pool's row shape, "
                        f"{rec}")
    return None


# ----------------------------------------------------------------------------- coverage table


def class_table_rows(kernels: pd.DataFrame) -> pd.DataFrame:
    """One row per (kernel name, class): name, cls, cls2, evidence, calls, us, share (of all
    kernel time); sorted by time, largest first."""
    cols = ["name", "cls", "cls2", "evidence", "calls", "us", "share"]
    if not len(kernels) or "cls" not in kernels:
        return pd.DataFrame(columns=cols)
    k = kernels
    total = float(k["dur"].sum()) or 1.0
    g = k.groupby(["name", "cls", "cls2"], sort=False, dropna=False)
    out = g.agg(calls=("dur", "size"), us=("dur", "sum")).reset_index()
    out["evidence"] = g["cls_evidence"].agg(_most_common).to_numpy()
    out["share"] = out["us"] / total
    return out[cols].sort_values("us", ascending=False, kind="stable").reset_index(drop=True)


def _most_common(values: Iterable[str]) -> str:
    c = Counter(values)
    return c.most_common(1)[0][0] if c else ""
