"""Tasks on JSONL data (gsm8k, math, countdown): splits, seeded draws, rewards, SFT examples, buffers, data errors."""
import json
import time

import numpy as np
import pytest

from jaxrl_batch.tasks import TASKS, countdown, gsm8k, make_task, math_boxed
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.text.spm_tokenizer import train_sentencepiece

NAMES = ("gsm8k", "math", "countdown")
MODULES = {"gsm8k": gsm8k, "math": math_boxed, "countdown": countdown}
GARBAGE = [None, 17, b"#### 12", "", " ", "\n\n", "####", "#### ", "\\boxed{", "\\boxed{" * 20_000, "}" * 10_000,
           "9" * 100_000, "#### " + "9" * 5000, "\\boxed{" + "9" * 5000 + "}", "<answer>" * 1000, "(" * 10_000,
           "Answer: " + "1+" * 10_000 + "1", "<answer>__import__('os').system('ls')</answer>", "\x00\ufffd\u202e",
           "-" * 100_000, "\\frac{1}{0}", "\\boxed{\\frac{1}{0}}", "<answer>1/0</answer>", "#### 1e999",
           "word " * 200_000]


def _write(path, rows):
  path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
  return str(path)


@pytest.fixture(scope="module")
def tasks():
  return {name: make_task(name, {}) for name in NAMES}


@pytest.fixture(scope="module")
def tok(tasks, tmp_path_factory):
  """A small SentencePiece model trained on the sample prompts and SFT completions."""
  rng = np.random.default_rng(0)
  texts = [text for task in tasks.values() for p in task._train + task._eval for text in task.sft_example(p, rng)]
  return train_sentencepiece(texts * 4, tmp_path_factory.mktemp("tok") / "t.model", vocab_size=200,
                                           hard_vocab_limit=False)


def test_registry_and_default_configs():
  for name in NAMES:
    assert name in TASKS
    cfg = MODULES[name].default_config()
    assert {"path", "eval_path", "num_eval", "eval_seed", "prompt_template", "max_response_tokens"} <= set(cfg)
    assert cfg.path == "" and cfg.eval_path == ""
    assert make_task(name, dict(cfg, name=name)).eval_problems()


@pytest.mark.parametrize("name", NAMES)
def test_config_errors(name):
  with pytest.raises(ValueError, match="Unknown .* config fields \\['max_digits'\\]"):
    make_task(name, {"max_digits": 3})
  with pytest.raises(ValueError, match="task.num_eval='4' has type str; set a int"):
    make_task(name, {"num_eval": "4"})
  with pytest.raises(ValueError, match="task.use_all_numbers=1 has type int; set a bool"):
    make_task("countdown", {"use_all_numbers": 1})
  with pytest.raises(ValueError, match="task.max_response_tokens=-1; set a value >= 0"):
    make_task(name, {"max_response_tokens": -1})
  with pytest.raises(ValueError, match="hold out 1..15"):
    make_task(name, {"num_eval": 16})
  with pytest.raises(ValueError, match="uses fields \\['oops'\\]"):
    make_task(name, {"prompt_template": "{oops}"})
  with pytest.raises(ValueError, match="literal braces"):
    make_task(name, {"prompt_template": "\\boxed{"})
  with pytest.raises(ValueError, match="bundles no tokenizer; set config.tokenizer_path"):
    make_task(name, {}).tokenizer_path()
  with pytest.raises(ValueError, match="choose one of"):
    make_task("gsm8k", {"extraction": "loose"})


@pytest.mark.parametrize("name", NAMES)
def test_train_problems_are_seeded_and_never_held_out(tasks, name):
  task = tasks[name]
  batch = task.train_problems(3, 7, 64)
  assert len(batch) == 64 and batch == task.train_problems(3, 7, 64)
  assert batch != task.train_problems(3, 8, 64) and batch != task.train_problems(4, 7, 64)
  held_out = {p.prompt for p in task.eval_problems()}
  seen = {p.prompt for step in range(20) for p in task.train_problems(0, step, 32)}
  assert not seen & held_out
  assert len(seen) == 12 and len(held_out) == 4  # 16 sample problems; every training one is drawn.


@pytest.mark.parametrize("name", NAMES)
def test_eval_split_depends_only_on_config(name):
  a, b = make_task(name, {}), make_task(name, {})
  assert a.eval_problems() == b.eval_problems()
  other = make_task(name, {"eval_seed": 1, "num_eval": 6})
  assert len(other.eval_problems()) == 6 and other.eval_problems() != a.eval_problems()
  assert not {p.prompt for p in other._train} & {p.prompt for p in other.eval_problems()}


