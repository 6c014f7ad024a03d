"""Gradient noise scale: both estimators against a reference written apart from the module (plain numpy: the
expected squared norms of the documented model, E|sum_{b in i} s_b u_b x_b|^2 = |G|^2 (sum s u)^2 +
A sum_p (sum_{b in p, i} s u)^2 + C sum u^2), fed exact expectations (known answers) and Monte Carlo gradients
x_b = G + a_p + e_b, over the configurations a user reaches (whole groups, shuffled mini-batches that split groups,
micro-batches not a multiple of the group size, packed micro-batches, unequal weights); the EMA ratios; and the
update's norms and estimates against their definition."""
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.base import algo_config
from jaxrl_batch.rl import losses
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl import noise_scale
from jaxrl_batch.rl.noise_scale import (NoiseScale, from_micro_batches, from_signed_gradients,
                                        from_split_micro_batches, signs)
from jaxrl_batch.rl.objective import LossWeights
from jaxrl_batch.rl.packing import Packing
from jaxrl_batch.rl.update import micro_loss
from jaxrl_batch.runtime import sharding
from tests.close import assert_close, assert_trees_close
from tests.helpers import ONE_DEVICE, make_batch, one_step, setup


def coefficients(u_B, prompt_B, rows):
  """(|G|^2, A, C) coefficients of E|sum_{b in rows} u_b x_b|^2, by a loop over the prompts."""
  u_B, prompt_B = np.asarray(u_B, np.float64)[rows], np.asarray(prompt_B)[rows]
  per_prompt = [u_B[prompt_B == p].sum() for p in np.unique(prompt_B)]
  return np.array([u_B.sum()**2, sum(x**2 for x in per_prompt), (u_B**2).sum()])


def expected_norms(theta, u_B, prompt_B, micro_B, num_micro):
  """(E|g|^2, E|g_i|^2 per micro-batch, U_i per micro-batch, the mini-batch's per-rollout trace A S / W + C)."""
  u_B, micro_B = np.asarray(u_B, np.float64), np.asarray(micro_B)
  full = coefficients(u_B, prompt_B, np.arange(len(u_B)))
  micro = [coefficients(u_B, prompt_B, micro_B == i) for i in range(num_micro)]
  trace = theta[1] * full[1] / full[2] + theta[2]
  return full @ theta, np.array([c @ theta for c in micro]), np.array([u_B[micro_B == i].sum() for i in
                                                                        range(num_micro)]), trace


def reference_signal(grad_sq, micro_sq, u_B, prompt_B, micro_B):
  """|G|^2 by least squares (float64) over the equations of |g|^2 - sum_i |g_i|^2 and of each |g_i|^2."""
  num_micro = len(micro_sq)
  full = coefficients(u_B, prompt_B, np.arange(len(u_B)))
  micro = np.stack([coefficients(u_B, prompt_B, np.asarray(micro_B) == i) for i in range(num_micro)])
  coef = np.concatenate([[full - micro.sum(0)], micro])
  coef[0, 2] = 0.0
  return np.linalg.lstsq(coef, np.concatenate([[grad_sq - np.sum(micro_sq)], micro_sq]), rcond=None)[0][0]


def estimate(grad_sq, micro_sq, micro_u, u_B, prompt_B=None, micro_B=None):
  """`from_split_micro_batches`, or without prompt ids (each row its own prompt) `from_micro_batches`."""
  f32 = lambda x: jnp.asarray(x, jnp.float32)
  if prompt_B is None:
    out = from_micro_batches(f32(grad_sq), f32(np.sum(micro_sq)), f32(np.sum(np.square(micro_u))), f32(np.sum(u_B)),
                             f32(np.sum(np.square(u_B))))
  else:
    out = from_split_micro_batches(f32(grad_sq), f32(micro_sq), f32(micro_u), f32(u_B),
                                   jnp.asarray(prompt_B, jnp.int32), jnp.asarray(micro_B, jnp.int32))
  return float(out["noise_signal_sq"]), float(out["noise_trace"])


