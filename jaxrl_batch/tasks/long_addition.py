"""Long addition worked column by column: a reasoning-length task whose responses grow with the problem.

A prompt is `"4721+3858="`. The completion works the columns from the least significant, each as
`x+y+c=s.` (the two digits, the carry in, their sum), then gives the answer after `=`:

  4721+3858=  ->  1+8+0=9.2+5+0=7.7+8+0=15.4+3+1=8.=8579

The reward is 1.0 iff the completion ends with `.=` and the exact answer (a worked trace, then the result); the trace
itself is not graded, as with a reasoning model's chain of thought. Operands have n digits each, n in
[min_digits, max_digits] with P(n) proportional to digits_decay**n: most problems are short, a few are long, so
response lengths have the long tail of LLM reasoning (~9 tokens per column). A policy that adds the columns with a
per-column error rate e solves an n-digit problem with probability ~(1 - e)**n, so the long problems need the
column skill most. `sft_carry_drop` gives the warm start a habit to unlearn: its traces forget each carry with that
probability (and go on consistently from the mistake), which only the outcome reward reveals.

Held-out problems: a fixed ~10% of all operand pairs, chosen by a salt-free hash (`is_heldout`). Tokens: the bundled
character-level `arith.model` (digits, '+', '-', '=', '.'), one token per character.
"""
from __future__ import annotations

from collections.abc import Sequence

import ml_collections
import numpy as np

from jaxrl_batch.tasks import arithmetic
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.jsonl_task import config_fields
from jaxrl_batch.text import tokenizer as tokenizer_lib

MAX_DIGITS_LIMIT = 15  # Operands and their sums fit int64.
HELDOUT_MODULUS = 10


def default_config() -> ml_collections.ConfigDict:
  """The `task` config group for `LongAdditionTask`."""
  cfg = ml_collections.ConfigDict()
  cfg.min_digits = 2  # Digits of the shortest operands.
  cfg.max_digits = 12  # Digits of the longest operands (<= 15).
  cfg.digits_decay = 0.7  # P(n digits) ~ digits_decay**n: < 1 favours short problems (the long tail).
  cfg.num_eval = 768  # Held-out problems (a 90% CI of +/- 0.03 on an accuracy near 0.5).
  cfg.eval_seed = 0  # Seeds the choice of evaluation problems among the held-out ones.
  cfg.sft_max_digits = 0  # Longest operands in the warm-start data (0 = max_digits).
  cfg.sft_carry_drop = 0.0  # Probability that a warm-start trace forgets a carry (a habit RL must unlearn).
  return cfg


def trace(a: int, b: int, dropped: Sequence[bool] = ()) -> str:
  """The worked completion of `a+b`: one `x+y+c=s.` per column from the least significant, then the result.

  `dropped[i]` True forgets column i's carry in (writes c = 0 where it is 1): the trace goes on consistently from
  the mistake, and its result is wrong, as a student's would be.
  """
  columns, carry, result = [], 0, 0
  digits_a, digits_b = str(a)[::-1], str(b)[::-1]
  for i in range(max(len(digits_a), len(digits_b))):
    x = int(digits_a[i]) if i < len(digits_a) else 0
    y = int(digits_b[i]) if i < len(digits_b) else 0
    carry = 0 if i < len(dropped) and dropped[i] else carry
    s = x + y + carry
    columns.append(f"{x}+{y}+{carry}={s}.")
    result += (s % 10) * 10**i
    carry = s // 10
  return "".join(columns) + f"={result + carry * 10**len(columns)}"


