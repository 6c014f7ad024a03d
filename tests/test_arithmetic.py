"""Arithmetic task: problems, held-out split, strict reward, loose SFT formats, bundled tokenizer."""
import re

import ml_collections
import numpy as np
import pytest

from jaxrl_batch.tasks import arithmetic, make_task
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.text.loading import load_tokenizer

PROMPT_RE = re.compile(r"(0|[1-9][0-9]*)([+-])(0|[1-9][0-9]*)=")


@pytest.fixture(scope="module")
def task():
  return arithmetic.ArithmeticTask(arithmetic.default_config())


@pytest.fixture(scope="module")
def tok():
  return load_tokenizer(arithmetic.TOKENIZER_PATH)


def _triple(problem):
  a, op, b = PROMPT_RE.fullmatch(problem.prompt).groups()
  return int(a), op, int(b)


def _heldout(problems):
  a, op, b = zip(*map(_triple, problems))
  return arithmetic.is_heldout(np.array(a), np.array(["+-".index(o) for o in op]), np.array(b))


def test_bundled_tokenizer(task, tok):
  assert task.tokenizer_path() == arithmetic.TOKENIZER_PATH
  assert (tok.vocab_size, tok.pad_id, tok.bos_id, tok.eos_id) == (18, 0, 1, 2)
  char_ids = {}
  for char in "0123456789+-=.":
    ids = tok.encode(char)
    assert len(ids) == 1 and ids[0] > 3, char  # One ordinary piece, not PAD/BOS/EOS/UNK.
    char_ids[char] = ids[0]
  assert sorted(char_ids.values()) == list(range(4, 18))  # 14 distinct pieces fill the vocab after the specials.
  # Golden ids: a changed bundled model silently invalidates checkpoints trained with the old one.
  assert tok.encode("12+3=-90") == [4, 10, 17, 11, 5, 13, 15, 6]
  assert tok.encode("57.0") == [12, 9, 16, 6]


def test_round_trip(task, tok):
  problems = [Problem("5-7=", -2), Problem("0+0=", 0)] + task.train_problems(0, 0, 20) + task.eval_problems()[:20]
  for problem in problems:
    prompt, _ = task.sft_example(problem, np.random.default_rng(0))
    for completion in [str(problem.answer), *arithmetic.loose_formats(problem.answer)]:
      ids = tok.encode(prompt) + tok.encode(completion)
      assert ids == tok.encode(prompt + completion), (prompt, completion)
      assert len(tok.encode(completion)) == len(completion)  # One token per character, loose or strict.
      assert tok.decode(ids + [tok.eos_id]) == prompt + completion


def test_round_trip_of_mixed_sft_examples(tok):
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=0.5, sft_strict_frac_sub=0.5))
  rng = np.random.default_rng(0)
  kinds = set()
  for problem in t.train_problems(0, 0, 200):
    prompt, completion = t.sft_example(problem, rng)
    kinds.add([str(problem.answer), *arithmetic.loose_formats(problem.answer)].index(completion))
    assert tok.encode(prompt) + tok.encode(completion) == tok.encode(prompt + completion), (prompt, completion)
    assert tok._sp.unk_id() not in tok.encode(prompt + completion)
  assert kinds == {0, 1, 2}  # The strict and both loose spellings were all exercised.


def test_regenerated_tokenizer_matches_bundled(tmp_path, tok):
  regen = arithmetic.write_tokenizer(str(tmp_path / "arith.model"))
  assert regen.vocab_size == tok.vocab_size
  assert [regen._sp.id_to_piece(i) for i in range(18)] == [tok._sp.id_to_piece(i) for i in range(18)]
  for text in ["347+85=432", "0-999=-999", "9876543210", "47+10=57.", "0-47=-47.0"]:
    assert regen.encode(text) == tok.encode(text)


