"""The key/value cache: a small value type holding every layer's keys and values."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.model.config import ModelConfig


class KVCache(NamedTuple):
  """Preallocated keys and values for all layers.

  Slot s of a sequence holds the token at cache index s; the caller tracks which slots are valid (see
  `jaxrl_batch.model.masks`). Layout (L, B, S, K, H): one contiguous (S, K, H) block per sequence and layer.
  """

  k_LxBxSxKxH: jax.Array
  v_LxBxSxKxH: jax.Array

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
    shape = (cfg.num_layers, batch, length, cfg.num_kv_heads, cfg.head_dim)
    dtype = dtype or cfg.compute_dtype
    return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

  def write(self, layer: int, index, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> "KVCache":
    """Writes T new keys/values of one layer at slots index..index+T-1 (in place under jit)."""
    start = (layer, 0, index, 0, 0)
    return KVCache(
        jax.lax.dynamic_update_slice(self.k_LxBxSxKxH, k_BxTxKxH[None].astype(self.k_LxBxSxKxH.dtype), start),
        jax.lax.dynamic_update_slice(self.v_LxBxSxKxH, v_BxTxKxH[None].astype(self.v_LxBxSxKxH.dtype), start))
