"""One optimizer step of the actor (and critic) on a mini-batch: the loss of `rl.objective`, its gradient
accumulated over micro-batches (padded slices of the rows, or packed rows with `rl.packing`), the optimizer steps,
and the metrics, with the per-update gradient noise-scale estimates of the `rl.noise_scale.Estimator` (which
collects its parts as the micro-batches are differentiated).

A mixture-of-experts policy replays the sampler's routing (`TrainBatch.experts_BxTxLxK`) when
`model.routing_replay`, and logs `expert_load_cv`, `router_aux_loss` and, where the sampler recorded its routing,
`router_mismatch_frac` (`rl.routing`).
"""
import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_batch.model import lora
from jaxrl_batch.rl import losses
from jaxrl_batch.rl import noise_scale as noise_lib
from jaxrl_batch.rl import objective as objective_lib
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.rl import routing as routing_lib
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import TrainBatch, split_micro_batches
from jaxrl_batch.rl.forward import ModelDefs, forward
from jaxrl_batch.rl.objective import LossWeights


def micro_loss(trainable, micro: TrainBatch, weights: LossWeights, kl_coef, models: ModelDefs, cfg: AlgoConfig,
               train_actor: bool, num_micro=1):
  """(L of `rl.objective` on the micro-batch, stacked with its two signed variants when `weights` are signed;
  logged terms). The actor is held fixed without `train_actor`."""
  policy, critic = trainable
  if not train_actor:
    policy = jax.lax.stop_gradient(policy)
  out = forward(policy, critic, micro.tokens_BxT, micro.valid_BxT, models, cfg, need_policy=train_actor,
                experts_BxTxLxK=micro.experts_BxTxLxK, segment_ids_BxT=micro.segment_ids_BxT,
                positions_BxT=micro.positions_BxT, entropy=True)
  terms, aux = objective_lib.terms_and_diagnostics(out, micro, weights.token_BxT, cfg, num_micro)
  loss, parts = objective_lib.objective(terms, weights.loss_BxT, kl_coef, cfg)
  if weights.signed_BxTx2 is not None:
    loss = jnp.stack([loss, *noise_lib.signed_losses(terms, weights, kl_coef, cfg)])
  return loss, {**aux, **parts}


def _on_trained(trained, micro: TrainBatch, weights: LossWeights, params, **kwargs):
  """`micro_loss` as a function of what trains, (`lora.trainable(params)`, critic): with adapters, the frozen base
  weights of `params` are constants of the loss, so neither gradients nor optimizer state exist for them."""
  policy, critic = trained
  return micro_loss((lora.with_trained(params, policy), critic), micro, weights, **kwargs)


def packed(batch: TrainBatch, weights: LossWeights, packing: packing_lib.Packing):
  """The mini-batch and its weights as packed micro-batches (M, R, L, ...) with segment ids and positions, the
  number of micro-batches that hold tokens (`rl.packing`) and each row's micro-batch (M for a row of no tokens)."""
  plan = packing_lib.plan(batch.valid_BxT, packing=packing)
  pack = lambda x: None if x is None else packing_lib.pack(plan, x)
  layout = dict(positions_BxT=plan.positions_MxRxL, segment_ids_BxT=plan.segment_ids_MxRxL)
  micro = TrainBatch(**{name: pack(getattr(batch, name)) for name in batch._fields if name not in layout}, **layout)
  micro_B = jnp.min(plan.dest_BxT, axis=1) // (packing.rows * packing.length)
  micro_batches = (micro._replace(valid_BxT=plan.segment_ids_MxRxL > 0), LossWeights(*map(pack, weights)))
  return micro_batches, plan.num_micro, micro_B


def _weights(batch: TrainBatch, cfg: AlgoConfig) -> LossWeights:
  if cfg.loss_agg == "constant" and cfg.loss_agg_constant <= 0:
    raise ValueError("loss_agg='constant' needs cfg.loss_agg_constant > 0; `train.setup` sets its default, the "
                     "response budget in tokens.")
  loss_BxT = losses.token_weights(batch.loss_mask_BxT, cfg.loss_agg, cfg.loss_agg_constant)
  return LossWeights(loss_BxT, losses.token_weights(batch.loss_mask_BxT, "token_mean"))


