r"""Competition mathematics in the MATH format, rewarded on the last `\boxed{...}` answer.

Data: JSONL rows `{"problem": "...", "solution": "... \\boxed{\\frac{1}{2}}."}` (the MATH release format), or
`{"problem": "...", "answer": "\\frac{1}{2}"}`, or both. The reference answer is the "answer" field if present,
else the last `\boxed{}` of the solution. The SFT completion is the solution, or `\boxed{<answer>}` for rows
without one.

Reward: 1.0 iff the completion's last complete `\boxed{...}` agrees with the reference under
`answers.math_equal` ('\dfrac12', '0.5', '1/2' and '\frac{1}{2}' agree; numbers compare exactly as rationals, or
within a relative 1e-6 when a decimal is involved; other answers compare as normalised strings). A completion
without a box earns 0.

Prompt template fields: {problem}. Run with a tokenizer of your own: `--config.tokenizer_path=...`.
"""
from __future__ import annotations

import ml_collections
import numpy as np

from jaxrl_batch.tasks import answers
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.jsonl_task import JsonlTask, SolvedProblem, check_template, config_fields, data_config
from jaxrl_batch.text.tokenizer import Tokenizer


def default_config() -> ml_collections.ConfigDict:
  """The `task` config group for `MathTask`."""
  return data_config(prompt_template="Problem: {problem}\nSolution:")


class MathTask(JsonlTask):
  r"""MATH-format problems whose answer is the last `\boxed{}`."""
  name = "math"
  sample_file = "math.jsonl"
  example_row = r'{"problem": "What is $1/2 + 1/4$?", "solution": "$1/2 + 1/4 = \\boxed{\\frac{3}{4}}$."}'

  def __init__(self, cfg):
    """`cfg`: a ConfigDict or dict with fields of `default_config()`; missing fields take the defaults."""
    fields = config_fields(cfg, default_config(), self.name)
    self.prompt_template = fields["prompt_template"]
    check_template(self.prompt_template, {"problem"}, self.name)
    super().__init__(fields)

  def parse_row(self, row: dict) -> Problem:
    r"""A problem from {"problem", "solution" and/or "answer"}; the answer or a `\boxed{}` solution is required."""
    problem, solution, answer = row.get("problem"), row.get("solution"), row.get("answer")
    if not isinstance(problem, str) or not problem.strip():
      raise ValueError('"problem" must be a non-empty string')
    if solution is not None and not isinstance(solution, str):
      raise ValueError('"solution" must be a string')
    if answer is None:
      answer = answers.last_boxed(solution)
      if answer is None:
        raise ValueError('the row needs an "answer" field or a "solution" containing a complete \\boxed{...}')
    elif isinstance(answer, int | float) and not isinstance(answer, bool):
      answer = str(answer)
    if not isinstance(answer, str) or not answer.strip() or len(answer) > answers.MAX_ANSWER_CHARS:
      raise ValueError(f'"answer" must be a non-empty string of at most {answers.MAX_ANSWER_CHARS} characters')
    completion = solution.strip() if solution else f"\\boxed{{{answer.strip()}}}"
    return SolvedProblem(self.prompt_template.format(problem=problem.strip()), answer.strip(), completion)

  def reward(self, completion: str, problem: Problem) -> float:
    r"""1.0 iff the last `\boxed{}` of `completion` agrees with the reference answer, else 0.0; never raises."""
    found = answers.last_boxed(completion)
    return 1.0 if found is not None and answers.math_equal(found, problem.answer) else 0.0

  def extract_answer(self, completion: str) -> str | None:
    r"""The last `\boxed{}` normalised (`answers.normalize_math`), a number as its exact value ('\dfrac12', '1/2' and
    '0.5' -> '1/2'), the key of majority voting; None without a complete box."""
    found = answers.last_boxed(completion)
    if found is None:
      return None
    normalized = answers.normalize_math(found)
    number = answers.math_number(normalized)
    return normalized if number is None else str(number.value)

  def sft_example(self, problem: SolvedProblem, rng: np.random.Generator) -> tuple[str, str]:
    r"""(prompt, reference solution ending in `\boxed{answer}`); `rng` is unused."""
    return problem.prompt, problem.solution

  def completion_len(self, problem: SolvedProblem, tokenizer: Tokenizer) -> int:
    """Tokens of the reference solution."""
    return len(tokenizer.encode(problem.solution))
