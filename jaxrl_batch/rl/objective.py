"""The loss of a mini-batch, read like the papers (PPO, GRPO and its aggregations, truncated importance sampling):

  L = sum_t w_t (pg_t tis_t - entropy_coef H_t + kl_coef kl_t) + router_coef L_aux + vf_coef sum_t w_t vl_t

  pg_t  = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)  (capped at -dual_clip A_t for A_t < 0), with
          r_t = pi / pi_old per token, or per sequence (GSPO, rl.ratio_level) (`losses.policy_loss`);
  tis_t = pi_old / pi_sampler truncated at rl.tis_cap, or 0 past it with rl.tis_mode='mask'; 1 when the cap is 0;
  kl_t  = the rl.kl_estimator of KL(pi || pi_ref), in the loss when rl.kl_in='loss';
  H_t   = the policy's entropy; L_aux = the MoE load-balancing loss; vl_t = the clipped value loss (PPO).
w_t are the configured aggregation's weights (`losses.token_weights`, counts over the whole mini-batch, so that
micro-batch losses sum to the mini-batch's). Logged means use token-mean weights, whatever the aggregation.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.rl import losses
from jaxrl_batch.rl import routing as routing_lib
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.forward import Outputs


class LossWeights(NamedTuple):
  """Per-token loss weights: w_t of the configured aggregation, the token mean for logged means, and with
  rl.noise_split w_t times the two signs of the token's rollout (`noise_scale.Estimator.weights`)."""
  loss_BxT: jax.Array
  token_BxT: jax.Array
  signed_BxTx2: jax.Array | None = None


class Terms(NamedTuple):
  """The loss's per-token terms (None where they are not in it) and the load-balancing loss."""
  policy_BxT: jax.Array | None  # pg_t tis_t
  entropy_BxT: jax.Array | None
  kl_BxT: jax.Array | None
  value_BxT: jax.Array | None
  router_aux: jax.Array | None


def objective(terms: Terms, w_BxT, kl_coef, cfg: AlgoConfig) -> tuple[jax.Array, dict]:
  """(L, dict(policy_loss, value_loss) where present) of the module's formula."""
  wsum = lambda x_BxT: losses.weighted_sum(x_BxT, w_BxT)
  loss, parts = jnp.zeros((), jnp.float32), {}
  if terms.policy_BxT is not None:
    parts["policy_loss"] = wsum(terms.policy_BxT)
    loss = parts["policy_loss"] - cfg.entropy_coef * wsum(terms.entropy_BxT)
    if terms.kl_BxT is not None:
      loss = loss + kl_coef * wsum(terms.kl_BxT)
    if terms.router_aux is not None:
      loss = loss + cfg.router_aux_loss_coef * terms.router_aux
  if terms.value_BxT is not None:
    parts["value_loss"] = wsum(terms.value_BxT)
    loss = loss + cfg.vf_coef * parts["value_loss"]
  return loss, parts


def terms_and_diagnostics(out: Outputs, micro: TrainBatch, token_BxT, cfg: AlgoConfig,
                          num_micro) -> tuple[Terms, dict]:
  """The loss's per-token terms of the forward `out` on `micro`, and the logged diagnostics (token means under
  `token_BxT`: entropy, kl, clip fractions, ratio_mean, logp_gap_mean, tis_capped_frac; the router's sums)."""
  value_BxT = None
  if cfg.critic:
    value_BxT = losses.value_loss(out.values_BxT, micro.old_values_BxT, micro.returns_BxT, cfg.vf_clip)
  if out.logp_BxT is None:
    return Terms(None, None, None, value_BxT, None), {}
  tmean = lambda x_BxT: losses.weighted_sum(jax.lax.stop_gradient(x_BxT), token_BxT)
  log_ratio_BxT = losses.log_ratio(out.logp_BxT, micro.old_logp_BxT, micro.loss_mask_BxT, cfg.ratio_level,
                                   micro.segment_ids_BxT)
  pg_BxT, low_BxT, high_BxT = losses.policy_loss(log_ratio_BxT, micro.adv_BxT, cfg.clip_low, cfg.clip_high,
                                                 cfg.dual_clip)
  aux = {}
  if cfg.tis_cap > 0:
    tis_BxT, capped_BxT = losses.behaviour_weight(micro.old_logp_BxT, micro.sampler_logp_BxT, cfg.tis_cap,
                                                  cfg.tis_mode)
    pg_BxT = pg_BxT * tis_BxT
    aux["tis_capped_frac"] = tmean(capped_BxT)
  entropy_BxT = out.entropy_BxT if cfg.entropy_coef > 0 else jax.lax.stop_gradient(out.entropy_BxT)
  kl_BxT = None
  if cfg.use_kl:
    kl_BxT = losses.kl_penalty(out.logp_BxT, micro.ref_logp_BxT, cfg.kl_estimator)
    aux["kl"] = tmean(kl_BxT)
  aux.update(entropy=tmean(entropy_BxT), clip_frac_low=tmean(low_BxT), clip_frac_high=tmean(high_BxT),
             ratio_mean=tmean(jnp.exp(log_ratio_BxT)),
             logp_gap_mean=tmean(jnp.abs(jax.lax.stop_gradient(out.logp_BxT) - micro.sampler_logp_BxT)))
  router_aux = None
  if out.routings:
    aux.update(routing_lib.micro_batch_terms(out.routings, micro.valid_BxT, micro.experts_BxTxLxK, num_micro))
    if cfg.router_aux_loss_coef > 0:
      router_aux = aux["router_aux_loss"]
    aux["router_aux_loss"] = jax.lax.stop_gradient(aux["router_aux_loss"])
  return Terms(pg_BxT, entropy_BxT, kl_BxT if cfg.kl_in == "loss" else None, value_BxT, router_aux), aux
