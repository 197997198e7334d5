"""``countdown``: reach a target with given numbers and ``+ - * /``; checked by a safe evaluator.

The answer is an arithmetic expression (``"(3+5)*2"``). It is parsed with :mod:`ast` and
evaluated over exact :class:`fractions.Fraction` values by walking the tree: only integer
literals, ``+ - * /`` and parentheses are accepted (no names, calls, attributes, powers, unary
minus), so nothing the model writes is ever executed. Each given number may be used at most
once (as a multiset); ``/`` must divide exactly (the Countdown game rule; TinyZero, Pan et al.
2025). An optional trailing ``= target`` is ignored.
"""

from __future__ import annotations

import ast
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from posttrain.rewards.verdict import Verdict
from posttrain.rewards.verifier import VERIFIERS
from posttrain.trajectory import Status

MAX_EXPR_CHARS = 200


class ExpressionError(ValueError):
    """The expression is not a valid countdown expression; the message says why."""


_BINOPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def _eval(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, used), _eval(node.right, used)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ExpressionError("division by zero")
            q = a / b
            if q.denominator != 1:
                raise ExpressionError(f"inexact division {a}/{b}")
            return q
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise ExpressionError(f"operator {type(node.op).__name__} not allowed (only + - * /)")
        return op(a, b)
    raise ExpressionError(f"{type(node).__name__} not allowed (only integers, + - * /, parentheses)")


def safe_evaluate(expr: str) -> tuple[Fraction, list[int]]:
    """Value of ``expr`` and the integer literals it uses, without ``eval``.

    Raises :class:`ExpressionError` for anything outside integers, ``+ - * /`` and parentheses,
    for division by zero or inexact division, and for expressions over ``MAX_EXPR_CHARS``.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise ExpressionError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise ExpressionError(f"syntax error: {e.msg}") from None
    used: list[int] = []
    return _eval(tree, used), used


def check_numbers(used: Sequence[int], numbers: Sequence[int], use_all: bool = False) -> str | None:
    """``None`` if ``used`` is a sub-multiset of ``numbers`` (equal to it if ``use_all``), else why not."""
    extra = Counter(used) - Counter(numbers)
    if extra:
        return f"uses {sorted(extra.elements())} beyond the given {sorted(numbers)}"
    if use_all and Counter(used) != Counter(numbers):
        return f"does not use all of {sorted(numbers)}"
    return None


@VERIFIERS.register("countdown")
@dataclasses.dataclass(frozen=True)
class CountdownVerifier:
    """``reference = {"numbers": [...], "target": int}``.

    ``invalid`` (format 0): not a countdown expression (syntax, forbidden node, bad division).
    ``wrong`` (format 1): a valid expression that misuses the numbers or misses the target.
    """

    use_all: bool = False
    name: str = "countdown"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        """See the class docstring."""
        numbers, target = list(reference["numbers"]), int(reference["target"])
        expr = response.strip().split("=")[0]
        try:
            value, used = safe_evaluate(expr)
        except ExpressionError as e:
            return Verdict(Status.INVALID, {"task": 0.0, "format": 0.0}, f"{expr[:60]!r}: {e}")
        why = check_numbers(used, numbers, self.use_all)
        if why is not None:
            return Verdict(Status.WRONG, {"task": 0.0, "format": 1.0}, f"{expr[:60]!r} {why}")
        ok = value == target
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok), "format": 1.0},
                       f"{expr[:60]!r} = {value}, target {target}")