def test_eval_file_is_disjoint_from_training(tmp_path):
  rows = [json.loads(line) for line in open(make_task("countdown", {}).path)]
  train = _write(tmp_path / "train.jsonl", rows[:10] + [rows[0]])  # rows[0] twice.
  evals = _write(tmp_path / "eval.jsonl", [rows[0], rows[12], rows[13], rows[12]])
  task = make_task("countdown", {"path": train, "eval_path": evals, "num_eval": 0})
  assert [p.numbers for p in task.eval_problems()] == [(3, 5, 2), (20, 4, 3), (9, 9, 9)]  # Distinct, in order.
  assert len(task._train) == 9 and (3, 5, 2) not in {p.numbers for p in task._train}
  assert len(make_task("countdown", {"path": train, "eval_path": evals, "num_eval": 2}).eval_problems()) == 2
  with pytest.raises(ValueError, match="disjoint files"):
    make_task("countdown", {"path": evals, "eval_path": evals})


def test_duplicate_prompts_are_held_out_together(tmp_path):
  rows = [{"numbers": [n, 1], "target": n + 1} for n in range(6)] * 3
  task = make_task("countdown", {"path": _write(tmp_path / "d.jsonl", rows), "num_eval": 2})
  assert len(task.eval_problems()) == 2 and len(task._train) == 12
  assert not {p.prompt for p in task._train} & {p.prompt for p in task.eval_problems()}


@pytest.mark.parametrize("name", NAMES)
def test_sft_completions_earn_reward(tasks, name):
  task = tasks[name]
  for problem in task._train + task.eval_problems():
    prompt, completion = task.sft_example(problem, np.random.default_rng(0))
    assert prompt == problem.prompt
    assert task.reward(completion, problem) == 1.0, (problem, completion)


@pytest.mark.parametrize("name", NAMES)
def test_reward_never_raises(tasks, name):
  task = tasks[name]
  problem = task.eval_problems()[0]
  for completion in GARBAGE:
    start = time.time()
    assert task.reward(completion, problem) == 0.0, repr(completion)[:80]
    assert time.time() - start < 1.0, repr(completion)[:80]  # Linear in the length: no quadratic blow-up.
  assert task.reward("#### 1", Problem("p", 1)) in (0.0, 1.0)  # A problem from elsewhere.


def test_gsm8k_data_and_reward(tmp_path):
  task = make_task("gsm8k", {})
  by_answer = {p.answer: p for p in task._train + task._eval}
  assert {2705, "2.5", -7} <= set(by_answer)  # '#### 2,705' -> 2705; non-integers stay text.
  assert "<<" not in by_answer[2705].solution and by_answer[2705].solution.endswith("#### 2,705")
  kept = make_task("gsm8k", {"keep_calculator_annotations": True})
  assert any("<<2450+380=2830>>" in p.solution for p in kept._train + kept._eval)
  problem = Problem("q", 1000)
  strict, flexible = task, make_task("gsm8k", {"extraction": "flexible"})
  cases = [("so 1000 in all.\n#### 1,000", 1, 1), ("#### $1000.00", 1, 1), ("#### 1000.", 1, 1),
           ("The answer is 1000.", 0, 1), ("#### 1000 or maybe 999", 1, 0), ("#### 999\nno, 1000", 0, 1),
           ("#### 100", 0, 0), ("#### -1000", 0, 0)]
  for completion, want_strict, want_flexible in cases:
    assert strict.reward(completion, problem) == want_strict, completion
    assert flexible.reward(completion, problem) == want_flexible, completion
  assert strict.reward("#### 2.50", Problem("q", "2.5")) == 1.0
  assert strict.reward("#### -7", Problem("q", -7)) == 1.0 and strict.reward("#### 7", Problem("q", -7)) == 0.0


def test_math_data_and_reward(tmp_path):
  task = make_task("math", {})
  by_answer = {p.answer: p for p in task._train + task._eval}
  assert by_answer["12"].solution == "\\boxed{12}"  # An answer-only row.
  assert "\\frac{5}{6}" in by_answer and "540^\\circ" in by_answer and "\\text{Thursday}" in by_answer
  path = _write(tmp_path / "m.jsonl", [{"problem": f"p{i}", "solution": "\\boxed{1}", "answer": 0.5} for i in range(3)])
  assert {p.answer for p in make_task("math", {"path": path, "num_eval": 1})._train} == {"0.5"}  # "answer" wins.
  problem = Problem("q", "\\frac{1}{2}")
  for completion, want in [("so \\boxed{0.5}.", 1), ("\\boxed{\\dfrac12}", 1), ("\\boxed{1/2}", 1),
                           ("\\boxed{2} then \\boxed{\\frac{1}{2}}", 1), ("\\boxed{\\frac{1}{2}} then \\boxed{2}", 0),
                           ("the answer is 1/2", 0), ("\\boxed{\\frac{1}{3}}", 0)]:
    assert task.reward(completion, problem) == want, completion
  assert task.reward("\\boxed{21}", by_answer["21\\text{ cm}^2"]) == 1.0
  assert task.reward("\\boxed{\\text{Thursday}}", by_answer["\\text{Thursday}"]) == 1.0


