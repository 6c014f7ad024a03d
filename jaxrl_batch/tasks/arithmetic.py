"""Integer addition and subtraction: a verifiable task a ~1-5M-parameter model learns on a CPU in minutes.

A prompt is `"347+85="`; the completion must be the answer in canonical decimal (`"432"`, `"-17"`, `"0"`) and
nothing else: `" 432"`, `"432 "`, `"0432"`, `"-0"`, `"432.0"` earn reward 0.

Held-out problems: a fixed ~10% of all (a, op, b) triples, chosen by a salt-free hash of the triple (`is_heldout`),
independent of the config. Training never samples them; evaluation samples only them.

The bundled tokenizer `assets/arith.model` is a character-level SentencePiece model (one piece per digit and per
'+', '-', '=', '.'; pad=0, bos=1, eos=2, unk=3) trained on `tokenizer_corpus()`. One piece per character means
`encode(prompt) + encode(completion) == encode(prompt + completion)`, so SFT and RL see the same tokens. Regenerate
it (deterministic) with:

  python -m jaxrl_batch.tasks.arithmetic --write_tokenizer
"""
from __future__ import annotations

import argparse
import logging
import os

import ml_collections
import numpy as np

from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.text import spm_tokenizer
from jaxrl_batch.text import tokenizer as tokenizer_lib

TOKENIZER_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "arith.model")
ALL_OPS = "+-"  # Operator codes for the held-out hash; fixed so membership never depends on the config.
HELDOUT_MODULUS = 10  # A triple is held out iff hash % HELDOUT_MODULUS == 0 (~10% of triples).
MAX_DIGITS_LIMIT = 9  # Operands must fit the 31-bit fields of the hashed key.


def default_config() -> ml_collections.ConfigDict:
  """The `task` config group for `ArithmeticTask`."""
  cfg = ml_collections.ConfigDict()
  cfg.max_digits = 3  # Operands are integers in [0, 10**max_digits); 1..9.
  cfg.ops = "+-"  # Operators to sample: a non-empty subset of "+-".
  cfg.num_eval = 256  # Number of held-out evaluation problems.
  cfg.eval_seed = 0  # Seeds the choice of evaluation problems among the held-out ones.
  cfg.sft_strict_frac_add = 1.0  # Fraction of warm-start sums written strictly; the rest as "57." / "57.0".
  cfg.sft_strict_frac_sub = 1.0  # The same for differences.
  return cfg


def loose_formats(answer: int) -> list[str]:
  """Answer spellings a reader accepts but the strict reward rejects: `"57."` and `"57.0"` for 57.

  Both only append characters, so the digits sit where the strict answer has them.
  """
  return [f"{answer}.", f"{answer}.0"]


def format_prompt(a: int, op: str, b: int) -> str:
  """`"347+85="` for (347, "+", 85)."""
  return f"{a}{op}{b}="


def make_problem(a: int, op: str, b: int) -> Problem:
  """The problem `a op b` with its integer answer."""
  return Problem(format_prompt(a, op, b), a + b if op == "+" else a - b)


