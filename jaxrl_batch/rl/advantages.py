"""Advantage estimators: GRPO, Dr.GRPO, RLOO, REINFORCE++ (and its group-baseline variant), GAE.

Rollouts of one prompt are contiguous: rollout i belongs to prompt i // group_size. Sequence-level estimators
return one advantage per rollout (adv_B); `estimate` broadcasts every estimator to response tokens (adv_BxT).
"""
import jax
import jax.numpy as jnp

from jaxrl_batch.rl.returns import discounted_returns, gae

ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_pp_baseline")


def _grouped(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """(B,) rewards -> (G, group_size) float32, checking the static shapes; a numpy array stays on the host (the
  collector's statistics), a jax array on the device."""
  if group_size < 2:
    raise ValueError(f"group_size must be >= 2 (rollouts per prompt), got {group_size}.")
  if rewards_B.ndim != 1:
    raise ValueError(f"rewards_B must be 1-D (one reward per rollout), got shape {rewards_B.shape}.")
  if rewards_B.shape[0] % group_size:
    raise ValueError(f"The number of rollouts {rewards_B.shape[0]} is not divisible by group_size "
                     f"{group_size}; sample group_size rollouts for every prompt.")
  return rewards_B.astype(jnp.float32).reshape(-1, group_size)


def _all_equal_G(rewards_GxK: jax.Array) -> jax.Array:
  """bool_G: the group's rewards are all exactly equal (zero spread)."""
  return rewards_GxK.max(axis=1) == rewards_GxK.min(axis=1)


def group_advantages(rewards_B: jax.Array, group_size: int, normalize_std: bool = True,
                     eps: float = 1e-6) -> jax.Array:
  """GRPO: A_i = r_i - mean(group), divided by (std(group) + eps) if `normalize_std` (Dr.GRPO: no std).

  The std is the population std (ddof=0). A group whose rewards are all exactly equal (`zero_std_groups`) gets
  advantage exactly 0.
  """
  rewards_GxK = _grouped(rewards_B, group_size)
  adv_GxK = rewards_GxK - rewards_GxK.mean(axis=1, keepdims=True)
  if normalize_std:
    adv_GxK = adv_GxK / (rewards_GxK.std(axis=1, keepdims=True) + eps)
  # The float32 mean of equal rewards can miss them by an ulp (0.9 x 7), and the std would scale that up to ~0.1.
  return jnp.where(_all_equal_G(rewards_GxK)[:, None], 0.0, adv_GxK).reshape(-1)


def rloo_advantages(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """RLOO (Ahmadian et al. 2024): A_i = r_i - mean of the other K - 1 rewards of its group = K/(K-1) (r_i - mean)."""
  k = group_size
  return group_advantages(rewards_B, k, normalize_std=False) * (k / (k - 1))


def zero_std_group_frac(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """Scalar fraction of groups whose rewards are all exactly equal (they give no learning signal)."""
  return zero_std_groups(rewards_B, group_size).mean(dtype=jnp.float32)


def zero_std_groups(rewards_B: jax.Array, group_size: int) -> jax.Array:
  """bool_G: the group's rewards are all exactly equal (the groups `group_advantages` gives advantage 0)."""
  return _all_equal_G(_grouped(rewards_B, group_size))


def whiten(x_BxT: jax.Array, mask_BxT: jax.Array, eps: float = 1e-8) -> jax.Array:
  """(x - mean) / (std + eps) over the masked entries of the whole batch; 0 off the mask."""
  m_BxT = mask_BxT.astype(jnp.float32)
  n = jnp.maximum(m_BxT.sum(), 1.0)
  mean = jnp.sum(x_BxT * m_BxT) / n
  std = jnp.sqrt(jnp.sum(((x_BxT - mean) * m_BxT) ** 2) / n)
  return (x_BxT - mean) / (std + eps) * m_BxT


def outcome_rewards(rewards_B: jax.Array, mask_BxT: jax.Array) -> jax.Array:
  """The sequence reward placed on each row's last response token: rewards_BxT (0 elsewhere)."""
  m_BxT = mask_BxT.astype(jnp.int32)
  last_B = jnp.argmax(jnp.cumsum(m_BxT, axis=1), axis=1)  # First index holding the row's full count.
  onehot_BxT = jax.nn.one_hot(last_B, m_BxT.shape[1]) * (m_BxT.sum(axis=1) > 0)[:, None]
  return onehot_BxT * jnp.asarray(rewards_B, jnp.float32)[:, None]


def estimate(estimator: str, rewards_B: jax.Array, mask_BxT: jax.Array, *, group_size: int,
             token_rewards_BxT: jax.Array | None = None, values_BxT: jax.Array | None = None, gamma: float = 1.0,
             lam: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """Advantages and returns per response token: (adv_BxT, returns_BxT), 0 off `mask_BxT`.

  rewards_B: the task reward of each rollout. token_rewards_BxT: extra per-token rewards (the KL-in-reward term
  -beta * k1), or None. Sequence-level estimators (grpo, drgrpo, rloo) use r_i + sum_t token_rewards as the
  sequence reward and broadcast A_i over its tokens; reinforce_pp(_baseline) and gae work per token, with the
  outcome reward on the last response token. returns_BxT is the discounted reward-to-go (gae: A + V).
  """
  mask_BxT = mask_BxT.astype(bool)
  extra_BxT = jnp.zeros(mask_BxT.shape) if token_rewards_BxT is None else token_rewards_BxT * mask_BxT
  rewards_B = jnp.asarray(rewards_B, jnp.float32)
  if estimator in ("grpo", "drgrpo", "rloo"):
    seq_B = rewards_B + extra_BxT.sum(axis=1)
    adv_B = (rloo_advantages(seq_B, group_size) if estimator == "rloo"
             else group_advantages(seq_B, group_size, normalize_std=estimator == "grpo"))
    return adv_B[:, None] * mask_BxT, discounted_returns(outcome_rewards(seq_B, mask_BxT), mask_BxT, gamma)
  if estimator in ("reinforce_pp", "reinforce_pp_baseline"):
    if estimator == "reinforce_pp_baseline":
      rewards_B = group_advantages(rewards_B, group_size, normalize_std=False)
    returns_BxT = discounted_returns(outcome_rewards(rewards_B, mask_BxT) + extra_BxT, mask_BxT, gamma)
    return whiten(returns_BxT, mask_BxT), returns_BxT
  if estimator == "gae":
    if values_BxT is None:
      raise ValueError("The gae estimator needs critic values (values_BxT); enable the critic (algo='ppo').")
    return gae(outcome_rewards(rewards_B, mask_BxT) + extra_BxT, values_BxT, mask_BxT, gamma, lam)
  raise ValueError(f"Unknown advantage estimator {estimator!r}; use one of {ESTIMATORS}.")
