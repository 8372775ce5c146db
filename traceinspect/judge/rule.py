"""The rule types: :class:`Rule` (one validated rule) and :class:`RuleSet`, and the vocabulary a rule file is
validated against (severities, phases, selectors, fixes)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec

from traceinspect.judge.expr import Expr

ID_RE = re.compile(r"^[a-z][a-z0-9]*(?:-[a-z0-9]+)*$")
RULE_PHASES = ("decode", "prefill", "all")  # the steps a rule judges (``phase:``; ``scope:`` in older files)
REQUIRED = ("id", "title", "severity", "phase", "when", "estimate", "message", "why", "remediation", "references")
OPTIONAL = ("select", "let", "impact", "share_of", "removes", "evidence", "params", "tests", "example", "override",
            "notes", "fixes", "scope")  # scope: the older name of phase
SHARE_OF = ("step_time",)  # every share is of the step time; the key stays readable for older rule files
REMOVES = ("time", "idle")  # what fixing the finding removes: kernel time, or GPU idle inside the step
FIX_KEYS = {"variant", "label", "edits"}
EDIT_KEYS = {"edit", "select", "value", "rank", "from"}
RANK_REFS = ("subject", "fastest", "latest")
KERNEL_SELECT_KEYS = {"class", "name", "not_name", "op", "not_op", "kind", "graph"}
GROUP_BY = {"kernels": ("none", "name", "cls"), "gemm": ("none", "shape", "cls", "moe"), "rank": ("rank",),
            "class": ("class",), "run": ("none",)}
GEMM_SELECT_KEYS = {"moe", "class", "where"}
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
FORMAT_SPEC = re.compile(r"^[<>^]?[+\- ]?,?\d{0,2}(?:\.\d{1,2})?[eEfFgG%dsn]?$")
MAX_TEXT = 20_000


class Placeholder(msgspec.Struct, frozen=True):
    """One ``{expression:format}`` of a message template."""

    expr: Expr
    spec: str


class Selector(msgspec.Struct):
    """What a rule is evaluated on (scope) and how the subjects are picked."""

    scope: str = "run"  # run | kernels | gemm | rank | class
    classes: tuple[str, ...] = ()
    name: re.Pattern[str] | None = None
    not_name: re.Pattern[str] | None = None
    op: re.Pattern[str] | None = None
    not_op: re.Pattern[str] | None = None
    kinds: tuple[str, ...] = ()
    graph: bool | None = None  # kernels: only graph-replayed (True) / only eager (False)
    moe: bool | None = None  # gemm: only expert (True) / only dense (False) GEMMs
    where: Expr | None = None  # gemm: row filter over the gemm scope's shape metrics
    group_by: str = "none"
    text: dict[str, Any] = msgspec.field(default_factory=dict)  # as written, for `rules show`


class FixEdit(msgspec.Struct):
    """One edit of a fix as declared: ``value`` is an expression over the rule's names (or None)."""

    spec: dict[str, Any]
    value: Expr | None = None


class Fix(msgspec.Struct):
    """A named way to fix what a rule finds, as replay edits (``fixes:`` of a rule)."""

    variant: str
    label: str
    edits: list[FixEdit]


class Rule(msgspec.Struct):
    """One validated rule."""

    id: str
    title: str
    severity: str
    phase: str  # the steps it judges: decode | prefill | all
    select: Selector
    when: list[Expr]
    estimate: Expr
    impact: Expr | None
    message: str
    placeholders: list[Placeholder]
    why: str
    remediation: str
    references: list[str]
    evidence: dict[str, Expr]
    params: dict[str, float]
    tests: dict[str, list[str]]
    let: dict[str, Expr] = msgspec.field(default_factory=dict)
    share_of: str = "step_time"
    removes: str = "time"  # "idle": the estimate is capped at the GPU idle time inside the step
    example: str = ""
    notes: str = ""
    source: Path | None = None
    line: int = 0
    override: bool = False
    shipped: bool = False
    fixes: list[Fix] = msgspec.field(default_factory=list)

    @property
    def where(self) -> str:
        return f"{self.source}:{self.line}" if self.source else self.id

    def metric_names(self) -> list[str]:
        """Every metric the rule reads, in first-use order."""
        seen: dict[str, None] = {}
        exprs: list[Expr] = [*self.when, self.estimate]
        if self.impact is not None:
            exprs.append(self.impact)
        if self.select.where is not None:
            exprs.append(self.select.where)
        exprs.extend(self.evidence.values())
        exprs.extend(p.expr for p in self.placeholders)
        for e in exprs:
            for n in sorted(e.names):
                if n in self.let:
                    for n2 in sorted(self.let[n].names):
                        if n2 not in self.params and n2 not in self.let:
                            seen.setdefault(n2, None)
                if n not in self.params:
                    seen.setdefault(n, None)
        return list(seen)

    def test_paths(self, kind: str) -> list[Path]:
        """Fixture directories of ``tests.fires`` / ``tests.silent``, resolved against the rule
        file's directory, its parent, then the working directory."""
        return [self._resolve(split_test(p)[0]) for p in self.tests.get(kind, [])]

    def test_model_configs(self, kind: str) -> list[Path | None]:
        """The ``--model-config`` file of each entry of ``tests.<kind>`` (None where it names none)."""
        out: list[Path | None] = []
        for p in self.tests.get(kind, []):
            mc = split_test(p)[1]
            out.append(self._resolve(mc) if mc is not None else None)
        return out

    def _resolve(self, p: str) -> Path:
        path = Path(p)
        if not path.is_absolute():
            cands = []
            if self.source is not None:
                cands += [self.source.parent / path, self.source.parent.parent / path]
            cands.append(Path.cwd() / path)
            path = next((c for c in cands if c.exists()), cands[0])
        return path


MODEL_CONFIG_FLAG = " --model-config "


def split_test(entry: str) -> tuple[str, str | None]:
    """A ``tests`` entry: the trace set, and the model config it is analysed with (``DIR --model-config FILE``)."""
    if MODEL_CONFIG_FLAG in entry:
        d, mc = entry.split(MODEL_CONFIG_FLAG, 1)
        return d.strip(), mc.strip()
    return entry.strip(), None


class RuleSet(msgspec.Struct):
    """The rules to evaluate, in file order, and the files they came from."""

    rules: list[Rule]
    files: list[Path] = msgspec.field(default_factory=list)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def get(self, rule_id: str) -> Rule | None:
        return next((r for r in self.rules if r.id == rule_id), None)

    @property
    def ids(self) -> list[str]:
        return [r.id for r in self.rules]
