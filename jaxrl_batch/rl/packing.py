"""Packed micro-batches: a mini-batch's sequences laid end to end in rows of fixed length, so that a forward's cost
follows the tokens, not the padding.

A padded batch holds B rows of T tokens: a left-padded prompt, then a right-padded response, so each sequence is
one contiguous span [start_b, start_b + n_b). Packing places the spans by first-fit decreasing (longest first, each
into the first row with room) into rows of `length` >= T tokens; row k of the packing is row k % R of micro-batch
k // R, for R = `rows` rows per micro-batch. Every array keeps a static shape: at most M = ceil(B / R) micro-batches
of (R, length) tokens, of which `num_micro` (a device scalar) hold tokens. Inside a packed row each sequence is a
segment (`segment_ids`: the padded row's index + 1, 0 = padding), positions restart at 0 per sequence, and
attention is causal within a segment (`model.masks.segment_causal_mask`).

The plan is computed on the device, deterministically (a stable sort and a scan), from the validity mask alone.
"""
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_batch.model import positions_from_valid


class Packing(NamedTuple):
  """Static shape of packed micro-batches: `rows` packed rows of `length` tokens each."""
  rows: int
  length: int


class Plan(NamedTuple):
  """Where every token of a padded (B, T) batch goes in the (M, R, L) packed one, and back.

  dest_BxT: int32 flat index into the M*R*L packed tokens (M*R*L for padding: nowhere).
  src_MxRxL: int32 flat index into the B*T padded tokens (-1 for packing padding).
  num_micro: int32 scalar, micro-batches that hold tokens (the others are all padding).
  segment_ids_MxRxL: int32, the padded row's index + 1 of each packed token (0 = padding).
  positions_MxRxL: int32, each packed token's position in its own sequence.
  """
  dest_BxT: jax.Array
  src_MxRxL: jax.Array
  num_micro: jax.Array
  segment_ids_MxRxL: jax.Array
  positions_MxRxL: jax.Array


def micro_batches(batch_size: int, packing: Packing) -> int:
  """M: the packed micro-batches a batch of `batch_size` sequences may need (each row holds at least one)."""
  return -(-batch_size // packing.rows)


def first_fit_decreasing(lengths_B: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
  """(bin_B, offset_B): the bin (row) of each length and its offset there, lengths placed longest first (ties in
  index order), each into the first of B bins of `capacity` where it fits. Bins used form a prefix 0..k-1."""
  order_B = jnp.argsort(-lengths_B, stable=True)

  def place(fills_K, i):
    n = lengths_B[i]
    k = jnp.argmax(fills_K + n <= capacity)  # an empty bin always fits (n <= capacity)
    return fills_K.at[k].add(n), (k, fills_K[k])

  _, (bins, offsets) = jax.lax.scan(place, jnp.zeros_like(lengths_B), order_B)
  bin_B = jnp.zeros_like(lengths_B).at[order_B].set(bins)
  offset_B = jnp.zeros_like(lengths_B).at[order_B].set(offsets)
  return bin_B, offset_B


@functools.partial(jax.jit, static_argnames=("packing",))
def plan(valid_BxT: jax.Array, *, packing: Packing) -> Plan:
  """The packing of the sequences of `valid_BxT` (each a contiguous span of valid tokens, length <= packing.length)."""
  b, t = valid_BxT.shape
  r, length = packing
  if length < t:
    raise ValueError(f"packed rows of {length} tokens cannot hold a sequence of {t}.")
  m = micro_batches(b, packing)
  valid_BxT = valid_BxT.astype(bool)
  lengths_B = valid_BxT.sum(axis=1, dtype=jnp.int32)
  start_B = jnp.argmax(valid_BxT, axis=1).astype(jnp.int32)
  bin_B, offset_B = first_fit_decreasing(lengths_B, length)
  col_BxT = offset_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :] - start_B[:, None]
  size = m * r * length
  dest_BxT = jnp.where(valid_BxT, bin_B[:, None] * length + col_BxT, size)
  src = jnp.full((size,), -1, jnp.int32).at[dest_BxT.reshape(-1)].set(jnp.arange(b * t, dtype=jnp.int32),
                                                                       mode="drop")
  bins_used = jnp.max(jnp.where(lengths_B > 0, bin_B, -1)) + 1
  src_MxRxL = src.reshape(m, r, length)
  row_BxT = jnp.broadcast_to(jnp.arange(1, b + 1, dtype=jnp.int32)[:, None], (b, t))
  return Plan(dest_BxT, src_MxRxL, ((bins_used + r - 1) // r).astype(jnp.int32), _gather(src_MxRxL, row_BxT),
              _gather(src_MxRxL, positions_from_valid(valid_BxT)))


def _gather(src_MxRxL: jax.Array, x_BxT: jax.Array) -> jax.Array:
  b, t = x_BxT.shape[:2]
  out = jnp.take(x_BxT.reshape(b * t, *x_BxT.shape[2:]), jnp.maximum(src_MxRxL, 0), axis=0)
  keep = (src_MxRxL >= 0).reshape(src_MxRxL.shape + (1,) * (x_BxT.ndim - 2))
  return jnp.where(keep, out, jnp.zeros((), x_BxT.dtype))


def pack(plan_: Plan, x_BxT: jax.Array) -> jax.Array:
  """(B, T, ...) -> (M, R, L, ...): each token at its packed place, zeros (False) in the packing's padding."""
  return _gather(plan_.src_MxRxL, x_BxT)


def unpack(plan_: Plan, x_MxRxL: jax.Array) -> jax.Array:
  """(M, R, L, ...) -> (B, T, ...): each padded token's value from its packed place, zeros at the padding."""
  m, r, length = x_MxRxL.shape[:3]
  flat = x_MxRxL.reshape(m * r * length, *x_MxRxL.shape[3:])
  dest = plan_.dest_BxT
  out = jnp.take(flat, jnp.minimum(dest, m * r * length - 1), axis=0)
  keep = (dest < m * r * length).reshape(dest.shape + (1,) * (x_MxRxL.ndim - 3))
  return jnp.where(keep, out, jnp.zeros((), x_MxRxL.dtype))
