"""The data side of tasks on user-supplied JSONL files (gsm8k, math, countdown).

`JsonlTask` reads a training file and an evaluation file (or holds out part of the training file), draws seeded
training batches and sizes the prompt and response buffers; a subclass parses one row into a `Problem`, scores
completions and writes SFT completions.

A row whose prompt is longer than `max_prompt_tokens` is skipped when the tokenizer is known
(`skip_long_prompts`, called by `train.setup`): one oversized prompt would otherwise size every step's prompt buffer
and KV cache. Its file, line and length are logged, and the count.

Held-out problems are chosen by prompt text, so a prompt repeated in the file lands wholly on one side: with
`eval_path` set, training rows whose prompt appears in the eval file are dropped; without it, `num_eval` distinct
prompts chosen by `eval_seed` are held out of `path`.

These tasks bundle no tokenizer: set `config.tokenizer_path` to the SentencePiece model of the policy.
"""
from __future__ import annotations

import abc
import dataclasses
import json
import logging
import os
import string
from collections.abc import Callable

import ml_collections
import numpy as np

from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.text.tokenizer import Tokenizer

SAMPLES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "samples")
# Tokens of prompt + response assumed for a policy that declares no context of its own (the supervised warm start; a
# Hugging Face checkpoint without max_position_embeddings).
DEFAULT_CONTEXT = 4096
SKIPPED_SHOWN = 5  # Skipped rows named one by one in the log line; the rest are counted.


@dataclasses.dataclass(frozen=True)
class SolvedProblem(Problem):
  """A problem with the reference solution its SFT completion uses."""
  solution: str


def data_config(prompt_template: str) -> ml_collections.ConfigDict:
  """The fields every JSONL task's config group shares; `prompt_template` is the task's default."""
  cfg = ml_collections.ConfigDict()
  cfg.path = ""  # Training JSONL file, one problem per line; "" = the task's bundled sample in assets/samples/.
  cfg.eval_path = ""  # Evaluation JSONL file in the same format; "" = hold out `num_eval` problems of `path`.
  # Evaluation problems: held out of `path` if eval_path is "", else the first distinct ones of eval_path (0 = all).
  cfg.num_eval = 4
  cfg.eval_seed = 0  # Chooses the problems held out of `path`; unused with eval_path.
  cfg.prompt_template = prompt_template  # str.format template of the prompt; the task's docstring lists its fields.
  # Response budget in tokens, EOS included; 0 = the longest SFT completion + EOS. Raise it for policies that
  # reason at length before answering.
  cfg.max_response_tokens = 0
  # Rows whose prompt is longer than this many tokens are skipped, each named in the log with its file, line and
  # length; 0 = the model's context (init_from's max_position_embeddings, else DEFAULT_CONTEXT) less the response
  # budget.
  cfg.max_prompt_tokens = 0
  return cfg


def config_fields(cfg, defaults: ml_collections.ConfigDict, name: str) -> dict:
  """`cfg` (ConfigDict or dict) over `defaults`; raises on unknown fields and on values of the wrong type."""
  unknown = sorted(set(cfg.keys()) - set(defaults.keys()))
  if unknown:
    raise ValueError(f"Unknown {name} task config fields {unknown}; known fields: {sorted(defaults.keys())}.")
  fields = {**defaults.to_dict(), **{key: cfg[key] for key in cfg.keys()}}
  for key, default in defaults.items():
    value = fields[key]
    if not isinstance(value, type(default)) or isinstance(value, bool) != isinstance(default, bool):
      raise ValueError(f"task.{key}={value!r} has type {type(value).__name__}; set a {type(default).__name__} "
                       f"like the default {default!r}.")
  return fields


def check_template(template: str, placeholders: set[str], name: str) -> None:
  """Raises unless `template` is a str.format template using exactly `placeholders`."""
  try:
    used = {field for _, field, _, _ in string.Formatter().parse(template) if field is not None}
  except ValueError as e:
    raise ValueError(f"task.prompt_template={template!r} is not a str.format template ({e}); write literal "
                     "braces as '{{' and '}}'.") from None
  if used != placeholders:
    raise ValueError(f"task.prompt_template={template!r} uses fields {sorted(used)}; the {name} task fills "
                     f"exactly {sorted(placeholders)}, e.g. '{{{sorted(placeholders)[0]}}}'.")


