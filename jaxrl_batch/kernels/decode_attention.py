"""Single-token decode attention over a KV cache with ragged spans: its definition and its two backends.

Semantics: query head n of sequence b attends kv head n // (N // K) at the cache slots starts_B[b] <= s <
lengths_B[b] (lengths are clipped to [0, S], starts to [0, length]; starts default to 0, and left-padded prompts pass
their padding count); the other slots are ignored, whatever they hold (NaN included). Scores are scaled by H**-0.5;
scores, softmax and the value sum are in float32; the output has q's dtype. A row with no slot to attend has zeros as
output. `decode_attention_reference` is this definition in plain jnp (for tests); the backends of
`decode_attention`, both tested against it, are
  xla: `decode_attention_xla`, broadcast products and sums over the whole cache, the span applied as a mask;
  pallas: a kernel that reads only the cache blocks inside the span: on GPU `decode_attention_pallas`, written for
    Triton (interpret mode on CPU); on TPU `tpu_decode_attention.decode_attention_mosaic`, its Mosaic form.

The cache is one layer's in the `jaxrl_batch.model.KVCache` layout, keys k_BxKxHxS and values v_BxKxSxH: each
(sequence, kv head) owns one contiguous H x S and one S x H block, which both backends read in place.
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_batch.kernels import online_softmax
from jaxrl_batch.kernels.platform import current_platform
from jaxrl_batch.kernels.tpu_decode_attention import decode_attention_mosaic, on_mesh

BACKENDS = ("pallas", "xla")
# Triton's dot wants every operand dimension >= 16 and power-of-two tensor sizes, so the G query heads of a kv group
# are zero-padded to max(16, next power of two) rows; interpret mode runs the same padded program.
MIN_QUERY_ROWS = 16
_NEG_INF = -1e30


def decode_attention_reference(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None):
  """Plain-jnp decode attention with the semantics of the module docstring. Returns out_BxNxH."""
  b, n, h = q_BxNxH.shape
  kv, s = v_BxKxSxH.shape[1:3]
  slot_S = jnp.arange(s)[None, :]
  valid_BxS = slot_S < lengths_B[:, None]
  if starts_B is not None:
    valid_BxS &= slot_S >= starts_B[:, None]
  q_BxKxGxH = q_BxNxH.astype(jnp.float32).reshape(b, kv, n // kv, h)
  v_BxKxSxH = jnp.where(valid_BxS[:, None, :, None], v_BxKxSxH.astype(jnp.float32), 0.0)
  scores_BxKxGxS = jnp.einsum("bkgh,bkhs->bkgs", q_BxKxGxH, k_BxKxHxS.astype(jnp.float32),
                              precision=lax.Precision.HIGHEST) * h**-0.5
  scores_BxKxGxS = jnp.where(valid_BxS[:, None, None, :], scores_BxKxGxS, -jnp.inf)
  max_BxKxGx1 = jnp.max(scores_BxKxGxS, axis=-1, keepdims=True)
  weights_BxKxGxS = jnp.exp(scores_BxKxGxS - jnp.where(jnp.isfinite(max_BxKxGx1), max_BxKxGx1, 0.0))
  total_BxKxGx1 = jnp.sum(weights_BxKxGxS, axis=-1, keepdims=True)
  out_BxKxGxH = jnp.einsum("bkgs,bksh->bkgh", weights_BxKxGxS, v_BxKxSxH, precision=lax.Precision.HIGHEST)
  out_BxKxGxH = out_BxKxGxH / jnp.where(total_BxKxGx1 > 0, total_BxKxGx1, 1.0)
  return out_BxKxGxH.reshape(b, n, h).astype(q_BxNxH.dtype)


def decode_attention_xla(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None):
  """Decode attention as broadcast products and sums over the rows of the cache blocks, in float32: XLA fuses each
  into one vectorised pass over the cache. Its CPU batched dots with M = G query rows per kv head ran 1.2-2x slower on
  a 2-core EPYC and as fast on a 2-core Xeon (B = 64, S = 96-512, measured). Every slot is read; those outside the
  span are masked (scores to -1e30, values to 0). Same semantics and shapes as `decode_attention_reference`."""
  b, n, h = q_BxNxH.shape
  kv, s = v_BxKxSxH.shape[1:3]
  slot_1xS = jnp.arange(s)[None, :]
  valid_BxS = slot_1xS < lengths_B[:, None]
  if starts_B is not None:
    valid_BxS &= slot_1xS >= starts_B[:, None]
  q_BxKxGxHx1 = q_BxNxH.astype(jnp.float32).reshape(b, kv, n // kv, h, 1) * h**-0.5
  scores_BxKxGxS = jnp.sum(q_BxKxGxHx1 * k_BxKxHxS[:, :, None].astype(jnp.float32), axis=3)
  scores_BxKxGxS = jnp.where(valid_BxS[:, None, None], scores_BxKxGxS, _NEG_INF)
  probs_BxKxGxSx1 = jax.nn.softmax(scores_BxKxGxS, axis=-1)[..., None]
  # Values are masked as broadcast to the G query heads, inside the fused sum: masked as (B, K, S, H), XLA
  # materialises a masked copy of the layer's values every step; masking the products instead changes the rounding.
  v_BxKxGxSxH = jnp.where(valid_BxS[:, None, None, :, None], v_BxKxSxH[:, :, None].astype(jnp.float32), 0.0)
  out_BxKxGxH = jnp.sum(probs_BxKxGxSx1 * v_BxKxGxSxH, axis=3)
  return out_BxKxGxH.reshape(b, n, h).astype(q_BxNxH.dtype)


def _kernel(start_ref, length_ref, q_ref, k_ref, v_ref, o_ref, *, block_s: int):
  """One (sequence, kv head). q_ref, o_ref: (R, H), the group's query heads (zero-padded to R rows);
  k_ref: (H, S) and v_ref: (S, H), that kv head's cache, read only in the blocks the loops visit."""
  h, s = k_ref.shape
  rows = q_ref.shape[0]
  length = jnp.clip(length_ref[...], 0, s)
  start = jnp.clip(start_ref[...], 0, length)
  dtype = jnp.result_type(q_ref.dtype, k_ref.dtype, v_ref.dtype)  # of both dots' inputs
  q_RxH = q_ref[...].astype(dtype)

  def visit(i, carry, masked: bool):
    """`online_softmax.update` with block i. `masked`: a block holding the start or the length, shifted back to end
    at S if it would overrun; its slots before i * block_s (visited already) or the start, and from the length on,
    get zero weight."""
    offset = jnp.minimum(i * block_s, s - block_s) if masked else i * block_s
    slot_C = offset + jnp.arange(block_s)
    valid_C = ((slot_C >= jnp.maximum(i * block_s, start)) & (slot_C < length)) if masked else None
    return online_softmax.update(carry, q_RxH, k_ref[:, pl.ds(offset, block_s)].astype(dtype),
                                 v_ref[pl.ds(offset, block_s), :].astype(dtype), valid_C)

  o_ref[...] = online_softmax.over_span(visit, start, length, block_s, rows, h).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def decode_attention_pallas(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None, *, block_s: int = 128,
                            interpret: bool = False):
  """Pallas decode attention, same semantics and shapes as `decode_attention_reference`.

  Grid (B, K): each program takes one sequence's kv head and its G = N // K query heads as one tile, and walks the
  cache in blocks of `block_s` slots with an online softmax: the block holding the start, masked, then the blocks
  wholly inside [start, length), unmasked, then the block holding the length, masked. Blocks wholly outside
  [start, length) are never read. The cache is read in place: the BlockSpecs pick the (sequence, kv head) H x S
  and S x H blocks of the keys and values. S need not be a multiple of block_s (the last block
  is shifted back to end at slot S and its overlap masked); a block_s above S becomes the largest power of two
  <= S. On GPU (Triton) H and block_s must be powers of two >= 16. `interpret=True` runs on CPU.
  """
  b, n, h = q_BxNxH.shape
  _, kv, s, _ = v_BxKxSxH.shape
  if n % kv:
    raise ValueError(f"{n} query heads do not divide into {kv} kv heads")
  if v_BxKxSxH.shape != (b, kv, s, h) or k_BxKxHxS.shape != (b, kv, h, s):
    raise ValueError(f"q {q_BxNxH.shape}, k {k_BxKxHxS.shape}, v {v_BxKxSxH.shape} do not match (B,N,H), "
                     "(B,K,H,S), (B,K,S,H)")
  if block_s < 1:
    raise ValueError(f"block_s must be positive, got {block_s}")
  if block_s > s:
    block_s = 1 << (s.bit_length() - 1)
  g = n // kv
  rows = max(MIN_QUERY_ROWS, pl.next_power_of_2(g))
  q_BxKxRxH = jnp.pad(q_BxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  k_spec = pl.BlockSpec((None, None, h, s), lambda i, j: (i, j, 0, 0))
  v_spec = pl.BlockSpec((None, None, s, h), lambda i, j: (i, j, 0, 0))
  group_spec = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
  row_spec = pl.BlockSpec((None,), lambda i, j: (i,))
  starts_B = jnp.zeros((b,), jnp.int32) if starts_B is None else starts_B.astype(jnp.int32)
  out_BxKxRxH = pl.pallas_call(
      functools.partial(_kernel, block_s=block_s),
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxH.shape, q_BxNxH.dtype),
      grid=(b, kv),
      in_specs=[row_spec, row_spec, group_spec, k_spec, v_spec],
      out_specs=group_spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(),  # Triton on GPU: jax 0.10 defaults to Mosaic GPU
      name="decode_attention",
  )(starts_B, lengths_B.astype(jnp.int32), q_BxKxRxH, k_BxKxHxS, v_BxKxSxH)
  return out_BxKxRxH[:, :, :g].reshape(b, n, h)


