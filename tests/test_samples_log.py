"""samples.jsonl: a few rollouts per logged step as text, aligned with their prompts and rewards, trimmed on resume."""
import json
import os

import jax
import pytest

from configs import grpo_arith
from jaxrl_batch.config.args import apply_overrides
from jaxrl_batch.tasks.base import Problem
from jaxrl_batch.train import samples_log
from jaxrl_batch.train.trainer import Trainer

ONE = jax.devices()[:1]


def test_shorten_keeps_head_and_tail():
  assert samples_log.shorten("abcdef", 0) == "abcdef" and samples_log.shorten("abcdef", 6) == "abcdef"
  cut = samples_log.shorten("a" * 50 + "b" * 50, 27)
  assert cut == "a" * 10 + samples_log.CUT + "b" * 10 and len(cut) == 27


def test_truncate_after_drops_later_and_torn_rows(tmp_path):
  log = samples_log.SamplesLog(str(tmp_path), max_chars=5)
  log.write(1, 32, [dict(prompt="p", answer=3, completion="x" * 20, reward=1.0, length=20, truncated=False)])
  log.write(2, 64, [dict(prompt="q", answer=4, completion="y", reward=0.0, length=1, truncated=True)])
  with open(log.path, "a") as f:
    f.write('{"step": 3, "sam')
  log.truncate_after(2)
  rows = [json.loads(line) for line in open(log.path)]
  assert [r["step"] for r in rows] == [1, 2] and rows[0]["completion"] == samples_log.shorten("x" * 20, 5)
  log.truncate_after(1)
  assert [json.loads(line)["step"] for line in open(log.path)] == [1]


@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_logged_rollouts_are_the_scored_ones_and_a_resume_logs_no_step_twice(base_cache, tmp_path, engine):
  c = grpo_arith.get_config("debug")
  apply_overrides(c, ["mesh.data=1", f"sft.cache_dir={base_cache}", "sample_budget=128", "log_samples_every_steps=2",
                      f"sampling.engine={engine}", "sampling.slots=8", "checkpoint_every_samples=64"])
  workdir = str(tmp_path / "run")
  trainer = Trainer(c, workdir, devices=ONE)
  trainer.run()
  rows = [json.loads(line) for line in open(os.path.join(workdir, samples_log.SAMPLES))]
  assert [(r["step"], r["samples"]) for r in rows] == [(2, 64)] * 4 + [(4, 128)] * 4
  for r in rows:  # Each text is its prompt's completion: the task scores it to the logged reward.
    assert trainer.exp.task.reward(r["completion"], Problem(r["prompt"], r["answer"])) == r["reward"]
  assert len({r["prompt"] for r in rows if r["step"] == 2}) == 1  # One prompt's group of 4.
  assert any(r["reward"] > 0 for r in rows)
  with open(os.path.join(workdir, samples_log.SAMPLES), "a") as f:
    f.write(json.dumps(dict(rows[-1], step=5)) + "\n")  # A row past the last checkpoint (step 4): dropped on resume.
  Trainer(c, workdir, devices=ONE).run()
  assert [json.loads(line) for line in open(os.path.join(workdir, samples_log.SAMPLES))] == rows
