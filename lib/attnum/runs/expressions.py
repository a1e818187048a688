"""A small safe expression language: the ``_rules`` and ``_memory`` entries of ``params/<study>/schema.yaml``.

Kept only for studies whose package does not yet define ``rules(p)`` and ``memory_estimate(p)`` in
plain Python (``attnum.runs.params`` prefers those); to be deleted once every study has them.
"""
from __future__ import annotations

import ast
import operator

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}
_FUNCTIONS = {"min": min, "max": max, "len": len, "sum": sum, "abs": abs, "all": all, "any": any,
              "sorted": sorted, "int": int, "float": float}


def names_in(expr: str) -> set[str]:
    try:
        return {n.id for n in ast.walk(ast.parse(expr, mode="eval")) if isinstance(n, ast.Name)}
    except SyntaxError:
        return set()


def evaluate(expr: str, names: dict):
    """Evaluate ``expr`` over ``names`` without ``eval``: literals, names, arithmetic, comparisons,
    ``and``/``or``/``not``, ``a if c else b``, lists, indexing, and ``min max len sum abs all any
    sorted int float``. Anything else (attributes, other calls, comprehensions) is a ``ValueError``."""
    tree = ast.parse(expr, mode="eval")

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
            return node.value
        if isinstance(node, ast.Name):
            if node.id in names:
                return names[node.id]
            raise KeyError(f"unknown name {node.id!r}")
        if isinstance(node, (ast.List, ast.Tuple)):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError("exponent too large")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd, ast.Not)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else (+value if isinstance(node.op, ast.UAdd) else not value)
        if isinstance(node, ast.BoolOp):
            values = (ev(v) for v in node.values)
            if isinstance(node.op, ast.And):
                result = True
                for result in values:
                    if not result:
                        return result
                return result
            result = False
            for result in values:
                if result:
                    return result
            return result
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            left = ev(node.left)
            for op, comp in zip(node.ops, node.comparators):
                right = ev(comp)
                if not _COMPARE[type(op)](left, right):
                    return False
                left = right
            return True
        if isinstance(node, ast.IfExp):
            return ev(node.body) if ev(node.test) else ev(node.orelse)
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Slice):
            return ev(node.value)[ev(node.slice)]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCTIONS
                and not node.keywords):
            return _FUNCTIONS[node.func.id](*(ev(a) for a in node.args))
        raise ValueError(f"{type(node).__name__} is not allowed in a rule or estimate: {ast.unparse(node)!r}")

    return ev(tree)