def decode_attention_triton(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None, *, interpret: bool = False):
  """`decode_attention_pallas` (Triton on GPU) under a mesh in a `jax.shard_map`, as the Mosaic kernel is
  (`tpu_decode_attention.on_mesh`: rows over the batch axes, kv heads over `tensor`). XLA cannot partition a Pallas
  call: left to it, each chip gathers every query head and the whole cache at every decode step (seen compiled for
  qwen2.5-7b on 4 H100s with tensor = 4: 15 GB of all-gathers a decode chunk)."""
  def local(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B, kv_first, *, kv_heads):
    if kv_heads < k_BxKxHxS.shape[1]:  # The one kv head this shard's query heads share.
      k_BxKxHxS = lax.dynamic_slice_in_dim(k_BxKxHxS, kv_first[0], kv_heads, axis=1)
      v_BxKxSxH = lax.dynamic_slice_in_dim(v_BxKxSxH, kv_first[0], kv_heads, axis=1)
    return decode_attention_pallas(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B, interpret=interpret)
  return on_mesh(local, q_BxNxH, (k_BxKxHxS, v_BxKxSxH), lengths_B, starts_B)


# `jax.default_backend()` names and `jax.export` targets on which the kernel lowers (through Triton or Mosaic).
_KERNEL_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def backend_for(platform: str) -> str:
  """The backend "auto" stands for on `platform`, a `jax.default_backend()` name ("cpu", "gpu", "tpu") or an export
  target ("cuda", "rocm"): "pallas" on GPU and TPU, else "xla" (on CPU Pallas only interprets). On TPU the compiled
  costs decide (launch/bench_decode_attention.py, docs/engines.md): for qwen2.5-1.5b's shapes on v5p the Mosaic
  kernel reads 5-9x fewer bytes than the XLA form at every concurrency, with every row at full length."""
  return "pallas" if platform in _KERNEL_PLATFORMS else "xla"


def default_backend() -> str:
  """`backend_for` the platform traced for (`kernels.platform`: a compile-only TPU mesh counts as TPU)."""
  return backend_for(current_platform())


def decode_attention(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None, *, backend: str):
  """Decode attention by `backend` (one of BACKENDS): "xla" is `decode_attention_xla`, "pallas" the kernel with its
  default block. Returns out_BxNxH.

  The pallas form follows the platform lowered for (`lax.platform_dependent`), not the machine tracing: interpret
  mode for CPU, Triton for GPU (so an export for "cuda" from a CPU machine holds the Triton kernel), Mosaic for TPU
  (both in a `shard_map` under a mesh). Export it for one platform at a time: in a multi-platform export jax lowers every
  kept branch for every platform listed, and the Triton kernel does not lower for CPU."""
  if backend == "xla":
    return decode_attention_xla(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B)
  if backend == "pallas":
    return lax.platform_dependent(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B,
                                  cpu=functools.partial(decode_attention_pallas, interpret=True),
                                  tpu=decode_attention_mosaic,
                                  default=decode_attention_triton)
  raise ValueError(f"unknown decode attention backend {backend!r}; choose one of {BACKENDS}")
