"""Automatic error localisation for GSM8K-style answers (docs/algorithms/judge.md, issue: Judge tuples).

Every arithmetic step in the text is checked: calculator annotations ``<<48/2=24>>`` and inline
equations ``a op b (op c ...) = r``. The first false step gives the error span: the characters of
that step's stated result (the first place the text says something false). The final answer (after
``####``, else the last number) is compared with the reference (:mod:`specheads.grading`, which
``heads-eval`` grades with too). Evaluation walks the parsed expression tree (numbers, + - * / and
parentheses only); nothing is ``eval``-ed.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass

from specheads.grading import NUMBER, final_answer, final_correct, parse_number

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
# <<expression=result>>
_ANNOTATION = re.compile(r"<<([^<>=]+)=([^<>]+)>>")
# a op b [op c ...] = r, numbers optionally with $ or a trailing %; x, × and ÷ as operators
_TERM = r"\(?\s*\$?(?:" + NUMBER + r")%?\s*\)?"
_INLINE = re.compile(r"(" + _TERM + r"(?:\s*[-+*/x×÷]\s*" + _TERM + r")+)\s*=\s*\$?(" + NUMBER + r")")


@dataclass
class Step:
    """One checked step: where it is, what it states and what it should be."""

    start: int
    end: int
    result_start: int
    result_end: int
    stated: float
    computed: float
    decimals: int = 0  # decimals the stated result is written with

    @property
    def correct(self) -> bool:
        return _matches(self.computed, self.stated, self.decimals)


@dataclass
class Check:
    """The verdict on one answer.

    ``final_correct``: the final answer equals the reference (None without a reference).
    ``error_span``: ``(start, end)`` characters of the first false step's stated result, or None.
    ``steps``: every step found, in text order.
    """

    final_answer: str | None
    final_correct: bool | None
    error_span: tuple[int, int] | None
    steps: list[Step]


def _decimals(text: str) -> int:
    text = text.replace(",", "").strip()
    return len(text.split(".", 1)[1]) if "." in text else 0


def _matches(computed: float, stated: float, decimals: int) -> bool:
    """The stated result equals the computed one, up to the rounding its written decimals show
    (``10/3 = 3.33`` holds, ``7/2 = 3`` does not)."""
    tol = 1e-6 * max(1.0, abs(computed))
    if decimals:
        tol = max(tol, 0.5 * 10.0 ** (-decimals) + 1e-9)
    return abs(computed - stated) <= tol


def evaluate(expression: str) -> float | None:
    """The value of an arithmetic expression (numbers, + - * / x × ÷, parentheses, %, $), or None."""
    text = expression.replace(",", "").replace("$", "").replace("×", "*").replace("÷", "/")
    text = re.sub(r"(?<=[\d)\s])x(?=[\s\d(])", "*", text)
    text = re.sub(r"(\d+(?:\.\d+)?)%", r"(\1/100)", text)
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = walk(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            a, b = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and b == 0:
                raise ZeroDivisionError
            return _OPS[type(node.op)](a, b)
        raise ValueError(f"unsupported expression node {type(node).__name__}")

    try:
        return walk(tree)
    except (ValueError, ZeroDivisionError, OverflowError):
        return None


def steps(text: str) -> list[Step]:
    """Every checkable step of ``text`` in order (annotations and inline equations)."""
    found: list[Step] = []
    covered: list[tuple[int, int]] = []
    for m in _ANNOTATION.finditer(text):
        value = evaluate(m.group(1))
        res = m.group(2)
        try:
            stated = parse_number(res)
        except ValueError:
            continue
        if value is None:
            continue
        found.append(Step(m.start(), m.end(), m.start(2), m.end(2), stated, value, _decimals(res)))
        covered.append((m.start(), m.end()))
    for m in _INLINE.finditer(text):
        if any(a <= m.start() < b for a, b in covered):
            continue
        value = evaluate(m.group(1))
        if value is None:
            continue
        res = m.group(2)
        found.append(Step(m.start(), m.end(), m.start(2), m.end(2), parse_number(res), value, _decimals(res)))
    return sorted(found, key=lambda s: s.start)


def check(text: str, reference: str | None = None) -> Check:
    """Checks every step and the final answer of one answer text."""
    all_steps = steps(text)
    wrong = next((s for s in all_steps if not s.correct), None)
    fin = final_answer(text)
    span = (wrong.result_start, wrong.result_end) if wrong is not None else None
    return Check(
        fin[0] if fin else None, final_correct(text, reference) if reference is not None else None, span, all_steps
    )