def _accumulate(trainable, micro_batches, count, loss_fn, noise: noise_lib.Estimator):
  """((loss, aux, grads), noise parts) summed over the first `count` micro-batches, each differentiated by the
  noise estimator (`noise_scale.Estimator.micro_batch`)."""
  num_slots = len(micro_batches[0].tokens_BxT)

  def micro_step(i):
    micro, weights = jax.tree.map(lambda x: x[i], micro_batches)
    return noise.micro_batch(lambda t: loss_fn(t, micro, weights), trainable, weights, i, num_slots)

  zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(micro_step, 0))
  return jax.lax.fori_loop(0, count, lambda i, summed: jax.tree.map(jnp.add, summed, micro_step(i)), zeros)


@functools.partial(jax.jit, static_argnames=("models", "cfg", "num_micro", "train_actor", "packing"),
                   donate_argnums=(0,))
def update(state: dict, batch: TrainBatch, kl_coef, ids_Bx2=None, *, models: ModelDefs, cfg: AlgoConfig,
           num_micro: int, train_actor: bool = True, packing: packing_lib.Packing | None = None):
  """One optimizer step of the actor (if `train_actor`) and the critic (if cfg.critic) on the mini-batch `batch`.

  state: dict(params, opt_state[, critic, critic_opt_state]); params holding LoRA adapters train only those
  (`model.lora`: opt_state is theirs, grad_norm and the noise scale are of their gradient).
  kl_coef: float32 scalar (traced: it may adapt).
  ids_Bx2: int32 prompt id (any numbering) and index in its group of each row; None: each row its own prompt.
  Micro-batches: `num_micro` slices of the rows, or with `packing` the sequences packed into rows of a fixed length
  (as many micro-batches as they fill, a device scalar). Micro-batch losses are normalised by counts of the whole
  mini-batch, so the summed gradient depends on neither. Returns (state, metrics dict of scalars) with the noise
  scale's estimates: from the micro-batches' gradients, or with rl.noise_split (which needs `ids_Bx2`) from the
  signed gradients (the backward pass runs for three cotangents).
  """
  noise = noise_lib.estimator(cfg, ids_Bx2, train_actor)
  weights = noise.weights(_weights(batch, cfg))
  if packing is None:
    rows = batch.tokens_BxT.shape[0]
    micro_batches, count = split_micro_batches((batch, weights), num_micro), num_micro
    micro_B = jnp.arange(rows) // (rows // num_micro)  # each row's micro-batch
  else:
    micro_batches, count, micro_B = packed(batch, weights, packing)
  params = state["params"]
  loss_fn = functools.partial(_on_trained, params=params, kl_coef=kl_coef, models=models, cfg=cfg,
                              train_actor=train_actor, num_micro=jnp.asarray(count, jnp.float32))
  trainable = (lora.trainable(params), state.get("critic"))
  (loss, aux, (policy_grads, critic_grads)), parts = _accumulate(trainable, micro_batches, count, loss_fn, noise)
  state = dict(state)
  metrics = dict(routing_lib.logged(aux), loss=loss, num_tokens=jnp.sum(batch.loss_mask_BxT))
  if train_actor:
    updates, state["opt_state"] = models.actor_tx.update(policy_grads, state["opt_state"], trainable[0])
    state["params"] = lora.with_trained(params, optax.apply_updates(trainable[0], updates))
    grad_sq = optax.tree.norm(policy_grads, squared=True)
    metrics.update(grad_norm=jnp.sqrt(grad_sq), **noise.metrics(grad_sq, parts, weights, micro_B))
  if cfg.critic:
    updates, state["critic_opt_state"] = models.critic_tx.update(critic_grads, state["critic_opt_state"],
                                                                 state["critic"])
    state["critic"] = optax.apply_updates(state["critic"], updates)
    metrics["critic_grad_norm"] = optax.tree.norm(critic_grads)
  return state, metrics
