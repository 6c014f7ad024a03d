"""Safe expression parser: precedence, exact rationals, and refusal of everything outside the grammar."""
import os
import re
from fractions import Fraction

import pytest

from jaxrl_batch.tasks import expr_parser
from jaxrl_batch.tasks.expr_parser import ExprError, evaluate


@pytest.mark.parametrize("text, value", [
    ("2+3*4", 14), ("(2+3)*4", 20), ("10-4-3", 3), ("100/10/5", 2), ("2*3-4/2", 4), ("-3+5", 2), ("--3", 3),
    ("2*-3", -6), ("-(2+3)*2", -10), ("7/2", Fraction(7, 2)), ("7/2*2", 7), ("1/3+1/6", Fraction(1, 2)),
    (" ( 25 * 3 ) - 6 ", 69), ("0", 0), ("((((4))))", 4),
])
def test_values(text, value):
  assert evaluate(text).value == value


def test_numbers_in_order_of_appearance():
  assert evaluate("(25*3)-6+25").numbers == (25, 3, 6, 25)
  assert evaluate("-(7)").numbers == (7,)


@pytest.mark.parametrize("text", [
    "1/0", "5/(3-3)", "1/(2/4-1/2)",  # division by zero
    "__import__('os')", "__import__('os').system('ls')", "abc", "x+1", "2**100", "2^3", "1.5", "1e5", "3%2",
    "", "   ", "()", "(1+2", "1+2)", "1 2", "+3", "3+", "*3", "4//2", "١٢+3", "²", "1,000",
])
def test_rejects_invalid(text):
  with pytest.raises(ExprError):
    evaluate(text)


def test_limits():
  with pytest.raises(ExprError, match="characters"):
    evaluate("1+" * 200 + "1")
  with pytest.raises(ExprError, match="digits"):
    evaluate("1" * (expr_parser.MAX_DIGITS + 1))
  assert evaluate("9" * expr_parser.MAX_DIGITS).value == 10**expr_parser.MAX_DIGITS - 1
  with pytest.raises(ExprError, match="nesting"):
    evaluate("(" * 40 + "1" + ")" * 40)
  with pytest.raises(ExprError, match="nesting"):
    evaluate("-" * 40 + "1")
  assert evaluate("(" * 20 + "1" + ")" * 20).value == 1
  with pytest.raises(ExprError):
    evaluate(None)


def test_source_never_evaluates_python():
  with open(os.path.join(os.path.dirname(expr_parser.__file__), "expr_parser.py")) as f:
    source = f.read()
  assert not re.search(r"\b(eval|exec|compile|literal_eval)\(|import ast|__import__", source)
