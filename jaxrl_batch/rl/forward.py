"""The trainer's forward passes: per-token log-probs, entropies and values of the policy (and critic), over padded
rows in micro-batches or over packed rows (`rl.packing`); the update differentiates them, `logprobs_and_values`
scores a step's batch without gradients (the trainer's old log-probs, the critic's old values, the reference's
log-probs)."""
import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl_batch.model import token_stats, training_layout
from jaxrl_batch.rl import critic as critic_lib
from jaxrl_batch.rl import packing as packing_lib
from jaxrl_batch.rl.algorithm import AlgoConfig
from jaxrl_batch.rl.batch import split_micro_batches


class ModelDefs(NamedTuple):
  """What the update needs besides the parameters: the policy's and critic's graph definitions and optimizers
  (critic ones None without a critic). Static arguments of the jitted programs."""
  graphdef: nnx.GraphDef
  actor_tx: optax.GradientTransformation | None = None
  critic_graphdef: nnx.GraphDef | None = None
  critic_tx: optax.GradientTransformation | None = None


class Outputs(NamedTuple):
  """A forward's per-token outputs, aligned with the tokens (None where not computed), and the policy's
  `moe.Routing` per MoE layer (empty for a dense policy or without its forward)."""
  logp_BxT: jax.Array | None
  entropy_BxT: jax.Array | None
  values_BxT: jax.Array | None
  routings: tuple = ()


def forward(policy, critic, tokens_BxT, valid_BxT, models: ModelDefs, cfg: AlgoConfig, need_policy: bool = True,
            experts_BxTxLxK=None, segment_ids_BxT=None, positions_BxT=None, entropy: bool = False) -> Outputs:
  """The policy's log-probs (with `need_policy`) and entropies (with `entropy`) at temperature cfg.temperature
  (`model.token_stats`: logits in chunks of positions) and the critic's values (with cfg.critic), replaying
  `experts_BxTxLxK` (the sampler's routing; None = none recorded) when the model's routing_replay is on. Packed
  rows pass their segment ids and positions (`masks.training_layout`)."""
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
  return Outputs(logp_BxT, entropy_BxT, values_BxT, routings)


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


def micro_batched(fn, num_micro: int, *rows):
  """fn(*rows) of a forward, computed `num_micro` slices of the rows at a time (`jax.lax.map`: one slice's
  activations live at once); the outputs joined back to B rows."""
  if num_micro == 1:
    return fn(*rows)
  outs = jax.lax.map(lambda micro: fn(*micro), split_micro_batches(rows, num_micro))
  return jax.tree.map(lambda x: x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]), outs)


@functools.partial(jax.jit, static_argnames=("models", "cfg", "need_policy", "packing", "num_micro"))
def logprobs_and_values(policy, critic, tokens_BxT, valid_BxT, loss_mask_BxT, experts_BxTxLxK=None, *,
                        models: ModelDefs, cfg: AlgoConfig, need_policy: bool = True,
                        packing: packing_lib.Packing | None = None, num_micro: int = 1):
  """(logp_BxT or None, values_BxT or None) without gradients, 0 off the loss mask: the trainer's old log-probs
  and the critic's old values (before this step's updates), or with a frozen reference policy and no critic its
  log-probs; the sampler's routing replayed as in `forward`; in `num_micro` forwards of B / num_micro rows, or over
  packed rows with `packing`."""
  def fn(tokens, valid, experts, segment_ids=None, positions=None):
    out = forward(policy, critic, tokens, valid, models, cfg, need_policy, experts, segment_ids, positions)
    return out.logp_BxT, out.values_BxT

  if packing is None:
    logp_BxT, values_BxT = micro_batched(fn, num_micro, tokens_BxT, valid_BxT, experts_BxTxLxK)
  else:
    logp_BxT, values_BxT = packed_forward(fn, tokens_BxT, valid_BxT, experts_BxTxLxK, packing)
  masked = lambda x: None if x is None else jnp.where(loss_mask_BxT, x, 0.0)
  return masked(logp_BxT), masked(values_BxT)


def reference_cfg(cfg: AlgoConfig) -> AlgoConfig:
  """The settings under which `logprobs_and_values` scores the frozen reference policy: no critic."""
  return dataclasses.replace(cfg, critic=False, share_backbone=False)