def is_heldout(a_N: np.ndarray, op_N: np.ndarray, b_N: np.ndarray) -> np.ndarray:
  """Whether each triple (a, ALL_OPS[op], b) is held out; bool_N.

  The key packs (a, b, op) into 64 bits and is mixed with the splitmix64 finaliser: deterministic across processes
  and machines, unlike Python's salted `hash()`.
  """
  a_N, op_N, b_N = (np.asarray(x, np.uint64) for x in (a_N, op_N, b_N))
  key_N = (a_N << np.uint64(32)) | (b_N << np.uint64(1)) | op_N
  z_N = key_N + np.uint64(0x9E3779B97F4A7C15)
  z_N = (z_N ^ (z_N >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z_N = (z_N ^ (z_N >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  z_N = z_N ^ (z_N >> np.uint64(31))
  return z_N % np.uint64(HELDOUT_MODULUS) == 0


def tokenizer_corpus() -> list[str]:
  """Deterministic prompt+completion lines covering every digit, operator, and negative answers."""
  operands = list(range(10)) + list(range(10, 1000, 37))
  problems = [make_problem(a, op, b) for a in operands for b in operands for op in ALL_OPS]
  return [p.prompt + text for p in problems for text in [str(p.answer), *loose_formats(p.answer)]]


def write_tokenizer(path: str = TOKENIZER_PATH) -> tokenizer_lib.Tokenizer:
  """Trains the character-level tokenizer on `tokenizer_corpus()` and writes it to `path`."""
  return spm_tokenizer.train_sentencepiece(
      tokenizer_corpus(), path, vocab_size=32, model_type="char", hard_vocab_limit=False, character_coverage=1.0,
      byte_fallback=False, add_dummy_prefix=False, normalization_rule_name="identity", remove_extra_whitespaces=False)


class ArithmeticTask:
  """Addition/subtraction of non-negative operands with at most `max_digits` digits."""

  def __init__(self, cfg):
    """`cfg`: a ConfigDict or dict with fields of `default_config()`; missing fields take the defaults."""
    defaults = default_config()
    unknown = sorted(set(cfg.keys()) - set(defaults.keys()))
    if unknown:
      raise ValueError(f"Unknown arithmetic task config fields {unknown}; known fields: {sorted(defaults.keys())}.")
    fields = {**defaults.to_dict(), **{key: cfg[key] for key in cfg.keys()}}
    self.max_digits, self.ops = fields["max_digits"], fields["ops"]
    self.num_eval, self.eval_seed = fields["num_eval"], fields["eval_seed"]
    self.sft_strict_frac = {"+": fields["sft_strict_frac_add"], "-": fields["sft_strict_frac_sub"]}
    if not (isinstance(self.max_digits, int) and 1 <= self.max_digits <= MAX_DIGITS_LIMIT):
      raise ValueError(f"task.max_digits={self.max_digits!r}; set an integer in [1, {MAX_DIGITS_LIMIT}].")
    if not (isinstance(self.ops, str) and self.ops and set(self.ops) <= set(ALL_OPS)
            and len(set(self.ops)) == len(self.ops)):
      raise ValueError(f"task.ops={self.ops!r}; set a non-empty string of distinct operators from {ALL_OPS!r}.")
    if not (isinstance(self.num_eval, int) and self.num_eval >= 1):
      raise ValueError(f"task.num_eval={self.num_eval!r}; set a positive integer.")
    for op, name in (("+", "sft_strict_frac_add"), ("-", "sft_strict_frac_sub")):
      frac = self.sft_strict_frac[op]
      if not (isinstance(frac, float | int) and 0.0 <= frac <= 1.0):
        raise ValueError(f"task.{name}={frac!r}; set a fraction in [0, 1].")
    self._op_codes = np.array([ALL_OPS.index(op) for op in self.ops])
    self._eval = self._sample_eval()

  def _draw(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n uniform triples (a_N, op_N, b_N), op_N indexing ALL_OPS."""
    a_N = rng.integers(0, 10**self.max_digits, size=n)
    op_N = self._op_codes[rng.integers(0, len(self._op_codes), size=n)]
    b_N = rng.integers(0, 10**self.max_digits, size=n)
    return a_N, op_N, b_N

  def _sample_eval(self) -> list[Problem]:
    """The first `num_eval` distinct held-out triples drawn from a generator seeded by `eval_seed`."""
    rng = np.random.default_rng(self.eval_seed)
    seen, triples = set(), []
    for _ in range(64):
      a_N, op_N, b_N = self._draw(rng, 16 * self.num_eval)
      keep_N = is_heldout(a_N, op_N, b_N)
      for triple in zip(a_N[keep_N].tolist(), op_N[keep_N].tolist(), b_N[keep_N].tolist()):
        if triple not in seen:
          seen.add(triple)
          triples.append(triple)
      if len(triples) >= self.num_eval:
        return [make_problem(a, ALL_OPS[op], b) for a, op, b in triples[:self.num_eval]]
    raise ValueError(f"Found only {len(triples)} distinct held-out problems for max_digits={self.max_digits}, "
                     f"ops={self.ops!r}; lower task.num_eval or raise task.max_digits.")

  def train_problems(self, seed: int, step: int, num: int) -> list[Problem]:
    """`num` problems (with repeats) drawn uniformly from the non-held-out ones; deterministic per (seed, step)."""
    rng = np.random.default_rng([seed, step])
    problems = []
    while len(problems) < num:
      a_N, op_N, b_N = self._draw(rng, 2 * num)
      keep_N = ~is_heldout(a_N, op_N, b_N)
      problems += [make_problem(a, ALL_OPS[op], b)
                   for a, op, b in zip(a_N[keep_N].tolist(), op_N[keep_N].tolist(), b_N[keep_N].tolist())]
    return problems[:num]

  def eval_problems(self) -> list[Problem]:
    """The `num_eval` held-out problems; depends only on the config."""
    return list(self._eval)

  def reward(self, completion: str, problem: Problem) -> float:
    """1.0 iff `completion` is exactly the canonical decimal answer (optional '-', no leading zeros), else 0.0."""
    return 1.0 if completion == str(problem.answer) else 0.0

  def extract_answer(self, completion: str) -> str:
    """The whole completion: the reward compares it whole (`"432"`, `" 432"` and `"432.0"` are different answers)."""
    return completion

  def sft_example(self, problem: Problem, rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, completion) for supervised warm-up, without EOS.

    With probability `sft_strict_frac_add` (sums) or `sft_strict_frac_sub` (differences) the completion is the
    strict answer; otherwise one of `loose_formats`, like the mixed notation of real pretraining text, which the
    reward rejects and RL must learn to avoid.
    """
    op = "-" if "-" in problem.prompt[:-1] else "+"
    if rng.random() < self.sft_strict_frac[op]:
      return problem.prompt, str(problem.answer)
    loose = loose_formats(problem.answer)
    return problem.prompt, loose[rng.integers(len(loose))]

  def tokenizer_path(self) -> str:
    """The bundled `assets/arith.model`."""
    return TOKENIZER_PATH

  def _extreme_problems(self) -> list[Problem]:
    """Problems with operands 0 and 10**max_digits - 1: the longest prompts and answers."""
    top = 10**self.max_digits - 1
    return [make_problem(a, op, b) for a in (0, top) for op in self.ops for b in (0, top)]

  def max_prompt_len(self, tokenizer: tokenizer_lib.Tokenizer) -> int:
    """Longest prompt in tokens (exact for tokenizers with one token per digit, like the bundled one)."""
    return max(len(tokenizer.encode(p.prompt)) for p in self._extreme_problems())

  def max_answer_len(self, tokenizer: tokenizer_lib.Tokenizer) -> int:
    """Longest warm-start completion (strict or loose spelling) in tokens, including EOS (exact as for
    `max_prompt_len`)."""
    return max(len(tokenizer.encode(text)) for p in self._extreme_problems()
               for text in [str(p.answer), *loose_formats(p.answer)]) + 1


def _main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--write_tokenizer", action="store_true", help=f"regenerate {TOKENIZER_PATH}")
  args = parser.parse_args()
  if not args.write_tokenizer:
    parser.error("nothing to do; pass --write_tokenizer")
  logging.basicConfig(level=logging.INFO)
  tok = write_tokenizer()
  logging.info("Wrote %s (%d pieces).", tok.path, tok.vocab_size)


if __name__ == "__main__":
  _main()
