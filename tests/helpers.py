"""What several test modules share: tiny decoders on one device, the debug member of the arithmetic family and its
runs (straight, and killed then resumed), `launch.train` as a child process, comparisons of pytrees and rollouts,
and one RL update of a tiny model with the documented loss computed by hand.

Fixtures live in conftest.py; test modules import these functions and never each other.
"""
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from configs import grpo_arith
from configs.base import algo_config
from jaxrl_batch.kernels import train_attention
from jaxrl_batch.model import ModelConfig, Transformer, sequence_logits
from jaxrl_batch.model.logprobs import sequence_logprobs
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.critic import init_critic
from jaxrl_batch.rl.forward import ModelDefs
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train import rundir
from jaxrl_batch.train.trainer import Trainer
from tests.close import assert_close

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


def assert_same_rollout(a, b, rtol=5e-6):
  """Two `Rollout`s hold the same tokens, masks, lengths and truncation, and log-probs to `rtol` of their largest
  magnitude (`rtol=0`: bit for bit, for the same program run twice)."""
  for name in ("tokens_BxN", "mask_BxN", "lengths_B", "truncated_B"):
    np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
  if rtol == 0:
    np.testing.assert_array_equal(np.asarray(a.logprobs_BxN), np.asarray(b.logprobs_BxN))
  else:
    assert_close(a.logprobs_BxN, b.logprobs_BxN, rtol)


# Qwen2.5-1.5B's attention at a training length: 12 query heads over 2 kv heads of 128, bfloat16.
ATTENTION_B, ATTENTION_T, ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM = 2, 2048, 12, 2, 128


def compiled_attention(mesh, backend: str):
  """(HLO text, temporary bytes per device) of `segment_attention`'s forward and backward at the shapes above,
  compiled for `mesh` (rows over its batch axes, query heads over "tensor") with `backend`; nothing runs."""
  b, t, n, kv, h = ATTENTION_B, ATTENTION_T, ATTENTION_HEADS, ATTENTION_KV_HEADS, ATTENTION_HEAD_DIM
  rows = sharding.BATCH_AXES
  heads, whole = PartitionSpec(rows, None, "tensor", None), PartitionSpec(rows, None, None, None)
  specs = (heads, whole, whole, PartitionSpec(rows, None), heads)
  shapes = ((b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t), (b, t, n, h))
  dtypes = (jnp.bfloat16,) * 3 + (jnp.int32, jnp.bfloat16)
  args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in zip(shapes, dtypes, specs)]

  def run(q, k, v, ids, ct):
    out, vjp = jax.vjp(lambda q, k, v: train_attention.segment_attention(q, k, v, ids, backend=backend), q, k, v)
    return out, vjp(ct)
  with jax.set_mesh(mesh):
    lowered = jax.jit(run).lower(*args)
  return lowered.as_text(), lowered.compile().memory_analysis().temp_size_in_bytes


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


def xla_flags(devices: int) -> str:
  """This process's XLA_FLAGS (tests/conftest.py) with `devices` fake CPU devices, for a process a test starts."""
  count = "--xla_force_host_platform_device_count"
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(count)]
  return " ".join([f"{count}={devices}", *flags])


def launch_train(workdir, base_cache, *flags, devices=None) -> subprocess.Popen:
  """`python -m launch.train` of the arithmetic debug member as a child process (stdout and stderr in one text pipe),
  its warm start cached in `base_cache`; `devices` fakes that many CPU devices (default: this process's 8)."""
  cmd = [sys.executable, "-m", "launch.train", "--config=configs/grpo_arith.py:debug", f"--workdir={workdir}",
         f"--config.sft.cache_dir={base_cache}", *flags]
  env = dict(os.environ)
  if devices is not None:
    env["XLA_FLAGS"] = xla_flags(devices)
  return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


# -- one RL update of a tiny model on a random batch (tests/test_update.py, test_noise_scale.py, test_packing.py) --

UPDATE_CFG = tiny_config(vocab_size=16, d_model=16, num_layers=1, head_dim=4, d_ff=32)
B, P, N = 8, 4, 5  # the update batch's rows, prompt tokens and response tokens
PPO = algo_config(algo="ppo", estimator="gae", critic=True)


def make_batch(seed=0) -> TrainBatch:
  """B rows of P prompt tokens (some left-padded) and up to N response tokens, with random log-probs, advantages,
  values and returns on the response."""
  rng = np.random.default_rng(seed)
  prompt = rng.integers(3, 16, (B, P))
  prompt_valid = np.ones((B, P), bool)
  prompt_valid[::3, :2] = False
  lengths = rng.integers(1, N + 1, B)
  mask = np.arange(N)[None] < lengths[:, None]
  tokens = np.concatenate([prompt, np.where(mask, rng.integers(3, 16, (B, N)), 0)], 1).astype(np.int32)
  loss_mask = np.concatenate([np.zeros((B, P), bool), mask], 1)
  valid = np.concatenate([prompt_valid, mask], 1)
  f = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  logp = f(-rng.uniform(0.5, 3.0, (B, P + N)))
  adv = f(rng.normal(size=(B, 1)) * np.ones((1, P + N)))
  return TrainBatch(jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(loss_mask), logp, logp, jnp.zeros_like(logp),
                    adv, f(rng.uniform(0, 1, (B, P + N))), f(rng.uniform(0, 1, (B, P + N))))


