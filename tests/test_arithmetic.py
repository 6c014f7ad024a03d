"""Arithmetic task: problems, held-out split, strict reward, bundled tokenizer."""
import re

import ml_collections
import numpy as np
import pytest

from jaxrl_batch.tasks import arithmetic, make_task
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tokenizer import Tokenizer

PROMPT_RE = re.compile(r"(0|[1-9][0-9]*)([+-])(0|[1-9][0-9]*)=")


@pytest.fixture(scope="module")
def task():
  return arithmetic.ArithmeticTask(arithmetic.default_config())


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.load(arithmetic.TOKENIZER_PATH)


def _triple(problem):
  a, op, b = PROMPT_RE.fullmatch(problem.prompt).groups()
  return int(a), op, int(b)


def _heldout(problems):
  a, op, b = zip(*map(_triple, problems))
  return arithmetic.is_heldout(np.array(a), np.array(["+-".index(o) for o in op]), np.array(b))


def test_bundled_tokenizer(task, tok):
  assert task.tokenizer_path() == arithmetic.TOKENIZER_PATH
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (17, 0, 1, 2)
  for char in "0123456789+-=":
    ids = tok.encode(char)
    assert len(ids) == 1 and ids[0] > 3, char  # One ordinary piece, not PAD/BOS/EOS/UNK.
  # Golden ids: a changed bundled model silently invalidates checkpoints trained with the old one.
  assert tok.encode("12+3=-90") == [4, 9, 16, 10, 5, 12, 14, 15]


def test_round_trip(task, tok):
  problems = [Problem("5-7=", -2), Problem("0+0=", 0)] + task.train_problems(0, 0, 20) + task.eval_problems()[:20]
  for problem in problems:
    prompt, completion = task.sft_example(problem)
    ids = tok.encode(prompt) + tok.encode(completion)
    assert ids == tok.encode(prompt + completion)
    assert tok.decode(ids + [tok.eos_id]) == prompt + completion


def test_regenerated_tokenizer_matches_bundled(tmp_path, tok):
  regen = arithmetic.write_tokenizer(str(tmp_path / "arith.model"))
  assert regen.vocab_size == tok.vocab_size
  assert [regen._sp.id_to_piece(i) for i in range(17)] == [tok._sp.id_to_piece(i) for i in range(17)]
  for text in ["347+85=432", "0-999=-999", "9876543210"]:
    assert regen.encode(text) == tok.encode(text)


@pytest.mark.parametrize("max_digits, ops, prompt_len, answer_len", [
    (3, "+-", 8, 5),  # "999+999=", "-999"+EOS or "1998"+EOS
    (1, "+", 4, 3),  # "9+9=", "18"+EOS
    (2, "-", 6, 4),  # "99-99=", "-99"+EOS
])
def test_max_lengths(tok, max_digits, ops, prompt_len, answer_len):
  t = arithmetic.ArithmeticTask(dict(max_digits=max_digits, ops=ops, num_eval=4))
  assert (t.max_prompt_len(tok), t.max_answer_len(tok)) == (prompt_len, answer_len)


def test_train_problems_are_deterministic_and_correct(task):
  problems = task.train_problems(seed=3, step=7, num=64)
  assert problems == task.train_problems(seed=3, step=7, num=64)
  assert problems != task.train_problems(seed=3, step=8, num=64)
  assert problems != task.train_problems(seed=4, step=7, num=64)
  assert len(problems) == 64 and task.train_problems(0, 0, 0) == []
  for problem in problems:
    a, op, b = _triple(problem)
    assert 0 <= a < 1000 and 0 <= b < 1000
    assert problem.answer == (a + b if op == "+" else a - b)
  assert {_triple(p)[1] for p in problems} == {"+", "-"}


def test_ops_config_restricts_operators():
  t = arithmetic.ArithmeticTask(dict(max_digits=2, ops="+", num_eval=8))
  assert all("-" not in p.prompt for p in t.train_problems(0, 0, 200) + t.eval_problems())
  assert all(p.answer <= 198 for p in t.train_problems(0, 0, 200))


