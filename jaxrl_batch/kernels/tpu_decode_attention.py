"""The TPU (Mosaic) forms of decode attention, over the slot cache and over the paged cache: kernels that DMA only the
cache blocks holding each row's live span [start, length).

Why our own kernels and not JAX's (`jax.experimental.pallas.ops.tpu.paged_attention`, `ragged_paged_attention`):
both want kv-head-major pages of keys laid out like the values, [K, P, C, H] (ragged: [P, C, 2K, H], keys and values
interleaved), and read from slot 0 up to a length (no start, so no left-padded prompts). Our caches keep keys
transposed (`KVCache`: k_BxKxHxS; the paged pool: k_PxKxHxC) so that a decode step's q k is a plain (G, H) x (H, S)
matmul. Feeding JAX's kernels would mean a copy of the whole cache into their layout every call (decode is HBM-bound:
that copy costs more than the attention) or changing the model's cache layout, and still no starts. Both layouts
are ones Mosaic reads well as they are (a key block (H, C) and a value block (C, H) have 128-lane minor dimensions),
so the kernels below read the caches in place.

How they skip: the grid is (B, K, blocks of the span axis) with starts and lengths (and the page table) as scalar
prefetch; the key and value index_maps clamp the block index to the row's live blocks [start // C,
cdiv(length, C)), so a grid step outside the span names the same block as its neighbour and Pallas does not fetch it
again: each row's live blocks are DMA'd once, the others never (an empty row fetches one block and uses none). The
kernel body runs the online softmax (float32 max, total and accumulator in VMEM scratch) only on live blocks, masking
the slots before the start and from the length on in the blocks holding them (and the unwritten tail of a last block
when S is not a multiple of the block). The G query heads of a kv group are one (R, H) tile, zero-padded to R rows,
a multiple of 8 sublanes (16 for 16-bit q). dimension_semantics: rows and kv heads parallel, the span arbitrary. A
grid step moves about 1 MiB of keys and values (`default_block_s`, `default_block_pages`), so that the per-step cost
does not dominate; a row reads its span rounded out to whole steps (the paged kernel: each of a step's page operands
without a live page still fetches one page per row).

The compiled program's cost analysis cannot see the skipping (it sees the whole cache as an operand): the kernels
declare a `pl.CostEstimate` of one read of every block the grid names at full span (every row at S), an upper bound
that is exact when the cache is full.

Under a mesh (`jax.sharding.get_abstract_mesh()`) the kernels sit in a `jax.shard_map` (Mosaic kernels cannot be
partitioned automatically), `on_mesh`: rows over the batch axes that divide B; kv heads over `tensor` where it
divides K; where it divides only N (2 kv heads, 12 query heads, tensor = 4: the cache replicated over `tensor`) and
each shard's query heads share one kv head, the shard reads only that kv head (its index from `lax.axis_index`).
"""
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from jaxrl_batch.runtime.sharding import BATCH_AXES, dividing_axes

HEAD_AXIS = "tensor"
_LANES = 128  # a vector register's minor dimension: key blocks span a multiple of it
# A grid step costs ~0.35 us besides its DMAs (Pallas TPU's figure), the time of ~1 MB at v5p's 2.8 TB/s: a step
# should move about that much cache, k and v together, so that steps are not what the kernel waits on. The price:
# a row reads its span rounded out to whole steps (a 100-slot row reads 2,048 slots at H = 128 in bf16).
_STEP_BYTES = 2**20
_MAX_BLOCK_PAGES = 16  # page operand pairs per step of the paged kernel (each one DMA per page)