def setup(mesh, cfg: AlgoConfig, actor_tx=optax.sgd(0.05), critic_tx=optax.sgd(0.05)):
  """(ModelDefs, state) of the tiny update model on `mesh`, with a critic when `cfg` has one."""
  graphdef, params = sharding.create_sharded(lambda: Transformer(UPDATE_CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  state, critic_graphdef = dict(params=params, opt_state=actor_tx.init(params)), None
  if cfg.critic:
    critic_graphdef, state["critic"] = init_critic(UPDATE_CFG, params, cfg.share_backbone, cfg.critic_layers, mesh,
                                                   sharding.DEFAULT_RULES)
    # A non-zero head, so that values and their gradients are not trivially 0.
    head = state["critic"] if cfg.share_backbone else state["critic"]["head"]
    head["w"] = head["w"] + 0.1
    state["critic_opt_state"] = critic_tx.init(state["critic"])
  return ModelDefs(graphdef, actor_tx, critic_graphdef, critic_tx if cfg.critic else None), state


def one_step(mesh, num_micro, batch, cfg, kl_coef=0.0, train_actor=True, packing=None, noise_ids=None):
  """One `update` of a fresh `setup` on `batch`: (models, state before, state after, metrics), states as numpy."""
  models, state = setup(mesh, cfg)
  before = jax.tree.map(np.asarray, state)
  with jax.set_mesh(mesh):
    batch = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch)
    state, metrics = update(state, batch, jnp.float32(kl_coef), noise_ids, models=models, cfg=cfg, num_micro=num_micro,
                            train_actor=train_actor, packing=packing)
  return models, before, jax.tree.map(np.asarray, state), metrics


def loss_scale(models, params, batch, cfg, metrics):
  """The sum of |terms| of the update's loss and its policy part, the `scale` of their `assert_close`: the hand
  computation's (below; token-level ratio and no dual clip, so an estimate for GSPO's and dual-clip configs) plus
  vf_coef * the (non-negative) value loss."""
  policy = hand_loss(models, params, batch, cfg)[1]
  return dict(loss=policy + cfg.vf_coef * float(metrics.get("value_loss", 0.0)), policy_loss=policy)


def assert_metrics_close(metrics, want, scales, rtol=2e-5):
  """Two updates' metrics agree: the losses (sums that can cancel) to rtol of their terms' magnitudes (`scales`,
  from `loss_scale`), the other metrics (sums of non-negative terms, counts) to rtol of themselves."""
  for key in want:
    if key.startswith("noise_"):  # Estimates from micro-batches of other sizes.
      continue
    assert_close(metrics[key], want[key], rtol, scale=scales.get(key), err_msg=key)


def hand_loss(models, params, batch, cfg, ref_logp=None, kl_coef=0.0):
  """The documented loss in numpy, token by token (token-level ratio, no dual clip), and the sum of its terms'
  magnitudes, to which its float32 computation is accurate (the `scale` of its `assert_close`)."""
  logp, logits = sequence_logprobs(models.graphdef, params, batch.tokens_BxT, batch.valid_BxT)
  logp, old, sampler, adv, mask = map(np.asarray, (logp, batch.old_logp_BxT, batch.sampler_logp_BxT, batch.adv_BxT,
                                                    batch.loss_mask_BxT))
  ratio = np.exp(logp - old)
  pg = np.maximum(-ratio * adv, -np.clip(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high) * adv)
  if cfg.tis_cap:
    w = np.exp(old - sampler)
    pg = pg * (np.minimum(w, cfg.tis_cap) if cfg.tis_mode == "truncate" else np.where(w > cfg.tis_cap, 0.0, w))
  n = mask.sum(1, keepdims=True)
  if cfg.loss_agg == "token_mean":
    w = mask / mask.sum()
  else:  # 1 / (N_seq n_i), 1 / N_seq or 1 / (N_seq constant), with N_seq the sequences that have loss tokens
    per_seq = dict(seq_mean_token_mean=n.clip(1), seq_mean_token_sum=1.0, constant=cfg.loss_agg_constant)[cfg.loss_agg]
    w = mask / ((n > 0).sum() * per_seq)
  p = jax.nn.softmax(np.asarray(logits), -1)
  entropy = np.pad(-(p * np.log(p)).sum(-1)[:, :-1], ((0, 0), (1, 0)))
  terms = [w * pg, -cfg.entropy_coef * w * entropy]
  if ref_logp is not None:
    d = ref_logp - logp
    terms.append(kl_coef * w * (np.exp(d) - d - 1))
  return sum(t.sum() for t in terms), sum(np.abs(t).sum() for t in terms)