def layout(case, rng):
  """(u_B, prompt_B, micro_B, num_micro) of a mini-batch in configuration `case`."""
  if case == "whole_groups":  # 32 rows in group order, groups of 4, 4 micro-batches of 8
    rows, group, num_micro = np.arange(32), 4, 4
  elif case == "mini_batches_shuffled":  # the issue's: 64 of 128 rows (G = 8), in shuffled order, 2 micro-batches
    rows, group, num_micro = rng.permutation(128)[:64], 8, 2
  elif case == "mini_batches_sorted":  # the learner's order (each mini-batch's rows sorted), 4 micro-batches
    rows, group, num_micro = np.sort(rng.permutation(128)[:64]), 8, 4
  elif case == "mini_batches_over_group_size":  # 8 mini-batches of a batch of 64 (groups of 4): prompt ids >= rows
    rows, group, num_micro = np.sort(rng.permutation(64)[:8]), 4, 2
  elif case == "micro_not_multiple_of_group":  # 48 rows in group order, groups of 6, 3 micro-batches of 16
    rows, group, num_micro = np.arange(48), 6, 3
  else:  # packed: rows placed by length into micro-batches of unequal sizes
    rows, group, num_micro = np.arange(40), 5, 4
  u_B = rng.uniform(0.2, 2.0, len(rows)) if case in ("packed", "mini_batches_sorted") else np.ones(len(rows))
  micro_B = np.arange(len(rows)) // (len(rows) // num_micro)
  if case == "packed":
    micro_B = np.minimum(np.argsort(np.argsort(-u_B, kind="stable")) // 7, num_micro - 1)
  return u_B / u_B.sum(), rows // group, micro_B, num_micro


CASES = ["whole_groups", "mini_batches_shuffled", "mini_batches_sorted", "mini_batches_over_group_size",
         "micro_not_multiple_of_group", "packed"]


@pytest.mark.parametrize("case", CASES)
def test_micro_batch_estimate_is_exact_on_expected_norms(case):
  """Known answers: the expected norms of (|G|^2, A, C) = (1, 16, 500) give back |G|^2 and the per-rollout trace
  A * sum_p U_p^2 / sum_b u_b^2 + C of the mini-batch's own (partial) groups. The issue's case (64 shuffled rows
  of 128, G = 8, 2 micro-batches) came back from the whole-groups formula as |G|^2 ~ 1.9."""
  theta = np.array([1.0, 16.0, 500.0])
  u_B, prompt_B, micro_B, num_micro = layout(case, np.random.default_rng(3))
  grad_sq, micro_sq, micro_u, trace = expected_norms(theta, u_B, prompt_B, micro_B, num_micro)
  signal_sq, got_trace = estimate(grad_sq, micro_sq, micro_u, u_B, prompt_B, micro_B)
  assert signal_sq == pytest.approx(1.0, rel=2e-3) and got_trace == pytest.approx(trace, rel=1e-4)
  if case == "whole_groups":  # Without prompt ids every row is its own prompt: the whole-groups formula.
    assert estimate(grad_sq, micro_sq, micro_u, u_B) == (signal_sq, got_trace)
  if case == "mini_batches_shuffled":
    assert estimate(grad_sq, micro_sq, micro_u, u_B)[0] > 1.5  # what ignoring the split groups gives


def test_micro_batch_estimate_is_nan_where_not_identifiable():
  u_B, prompt_B = np.full(16, 1 / 16), np.arange(16) // 4
  one = estimate(2.0, [2.0], [1.0], u_B, prompt_B, np.zeros(16))
  assert all(math.isnan(v) for v in one)
  # Two micro-batches, each holding half of every group with equal weights: the A and |G|^2 coefficients of all
  # three equations are proportional, so |G|^2 cannot be told from A.
  halves = estimate(2.0, [0.6, 0.6], [0.5, 0.5], u_B, prompt_B, np.arange(16) % 2)
  assert math.isnan(halves[0])


def simulate_gradients(rng, draws, u_B, prompt_B, dim, theta):
  """(draws, B, dim) per-rollout gradients x_b = G + a_p + e_b: |G|^2, tr Cov a_p = A, tr Cov e_b = C."""
  prompts = np.unique(prompt_B, return_inverse=True)[1]
  signal = np.full(dim, math.sqrt(theta[0] / dim))
  shared = rng.normal(0, math.sqrt(theta[1] / dim), (draws, prompts.max() + 1, dim))[:, prompts]
  return signal + shared + rng.normal(0, math.sqrt(theta[2] / dim), (draws, len(u_B), dim))


@pytest.mark.parametrize("case", ["mini_batches_sorted", "micro_not_multiple_of_group", "packed"])
def test_micro_batch_estimate_is_unbiased_on_simulated_gradients(case):
  """Monte Carlo: 2,000 draws of gradients with known (|G|^2, A, C); the micro-batch gradients g_i and g summed as
  the update sums them; the mean estimates within 4 standard errors of |G|^2 and the mini-batch's trace."""
  rng, theta = np.random.default_rng(4), np.array([1.0, 16.0, 500.0])
  u_B, prompt_B, micro_B, num_micro = layout(case, rng)
  x = simulate_gradients(rng, 2000, u_B, prompt_B, 200, theta)
  g_i = np.stack([np.einsum("b,nbd->nd", u_B * (micro_B == i), x) for i in range(num_micro)], axis=1)
  micro_u = np.array([u_B[micro_B == i].sum() for i in range(num_micro)], np.float32)
  grad_sq, micro_sq = np.sum(g_i.sum(1)**2, -1), np.sum(g_i**2, -1)
  estimates = jax.vmap(lambda g, m: from_split_micro_batches(g, m, micro_u, jnp.asarray(u_B, jnp.float32),
                                                              jnp.asarray(prompt_B), jnp.asarray(micro_B)))
  out = estimates(jnp.asarray(grad_sq, jnp.float32), jnp.asarray(micro_sq, jnp.float32))
  trace = expected_norms(theta, u_B, prompt_B, micro_B, num_micro)[3]
  for key, want in (("noise_signal_sq", 1.0), ("noise_trace", trace)):
    draws = np.asarray(out[key], np.float64)
    assert abs(draws.mean() - want) < 4 * draws.std() / math.sqrt(len(draws)), (key, draws.mean(), want)


def test_signed_estimate_is_exact_for_prompt_ids_past_the_rows():
  """The issue's case: rl.mini_batches > group_size gives a mini-batch prompt ids numbered over the whole batch,
  which the per-prompt sums must keep: (|G|^2, A, C) = (1.3, 2.5, 9.0) came back as (1.3, 4.64, 9.11)."""
  theta = np.array([1.3, 2.5, 9.0])
  rows = np.array([132, 133, 135, 160, 161, 162, 208, 209, 210, 211, 244, 245, 247, 280, 281, 283])  # of 288 rows
  prompt_B, sample_B = rows // 4, rows % 4
  u_B = np.random.default_rng(6).uniform(0.5, 2.0, 16)
  s_Bx3 = np.stack([np.ones(16), (-1.0)**sample_B, (-1.0)**prompt_B], axis=1)
  sq_3 = np.array([coefficients(s_Bx3[:, k] * u_B, prompt_B, np.arange(16)) @ theta for k in range(3)])
  out = from_signed_gradients(jnp.asarray(sq_3, jnp.float32), jnp.asarray(u_B, jnp.float32), jnp.asarray(prompt_B),
                              jnp.asarray(sample_B))
  got = [float(out[k]) for k in ("noise_signal_sq", "noise_inter_trace", "noise_intra_trace")]
  assert_close(got, theta, 1e-3)


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


def test_row_fields_follow_the_mode_and_are_none_without_an_estimate():
  """A frozen actor's step carries no estimate: each field of its mode None; a step's estimates go to the EMAs."""
  assert NoiseScale().row(dict(loss=0.5), 4, split=False) == dict(noise_scale=None)
  assert NoiseScale().row(dict(loss=0.5), 4, split=True) == dict(noise_scale=None, noise_inter=None, noise_intra=None)
  fetched = dict(loss=0.5, grad_norm=1.0, noise_signal_sq=2.0, noise_inter_trace=6.0, noise_intra_trace=10.0)
  assert NoiseScale(decay=0.5).row(fetched, 4, split=True) == dict(noise_scale=17.0, noise_inter=3.0, noise_intra=5.0)


def test_the_estimator_follows_the_config_and_the_ids():
  """Ids where micro-batches may split groups (`needs_ids`), and the estimate the update then makes."""
  cfg, ids = algo_config(), jnp.zeros((8, 2), jnp.int32)
  split = dataclasses.replace(cfg, noise_split=True)
  assert not noise_scale.needs_ids(cfg, 4, 32, 4, None)  # micro-batches of 8 rows: whole groups of 4
  assert noise_scale.needs_ids(cfg, 4, 32, 16, None)  # micro-batches of 2 rows split the groups
  assert noise_scale.needs_ids(cfg, 4, 32, 4, Packing(2, 18))
  assert noise_scale.needs_ids(dataclasses.replace(cfg, mini_batches=2), 4, 32, 4, None)
  assert noise_scale.needs_ids(split, 4, 32, 4, None)
  kinds = [noise_scale.estimator(c, i, True).kind for c, i in ((cfg, None), (cfg, ids), (split, ids))]
  assert kinds == [noise_scale.WHOLE_GROUPS, noise_scale.SPLIT_GROUPS, noise_scale.SIGNED]
  assert noise_scale.estimator(split, ids, False).kind is None  # the actor frozen: no estimate
  with pytest.raises(ValueError, match="noise_split needs each row's prompt id"):
    noise_scale.estimator(split, None, True)


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
@pytest.mark.slow
def test_update_signed_gradients_match_their_definition(case):
  """The split's squared norms, through the update's backward passes over micro-batches (padded, packed, or one
  micro-batch of 32 long rows, where jit(vmap(vjp)) miscomputed them on XLA:CPU), equal those of jax.grad of the
  loss with the signed weights on the whole batch, and its estimates the reference's solve of them, with prompt ids
  numbered past the rows (a mini-batch of a larger batch); the step itself is the one the update takes without it."""
  cfg = algo_config(loss_agg="seq_mean_token_mean", entropy_coef=0.01)
  batch, num_micro, packing = make_batch(2), 2, None
  if case == "packed":
    packing = Packing(rows=2, length=18)
  elif case == "one_long_micro_batch":
    batch, num_micro = long_batch(), 1
  rows = np.arange(batch.tokens_BxT.shape[0])
  group, mesh = 4, sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)
  prompt_B, sample_B = rows // group + 2 * len(rows), rows % group
  models, state = setup(mesh, cfg)
  w = losses.token_weights(batch.loss_mask_BxT, cfg.loss_agg)
  tw = losses.token_weights(batch.loss_mask_BxT, "token_mean")
  s_Bx3 = np.stack([np.ones(len(rows)), (-1.0)**sample_B, (-1.0)**prompt_B], axis=1)
  grad = jax.jit(jax.grad(lambda p, s_B: micro_loss((p, None), batch, LossWeights(w * s_B[:, None], tw), 0.0, models,
                                                     cfg, True)[0]))
  sq = [float(sum(jnp.sum(g**2) for g in jax.tree.leaves(grad(state["params"], jnp.asarray(s_Bx3[:, k])))))
        for k in range(3)]
  u_B = np.asarray(w.sum(1), np.float64)
  inverse_3x3 = np.linalg.inv(np.stack([coefficients(s_Bx3[:, k] * u_B, prompt_B, rows) for k in range(3)]))
  want = dict(zip(("noise_signal_sq", "noise_inter_trace", "noise_intra_trace"), inverse_3x3 @ sq))
  # The estimates are differences of the squared norms, which can cancel to near 0 (|G|^2 here), so each is
  # compared to its terms, sum_j |coef^-1_kj| sq_j.
  terms = dict(zip(want, np.abs(inverse_3x3) @ np.abs(sq)))
  _, _, plain, _ = one_step(mesh, num_micro, batch, cfg, packing=packing)
  ids = jnp.asarray(np.stack([prompt_B, sample_B], axis=1), jnp.int32)
  _, _, split, metrics = one_step(mesh, num_micro, batch, dataclasses.replace(cfg, noise_split=True),
                                  packing=packing, noise_ids=ids)
  assert_trees_close(split, plain, 2e-6)
  for key, value in want.items():
    assert_close(metrics[key], value, 2e-5, scale=terms[key], err_msg=key)
  assert np.isfinite(want["noise_intra_trace"]) and want["noise_intra_trace"] != 0


