"""The actor/critic update: micro-batching and device count leave it unchanged; its loss equals hand computations;
a step moves log-probs in the direction of the advantage; a frozen actor stays frozen."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.base import algo_config
from jaxrl_batch.model import Transformer
from jaxrl_batch.model.logprobs import sequence_logprobs
from jaxrl_batch.rl.batch import split_micro_batches
from jaxrl_batch.rl.forward import ModelDefs, logprobs_and_values, reference_cfg
from jaxrl_batch.runtime import sharding
from tests.close import assert_close, assert_trees_close
from tests.helpers import (B, N, ONE_DEVICE, P, PPO, UPDATE_CFG, assert_metrics_close, hand_loss,
                           loss_scale, make_batch, one_step, setup)


@pytest.mark.parametrize("cfg", [
    algo_config(),
    algo_config(loss_agg="seq_mean_token_mean", clip_high=0.28, dual_clip=3.0, entropy_coef=0.01,
                ratio_level="sequence", old_logp="trainer", tis_cap=1.5),
    dataclasses.replace(PPO, loss_agg="constant", loss_agg_constant=9.0),
    dataclasses.replace(PPO, share_backbone=True, vf_coef=0.5, loss_agg="seq_mean_token_sum"),
], ids=["grpo", "all_policy_knobs", "ppo_separate", "ppo_shared"])
@pytest.mark.slow
def test_micro_batches_and_devices_leave_the_update_unchanged(cfg):
  """One device and the whole mini-batch vs. 8 devices (data, fsdp, tensor = 2, 2, 2) and 2 micro-batches."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  batch = make_batch()
  rng = np.random.default_rng(9)
  batch = batch._replace(sampler_logp_BxT=batch.old_logp_BxT + jnp.asarray(rng.normal(0, 0.2, (B, P + N)),
                                                                           jnp.float32) * batch.loss_mask_BxT)
  models, before, ref_state, ref_metrics = one_step(sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE), 1, batch, cfg)
  _, _, state, metrics = one_step(sharding.make_mesh(2, 2, 2), 2, batch, cfg)
  assert ref_metrics["grad_norm"] > 0 and ("kl" in ref_metrics) == cfg.use_kl
  assert_trees_close(state, ref_state, 5e-6)
  assert_metrics_close(metrics, ref_metrics, loss_scale(models, before["params"], batch, cfg, ref_metrics))


TIS = algo_config(loss_agg="seq_mean_token_mean", entropy_coef=0.05, old_logp="trainer", tis_cap=1.5)


@pytest.mark.parametrize("cfg", [algo_config(), TIS, dataclasses.replace(TIS, tis_mode="mask")],
                         ids=["plain", "truncated_is", "decoupled_mask"])
@pytest.mark.slow
def test_loss_equals_hand_computation(cfg):
  batch = make_batch(1)
  rng = np.random.default_rng(5)
  # Distinct behaviour log-probs, so that the ratio and the TIS weight are not 1.
  batch = batch._replace(old_logp_BxT=batch.old_logp_BxT + jnp.asarray(rng.normal(0, 0.3, (B, P + N)), jnp.float32)
                         * batch.loss_mask_BxT)
  models, before, _, metrics = one_step(sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE), 2, batch, cfg)
  want, scale = hand_loss(models, before["params"], batch, cfg)
  assert_close(metrics["loss"], want, 1e-5, scale=scale)
  assert metrics["num_tokens"] == np.asarray(batch.loss_mask_BxT).sum()
  if cfg.tis_cap:  # some weights past the cap, so the two modes differ
    mask = np.asarray(batch.loss_mask_BxT)
    w = np.exp(np.asarray(batch.old_logp_BxT - batch.sampler_logp_BxT))
    assert_close(metrics["tis_capped_frac"], ((w > cfg.tis_cap) & mask).sum() / mask.sum(), 1e-6)
    assert metrics["tis_capped_frac"] > 0


