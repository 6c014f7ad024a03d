"""Tests for GRPO group-relative advantages."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.rl import advantages


def test_normalized_advantages_use_population_std():
  # Group 0 [1, 0, 0, 1]: mean 0.5, population std 0.5 (sample std would be 0.577).
  # Group 1 [2, 2, 2, 2]: all equal -> advantage 0.
  rewards_B = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  adv_B = advantages.group_advantages(rewards_B, group_size=4)
  scale = 0.5 / (0.5 + 1e-6)
  np.testing.assert_allclose(adv_B, [scale, -scale, -scale, scale, 0, 0, 0, 0], rtol=1e-6)


def test_groups_are_contiguous():
  # Groups [3, 1] and [0, 4]: means 2 and 2, stds 1 and 2.
  adv_B = advantages.group_advantages(jnp.array([3.0, 1.0, 0.0, 4.0]), group_size=2, eps=0.0)
  np.testing.assert_allclose(adv_B, [1.0, -1.0, -1.0, 1.0], rtol=1e-6)


def test_unnormalized_advantages_subtract_group_mean():
  rewards_B = jnp.array([1, 0, 0, 1, 2, 2, 2, 5])  # ints are accepted
  adv_B = advantages.group_advantages(rewards_B, group_size=4, normalize_std=False)
  assert adv_B.dtype == jnp.float32
  np.testing.assert_allclose(adv_B, [0.5, -0.5, -0.5, 0.5, -0.75, -0.75, -0.75, 2.25], rtol=1e-6)


def test_jit_with_static_group_size():
  fn = jax.jit(advantages.group_advantages, static_argnames=("group_size", "normalize_std"))
  adv_B = fn(jnp.array([3.0, 1.0, 0.0, 4.0]), group_size=2, normalize_std=False)
  np.testing.assert_allclose(adv_B, [1.0, -1.0, -2.0, 2.0], rtol=1e-6)


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