def _mix(x_N: np.ndarray) -> np.ndarray:
  """The splitmix64 finaliser: a fixed bijective hash of uint64."""
  z_N = x_N + np.uint64(0x9E3779B97F4A7C15)
  z_N = (z_N ^ (z_N >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z_N = (z_N ^ (z_N >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z_N ^ (z_N >> np.uint64(31))


def is_heldout(a_N: np.ndarray, b_N: np.ndarray) -> np.ndarray:
  """Whether each pair (a, b) is held out (~1 in HELDOUT_MODULUS); bool_N, the same on every machine."""
  with np.errstate(over="ignore"):
    key_N = _mix(_mix(np.asarray(a_N, np.uint64)) + np.asarray(b_N, np.uint64))
  return key_N % np.uint64(HELDOUT_MODULUS) == 0


class LongAdditionTask:
  """Addition of two n-digit operands, worked column by column (module docstring)."""

  def __init__(self, cfg):
    """`cfg`: a ConfigDict or dict with fields of `default_config()`; missing fields take the defaults."""
    f = config_fields(cfg, default_config(), "long_addition")
    self.min_digits, self.max_digits, self.decay = f["min_digits"], f["max_digits"], f["digits_decay"]
    self.num_eval, self.eval_seed = f["num_eval"], f["eval_seed"]
    self.sft_max_digits = f["sft_max_digits"] or self.max_digits
    self.carry_drop = f["sft_carry_drop"]
    if not 0 <= self.carry_drop <= 1:
      raise ValueError(f"task.sft_carry_drop={self.carry_drop!r}: set a probability in [0, 1].")
    if not 1 <= self.min_digits <= self.max_digits <= MAX_DIGITS_LIMIT:
      raise ValueError(f"task.min_digits={self.min_digits!r}, task.max_digits={self.max_digits!r}: set "
                       f"1 <= min_digits <= max_digits <= {MAX_DIGITS_LIMIT}.")
    if self.decay <= 0:
      raise ValueError(f"task.digits_decay={self.decay!r}: set a positive number (< 1 favours short problems).")
    if not self.min_digits <= self.sft_max_digits <= self.max_digits:
      raise ValueError(f"task.sft_max_digits={self.sft_max_digits!r}: set 0 or an integer in "
                       f"[min_digits, max_digits] = [{self.min_digits}, {self.max_digits}].")
    if self.num_eval < 1:
      raise ValueError(f"task.num_eval={self.num_eval!r}; set a positive integer.")
    self._eval = self._sample_eval()

  def digits_probs(self, max_digits: int | None = None) -> np.ndarray:
    """P(n) for n = min_digits..max_digits (default: the task's), proportional to digits_decay**n."""
    n = np.arange(self.min_digits, (max_digits or self.max_digits) + 1)
    weights = float(self.decay) ** (n - self.min_digits)
    return weights / weights.sum()

  def _draw(self, rng: np.random.Generator, size: int, max_digits: int | None = None
            ) -> tuple[np.ndarray, np.ndarray]:
    """`size` operand pairs (a_N, b_N), both with the same number of digits n ~ `digits_probs`."""
    probs = self.digits_probs(max_digits)
    n_N = self.min_digits + rng.choice(len(probs), size=size, p=probs)
    low_N = np.where(n_N == 1, 0, 10 ** (n_N - 1))
    high_N = 10**n_N
    return rng.integers(low_N, high_N), rng.integers(low_N, high_N)

  def _problems(self, rng: np.random.Generator, num: int, heldout: bool, max_digits: int | None = None
                ) -> list[Problem]:
    problems = []
    while len(problems) < num:
      a_N, b_N = self._draw(rng, 2 * num + 16, max_digits)
      keep_N = is_heldout(a_N, b_N) == heldout
      problems += [Problem(f"{a}+{b}=", a + b) for a, b in zip(a_N[keep_N].tolist(), b_N[keep_N].tolist())]
    return problems[:num]

  def _sample_eval(self) -> list[Problem]:
    """`num_eval` distinct held-out problems drawn from a generator seeded by `eval_seed`."""
    rng = np.random.default_rng(self.eval_seed)
    unique = {}
    for _ in range(64):
      for p in self._problems(rng, self.num_eval, heldout=True):
        unique.setdefault(p.prompt, p)
      if len(unique) >= self.num_eval:
        return list(unique.values())[:self.num_eval]
    raise ValueError(f"Found only {len(unique)} distinct held-out problems; lower task.num_eval or raise "
                     "task.max_digits.")

  def train_problems(self, seed: int, step: int, num: int) -> list[Problem]:
    """`num` problems (with repeats) that are not held out; deterministic per (seed, step)."""
    return self._problems(np.random.default_rng([seed, step]), num, heldout=False)

  def eval_problems(self) -> list[Problem]:
    """The `num_eval` held-out problems; depends only on the config."""
    return list(self._eval)

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 iff `completion` ends with `.=` and the exact answer (a worked trace, then the result), else 0.0."""
    return 1.0 if completion.endswith(f".={problem.answer}") else 0.0

  def extract_answer(self, completion: str) -> str | None:
    """The text after the last `.=`, None without one."""
    head, sep, answer = completion.rpartition(".=")
    return answer if sep else None

  def sft_problems(self, seed: int, step: int, num: int) -> list[Problem]:
    """The warm start's problems: like `train_problems`, with at most `sft_max_digits` digits, so that longer
    problems are met first in RL."""
    return self._problems(np.random.default_rng([seed, step]), num, heldout=False, max_digits=self.sft_max_digits)

  def sft_example(self, problem: Problem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, worked completion) for the warm start, without EOS; each carry is forgotten with probability
    `sft_carry_drop`."""
    a, b = problem.prompt[:-1].split("+")
    return problem.prompt, trace(int(a), int(b), rng.random(len(a)) < self.carry_drop)

  def tokenizer_path(self) -> str:
    """The bundled character-level `assets/arith.model`."""
    return arithmetic.TOKENIZER_PATH

  def max_prompt_len(self, tokenizer: tokenizer_lib.Tokenizer) -> int:
    """Longest prompt in tokens (one token per character)."""
    top = 10**self.max_digits - 1
    return len(tokenizer.encode(f"{top}+{top}="))

  def max_answer_len(self, tokenizer: tokenizer_lib.Tokenizer) -> int:
    """Longest worked completion in tokens, including EOS."""
    top = 10**self.max_digits - 1
    return len(tokenizer.encode(trace(top, top))) + 1
