"""The manifest expression language: a safe subset of Python over geometry numbers.

Manifests (``manifests/*.toml``) write shapes, derived numbers, layer kinds and budget terms as
expressions: integer arithmetic (``+ - * // % **``, ``/`` only where a float is meant),
comparisons (also ``in`` / ``not in`` a tuple of constants, ``is None`` / ``is not None``), ``and/or/not``,
``x if c else y``, ``min``, ``max``, ``sqrt``, ``int``, ``len``, ``is_list``, ``defined(name)``, indexing of array
params, and string constants. :func:`evaluate` parses once
(cached) and walks the AST; anything else (attribute access, lambdas, comprehensions, calls of
other functions) is refused by :func:`parse` with the expression in the message.

Two functions exist only when the caller binds them: ``ne(role, d)`` (dim ``d`` of the tensor with
that role, in the current layer for a per-layer role) and ``has(role)``. The budget audit binds them
to a pack's tensor shapes for the second, independent derivation of every budget term
(``[state_from_tensors]``).
"""

from __future__ import annotations

import ast
import math
import operator
from functools import lru_cache
from typing import Any


class ManifestError(ValueError):
    """A manifest file or a model's metadata that does not satisfy its manifest."""


BINOPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
CMPOPS = {
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.In: lambda a, b: a in b,
    ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_,
    ast.IsNot: operator.is_not,
}
FUNCS = {"min": min, "max": max, "sqrt": math.sqrt, "int": int, "len": len, "is_list": lambda x: isinstance(x, list)}
#: Functions an expression may call only when the caller binds them in ``env``: ``ne(role, d)`` (dim
#: ``d`` of the tensor with that role, in the current layer for a per-layer role) and ``has(role)``
#: (see the module docstring).
ENV_FUNCS = ("ne", "has")


@lru_cache(maxsize=4096)
def parse(expr: str) -> ast.Expression:
    """Parse ``expr`` and check every node is allowed (cached). Raises ManifestError naming the expression."""
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as e:
        raise ManifestError(f"bad expression {expr!r}: {e.msg}") from None
    for node in ast.walk(tree):
        ok = (
            isinstance(
                node,
                (
                    ast.Expression,
                    ast.BinOp,
                    ast.UnaryOp,
                    ast.Compare,
                    ast.BoolOp,
                    ast.IfExp,
                    ast.Name,
                    ast.Constant,
                    ast.Subscript,
                    ast.Call,
                    ast.Load,
                    ast.And,
                    ast.Or,
                    ast.Not,
                    ast.USub,
                    ast.UAdd,
                    ast.Tuple,
                ),
            )
            or type(node) in BINOPS
            or type(node) in CMPOPS
        )
        if not ok:
            raise ManifestError(f"expression {expr!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in (*FUNCS, *ENV_FUNCS, "defined")
        ):
            raise ManifestError(f"expression {expr!r}: only min/max/sqrt/int/len/is_list/defined/ne/has may be called")
    return tree


def evaluate(expr: str | int | float, env: dict[str, Any]) -> Any:
    """Evaluate a manifest expression over ``env`` (param name -> value).

    Raises:
        ManifestError: syntax outside the allowed subset, or an unknown name (naming it).
    """
    if isinstance(expr, (int, float)):
        return expr
    tree = parse(expr)

    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.Name):
            if n.id in ("True", "False", "None"):
                return {"True": True, "False": False, "None": None}[n.id]
            if n.id not in env:
                raise ManifestError(f"expression {expr!r}: unknown name {n.id!r}")
            return env[n.id]
        if isinstance(n, ast.BinOp):
            return BINOPS[type(n.op)](ev(n.left), ev(n.right))
        if isinstance(n, ast.UnaryOp):
            v = ev(n.operand)
            return (not v) if isinstance(n.op, ast.Not) else (-v if isinstance(n.op, ast.USub) else +v)
        if isinstance(n, ast.Compare):
            left = ev(n.left)
            for op, c in zip(n.ops, n.comparators):
                right = ev(c)
                if not CMPOPS[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(n, ast.BoolOp):
            if isinstance(n.op, ast.And):
                v = True
                for x in n.values:
                    v = ev(x)
                    if not v:
                        return v
                return v
            v = False
            for x in n.values:
                v = ev(x)
                if v:
                    return v
            return v
        if isinstance(n, ast.IfExp):
            return ev(n.body) if ev(n.test) else ev(n.orelse)
        if isinstance(n, ast.Subscript):
            return ev(n.value)[ev(n.slice)]
        if isinstance(n, ast.Tuple):
            return tuple(ev(x) for x in n.elts)
        if isinstance(n, ast.Call):
            name = n.func.id
            if name == "defined":
                a = n.args[0]
                return isinstance(a, ast.Name) and env.get(a.id) is not None
            if name in ENV_FUNCS:
                fn = env.get(name)
                if not callable(fn):
                    raise ManifestError(f"expression {expr!r}: {name}() needs tensor shapes, none were bound")
                return fn(*[ev(a) for a in n.args])
            return FUNCS[name](*[ev(a) for a in n.args])
        raise ManifestError(f"expression {expr!r}: cannot evaluate {type(n).__name__}")

    return ev(tree)


def names_in(expr: str) -> list[str]:
    """The names an expression reads (for messages that show their values)."""
    return sorted({n.id for n in ast.walk(parse(expr)) if isinstance(n, ast.Name)})


__all__ = ["ENV_FUNCS", "FUNCS", "ManifestError", "evaluate", "names_in", "parse"]