@pytest.mark.slow
def test_update_micro_batch_estimate_matches_its_definition():
  """End to end, micro-batches that split groups (groups of 3 in 2 micro-batches of 4 rows, prompt ids numbered
  past the rows): the update's estimates equal the reference's least squares over the micro-batch gradients' norms
  computed apart (jax.grad of each micro-batch's loss under the mini-batch's weights)."""
  cfg = algo_config(loss_agg="seq_mean_token_mean")
  batch, mesh, rows = make_batch(2), sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE), np.arange(8)
  prompt_B = rows // 3 + 20
  models, state = setup(mesh, cfg)
  w = losses.token_weights(batch.loss_mask_BxT, cfg.loss_agg)
  tw = losses.token_weights(batch.loss_mask_BxT, "token_mean")
  micro_B = rows // 4
  part = lambda x, i: jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, 4 * i, 4), x)  # one program for both
  grad = jax.jit(jax.grad(lambda p, i: micro_loss((p, None), part(batch, i), part(LossWeights(w, tw), i), 0.0,
                                                  models, cfg, True)[0]))
  g_i = [np.concatenate([np.ravel(g) for g in jax.tree.leaves(grad(state["params"], i))]).astype(np.float64)
         for i in range(2)]
  micro_sq, grad_sq = np.array([g @ g for g in g_i]), (g_i[0] + g_i[1]) @ (g_i[0] + g_i[1])
  u_B = np.asarray(w.sum(1), np.float64)
  signal_sq = reference_signal(grad_sq, micro_sq, u_B, prompt_B, micro_B)
  unit = [reference_signal(*np.eye(3)[k, :1], np.eye(3)[k, 1:], u_B, prompt_B, micro_B) for k in range(3)]
  scale = np.abs(unit) @ np.abs(np.concatenate([[grad_sq], micro_sq]))
  ids = jnp.asarray(np.stack([prompt_B, rows % 3], axis=1), jnp.int32)
  _, _, _, metrics = one_step(mesh, 2, batch, cfg, noise_ids=ids)
  assert_close(metrics["noise_signal_sq"], signal_sq, 2e-5, scale=scale)
  trace = (grad_sq - signal_sq * u_B.sum()**2) / (u_B**2).sum()
  assert_close(metrics["noise_trace"], trace, 2e-5, scale=scale * u_B.sum()**2 / (u_B**2).sum())
  _, _, _, whole = one_step(mesh, 2, batch, cfg)  # without ids: groups taken as whole, another estimate
  assert abs(float(whole["noise_signal_sq"]) - signal_sq) > 10 * 2e-5 * scale