def test_heldout_split(task):
  evals = task.eval_problems()
  assert len(evals) == 256 and len(set(evals)) == 256
  assert _heldout(evals).all()
  assert not _heldout(task.train_problems(seed=0, step=1, num=10_000)).any()
  rng = np.random.default_rng(0)
  a, op, b = rng.integers(0, 1000, 100_000), rng.integers(0, 2, 100_000), rng.integers(0, 1000, 100_000)
  assert 0.09 < arithmetic.is_heldout(a, op, b).mean() < 0.11


def test_heldout_hash_matches_pure_python_splitmix64():
  mask = 2**64 - 1

  def reference(a, op, b):
    z = ((a << 32) | (b << 1) | op) + 0x9E3779B97F4A7C15 & mask
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 & mask
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB & mask
    return (z ^ (z >> 31)) % 10 == 0

  triples = [(a, op, b) for a in (0, 1, 7, 999, 123456789) for op in (0, 1) for b in range(0, 1000, 9)]
  a, op, b = map(np.array, zip(*triples))
  assert arithmetic.is_heldout(a, op, b).tolist() == [reference(*t) for t in triples]


def test_eval_problems_depend_only_on_config(task):
  assert arithmetic.ArithmeticTask(arithmetic.default_config()).eval_problems() == task.eval_problems()
  other = arithmetic.ArithmeticTask(dict(eval_seed=1)).eval_problems()
  assert other != task.eval_problems() and _heldout(other).all()


@pytest.mark.parametrize("completion, expected", [
    ("432", 1.0), (" 432", 0.0), ("432 ", 0.0), ("0432", 0.0), ("432.0", 0.0), ("+432", 0.0), ("-432", 0.0),
    ("433", 0.0), ("432432", 0.0), ("4 32", 0.0), ("432\n", 0.0), ("", 0.0), ("٤٣٢", 0.0), ("４３２", 0.0),
    ("1" * 5000, 0.0), ("⁇", 0.0), (None, 0.0),
])
def test_reward_positive_answer(task, completion, expected):
  assert task.reward(completion, Problem("347+85=", 432)) == expected


@pytest.mark.parametrize("completion, expected", [
    ("-262", 1.0), ("262", 0.0), ("- 262", 0.0), ("--262", 0.0), ("-0262", 0.0), ("−262", 0.0),
])
def test_reward_negative_answer(task, completion, expected):
  assert task.reward(completion, Problem("85-347=", -262)) == expected


@pytest.mark.parametrize("completion, expected", [("0", 1.0), ("-0", 0.0), ("00", 0.0), ("", 0.0)])
def test_reward_zero_answer(task, completion, expected):
  assert task.reward(completion, Problem("5-5=", 0)) == expected


def test_sft_example_earns_full_reward(task):
  assert task.sft_example(Problem("85-347=", -262)) == ("85-347=", "-262")
  for problem in task.train_problems(0, 5, 50):
    assert task.reward(task.sft_example(problem)[1], problem) == 1.0


@pytest.mark.parametrize("fields, message", [
    (dict(max_digit=3), "Unknown arithmetic task config fields \\['max_digit'\\]"),
    (dict(max_digits=0), "max_digits=0"),
    (dict(ops="*"), "ops='\\*'"),
    (dict(ops="++"), "ops='\\+\\+'"),
    (dict(num_eval=0), "num_eval=0"),
    (dict(max_digits=1, num_eval=256), "Found only \\d+ distinct held-out problems"),
])
def test_config_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    arithmetic.ArithmeticTask(fields)


def test_make_task():
  cfg = arithmetic.default_config()
  cfg.name = "arithmetic"
  cfg.num_eval = 8
  cfg.lock()
  task = make_task("arithmetic", cfg)
  assert isinstance(task, arithmetic.ArithmeticTask) and len(task.eval_problems()) == 8
  with pytest.raises(ValueError, match="known tasks: \\['arithmetic'\\]"):
    make_task("arith", cfg)
  with pytest.raises(ValueError, match="name='other'"):
    make_task("arithmetic", ml_collections.ConfigDict(dict(name="other")))
