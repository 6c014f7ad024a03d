"""The PPO value model's pieces: a scalar head on a decoder's final hidden states, and a separate critic network.

The head starts at zero, so a fresh critic's values are 0.
"""
import jax.numpy as jnp
from flax import nnx

from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.model.layers import sharded_param
from jaxrl_batch.model.transformer import Transformer


class ValueHead(nnx.Module):
  """v = h . w + b per position, in float32."""

  def __init__(self, d_model: int, param_dtype, rngs: nnx.Rngs):
    self.w = sharded_param(rngs, nnx.initializers.zeros, (d_model,), ("embed",), param_dtype)
    self.b = sharded_param(rngs, nnx.initializers.zeros, (), (), param_dtype)

  def __call__(self, h_BxTxD):
    return jnp.einsum("btd,d->bt", h_BxTxD, self.w[...].astype(h_BxTxD.dtype),
                      preferred_element_type=jnp.float32) + self.b[...].astype(jnp.float32)


class ValueModel(nnx.Module):
  """A separate critic: decoder backbone + `ValueHead`."""

  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    self.backbone = Transformer(cfg, rngs)
    self.head = ValueHead(cfg.d_model, cfg.weight_dtype, rngs)
