"""Countdown: combine the given numbers with + - * / and parentheses to reach a target.

Data: JSONL rows `{"numbers": [25, 3, 6], "target": 69}` with non-negative integers (at most
`expr_parser.MAX_DIGITS` digits each) and an integer target.

Where the answer is (`extract_expression`): the text between the completion's last '<answer>' and the
'</answer>' after it; without such a pair, the text after its last 'Answer:' up to the end of that line; without
that, its last non-empty line. A final '.' is ignored, and so is a trailing '= <target>' ('(25*3)-6 = 69'); any
other '=' earns 0.

Reward: 1.0 iff that expression parses with the safe `expr_parser` (integers, + - * /, parentheses, unary minus;
exact rationals, so 7/2*2 == 7 and division by zero is invalid), uses each given number at most as often as it is
given (all of them exactly so, with `use_all_numbers`), and equals the target exactly.

No `extract_answer` (`tasks.base.Task`): many different expressions reach the target, so a majority vote over
answers is undefined and evaluation logs no eval_maj_at_k (pass@k still applies).

SFT completions are the bare expression (the default prompt ends in 'Answer:'), found by exhaustive search
(`solve`) over rows of at most MAX_SOLVE_NUMBERS numbers; a row without a solution makes `sft_example` raise, so
remove unsolvable rows before SFT. RL alone needs no solutions.

Prompt template fields: {numbers} (comma-separated) and {target}. Run with a tokenizer of your own:
`--config.tokenizer_path=...`.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from fractions import Fraction

import ml_collections
import numpy as np

from jaxrl_batch.tasks import expr_parser
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.jsonl_task import JsonlTask, check_template, config_fields, data_config
from jaxrl_batch.text.tokenizer import Tokenizer

MAX_SOLVE_NUMBERS = 5  # Most numbers `solve` searches exhaustively (< 1 s worst case; 6 numbers take ~15 s).


def default_config() -> ml_collections.ConfigDict:
  """The `task` config group for `CountdownTask`."""
  cfg = data_config(prompt_template="Using the numbers {numbers}, each at most once, with + - * / and parentheses, "
                                    "write an expression equal to {target}.\nAnswer:")
  cfg.use_all_numbers = False  # Require every given number to be used (exactly as often as given).
  return cfg


@dataclasses.dataclass(frozen=True)
class CountdownProblem(Problem):
  """A Countdown problem: `answer` is the target, `numbers` the numbers to combine."""
  numbers: tuple[int, ...]


def extract_expression(completion) -> str | None:
  """The completion's answer text (see the module docstring), stripped; None for a non-string."""
  if not isinstance(completion, str):
    return None
  start = completion.rfind("<answer>")
  end = completion.find("</answer>", start) if start >= 0 else -1
  if end >= 0:
    return completion[start + len("<answer>"):end].strip()
  marker = completion.rfind("Answer:")
  if marker >= 0:
    return completion[marker + len("Answer:"):].split("\n", 1)[0].strip()
  lines = [line for line in completion.split("\n") if line.strip()]
  return lines[-1].strip() if lines else ""


def check_expression(text: str, numbers: tuple[int, ...], target: int, use_all: bool) -> bool:
  """Whether `text` ('expr', 'expr.', or 'expr = target') reaches `target` using `numbers` as allowed."""
  expression, equals, rhs = text.rstrip(".").partition("=")
  if equals and rhs.strip() != str(target):
    return False
  try:
    evaluation = expr_parser.evaluate(expression)
  except expr_parser.ExprError:
    return False
  used, given = collections.Counter(evaluation.numbers), collections.Counter(numbers)
  allowed = used == given if use_all else not used - given
  return allowed and evaluation.value == target


