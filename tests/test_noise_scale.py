"""Gradient noise scale: the estimators against hand-computed values and against simulated gradients with a known
inter- and intra-prompt noise, the EMA ratios, and the update's signed gradients against their definition."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.base import algo_config
from jaxrl_batch.rl import losses
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.noise_scale import NoiseScale, from_micro_batches, from_signed_gradients, signs
from jaxrl_batch.rl.packing import Packing
from jaxrl_batch.rl.update import Weights, _micro_loss
from jaxrl_batch.runtime import sharding
from tests.test_update import ONE, assert_close_to_sum, make_batch, one_step, setup


def test_micro_batch_estimates_invert_the_expected_norms():
  # |G|^2 = 4, tr = 64, 32 rollouts of weight 1/32 in 4 micro-batches: E|g|^2 = 4 + 64/32 = 6 and
  # E sum_i |g_i|^2 = 4 * 4 / 16 + 64 / 32 = 3.
  out = from_micro_batches(6.0, 3.0, 4 / 16, 1.0, 32 / 32**2)
  assert float(out["noise_signal_sq"]) == pytest.approx(4.0) and float(out["noise_trace"]) == pytest.approx(64.0)
  assert math.isnan(float(from_micro_batches(6.0, 6.0, 1.0, 1.0, 1 / 32)["noise_signal_sq"]))  # one micro-batch


def simulate(rng, draws, prompts, group, dim, signal, inter, intra, u_B):
  """(draws, 3): squared norms of the three signed sums of per-rollout gradients x_b = G + a_p + e_b (tr Cov a =
  inter, tr Cov e = intra), drawn `draws` times."""
  x = (signal + rng.normal(0, math.sqrt(inter / dim), (draws, prompts, 1, dim))
       + rng.normal(0, math.sqrt(intra / dim), (draws, prompts, group, dim))).reshape(draws, prompts * group, dim)
  rows = np.arange(prompts * group)
  s = np.concatenate([np.ones((len(rows), 1)), np.asarray(signs(rows // group, rows % group))], axis=1)
  return np.sum(np.einsum("bk,nbd->nkd", s * u_B[:, None], x) ** 2, axis=-1)


@pytest.mark.parametrize("group", [4, 5])
def test_signed_estimates_are_unbiased_for_unequal_weights(group):
  """Known |G|^2 = 0.5, A = 20, C = 60; rollout weights drawn unequal (token-mean weights of unequal lengths); an
  odd group size leaves the sample signs unbalanced, which the exact coefficients absorb."""
  rng, prompts, dim = np.random.default_rng(0), 6, 50
  signal = np.full(dim, 0.1)
  u_B = rng.uniform(0.5, 2.0, prompts * group)
  u_B /= u_B.sum()
  rows = jnp.arange(prompts * group)
  sq_Nx3 = simulate(rng, 4000, prompts, group, dim, signal, 20.0, 60.0, u_B)
  draws = jax.vmap(lambda sq: from_signed_gradients(sq, jnp.asarray(u_B), rows // group, rows % group))(sq_Nx3)
  mean = {k: float(np.mean(v)) for k, v in draws.items()}
  assert mean["noise_signal_sq"] == pytest.approx(0.5, rel=0.15)
  assert mean["noise_inter_trace"] == pytest.approx(20.0, rel=0.1)
  assert mean["noise_intra_trace"] == pytest.approx(60.0, rel=0.05)


def test_split_is_singular_with_one_sample_per_prompt():
  rows = jnp.arange(8)
  out = from_signed_gradients(jnp.ones(3), jnp.full(8, 1 / 8), rows, jnp.zeros(8, jnp.int32))
  assert all(math.isnan(float(v)) for v in out.values())


def test_ema_ratios_skip_missing_estimates_and_compose_the_split():
  ns = NoiseScale(decay=0.5)
  assert ns.update(dict(noise_signal_sq=float("nan"), noise_trace=1.0), 4) == dict(noise_scale=None)
  assert ns.update(dict(noise_signal_sq=2.0, noise_trace=8.0), 4) == dict(noise_scale=4.0)
  assert ns.update(dict(noise_signal_sq=float("nan"), noise_trace=8.0), 4) == dict(noise_scale=4.0)
  split = NoiseScale(decay=0.5).update(dict(noise_signal_sq=2.0, noise_inter_trace=6.0, noise_intra_trace=10.0), 4)
  assert split == dict(noise_scale=4 * 3.0 + 5.0, noise_inter=3.0, noise_intra=5.0)


def test_ema_ratio_converges_to_b_simple_on_noisy_micro_batch_gradients():
  rng = np.random.default_rng(0)
  g_true, dim, small, big, steps = np.full(50, 0.1), 50, 4, 16, 3000  # |G|^2 = 0.5, tr = 50: B_simple = 100
  samples = g_true + rng.normal(size=(steps, big, dim))
  parts = samples.reshape(steps, big // small, small, dim).sum(2) / big  # each micro-batch's share of the gradient
  out = from_micro_batches(np.sum(parts.sum(1) ** 2, -1), np.sum(parts**2, (1, 2)), 4 * (1 / 4) ** 2, 1.0, 1 / big)
  estimate = NoiseScale(decay=0.99)
  for signal_sq, trace in zip(*map(np.asarray, (out["noise_signal_sq"], out["noise_trace"]))):
    value = estimate.update(dict(noise_signal_sq=float(signal_sq), noise_trace=float(trace)), 1)["noise_scale"]
  assert value == pytest.approx(100.0, rel=0.25)


def test_noise_split_needs_groups():
  with pytest.raises(ValueError, match="noise_split.*group_size >= 2"):
    algo_config(estimator="reinforce_pp", noise_split=True).check(1)


def long_batch(rows=32, prompt=16, response=142, seed=0) -> TrainBatch:
  """Rollouts as long as the reasoning workload's (~160 tokens) with random lengths and advantages."""
  rng = np.random.default_rng(seed)
  mask = np.arange(response)[None] < rng.integers(1, response + 1, rows)[:, None]
  tokens = np.concatenate([rng.integers(3, 16, (rows, prompt)), np.where(mask, rng.integers(3, 16, mask.shape), 0)], 1)
  loss_mask = np.concatenate([np.zeros((rows, prompt), bool), mask], 1)
  f = lambda x: jnp.asarray(np.where(loss_mask, x, 0.0), jnp.float32)
  logp = f(-rng.uniform(0.5, 3.0, loss_mask.shape))
  valid = loss_mask | (np.arange(prompt + response) < prompt)
  return TrainBatch(jnp.asarray(tokens, jnp.int32), jnp.asarray(valid), jnp.asarray(loss_mask), logp, logp,
                    jnp.zeros_like(logp), f(rng.normal(size=(rows, 1)) * np.ones((1, prompt + response))), logp, logp)


