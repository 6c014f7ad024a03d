"""The GRPO update step: micro-batching and device count leave the gradient unchanged; the step moves log-probs
in the direction of the advantage."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrl_batch import sharding
from jaxrl_batch.model import ModelConfig, Transformer
from jaxrl_batch.rl import grpo
from jaxrl_batch.rl.batch import sequence_logprobs
from jaxrl_batch.sampling import Rollout

CFG = ModelConfig(vocab_size=16, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64)
B, P, N = 8, 4, 5


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  prompt = rng.integers(3, 16, (B, P)).astype(np.int32)
  prompt_valid = np.ones((B, P), bool)
  prompt_valid[::3, :2] = False
  lengths = rng.integers(1, N + 1, B)
  mask = np.arange(N)[None] < lengths[:, None]
  tokens = np.where(mask, rng.integers(3, 16, (B, N)), 0).astype(np.int32)
  logp = np.where(mask, -rng.uniform(0.5, 3.0, (B, N)), 0.0).astype(np.float32)
  rollout = Rollout(jnp.asarray(tokens), jnp.asarray(logp), jnp.asarray(mask), jnp.asarray(lengths),
                    jnp.asarray(lengths == N))
  adv = rng.normal(size=B).astype(np.float32)
  return grpo.rollout_batch(jnp.asarray(prompt), jnp.asarray(prompt_valid), rollout, jnp.asarray(adv))


def one_step(mesh, num_micro, batch, lr=0.05):
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  tx = optax.sgd(lr)
  with jax.set_mesh(mesh):
    batch = jax.tree.map(lambda x: jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)), batch)
    new_params, _, metrics = grpo.update(jax.tree.map(jnp.copy, params), tx.init(params), batch, graphdef=graphdef,
                                         tx=tx, cfg=grpo.GRPOLossConfig(clip_eps=0.2), num_micro=num_micro)
  return graphdef, params, new_params, metrics


def test_micro_batches_and_devices_leave_the_update_unchanged():
  batch = make_batch()
  one = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  results = [one_step(one, 1, batch), one_step(one, 4, batch), one_step(sharding.make_mesh(2, 2, 2), 2, batch)]
  _, _, ref_params, ref_metrics = results[0]
  for _, _, params, metrics in results[1:]:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-6), ref_params, params)
    for key in ("loss", "grad_norm", "clip_frac", "entropy", "num_tokens"):
      np.testing.assert_allclose(metrics[key], ref_metrics[key], rtol=1e-5, err_msg=key)


def test_loss_equals_hand_computed_token_mean():
  batch = make_batch(1)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params, _, metrics = one_step(mesh, 1, batch)
  logp, _ = sequence_logprobs(graphdef, params, batch.tokens_BxT, batch.valid_BxT)
  logp, old, mask = map(np.asarray, (logp, batch.old_logp_BxT, batch.loss_mask_BxT))
  adv = np.asarray(batch.adv_B)[:, None]
  ratio = np.exp(logp - old)
  per_token = -np.minimum(ratio * adv, np.clip(ratio, 0.8, 1.2) * adv)
  assert metrics["num_tokens"] == mask.sum()
  np.testing.assert_allclose(metrics["loss"], (per_token * mask).sum() / mask.sum(), rtol=1e-5)


def test_update_raises_logprob_of_positive_advantage_sequences():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  batch = make_batch(2)
  on_policy, _ = sequence_logprobs(graphdef, params, batch.tokens_BxT, batch.valid_BxT)
  batch = batch._replace(old_logp_BxT=jnp.where(batch.loss_mask_BxT, on_policy, 0.0),
                         adv_B=jnp.array([1.0, -1.0] * (B // 2)))
  _, _, new_params, metrics = one_step(mesh, 1, batch, lr=0.02)
  assert metrics["clip_frac"] == 0.0 and metrics["logp_gap"] < 1e-6
  def seq_logp(p):
    logp, _ = sequence_logprobs(graphdef, p, batch.tokens_BxT, batch.valid_BxT)
    return np.asarray((logp * batch.loss_mask_BxT).sum(1))
  delta = seq_logp(new_params) - seq_logp(params)
  assert np.all(delta[0::2] > 0) and np.all(delta[1::2] < 0), delta


def test_kl_term_matches_hand_computed_k3_against_the_reference():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  _, ref_params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(7)), mesh, sharding.DEFAULT_RULES)
  batch = grpo.reference_logprobs(ref_params, make_batch(3), graphdef=graphdef, temperature=1.0)
  logp, _ = sequence_logprobs(graphdef, params, batch.tokens_BxT, batch.valid_BxT)
  ref, _ = sequence_logprobs(graphdef, ref_params, batch.tokens_BxT, batch.valid_BxT)
  mask = np.asarray(batch.loss_mask_BxT)
  np.testing.assert_allclose(np.asarray(batch.ref_logp_BxT), np.where(mask, ref, 0.0), atol=1e-6)
  d = np.asarray(ref) - np.asarray(logp)
  want_kl = ((np.exp(d) - d - 1) * mask).sum() / mask.sum()
  tx = optax.sgd(0.0)
  _, _, with_kl = grpo.update(jax.tree.map(jnp.copy, params), tx.init(params), batch, graphdef=graphdef, tx=tx,
                              cfg=grpo.GRPOLossConfig(kl_coef=0.5), num_micro=2)
  _, _, without = grpo.update(jax.tree.map(jnp.copy, params), tx.init(params), batch, graphdef=graphdef, tx=tx,
                              cfg=grpo.GRPOLossConfig(kl_coef=0.0), num_micro=2)
  assert want_kl > 0.01
  np.testing.assert_allclose(with_kl["kl"], want_kl, rtol=1e-4)
  np.testing.assert_allclose(with_kl["loss"], without["loss"] + 0.5 * want_kl, rtol=1e-4)
  assert without["kl"] == 0.0
