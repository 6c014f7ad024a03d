"""A run's inputs that are wrong say what is wrong and how to fix it, and change nothing: a damaged config.json, a
reward function that raises."""
import logging
import os
import re

import pytest

from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import ONE_DEVICE, debug_config


@pytest.mark.parametrize("content", [b"garbage{{", b'{"config": ', b"[1, 2]", b"\xff\xfe{"])
def test_damaged_config_json_is_named_with_the_fix_and_left_as_is(tmp_path, content):
  path = tmp_path / rundir.CONFIG
  path.write_bytes(content)
  (tmp_path / rundir.METRICS).write_text('{"step": 0, "samples": 0, "eval_accuracy": 0.5}\n')
  before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
  with pytest.raises(ValueError, match=rf"{path} (is not valid JSON|holds a JSON list).*Restore it from a backup"):
    rundir.read_config(str(tmp_path))
  assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_reward_that_always_raises_stops_the_run_naming_it(base_cache, tmp_path, caplog):
  """A reward that raises on every sample: each step's warning names the metrics row (`step`) that counts the
  errors, and task.max_failed_reward_steps such steps in a row stop the run with an error naming the reward, after
  writing the rows of the steps that ran."""
  config = debug_config(base_cache, sample_budget=96, **{"task.max_failed_reward_steps": 2})
  trainer = Trainer(config, str(tmp_path / "run"), devices=ONE_DEVICE)

  def broken(completion, problem):
    raise ZeroDivisionError("a broken verifier")
  trainer.exp.task.reward = broken
  with caplog.at_level(logging.WARNING), pytest.raises(
      RuntimeError, match=r"reward function (tests\.)?test_run_errors\..*broken failed on every sample of 2 consecutive "
      r"steps.*step 2: 32 of 32 raised.*task.max_failed_reward_steps=2\. .*Fix the reward function, then rerun"):
    trainer.run()
  rows = [r for r in rundir.read_metrics(trainer.workdir) if "reward_errors" in r]
  warned = [int(m) for m in re.findall(r"Step (\d+): the reward function raised on 32 of 32", caplog.text)]
  assert warned == [r["step"] for r in rows if r["reward_errors"] == 32] == [1, 2]
