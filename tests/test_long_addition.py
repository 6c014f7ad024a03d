"""The long-addition reasoning task: worked traces, the outcome reward, the held-out split and the length tail."""
import numpy as np
import pytest

from configs import grpo_reasoning
from jaxrl_batch.tasks import long_addition, make_task
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.text.loading import load_tokenizer


def test_trace_works_every_column_with_its_carry():
  assert long_addition.trace(4721, 3858) == "1+8+0=9.2+5+0=7.7+8+0=15.4+3+1=8.=8579"
  assert long_addition.trace(99, 1) == "9+1+0=10.9+0+1=10.=100"
  assert long_addition.trace(5, 0) == "5+0+0=5.=5"
  # A forgotten carry: the trace goes on consistently from the mistake, to a wrong result.
  assert long_addition.trace(4721, 3858, [False, False, False, True]) == "1+8+0=9.2+5+0=7.7+8+0=15.4+3+0=7.=7579"
  assert long_addition.trace(99, 1, [False, True]) == "9+1+0=10.9+0+0=9.=90"


def test_reward_needs_a_trace_then_the_exact_answer():
  task = long_addition.LongAdditionTask({})
  problem = Problem("47+85=", 132)
  assert task.reward(long_addition.trace(47, 85), problem) == 1.0
  assert task.reward("7+5+0=99.=132", problem) == 1.0  # The trace is not graded (a chain of thought).
  for wrong in ("132", "=132", "7+5+0=12.4+8+1=13.=131", "7+5+0=12.4+8+1=13.=132.", "7+5+0=12.4+8+1=13.=0132", ""):
    assert task.reward(wrong, problem) == 0.0, wrong
  assert task.extract_answer("1+2+0=3.=3") == "3" and task.extract_answer("3") is None


def test_splits_are_disjoint_seeded_and_draw_the_long_tail():
  task = make_task("long_addition", long_addition.default_config())
  held_out = {p.prompt for p in task.eval_problems()}
  assert len(held_out) == task.num_eval == 768
  train = task.train_problems(seed=0, step=3, num=4000)
  assert [p.prompt for p in train[:50]] == [p.prompt for p in task.train_problems(seed=0, step=3, num=4000)[:50]]
  assert not held_out & {p.prompt for p in train}
  digits = np.array([len(p.prompt.split("+")[0]) for p in train])
  assert digits.min() == task.min_digits and digits.max() == task.max_digits
  assert np.mean(digits <= 3) > 0.45  # Mostly short ...
  lengths = np.array([len(long_addition.trace(*map(int, p.prompt[:-1].split("+")))) + 1 for p in train])
  assert lengths.mean() >= 32 and lengths.max() / lengths.mean() >= 2.5  # ... with a long tail of tokens.
  assert all(p.answer == sum(map(int, p.prompt[:-1].split("+"))) for p in train)


def test_warm_start_problems_stop_at_sft_max_digits_and_their_completions_earn_reward():
  task = long_addition.LongAdditionTask(dict(sft_max_digits=4))
  problems = task.sft_problems(seed=0, step=0, num=500)
  assert max(len(p.prompt.split("+")[0]) for p in problems) == 4
  rng = np.random.default_rng(0)
  assert all(task.reward(task.sft_example(p, rng)[1], p) == 1.0 for p in problems)
  sloppy = long_addition.LongAdditionTask(dict(sft_max_digits=4, sft_carry_drop=1.0))
  carries = [p for p in problems if long_addition.trace(*map(int, p.prompt[:-1].split("+"))).count("+1=")]
  assert carries and all(sloppy.reward(sloppy.sft_example(p, rng)[1], p) == 0.0 for p in carries)


def test_budgets_fit_the_longest_problem():
  task = long_addition.LongAdditionTask({})
  tok = load_tokenizer(task.tokenizer_path())
  top = 10**task.max_digits - 1
  assert task.max_prompt_len(tok) == len(tok.encode(f"{top}+{top}="))
  assert task.max_answer_len(tok) == len(tok.encode(long_addition.trace(top, top))) + 1 == 123


@pytest.mark.parametrize("fields, message", [
    (dict(min_digits=3, max_digits=2), "min_digits <= max_digits"),
    (dict(max_digits=16), "<= 15"),
    (dict(digits_decay=0.0), "digits_decay=0.0: set a positive number"),
    (dict(digits_decay=1), "digits_decay=1 has type int"),
    (dict(sft_max_digits=13), "sft_max_digits"),
    (dict(sft_carry_drop=1.5), "sft_carry_drop"),
    (dict(bogus=1), "Unknown long_addition task config fields"),
])
def test_config_errors(fields, message):
  with pytest.raises(ValueError, match=message):
    long_addition.LongAdditionTask(fields)


def test_the_family_config_builds():
  c = grpo_reasoning.get_config()
  assert c.task.name == "long_addition" and c.batch_size == grpo_reasoning.BASE_BATCH
  assert {m["batch"] for m in grpo_reasoning.sweep()} == {16, 32, 64, 128}
