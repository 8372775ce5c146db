"""A small, safe expression language for rule files.

Rule conditions, estimates and message placeholders are Python-looking expressions evaluated by
walking their syntax tree (``ast.parse(mode='eval')``) over a whitelist of node types. There is
no ``eval``, no attribute access, no subscripts, no comprehensions or lambdas, and names resolve
only to metrics of the rule's scope. Arithmetic is on numbers only (strings can be compared and
tested with ``in``), exponents and integer sizes are bounded, and source length, tree depth and node
count are bounded. Evaluation visits each node at most once (there are no loops), and a step budget
enforces that: the work of one evaluation is bounded by the expression, never by a clock, so a rule
decides the same on a loaded machine as on an idle one.

Missing evidence: a metric whose value is ``None`` makes every expression that needs it ``None``
("cannot decide"), except for the explicit ``x is None`` / ``x is not None`` tests, and the
three-valued ``and``/``or`` (``False and None`` is ``False``, ``True or None`` is ``True``).
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

MAX_SOURCE = 1000  # characters of one expression
MAX_DEPTH = 24  # syntax-tree depth
MAX_NODES = 300
MAX_STRING = 200  # characters of a string literal
MAX_EXPONENT = 64  # |b| in a ** b
MAX_INT_BITS = 256  # integer results beyond this are an error (no runaway big-int arithmetic)
MAX_STEPS = 2 * MAX_NODES  # node visits per evaluation (each node is visited at most once)


class ExprError(ValueError):
    """An expression is not allowed (raised at load time) or cannot be computed."""


class _Undecided(Exception):
    """Raised internally when evaluation cannot go on (division by zero, overflow, ...)."""


def _log(x: float, base: float | None = None) -> float:
    return math.log(x) if base is None else math.log(x, base)


def _round(x: float, ndigits: int | None = None) -> float:
    if ndigits is None:
        return round(x)
    if not isinstance(ndigits, int) or abs(ndigits) > 20:
        raise ValueError("ndigits must be an integer between -20 and 20")
    return round(x, ndigits)


FUNCTIONS: dict[str, tuple[Callable[..., Any], int, int]] = {
    # name: (function, min args, max args)
    "min": (min, 1, 8),
    "max": (max, 1, 8),
    "abs": (abs, 1, 1),
    "round": (_round, 1, 2),
    "log": (_log, 1, 2),
    "sqrt": (math.sqrt, 1, 1),
}
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: lambda a, b: a / b,
    ast.FloorDiv: lambda a, b: a // b,
    ast.Mod: lambda a, b: a % b,
    ast.Pow: lambda a, b: a ** b,
}
_CMPOPS: dict[type, Callable[[Any, Any], bool]] = {
    ast.Eq: lambda a, b: a == b,
    ast.NotEq: lambda a, b: a != b,
    ast.Lt: lambda a, b: a < b,
    ast.LtE: lambda a, b: a <= b,
    ast.Gt: lambda a, b: a > b,
    ast.GtE: lambda a, b: a >= b,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
}
_ALLOWED = (
    ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.BinOp, ast.UnaryOp, ast.USub, ast.UAdd, ast.Not,
    ast.Compare, ast.IfExp, ast.Call, ast.Name, ast.Load, ast.Constant, ast.Tuple, ast.List,
    ast.Is, ast.IsNot, *_BINOPS, *_CMPOPS,
)


@dataclass(frozen=True)
class Expr:
    """A parsed, validated expression: its source, the metric names it reads and its tree."""

    source: str
    names: frozenset[str]
    tree: ast.Expression = field(repr=False, compare=False)

    def evaluate(self, env: Mapping[str, Any]) -> Any:
        """Value of the expression over ``env`` (metric name -> value); ``None`` when it cannot be
        decided (missing metric, division by zero, overflow). Never raises for valid expressions
        except :class:`ExprError` when the step budget is exceeded."""
        return evaluate(self, env)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float))  # bool is an int


def parse(source: str, known: Callable[[str], bool] | None = None) -> Expr:
    """Parse and validate an expression. ``known(name)`` says whether a name is a metric of the
    scope; unknown names, disallowed syntax and oversized input raise :class:`ExprError`."""
    if not isinstance(source, str):
        raise ExprError(f"expected an expression string, got {type(source).__name__}")
    if len(source) > MAX_SOURCE:
        raise ExprError(f"expression is {len(source)} characters long (limit {MAX_SOURCE})")
    if "\x00" in source:
        raise ExprError("expression contains a NUL character")
    text = " ".join(source.split())  # one logical line: newlines in YAML block scalars are spaces
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise ExprError(f"syntax error in expression {source!r}: {e.msg}") from None
    except (RecursionError, MemoryError, ValueError) as e:
        raise ExprError(f"expression {source[:60]!r}... is too deeply nested ({type(e).__name__})") from None
    names: set[str] = set()
    count = 0
    stack: list[tuple[ast.AST, int]] = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise ExprError(f"expression is nested deeper than {MAX_DEPTH} levels")
        if count > MAX_NODES:
            raise ExprError(f"expression has more than {MAX_NODES} syntax nodes")
        if not isinstance(node, _ALLOWED):
            raise ExprError(f"{_describe(node)} is not allowed in rule expressions")
        if isinstance(node, ast.Constant):
            v = node.value
            if v is not None and not isinstance(v, (bool, int, float, str)):
                raise ExprError(f"constant {v!r} is not allowed (numbers, strings, true/false, None only)")
            if isinstance(v, str) and len(v) > MAX_STRING:
                raise ExprError(f"string literal of {len(v)} characters (limit {MAX_STRING})")
            if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
                raise ExprError("integer literal is too large")
        elif isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
                fname = node.func.id if isinstance(node.func, ast.Name) else _describe(node.func)
                raise ExprError(f"call of {fname!r}: only {', '.join(sorted(FUNCTIONS))} may be called")
            if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
                raise ExprError(f"{node.func.id}() takes positional arguments only")
            _, lo, hi = FUNCTIONS[node.func.id]
            if not lo <= len(node.args) <= hi:
                raise ExprError(f"{node.func.id}() takes {lo}..{hi} arguments, got {len(node.args)}")
            stack.extend((a, depth + 1) for a in node.args)
            continue  # the function name is not a metric
        elif isinstance(node, ast.Name):
            if node.id.startswith("_"):
                raise ExprError(f"name {node.id!r} is not allowed (names starting with '_' are reserved)")
            if node.id in FUNCTIONS:
                raise ExprError(f"{node.id!r} is a function: call it")
            if node.id in ("True", "False", "None"):
                continue
            if known is not None and not known(node.id):
                raise ExprError(f"unknown metric {node.id!r}")
            names.add(node.id)
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, (ast.Is, ast.IsNot)) and not (
                        isinstance(right, ast.Constant) and right.value is None):
                    raise ExprError("'is' / 'is not' may only compare with None")
                if isinstance(op, (ast.In, ast.NotIn)) and isinstance(right, (ast.List, ast.Tuple)):
                    for elt in right.elts:
                        if not isinstance(elt, ast.Constant):
                            raise ExprError("lists after 'in' may hold constants only")
        elif isinstance(node, (ast.List, ast.Tuple)) and len(node.elts) > 64:
            raise ExprError("list literal is too long")
        stack.extend((c, depth + 1) for c in ast.iter_child_nodes(node))
    # lists / tuples may only appear as the right side of 'in'
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(right, (ast.List, ast.Tuple)) and not isinstance(op, (ast.In, ast.NotIn)):
                    raise ExprError("list literals may only follow 'in' / 'not in'")
            if isinstance(node.left, (ast.List, ast.Tuple)):
                raise ExprError("list literals may only follow 'in' / 'not in'")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.List, ast.Tuple)) and not isinstance(node, ast.Compare):
                raise ExprError("list literals may only follow 'in' / 'not in'")
    return Expr(source=text, names=frozenset(names), tree=tree)


def _describe(node: ast.AST) -> str:
    labels = {
        ast.Attribute: "attribute access ('.')", ast.Subscript: "subscript ('[...]')",
        ast.Lambda: "lambda", ast.ListComp: "comprehension", ast.SetComp: "comprehension",
        ast.DictComp: "comprehension", ast.GeneratorExp: "generator", ast.Dict: "dict literal",
        ast.Set: "set literal", ast.JoinedStr: "f-string", ast.NamedExpr: "assignment (':=')",
        ast.Starred: "star argument", ast.Await: "await", ast.Yield: "yield", ast.Slice: "slice",
    }
    for t, label in labels.items():
        if isinstance(node, t):
            return label
    return type(node).__name__


class _Evaluator:
    def __init__(self, env: Mapping[str, Any], steps: int = MAX_STEPS) -> None:
        self.env = env
        self.steps = steps

    def run(self, node: ast.AST) -> Any:  # noqa: C901 - a dispatch over node types
        self.steps -= 1
        if self.steps < 0:
            raise ExprError(f"expression exceeded its budget of {MAX_STEPS} evaluation steps")
        if isinstance(node, ast.Expression):
            return self.run(node.body)
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            if node.id == "True":
                return True
            if node.id == "False":
                return False
            if node.id == "None":
                return None
            return self.env.get(node.id)
        if isinstance(node, (ast.List, ast.Tuple)):
            return tuple(self.run(e) for e in node.elts)
        if isinstance(node, ast.BoolOp):
            return self._boolop(node)
        if isinstance(node, ast.UnaryOp):
            v = self.run(node.operand)
            if isinstance(node.op, ast.Not):
                return None if v is None else not v
            if v is None:
                return None
            if not _is_num(v):
                raise _Undecided(f"unary minus/plus on a {type(v).__name__}")
            return -v if isinstance(node.op, ast.USub) else +v
        if isinstance(node, ast.BinOp):
            return self._binop(node)
        if isinstance(node, ast.Compare):
            return self._compare(node)
        if isinstance(node, ast.IfExp):
            cond = self.run(node.test)
            if cond is None:
                return None
            return self.run(node.body if cond else node.orelse)
        if isinstance(node, ast.Call):
            fn, _, _ = FUNCTIONS[node.func.id]  # type: ignore[attr-defined]
            args = [self.run(a) for a in node.args]
            if any(a is None for a in args):
                return None
            if not all(_is_num(a) for a in args):
                raise _Undecided(f"{node.func.id}() takes numbers")  # type: ignore[attr-defined]
            try:
                return _check_num(fn(*args))
            except (ValueError, OverflowError, ZeroDivisionError, TypeError) as e:
                raise _Undecided(f"{node.func.id}(): {e}") from None  # type: ignore[attr-defined]
        raise ExprError(f"{_describe(node)} is not allowed")  # unreachable for parsed expressions

    def _boolop(self, node: ast.BoolOp) -> Any:
        saw_none = False
        is_and = isinstance(node.op, ast.And)
        for v_node in node.values:
            v = self.run(v_node)
            if v is None:
                saw_none = True
                continue
            if is_and and not v:
                return False
            if not is_and and v:
                return True
        return None if saw_none else is_and

    def _binop(self, node: ast.BinOp) -> Any:
        a = self.run(node.left)
        b = self.run(node.right)
        if a is None or b is None:
            return None
        if not (_is_num(a) and _is_num(b)):
            raise _Undecided(f"arithmetic on {type(a).__name__} and {type(b).__name__} (numbers only)")
        if isinstance(node.op, ast.Pow):
            if abs(b) > MAX_EXPONENT:
                raise _Undecided(f"exponent {b!r} is larger than {MAX_EXPONENT}")
            if isinstance(a, int) and isinstance(b, int) and a.bit_length() * max(b, 0) > MAX_INT_BITS:
                raise _Undecided("integer power is too large")
        try:
            return _check_num(_BINOPS[type(node.op)](a, b))
        except ZeroDivisionError:
            raise _Undecided("division by zero") from None
        except OverflowError:
            raise _Undecided("numeric overflow") from None

    def _compare(self, node: ast.Compare) -> Any:
        left = self.run(node.left)
        result: Any = True
        for op, right_node in zip(node.ops, node.comparators, strict=True):
            right = self.run(right_node)
            if isinstance(op, ast.Is):
                ok: Any = left is None
            elif isinstance(op, ast.IsNot):
                ok = left is not None
            elif left is None or right is None or (isinstance(right, tuple) and None in right):
                ok = None
            else:
                if isinstance(op, (ast.In, ast.NotIn)):
                    if not isinstance(right, (str, tuple)):
                        raise _Undecided(f"'in' needs a string or a list on its right, got {type(right).__name__}")
                    if isinstance(right, str) and not isinstance(left, str):
                        raise _Undecided("'in' a string needs a string on its left")
                elif isinstance(left, str) != isinstance(right, str) and not isinstance(op, (ast.Eq, ast.NotEq)):
                    raise _Undecided(f"cannot order {type(left).__name__} and {type(right).__name__}")
                ok = _CMPOPS[type(op)](left, right)
            if ok is False:
                return False
            if ok is None:
                result = None
            left = right
        return result


def _check_num(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > MAX_INT_BITS:
        raise _Undecided("integer result is too large")
    if isinstance(v, float) and math.isnan(v):
        raise _Undecided("result is not a number")
    return v


def evaluate(expr: Expr, env: Mapping[str, Any]) -> Any:
    """Evaluate a parsed expression; ``None`` means "cannot decide" (see :class:`Expr`)."""
    value, _ = evaluate_explain(expr, env)
    return value


def evaluate_explain(expr: Expr, env: Mapping[str, Any]) -> tuple[Any, str | None]:
    """Evaluate and also say why the result is ``None`` when it is (missing metrics or an
    arithmetic problem); the reason is ``None`` for a decided value."""
    ev = _Evaluator(env)
    try:
        value = ev.run(expr.tree)
    except _Undecided as e:
        return None, str(e)
    except RecursionError:
        raise ExprError("expression is nested too deeply") from None
    if value is None:
        missing = sorted(n for n in expr.names if env.get(n) is None)
        return None, ("unavailable: " + ", ".join(missing)) if missing else "evaluates to None"
    return value, None
