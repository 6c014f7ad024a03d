"""What several test modules share: tiny decoders on one device, the debug member of the arithmetic family and its
runs (straight, and killed then resumed), `launch.train` as a child process, and comparisons of pytrees and rollouts.

Fixtures live in conftest.py; test modules import these functions and never each other.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import grpo_arith
from jaxrl_batch.model import ModelConfig, Transformer, sequence_logits
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ONE_DEVICE = jax.devices()[:1]

# D 32, 2 layers, 4 query heads sharing 2 kv heads of 8, SwiGLU 64: it compiles in about a second on a CPU.
_TINY = dict(vocab_size=32, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64)


def tiny_config(**fields) -> ModelConfig:
  """The tiny decoder above, with `fields` changed (e.g. the vocabulary of a test's token ids)."""
  return ModelConfig(**{**_TINY, **fields})


def one_device_model(cfg: ModelConfig, seed: int = 0):
  """(graphdef, params) of a `Transformer(cfg)` initialised from `seed` on a mesh of the first device."""
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  return sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(seed)), mesh, sharding.DEFAULT_RULES)


def next_token_loss(graphdef, params, tokens_BxT, valid_BxT):
  """Mean negative log-likelihood of each valid token after the first, under the model's own logits."""
  logits_BxTxV = sequence_logits(graphdef, params, tokens_BxT, valid_BxT)
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV[:, :-1])
  nll_BxT = -jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
  return jnp.sum(nll_BxT * valid_BxT[:, 1:]) / jnp.sum(valid_BxT[:, 1:])


def assert_trees_equal(a, b):
  """Every leaf of `a` equals `b`'s, bit for bit."""
  jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def assert_same_rollout(a, b, atol=1e-5):
  """Two `Rollout`s hold the same tokens, masks, lengths and truncation, and log-probs to `atol`."""
  for name in ("tokens_BxN", "mask_BxN", "lengths_B", "truncated_B"):
    np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
  np.testing.assert_allclose(np.asarray(a.logprobs_BxN), np.asarray(b.logprobs_BxN), atol=atol)


def debug_config(base_cache, module=grpo_arith, **overrides):
  """The debug member (6 steps of 32 rollouts on one device, learning from the first), its warm start cached in
  `base_cache`, with dotted-key `overrides` ({"rl.kl_coef": 0.05})."""
  c = module.get_config("debug")
  c.sft.cache_dir = base_cache
  c.sample_budget = 192
  c.mesh.data = 1
  for key, value in overrides.items():
    node = c
    *path, leaf = key.split(".")
    for name in path:
      node = node[name]
    node[leaf] = value
  return c


def straight_and_resumed(tmp_path, monkeypatch, config, straight=None):
  """Rows of an uninterrupted run of `config()` (or of the run directory `straight`) and of one killed at step 3,
  then rerun to the end."""
  resumed = str(tmp_path / "resumed")
  if straight is None:
    straight = str(tmp_path / "straight")
    Trainer(config(), straight, devices=ONE_DEVICE).run()
  original = Trainer._train_step

  def crash_at_step_3(self, state, step):
    if step == 3:
      raise KeyboardInterrupt("simulated kill")
    return original(self, state, step)
  monkeypatch.setattr(Trainer, "_train_step", crash_at_step_3)
  with pytest.raises(KeyboardInterrupt):
    Trainer(config(), resumed, devices=ONE_DEVICE).run()
  monkeypatch.setattr(Trainer, "_train_step", original)
  # Step 3 was logged after the checkpoint at step 2, then the run died: the rerun drops it and redoes it.
  Trainer(config(), resumed, devices=ONE_DEVICE).run()
  return rundir.read_metrics(straight), rundir.read_metrics(resumed)


def launch_train(workdir, base_cache, *flags, devices=None) -> subprocess.Popen:
  """`python -m launch.train` of the arithmetic debug member as a child process (stdout and stderr in one text pipe),
  its warm start cached in `base_cache`; `devices` fakes that many CPU devices (default: this process's 8)."""
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug", f"--workdir={workdir}",
         f"--config.sft.cache_dir={base_cache}", *flags]
  env = dict(os.environ)
  if devices is not None:
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
