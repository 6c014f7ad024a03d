r"""Final answers in text: GSM8K numbers (`#### 72` or the last number) and MATH `\boxed{...}` expressions.

Every function accepts any input and never raises: a non-string, an answer longer than MAX_ANSWER_CHARS or a
number with more than MAX_NUMBER_DIGITS digits counts as no answer (Python refuses int() of very long strings).

Comparison. GSM8K numbers are equal iff their exact values are ('1,000' == '$1000' == '1000.0' == '1000.').
MATH answers are normalised (`normalize_math`); if both then read as numbers (an integer, a decimal, `\frac{a}{b}`
or `a/b` with a sign) they are compared as rationals: exactly when both are integers or fractions of integers,
within a relative REL_TOL when either holds a decimal. Otherwise the normalised strings must be equal.
"""
from __future__ import annotations

import re
from fractions import Fraction
from typing import NamedTuple

MAX_ANSWER_CHARS = 1000  # Longer answers are neither normalised nor matched.
MAX_NUMBER_DIGITS = 100  # Longer digit strings are not read as numbers.
REL_TOL = 1e-6  # Relative tolerance of numeric MATH comparisons that involve a decimal.

# A number inside text: a minus sign unless it follows a word, ')' or '.' (so "5-3" holds 5 and 3), an optional
# '$', digits with optional thousands commas, optional decimals. A sentence's final '.' is not part of it.
_NUMBER_IN_TEXT_RE = re.compile(r"(?:(?<![\w).])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
# A whole string that is one number: sign, '$', integer part (maybe with thousands commas), '.' and decimals.
_NUMBER_RE = re.compile(r"(-?)\$?(\d{1,3}(?:,\d{3})+|\d*)(?:\.(\d*))?")
_UNSIGNED = r"(?:\d+(?:\.\d*)?|\.\d+)"
_FRACTION_RES = (re.compile(rf"(-?)\\frac\{{(-?{_UNSIGNED})\}}\{{(-?{_UNSIGNED})\}}"),
                 re.compile(rf"()(-?{_UNSIGNED})/(-?{_UNSIGNED})"))
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")

_BOX_RE = re.compile(r"\\(?:boxed|fbox) *\{")
_BRACE_TOKEN_RE = re.compile(r"\\.|[{}]", re.S)  # An escaped character (skipped) or a brace.
# Spellings dropped or rewritten before comparing MATH answers; order matters ('\$' before '$').
_REPLACEMENTS = (("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""), ("\\ ", " "), ("\\displaystyle", ""),
                 ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\%", ""), ("%", ""), ("\\$", ""), ("$", ""),
                 ("{,}", ","), ("°", ""))
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_DEGREES_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree")
# A `\text{ cm}`-style unit (maybe squared) after a number or a closing brace, at the end of the answer.
_TEXT_UNIT_RE = re.compile(r"^(.*?[\d}])\s*\\(?:text|textrm|mbox)\s*\{\s*[A-Za-z][A-Za-z .]*\}(?:\^\{?\d\}?)?$")
_TEXT_WRAPPER_RE = re.compile(r"\\(?:text|textrm|textbf|mbox|mathrm|mathbf)\s*\{([^{}]*)\}")
# A number followed only by plain words, the first of 2+ letters: "12 dollars", "4 square feet".
_WORD_UNIT_RE = re.compile(r"^(-?[\d.,]*\d)\s+[A-Za-z]{2,}(?:\s+[A-Za-z]+)*(?:\^\d)?$")
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z]\s*=\s*")


class Number(NamedTuple):
  """A parsed number: its exact value, and whether it was written without decimals (integers, fractions)."""
  value: Fraction
  exact: bool


def parse_number(text) -> Number | None:
  """'72', '-3', '1,000', '$5', '72.', '72.0', '.5' as a Number; None if `text` is not one such number."""
  if not isinstance(text, str) or len(text) > MAX_ANSWER_CHARS:
    return None
  match = _NUMBER_RE.fullmatch(text.strip())
  if match is None:
    return None
  sign, whole, decimals = match.group(1), match.group(2).replace(",", ""), match.group(3) or ""
  if not (whole or decimals) or len(whole) + len(decimals) > MAX_NUMBER_DIGITS:
    return None
  scale = 10**len(decimals)
  value = Fraction(int(whole or "0") * scale + int(decimals or "0"), scale)
  return Number(-value if sign else value, not decimals)


def same_number(a, b) -> bool:
  """Whether `a` and `b` (strings or ints) are numbers with the same exact value."""
  x, y = parse_number(str(a)), parse_number(str(b))
  return x is not None and y is not None and x.value == y.value


def number_after_hashes(text) -> str | None:
  """The number right after the first '####' in `text` ('1,000' in '... #### 1,000 apples'), or None."""
  if not isinstance(text, str):
    return None
  start = text.find("####")
  if start < 0:
    return None
  pos = start + 4
  while pos < len(text) and text[pos].isspace():
    pos += 1
  match = _NUMBER_IN_TEXT_RE.match(text, pos)
  return match.group(0) if match else None


def last_number(text) -> str | None:
  """The last number in `text` ('-7' in 'it fell to -7 degrees.'), or None."""
  if not isinstance(text, str):
    return None
  last = None
  for last in _NUMBER_IN_TEXT_RE.finditer(text):
    pass
  return last.group(0) if last else None


def last_boxed(text) -> str | None:
  r"""The content of the last complete `\boxed{...}` (or `\fbox{...}`) in `text`, braces balanced; else None.

  '\boxed{\frac{1}{2}}' gives '\frac{1}{2}'. Escaped braces (`\{`, `\}`) do not count. A box that never closes
  (a truncated completion) or holds more than MAX_ANSWER_CHARS characters is skipped. One pass: linear time.
  """
  if not isinstance(text, str):
    return None
  opens = [match.end() - 1 for match in _BOX_RE.finditer(text)]
  if not opens:
    return None
  closing, stack = {}, []
  for match in _BRACE_TOKEN_RE.finditer(text, opens[0]):
    if match.group() == "{":
      stack.append(match.start())
    elif match.group() == "}" and stack:
      closing[stack.pop()] = match.start()
  for start in reversed(opens):
    end = closing.get(start)
    if end is not None and end - start - 1 <= MAX_ANSWER_CHARS:
      return text[start + 1:end]
  return None


def normalize_math(answer: str) -> str:
  r"""A canonical spelling of a MATH answer: '\dfrac12' -> '\frac{1}{2}', 'x = 5\text{ cm}' -> '5'.

  Drops spaces, `\left`/`\right`, `\!`-style spacing, degrees, `\%`, `\$`, `\displaystyle`, a unit after a
  number (`\text{ cm}^2`, or plain words as in '12 dollars'), a leading 'x =' and a final '.'; unwraps `\text{}`,
  `\mbox{}`, `\mathrm{}`, `\mathbf{}`; rewrites `\dfrac`/`\tfrac` as `\frac`, braces `\frac12` and `\sqrt2`, and
  writes '.5' as '0.5'.
  """
  text = answer.strip()
  for old, new in _REPLACEMENTS:
    text = text.replace(old, new)
  text = _LEFT_RIGHT_RE.sub("", text)
  text = _DEGREES_RE.sub("", text)
  text = _TEXT_UNIT_RE.sub(r"\1", text)
  unwrapped = _TEXT_WRAPPER_RE.sub(r"\1", text)
  while unwrapped != text:
    text, unwrapped = unwrapped, _TEXT_WRAPPER_RE.sub(r"\1", unwrapped)
  text = _WORD_UNIT_RE.sub(r"\1", text.strip())
  if text.count("=") == 1:
    text = _ASSIGNMENT_RE.sub("", text)
  text = re.sub(r"\s+", "", text)
  text = re.sub(r"\\frac([^{\\])", r"\\frac{\1}", text)
  text = re.sub(r"\\frac(\{[^{}]*\})([^{\\])", r"\\frac\1{\2}", text)
  text = re.sub(r"\\sqrt([^{\\\[])", r"\\sqrt{\1}", text)
  text = re.sub(r"(?<!\d)\.(\d)", r"0.\1", text)
  return text.rstrip(".")


def math_number(normalized: str) -> Number | None:
  r"""A normalised answer's value if it is a number: '-3', '0.25', '1,000', '\frac{-1}{2}', '-3/4'; else None."""
  if _THOUSANDS_RE.fullmatch(normalized):
    normalized = normalized.replace(",", "")
  number = parse_number(normalized)
  if number is not None:
    return number
  for pattern in _FRACTION_RES:
    match = pattern.fullmatch(normalized)
    if match:
      num, den = parse_number(match.group(2)), parse_number(match.group(3))
      if num is None or den is None or den.value == 0:
        return None
      value = num.value / den.value
      return Number(-value if match.group(1) else value, num.exact and den.exact)
  return None


def math_equal(prediction, reference) -> bool:
  """Whether two MATH answers agree, as numbers when both read as numbers, else as normalised strings."""
  if not (isinstance(prediction, str) and isinstance(reference, str)):
    return False
  if max(len(prediction), len(reference)) > MAX_ANSWER_CHARS:
    return False
  a, b = normalize_math(prediction), normalize_math(reference)
  x, y = math_number(a), math_number(b)
  if x is not None and y is not None:
    if x.exact and y.exact:
      return x.value == y.value
    return abs(x.value - y.value) <= REL_TOL * max(abs(x.value), abs(y.value))
  return a == b
