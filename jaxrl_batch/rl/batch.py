"""The token-aligned training batch shared by the RL update and supervised warm-up."""
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from jaxrl_batch.runtime import sharding


class TrainBatch(NamedTuple):
  """B sequences of T tokens: a left-padded prompt followed by a right-padded response.

  Per-token arrays are aligned with `tokens_BxT`: entry t refers to token t, scored from the logits at t - 1
  (entry 0 is never a loss token). Float arrays are 0 off the loss mask.

  tokens_BxT: int32 ids.
  valid_BxT: bool, not padding.
  loss_mask_BxT: bool, tokens that enter the loss (response tokens up to and including EOS).
  old_logp_BxT: float32 log-probs of the policy before this step's updates (the PPO ratio's denominator): the
    sampler's, or the trainer's recomputation (`rl.old_logp`).
  sampler_logp_BxT: float32 behaviour log-probs reported by the sampler.
  ref_logp_BxT: float32 log-probs under the frozen reference policy (zeros when there is no KL term).
  adv_BxT: float32 advantage of each token.
  returns_BxT: float32 value targets (PPO).
  old_values_BxT: float32 critic values before this step's updates (PPO; zeros without a critic).
  experts_BxTxLxK: for a mixture-of-experts model, the int16 experts the sampler routed each token to in each of
    the L MoE layers (-1 where it fed none: `sampling.Rollout.experts_BxTxLxK`): replayed when
    `model.routing_replay`, compared with the trainer's routing for `router_mismatch_frac`. None otherwise.
  positions_BxT, segment_ids_BxT: packed rows only (`rl.packing`): each token's position in its own sequence, and
    its sequence's id in the row (0 = padding). None for padded rows (one sequence each).
  """

  tokens_BxT: jax.Array
  valid_BxT: jax.Array
  loss_mask_BxT: jax.Array
  old_logp_BxT: jax.Array
  sampler_logp_BxT: jax.Array
  ref_logp_BxT: jax.Array
  adv_BxT: jax.Array
  returns_BxT: jax.Array
  old_values_BxT: jax.Array
  experts_BxTxLxK: jax.Array | None = None
  positions_BxT: jax.Array | None = None
  segment_ids_BxT: jax.Array | None = None


def split_micro_batches(tree, num_micro: int):
  """Reshapes every leaf (B, ...) -> (num_micro, B // num_micro, ...) for a scan over micro-batches: micro-batch i
  is rows [i B / n, (i + 1) B / n). Under a mesh each micro-batch's rows are laid out over the batch axes (one
  all-to-all of the batch), so that every device computes its share of every micro-batch rather than whole
  micro-batches of its own rows (the plain reshape's layout: each device then ran a whole micro-batch)."""
  mesh = jax.sharding.get_abstract_mesh()

  def split(x):
    rows = x.shape[0] // num_micro
    x = x.reshape(num_micro, rows, *x.shape[1:])
    axes = () if mesh.empty else sharding.dividing_axes(mesh, sharding.BATCH_AXES, rows)
    return jax.lax.with_sharding_constraint(x, P(None, axes, *([None] * (x.ndim - 2)))) if axes else x

  return jax.tree.map(split, tree)