def default_block_s(h: int, itemsize: int) -> int:
  """Slots per grid step of the slot-cache kernel: the power of two >= 128 whose keys and values are about
  _STEP_BYTES (2,048 slots at H = 128 in bf16)."""
  return max(_LANES, 1 << (_STEP_BYTES // (2 * h * itemsize)).bit_length() - 1)


def default_block_pages(c: int, h: int, itemsize: int) -> int:
  """Pages per grid step of the paged kernel: about _STEP_BYTES of keys and values, 1 to _MAX_BLOCK_PAGES (16 pages
  of 128 slots at H = 128 in bf16)."""
  return max(1, min(_MAX_BLOCK_PAGES, _STEP_BYTES // (2 * c * h * itemsize)))


def _query_rows(g: int, dtype) -> int:
  """G rounded up to whole sublane tiles: 8 rows of 32-bit, 16 of 16-bit values."""
  tile = 8 * max(1, 4 // jnp.dtype(dtype).itemsize)
  return -(-g // tile) * tile


def _interpret(interpret: bool):
  """pallas_call's `interpret`: the TPU interpreter (it runs scalar prefetch, DMAs and scratch as a TPU would)."""
  return pltpu.InterpretParams() if interpret else False


def _grouped_queries(q_BxNxH, kv: int):
  """(q_BxKxRxH, G): the G = N // K query heads of each kv head as rows, zero-padded to R rows."""
  b, n, h = q_BxNxH.shape
  g = n // kv
  rows = _query_rows(g, q_BxNxH.dtype)
  return jnp.pad(q_BxNxH.reshape(b, kv, g, h), ((0, 0), (0, 0), (0, rows - g), (0, 0))), g


def _span(lengths_B, starts_B, s: int):
  """(starts_B, lengths_B) as int32, lengths clipped to [0, S] and starts to [0, length]."""
  lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, s)
  starts_B = jnp.zeros_like(lengths_B) if starts_B is None else jnp.clip(starts_B.astype(jnp.int32), 0, lengths_B)
  return starts_B, lengths_B


def _live_block(i, start, length, block: int):
  """Grid step i's block, clamped to the live blocks [start // block, cdiv(length, block)) (the first one if none)."""
  first = lax.div(start, block)  # lax.div: spans are >= 0, and jnp's floor division lowers through sign on Mosaic
  last = jnp.maximum(lax.div(length + block - 1, block) - 1, first)
  return jnp.clip(i, first, last)


def _init(max_ref, total_ref, acc_ref):
  """The online softmax's state before any block: max -inf, total and accumulator 0."""
  max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
  total_ref[...] = jnp.zeros(total_ref.shape, jnp.float32)
  acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)


def _update(q_ref, k_HxC, v_CxH, max_ref, total_ref, acc_ref, first_slot, start, length, masked: bool):
  """The online softmax over one block of C slots (slots first_slot ...): scores q k / sqrt(H), max, total and
  accumulator in float32 (scratch refs of (R, 128), (R, 128) and (R, H)). `masked`: slots before the start or from
  the length on get zero weight (their values zeroed too: they may hold anything)."""
  dtype = jnp.result_type(q_ref.dtype, k_HxC.dtype, v_CxH.dtype)
  q_RxH = q_ref[...].astype(dtype)
  rows, h = q_RxH.shape
  c = k_HxC.shape[1]
  # Mosaic takes fp32 contraction precision only for f32 operands; 16-bit operands are exact in the MXU anyway.
  dot = functools.partial(lax.dot_general, dimension_numbers=(((1,), (0,)), ((), ())),
                          precision=lax.Precision.HIGHEST if dtype == jnp.float32 else None,
                          preferred_element_type=jnp.float32)
  scores_RxC = dot(q_RxH, k_HxC.astype(dtype)) * h**-0.5
  v_CxH = v_CxH.astype(dtype)
  if masked:
    slot_RxC = first_slot + lax.broadcasted_iota(jnp.int32, (rows, c), 1)
    scores_RxC = jnp.where((slot_RxC >= start) & (slot_RxC < length), scores_RxC, -jnp.inf)
    slot_CxH = first_slot + lax.broadcasted_iota(jnp.int32, (c, h), 0)
    v_CxH = jnp.where((slot_CxH >= start) & (slot_CxH < length), v_CxH, jnp.zeros_like(v_CxH))
  max_Rx1 = max_ref[:, :1]
  new_max_Rx1 = jnp.maximum(max_Rx1, jnp.max(scores_RxC, axis=1, keepdims=True))
  rescale_Rx1 = jnp.exp(max_Rx1 - new_max_Rx1)
  weights_RxC = jnp.exp(scores_RxC - new_max_Rx1)
  acc_ref[...] = rescale_Rx1 * acc_ref[...] + dot(weights_RxC.astype(dtype), v_CxH)
  total_Rx1 = rescale_Rx1 * total_ref[:, :1] + jnp.sum(weights_RxC, axis=1, keepdims=True)
  max_ref[...] = jnp.broadcast_to(new_max_Rx1, max_ref.shape)
  total_ref[...] = jnp.broadcast_to(total_Rx1, total_ref.shape)


def _visit(q_ref, k_HxC_fn, v_CxH_fn, scratch, first_slot, c: int, start, length):
  """`_update` with the block of C slots at first_slot if it holds a slot of the (non-empty) span: masked where it
  holds the start or the length (or runs past them), else unmasked. k_HxC_fn, v_CxH_fn read the block (only inside
  the branch)."""
  live = (first_slot < length) & (first_slot + c > start) & (start < length)
  edge = (first_slot < start) | (first_slot + c > length)
  for masked, taken in ((True, live & edge), (False, live & ~edge)):
    pl.when(taken)(lambda masked=masked: _update(q_ref, k_HxC_fn(), v_CxH_fn(), *scratch, first_slot, start, length,
                                                 masked))


def _finish(o_ref, total_ref, acc_ref):
  total_Rx1 = total_ref[:, :1]
  o_ref[...] = (acc_ref[...] / jnp.where(total_Rx1 > 0, total_Rx1, 1.0)).astype(o_ref.dtype)


def _slot_kernel(starts_ref, lengths_ref, kv_first_ref, q_ref, k_ref, v_ref, o_ref, *scratch, block_s: int):
  """Grid step (b, k, i): block i of sequence b's kv head k. q_ref, o_ref: (R, H); k_ref: (H, C); v_ref: (C, H)."""
  b, i = pl.program_id(0), pl.program_id(2)
  start, length = starts_ref[b], lengths_ref[b]
  pl.when(i == 0)(lambda: _init(*scratch))
  _visit(q_ref, lambda: k_ref[...], lambda: v_ref[...], scratch, i * block_s, block_s, start, length)
  pl.when(i == pl.num_programs(2) - 1)(lambda: _finish(o_ref, *scratch[1:]))


def _scratch(rows: int, h: int):
  return [pltpu.VMEM((rows, _LANES), jnp.float32), pltpu.VMEM((rows, _LANES), jnp.float32),
          pltpu.VMEM((rows, h), jnp.float32)]


def _cost(q_BxKxRxH, out_dtype, cache_bytes: int, slots: int):
  """The kernel's declared cost at full span: every cache block read once, q read and the output written once."""
  b, kv, rows, h = q_BxKxRxH.shape
  return pl.CostEstimate(flops=4 * b * kv * rows * h * slots, transcendentals=b * kv * rows * slots,
                         bytes_accessed=cache_bytes + q_BxKxRxH.size * (q_BxKxRxH.dtype.itemsize
                                                                        + jnp.dtype(out_dtype).itemsize))


def _check_heads(n: int, kv: int):
  if n % kv:
    raise ValueError(f"{n} query heads do not divide into {kv} kv heads")


def _call(kernel, q_BxNxH, cache, cache_specs, prefetch, *, kv_heads: int, blocks: int, slots: int, interpret: bool,
          name: str):
  """pallas_call of `kernel` on grid (B, kv_heads, blocks) for q's heads grouped over the kv_heads they attend (the
  scalar-prefetch `prefetch` arrays, then q's (R, H) group tile, then `cache` read by `cache_specs`); the output
  tile as q's. `slots`: the cache slots one (row, kv head) spans at most (for the cost estimate)."""
  b, n, h = q_BxNxH.shape
  q_BxKxRxH, g = _grouped_queries(q_BxNxH, kv_heads)
  rows = q_BxKxRxH.shape[2]
  group_spec = pl.BlockSpec((None, None, rows, h), lambda bi, ki, i, *_: (bi, ki, 0, 0))
  grid_spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=len(prefetch), grid=(b, kv_heads, blocks),
                                           in_specs=[group_spec, *cache_specs], out_specs=group_spec,
                                           scratch_shapes=_scratch(rows, h))
  cache_bytes = sum(x.dtype.itemsize for x in cache[:1] + cache[-1:]) * b * kv_heads * h * slots
  out_BxKxRxH = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct(q_BxKxRxH.shape, q_BxNxH.dtype),
      grid_spec=grid_spec,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
      cost_estimate=_cost(q_BxKxRxH, q_BxNxH.dtype, cache_bytes, slots),
      interpret=_interpret(interpret),
      name=name,
  )(*prefetch, q_BxKxRxH, *cache)
  return out_BxKxRxH[:, :, :g].reshape(b, n, h)


def _slot_local(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B, kv_first, *, kv_heads: int, block_s: int,
                interpret: bool):
  """The slot-cache kernel for q's heads, which attend the kv_heads kv heads from kv_first (an int32 (1,) array)."""
  s = v_BxKxSxH.shape[2]
  starts_B, lengths_B = _span(lengths_B, starts_B, s)

  def block(bi, ki, i, starts, lengths, first):
    """(row, kv head, live block) of the cache that grid step (bi, ki, i) reads."""
    return bi, first[0] + ki, _live_block(i, starts[bi], lengths[bi], block_s)

  k_spec = pl.BlockSpec((None, None, k_BxKxHxS.shape[2], block_s), lambda *ids: (*block(*ids)[:2], 0, block(*ids)[2]))
  v_spec = pl.BlockSpec((None, None, block_s, v_BxKxSxH.shape[3]), lambda *ids: (*block(*ids), 0))
  return _call(functools.partial(_slot_kernel, block_s=block_s), q_BxNxH, (k_BxKxHxS, v_BxKxSxH), (k_spec, v_spec),
               (starts_B, lengths_B, kv_first), kv_heads=kv_heads, blocks=pl.cdiv(s, block_s), slots=s,
               interpret=interpret, name="decode_attention_mosaic")


@functools.partial(jax.jit, static_argnames=("block_s", "interpret"))
def decode_attention_mosaic(q_BxNxH, k_BxKxHxS, v_BxKxSxH, lengths_B, starts_B=None, *,
                            block_s: int | None = None, interpret: bool = False):
  """Decode attention over the slot cache on TPU, same semantics and shapes as `decode_attention_reference`; reads
  only the blocks of `block_s` slots that hold each row's span (module docstring). Under a mesh: `on_mesh`.

  block_s: slots per grid step, a multiple of 128 (the keys' lane dimension); None: `default_block_s`; a block_s
  >= S becomes S (one block). S need not be a
  multiple of block_s: the last block's slots past S are masked. `interpret=True` runs the TPU interpreter on CPU."""
  b, n, h = q_BxNxH.shape
  _, kv, s, _ = v_BxKxSxH.shape
  _check_heads(n, kv)
  if v_BxKxSxH.shape != (b, kv, s, h) or k_BxKxHxS.shape != (b, kv, h, s):
    raise ValueError(f"q {q_BxNxH.shape}, k {k_BxKxHxS.shape}, v {v_BxKxSxH.shape} do not match (B,N,H), "
                     "(B,K,H,S), (B,K,S,H)")
  block_s = default_block_s(h, max(k_BxKxHxS.dtype.itemsize, v_BxKxSxH.dtype.itemsize)) if block_s is None else block_s
  if block_s < s and block_s % _LANES:
    raise ValueError(f"block_s must be a multiple of {_LANES} below S = {s}, got {block_s}")
  local = functools.partial(_slot_local, block_s=min(block_s, s), interpret=interpret)
  return on_mesh(local, q_BxNxH, (k_BxKxHxS, v_BxKxSxH), lengths_B, starts_B)


def _live_page(j: int, i, start, length, c: int, block_pages: int, m: int):
  """The logical page operand j of the paged kernel reads at grid step i: page i * block_pages + j, clamped to the
  live pages [start // C, cdiv(length, C)) that are j modulo block_pages (the first such step's page when there are
  none), so that the operand names each of its live pages at consecutive steps and no other page."""
  first_page = lax.div(start, c)
  last_page = jnp.maximum(lax.div(length + c - 1, c) - 1, first_page)
  lo = lax.div(jnp.maximum(first_page - j, 0) + block_pages - 1, block_pages)
  hi = jnp.where(last_page >= j, lax.div(last_page - j, block_pages), -1)
  return jnp.minimum(jnp.clip(i, lo, jnp.maximum(hi, lo)) * block_pages + j, m - 1)


def _paged_kernel(starts_ref, lengths_ref, table_ref, kv_first_ref, q_ref, *refs, page: int, block_pages: int):
  """Grid step (b, k, i): logical pages i * block_pages + j (j < block_pages) of sequence b's kv head k, one per
  operand pair (k_refs[j]: (H, C), v_refs[j]: (C, H)). q_ref, o_ref: (R, H)."""
  k_refs, v_refs, (o_ref, *scratch) = refs[:block_pages], refs[block_pages:2 * block_pages], refs[2 * block_pages:]
  b, i = pl.program_id(0), pl.program_id(2)
  start, length = starts_ref[b], lengths_ref[b]
  pl.when(i == 0)(lambda: _init(*scratch))
  for j, (k_ref, v_ref) in enumerate(zip(k_refs, v_refs)):
    _visit(q_ref, lambda k_ref=k_ref: k_ref[...], lambda v_ref=v_ref: v_ref[...], scratch,
           (i * block_pages + j) * page, page, start, length)
  pl.when(i == pl.num_programs(2) - 1)(lambda: _finish(o_ref, *scratch[1:]))


def _paged_local(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B, kv_first, *,
                 kv_heads: int, block_pages: int, interpret: bool):
  """The paged kernel for q's heads, which attend the kv_heads kv heads from kv_first (an int32 (1,) array)."""
  _, _, h, c = k_pages_PxKxHxC.shape
  m = table_BxM.shape[1]
  starts_B, lengths_B = _span(lengths_B, starts_B, m * c)

  def page_of(j, bi, ki, i, starts, lengths, table, first):
    """(pool page, kv head) operand pair j reads at grid step (bi, ki, i)."""
    return table[bi * m + _live_page(j, i, starts[bi], lengths[bi], c, block_pages, m)], first[0] + ki

  k_specs = [pl.BlockSpec((None, None, h, c), lambda *ids, j=j: (*page_of(j, *ids), 0, 0)) for j in range(block_pages)]
  v_specs = [pl.BlockSpec((None, None, c, h), lambda *ids, j=j: (*page_of(j, *ids), 0, 0)) for j in range(block_pages)]
  kernel = functools.partial(_paged_kernel, page=c, block_pages=block_pages)
  return _call(kernel, q_BxNxH, (k_pages_PxKxHxC,) * block_pages + (v_pages_PxKxCxH,) * block_pages,
               k_specs + v_specs, (starts_B, lengths_B, table_BxM.reshape(-1).astype(jnp.int32), kv_first),
               kv_heads=kv_heads, blocks=pl.cdiv(m, block_pages), slots=m * c, interpret=interpret,
               name="paged_decode_attention_mosaic")


@functools.partial(jax.jit, static_argnames=("block_pages", "interpret"))
def paged_decode_attention_mosaic(q_BxNxH, k_pages_PxKxHxC, v_pages_PxKxCxH, table_BxM, lengths_B, starts_B=None, *,
                                  block_pages: int | None = None, interpret: bool = False):
  """Paged decode attention on TPU, same semantics and shapes as `paged_decode_attention_reference` (callers check
  the shapes); reads only the pages that hold each row's span, in place in the pool (module docstring), `block_pages`
  pages per grid step (at most M; None: `default_block_pages`), each page's id read from the scalar-prefetched
  table. Under a mesh: `on_mesh`, the pool split over `tensor` by kv head like a slot cache, never by rows (rows
  share pages).

  The page size C is the keys' lane dimension: a multiple of 128 fills the lanes (smaller pages are correct, but
  their tiles are padded and the compiled program copies the pool: 16-slot pages read 7x the bytes of 128-slot ones,
  docs/results/2026-12-06-tpu-decode-attention.md). `interpret=True` runs the TPU interpreter on CPU."""
  _, _, h, c = k_pages_PxKxHxC.shape
  if block_pages is None:
    block_pages = default_block_pages(c, h, max(k_pages_PxKxHxC.dtype.itemsize, v_pages_PxKxCxH.dtype.itemsize))
  local = functools.partial(_paged_local, block_pages=max(1, min(block_pages, table_BxM.shape[1])),
                            interpret=interpret)
  return on_mesh(local, q_BxNxH, (k_pages_PxKxHxC, v_pages_PxKxCxH), table_BxM, lengths_B, starts_B, pool=True)


def on_mesh(local_fn, q_BxNxH, cache, *rows, pool: bool = False):
  """local_fn(q_BxNxH, *cache, *rows, kv_first, kv_heads=...) in a `jax.shard_map` over the ambient mesh as the
  module docstring says; called directly without a mesh (kv_first = 0, every kv head). cache: arrays whose dimension
  1 holds the kv heads and dimension 0 the rows (`pool`: pages, shared by the rows: not split); rows: (B,) or (B, M)
  arrays split like q's rows, or None."""
  kv = cache[0].shape[1]
  zero = jnp.zeros((1,), jnp.int32)
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size == 1:
    return local_fn(q_BxNxH, *cache, *rows, zero, kv_heads=kv)
  b, n, _ = q_BxNxH.shape
  g = n // kv
  row_axes = dividing_axes(mesh, BATCH_AXES, b) or None
  tp = mesh.shape.get(HEAD_AXIS, 1)
  split_kv = tp > 1 and kv % tp == 0
  one_kv_per_shard = tp > 1 and not split_kv and n % tp == 0 and g % (n // tp) == 0
  heads = HEAD_AXIS if split_kv or one_kv_per_shard else None
  kv_heads = 1 if one_kv_per_shard else kv // tp if split_kv else kv
  cache_spec = P(None if pool else row_axes, HEAD_AXIS if split_kv else None)
  present = [r for r in rows if r is not None]

  def local(q_BxNxH, *args):
    """One shard: its rows' query heads, their kv heads' cache (all kv heads where one_kv_per_shard)."""
    first = zero
    if one_kv_per_shard:
      first = (lax.axis_index(HEAD_AXIS) * (n // tp) // g).astype(jnp.int32)[None]
    present_rows = iter(args[len(cache):])
    shard_rows = [None if r is None else next(present_rows) for r in rows]
    return local_fn(q_BxNxH, *args[:len(cache)], *shard_rows, first, kv_heads=kv_heads)

  return jax.shard_map(local, mesh=mesh, in_specs=(P(row_axes, heads), *(cache_spec for _ in cache),
                                                   *(P(row_axes) for _ in present)),
                       out_specs=P(row_axes, heads), check_vma=False)(q_BxNxH, *cache, *present)
