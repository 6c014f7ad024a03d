"""configs/grpo_gsm8k_qwen.py: members chosen by batch= or prompts=, and end to end on CPU: the tiny_random member
from a warm start, and from a Hugging Face checkpoint (`init_from`), with a chat template applied."""
import json
import os

import jax
import numpy as np
import pytest

from configs import grpo_gsm8k_qwen
from jaxrl_batch.config import family
from jaxrl_batch.train.setup import Experiment
from jaxrl_batch.train.trainer import Trainer

pytest.importorskip("safetensors")
ONE = jax.devices()[:1]
# Under `-n 2` the runs of the tiny_random member are in one worker (`--dist=loadgroup`), which compiles its programs
# once.
ON_TINY_RUNS_WORKER = pytest.mark.xdist_group("gsm8k_tiny_random")


def tiny_config(tmp_path, **fields):
  c = grpo_gsm8k_qwen.get_config("model=tiny_random,mesh=1x1x1")
  c.sft.cache_dir = str(tmp_path / "base")
  c.sample_budget = 32
  for key, value in fields.items():
    c[key] = value
  return c


@pytest.mark.parametrize("arg, prompts, group_size, base_batch", [
    ("model=tiny_random", 4, 4, 16), ("model=tiny_random,batch=32", 8, 4, 16),
    ("model=tiny_random,prompts=8", 8, 4, 16), ("model=tiny_random,batch=32,prompts=8", 8, 4, 16),
    ("model=qwen2.5-0.5b,batch=512", 64, 8, 1024), ("model=qwen2.5-0.5b,prompts=64", 64, 8, 1024),
    ("model=qwen2.5-0.5b", 128, 8, 1024)])
def test_batch_and_prompts_choose_the_member(arg, prompts, group_size, base_batch):
  member = family.member(grpo_gsm8k_qwen.get_config(arg))
  assert (member.num_prompts, member.group_size, member.batch_size) == (prompts, group_size, prompts * group_size)
  lr = member.actor_lr
  assert (lr.rule, lr.base_batch, lr.lr) == ("sqrt", base_batch, pytest.approx(lr.base_lr * np.sqrt(
      member.batch_size / base_batch)))


def test_batch_and_prompts_that_disagree_are_refused():
  with pytest.raises(ValueError, match="batch=32 and prompts=4 disagree: batch = prompts x group size 4 = 16"):
    grpo_gsm8k_qwen.get_config("model=tiny_random,batch=32,prompts=4")


@pytest.mark.slow
@ON_TINY_RUNS_WORKER
def test_tiny_random_runs_end_to_end_on_the_bundled_sample(tmp_path):
  Trainer(tiny_config(tmp_path, chat_template="chatml"), str(tmp_path / "run"), devices=ONE).run()
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [r["samples"] for r in rows if "reward_mean" in r] == [16, 32]
  assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


@pytest.mark.slow
@ON_TINY_RUNS_WORKER
def test_init_from_a_hugging_face_checkpoint(tmp_path):
  from jaxrl_batch.hf.convert import save_pretrained
  config = tiny_config(tmp_path)
  exp = Experiment.create(config, devices=ONE)
  _, params = exp.init_params(seed=3)
  hf_dir = str(tmp_path / "hf")
  save_pretrained(exp.model_cfg, params, hf_dir)
  trainer = Trainer(tiny_config(tmp_path, init_from=hf_dir), str(tmp_path / "run"), devices=ONE)
  trainer.run()
  saved = json.load(open(tmp_path / "run" / "config.json"))
  assert saved["derived"]["base_policy"] == hf_dir
  assert not os.path.exists(tmp_path / "base")  # No supervised warm start was trained.


@pytest.mark.slow
def test_init_from_a_checkpoint_of_another_shape_is_refused(tmp_path):
  from jaxrl_batch.hf.convert import save_pretrained
  exp = Experiment.create(tiny_config(tmp_path), devices=ONE)
  _, params = exp.init_params(seed=0)
  save_pretrained(exp.model_cfg, params, str(tmp_path / "hf"))
  other = tiny_config(tmp_path, init_from=str(tmp_path / "hf"))
  other.model.d_ff = 256
  with pytest.raises(ValueError, match="model.d_ff: config 256, checkpoint 128"):
    Trainer(other, str(tmp_path / "run"), devices=ONE)
  assert not (tmp_path / "run").exists()
