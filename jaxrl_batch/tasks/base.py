"""What the trainer needs from a verifiable task: problems, a reward, SFT examples and buffer sizes."""
from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from jaxrl_batch.text.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Problem:
  r"""One problem: the prompt text given to the policy and the reference answer the reward checks.

  `answer` is an int for arithmetic and countdown (the target), an int or decimal string for gsm8k, and a LaTeX
  string such as '\frac{1}{2}' for math.
  """
  prompt: str
  answer: int | str


class Task(Protocol):
  """A verifiable task; see `jaxrl_batch.tasks.arithmetic.ArithmeticTask` for the reference implementation.

  Optional: `extract_answer(completion) -> str | None`, the completion's final answer in a canonical spelling, for
  majority voting over samples (`eval_maj_at_k`, `train.evaluation`). Completions with equal answers must earn equal
  rewards: the winning answer is graded by the reward of a sample that gave it. None means no answer (no vote); it
  never raises. A task without it (countdown, where many different answers are correct) logs no maj@k.

  Optional: `skip_long_prompts(tokenizer, context)`, called once the tokenizer is known: drops the problems whose
  prompt is too long for a model of `context` tokens (None: it declares none), naming each (`jsonl_task`: rows read
  from user files).

  Optional: `sft_problems(seed, step, num)`, the warm start's problems when they should differ from
  `train_problems` (`long_addition` warm-starts on short problems only).
  """

  def train_problems(self, seed: int, step: int, num: int) -> list[Problem]:
    """`num` training problems, deterministic per (seed, step), never held-out ones."""

  def eval_problems(self) -> list[Problem]:
    """The fixed held-out evaluation set, disjoint from every training problem."""

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 if `completion` (decoded text before EOS) solves `problem`, else 0.0; never raises."""

  def sft_example(self, problem: Problem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, completion) text for supervised warm-up; the completion excludes EOS."""

  def tokenizer_path(self) -> str:
    """Path of the task's SentencePiece model."""

  def max_prompt_len(self, tokenizer: Tokenizer) -> int:
    """Longest prompt in tokens."""

  def max_answer_len(self, tokenizer: Tokenizer) -> int:
    """Longest correct completion in tokens, counting the EOS token."""
