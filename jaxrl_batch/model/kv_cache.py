"""The key/value cache: a small value type holding every layer's keys and values."""
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_batch.kernels.decode_attention import decode_attention
from jaxrl_batch.model.config import ModelConfig
from jaxrl_batch.runtime import sharding


def cache_heads(cfg: ModelConfig) -> int:
  """The kv heads a cache holds under the ambient mesh: K, or K x r when a tensor axis of T chips is not a multiple
  of K (r = T / gcd(K, T), each kv head repeated r times, head j a copy of kv head j // r), so that the heads split
  evenly over `tensor` and each chip holds only the heads its query heads read. Replicated instead, every chip held
  and read all K heads (2 kv heads on 4 chips: twice the bytes per chip) and each decode chunk ended in an
  all-gather of the whole cache (measured with the TPU compiler, docs/results/2026-12-06-decode-roofline.md).
  Attention is unchanged: query head n reads head n // (N / (K r)), a copy of kv head n // (N / K). K where K x r
  would not divide the N query heads."""
  mesh = jax.sharding.get_abstract_mesh()
  tensor = 1 if mesh.empty else mesh.shape.get("tensor", 1)
  repeats = tensor // math.gcd(cfg.num_kv_heads, tensor)
  return cfg.num_kv_heads * repeats if cfg.num_heads % (cfg.num_kv_heads * repeats) == 0 else cfg.num_kv_heads


def layer_sharding(rows: NamedSharding, heads: int) -> NamedSharding:
  """A cache layer's layout: its rows as `rows` lays out a batch's, its `heads` over `tensor` where they split
  evenly (`cache_heads`; 0 = not known: whole), the rest whole."""
  tensor = rows.mesh.shape.get("tensor", 1)
  split = "tensor" if tensor > 1 and heads and heads % tensor == 0 else None
  return NamedSharding(rows.mesh, P(rows.spec[0] if rows.spec else None, split, None, None))


def _laid_out(x_BxKx_x_):
  """A cache layer with its rows over the batch axes of the ambient mesh that divide them and its heads over `tensor`
  where they split evenly (as `layer_sharding`), so that the layout persists through the decode loops and the
  engine's programs; a dimension that does not split is left to the partitioner. A no-op without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x_BxKx_x_
  rows = sharding.dividing_axes(mesh, sharding.BATCH_AXES, x_BxKx_x_.shape[0]) or P.UNCONSTRAINED
  tensor = mesh.shape.get("tensor", 1)
  split = "tensor" if tensor > 1 and x_BxKx_x_.shape[1] % tensor == 0 else P.UNCONSTRAINED
  return jax.lax.with_sharding_constraint(x_BxKx_x_, P(rows, split, None, None))


class KVCache(NamedTuple):
  """Preallocated keys and values, one array per layer and kind: keys transposed, (B, K, H, S), values (B, K, S, H).

  Slot s of a sequence holds the token at cache index s; the caller tracks which slots are valid (see
  `jaxrl_batch.model.masks`). Each (sequence, kv head) owns one contiguous block of each, laid out as the
  attention products read them: scores = q (G x H) @ keys (H x S), out = probs (G x S) @ values (S x H), both with
  the contraction over a row-major operand's rows, which XLA's CPU backend runs as one vectorised pass over the
  cache (contracting H along the rows of an S x H block ran 2.7-4x slower, measured at B = 64 on two CPUs). Keys
  stored like values, (B, K, S, H), were tried for TPU: the compiled decode step of qwen2.5-1.5b on v5p read the
  same bytes at 1-256 rows, while the CPU decode attention ran up to 1.9x slower (docs/results/
  2026-12-06-decode-roofline.md, "Keys as values"). A decode step reads its layer's arrays as they are: a stacked
  (L, ...) array would have XLA copy the layer out on every layer and step.
  """

  k_layers: tuple[jax.Array, ...]  # L x (B, K, H, S)
  v_layers: tuple[jax.Array, ...]  # L x (B, K, S, H)

  @classmethod
  def zeros(cls, cfg: ModelConfig, batch: int, length: int, dtype=None) -> "KVCache":
    """An empty cache of `batch` rows x `length` slots with `cache_heads(cfg)` heads, laid out as `_laid_out`."""
    b, kv, h, dtype = batch, cache_heads(cfg), cfg.head_dim, dtype or cfg.compute_dtype
    return cls(tuple(_laid_out(jnp.zeros((b, kv, h, length), dtype)) for _ in range(cfg.num_layers)),
               tuple(_laid_out(jnp.zeros((b, kv, length, h), dtype)) for _ in range(cfg.num_layers)))

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
    scalar, or for T == 1 an int array (B,) of each row's own slot (the continuous engine's slots). The model's K
    heads are repeated to the cache's (`cache_heads`)."""
    repeats = self.v_layers[layer].shape[1] // k_BxTxKxH.shape[2]
    if repeats > 1:
      k_BxTxKxH, v_BxTxKxH = (jnp.repeat(x, repeats, axis=2) for x in (k_BxTxKxH, v_BxTxKxH))
    if jnp.ndim(index) == 1:
      return self._write_rows(layer, index, k_BxTxKxH, v_BxTxKxH)

    def put(layers, new, start):
      updated = _laid_out(jax.lax.dynamic_update_slice(layers[layer], new.astype(layers[layer].dtype), start))
      return (*layers[:layer], updated, *layers[layer + 1:])

    return KVCache(put(self.k_layers, jnp.transpose(k_BxTxKxH, (0, 2, 3, 1)), (0, 0, 0, index)),
                   put(self.v_layers, jnp.swapaxes(v_BxTxKxH, 1, 2), (0, 0, index, 0)))

  def _write_rows(self, layer: int, index_B, k_Bx1xKxH: jax.Array, v_Bx1xKxH: jax.Array) -> "KVCache":
    """One key/value per row b at its slot index_B[b] (in [0, S): a slot out of range is clamped into it), written
    as a per-row `dynamic_update_slice`: the TPU compiler updates only the B x K x H elements in place, where the
    equivalent `.at[rows, :, :, index].set` of a key column read and wrote the whole layer (4x its bytes, measured
    with `cost_analysis` on v5p; the value rows cost the same either way)."""
    if k_Bx1xKxH.shape[1] != 1:
      raise ValueError(f"per-row cache slots take one token per row, got {k_Bx1xKxH.shape[1]}.")
    k, v = self.k_layers[layer], self.v_layers[layer]
    put_key = lambda k_KxHxS, k_KxH, i: jax.lax.dynamic_update_slice(k_KxHxS, k_KxH[:, :, None], (0, 0, i))
    put_value = lambda v_KxSxH, v_KxH, i: jax.lax.dynamic_update_slice(v_KxSxH, v_KxH[:, None, :], (0, i, 0))
    k = _laid_out(jax.vmap(put_key)(k, k_Bx1xKxH[:, 0].astype(k.dtype), index_B))
    v = _laid_out(jax.vmap(put_value)(v, v_Bx1xKxH[:, 0].astype(v.dtype), index_B))
    return KVCache((*self.k_layers[:layer], k, *self.k_layers[layer + 1:]),
                   (*self.v_layers[:layer], v, *self.v_layers[layer + 1:]))