@pytest.mark.parametrize("max_digits, ops, prompt_len, answer_len", [
    (3, "+-", 8, 7),  # "999+999=", "1998.0"+EOS or "-999.0"+EOS
    (1, "+", 4, 5),  # "9+9=", "18.0"+EOS
    (2, "-", 6, 6),  # "99-99=", "-99.0"+EOS
    (2, "+-", 6, 6),  # "99+99=", "198.0"+EOS or "-99.0"+EOS
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


def test_default_config_sft_fractions():
  cfg = arithmetic.default_config()
  assert (cfg.sft_strict_frac_add, cfg.sft_strict_frac_sub) == (1.0, 1.0)


@pytest.mark.parametrize("answer, expected", [(57, ["57.", "57.0"]), (-262, ["-262.", "-262.0"]), (0, ["0.", "0.0"])])
def test_loose_formats(answer, expected):
  assert arithmetic.loose_formats(answer) == expected


@pytest.mark.parametrize("prompt, answer", [("47+10=", 57), ("85-347=", -262), ("5-5=", 0), ("0+0=", 0)])
def test_loose_formats_earn_zero_reward(task, prompt, answer):
  problem = Problem(prompt, answer)
  assert task.reward(str(answer), problem) == 1.0
  for completion in arithmetic.loose_formats(answer):
    assert task.reward(completion, problem) == 0.0, completion


def test_tokenizer_corpus_has_strict_and_loose_lines():
  corpus = arithmetic.tokenizer_corpus()
  for line in ["10+3=13", "10+3=13.", "10+3=13.0", "0-47=-47", "0-47=-47.", "0-47=-47.0", "0+0=0.0"]:
    assert line in corpus, line
  assert set("".join(corpus)) == set("0123456789+-=.")


def test_sft_example_earns_full_reward(task):
  rng = np.random.default_rng(0)
  assert task.sft_example(Problem("85-347=", -262), rng) == ("85-347=", "-262")
  assert task.sft_example(Problem("347+85=", 432), rng) == ("347+85=", "432")
  for problem in task.train_problems(0, 5, 200):
    prompt, completion = task.sft_example(problem, rng)
    assert prompt == problem.prompt and task.reward(completion, problem) == 1.0


def test_sft_example_never_strict_at_fraction_zero():
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=0.0, sft_strict_frac_sub=0.0))
  rng = np.random.default_rng(0)
  assert t.sft_example(Problem("5-5=", 0), rng)[1] in ("0.", "0.0")
  assert t.sft_example(Problem("85-347=", -262), rng)[1] in ("-262.", "-262.0")
  seen = set()
  problems = t.train_problems(0, 5, 200)
  assert {_triple(p)[1] for p in problems} == {"+", "-"}
  for problem in problems:
    prompt, completion = t.sft_example(problem, rng)
    assert prompt == problem.prompt and t.reward(completion, problem) == 0.0
    assert completion in arithmetic.loose_formats(problem.answer)
    seen.add(completion == f"{problem.answer}.0")
  assert seen == {False, True}  # Both loose spellings are used.


@pytest.mark.parametrize("add, sub", [(1.0, 0.0), (0.0, 1.0)])
def test_sft_fraction_is_per_operator(add, sub):
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=add, sft_strict_frac_sub=sub))
  rng = np.random.default_rng(1)
  # Negative answers and zero differences count as differences; the '-' of a negative answer is not in the prompt.
  for problem in [Problem("5-7=", -2), Problem("5-5=", 0), Problem("7-5=", 2), Problem("0+0=", 0), Problem("9+9=", 18)]:
    strict = t.reward(t.sft_example(problem, rng)[1], problem) == 1.0
    assert strict == ((add if "+" in problem.prompt else sub) == 1.0), problem
  for problem in t.train_problems(0, 5, 200):
    expected = add if _triple(problem)[1] == "+" else sub
    assert t.reward(t.sft_example(problem, rng)[1], problem) == expected


