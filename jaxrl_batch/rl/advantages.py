"""GRPO group-relative advantages.

Rollouts of one prompt are contiguous: rollout i belongs to prompt i // group_size, so a batch of B
rollouts holds G = B / group_size groups.
"""
import jax
import jax.numpy as jnp


def _grouped(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """(B,) rewards -> (G, group_size) float32, checking the static shapes."""
  if group_size < 2:
    raise ValueError(f"group_size must be >= 2 (rollouts per prompt), got {group_size}.")
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D (one reward per rollout), got shape {rewards_B.shape}.")
  if rewards_B.shape[0] % group_size:
    raise ValueError(f"The number of rollouts {rewards_B.shape[0]} is not divisible by group_size "
                     f"{group_size}; sample group_size rollouts for every prompt.")
  return jnp.asarray(rewards_B, jnp.float32).reshape(-1, group_size)


def group_advantages(rewards_B: jax.Array, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
  """A_i = r_i - mean(group), divided by (std(group) + eps) if `normalize_std`. Returns adv_B float32.

  The std is the population std (ddof=0) of the group's rewards. A group whose rewards are all equal
  gets advantage 0 for every rollout.
  """
  rewards_GxK = _grouped(rewards_B, group_size)
  adv_GxK = rewards_GxK - rewards_GxK.mean(axis=1, keepdims=True)
  if normalize_std:
    adv_GxK = adv_GxK / (rewards_GxK.std(axis=1, keepdims=True) + eps)
  return adv_GxK.reshape(-1)


def zero_std_group_frac(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """Scalar fraction of groups whose rewards are all exactly equal (they give no learning signal)."""
  rewards_GxK = _grouped(rewards_B, group_size)
  constant_G = rewards_GxK.max(axis=1) == rewards_GxK.min(axis=1)
  return constant_G.mean(dtype=jnp.float32)
