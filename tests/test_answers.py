r"""Answer extraction (#### N, last number, \boxed{}) and comparison (GSM8K numbers, normalised MATH answers)."""
from fractions import Fraction

import pytest

from jaxrl_batch.tasks import answers


@pytest.mark.parametrize("text, number", [
    ("3 * 4 = 12\n#### 12", "12"), ("####72", "72"), ("#### 1,000 apples", "1,000"), ("#### $1,000.50", "$1,000.50"),
    ("#### -7", "-7"), ("#### 72.", "72"), ("#### 5\nQuestion: next one\n#### 6", "5"),
    ("no hashes, 72", None), ("#### seventy-two", None), ("", None), (None, None), (72, None),
])
def test_number_after_hashes(text, number):
  assert answers.number_after_hashes(text) == number


@pytest.mark.parametrize("text, number", [
    ("The answer is 72.", "72"), ("5-3=2", "2"), ("It fell to -7 degrees.", "-7"), ("x-3", "3"),
    ("1,000,000 people", "1,000,000"), ("pick 3, 4", "4"), ("It costs $2.50 in total", "$2.50"),
    ("#### 12 and then 13", "13"), ("no digits here", None), (None, None),
])
def test_last_number(text, number):
  assert answers.last_number(text) == number


def test_parse_and_same_number():
  assert answers.parse_number("1,000") == (1000, True)
  assert answers.parse_number("-0.25") == (Fraction(-1, 4), False)
  assert answers.parse_number(".5").value == Fraction(1, 2)
  for spelling in ["1000", "1,000", "$1,000", "1000.", "1000.0", " 1000 ", 1000]:
    assert answers.same_number(spelling, 1000), spelling
  assert answers.same_number("-7", -7) and answers.same_number("2.50", "2.5")
  for a, b in [("7", "-7"), ("72.5", 72), ("1,00", 100), ("", 0), ("abc", "abc"), (None, None), ("1/2", "0.5")]:
    assert not answers.same_number(a, b), (a, b)
  assert answers.parse_number("9" * (answers.MAX_NUMBER_DIGITS + 1)) is None  # int() refuses > 4300 digits.


@pytest.mark.parametrize("text, content", [
    (r"so $x = \boxed{4}$.", "4"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\frac{\sqrt{3}}{2}} wait, no: \boxed{\dfrac{1}{\sqrt{2}}}", r"\dfrac{1}{\sqrt{2}}"),
    (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),
    (r"\boxed {7}", "7"), (r"\fbox{8}", "8"),
    (r"\boxed{3} and a truncated \boxed{\frac{1}{", "3"),
    (r"\boxed", None), ("no box", None), ("", None), (None, None),
])
def test_last_boxed(text, content):
  assert answers.last_boxed(text) == content


@pytest.mark.parametrize("a, b", [
    (r"\frac{1}{2}", "0.5"), (r"\frac{1}{2}", "1/2"), (r"\frac12", r"\frac{1}{2}"), (r"\dfrac{1}{2}", ".5"),
    (r"\tfrac{3}{4}", "0.75"), ("-\\frac{1}{2}", r"\frac{-1}{2}"), ("-1/2", "-0.5"), (r"\frac{6}{4}", r"\frac32"),
    ("0.3333333", r"\frac{1}{3}"), ("72", "72.0"), ("1,000", "1000"), (r"1{,}000", "1000"), (r"1\,000", "1000"),
    (r"540^\circ", "540"), (r"540^{\circ}", "540"), (r"15\%", "15"), (r"\$5.00", "5"), ("x = 4", "4"),
    (r"21\text{ cm}^2", "21"), (r"5 \text{ inches}", "5"), ("12 dollars", "12"), (r"\text{Thursday}", "Thursday"),
    (r"\mathrm{Thursday}", r"\text{Thursday}"), (r"\left( 2, 3 \right)", "(2,3)"), (r"\sqrt2", r"\sqrt{2}"),
    (r"5\sqrt{2}", r"5 \sqrt 2"), (r"\frac{\sqrt{3}}{2}", r"\dfrac{\sqrt3}{2}"), (r"\!4", "4."),
    (r"\displaystyle\frac{5}{6}", r"\frac{5}{6}"), ("-7", "-7"),
])
def test_math_equal(a, b):
  assert answers.math_equal(a, b) and answers.math_equal(b, a)


@pytest.mark.parametrize("a, b", [
    ("2", "3"), (r"\frac{1}{2}", r"\frac{1}{3}"), ("0.3333", r"\frac{1}{3}"), ("-1/2", "1/2"), ("(2,3)", "(3,2)"),
    (r"\sqrt{2}", "2"), (r"2\sqrt{2}", r"\sqrt{8}"), ("5x", "5"), ("x+1", "x+2"), (r"\frac{1}{0}", "0"),
    ("", "1"), (None, "1"), ("1", None), ("1" * 2000, "1" * 2000),
])
def test_math_not_equal(a, b):
  assert not answers.math_equal(a, b)


def test_normalize_math_spellings():
  assert answers.normalize_math(r" \left( \dfrac12, \tfrac{3}{4} \right) ") == r"(\frac{1}{2},\frac{3}{4})"
  assert answers.normalize_math(r"y = \text{Thursday}") == "Thursday"
  assert answers.normalize_math(r"x \rightarrow 2") == r"x\rightarrow2"  # \right inside \rightarrow stays.
  assert answers.math_number("12") == (12, True)
  assert answers.math_number(r"-\frac{3}{4}") == (Fraction(-3, 4), True)
  assert answers.math_number("0.75") == (Fraction(3, 4), False)
  assert answers.math_number(r"\frac{1}{0}") is None and answers.math_number("x") is None
