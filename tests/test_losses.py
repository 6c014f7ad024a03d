"""Loss terms against hand computations: clipping variants, KL estimators, aggregations, value loss."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.model.logprobs import entropy_from_logits, token_logprobs
from jaxrl_batch.rl import losses
from tests.close import assert_close

LN2 = math.log(2.0)


def test_token_logprobs_float32():
  # softmax([0, ln2, ln3]) = [1, 2, 3] / 6.
  logits_BxTxV = jnp.log(jnp.array([[[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]])).astype(jnp.bfloat16)
  logp_BxT = token_logprobs(logits_BxTxV, jnp.array([[2, 0]]))
  assert logp_BxT.dtype == jnp.float32
  assert_close(logp_BxT, [[math.log(3 / 6), math.log(1 / 6)]], 1e-2)


def test_entropy_from_logits():
  logits_BxTxV = jnp.log(jnp.array([[[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]]]))
  expected = -(1 / 6 * math.log(1 / 6) + 2 / 6 * math.log(2 / 6) + 3 / 6 * math.log(3 / 6))
  assert_close(entropy_from_logits(logits_BxTxV), [[expected, math.log(3)]], 1e-6)


def test_kl_estimators():
  # r = logp - ref: k1 = r, k2 = r^2 / 2, k3 = e^-r + r - 1.
  logp, ref = jnp.array([[0.0, 0.0, 0.0]]), jnp.array([[LN2, 0.0, -LN2]])
  assert_close(losses.kl_penalty(logp, ref, "k1"), [[-LN2, 0.0, LN2]], 1e-6)
  assert_close(losses.kl_penalty(logp, ref, "k2"), [[LN2**2 / 2, 0.0, LN2**2 / 2]], 1e-6)
  assert_close(losses.kl_penalty(logp, ref, "k3"), [[1 - LN2, 0.0, LN2 - 0.5]], 2e-6)
  with pytest.raises(ValueError, match="k4"):
    losses.kl_penalty(logp, ref, "k4")


def test_symmetric_clip_and_indicators():
  # eps = 0.2. A = +1: ratio 1.5 -> clipped at 1.2 (high); ratio 0.9 -> unclipped.
  # A = -2: ratio 0.5 -> clip 0.8 gives 1.6 > 1.0, clipped (low); ratio 1.5 -> loss 3.0 > 2.4, unclipped.
  log_ratio = jnp.log(jnp.array([[1.5, 0.9], [0.5, 1.5]]))
  adv = jnp.array([[1.0, 1.0], [-2.0, -2.0]])
  loss, low, high = losses.policy_loss(log_ratio, adv, 0.2, 0.2)
  assert_close(loss, [[-1.2, -0.9], [1.6, 3.0]], 1e-6)
  np.testing.assert_array_equal(low, [[0, 0], [1, 0]])
  np.testing.assert_array_equal(high, [[1, 0], [0, 0]])


def test_clip_higher_is_asymmetric():
  # clip_low 0.2, clip_high 0.28: A = +1 at ratio 1.25 is inside [0.8, 1.28]; at 1.5 it is clipped to 1.28.
  loss, _, high = losses.policy_loss(jnp.log(jnp.array([[1.25, 1.5, 0.7]])), jnp.array([[1.0, 1.0, -1.0]]),
                                     0.2, 0.28)
  assert_close(loss, [[-1.25, -1.28, 0.8]], 1e-6)
  np.testing.assert_array_equal(high, [[0, 1, 0]])


def test_dual_clip_caps_negative_advantage_loss():
  # A = -1, ratio 5: standard loss max(5, 1.2) = 5, dual clip c = 3 caps it at 3. A = +1 is untouched.
  log_ratio = jnp.log(jnp.array([[5.0, 2.0, 5.0]]))
  adv = jnp.array([[-1.0, -1.0, 1.0]])
  loss, _, _ = losses.policy_loss(log_ratio, adv, 0.2, 0.2, dual_clip=3.0)
  assert_close(loss, [[3.0, 2.0, -1.2]], 1e-6)
  g = jax.grad(lambda lr: losses.policy_loss(lr, adv, 0.2, 0.2, dual_clip=3.0)[0][0, 0])(log_ratio)
  assert float(g[0, 0]) == 0.0  # The capped token gives no gradient.


def test_sequence_level_ratio_is_the_mean_log_ratio():
  logp = jnp.array([[-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0]])
  old = jnp.array([[-1.5, -1.5, -3.3], [-0.5, 0.0, 0.0]])
  mask = jnp.array([[1, 1, 0], [1, 0, 0]], bool)
  assert_close(losses.log_ratio(logp, old, mask, "token"), [[0.5, -0.5, 0], [-0.5, 0, 0]], 5e-6)
  # Row 0: (0.5 - 0.5) / 2 = 0 on every token; row 1: -0.5.
  assert_close(losses.log_ratio(logp, old, mask, "sequence"), [[0, 0, 0], [-0.5, -0.5, -0.5]], 5e-6)


MASK = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]], bool)  # n_i = 2, 4, 0, 1


@pytest.mark.parametrize("aggregation, expected_row_weights", [
    ("token_mean", [1 / 7, 1 / 7, 0, 1 / 7]),
    ("seq_mean_token_mean", [1 / 6, 1 / 12, 0, 1 / 3]),  # 3 sequences with tokens; 1 / (3 n_i).
    ("seq_mean_token_sum", [1 / 3, 1 / 3, 0, 1 / 3]),
    ("constant", [1 / 30, 1 / 30, 0, 1 / 30]),  # 1 / (3 sequences x constant 10).
])
def test_token_weights(aggregation, expected_row_weights):
  w = losses.token_weights(MASK, aggregation, constant=10.0)
  assert_close(w, np.asarray(expected_row_weights)[:, None] * MASK, 1e-6)


def test_weighted_sum_ignores_nan_off_the_mask():
  x = jnp.array([[1.0, jnp.nan], [2.0, jnp.inf]])
  w = losses.token_weights(jnp.array([[1, 0], [1, 0]], bool), "token_mean")
  assert float(losses.weighted_sum(x, w)) == 1.5


def test_unknown_aggregation():
  with pytest.raises(ValueError, match="seq_sum"):
    losses.token_weights(MASK, "seq_sum")


def test_value_loss_clipped_and_unclipped():
  # V_old = 0, R = 1. V = 0.5 (inside clip 0.2): clipped branch 0.2 -> (0.8)^2 > (0.5)^2, so 0.5 * 0.64.
  # V = 1.5: unclipped (0.5)^2, clipped (0.2 - 1)^2 = 0.64 -> 0.32. V = 0.1: both 0.81 -> 0.405.
  v, old, ret = jnp.array([[0.5, 1.5, 0.1]]), jnp.zeros((1, 3)), jnp.ones((1, 3))
  assert_close(losses.value_loss(v, old, ret, 0.2), [[0.32, 0.32, 0.405]], 1e-6)
  assert_close(losses.value_loss(v, old, ret, 0.0), [[0.125, 0.125, 0.405]], 1e-6)


def test_explained_variance():
  ret = jnp.array([[1.0, 2.0, 3.0, 99.0]])
  mask = jnp.array([[1, 1, 1, 0]], bool)
  assert_close(losses.explained_variance(ret, ret, mask), 1.0, 1e-7)
  # V = mean(R) everywhere: Var(R - V) = Var(R) -> 0.
  assert_close(losses.explained_variance(jnp.full((1, 4), 2.0), ret, mask), 0.0, 1e-6, scale=1.0)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "constant"])
def test_micro_batches_sum_to_full_batch(aggregation):
  rng = np.random.default_rng(0)
  feat_BxT = jnp.asarray(rng.uniform(-1, 1, (8, 4)), jnp.float32)
  old_logp_BxT = jnp.asarray(rng.uniform(-3, -0.1, (8, 4)), jnp.float32)
  ref_logp_BxT = jnp.asarray(rng.uniform(-3, -0.1, (8, 4)), jnp.float32)
  adv_BxT = jnp.asarray(rng.normal(size=(8, 1)) * np.ones((1, 4)), jnp.float32)
  lengths_B = np.array([4, 1, 3, 2, 4, 4, 1, 2])
  mask_BxT = jnp.asarray(np.arange(4)[None, :] < lengths_B[:, None])
  w_BxT = losses.token_weights(mask_BxT, aggregation, constant=4.0)  # Global, before splitting.

  def loss_fn(theta, rows, w):
    logp_BxT = old_logp_BxT[rows] + theta * feat_BxT[rows]
    pg, _, _ = losses.policy_loss(logp_BxT - old_logp_BxT[rows], adv_BxT[rows], 0.2, 0.28, dual_clip=3.0)
    kl = losses.kl_penalty(logp_BxT, ref_logp_BxT[rows], "k3")
    return losses.weighted_sum(pg + 0.1 * kl, w[rows] if w is w_BxT else w)

  theta = 0.4  # ratios up to e^0.4: some tokens are clipped
  full, full_grad = jax.value_and_grad(loss_fn)(theta, slice(0, 8), w_BxT)
  micro = [jax.value_and_grad(loss_fn)(theta, slice(i, i + 2), w_BxT) for i in range(0, 8, 2)]
  assert_close(sum(v for v, _ in micro), full, 1e-6)
  assert_close(sum(g for _, g in micro), full_grad, 5e-6)
  if aggregation == "token_mean":  # Token counts differ between micro-batches: local counts would not add up.
    local = [loss_fn(theta, slice(i, i + 2), losses.token_weights(mask_BxT[i:i + 2], aggregation))
             for i in range(0, 8, 2)]
    assert abs(float(sum(local)) / 4 - float(full)) > 1e-3