def test_countdown_reward():
  task, strict = make_task("countdown", {}), make_task("countdown", {"use_all_numbers": True})
  problem = countdown.CountdownProblem("p", 16, (3, 5, 2))
  cases = [("(3+5)*2", 1, 1), ("<answer>(3+5)*2</answer>", 1, 1), ("2*(5+3) = 16", 1, 1), ("(3+5)*2.", 1, 1),
           ("I think\nAnswer: (3+5)*2\nDone.", 1, 1), ("reasoning...\n(5+3)*2\n", 1, 1),
           ("<answer>3+5</answer> then (3+5)*2", 0, 0), ("(3+5)*2 = 17", 0, 0), ("(3+5)*2 = 16 = 16", 0, 0),
           ("3*5+2-1", 0, 0), ("3*3+5+2-3", 0, 0), ("4*4", 0, 0), ("16", 0, 0), ("(3+5)*2*1", 0, 0),
           ("3*5+2/2", 0, 0), ("2**4", 0, 0)]
  for completion, want, want_all in cases:
    assert task.reward(completion, problem) == want, completion
    assert strict.reward(completion, problem) == want_all, completion
  subset = countdown.CountdownProblem("p", 8, (3, 5, 2))
  assert task.reward("3+5", subset) == 1.0 and strict.reward("3+5", subset) == 0.0
  exact = countdown.CountdownProblem("p", 7, (7, 2, 2))
  assert task.reward("7/2*2", exact) == 1.0 and task.reward("(7/2)*(2)", exact) == 1.0
  assert task.reward("7/2", exact) == 0.0 and task.reward("7*2/(2-2)", exact) == 0.0
  repeated = countdown.CountdownProblem("p", 4, (2, 2))
  assert task.reward("2+2", repeated) == 1.0 and task.reward("2+2+0", repeated) == 0.0


def test_countdown_solve_and_sft_errors():
  assert countdown.solve((25, 3, 6), 69, False) in ("(25*3)-6", "25*3-6")
  assert countdown.solve((3, 5, 2), 5, False) == "5"
  assert countdown.solve((3, 5, 2), 5, True) is not None
  assert countdown.solve((1, 1), 100, False) is None
  task = make_task("countdown", {})
  with pytest.raises(ValueError, match="No expression reaches 100 from \\[1, 1\\].*remove the row"):
    task.sft_example(countdown.CountdownProblem("p", 100, (1, 1)), np.random.default_rng(0))
  with pytest.raises(ValueError, match="at most 5 numbers"):
    task.sft_example(countdown.CountdownProblem("p", 1, (1,) * 6), np.random.default_rng(0))


@pytest.mark.parametrize("name", NAMES)
def test_buffer_lengths(tasks, tok, name):
  task = tasks[name]
  problems = task._train + task._eval
  assert task.max_prompt_len(tok) == max(len(tok.encode(p.prompt)) for p in problems)
  rng = np.random.default_rng(0)
  longest = max(len(tok.encode(task.sft_example(p, rng)[1])) for p in problems) + 1
  if name == "countdown":
    assert longest <= task.max_answer_len(tok) <= longest + 12  # A bound without solving.
  else:
    assert task.max_answer_len(tok) == longest
  assert make_task(name, {"max_response_tokens": 512}).max_answer_len(tok) == 512


@pytest.mark.parametrize("name, lines, message", [
    ("gsm8k", ['{"question": "q", "answer": "#### 1"}', '{"question": "q2", "answer": "#### 2"'], "line 2: .*JSON"),
    ("gsm8k", ['["question", "answer"]'], "line 1: expected a JSON object"),
    ("gsm8k", ['{"question": "q", "answer": "it is 5"}'], "line 1: \"answer\" has no \"#### <number>\""),
    ("gsm8k", ['', '{"answer": "#### 5"}'], "line 2: \"question\" must be a non-empty string"),
    ("math", ['{"problem": "p", "solution": "it is 5"}'], "line 1: the row needs an \"answer\" field"),
    ("math", ['{"problem": "p", "answer": ""}'], "line 1: \"answer\" must be a non-empty string"),
    ("countdown", ['{"numbers": [1, -2], "target": 3}'], "line 1: \"numbers\" must be"),
    ("countdown", ['{"numbers": [1, 2], "target": true}'], "line 1: \"target\" must be an integer"),
    ("countdown", ['{"numbers": [], "target": 3}'], "line 1: \"numbers\" must be"),
    ("countdown", ['', '  '], "holds no rows"),
])
def test_malformed_data_files(tmp_path, name, lines, message):
  path = _write(tmp_path / "bad.jsonl", lines)
  with pytest.raises(ValueError, match=message) as error:
    make_task(name, {"path": path})
  assert str(path) in str(error.value)
  with pytest.raises(ValueError, match=message):
    make_task(name, {"eval_path": path})


def test_missing_and_non_utf8_files(tmp_path):
  with pytest.raises(ValueError, match="missing.jsonl' not found; point task.path"):
    make_task("gsm8k", {"path": str(tmp_path / "missing.jsonl")})
  bad = tmp_path / "latin1.jsonl"
  bad.write_bytes('{"question": "caf\u00e9", "answer": "#### 1"}\n'.encode("latin-1"))
  with pytest.raises(ValueError, match="latin1.jsonl is not UTF-8"):
    make_task("gsm8k", {"path": str(bad)})
