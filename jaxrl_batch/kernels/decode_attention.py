"""Single-token decode attention over a KV cache with ragged lengths: a jnp reference and a Pallas kernel.

Semantics (both implementations): query head n of sequence b attends kv head n // (N // K) at the cache slots
s < lengths_B[b] (lengths are clipped to [0, S]); the other slots are ignored, whatever they hold (NaN included).
Scores are scaled by H**-0.5; scores, softmax and the value sum are accumulated in float32; the output has q's dtype.
A row of length 0 attends nothing and its output is zeros.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

BACKENDS = ("pallas", "xla")
# Triton's dot wants every operand dimension >= 16 and power-of-two tensor sizes, so the G query heads of a kv group
# are zero-padded to max(16, next power of two) rows; interpret mode runs the same padded program.
_MIN_QUERY_ROWS = 16


def decode_attention_reference(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B):
  """Plain-jnp decode attention with the semantics of the module docstring. Returns out_BxNxH."""
  b, n, h = q_BxNxH.shape
  s, kv = k_BxSxKxH.shape[1:3]
  valid_BxS = jnp.arange(s)[None, :] < lengths_B[:, None]
  q_BxKxGxH = q_BxNxH.astype(jnp.float32).reshape(b, kv, n // kv, h)
  v_BxSxKxH = jnp.where(valid_BxS[:, :, None, None], v_BxSxKxH.astype(jnp.float32), 0.0)
  scores_BxKxGxS = jnp.einsum("bkgh,bskh->bkgs", q_BxKxGxH, k_BxSxKxH.astype(jnp.float32),
                              precision=lax.Precision.HIGHEST) * h**-0.5
  scores_BxKxGxS = jnp.where(valid_BxS[:, None, None, :], scores_BxKxGxS, -jnp.inf)
  max_BxKxGx1 = jnp.max(scores_BxKxGxS, axis=-1, keepdims=True)
  weights_BxKxGxS = jnp.exp(scores_BxKxGxS - jnp.where(jnp.isfinite(max_BxKxGx1), max_BxKxGx1, 0.0))
  total_BxKxGx1 = jnp.sum(weights_BxKxGxS, axis=-1, keepdims=True)
  out_BxKxGxH = jnp.einsum("bkgs,bskh->bkgh", weights_BxKxGxS, v_BxSxKxH, precision=lax.Precision.HIGHEST)
  out_BxKxGxH = out_BxKxGxH / jnp.where(total_BxKxGx1 > 0, total_BxKxGx1, 1.0)
  return out_BxKxGxH.reshape(b, n, h).astype(q_BxNxH.dtype)


def _kernel(length_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int):
  """One (sequence, kv head). q_ref, o_ref: (R, H), the group's query heads (zero-padded to R rows);
  k_ref, v_ref: (S, H), that kv head's column of the cache, read only in the blocks the loops visit."""
  s, h = k_ref.shape
  rows = q_ref.shape[0]
  length = jnp.clip(length_ref[...], 0, s)
  dtype = jnp.result_type(q_ref.dtype, k_ref.dtype, v_ref.dtype)  # of both dots' inputs
  q_RxH = q_ref[...].astype(dtype)

  def visit(i, carry, masked: bool):
    """Online-softmax update with block i. `masked`: the block holding the length, shifted back to end at S if
    it would overrun; its slots before i * block_s (visited already) and from the length on get zero weight."""
    max_R, total_R, acc_RxH = carry
    start = jnp.minimum(i * block_s, s - block_s) if masked else i * block_s
    k_CxH = k_ref[pl.ds(start, block_s), :].astype(dtype)
    v_CxH = v_ref[pl.ds(start, block_s), :].astype(dtype)
    scores_RxC = lax.dot_general(q_RxH, k_CxH, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32) * h**-0.5
    if masked:
      slot_C = start + jnp.arange(block_s)
      valid_C = (slot_C >= i * block_s) & (slot_C < length)
      scores_RxC = jnp.where(valid_C[None, :], scores_RxC, -jnp.inf)
      v_CxH = jnp.where(valid_C[:, None], v_CxH, 0)
    new_max_R = jnp.maximum(max_R, jnp.max(scores_RxC, axis=1))
    rescale_R = jnp.exp(max_R - new_max_R)
    weights_RxC = jnp.exp(scores_RxC - new_max_R[:, None])
    acc_RxH = rescale_R[:, None] * acc_RxH + lax.dot_general(
        weights_RxC.astype(dtype), v_CxH, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32)
    return new_max_R, rescale_R * total_R + jnp.sum(weights_RxC, axis=1), acc_RxH

  # Every visited block holds a valid slot, so the running max is finite after the first one.
  carry = (jnp.full((rows,), -jnp.inf, jnp.float32), jnp.zeros((rows,), jnp.float32),
           jnp.zeros((rows, h), jnp.float32))
  full_blocks = length // block_s
  carry = lax.fori_loop(0, full_blocks, functools.partial(visit, masked=False), carry)
  carry = lax.fori_loop(full_blocks, pl.cdiv(length, block_s), functools.partial(visit, masked=True), carry)
  _, total_R, acc_RxH = carry
  o_ref[...] = (acc_RxH / jnp.where(total_R > 0, total_R, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def decode_attention_pallas(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, *, block_s: int = 128,
                            interpret: bool = False):
  """Pallas decode attention, same semantics and shapes as `decode_attention_reference`.

  Grid (B, K): each program takes one sequence's kv head and its G = N // K query heads as one tile, and walks the
  cache in blocks of `block_s` slots with an online softmax: first the blocks wholly below the length, unmasked,
  then the block holding the length, masked. Blocks wholly at or past the length are never read. The cache is read
  in place; the BlockSpec picks the kv-head column of the B x S x K x H layout. S need not be a multiple of block_s
  (the last block is shifted back to end at slot S and its overlap masked); a block_s above S becomes the largest
  power of two <= S. On GPU (Triton) H and block_s must be powers of two >= 16. `interpret=True` runs on CPU.
  """
  b, n, h = q_BxNxH.shape
  _, s, kv, _ = k_BxSxKxH.shape
  if n % kv:
    raise ValueError(f"{n} query heads do not divide into {kv} kv heads")
  if v_BxSxKxH.shape != k_BxSxKxH.shape or k_BxSxKxH.shape[0] != b or k_BxSxKxH.shape[3] != h:
    raise ValueError(f"q {q_BxNxH.shape}, k {k_BxSxKxH.shape}, v {v_BxSxKxH.shape} do not match (B,N,H), (B,S,K,H)")
  if block_s < 1:
    raise ValueError(f"block_s must be positive, got {block_s}")
  if block_s > s:
    block_s = 1 << (s.bit_length() - 1)
  g = n // kv
  rows = max(_MIN_QUERY_ROWS, pl.next_power_of_2(g))
  q_BxKxRxH = jnp.pad(q_BxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  cache_spec = pl.BlockSpec((None, s, None, h), lambda i, j: (i, 0, j, 0))
  group_spec = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
  out_BxKxRxH = pl.pallas_call(
      functools.partial(_kernel, block_s=block_s),
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxH.shape, q_BxNxH.dtype),
      grid=(b, kv),
      in_specs=[pl.BlockSpec((None,), lambda i, j: (i,)), group_spec, cache_spec, cache_spec],
      out_specs=group_spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(),  # Triton on GPU: jax 0.10 defaults to Mosaic GPU
      name="decode_attention",
  )(lengths_B.astype(jnp.int32), q_BxKxRxH, k_BxSxKxH, v_BxSxKxH)
  return out_BxKxRxH[:, :, :g].reshape(b, n, h)


def default_backend() -> str:
  """The backend for `decode_attention`: "pallas" on GPU or TPU, else "xla" (Pallas on CPU only interprets)."""
  return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"


def decode_attention(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, *, backend: str):
  """Decode attention by `backend` (one of BACKENDS): "pallas" is the kernel with its default block (interpret mode
  on CPU), "xla" the reference. Returns out_BxNxH."""
  if backend == "xla":
    return decode_attention_reference(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B)
  if backend == "pallas":
    return decode_attention_pallas(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B,
                                   interpret=jax.default_backend() == "cpu")
  raise ValueError(f"unknown decode attention backend {backend!r}; choose one of {BACKENDS}")