def read_jsonl(path: str, parse_row: Callable[[dict], Problem], example_row: str) -> list[tuple[int, Problem]]:
  """(line number, problem) of each non-blank line; a missing file or a bad line raises ValueError naming the file
  and line."""
  if not os.path.isfile(path):
    raise ValueError(f"Data file {path!r} not found; point task.path / task.eval_path at a JSONL file with one "
                     f"object per line, such as {example_row}.")
  problems = []
  with open(path, encoding="utf-8") as f:
    try:
      for line_no, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          row = json.loads(line)
          if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object, got {type(row).__name__}")
          problems.append((line_no, parse_row(row)))
        except ValueError as e:  # json.JSONDecodeError is a ValueError.
          raise ValueError(f"{path}, line {line_no}: {e}. Each line must be one JSON object such as "
                           f"{example_row}; fix or delete the line.") from None
    except UnicodeDecodeError as e:
      raise ValueError(f"{path} is not UTF-8 text ({e}); convert it to UTF-8.") from None
  if not problems:
    raise ValueError(f"Data file {path} holds no rows; add lines such as {example_row}.")
  return problems


def _distinct(rows: list[tuple[int, Problem]]) -> list[tuple[int, Problem]]:
  """The first (line, problem) of each prompt, in file order."""
  first = {}
  for line_no, problem in rows:
    first.setdefault(problem.prompt, (line_no, problem))
  return list(first.values())


