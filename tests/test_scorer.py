"""The reward scorer (`tasks.rewards`): a reward that raises, returns NaN or hangs scores 0 and is counted, never
stopping the scoring; hung threads are replaced up to `max_hung`, past which scoring stops with an error; a batch's
completions arrive in parts and keep their order."""
import threading
import time

import pytest

from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.rewards import RewardScorer


def test_reward_errors_and_timeouts_are_counted_not_raised():
  def reward(completion, problem):
    if completion == "boom":
      raise RuntimeError("parser exploded")
    if completion == "hang":
      threading.Event().wait()
    return float("nan") if completion == "nan" else float(completion == str(problem.answer))
  problems = [Problem("1+1=", 2)] * 6
  scorer = RewardScorer(reward, workers=2, timeout_s=0.3)
  start = time.monotonic()
  scores = scorer.score(["2", "boom", "hang", "3", "nan", "2"], problems)
  assert scores.rewards_B.tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 1.0]
  assert (scores.errors, scores.timeouts) == (2, 1) and scores.first_error == "RuntimeError: parser exploded"
  assert time.monotonic() - start < 5 and scorer.abandoned == 1
  assert scores.failures() == ("raised on 2 and ran past task.reward_timeout_s on 1 of 6 samples (scored 0); first: "
                               "RuntimeError: parser exploded")  # the run's log line
  assert scorer.score(["2"], problems[:1]).failures() == ""
  # Hung threads are replaced: with both workers hung, the third sample is still scored.
  scores = scorer.score(["hang", "hang", "2"], problems[:3])
  assert scores.rewards_B.tolist() == [0.0, 0.0, 1.0] and scores.timeouts == 2 and scorer.abandoned == 3
  assert scores.first_error == "the reward function ran past task.reward_timeout_s=0.3 s"
  scorer.close()


def test_a_reward_that_hangs_for_good_stops_scoring_with_an_error_past_max_hung():
  release = threading.Event()
  def reward(completion, problem):
    if completion == "hang":
      release.wait()
    return 1.0
  scorer = RewardScorer(reward, workers=1, timeout_s=0.1, max_hung=2)
  assert scorer.score(["hang", "hang", "ok"], [None] * 3).rewards_B.tolist() == [0.0, 0.0, 1.0]
  assert (scorer.abandoned, scorer.hung, scorer.failure) == (2, 2, None)  # Two hung threads are tolerated.
  with pytest.raises(RuntimeError, match=r"3 reward threads are still running past task.reward_timeout_s=0.1 s "
                                         r"\(at most 2 are tolerated\): the reward function hangs"):
    scorer.score(["hang", "ok"], [None] * 2)
  release.set()  # The hung calls return at last: their threads end and are no longer counted.
  deadline = time.monotonic() + 5
  while scorer.hung and time.monotonic() < deadline:
    time.sleep(0.01)
  assert scorer.hung == 0 and scorer.abandoned == 3
  scorer.close()


def test_rewards_arrive_in_parts_and_keep_their_order():
  scorer = RewardScorer(lambda completion, problem: float(completion), workers=3)
  batch = scorer.batch(list(range(5)))
  batch.submit([3, 1], lambda: ["3", "1"])
  with pytest.raises(ValueError, match=r"samples \[1\] were submitted twice"):
    batch.submit([1], lambda: ["1"])
  with pytest.raises(ValueError, match="3 of 5 samples were never submitted"):
    batch.result()
  batch.submit([4, 0, 2], lambda: ["4", "0", "2"])
  assert batch.result().rewards_B.tolist() == [0, 1, 2, 3, 4]
  scorer.close()