@pytest.mark.parametrize("case", ["padded", "packed", "one_long_micro_batch"])
def test_update_signed_gradients_match_their_definition(case):
  """The split's squared norms, through the update's backward passes over micro-batches (padded, packed, or one
  micro-batch of 32 long rows, where jit(vmap(vjp)) miscomputed them on XLA:CPU), equal those of jax.grad of the
  loss with the signed weights on the whole batch; and the step itself is the one the update takes without it."""
  cfg = algo_config(loss_agg="seq_mean_token_mean", entropy_coef=0.01)
  batch, num_micro, packing = make_batch(2), 2, None
  if case == "packed":
    packing = Packing(rows=2, length=18)
  elif case == "one_long_micro_batch":
    batch, num_micro = long_batch(), 1
  rows = jnp.arange(batch.tokens_BxT.shape[0])
  group, mesh = 4, sharding.make_mesh(1, 1, 1, devices=ONE)
  ids = jnp.stack([rows // group, rows % group], axis=1)
  models, state = setup(mesh, cfg)
  w = losses.token_weights(batch.loss_mask_BxT, cfg.loss_agg)
  tw = losses.token_weights(batch.loss_mask_BxT, "token_mean")
  s_Bx3 = np.concatenate([np.ones((len(rows), 1)), np.asarray(signs(rows // group, rows % group))], axis=1)
  grad = jax.jit(jax.grad(lambda p, s_B: _micro_loss((p, None), batch, Weights(w * s_B[:, None], tw), 0.0, models,
                                                      cfg, True)[0]))
  sq = [float(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad(state["params"], jnp.asarray(s_Bx3[:, k])))))
        for k in range(3)]
  estimate = lambda sq_3: from_signed_gradients(jnp.asarray(sq_3, jnp.float32), w.sum(1), rows // group, rows % group)
  want = estimate(sq)
  # The estimates are solve(coef, sq): differences of the squared norms, which can cancel to near 0 (|G|^2 here),
  # so each is compared to its terms, sum_j |coef^-1_kj| sq_j (coef^-1's columns: the estimates of unit vectors).
  inverse_3x3 = np.stack([[float(v) for v in estimate(e).values()] for e in np.eye(3)], axis=1)
  terms = dict(zip(want, np.abs(inverse_3x3) @ np.abs(sq)))
  _, _, plain, _ = one_step(mesh, num_micro, batch, cfg, packing=packing)
  _, _, split, metrics = one_step(mesh, num_micro, batch, cfg, packing=packing, noise_ids=ids)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), plain, split)
  for key, value in want.items():
    assert_close_to_sum(metrics[key], value, terms[key], err_msg=key)
  assert np.isfinite(float(want["noise_intra_trace"])) and float(want["noise_intra_trace"]) != 0
