"""Single-token decode attention over a KV cache with ragged lengths: a jnp reference and a Pallas kernel.

Semantics (both implementations): query head n of sequence b attends kv head n // (N // K) at the cache slots
starts_B[b] <= s < lengths_B[b] (lengths are clipped to [0, S], starts to [0, length]; starts default to 0, and
left-padded prompts pass their padding count); the other slots are ignored, whatever they hold (NaN included).
Scores are scaled by H**-0.5; scores, softmax and the value sum are accumulated in float32; the output has q's dtype.
A row with no slot to attend has zeros as output.

The cache is either one layer, k_BxSxKxH, or the model's whole stacked cache k_LxBxSxKxH with a `layer` index
(an int or an int32 scalar in [0, L)): the kernel then reads that layer in place (slicing it out first would copy
all S slots on every call), and one compiled kernel serves every layer.
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


def _layer_of(k, v, layer):
  """One layer's (B, S, K, H) cache from a layer or a stacked cache (see the module docstring)."""
  return (k, v) if layer is None else (k[layer], v[layer])


def decode_attention_reference(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, starts_B=None, *, layer=None):
  """Plain-jnp decode attention with the semantics of the module docstring. Returns out_BxNxH."""
  k_BxSxKxH, v_BxSxKxH = _layer_of(k_BxSxKxH, v_BxSxKxH, layer)
  b, n, h = q_BxNxH.shape
  s, kv = k_BxSxKxH.shape[1:3]
  slot_S = jnp.arange(s)[None, :]
  valid_BxS = slot_S < lengths_B[:, None]
  if starts_B is not None:
    valid_BxS &= slot_S >= starts_B[:, None]
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


