"""Safe arithmetic expressions: integers, + - * /, parentheses and unary minus, evaluated as exact rationals.

A hand-written recursive-descent parser over ASCII text; nothing reaches `eval`, `compile` or `ast`. Grammar:

  expr   := term (('+' | '-') term)*
  term   := factor (('*' | '/') factor)*
  factor := '-' factor | '(' expr ')' | INTEGER

Whitespace between tokens is ignored. Text longer than MAX_CHARS, an integer of more than MAX_DIGITS digits,
nesting (parentheses and unary minus) deeper than MAX_DEPTH, any other character (letters, '.', '**' is a
syntax error) and division by zero raise `ExprError`. The limits bound the work and the size of every value.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

MAX_CHARS = 256  # Longest accepted text, in characters.
MAX_DIGITS = 12  # Longest integer literal, in digits.
MAX_DEPTH = 32  # Deepest nesting of parentheses and unary minus.
_OPERATORS = "+-*/()"


class ExprError(ValueError):
  """The text is not a valid expression under the grammar and limits, or divides by zero."""


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """An expression's exact value and the integer literals it uses, in order of appearance."""
  value: Fraction
  numbers: tuple[int, ...]


def _tokenize(text: str) -> list[str]:
  """Integer literals and single-character operators; whitespace dropped."""
  tokens, i = [], 0
  while i < len(text):
    char = text[i]
    if char.isspace():
      i += 1
    elif char in _OPERATORS:
      tokens.append(char)
      i += 1
    elif "0" <= char <= "9":
      j = i
      while j < len(text) and "0" <= text[j] <= "9":
        j += 1
      if j - i > MAX_DIGITS:
        raise ExprError(f"integer at position {i} has {j - i} digits; at most {MAX_DIGITS} are allowed")
      tokens.append(text[i:j])
      i = j
    else:
      raise ExprError(f"unexpected character {char!r} at position {i}")
  return tokens


class _Parser:
  """Recursive descent over a token list; `numbers` collects the literals as they are read."""

  def __init__(self, tokens: list[str]):
    self.tokens, self.pos, self.numbers = tokens, 0, []

  def _peek(self) -> str | None:
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def _take(self) -> str | None:
    token = self._peek()
    self.pos += 1
    return token

  def expr(self, depth: int) -> Fraction:
    value = self.term(depth)
    while self._peek() in ("+", "-"):
      op = self._take()
      rhs = self.term(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def term(self, depth: int) -> Fraction:
    value = self.factor(depth)
    while self._peek() in ("*", "/"):
      op = self._take()
      rhs = self.factor(depth)
      if op == "*":
        value *= rhs
      elif rhs == 0:
        raise ExprError("division by zero")
      else:
        value /= rhs
    return value

  def factor(self, depth: int) -> Fraction:
    if depth >= MAX_DEPTH:
      raise ExprError(f"nesting deeper than {MAX_DEPTH}")
    token = self._take()
    if token == "-":
      return -self.factor(depth + 1)
    if token == "(":
      value = self.expr(depth + 1)
      if self._take() != ")":
        raise ExprError("missing ')'")
      return value
    if token is not None and token.isdigit():
      self.numbers.append(int(token))
      return Fraction(int(token))
    raise ExprError(f"expected a number, '-' or '(' but found {'the end' if token is None else repr(token)}")


def evaluate(text: str) -> Evaluation:
  """Parses and evaluates `text` exactly; raises ExprError if it is not a valid expression."""
  if not isinstance(text, str):
    raise ExprError(f"expected a string, got {type(text).__name__}")
  if len(text) > MAX_CHARS:
    raise ExprError(f"expression has {len(text)} characters; at most {MAX_CHARS} are allowed")
  tokens = _tokenize(text)
  parser = _Parser(tokens)
  value = parser.expr(0)
  if parser.pos != len(tokens):
    raise ExprError(f"unexpected {tokens[parser.pos]!r} after a complete expression")
  return Evaluation(value, tuple(parser.numbers))
