"""Attention masks and RoPE positions for left-padded, variable-length sequences."""
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.kernels.train_attention import resolve, segment_causal_mask


def positions_from_valid(valid_BxT: jax.Array) -> jax.Array:
  """RoPE position of each token: 0 at a sequence's first valid token (left padding is skipped)."""
  return jnp.maximum(jnp.cumsum(valid_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(valid_BxT: jax.Array) -> jax.Array:
  """(B, T, T) bool: query t may attend key s iff s <= t and key s is a real token."""
  t = valid_BxT.shape[-1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  return causal_TxT[None] & valid_BxT[:, None, :].astype(bool)


def layout(valid_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None, positions_BxT: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
  """(positions_BxT, mask_BxTxS) of a full forward: padded rows (one sequence each, `valid_BxT`) by default; packed
  rows when `segment_ids_BxT` and each token's own `positions_BxT` are given."""
  if segment_ids_BxT is None:
    return positions_from_valid(valid_BxT), causal_mask(valid_BxT)
  return positions_BxT, segment_causal_mask(segment_ids_BxT)


class Segments(NamedTuple):
  """The mask of a forward without a KV cache as each row's segment ids instead of (B, T, T) bools: query t attends
  key s iff s <= t and both carry the same nonzero id (0 = padding). `Attention` reads it with
  `kernels.train_attention.segment_attention`, backend `model.attention`; `segments` builds it."""

  segment_ids_BxT: jax.Array


def segments(valid_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None, positions_BxT: jax.Array | None = None
             ) -> tuple[jax.Array, Segments]:
  """`layout` with the mask as `Segments`: a padded row is one segment (id 1 on its valid tokens); packed rows keep
  their segment ids. Valid queries attend the keys `layout`'s mask gives them."""
  if segment_ids_BxT is None:
    return positions_from_valid(valid_BxT), Segments(valid_BxT.astype(jnp.int32))
  return positions_BxT, Segments(segment_ids_BxT.astype(jnp.int32))


def training_layout(attention: str, valid_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None,
                    positions_BxT: jax.Array | None = None) -> tuple[jax.Array, jax.Array | Segments]:
  """`layout` where `attention` (a `ModelConfig.attention`) resolves to the dense backend on the platform traced for
  (`kernels.train_attention.resolve`: auto is dense on CPU), else `segments`."""
  build = layout if resolve(attention) == "dense" else segments
  return build(valid_BxT, segment_ids_BxT, positions_BxT)


def cache_mask(kv_valid_BxS: jax.Array, cache_index: jax.Array, num_queries: int) -> jax.Array:
  """(B, T, S) bool for T queries written at cache slots cache_index..cache_index+T-1.

  Query t may attend slot s iff s <= cache_index + t and slot s holds a real token.
  """
  s = kv_valid_BxS.shape[-1]
  query_slot_T = cache_index + jnp.arange(num_queries)
  causal_TxS = jnp.arange(s)[None, :] <= query_slot_T[:, None]
  return causal_TxS[None] & kv_valid_BxS[:, None, :].astype(bool)


class DecodeSpan(NamedTuple):
  """The keys of a one-token cached step, as ragged spans rather than a dense mask.

  Row b's query attends cache slots starts_B[b] <= s < ends_B[b]: from a left-padded prompt's first real token to
  the query's own slot. Handed to the model as the mask of a step with a `decode_backend`, which reads it
  (`jaxrl_batch.kernels.decode_attention`, starts and lengths = ends). `window` (a Python int, static): a slot
  cache is read only in its first `window` slots, which must hold every span (None: all of it); the static engine's
  segments read a growing window of one full-size cache.
  """

  starts_B: jax.Array
  ends_B: jax.Array
  window: int | None = None

  @property
  def live_B(self) -> jax.Array:
    """Rows that attend at least one key: a continuous engine's finished or free slot has an empty span (its token
    is discarded), and its MoE layers route it to no expert."""
    return self.ends_B > self.starts_B
