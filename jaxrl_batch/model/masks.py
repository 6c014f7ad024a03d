"""Attention masks and RoPE positions for left-padded, variable-length sequences."""
from typing import NamedTuple

import jax
import jax.numpy as jnp


def positions_from_valid(valid_BxT: jax.Array) -> jax.Array:
  """RoPE position of each token: 0 at a sequence's first valid token (left padding is skipped)."""
  return jnp.maximum(jnp.cumsum(valid_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def causal_mask(valid_BxT: jax.Array) -> jax.Array:
  """(B, T, T) bool: query t may attend key s iff s <= t and key s is a real token."""
  t = valid_BxT.shape[-1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  return causal_TxT[None] & valid_BxT[:, None, :].astype(bool)


def segment_causal_mask(segment_ids_BxT: jax.Array) -> jax.Array:
  """(B, T, T) bool for packed rows (`rl.packing`): query t may attend key s iff s <= t and both belong to the same
  sequence (segment id), 0 marking padding."""
  t = segment_ids_BxT.shape[-1]
  causal_TxT = jnp.tril(jnp.ones((t, t), bool))
  same_BxTxT = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  return causal_TxT[None] & same_BxTxT & (segment_ids_BxT[:, None, :] != 0)


def layout(valid_BxT: jax.Array, segment_ids_BxT: jax.Array | None = None, positions_BxT: jax.Array | None = None
           ) -> tuple[jax.Array, jax.Array]:
  """(positions_BxT, mask_BxTxS) of a full forward: padded rows (one sequence each, `valid_BxT`) by default; packed
  rows when `segment_ids_BxT` and each token's own `positions_BxT` are given."""
  if segment_ids_BxT is None:
    return positions_from_valid(valid_BxT), causal_mask(valid_BxT)
  return positions_BxT, segment_causal_mask(segment_ids_BxT)


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
  (`jaxrl_batch.kernels.decode_attention`, starts and lengths = ends).
  """

  starts_B: jax.Array
  ends_B: jax.Array
