"""Tests for GRPO group-relative advantages."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.rl import advantages, returns
from tests.close import assert_close


def test_normalized_advantages_use_population_std():
  # Group 0 [1, 0, 0, 1]: mean 0.5, population std 0.5 (sample std would be 0.577).
  # Group 1 [2, 2, 2, 2]: all equal -> advantage 0.
  rewards_B = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  adv_B = advantages.group_advantages(rewards_B, group_size=4)
  scale = 0.5 / (0.5 + 1e-6)
  assert_close(adv_B, [scale, -scale, -scale, scale, 0, 0, 0, 0], 1e-6)


def test_groups_are_contiguous():
  # Groups [3, 1] and [0, 4]: means 2 and 2, stds 1 and 2.
  adv_B = advantages.group_advantages(jnp.array([3.0, 1.0, 0.0, 4.0]), group_size=2, eps=0.0)
  assert_close(adv_B, [1.0, -1.0, -1.0, 1.0], 1e-6)


def test_unnormalized_advantages_subtract_group_mean():
  rewards_B = jnp.array([1, 0, 0, 1, 2, 2, 2, 5])  # ints are accepted
  adv_B = advantages.group_advantages(rewards_B, group_size=4, normalize_std=False)
  assert adv_B.dtype == jnp.float32
  assert_close(adv_B, [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25], 1e-6)


def test_jit_with_static_group_size():
  fn = jax.jit(advantages.group_advantages, static_argnames=("group_size", "normalize_std"))
  adv_B = fn(jnp.array([3.0, 1.0, 0.0, 4.0]), group_size=2, normalize_std=False)
  assert_close(adv_B, [1.0, -1.0, -2.0, 2.0], 1e-6)


def test_zero_std_group_frac():
  rewards_B = jnp.array([1.0, 1.0, 0.0, 1.0, 0.3, 0.3, 0.0, 0.0])
  assert float(advantages.zero_std_group_frac(rewards_B, group_size=2)) == 0.75


@pytest.mark.parametrize("rewards_B, group_size, match", [
    (jnp.zeros(6), 4, "6 is not divisible by group_size 4"),
    (jnp.zeros(6), 1, "group_size must be >= 2"),
    (jnp.zeros((2, 4)), 2, "rewards_B must be 1-D"),
])
def test_rejects_bad_shapes(rewards_B, group_size, match):
  with pytest.raises(ValueError, match=match):
    advantages.group_advantages(rewards_B, group_size)


def test_rloo_is_leave_one_out():
  # Group [1, 0, 0, 1]: r_0 - mean(0, 0, 1) = 2/3.
  adv_B = advantages.rloo_advantages(jnp.array([1.0, 0.0, 0.0, 1.0, 3.0, 3.0, 3.0, 3.0]), group_size=4)
  assert_close(adv_B, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0], 2e-6)


def test_outcome_reward_sits_on_the_last_response_token():
  mask = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], bool)
  np.testing.assert_array_equal(advantages.outcome_rewards(jnp.array([2.0, 5.0, -1.0]), mask),
                                [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 0, -1]])


def test_gae_hand_computed():
  # Row 0 (gamma 1, lambda 0.5), values 0.5, 0.6, 0.8 and reward 1 at the end:
  # deltas 0.1, 0.2, 0.2 -> A_3 = 0.2, A_2 = 0.2 + 0.5 * 0.2 = 0.3, A_1 = 0.1 + 0.5 * 0.3 = 0.25.
  # Row 1: the response ends at t = 2; the value 5 at t = 3 (padding) must not be bootstrapped.
  mask = jnp.array([[0, 1, 1, 1], [0, 1, 1, 0]], bool)
  rewards = advantages.outcome_rewards(jnp.array([1.0, 1.0]), mask)
  values = jnp.array([[0.0, 0.5, 0.6, 0.8], [0.0, 0.5, 0.6, 5.0]])
  adv, ret = returns.gae(rewards, values, mask, gamma=1.0, lam=0.5)
  # Row 1: delta_2 = 1 - 0.6 = 0.4, delta_1 = 0.6 - 0.5 = 0.1 -> A_1 = 0.1 + 0.5 * 0.4 = 0.3.
  assert_close(adv, [[0, 0.25, 0.3, 0.2], [0, 0.3, 0.4, 0]], 2e-6)
  assert_close(ret, [[0, 0.75, 0.9, 1.0], [0, 0.8, 1.0, 0]], 2e-6)


def test_gae_with_lambda_1_gives_discounted_returns():
  mask = jnp.array([[0, 1, 1, 1]], bool)
  rewards = advantages.outcome_rewards(jnp.array([1.0]), mask)
  values = jnp.array([[0.0, 0.5, 0.6, 0.8]])
  _, ret = returns.gae(rewards, values, mask, gamma=0.9, lam=1.0)
  assert_close(ret, [[0, 0.81, 0.9, 1.0]], 1e-6)
  assert_close(returns.discounted_returns(rewards, mask, 0.9), [[0, 0.81, 0.9, 1.0]], 1e-6)


def test_reinforce_pp_whitens_returns_over_the_batch():
  # Returns [[1, 1], [0]] over 3 tokens: mean 2/3, std sqrt(2)/3 -> (1 - 2/3) / (sqrt(2)/3) = 1/sqrt(2).
  mask = jnp.array([[0, 1, 1], [0, 1, 0]], bool)
  adv, ret = advantages.estimate("reinforce_pp", jnp.array([1.0, 0.0]), mask, group_size=1)
  assert_close(ret, [[0, 1, 1], [0, 0, 0]], 1e-7)
  assert_close(adv, [[0, 2**-0.5, 2**-0.5], [0, -(2**0.5), 0]], 1e-5)


def test_reinforce_pp_baseline_subtracts_the_group_mean_first():
  # Groups [1, 0] and [1, 1]: centred rewards 0.5, -0.5, 0, 0; one token each -> whitened by std sqrt(0.125).
  mask = jnp.array([[0, 1]] * 4, bool)
  adv, _ = advantages.estimate("reinforce_pp_baseline", jnp.array([1.0, 0.0, 1.0, 1.0]), mask, group_size=2)
  assert_close(adv[:, 1], np.array([0.5, -0.5, 0, 0]) / np.sqrt(0.125), 1e-5)


def test_sequence_estimators_broadcast_and_fold_in_token_rewards():
  mask = jnp.array([[0, 1, 1], [0, 1, 0], [1, 1, 1], [0, 1, 1]], bool)
  rewards = jnp.array([1.0, 0.0, 1.0, 1.0])
  kl_rewards = jnp.array([[9.0, -0.1, -0.1], [0, -0.3, 7.0], [0, 0, 0], [0, 0, 0]])  # Off-mask entries ignored.
  adv, _ = advantages.estimate("drgrpo", rewards, mask, group_size=2, token_rewards_BxT=kl_rewards)
  # Sequence rewards 0.8, -0.3 -> +-0.55; group 2 equal -> 0.
  assert_close(adv, [[0, 0.55, 0.55], [0, -0.55, 0], [0, 0, 0], [0, 0, 0]], 2e-5)
  adv, _ = advantages.estimate("grpo", rewards, mask, group_size=2)
  assert_close(adv[:2], [[0, 1, 1], [0, -1, 0]], 1e-4)


def test_gae_needs_values():
  with pytest.raises(ValueError, match="needs critic values"):
    advantages.estimate("gae", jnp.ones(2), jnp.ones((2, 3), bool), group_size=1)


_jit_estimate = jax.jit(advantages.estimate, static_argnames=("estimator", "group_size"))


@pytest.mark.parametrize("group_size", range(2, 9))
@pytest.mark.parametrize("reward", [0.1, 0.375, 0.7, 0.9])
def test_equal_rewards_give_exactly_zero_advantage(reward, group_size):
  # Group 0 all equal (their float32 mean can miss them by an ulp: 0.9 x 7); group 1 has spread.
  rewards_B = jnp.concatenate([jnp.full((group_size,), reward, jnp.float32), jnp.eye(group_size)[0]])
  mask_BxT = jnp.ones((2 * group_size, 3), bool)
  np.testing.assert_array_equal(advantages.zero_std_groups(rewards_B, group_size), [True, False])
  assert float(advantages.zero_std_group_frac(rewards_B, group_size)) == 0.5
  for estimator in advantages.GROUP_ESTIMATORS:
    for fn in (advantages.estimate, _jit_estimate):
      adv_BxT, returns_BxT = fn(estimator, rewards_B, mask_BxT, group_size=group_size)
      # reinforce_pp_baseline whitens over the batch after the group baseline: its group part is the return.
      group_BxT = returns_BxT if estimator == "reinforce_pp_baseline" else adv_BxT
      assert np.all(np.asarray(group_BxT[:group_size]) == 0), estimator
      assert np.all(np.asarray(group_BxT[group_size:]) != 0), estimator


def test_groups_with_spread_match_a_float64_reference():
  rewards_GxK = np.random.default_rng(0).choice([0.0, 0.1, 0.375, 0.7, 0.9, 1.0], size=(64, 7))
  rewards_GxK[:, 0] = 0.5  # Every group has spread.
  centred_GxK = rewards_GxK - rewards_GxK.mean(axis=1, keepdims=True)
  rewards_B = jnp.asarray(rewards_GxK.reshape(-1), jnp.float32)
  want = centred_GxK / (rewards_GxK.std(axis=1, keepdims=True) + 1e-6)
  assert_close(advantages.group_advantages(rewards_B, 7), want.reshape(-1), 2e-5)
  assert_close(advantages.rloo_advantages(rewards_B, 7), (centred_GxK * 7 / 6).reshape(-1), 2e-5)