def _kernel(layer_ref, start_ref, length_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int):
  """One (sequence, kv head). q_ref, o_ref: (R, H), the group's query heads (zero-padded to R rows);
  k_ref, v_ref: (L, S, H), that kv head's column of every layer's cache, read only in layer layer_ref[0] and in
  the blocks the loops visit."""
  _, s, h = k_ref.shape
  layer = layer_ref[0]
  rows = q_ref.shape[0]
  length = jnp.clip(length_ref[...], 0, s)
  start = jnp.clip(start_ref[...], 0, length)
  dtype = jnp.result_type(q_ref.dtype, k_ref.dtype, v_ref.dtype)  # of both dots' inputs
  q_RxH = q_ref[...].astype(dtype)

  def visit(i, carry, masked: bool):
    """Online-softmax update with block i. `masked`: a block holding the start or the length, shifted back to
    end at S if it would overrun; its slots before i * block_s (visited already) or the start, and from the length
    on, get zero weight."""
    max_R, total_R, acc_RxH = carry
    offset = jnp.minimum(i * block_s, s - block_s) if masked else i * block_s
    k_CxH = k_ref[layer, pl.ds(offset, block_s), :].astype(dtype)
    v_CxH = v_ref[layer, pl.ds(offset, block_s), :].astype(dtype)
    scores_RxC = lax.dot_general(q_RxH, k_CxH, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                 preferred_element_type=jnp.float32) * h**-0.5
    if masked:
      slot_C = offset + jnp.arange(block_s)
      valid_C = (slot_C >= jnp.maximum(i * block_s, start)) & (slot_C < length)
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
  # Blocks [first_full, end_full) lie wholly in [start, length); the block holding the start (when it is not a
  # block boundary) and the one holding the length (when it is not) are masked. Nothing is visited when start ==
  # length.
  first_full, end_full = pl.cdiv(start, block_s), length // block_s
  end = jnp.where(start < length, pl.cdiv(length, block_s), 0)
  masked, unmasked = functools.partial(visit, masked=True), functools.partial(visit, masked=False)
  carry = lax.fori_loop(start // block_s, jnp.minimum(first_full, end), masked, carry)
  carry = lax.fori_loop(first_full, end_full, unmasked, carry)
  carry = lax.fori_loop(jnp.maximum(first_full, end_full), end, masked, carry)
  _, total_R, acc_RxH = carry
  o_ref[...] = (acc_RxH / jnp.where(total_R > 0, total_R, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def decode_attention_pallas(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, starts_B=None, *, layer=None,
                            block_s: int = 128, interpret: bool = False):
  """Pallas decode attention, same semantics and shapes as `decode_attention_reference`.

  Grid (B, K): each program takes one sequence's kv head and its G = N // K query heads as one tile, and walks the
  cache in blocks of `block_s` slots with an online softmax: the block holding the start, masked, then the blocks
  wholly inside [start, length), unmasked, then the block holding the length, masked. Blocks wholly outside
  [start, length) are never read. The cache is read in place: the BlockSpec picks the kv-head column of the
  (L x) B x S x K x H layout and the kernel indexes the layer. S need not be a multiple of block_s (the last block
  is shifted back to end at slot S and its overlap masked); a block_s above S becomes the largest power of two
  <= S. On GPU (Triton) H and block_s must be powers of two >= 16. `interpret=True` runs on CPU.
  """
  if layer is None:
    k_BxSxKxH, v_BxSxKxH, layer = k_BxSxKxH[None], v_BxSxKxH[None], 0  # a free reshape: one code path
  b, n, h = q_BxNxH.shape
  _, _, s, kv, _ = k_BxSxKxH.shape
  if n % kv:
    raise ValueError(f"{n} query heads do not divide into {kv} kv heads")
  if v_BxSxKxH.shape != k_BxSxKxH.shape or k_BxSxKxH.shape[1] != b or k_BxSxKxH.shape[4] != h:
    raise ValueError(f"q {q_BxNxH.shape}, k {k_BxSxKxH.shape}, v {v_BxSxKxH.shape} do not match (B,N,H), "
                     "([L,] B,S,K,H)")
  if block_s < 1:
    raise ValueError(f"block_s must be positive, got {block_s}")
  if block_s > s:
    block_s = 1 << (s.bit_length() - 1)
  g = n // kv
  rows = max(_MIN_QUERY_ROWS, pl.next_power_of_2(g))
  q_BxKxRxH = jnp.pad(q_BxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  cache_spec = pl.BlockSpec((k_BxSxKxH.shape[0], None, s, None, h), lambda i, j: (0, i, 0, j, 0))
  group_spec = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
  row_spec = pl.BlockSpec((None,), lambda i, j: (i,))
  starts_B = jnp.zeros((b,), jnp.int32) if starts_B is None else starts_B.astype(jnp.int32)
  out_BxKxRxH = pl.pallas_call(
      functools.partial(_kernel, block_s=block_s),
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxH.shape, q_BxNxH.dtype),
      grid=(b, kv),
      in_specs=[pl.BlockSpec((1,), lambda i, j: (0,)), row_spec, row_spec, group_spec, cache_spec, cache_spec],
      out_specs=group_spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(),  # Triton on GPU: jax 0.10 defaults to Mosaic GPU
      name="decode_attention",
  )(jnp.full((1,), layer, jnp.int32), starts_B, lengths_B.astype(jnp.int32), q_BxKxRxH, k_BxSxKxH, v_BxSxKxH)
  return out_BxKxRxH[:, :, :g].reshape(b, n, h)


def default_backend() -> str:
  """The backend for `decode_attention`: "pallas" on GPU or TPU, else "xla" (Pallas on CPU only interprets)."""
  return "pallas" if jax.default_backend() in ("gpu", "tpu") else "xla"


def decode_attention(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, starts_B=None, *, backend: str, layer=None):
  """Decode attention by `backend` (one of BACKENDS): "pallas" is the kernel with its default block (interpret mode
  on CPU), "xla" the reference. Returns out_BxNxH."""
  if backend == "xla":
    return decode_attention_reference(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, starts_B, layer=layer)
  if backend == "pallas":
    return decode_attention_pallas(q_BxNxH, k_BxSxKxH, v_BxSxKxH, lengths_B, starts_B, layer=layer,
                                   interpret=jax.default_backend() == "cpu")
  raise ValueError(f"unknown decode attention backend {backend!r}; choose one of {BACKENDS}")
