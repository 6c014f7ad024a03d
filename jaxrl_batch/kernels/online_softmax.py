"""The online softmax both Pallas decode-attention kernels run over one (sequence, kv head)'s span, block by block.

A running max m, running total l and running accumulator a (all float32) over the blocks visited so far: for a
block of C slots with scores s = q k / sqrt(H), m' = max(m, max s), a' = e^(m - m') a + e^(s - m') v and
l' = e^(m - m') l + sum e^(s - m'); the output is a / l (0 where nothing was visited).
"""
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


def update(carry, q_RxH, k_HxC, v_CxH, valid_C=None):
  """One block: the R query rows against its C slots; slots where valid_C is False get zero weight. carry:
  (max_R, total_R, acc_RxH) float32. The dots run in q's dtype (k and v already cast to it) with f32 results."""
  max_R, total_R, acc_RxH = carry
  scores_RxC = lax.dot_general(q_RxH, k_HxC, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32) * q_RxH.shape[1]**-0.5
  if valid_C is not None:
    scores_RxC = jnp.where(valid_C[None, :], scores_RxC, -jnp.inf)
    v_CxH = jnp.where(valid_C[:, None], v_CxH, 0)
  new_max_R = jnp.maximum(max_R, jnp.max(scores_RxC, axis=1))
  rescale_R = jnp.exp(max_R - new_max_R)
  weights_RxC = jnp.exp(scores_RxC - new_max_R[:, None])
  acc_RxH = rescale_R[:, None] * acc_RxH + lax.dot_general(
      weights_RxC.astype(v_CxH.dtype), v_CxH, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)
  return new_max_R, rescale_R * total_R + jnp.sum(weights_RxC, axis=1), acc_RxH


def over_span(visit, start, length, block: int, rows: int, h: int):
  """(R, H) float32 attention output over slots [start, length), visiting blocks of `block` slots:
  visit(i, carry, masked) -> carry updates with block i (`update`). Blocks [first_full, end_full) lie wholly in the
  span and are visited unmasked; the block holding the start (when it is not a block boundary) and the one holding
  the length (when it is not) are visited masked. Nothing is visited when start == length. Every visited block
  holds a valid slot, so the running max is finite after the first one."""
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, h), jnp.float32))
  first_full, end_full = pl.cdiv(start, block), length // block
  end = jnp.where(start < length, pl.cdiv(length, block), 0)
  masked, unmasked = functools.partial(visit, masked=True), functools.partial(visit, masked=False)
  carry = lax.fori_loop(start // block, jnp.minimum(first_full, end), masked, carry)
  carry = lax.fori_loop(first_full, end_full, unmasked, carry)
  carry = lax.fori_loop(jnp.maximum(first_full, end_full), end, masked, carry)
  _, total_R, acc_RxH = carry
  return acc_RxH / jnp.where(total_R > 0, total_R, 1.0)[:, None]
