"""The key/value cache: a small value type holding every layer's keys and values."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.kernels.decode_attention import decode_attention
from jaxrl_batch.model.config import ModelConfig


class KVCache(NamedTuple):
  """Preallocated keys and values, one array per layer and kind: keys transposed, (B, K, H, S), values (B, K, S, H).

  Slot s of a sequence holds the token at cache index s; the caller tracks which slots are valid (see
  `jaxrl_batch.model.masks`). Each (sequence, kv head) owns one contiguous block of each, laid out as the
  attention products read them: scores = q (G x H) @ keys (H x S), out = probs (G x S) @ values (S x H), both with
  the contraction over a row-major operand's rows, which XLA's CPU backend runs as one vectorised pass over the
  cache (contracting H along the rows of an S x H block ran 2.7-4x slower, measured at B = 64 on two CPUs). A
  decode step reads its layer's arrays as they are: a stacked (L, ...) array would have XLA copy the layer out on
  every layer and step.
  """

  k_layers: tuple[jax.Array, ...]  # L x (B, K, H, S)
  v_layers: tuple[jax.Array, ...]  # L x (B, K, S, H)

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
    b, kv, h, dtype = batch, cfg.num_kv_heads, cfg.head_dim, dtype or cfg.compute_dtype
    return cls(tuple(jnp.zeros((b, kv, h, length), dtype) for _ in range(cfg.num_layers)),
               tuple(jnp.zeros((b, kv, length, h), dtype) for _ in range(cfg.num_layers)))

  @staticmethod
  def bytes_for(cfg: ModelConfig, batch: int, length: int, dtype=None) -> int:
    """Bytes of a cache of `batch` sequences x `length` slots: L layers x (keys + values) x K x H x length."""
    itemsize = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    return 2 * cfg.num_layers * batch * cfg.num_kv_heads * cfg.head_dim * length * itemsize

  @property
  def length(self) -> int:
    """S, the slots per sequence."""
    return self.v_layers[0].shape[2]

  @property
  def idle_slot(self) -> int:
    """A slot an idle row may write to harmlessly (its own first)."""
    return 0

  def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
    """One layer's keys (B, K, H, S) and values (B, K, S, H)."""
    return self.k_layers[layer], self.v_layers[layer]

  def decode_attention(self, layer: int, q_BxNxH, starts_B, ends_B, *, backend: str, window: int | None = None):
    """One-token attention of each row over its slots [starts_B, ends_B), read in place by `backend`
    (`kernels.decode_attention`), of the first `window` slots only (static; None = all). Returns out_BxNxH."""
    k, v = self.k_layers[layer], self.v_layers[layer]
    if window is not None and window < self.length:
      k, v = k[..., :window], v[:, :, :window]
    return decode_attention(q_BxNxH, k, v, ends_B, starts_B, backend=backend)

  def resized(self, length: int) -> "KVCache":
    """The cache zero-padded to `length` >= S slots."""
    pad = length - self.length
    return KVCache(tuple(jnp.pad(k, ((0, 0), (0, 0), (0, 0), (0, pad))) for k in self.k_layers),
                   tuple(jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0))) for v in self.v_layers))

  def repeat_rows(self, repeats: int) -> "KVCache":
    """The cache with each sequence's row repeated `repeats` times (B -> B * repeats)."""
    return KVCache(*(tuple(jnp.repeat(x, repeats, axis=0) for x in layers) for layers in self))

  def write(self, layer: int, index, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array) -> "KVCache":
    """Writes T new keys/values of one layer at slots index..index+T-1 (in place under jit). `index` is an int
    scalar, or for T == 1 an int array (B,) of each row's own slot (the continuous engine's slots)."""
    if jnp.ndim(index) == 1:
      return self._write_rows(layer, index, k_BxTxKxH, v_BxTxKxH)

    def put(layers, new, start):
      updated = jax.lax.dynamic_update_slice(layers[layer], new.astype(layers[layer].dtype), start)
      return (*layers[:layer], updated, *layers[layer + 1:])

    return KVCache(put(self.k_layers, jnp.transpose(k_BxTxKxH, (0, 2, 3, 1)), (0, 0, 0, index)),
                   put(self.v_layers, jnp.swapaxes(v_BxTxKxH, 1, 2), (0, 0, index, 0)))

  def _write_rows(self, layer: int, index_B, k_Bx1xKxH: jax.Array, v_Bx1xKxH: jax.Array) -> "KVCache":
    """One key/value per row b at its slot index_B[b]: a scatter of B x K x H elements per array."""
    if k_Bx1xKxH.shape[1] != 1:
      raise ValueError(f"per-row cache slots take one token per row, got {k_Bx1xKxH.shape[1]}.")
    rows_B = jnp.arange(k_Bx1xKxH.shape[0])
    k, v = self.k_layers[layer], self.v_layers[layer]
    k = k.at[rows_B, :, :, index_B].set(k_Bx1xKxH[:, 0].astype(k.dtype))
    v = v.at[rows_B, :, index_B, :].set(v_Bx1xKxH[:, 0].astype(v.dtype))
    return KVCache((*self.k_layers[:layer], k, *self.k_layers[layer + 1:]),
                   (*self.v_layers[:layer], v, *self.v_layers[layer + 1:]))