class JsonlTask(abc.ABC):
  """Train and eval problems from JSONL files.

  Subclasses set `name`, `sample_file` and `example_row`, and define `parse_row`, `reward`, `sft_example` and
  `completion_len`; they call `__init__` with their resolved config fields once `parse_row` can run.
  """
  name: str  # Registry name, used in messages.
  sample_file: str  # Bundled sample under SAMPLES_DIR, used when `path` is "".
  example_row: str  # A valid JSONL line, quoted in error messages.

  def __init__(self, fields: dict):
    self.path = fields["path"] or os.path.join(SAMPLES_DIR, self.sample_file)
    self.eval_path = fields["eval_path"]
    self.max_response_tokens = fields["max_response_tokens"]
    self.max_prompt_tokens = fields["max_prompt_tokens"]
    num_eval = fields["num_eval"]
    for key in ("num_eval", "eval_seed", "max_response_tokens", "max_prompt_tokens"):
      if fields[key] < 0:
        raise ValueError(f"task.{key}={fields[key]}; set a value >= 0.")
    train = read_jsonl(self.path, self.parse_row, self.example_row)
    if self.eval_path:
      held_out = _distinct(read_jsonl(self.eval_path, self.parse_row, self.example_row))[:num_eval or None]
    else:
      distinct = _distinct(train)
      if not 1 <= num_eval < len(distinct):
        raise ValueError(f"task.num_eval={num_eval}, but {self.path} holds {len(distinct)} distinct problems and "
                         f"training needs some: hold out 1..{len(distinct) - 1}, or set task.eval_path.")
      order = np.random.default_rng(fields["eval_seed"]).permutation(len(distinct))
      held_out = [distinct[i] for i in order[:num_eval]]
    eval_prompts = {p.prompt for _, p in held_out}
    self._set_rows([(line_no, p) for line_no, p in train if p.prompt not in eval_prompts], held_out)
    if not self._train:
      raise ValueError(f"Every problem of {self.path} is also in the eval file {self.eval_path}; "
                       "point task.path and task.eval_path at disjoint files.")
    if self.eval_path and len(self._train) < len(train):
      logging.info("Dropped %d rows of %s whose prompts are in the eval file %s.", len(train) - len(self._train),
                   self.path, self.eval_path)

  def _set_rows(self, train_rows: list[tuple[int, Problem]], eval_rows: list[tuple[int, Problem]]) -> None:
    """The training and held-out problems, each with the line it was read from (of `path`; held out: of
    `eval_path` when set)."""
    self._train_rows, self._eval_rows = train_rows, eval_rows
    self._train, self._eval = [p for _, p in train_rows], [p for _, p in eval_rows]

  def skip_long_prompts(self, tokenizer: Tokenizer, context: int | None) -> None:
    """Drops the train and eval rows whose prompt is longer than `max_prompt_tokens` tokens (0: the model's
    `context` in tokens, DEFAULT_CONTEXT when it declares none, less the response budget), logging the count and
    each row's file, line and length. ValueError when that leaves no training or no eval problem."""
    limit, source = self.max_prompt_tokens, f"task.max_prompt_tokens={self.max_prompt_tokens}"
    if not limit:
      budget = self.max_answer_len(tokenizer)
      limit = (context or DEFAULT_CONTEXT) - budget
      source = (f"the model's context of {context or DEFAULT_CONTEXT} tokens less the response budget of {budget}; "
                "set task.max_prompt_tokens to choose")
      if limit < 1:
        raise ValueError(f"The response budget of {budget} tokens leaves no room for a prompt in the model's context "
                         f"of {context or DEFAULT_CONTEXT} tokens: lower task.max_response_tokens.")
    lengths = {prompt: len(tokenizer.encode(prompt)) for prompt in {p.prompt for p in self._train + self._eval}}
    fits = lambda rows: [(line_no, p) for line_no, p in rows if lengths[p.prompt] <= limit]
    eval_file = self.eval_path or self.path
    skipped = [(path, line_no, lengths[p.prompt])
               for path, rows in ((self.path, self._train_rows), (eval_file, self._eval_rows))
               for line_no, p in rows if lengths[p.prompt] > limit]
    if not skipped:
      return
    self._set_rows(fits(self._train_rows), fits(self._eval_rows))
    named = "; ".join(f"{path}, line {line_no}: {n} tokens" for path, line_no, n in skipped[:SKIPPED_SHOWN])
    more = f"; and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
    logging.warning("Skipped %d rows whose prompt is longer than %d tokens (%s): %s%s.", len(skipped), limit, source,
                    named, more)
    for kind, rows, path in (("training", self._train, self.path), ("eval", self._eval, eval_file)):
      if not rows:
        raise ValueError(f"Every {kind} row of {path} has a prompt longer than {limit} tokens ({source}): raise "
                         "task.max_prompt_tokens, or shorten the prompts (task.prompt_template).")

  @abc.abstractmethod
  def parse_row(self, row: dict) -> Problem:
    """The problem of one JSON row; raises ValueError saying what is wrong with it."""

  @abc.abstractmethod
  def completion_len(self, problem: Problem, tokenizer: Tokenizer) -> int:
    """Upper bound on the tokens of `problem`'s SFT completion, EOS excluded."""

  def train_problems(self, seed: int, step: int, num: int) -> list[Problem]:
    """`num` training problems drawn uniformly with replacement; deterministic per (seed, step)."""
    indices = np.random.default_rng([seed, step]).integers(0, len(self._train), size=num)
    return [self._train[i] for i in indices.tolist()]

  def eval_problems(self) -> list[Problem]:
    """The held-out problems (distinct prompts), disjoint from every training problem."""
    return list(self._eval)

  def tokenizer_path(self) -> str:
    """Raises: the task bundles no tokenizer, so `Experiment` needs `config.tokenizer_path`."""
    raise ValueError(f"The {self.name} task bundles no tokenizer; set config.tokenizer_path to the SentencePiece "
                     ".model file of your policy (e.g. --config.tokenizer_path=/path/to/tokenizer.model).")

  def max_prompt_len(self, tokenizer: Tokenizer) -> int:
    """Longest prompt of the train and eval problems, in tokens."""
    return max(len(tokenizer.encode(prompt)) for prompt in {p.prompt for p in self._train + self._eval})

  def max_answer_len(self, tokenizer: Tokenizer) -> int:
    """`max_response_tokens` if set, else the longest SFT completion of the train and eval problems + EOS."""
    if self.max_response_tokens:
      return self.max_response_tokens
    return 1 + max(self.completion_len(p, tokenizer) for p in set(self._train + self._eval))