@functools.lru_cache(maxsize=4096)
def solve(numbers: tuple[int, ...], target: int, use_all: bool) -> str | None:
  """An expression equal to `target` using each number at most once (all of them if `use_all`), or None.

  Exhaustive search: repeatedly replace two values by their sum, difference, product or quotient, skipping
  multisets of values already explored. Inner operations are parenthesised: '(25*3)-6'.
  """
  goal, explored = Fraction(target), set()

  def search(items: tuple[tuple[Fraction, str, bool], ...]) -> str | None:  # (value, text, is a literal)
    if not use_all or len(items) == 1:
      for value, text, _ in items:
        if value == goal:
          return text
    key = tuple(sorted(value for value, _, _ in items))
    if len(items) == 1 or key in explored:
      return None
    explored.add(key)
    for i in range(len(items)):
      for j in range(i + 1, len(items)):
        (a, a_text, a_atom), (b, b_text, b_atom) = items[i], items[j]
        a_text, b_text = (a_text if a_atom else f"({a_text})"), (b_text if b_atom else f"({b_text})")
        options = [(a + b, f"{a_text}+{b_text}"), (a * b, f"{a_text}*{b_text}"), (a - b, f"{a_text}-{b_text}"),
                   (b - a, f"{b_text}-{a_text}")]
        options += [(a / b, f"{a_text}/{b_text}")] if b else []
        options += [(b / a, f"{b_text}/{a_text}")] if a else []
        rest = items[:i] + items[i + 1:j] + items[j + 1:]
        for value, text in options:
          found = search(rest + ((value, text, False),))
          if found is not None:
            return found
    return None

  return search(tuple((Fraction(n), str(n), True) for n in numbers))


class CountdownTask(JsonlTask):
  """Reach a target from given numbers with a verified arithmetic expression."""
  name = "countdown"
  sample_file = "countdown.jsonl"
  example_row = '{"numbers": [25, 3, 6], "target": 69}'

  def __init__(self, cfg):
    """`cfg`: a ConfigDict or dict with fields of `default_config()`; missing fields take the defaults."""
    fields = config_fields(cfg, default_config(), self.name)
    self.use_all_numbers = fields["use_all_numbers"]
    self.prompt_template = fields["prompt_template"]
    check_template(self.prompt_template, {"numbers", "target"}, self.name)
    super().__init__(fields)

  def parse_row(self, row: dict) -> Problem:
    """A problem from {"numbers": [non-negative ints], "target": int}."""
    numbers, target = row.get("numbers"), row.get("target")
    limit = 10**expr_parser.MAX_DIGITS
    if not (isinstance(numbers, list) and numbers
            and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < limit for n in numbers)):
      raise ValueError(f'"numbers" must be a non-empty list of integers in [0, {limit})')
    if not isinstance(target, int) or isinstance(target, bool):
      raise ValueError('"target" must be an integer')
    prompt = self.prompt_template.format(numbers=", ".join(map(str, numbers)), target=target)
    return CountdownProblem(prompt, target, tuple(numbers))

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 iff the completion's expression reaches the target with the allowed numbers, else 0.0; never raises."""
    text = extract_expression(completion)
    numbers = getattr(problem, "numbers", None)
    if text is None or numbers is None:
      return 0.0
    return 1.0 if check_expression(text, numbers, problem.answer, self.use_all_numbers) else 0.0

  def sft_example(self, problem: CountdownProblem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, an expression found by `solve`); raises ValueError if the problem is too large or unsolvable."""
    if len(problem.numbers) > MAX_SOLVE_NUMBERS:
      raise ValueError(f"Countdown SFT searches solutions only for rows of at most {MAX_SOLVE_NUMBERS} numbers; "
                       f"{list(problem.numbers)} is too long: drop such rows from {self.path} for SFT.")
    expression = solve(problem.numbers, problem.answer, self.use_all_numbers)
    if expression is None:
      raise ValueError(f"No expression reaches {problem.answer} from {list(problem.numbers)}"
                       f"{' using all of them' if self.use_all_numbers else ''}; SFT needs solvable problems: "
                       f"remove the row from {self.path}.")
    return problem.prompt, expression

  def completion_len(self, problem: CountdownProblem, tokenizer: Tokenizer) -> int:
    """A bound without searching: the characters of the longest expression `solve` can write, + 1 in case the
    tokenizer adds a word-start piece. Every other token covers at least one character."""
    count = len(problem.numbers)
    digits = sum(len(str(n)) for n in problem.numbers)
    return 1 + digits + (count - 1) + 2 * max(0, count - 2)  # numbers, operators, parentheses
