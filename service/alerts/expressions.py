"""Scalar expressions of alert rules: plain arithmetic over scalar names (``loss / loss_shadow - 1``).

Operators ``+ - * /``, unary minus, parentheses, numbers and scalar names. A step yields a sample of such an
expression only when every scalar it names was reported at that step, so the shipped "loss diverges from the FP32
shadow" rule stays silent for runs without a shadow. Division by zero follows IEEE 754 (``x/0`` is ``±inf``, ``0/0``
is NaN); parsing walks the syntax tree and never calls ``eval``.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from quantwatch.protocol import SCALARS as CATALOG_SCALARS

__all__ = ["SCALARS", "ScalarExpression"]

SCALARS: frozenset[str] = frozenset(CATALOG_SCALARS)
"""Canonical per-run scalar names (the protocol's catalogue)."""


_BIN_OPS: dict[type[ast.operator], Callable[[float, float], float]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: lambda a, b: _ieee_div(a, b),
}


def _ieee_div(numerator: float, denominator: float) -> float:
    if denominator == 0.0:
        if numerator == 0.0 or math.isnan(numerator):
            return math.nan
        return math.copysign(math.inf, numerator) * math.copysign(1.0, denominator)
    return numerator / denominator


@dataclass(frozen=True)
class ScalarExpression:
    """A parsed arithmetic expression over scalar names (``loss / loss_shadow - 1``), evaluated without ``eval``."""

    text: str
    names: frozenset[str]
    _tree: ast.expr

    @classmethod
    def parse(cls, text: str) -> ScalarExpression:
        """Parse and validate ``text``; raises ``ValueError`` naming the problem."""
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError as exc:
            raise ValueError(f"scalar: cannot parse expression {text!r}: {exc.msg}") from None
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                # Any scalar a run may send: the catalogued ones, the agent's counters (agent_*), the user's own
                # (grad_norm=, lr=); `quantwatch rules check` warns about names outside the catalogue.
                names.add(node.id)
            elif isinstance(node, ast.Constant):
                if isinstance(node.value, bool) or not isinstance(node.value, int | float):
                    raise ValueError(f"scalar: only numbers may appear as constants, not {node.value!r}")
            elif isinstance(node, ast.BinOp):
                if type(node.op) not in _BIN_OPS:
                    raise ValueError("scalar: only + - * / are allowed in an expression")
            elif isinstance(node, ast.UnaryOp):
                if not isinstance(node.op, ast.USub | ast.UAdd):
                    raise ValueError("scalar: only unary + and - are allowed in an expression")
            elif not isinstance(node, ast.operator | ast.unaryop | ast.Load):
                raise ValueError(f"scalar: {type(node).__name__} is not allowed in an expression")
        if not names:
            raise ValueError("scalar: the expression must name at least one scalar")
        return cls(text=text, names=frozenset(names), _tree=tree)

    def evaluate(self, scalars: Mapping[str, float]) -> float | None:
        """The value at one step, or ``None`` when a scalar it names was not reported at that step."""
        if not self.names.issubset(scalars.keys()):
            return None
        return self._eval(self._tree, scalars)

    def _eval(self, node: ast.expr, scalars: Mapping[str, float]) -> float:
        if isinstance(node, ast.Name):
            return float(scalars[node.id])
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return float(node.value)
        if isinstance(node, ast.UnaryOp):
            inner = self._eval(node.operand, scalars)
            return -inner if isinstance(node.op, ast.USub) else inner
        if isinstance(node, ast.BinOp):
            return _BIN_OPS[type(node.op)](self._eval(node.left, scalars), self._eval(node.right, scalars))
        raise ValueError(f"scalar: {type(node).__name__} is not allowed in an expression")