@pytest.mark.slow
def test_kl_in_the_loss_matches_hand_computed_k3():
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  cfg = algo_config(kl_coef=0.5)
  models, state = setup(mesh, cfg)
  _, ref_params = sharding.create_sharded(lambda: Transformer(UPDATE_CFG, nnx.Rngs(7)), mesh, sharding.DEFAULT_RULES)
  batch = make_batch(3)
  ref, _ = logprobs_and_values(ref_params, None, batch.tokens_BxT, batch.valid_BxT, batch.loss_mask_BxT,
                               models=ModelDefs(models.graphdef), cfg=reference_cfg(cfg))
  batch = batch._replace(ref_logp_BxT=ref)
  want, scale = hand_loss(models, state["params"], batch, cfg, np.asarray(ref), kl_coef=0.5)
  _, _, _, with_kl = one_step(mesh, 2, batch, cfg, kl_coef=0.5)
  assert_close(with_kl["loss"], want, 1e-5, scale=scale)
  assert with_kl["kl"] > 0.01
  assert_close(with_kl["loss"], with_kl["policy_loss"] + 0.5 * with_kl["kl"], 1e-5, scale=scale)


@pytest.mark.slow
def test_update_raises_logprob_of_positive_advantage_sequences():
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  models, state = setup(mesh, algo_config())
  batch = make_batch(2)
  on_policy, _ = sequence_logprobs(models.graphdef, state["params"], batch.tokens_BxT, batch.valid_BxT)
  on_policy = jnp.where(batch.loss_mask_BxT, on_policy, 0.0)
  sign_B = jnp.array([1.0, -1.0] * (B // 2))
  batch = batch._replace(old_logp_BxT=on_policy, sampler_logp_BxT=on_policy,
                         adv_BxT=sign_B[:, None] * batch.loss_mask_BxT)
  _, before, after, metrics = one_step(mesh, 1, batch, algo_config())
  # On-policy: the update's log-probs are these to rounding (another program), a few ulps of |logp| (about 3 here).
  logp_size = float(jnp.abs(on_policy).sum() / batch.loss_mask_BxT.sum())
  assert metrics["clip_frac_low"] == metrics["clip_frac_high"] == 0.0 and metrics["logp_gap_mean"] < 1e-5 * logp_size

  def seq_logp(p):
    logp, _ = sequence_logprobs(models.graphdef, p, batch.tokens_BxT, batch.valid_BxT)
    return np.asarray((logp * batch.loss_mask_BxT).sum(1))

  delta = seq_logp(after["params"]) - seq_logp(before["params"])
  assert np.all(delta[0::2] > 0) and np.all(delta[1::2] < 0), delta


def test_frozen_actor_trains_only_the_critic():
  _, before, after, metrics = one_step(sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE), 2, make_batch(4), PPO,
                                       train_actor=False)
  jax.tree.map(np.testing.assert_array_equal, before["params"], after["params"])
  assert "grad_norm" not in metrics and metrics["critic_grad_norm"] > 0 and metrics["value_loss"] > 0
  moved = jax.tree.leaves(jax.tree.map(lambda a, b: np.abs(a - b).max(), before["critic"], after["critic"]))
  assert max(moved) > 0


def test_each_micro_batch_is_spread_over_the_batch_axes():
  """Micro-batch i is rows [8i, 8i + 8) and each of the 4 batch shards holds 2 of its rows, so that every device
  computes its share of every micro-batch (a plain reshape left whole micro-batches on half the devices)."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  mesh = sharding.make_mesh(2, 2, 2)  # data x fsdp: the batch split 4 ways
  rows = jax.device_put(jnp.arange(16 * 3).reshape(16, 3), sharding.batch_sharding(mesh))
  with jax.set_mesh(mesh):
    micro = jax.jit(lambda x: split_micro_batches(x, 2))(rows)
  np.testing.assert_array_equal(micro, np.arange(16 * 3).reshape(2, 8, 3))
  assert micro.sharding.shard_shape(micro.shape) == (2, 2, 3)


def test_activations_are_constrained_to_the_batch_layout():
  """`sharding.constrain_rows` lays the leading dimension over the batch axes that divide it (the others left to the
  partitioner), and leaves rows that no batch axis divides as they are."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  mesh = sharding.make_mesh(2, 2, 2)  # data x fsdp: the batch split 4 ways
  with jax.set_mesh(mesh):
    rows = jax.jit(sharding.constrain_rows)(jax.device_put(jnp.ones((8, 6)), sharding.replicated(mesh)))
    odd = jax.jit(sharding.constrain_rows)(jax.device_put(jnp.ones((3, 6)), sharding.replicated(mesh)))
  assert rows.sharding.shard_shape(rows.shape) == (2, 6)
  assert odd.sharding.shard_shape(odd.shape) == (3, 6)
