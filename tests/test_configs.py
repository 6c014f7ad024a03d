"""Every shipped config builds (default and debug), each sweep member derives as launch.study builds it, and config
args are parsed strictly."""
import glob
import importlib
import math
import os

import jax
import pytest

from jaxrl_batch.config.args import parse_arg
from jaxrl_batch.config.optim import make_optimizer
from jaxrl_batch.study import runner
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.tasks.rewards import safe_rewards
from jaxrl_batch.train.setup import Experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE = jax.devices()[:1]
CONFIGS = sorted(os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
                 if not p.endswith("__init__.py"))
SWEEP_BASE_ARG = {"grpo_gsm8k_qwen": "model=qwen2.5-0.5b"}  # The model its sweep() is for (tiny_random: 64 samples).


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_builds_and_its_sweep_members_derive(name):
  module = importlib.import_module(f"configs.{name}")
  for arg in [None, "debug"]:
    config = module.get_config(arg)
    config.mesh.data = 1
    exp = Experiment.create(config, devices=jax.devices()[:1])
    optimizer = make_optimizer(config.optim, config.batch_size, config.sample_budget)
    assert optimizer.lr.lr > 0
    assert exp.prompt_len > 1 and exp.response_len > 1
  # A sweep member is built as launch.study builds it; its Member validates (a Qwen model needs its tokenizer for
  # a whole Experiment).
  members = [runner.derive(runner.member_config(module, SWEEP_BASE_ARG.get(name, ""), dict(f, seed=0)), f, ONE)
             for f in module.sweep()]
  assert len({m.name for m in members}) == len(members) and len({m.sample_budget for m in members}) == 1


@pytest.mark.parametrize("name", CONFIGS)
def test_sweep_members_follow_their_rule(name):
  module = importlib.import_module(f"configs.{name}")
  for fields in module.sweep():
    c = runner.member_config(module, SWEEP_BASE_ARG.get(name, ""), fields)
    lr = make_optimizer(c.optim, c.batch_size, c.sample_budget).lr.lr
    ratio = c.batch_size / c.optim.base_batch
    want = c.optim.base_lr * {"sqrt": math.sqrt(ratio), "none": 1.0, "linear": ratio}[c.optim.lr_rule]
    assert (c.batch_size, c.optim.lr_rule, lr) == (fields["batch"], fields["lr_rule"], pytest.approx(want))


def test_parse_arg_types_and_errors():
  c = parse_arg("batch=256,lr_rule=none,debug", batch=128, lr_rule="sqrt", debug=False, scale=1.0)
  assert (c.batch, c.lr_rule, c.debug, c.scale) == (256, "none", True, 1.0)
  assert parse_arg("scale=2.5,debug=false", scale=1.0, debug=True).to_dict() == {"scale": 2.5, "debug": False}
  with pytest.raises(ValueError, match="Unknown config arg 'bach'; this config accepts"):
    parse_arg("bach=3", batch=128)
  with pytest.raises(ValueError, match="batch='x': expected int"):
    parse_arg("batch=x", batch=128)
  with pytest.raises(ValueError, match="needs a value"):
    parse_arg("batch", batch=128)


def test_reward_errors_are_counted_not_raised():
  class Flaky:
    def reward(self, completion, problem):
      if completion == "boom":
        raise RuntimeError("parser exploded")
      return float(completion == str(problem.answer))
  problems = [Problem("1+1=", 2)] * 3
  rewards, errors, first = safe_rewards(Flaky(), ["2", "boom", "3"], problems)
  assert rewards.tolist() == [1.0, 0.0, 0.0]
  assert errors == 1 and first == "RuntimeError: parser exploded"
