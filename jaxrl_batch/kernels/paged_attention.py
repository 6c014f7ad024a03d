"""Single-token decode attention over a paged KV cache: its definition and its two backends.

One layer's cache is a pool of P pages of C slots each, keys k_pages_PxKxHxC and values v_pages_PxKxCxH (the
`decode_attention` layout with pages in place of sequences: keys transposed). Sequence b's logical cache slot s lives
in page table_BxM[b, s // C] at offset s % C, so each sequence sees a logical cache of M * C slots, and sequences may
share pages (a group's prompt pages are shared).

Semantics: exactly those of `decode_attention` over the logical slots [0, M * C): query head n of sequence b attends
kv head n // (N // K) at the logical slots starts_B[b] <= s < lengths_B[b] (lengths are clipped to [0, M * C], starts
to [0, length]; starts default to 0); every other slot is ignored, whatever it holds (NaN included), and a table entry
naming a logical page wholly outside [start, length) may be any page id in [0, P). Scores are scaled by H**-0.5;
scores, softmax and the value sum are in float32; the output has q's dtype. A row with no slot to attend has zeros as
output. `paged_decode_attention_reference` is this definition in plain jnp (for tests); the backends of
`paged_decode_attention`, both tested against it, are
  xla: `paged_decode_attention_xla`, the table's M pages of each sequence gathered into the dense layout and
    `decode_attention_xla` over it (callers pass a table cut to the live pages);
  pallas: a kernel that reads only the pages holding the span, in place in the pool: on GPU
    `paged_decode_attention_pallas`, written for Triton (interpret mode on CPU); on TPU
    `tpu_decode_attention.paged_decode_attention_mosaic`, its Mosaic form (JAX's TPU paged kernels want another pool
    layout and no starts: that module says why it does not use them).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from jaxrl_batch.kernels import online_softmax
from jaxrl_batch.kernels.decode_attention import (
  BACKENDS,
  MIN_QUERY_ROWS,
  decode_attention_reference,
  decode_attention_xla,
)
from jaxrl_batch.kernels.tpu_decode_attention import paged_decode_attention_mosaic


def _check_shapes(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM):
  """Raises a ValueError unless the shapes are (B, N, H), (P, K, H, C), (P, K, C, H), (B, M) with K dividing N."""
  b, n, h = q_BxNxH.shape
  p, kv, c, _ = v_pages_PxKxCxH.shape
  if n % kv:
    raise ValueError(f"{n} query heads do not divide into {kv} kv heads")
  if (v_pages_PxKxCxH.shape != (p, kv, c, h) or k_pages_PxKxHxC.shape != (p, kv, h, c) or table_BxM.ndim != 2
      or table_BxM.shape[0] != b):
    raise ValueError(f"q {q_BxNxH.shape}, k_pages {k_pages_PxKxHxC.shape}, v_pages {v_pages_PxKxCxH.shape}, table "
                     f"{table_BxM.shape} do not match (B,N,H), (P,K,H,C), (P,K,C,H), (B,M)")


def paged_decode_attention_reference(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B=None):
  """Plain-jnp paged decode attention with the semantics of the module docstring: each logical slot s of sequence b
  read from page table_BxM[b, s // C] at offset s % C into a dense k_BxKxHxS, v_BxKxSxH (S = M * C), then
  `decode_attention_reference`. Returns out_BxNxH."""
  _check_shapes(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM)
  c, m = v_pages_PxKxCxH.shape[2], table_BxM.shape[1]
  slot_S = jnp.arange(m * c)
  page_BxS, offset_1xS = table_BxM[:, slot_S // c], (slot_S % c)[None, :]
  k_BxSxKxH = k_pages_PxKxHxC[page_BxS, :, :, offset_1xS]
  v_BxSxKxH = v_pages_PxKxCxH[page_BxS, :, offset_1xS, :]
  k_BxKxHxS = jnp.transpose(k_BxSxKxH, (0, 2, 3, 1))
  v_BxKxSxH = jnp.transpose(v_BxSxKxH, (0, 2, 1, 3))
  return decode_attention_reference(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B)


def paged_decode_attention_xla(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B=None):
  """The M pages the table names for each sequence, gathered from the pool into the dense (B, K, H, M * C) and
  (B, K, M * C, H) layout, and `decode_attention_xla` over it. Every gathered slot is read (those outside the span
  masked), so pass a table cut to the live pages. Same semantics and shapes as `paged_decode_attention_reference`."""
  _check_shapes(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM)
  _, kv, c, h = v_pages_PxKxCxH.shape
  b, m = table_BxM.shape
  k_BxKxHxMxC = jnp.transpose(k_pages_PxKxHxC[table_BxM], (0, 2, 3, 1, 4))
  v_BxKxMxCxH = jnp.transpose(v_pages_PxKxCxH[table_BxM], (0, 2, 1, 3, 4))
  return decode_attention_xla(q_BxNxH, k_BxKxHxMxC.reshape(b, kv, h, m * c), v_BxKxMxCxH.reshape(b, kv, m * c, h),
                              lengths_B, starts_B)


def _kernel(start_ref, length_ref, table_ref, q_ref, k_ref, v_ref, o_ref):
  """One (sequence, kv head). table_ref: (M,), the sequence's page ids; q_ref, o_ref: (R, H), the group's query heads
  (zero-padded to R rows); k_ref: (P, H, C) and v_ref: (P, C, H), that kv head's whole pool, read only in the pages
  the loops visit."""
  _, h, c = k_ref.shape
  m = table_ref.shape[0]
  rows = q_ref.shape[0]
  length = jnp.clip(length_ref[...], 0, m * c)
  start = jnp.clip(start_ref[...], 0, length)
  dtype = jnp.result_type(q_ref.dtype, k_ref.dtype, v_ref.dtype)  # of both dots' inputs
  q_RxH = q_ref[...].astype(dtype)

  def visit(i, carry, masked: bool):
    """`online_softmax.update` with logical page i, read from pool page table_ref[i]. `masked`: the page holding
    the start or the length; its slots before the start or from the length on get zero weight."""
    page = table_ref[i]
    slot_C = i * c + jnp.arange(c)
    valid_C = ((slot_C >= start) & (slot_C < length)) if masked else None
    return online_softmax.update(carry, q_RxH, k_ref[page].astype(dtype), v_ref[page].astype(dtype), valid_C)

  o_ref[...] = online_softmax.over_span(visit, start, length, c, rows, h).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("interpret",))
def paged_decode_attention_pallas(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B=None, *,
                                  interpret: bool = False):
  """Pallas paged decode attention, same semantics and shapes as `paged_decode_attention_reference`.

  Grid (B, K): each program takes one sequence's kv head and its G = N // K query heads as one tile (zero-padded to
  max(16, next power of two) rows), and walks the logical pages [start // C, cdiv(length, C)) with an online
  softmax: the page holding the start, masked, then the pages wholly inside [start, length), unmasked, then the page
  holding the length, masked. Each page's id is read from the sequence's table row, and its H x C keys and C x H
  values are read in place: the BlockSpecs give the program its kv head's whole pool (P, H, C) and (P, C, H), indexed
  by that dynamic page id (unchecked: the ids the span reads must be in [0, P)). Pages outside the span, and the table
  entries naming them, are never read. On GPU (Triton) H and C must be powers of two >= 16 (a non-power of two fails
  at lowering, a power below 16 only at Triton's compile on the GPU); P and M may be any size, since Triton needs
  power-of-two sizes only of what a program loads (a page, a query tile, a table entry), and a pool over 4 GiB gets
  64-bit offsets. `interpret=True` runs on CPU.
  """
  _check_shapes(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM)
  b, n, h = q_BxNxH.shape
  p, kv, c, _ = v_pages_PxKxCxH.shape
  m = table_BxM.shape[1]
  g = n // kv
  rows = max(MIN_QUERY_ROWS, pl.next_power_of_2(g))
  q_BxKxRxH = jnp.pad(q_BxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0)))
  k_spec = pl.BlockSpec((p, None, h, c), lambda i, j: (0, j, 0, 0))
  v_spec = pl.BlockSpec((p, None, c, h), lambda i, j: (0, j, 0, 0))
  group_spec = pl.BlockSpec((None, None, rows, h), lambda i, j: (i, j, 0, 0))
  table_spec = pl.BlockSpec((None, m), lambda i, j: (i, 0))
  row_spec = pl.BlockSpec((None,), lambda i, j: (i,))
  starts_B = jnp.zeros((b,), jnp.int32) if starts_B is None else starts_B.astype(jnp.int32)
  out_BxKxRxH = pl.pallas_call(
      _kernel,
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxH.shape, q_BxNxH.dtype),
      grid=(b, kv),
      in_specs=[row_spec, row_spec, table_spec, group_spec, k_spec, v_spec],
      out_specs=group_spec,
      interpret=interpret,
      compiler_params=pltriton.CompilerParams(),  # Triton on GPU: jax 0.10 defaults to Mosaic GPU
      name="paged_decode_attention",
  )(starts_B, lengths_B.astype(jnp.int32), table_BxM.astype(jnp.int32), q_BxKxRxH, k_pages_PxKxHxC, v_pages_PxKxCxH)
  return out_BxKxRxH[:, :, :g].reshape(b, n, h)


def _paged_decode_attention_mosaic(*args):
  """`paged_decode_attention_mosaic` after the shape checks its siblings make."""
  _check_shapes(*args[:4])
  return paged_decode_attention_mosaic(*args)


def paged_decode_attention(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B=None, *,
                           backend: str):
  """Paged decode attention by `backend` (one of BACKENDS): "xla" is `paged_decode_attention_xla`, "pallas" the
  kernel. Returns out_BxNxH.

  The pallas form follows the platform lowered for (`lax.platform_dependent`), not the machine tracing: interpret
  mode for CPU, Triton for GPU (so an export for "cuda" from a CPU machine holds the Triton kernel), Mosaic for TPU
  (in a `shard_map` under a mesh). Export it for one platform at a time: in a multi-platform export jax lowers every
  kept branch for every platform listed, and the Triton kernel does not lower for CPU."""
  args = (q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B)
  if backend == "xla":
    return paged_decode_attention_xla(*args)
  if backend == "pallas":
    return lax.platform_dependent(*args, cpu=functools.partial(paged_decode_attention_pallas, interpret=True),
                                  tpu=_paged_decode_attention_mosaic,
                                  default=paged_decode_attention_pallas)
  raise ValueError(f"unknown paged decode attention backend {backend!r}; choose one of {BACKENDS}")