def test_sft_strict_fractions_match_config():
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=0.9, sft_strict_frac_sub=0.2))
  rng = np.random.default_rng(0)
  strict = {"+": [], "-": []}
  for problem in t.train_problems(seed=0, step=0, num=2000):
    prompt, completion = t.sft_example(problem, rng)
    assert prompt == problem.prompt
    assert completion == str(problem.answer) or completion in arithmetic.loose_formats(problem.answer)
    strict[_triple(problem)[1]].append(t.reward(completion, problem))
  assert min(len(strict["+"]), len(strict["-"])) > 800
  assert abs(np.mean(strict["+"]) - 0.9) < 0.05
  assert abs(np.mean(strict["-"]) - 0.2) < 0.05


def test_sft_example_is_deterministic_given_rng():
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=0.5, sft_strict_frac_sub=0.5))
  problems = t.train_problems(0, 0, 100)
  run = lambda seed: [t.sft_example(p, rng) for rng in [np.random.default_rng(seed)] for p in problems]
  assert run(3) == run(3) and run(3) != run(4)


@pytest.mark.parametrize("add, sub", [(0, 1), (1, 0), (0.0, 0.5), (np.float64(0.25), 1.0)])
def test_sft_fraction_bounds_accepted(add, sub):
  t = arithmetic.ArithmeticTask(dict(num_eval=4, sft_strict_frac_add=add, sft_strict_frac_sub=sub))
  assert t.sft_strict_frac == {"+": add, "-": sub}


@pytest.mark.parametrize("fields, message", [
    (dict(max_digit=3), "Unknown arithmetic task config fields \\['max_digit'\\]"),
    (dict(max_digits=0), "max_digits=0"),
    (dict(ops="*"), "ops='\\*'"),
    (dict(ops="++"), "ops='\\+\\+'"),
    (dict(num_eval=0), "num_eval=0"),
    (dict(max_digits=1, num_eval=256), "Found only \\d+ distinct held-out problems"),
    (dict(sft_strict_frac_add=1.5), "^task\\.sft_strict_frac_add=1\\.5; set a fraction in \\[0, 1\\]\\.$"),
    (dict(sft_strict_frac_add=-0.1), "^task\\.sft_strict_frac_add=-0\\.1; set a fraction in \\[0, 1\\]"),
    (dict(sft_strict_frac_add=float("nan")), "^task\\.sft_strict_frac_add=nan; "),
    (dict(sft_strict_frac_add="0.5"), "^task\\.sft_strict_frac_add='0\\.5'; "),
    (dict(sft_strict_frac_add=None), "^task\\.sft_strict_frac_add=None; "),
    (dict(sft_strict_frac_sub=1.01), "^task\\.sft_strict_frac_sub=1\\.01; set a fraction in \\[0, 1\\]"),
    (dict(sft_strict_frac_sub=-1), "^task\\.sft_strict_frac_sub=-1; "),
    (dict(sft_strict_frac_sub=2), "^task\\.sft_strict_frac_sub=2; "),
    (dict(sft_strict_frac_add=0.5, sft_strict_frac_sub=7.0), "^task\\.sft_strict_frac_sub=7\\.0; "),
    (dict(sft_strict_frac=0.5), "Unknown arithmetic task config fields \\['sft_strict_frac'\\]"),
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
  assert task.sft_strict_frac == {"+": 1.0, "-": 1.0}
  cfg.unlock()
  cfg.sft_strict_frac_add, cfg.sft_strict_frac_sub = 0.9, 0.2
  cfg.lock()
  assert make_task("arithmetic", cfg).sft_strict_frac == {"+": 0.9, "-": 0.2}
  cfg.sft_strict_frac_sub = 1.2
  with pytest.raises(ValueError, match="task.sft_strict_frac_sub=1.2"):
    make_task("arithmetic", cfg)
  known = "known tasks: \\['arithmetic', 'countdown', 'gsm8k', 'long_addition', 'math'\\]"
  with pytest.raises(ValueError, match=known):
    make_task("arith", cfg)
  with pytest.raises(ValueError, match="name='other'"):
    make_task("arithmetic", ml_collections.ConfigDict(dict(name="other")))
