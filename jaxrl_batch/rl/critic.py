"""The PPO value model: a scalar head on a decoder's final hidden states.

Two layouts, chosen by `critic.share_backbone`:
  separate: `ValueModel` = its own decoder (the policy's first `num_layers` blocks, 0 = all, initialised from the
            base policy) + head; trained only by the critic optimizer.
  shared:   `ValueHead` alone, applied to the policy's hidden states; the value loss also trains the policy backbone
            (through the actor optimizer, weighted by `critic.vf_coef`).
The head starts at zero, so the first values are 0 and the critic warm-up fits them to the returns.
"""
import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model import ModelConfig, training_layout
from jaxrl_batch.model.value_head import ValueHead, ValueModel
from jaxrl_batch.runtime import sharding


def critic_model_config(policy_cfg: ModelConfig, num_layers: int) -> ModelConfig:
  """The separate critic's decoder: the policy's shape, `num_layers` blocks (0 = as many as the policy), no LM head."""
  if num_layers > policy_cfg.num_layers:
    raise ValueError(f"critic.num_layers={num_layers} exceeds the policy's {policy_cfg.num_layers} layers; the "
                     "critic is initialised from the policy's first blocks.")
  return dataclasses.replace(policy_cfg, num_layers=num_layers or policy_cfg.num_layers, tie_embeddings=True)


def align(values_BxT: jax.Array) -> jax.Array:
  """Values from hidden state t-1 placed at entry t (the state before token t), like the per-token log-probs."""
  return jnp.pad(values_BxT[:, :-1], ((0, 0), (1, 0)))


def shared_values(head_graphdef, head_params, hidden_BxTxD) -> jax.Array:
  """values_BxT (aligned) from the policy's hidden states."""
  return align(nnx.merge(head_graphdef, head_params)(hidden_BxTxD))


def separate_values(graphdef, params, tokens_BxT, valid_BxT, segment_ids_BxT=None, positions_BxT=None) -> jax.Array:
  """values_BxT (aligned) of a `ValueModel` over left/right-padded sequences, or packed rows
  (`masks.training_layout`)."""
  model = nnx.merge(graphdef, params)
  positions_and_mask = training_layout(model.backbone.cfg.attention, valid_BxT, segment_ids_BxT, positions_BxT)
  hidden_BxTxD, _, _ = model.backbone.forward(tokens_BxT, *positions_and_mask)
  return align(model.head(hidden_BxTxD))


def critic_module(policy_cfg: ModelConfig, share_backbone: bool, num_layers: int):
  """The critic's module factory: a `ValueHead` on the policy's hidden states, or a `ValueModel` of its own."""
  if share_backbone:
    return lambda: ValueHead(policy_cfg.d_model, policy_cfg.weight_dtype, nnx.Rngs(0))
  cfg = critic_model_config(policy_cfg, num_layers)
  return lambda: ValueModel(cfg, nnx.Rngs(0))


def init_critic(policy_cfg: ModelConfig, policy_params, share_backbone: bool, num_layers: int, mesh, rules):
  """(graphdef, params) of the critic, created sharded. A separate critic copies the base policy's embedding,
  final norm and first blocks; the head is zero."""
  graphdef, params = sharding.create_sharded(critic_module(policy_cfg, share_backbone, num_layers), mesh, rules)
  if share_backbone:
    return graphdef, params
  backbone = params["backbone"]
  backbone["embedding"] = policy_params["embedding"]
  backbone["final_norm"] = policy_params["final_norm"]
  backbone["blocks"] = {i: policy_params["blocks"][i] for i in backbone["blocks"]}
  # Copies, so that donating the critic's buffers in the update never invalidates the policy's.
  return graphdef, jax.tree.map(jnp.copy, params)


def abstract_critic(policy_cfg: ModelConfig, policy_params, share_backbone: bool, num_layers: int, mesh, rules):
  """`init_critic`'s (graphdef, params) as sharded structs (its copies of the policy's parameters keep their shapes
  and shardings); `policy_params` is not read."""
  del policy_params
  return sharding.abstract_sharded(critic_module(policy_cfg, share_backbone, num_layers), mesh, rules)
