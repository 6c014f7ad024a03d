"""Tests for the GRPO loss terms."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.rl import losses

LN2 = math.log(2.0)


def test_token_logprobs_float32():
  # softmax([0, ln2, ln3]) = [1, 2, 3] / 6.
  logits_BxTxV = jnp.log(jnp.array([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])).astype(jnp.bfloat16)
  logp_BxT = losses.token_logprobs(logits_BxTxV, jnp.array([[2, 0]]))
  assert logp_BxT.dtype == jnp.float32
  np.testing.assert_allclose(logp_BxT, [[math.log(3 / 6), math.log(1 / 6)]], rtol=1e-2)


def test_entropy_from_logits():
  logits_BxTxV = jnp.log(jnp.array([[[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]]))
  expected = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))
  np.testing.assert_allclose(losses.entropy_from_logits(logits_BxTxV), [[expected, math.log(3)]],
                             rtol=1e-6)


def test_kl_k3():
  # d = ref - logp: k3 = e^d - d - 1.
  kl_BxT = losses.kl_k3(jnp.array([[0.0, 0.0, 0.0]]), jnp.array([[LN2, 0.0, -LN2]]))
  np.testing.assert_allclose(kl_BxT, [[1 - LN2, 0.0, LN2 - 0.5]], rtol=1e-6, atol=1e-7)


def test_clipped_policy_loss_and_indicator():
  # eps = 0.2. A = +1: ratio 1.5 -> clipped at 1.2; ratio 0.9 -> unclipped.
  # A = -2: ratio 0.5 -> clip 0.8 gives -1.6 < -1.0, clipped; ratio 1.5 -> -3.0 < -2.4, unclipped.
  ratio_BxT = jnp.array([[1.5, 0.9], [0.5, 1.5]])
  old_logp_BxT = jnp.array([[-1.0, -2.0], [-0.5, -1.5]])
  loss_BxT, clipped_BxT = losses.clipped_policy_loss(
      old_logp_BxT + jnp.log(ratio_BxT), old_logp_BxT, jnp.array([1.0, -2.0]), clip_eps=0.2)
  np.testing.assert_allclose(loss_BxT, [[-1.2, -0.9], [1.6, 3.0]], rtol=1e-6)
  np.testing.assert_array_equal(clipped_BxT, [[1.0, 0.0], [1.0, 0.0]])


def _two_by_three():
  """Hand example: ratios, KL offsets d = ref - logp, one masked token with extreme values."""
  ratio_BxT = np.array([[1.5, 0.9, 2.0], [0.5, 1.5, 1.0]])
  d_BxT = np.array([[LN2, 0.0, 5.0], [-LN2, 0.0, LN2]])
  old_logp_BxT = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.3, -2.2]])
  logp_BxT = old_logp_BxT + np.log(ratio_BxT)
  mask_BxT = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
  return (jnp.asarray(logp_BxT, jnp.float32), jnp.asarray(old_logp_BxT, jnp.float32),
          jnp.asarray(logp_BxT + d_BxT, jnp.float32), jnp.array([1.0, -2.0]), jnp.asarray(mask_BxT))


def test_grpo_loss_hand_computed():
  logp, old_logp, ref_logp, adv_B, mask = _two_by_three()
  # Valid per-token losses: -1.2, -0.9 | 1.6, 3.0, 2.0 -> 4.5 / 5 tokens = 0.9.
  # Valid k3: (1 - ln2) + 0 + (ln2 - 0.5) + 0 + (1 - ln2) = 1.5 - ln2 -> / 5.
  # Clipped: tokens (0,0) and (1,0) -> 2 / 5. Ratios: (1.5 + 0.9 + 0.5 + 1.5 + 1.0) / 5 = 1.08.
  loss, aux = losses.grpo_loss(logp, old_logp, ref_logp, adv_B, mask, num_tokens=5, clip_eps=0.2,
                               kl_coef=0.1)
  kl = (1.5 - LN2) / 5
  np.testing.assert_allclose(aux["policy_loss"], 0.9, rtol=1e-5)
  np.testing.assert_allclose(aux["kl"], kl, rtol=1e-5)
  np.testing.assert_allclose(aux["clip_frac"], 0.4, rtol=1e-6)
  np.testing.assert_allclose(aux["ratio_mean"], 1.08, rtol=1e-5)
  np.testing.assert_allclose(loss, 0.9 + 0.1 * kl, rtol=1e-5)


def test_grpo_loss_skips_kl_at_zero_coef():
  logp, old_logp, _, adv_B, mask = _two_by_three()
  loss, aux = losses.grpo_loss(logp, old_logp, None, adv_B, mask, num_tokens=5, clip_eps=0.2,
                               kl_coef=0.0)
  np.testing.assert_allclose(loss, 0.9, rtol=1e-5)
  assert float(aux["kl"]) == 0.0


def test_grpo_loss_needs_ref_for_kl():
  logp, old_logp, _, adv_B, mask = _two_by_three()
  with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp_BxT"):
    losses.grpo_loss(logp, old_logp, None, adv_B, mask, num_tokens=5, clip_eps=0.2, kl_coef=0.1)


def test_micro_batches_sum_to_full_batch():
  rng = np.random.default_rng(0)
  feat_BxT = jnp.asarray(rng.uniform(-1, 1, (8, 4)), jnp.float32)
  old_logp_BxT = jnp.asarray(rng.uniform(-3, -0.1, (8, 4)), jnp.float32)
  ref_logp_BxT = jnp.asarray(rng.uniform(-3, -0.1, (8, 4)), jnp.float32)
  adv_B = jnp.asarray(rng.normal(size=8), jnp.float32)
  lengths_B = np.array([4, 1, 3, 2, 4, 4, 1, 2])
  mask_BxT = jnp.asarray(np.arange(4)[None, :] < lengths_B[:, None], jnp.float32)
  num_tokens = int(lengths_B.sum())  # 21, global over the mini-batch

  def loss_fn(theta, rows, n):
    logp_BxT = old_logp_BxT[rows] + theta * feat_BxT[rows]
    return losses.grpo_loss(logp_BxT, old_logp_BxT[rows], ref_logp_BxT[rows], adv_B[rows],
                            mask_BxT[rows], n, clip_eps=0.2, kl_coef=0.1)[0]

  theta = 0.4  # ratios up to e^0.4: some tokens are clipped
  full, full_grad = jax.value_and_grad(loss_fn)(theta, slice(0, 8), num_tokens)
  micro = [jax.value_and_grad(loss_fn)(theta, slice(i, i + 2), num_tokens) for i in range(0, 8, 2)]
  np.testing.assert_allclose(sum(v for v, _ in micro), full, atol=1e-6)
  np.testing.assert_allclose(sum(g for _, g in micro), full_grad, atol=1e-6)
  # Normalizing each micro-batch by its own token count would not add up.
  local = [loss_fn(theta, slice(i, i + 2), mask_BxT[i:i + 2].sum()) for i in range(0, 8, 2)]
  assert abs(float(sum(local)) / 4 - float(full)) > 1e-3
