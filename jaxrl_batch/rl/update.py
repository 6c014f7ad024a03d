"""One optimizer step of the actor (and critic) on a mini-batch, gradients accumulated over micro-batches.

The loss of a mini-batch is
  sum_t w_t * [ pg_t * tis_t + kl_coef * kl_t (KL in the loss) - entropy_coef * H_t ] + vf_coef * sum_t w_t * vl_t
with w from `losses.token_weights` (the configured aggregation, counts taken over the whole mini-batch), pg the
clipped surrogate, tis the importance weight pi_trainer / pi_sampler truncated at the cap or, rl.tis_mode='mask',
zero past it (`losses.behaviour_weight`; 1 when rl.tis_cap = 0) and vl the clipped value loss (PPO). Logged scalars
use token-mean weights, whatever the aggregation.

A mixture-of-experts policy replays the sampler's routing (`TrainBatch.experts_BxTxLxK`) when
`model.routing_replay`, adds rl.router_aux_loss_coef x the load-balancing loss when > 0, and logs
`expert_load_cv`, `router_aux_loss` and, where the sampler recorded its routing, `router_mismatch_frac`
(`rl.routing`).
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_batch.model import token_stats, training_layout
from jaxrl_batch.rl import critic as critic_lib
from jaxrl_batch.rl import losses
from jaxrl_batch.rl import noise_scale as noise_lib
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.rl import routing as routing_lib
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch, split_micro_batches


class Models(NamedTuple):
  """Static pieces of the update: graph definitions and optimizers (critic ones None without a critic)."""
  graphdef: nnx.GraphDef
  actor_tx: optax.GradientTransformation
  critic_graphdef: nnx.GraphDef | None = None
  critic_tx: optax.GradientTransformation | None = None


class Weights(NamedTuple):
  loss_BxT: jax.Array  # The configured aggregation.
  token_BxT: jax.Array  # Token mean, for logged scalars.


def forward(policy, critic, tokens_BxT, valid_BxT, models: Models, cfg: AlgoConfig, need_policy: bool = True,
            experts_BxTxLxK=None, segment_ids_BxT=None, positions_BxT=None, entropy: bool = False):
  """(logp_BxT or None, entropy_BxT or None, values_BxT or None, routings) at temperature cfg.temperature, all
  aligned per token (`model.token_stats`: logits in chunks of positions; the entropy only with `entropy`);
  routings: the policy's `moe.Routing` per MoE layer (empty for a dense policy or without its forward), replaying
  `experts_BxTxLxK` (the sampler's; None = none recorded) when the model's routing_replay is on. Packed rows pass
  their segment ids and positions (`masks.training_layout`)."""
  logp_BxT = entropy_BxT = values_BxT = None
  routings = ()
  if need_policy or (cfg.critic and cfg.share_backbone):
    model = nnx.merge(models.graphdef, policy)
    replay = experts_BxTxLxK if model.cfg.routing_replay else None
    positions_and_mask = training_layout(model.cfg.attention, valid_BxT, segment_ids_BxT, positions_BxT)
    hidden_BxTxD, _, routings = model.forward(tokens_BxT, *positions_and_mask, replay_BxTxLxK=replay)
    if need_policy:
      logp_BxT, entropy_BxT = token_stats(model, hidden_BxTxD, tokens_BxT, cfg.temperature, entropy)
    if cfg.critic and cfg.share_backbone:
      values_BxT = critic_lib.shared_values(models.critic_graphdef, critic, hidden_BxTxD)
  if cfg.critic and not cfg.share_backbone:
    values_BxT = critic_lib.separate_values(models.critic_graphdef, critic, tokens_BxT, valid_BxT, segment_ids_BxT,
                                            positions_BxT)
  return logp_BxT, entropy_BxT, values_BxT, routings


def _router_terms(routings, micro: TrainBatch, num_micro: int) -> dict:
  """The micro-batch's router sums (`rl.routing`): expert loads, mismatched and recorded decisions, and its
  load-balancing loss / num_micro (so the micro-batches sum to their mean)."""
  terms = dict(expert_load=routing_lib.expert_load(routings, micro.valid_BxT),
               router_aux_loss=routing_lib.load_balancing_loss(routings, micro.valid_BxT) / num_micro)
  if micro.experts_BxTxLxK is not None:
    terms["router_mismatched"], terms["router_recorded"] = routing_lib.mismatched(routings, micro.valid_BxT,
                                                                                 micro.experts_BxTxLxK)
  return terms


def _router_metrics(aux: dict) -> dict:
  """Replaces the summed router terms by the logged scalars expert_load_cv and router_mismatch_frac."""
  aux = dict(aux)
  if "expert_load" in aux:
    aux["expert_load_cv"] = routing_lib.expert_load_cv(aux.pop("expert_load"))
  if "router_recorded" in aux:
    aux["router_mismatch_frac"] = aux.pop("router_mismatched") / jnp.maximum(aux.pop("router_recorded"), 1.0)
  return aux


def _weighted_sum(w, x_BxT):
  """sum(w * x) over tokens: a scalar for w_BxT, a K-vector for w_BxTxK (the loss and its signed variants)."""
  if w.ndim == 2:
    return losses.weighted_sum(x_BxT, w)
  return jnp.sum(jnp.where(w != 0, x_BxT[..., None] * w, 0.0), axis=(0, 1))


def _micro_loss(trainable, micro: TrainBatch, weights: Weights, kl_coef, models: Models, cfg: AlgoConfig,
                train_actor: bool, num_micro=1):
  policy, critic = trainable
  if not train_actor:
    policy = jax.lax.stop_gradient(policy)
  logp_BxT, entropy_BxT, values_BxT, routings = forward(policy, critic, micro.tokens_BxT, micro.valid_BxT, models,
                                                        cfg, need_policy=train_actor,
                                                        experts_BxTxLxK=micro.experts_BxTxLxK,
                                                        segment_ids_BxT=micro.segment_ids_BxT,
                                                        positions_BxT=micro.positions_BxT, entropy=True)
  mask_BxT = micro.loss_mask_BxT
  w, tw = weights.loss_BxT, weights.token_BxT
  wsum = functools.partial(_weighted_sum, w)
  first = lambda x: x if x.ndim == 0 else x[0]
  zero = jnp.zeros(w.shape[2:], jnp.float32)
  loss, aux = zero, {}
  if train_actor:
    log_ratio_BxT = losses.log_ratio(logp_BxT, micro.old_logp_BxT, mask_BxT, cfg.ratio_level, micro.segment_ids_BxT)
    pg_BxT, low_BxT, high_BxT = losses.policy_loss(log_ratio_BxT, micro.adv_BxT, cfg.clip_low, cfg.clip_high,
                                                   cfg.dual_clip)
    if cfg.tis_cap > 0:
      weight_BxT, capped_BxT = losses.behaviour_weight(micro.old_logp_BxT, micro.sampler_logp_BxT, cfg.tis_cap,
                                                       cfg.tis_mode)
      pg_BxT = pg_BxT * weight_BxT
      aux["tis_capped_frac"] = losses.weighted_sum(capped_BxT, tw)
    if cfg.entropy_coef <= 0:
      entropy_BxT = jax.lax.stop_gradient(entropy_BxT)
    pg = wsum(pg_BxT)
    aux["policy_loss"] = first(pg)
    loss = pg - cfg.entropy_coef * wsum(entropy_BxT)
    if cfg.use_kl:
      kl_BxT = losses.kl_penalty(logp_BxT, micro.ref_logp_BxT, cfg.kl_estimator)
      if cfg.kl_in == "loss":
        loss = loss + kl_coef * wsum(kl_BxT)
      aux["kl"] = losses.weighted_sum(jax.lax.stop_gradient(kl_BxT), tw)
    sg_logp_BxT = jax.lax.stop_gradient(logp_BxT)
    aux.update(entropy=losses.weighted_sum(jax.lax.stop_gradient(entropy_BxT), tw),
               clip_frac_low=losses.weighted_sum(low_BxT, tw), clip_frac_high=losses.weighted_sum(high_BxT, tw),
               ratio_mean=losses.weighted_sum(jnp.exp(jax.lax.stop_gradient(log_ratio_BxT)), tw),
               logp_gap=losses.weighted_sum(jnp.abs(sg_logp_BxT - micro.sampler_logp_BxT), tw))
    if routings:
      aux.update(_router_terms(routings, micro, num_micro))
      if cfg.router_aux_loss_coef > 0:  # In the loss itself only (not in the signed losses of the noise split).
        only_first = jnp.eye(w.shape[2])[0] if w.ndim == 3 else 1.0
        loss = loss + cfg.router_aux_loss_coef * aux["router_aux_loss"] * only_first
      aux["router_aux_loss"] = jax.lax.stop_gradient(aux["router_aux_loss"])
  if cfg.critic:
    vl_BxT = losses.value_loss(values_BxT, micro.old_values_BxT, micro.returns_BxT, cfg.vf_clip)
    vl = wsum(vl_BxT)
    aux["value_loss"] = first(vl)
    loss = loss + cfg.vf_coef * vl
  return loss, aux


def packed(batch: TrainBatch, weights: Weights, packing: packing_lib.Packing
           ) -> tuple[tuple[TrainBatch, Weights], jax.Array]:
  """The mini-batch and its weights as packed micro-batches (M, R, L, ...) with segment ids and positions, and the
  number of micro-batches that hold tokens (`rl.packing`)."""
  plan = packing_lib.plan(batch.valid_BxT, packing=packing)
  pack = lambda x: None if x is None else packing_lib.pack(plan, x)
  micro = TrainBatch(*(pack(x) for x in batch[:10]), positions_BxT=plan.positions_MxRxL,
                     segment_ids_BxT=plan.segment_ids_MxRxL)
  return (micro._replace(valid_BxT=plan.segment_ids_MxRxL > 0), Weights(*map(pack, weights))), plan.num_micro


@functools.partial(jax.jit, static_argnames=("models", "cfg", "num_micro", "train_actor", "packing"),
                   donate_argnums=(0,))
def update(state: dict, batch: TrainBatch, kl_coef, noise_ids_Bx2=None, *, models: Models, cfg: AlgoConfig,
           num_micro: int, train_actor: bool = True, packing: packing_lib.Packing | None = None):
  """One optimizer step of the actor (if `train_actor`) and the critic (if cfg.critic) on the mini-batch `batch`.

  state: dict(params, opt_state[, critic, critic_opt_state]). kl_coef: float32 scalar (traced: it may adapt).
  Micro-batches: `num_micro` slices of the rows, or with `packing` the sequences packed into rows of a fixed length
  (`rl.packing`; as many micro-batches as they fill, a device scalar). Micro-batch losses are normalised by counts
  of the whole mini-batch, so the summed gradient depends on neither. Returns (state, metrics dict of scalars),
  with the per-update noise-scale estimates (`rl.noise_scale`): from the micro-batches' gradients, or with
  `noise_ids_Bx2` (int32 prompt id and index in its group of each row) from two signed actor gradients computed
  alongside (`rl.noise_split`: the backward pass runs for three cotangents).
  """
  if cfg.loss_agg == "constant" and cfg.loss_agg_constant <= 0:
    raise ValueError("loss_agg='constant' needs cfg.loss_agg_constant > 0; `train.setup` sets its default, the "
                     "response budget in tokens.")
  loss_BxT = losses.token_weights(batch.loss_mask_BxT, cfg.loss_agg, cfg.loss_agg_constant)
  u_B = loss_BxT.sum(axis=1)
  split = noise_ids_Bx2 is not None and train_actor
  if split:
    signs_Bx3 = jnp.concatenate([jnp.ones_like(u_B)[:, None], noise_lib.signs(*noise_ids_Bx2.T)], axis=1)
    loss_BxT = loss_BxT[:, :, None] * signs_Bx3[:, None, :]
  weights = Weights(loss_BxT, losses.token_weights(batch.loss_mask_BxT, "token_mean"))
  trainable = (state["params"], state.get("critic"))
  if packing is None:
    micro_batches, count = split_micro_batches((batch, weights), num_micro), num_micro
  else:
    micro_batches, count = packed(batch, weights, packing)
  n = jnp.asarray(count, jnp.float32)

  def micro_grads(micro_and_weights):
    """((loss, aux, grads), noise parts): |g_i|^2 and U_i^2 of the actor's micro-batch gradient, or its signed
    gradients (2, ...) with the split."""
    micro, micro_weights = micro_and_weights
    loss_fn = lambda t: _micro_loss(t, micro, micro_weights, kl_coef, models, cfg, train_actor, n)
    if not split:
      (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
      return (loss, aux, grads), (optax.tree.norm(grads[0], squared=True), jnp.sum(micro_weights.loss_BxT)**2)
    loss_3, vjp_fn, aux = jax.vjp(loss_fn, trainable, has_aux=True)
    # One backward pass per cotangent: jit(vmap(vjp_fn)) miscomputed the signed rows on XLA:CPU (jax 0.10.2).
    (grads,), *signed = [vjp_fn(e) for e in jnp.eye(3, dtype=loss_3.dtype)]
    return (loss_3[0], aux, grads), jax.tree.map(lambda *g: jnp.stack(g), *(ct[0][0] for ct in signed))

  def accumulate(i, total):
    return jax.tree.map(jnp.add, total, micro_grads(jax.tree.map(lambda x: x[i], micro_batches)))

  shapes = jax.eval_shape(micro_grads, jax.tree.map(lambda x: x[0], micro_batches))
  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
  (loss, aux, (policy_grads, critic_grads)), noise_parts = jax.lax.fori_loop(0, count, accumulate, zeros)
  state = dict(state)
  metrics = dict(_router_metrics(aux), loss=loss, num_tokens=jnp.sum(batch.loss_mask_BxT))
  if train_actor:
    updates, state["opt_state"] = models.actor_tx.update(policy_grads, state["opt_state"], state["params"])
    state["params"] = optax.apply_updates(state["params"], updates)
    grad_sq = optax.tree.norm(policy_grads, squared=True)
    metrics.update(grad_norm=jnp.sqrt(grad_sq))
    if split:
      signed_sq = [optax.tree.norm(jax.tree.map(lambda g: g[k], noise_parts), squared=True) for k in (0, 1)]
      metrics.update(noise_lib.from_signed_gradients(jnp.stack([grad_sq, *signed_sq]), u_B, *noise_ids_Bx2.T))
    else:
      metrics.update(noise_lib.from_micro_batches(grad_sq, *noise_parts, jnp.sum(u_B), jnp.sum(u_B**2)))
  if cfg.critic:
    updates, state["critic_opt_state"] = models.critic_tx.update(critic_grads, state["critic_opt_state"],
                                                                 state["critic"])
    state["critic"] = optax.apply_updates(state["critic"], updates)
    metrics["critic_grad_norm"] = optax.tree.norm(critic_grads)
  return state, metrics


def packed_forward(fn, tokens_BxT, valid_BxT, experts_BxTxLxK, packing: packing_lib.Packing):
  """`fn(tokens, valid, experts, segment_ids, positions)` -> per-token outputs (or None), run on the packed rows
  one micro-batch at a time (only those that hold tokens), each output back in the padded (B, T) layout."""
  plan = packing_lib.plan(valid_BxT, packing=packing)
  segment_ids, positions = plan.segment_ids_MxRxL, plan.positions_MxRxL
  tokens = packing_lib.pack(plan, tokens_BxT)
  experts = None if experts_BxTxLxK is None else packing_lib.pack(plan, experts_BxTxLxK)
  micro = lambda i: (tokens[i], segment_ids[i] > 0, None if experts is None else experts[i], segment_ids[i],
                     positions[i])
  shapes = jax.eval_shape(fn, *micro(0))

  def body(i, outs):
    return jax.tree.map(lambda out, x: out.at[i].set(x), outs, fn(*micro(i)))

  outs = jax.tree.map(lambda s: jnp.zeros(tokens.shape[:1] + s.shape, s.dtype), shapes)
  outs = jax.lax.fori_loop(0, plan.num_micro, body, outs)
  return jax.tree.map(lambda x: packing_lib.unpack(plan, x), outs)


@functools.partial(jax.jit, static_argnames=("models", "cfg", "need_policy", "packing", "num_micro"))
def score(policy, critic, tokens_BxT, valid_BxT, loss_mask_BxT, experts_BxTxLxK=None, *, models: Models,
          cfg: AlgoConfig, need_policy: bool = True, packing: packing_lib.Packing | None = None, num_micro: int = 1):
  """(logp_BxT or None, values_BxT or None) without gradients, 0 off the loss mask: the trainer's old log-probs
  and the critic's old values (before this step's updates), replaying the sampler's routing as `forward`; in
  `num_micro` forwards of B / num_micro rows, or over packed rows with `packing`."""
  def fn(tokens, valid, experts, segment_ids=None, positions=None):
    logp, _, values, _ = forward(policy, critic, tokens, valid, models, cfg, need_policy, experts, segment_ids,
                                 positions)
    return logp, values

  if packing is None:
    logp_BxT, values_BxT = micro_batched(fn, num_micro, tokens_BxT, valid_BxT, experts_BxTxLxK)
  else:
    logp_BxT, values_BxT = packed_forward(fn, tokens_BxT, valid_BxT, experts_BxTxLxK, packing)
  masked = lambda x: None if x is None else jnp.where(loss_mask_BxT, x, 0.0)
  return masked(logp_BxT), masked(values_BxT)


def micro_batched(fn, num_micro: int, *rows):
  """fn(*rows) of a forward, computed `num_micro` slices of the rows at a time (`jax.lax.map`: one slice's
  activations live at once); the outputs joined back to B rows."""
  if num_micro == 1:
    return fn(*rows)
  outs = jax.lax.map(lambda micro: fn(*micro), split_micro_batches(rows, num_micro))
  return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), outs)
