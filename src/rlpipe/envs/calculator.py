"""``calculator``: multi-digit arithmetic (4-digit `+` and `*` by default; the agent demo uses products) with a calculator tool.

Episode: the observation is the problem (``1234*5678``). The policy may call ``calc(EXPR)`` any number
of times (the observation is ``=VALUE`` or ``error: …``) and ends with ``answer(N)``: reward 1 when N
is the exact value, else 0 (or, with ``partial_credit``, a shaped share of it for the right leading
digits; success is still only the exact value, ``info["solved"]``). Copying the tool's answer is the
skill to learn.

``calc`` evaluates integer arithmetic only — ``+ - * // %``, ``**`` with a small exponent, unary
signs and parentheses — by walking the parsed syntax tree; nothing is ever passed to ``eval``. Sizes
are bounded (expression length, exponent, result magnitude) so that no input can make a step slow.
"""

from __future__ import annotations

import ast
import operator
import random
from typing import Any

from pydantic import Field

from rlpipe.envs.actions import parse_int
from rlpipe.envs.base import StepResult, TaskError, ToolEnvironment, register_env
from rlpipe.yamlio import Strict

MAX_EXPR_CHARS = 64
MAX_EXPONENT = 8
MAX_MAGNITUDE = 10**36

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalcError(ValueError):
    """An expression the calculator refuses; the message says why."""


def evaluate(expr: str) -> int:
    """The integer value of an arithmetic expression, or :class:`CalcError`."""
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError):  # ValueError: e.g. a NUL character in the source
        raise CalcError(f"cannot parse {expr!r}") from None
    return _eval(tree.body)


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        value = _UNARY[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and not 0 <= right <= MAX_EXPONENT:
            raise CalcError(f"exponent {right} outside 0..{MAX_EXPONENT}")
        if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        value = _BINARY[type(node.op)](left, right)
    else:
        raise CalcError(f"only integers, + - * // % ** and parentheses are allowed, not {type(node).__name__}")
    if abs(value) > MAX_MAGNITUDE:
        raise CalcError("result too large")
    return value


class CalculatorParams(Strict):
    digits: int = Field(4, ge=1, le=9, description="Digits of each operand of a drawn problem.")
    ops: list[str] = Field(["+", "*"], min_length=1, description="Operators a drawn problem uses: any of + - *.")
    partial_credit: float = Field(0.0, ge=0, lt=1, description="A wrong answer earns this times the share of the value's "
                                  "leading digits it got right (shaping; success stays the exact answer).")

    def model_post_init(self, _: Any) -> None:
        bad = sorted(set(self.ops) - {"+", "-", "*"})
        if bad:
            raise ValueError(f"ops: {bad} not supported; use + - *")


@register_env("calculator", version="1", tools=("calc",), tool_free=True)  # its expert can also answer in its head
class Calculator(ToolEnvironment):
    Params = CalculatorParams
    takes_answer = True

    def reset(self, task: dict[str, Any], seed: int) -> str:
        expr = task.get("expression") or self._draw(seed)
        try:
            self.value = evaluate(str(expr))
        except CalcError as e:
            raise TaskError(f"task field 'expression' = {expr!r}: {e}; give an integer expression") from None
        self.started = True
        return str(expr)

    def draw(self, seed: int) -> dict[str, Any]:
        """The task ``reset(task={}, seed)`` would run, written out."""
        return {"expression": self._draw(seed)}

    def _draw(self, seed: int) -> str:
        rng = random.Random(seed)
        lo, hi = 10 ** (self.params.digits - 1), 10**self.params.digits - 1
        return f"{rng.randint(lo, hi)}{rng.choice(self.params.ops)}{rng.randint(lo, hi)}"

    def answer(self, argument: str) -> StepResult:
        got = parse_int(argument)
        if got == self.value:
            return StepResult("correct", reward=1.0, done=True, info={"solved": True})
        return StepResult("wrong", reward=self._partial(argument), done=True, info={"solved": False})

    def _partial(self, argument: str) -> float:
        """``partial_credit`` × the share of the value's digits the answer has right from the left."""
        if not self.params.partial_credit:
            return 0.0
        want, got = str(self.value), argument.strip()
        same = next((k for k, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        return self.params.partial_credit * same / max(len(want), len(got), 1)

    def call(self, tool: str, argument: str) -> StepResult:
        try:
            return StepResult(f"={evaluate(argument)}", info={"tool": "calc", "tool_error": False})
        except CalcError as e:
            return StepResult(f"error: {e}", info={"tool": "calc", "tool_error": True})
