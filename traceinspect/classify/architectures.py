"""The architectures table (``rules/tables/architectures.yaml``): per model family, the GEMMs of its layers as
expressions over the Hugging Face config's fields, and the small expression evaluator that reads them."""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

import msgspec

from traceinspect.errors import RuleError
from traceinspect.resources import lazy_module, settings_document, tables_dir

yaml = lazy_module("yaml")

TABLE = "architectures.yaml"
PARALLEL = ("column", "row", "expert_column", "expert_row", "replicated", "per_rank")


class _Missing(Exception):
    """An expression reads a name the config does not have."""


_BIN = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_CMP = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
        ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_FUNCS = {"max": max, "min": min, "int": int}


@lru_cache(maxsize=512)
def _parse(text: str) -> ast.Expression:
    try:
        return ast.parse(text.strip(), mode="eval")
    except SyntaxError as e:
        raise RuleError(f"expression {text!r} does not parse: {e.msg}", tables_dir() / TABLE) from None


def evaluate(text: Any, env: Mapping[str, Any]) -> Any:
    """The value of a table expression over ``env`` (raises :class:`_Missing` for an unknown name)."""
    if isinstance(text, (bool, int, float)):
        return text
    return _eval(_parse(str(text)).body, env, str(text))


def _eval(node: ast.AST, env: Mapping[str, Any], src: str) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, bool, str)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in ("True", "False"):
            return node.id == "True"
        if node.id not in env:
            raise _Missing(node.id)
        return env[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_eval(node.left, env, src), _eval(node.right, env, src))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.Not)):
        v = _eval(node.operand, env, src)
        return -v if isinstance(node.op, ast.USub) else not v
    if isinstance(node, ast.BoolOp):
        vals = (_eval(v, env, src) for v in node.values)
        return all(vals) if isinstance(node.op, ast.And) else any(vals)
    if isinstance(node, ast.Compare) and all(type(o) in _CMP for o in node.ops):
        left = _eval(node.left, env, src)
        for op, right in zip(node.ops, node.comparators, strict=True):
            r = _eval(right, env, src)
            if not _CMP[type(op)](left, r):
                return False
            left = r
        return True
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*(_eval(a, env, src) for a in node.args))
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, env, src) for e in node.elts]
    raise RuleError(f"expression {src!r}: {type(node).__name__} is not allowed", tables_dir() / TABLE)


# ----------------------------------------------------------------------------- the table


class GemmSpec(msgspec.Struct, frozen=True):
    """One named GEMM of a family's layer template, as the table writes it."""

    name: str
    n: Any
    k: Any
    parallel: str = "replicated"
    batch: Any = None
    at: str = "post_attention"
    role: str = ""
    optional: bool = False
    alt: str = ""
    when: Any = None


class Family(msgspec.Struct, frozen=True):
    id: str
    model_type: tuple[str, ...]
    architectures: tuple[str, ...]
    defaults: dict[str, Any]
    vars: dict[str, Any]
    attention_heads: dict[str, Any]
    attention: tuple[GemmSpec, ...]
    mlp: tuple[GemmSpec, ...]
    moe: tuple[GemmSpec, ...]
    moe_layer: Any
    tail: tuple[GemmSpec, ...]
    experts: str | None = None
    top_k: str | None = None


class Architectures(msgspec.Struct, frozen=True):
    families: tuple[Family, ...]
    softmax: re.Pattern[str]
    not_between: re.Pattern[str]
    max_between: int

    def family_of(self, config: Mapping[str, Any]) -> Family | None:
        mt = config.get("model_type")
        for f in self.families:
            if isinstance(mt, str) and mt in f.model_type:
                return f
        archs = config.get("architectures")
        for f in self.families:
            if isinstance(archs, list) and any(a in f.architectures for a in archs if isinstance(a, str)):
                return f
        return None


def _specs(raw: Any, where: str) -> tuple[GemmSpec, ...]:
    path = tables_dir() / TABLE
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise RuleError(f"{where} must be a list of GEMMs", path)
    out = []
    for e in raw:
        try:
            g = msgspec.convert(e, GemmSpec)
        except msgspec.ValidationError as err:
            raise RuleError(f"{where}: {err}", path) from None
        if g.parallel not in PARALLEL:
            raise RuleError(f"{where}.{g.name}: parallel must be one of {', '.join(PARALLEL)}", path)
        out.append(g)
    return tuple(out)


@lru_cache(maxsize=1)
def architectures() -> Architectures:
    """rules/tables/architectures.yaml, read and checked."""
    path = tables_dir() / TABLE
    try:
        doc = settings_document(TABLE)
    except (OSError, yaml.YAMLError) as e:
        raise RuleError(f"cannot read the architecture table: {e}", path) from None
    if not isinstance(doc, dict) or not isinstance(doc.get("families"), list):
        raise RuleError("the architecture table needs a `families` list", path)
    fams = []
    for raw in doc["families"]:
        if not isinstance(raw, dict) or "id" not in raw:
            raise RuleError("every family needs an id", path)
        fid = str(raw["id"])
        fams.append(Family(
            id=fid, model_type=tuple(raw.get("model_type") or ()), architectures=tuple(raw.get("architectures") or ()),
            defaults=dict(raw.get("defaults") or {}), vars=dict(raw.get("vars") or {}),
            attention_heads=dict(raw.get("attention_heads") or {}),
            attention=_specs(raw.get("attention"), f"{fid}.attention"), mlp=_specs(raw.get("mlp"), f"{fid}.mlp"),
            moe=_specs(raw.get("moe"), f"{fid}.moe"), moe_layer=raw.get("moe_layer", "False"),
            tail=_specs(raw.get("tail"), f"{fid}.tail"), experts=raw.get("experts"), top_k=raw.get("top_k")))
    pair = doc.get("attention_gemm_pair") or {}
    try:
        return Architectures(tuple(fams), re.compile(str(pair.get("softmax", "(?i)softmax"))),
                             re.compile(str(pair.get("not_between", "(?i)topk|sort"))),
                             int(pair.get("max_between", 4)))
    except (re.error, TypeError, ValueError) as e:
        raise RuleError(f"attention_gemm_pair: {e}", path) from None
