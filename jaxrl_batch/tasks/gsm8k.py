"""Grade-school word problems in the GSM8K format, rewarded on the final number.

Data: JSONL rows `{"question": "...", "answer": "...reasoning...\\n#### 72"}` (the GSM8K release format). The
reference answer is the number after '####'; the whole answer text, calculator annotations such as `<<6*12=72>>`
removed unless `keep_calculator_annotations`, is the SFT completion.

Reward: 1.0 iff the completion's answer has the reference's exact value (`answers.same_number`: '1,000',
'$1000', '1000.' and '1000.0' all equal 1000). `extraction` picks the completion's answer: "strict" is the number
right after its first '####' (what SFT teaches), "flexible" the last number anywhere in it.

Prompt template fields: {question}. Run with a tokenizer of your own: `--config.tokenizer_path=...`.
"""
from __future__ import annotations

import re

import ml_collections
import numpy as np

from jaxrl_batch.tasks import answers
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.jsonl_task import JsonlTask, SolvedProblem, check_template, config_fields, data_config
from jaxrl_batch.text.tokenizer import Tokenizer

EXTRACTIONS = ("strict", "flexible")
_ANNOTATION_RE = re.compile(r"<<[^<>]*>>")


def default_config() -> ml_collections.ConfigDict:
  """The `task` config group for `Gsm8kTask`."""
  cfg = data_config(prompt_template="Question: {question}\nAnswer:")
  cfg.extraction = "strict"  # "strict": the number after the completion's first '####'; "flexible": its last number.
  cfg.keep_calculator_annotations = False  # Keep GSM8K's `<<48/2=24>>` annotations in SFT completions.
  return cfg


def reference_value(final: str) -> int | str:
  """The reference answer as stored in `Problem.answer`: an int when whole ('1,000' -> 1000), else the text."""
  number = answers.parse_number(final)
  if number.value.denominator == 1:
    return int(number.value)
  return final.replace(",", "").replace("$", "")


class Gsm8kTask(JsonlTask):
  """GSM8K-format word problems with a numeric final answer."""
  name = "gsm8k"
  sample_file = "gsm8k.jsonl"
  example_row = '{"question": "Tom has 3 bags of 4 apples. How many apples?", "answer": "3 * 4 = 12\\n#### 12"}'

  def __init__(self, cfg):
    """`cfg`: a ConfigDict or dict with fields of `default_config()`; missing fields take the defaults."""
    fields = config_fields(cfg, default_config(), self.name)
    self.extraction = fields["extraction"]
    if self.extraction not in EXTRACTIONS:
      raise ValueError(f"task.extraction={self.extraction!r}; choose one of {EXTRACTIONS}.")
    self.keep_annotations = fields["keep_calculator_annotations"]
    self.prompt_template = fields["prompt_template"]
    check_template(self.prompt_template, {"question"}, self.name)
    super().__init__(fields)

  def parse_row(self, row: dict) -> Problem:
    """A problem from {"question", "answer"}; the answer must contain '#### <number>'."""
    question, answer = row.get("question"), row.get("answer")
    if not isinstance(question, str) or not question.strip():
      raise ValueError('"question" must be a non-empty string')
    if not isinstance(answer, str):
      raise ValueError('"answer" must be a string ending in "#### <number>"')
    final = answers.number_after_hashes(answer)
    if final is None or answers.parse_number(final) is None:
      raise ValueError(f'"answer" has no "#### <number>" final answer (got ...{answer[-40:]!r})')
    solution = answer if self.keep_annotations else _ANNOTATION_RE.sub("", answer)
    return SolvedProblem(self.prompt_template.format(question=question.strip()), reference_value(final),
                         solution.strip())

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 iff the extracted number equals the reference answer, else 0.0; never raises."""
    found = self._final_number(completion)
    return 1.0 if found is not None and answers.same_number(found, problem.answer) else 0.0

  def _final_number(self, completion: str) -> str | None:
    """The completion's answer as written, per `extraction`; None if it has none."""
    if self.extraction == "strict":
      return answers.number_after_hashes(completion)
    return answers.last_number(completion)

  def extract_answer(self, completion: str) -> str | None:
    """The answer's exact value ('1,000', '$1000.0' -> '1000'; '0.5' -> '1/2'), the key of majority voting; None if
    the completion has no number where `extraction` looks."""
    number = answers.parse_number(self._final_number(completion))
    return None if number is None else str(number.value)

  def sft_example(self, problem: SolvedProblem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, reference solution ending in '#### N'); `rng` is unused."""
    return problem.prompt, problem.solution

  def completion_len(self, problem: SolvedProblem, tokenizer: Tokenizer) -> int:
    """Tokens of the reference solution."""
    return len(tokenizer.encode(problem.solution))
