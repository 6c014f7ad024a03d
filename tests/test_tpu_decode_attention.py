"""The TPU (Mosaic) decode-attention kernels (`kernels.tpu_decode_attention`): run by the Pallas TPU interpreter against
the jnp references (ragged spans, starts > 0, empty rows, NaN outside the spans, S not a multiple of the block, G not a
multiple of 8, bf16 and f32; under a CPU mesh, where a shard reads one kv head of a replicated cache), and compiled
for libtpu's compile-only v5p devices: one Mosaic kernel per call reading the cache in place, with a cost of one
read of the cache blocks it names.
"""
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_batch.kernels import (decode_attention, decode_attention_reference, decode_attention_xla,
                                 paged_decode_attention, paged_decode_attention_reference, paged_decode_attention_xla)
from jaxrl_batch.kernels.decode_attention import backend_for
from jaxrl_batch.kernels.tpu_decode_attention import (_live_block, _live_page, decode_attention_mosaic,
                                                     paged_decode_attention_mosaic)
from jaxrl_batch.runtime import sharding
from tests.close import assert_close
from tests.helpers import ROOT

MOSAIC = "tpu_custom_call"


def _inputs(b, n, kv, h, s, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, n, h)), dtype), jnp.asarray(rng.normal(size=(b, kv, h, s)), dtype),
          jnp.asarray(rng.normal(size=(b, kv, s, h)), dtype))


def _with_nan_outside(k, v, starts, lengths):
  """k, v with NaN in every slot outside [start, length) of each row."""
  s = v.shape[2]
  slot_1xS = jnp.arange(s)[None, :]
  length = jnp.clip(lengths, 0, s)
  start = jnp.clip(starts, 0, length)
  outside_Bx1xSx1 = ((slot_1xS < start[:, None]) | (slot_1xS >= length[:, None]))[:, None, :, None]
  return jnp.where(jnp.swapaxes(outside_Bx1xSx1, 2, 3), jnp.nan, k), jnp.where(outside_Bx1xSx1, jnp.nan, v)


# S = 300 in blocks of 128 (the last block 44 slots). Rows: full; one slot; empty; a span ending 3 slots short of S
# in the partial last block; a start in the second block and a length past S (clipped); both ends inside the first
# block; start == length in the middle (empty); a start past the length (clipped: empty); a negative start.
STARTS = jnp.array([0, 0, 0, 0, 130, 5, 200, 90, -4], jnp.int32)
LENGTHS = jnp.array([300, 1, 0, 297, 310, 77, 200, 60, 140], jnp.int32)
EMPTY = np.array([2, 6, 7])


@pytest.mark.parametrize("n,kv,dtype,rtol", [
    pytest.param(12, 2, jnp.float32, 1e-5, id="qwen-groups-of-6-f32"),
    pytest.param(12, 2, jnp.bfloat16, 2e-2, id="qwen-groups-of-6-bf16"),
    pytest.param(3, 1, jnp.float32, 1e-5, id="mqa-3"),
    pytest.param(18, 2, jnp.bfloat16, 2e-2, id="groups-of-9-over-a-16-row-tile"),
])
def test_kernel_matches_reference_in_the_tpu_interpreter(n, kv, dtype, rtol):
  q, k, v = _inputs(len(LENGTHS), n, kv, 16, 300, dtype)
  k_nan, v_nan = _with_nan_outside(k, v, STARTS, LENGTHS)
  got = decode_attention_mosaic(q, k_nan, v_nan, LENGTHS, STARTS, block_s=128, interpret=True)
  want = decode_attention_reference(q, k, v, LENGTHS, STARTS)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[EMPTY], 0.0)


def test_one_block_without_starts_and_a_bf16_cache_under_f32_queries():
  q, k, v = _inputs(4, 4, 2, 16, 40, seed=1)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  lengths = jnp.array([40, 0, 17, 50], jnp.int32)
  got = decode_attention_mosaic(q, k, v, lengths, interpret=True)  # block_s 512 > S: one block of 40 slots
  assert_close(got, decode_attention_reference(q, k, v, lengths), 2e-5)


@pytest.mark.slow
def test_on_a_mesh_each_shard_reads_its_kv_head():
  # tensor = 4 over 12 query heads and 2 kv heads (qwen2.5-1.5b): the cache is replicated over `tensor` and each
  # shard's 3 query heads read kv head shard // 2 alone; rows over data = 2.
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=4, devices=jax.devices()[:8])
  q, k, v = _inputs(4, 12, 2, 16, 256, seed=2)
  starts, lengths = jnp.array([0, 3, 130, 0], jnp.int32), jnp.array([256, 129, 140, 0], jnp.int32)
  k_nan, v_nan = _with_nan_outside(k, v, starts, lengths)
  with jax.set_mesh(mesh):
    got = decode_attention_mosaic(q, k_nan, v_nan, lengths, starts, block_s=128, interpret=True)
  assert_close(got, decode_attention_reference(q, k, v, lengths, starts), 5e-6)


def test_refuses_bad_shapes_and_blocks():
  q, k, v = _inputs(2, 3, 2, 16, 256)
  with pytest.raises(ValueError, match="kv heads"):
    decode_attention_mosaic(q, k, v, jnp.array([8, 8]), interpret=True)
  q, k, v = _inputs(2, 4, 2, 16, 256)
  with pytest.raises(ValueError, match="block_s"):
    decode_attention_mosaic(q, k, v, jnp.array([8, 8]), block_s=100, interpret=True)
  with pytest.raises(ValueError, match="do not match"):
    decode_attention_mosaic(q, k, v[:, :, :128], jnp.array([8, 8]), interpret=True)


def test_auto_is_the_kernel_on_tpu_and_gpu():
  assert [backend_for(p) for p in ("cpu", "tpu", "gpu", "cuda")] == ["xla", "pallas", "pallas", "pallas"]


@pytest.fixture(scope="module")
def v5p(compile_only_tpu):
  """libtpu's compile-only v5p:2x2x1 devices; skips where libtpu cannot load."""
  return compile_only_tpu("v5p:2x2x1").devices


def _compiled(mesh, fn, b, n, kv, h, s, cache_heads):
  """fn(q, k, v, lengths, starts) compiled for `mesh` at bf16 shapes, rows over data, query heads over tensor and
  the cache's kv heads over `cache_heads`."""
  def sds(shape, dtype, *spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P(*spec)))
  args = (sds((b, n, h), jnp.bfloat16, "data", "tensor"), sds((b, kv, h, s), jnp.bfloat16, "data", cache_heads),
          sds((b, kv, s, h), jnp.bfloat16, "data", cache_heads), sds((b,), jnp.int32, "data"),
          sds((b,), jnp.int32, "data"))
  with jax.set_mesh(mesh):
    return jax.jit(fn).lower(*args).compile()


@pytest.mark.slow
@pytest.mark.parametrize("data,tensor", [(1, 4), (2, 2)])
def test_compiles_for_v5p_reading_only_the_kv_heads_it_needs(v5p, data, tensor):
  # qwen2.5-1.5b's attention (12 query heads over 2 kv heads of 128), 8 rows of 1,024 slots. tensor = 4: the cache
  # replicated over tensor, each chip reads one kv head; tensor = 2: the kv heads split, each chip reads its own.
  # Either way a chip reads 1/data of the rows of one kv head; the XLA form reads more than 5x that.
  b, n, kv, h, s = 8, 12, 2, 128, 1024
  mesh = sharding.make_mesh(data=data, fsdp=1, tensor=tensor, devices=v5p[:data * tensor])
  cache_heads = "tensor" if kv % tensor == 0 else None
  compiled = _compiled(mesh, lambda *a: decode_attention(*a, backend="pallas"), b, n, kv, h, s, cache_heads)
  text = compiled.as_text()
  assert text.count("custom-call(") == 1 and "all-gather" not in text and "all-reduce" not in text
  one_kv_head = 2 * (b // data) * h * s * 2  # keys and values of this chip's rows, bf16
  assert one_kv_head <= compiled.cost_analysis()["bytes accessed"] <= 1.1 * one_kv_head  # + q, out, their pads
  xla = _compiled(mesh, decode_attention_xla, b, n, kv, h, s, cache_heads)
  assert xla.cost_analysis()["bytes accessed"] > 5 * one_kv_head


def test_pallas_backend_lowers_to_mosaic_for_tpu():
  # Lowering needs no TPU: the platform_dependent branch for TPU is the Mosaic kernel, reading the cache in place.
  sds = jax.ShapeDtypeStruct
  args = (sds((3, 12, 128), jnp.bfloat16), sds((3, 2, 128, 384), jnp.bfloat16), sds((3, 2, 384, 128), jnp.bfloat16),
          sds((3,), jnp.int32), sds((3,), jnp.int32))
  fn = jax.jit(lambda *a: decode_attention(*a, backend="pallas"))
  text = jax.export.export(fn, platforms=("tpu",))(*args).mlir_module()
  assert text.count(MOSAIC) == 1 and "stablehlo.transpose" not in text and "stablehlo.while" not in text


@pytest.mark.parametrize("start,length,live", [(0, 300, [0, 1, 2]), (130, 300, [1, 2]), (5, 77, [0]),
                                               (256, 257, [2]), (200, 200, [1]), (0, 0, [0])])
def test_grid_steps_name_each_live_block_once_and_no_other(start, length, live):
  # The cache index_maps' block per grid step: consecutive equal indices are not fetched again, so the blocks read
  # are the distinct ones (an empty span names one block and uses none).
  blocks = [int(_live_block(i, jnp.int32(start), jnp.int32(length), 128)) for i in range(3)]
  assert blocks == sorted(blocks) and sorted(set(blocks)) == live


def _paged(q, k, v, starts, lengths, c, seed=0):
  """The dense cache k, v (S a multiple of C) scattered page by page into a pool at random, with NaN in every slot
  outside the rows' spans and in the spare pages; returns (k_pages, v_pages, table_BxM)."""
  b, kv, h, s = k.shape
  m = s // c
  k_nan, v_nan = _with_nan_outside(k, v, starts, lengths)
  p = b * m + 3
  page_BxM = np.random.default_rng(seed).permutation(p)[:b * m].reshape(b, m)
  k_pages = np.full((p, kv, h, c), np.nan, np.float32)
  v_pages = np.full((p, kv, c, h), np.nan, np.float32)
  k_pages[page_BxM] = np.asarray(k_nan, np.float32).reshape(b, kv, h, m, c).transpose(0, 3, 1, 2, 4)
  v_pages[page_BxM] = np.asarray(v_nan, np.float32).reshape(b, kv, m, c, h).transpose(0, 2, 1, 3, 4)
  return jnp.asarray(k_pages, k.dtype), jnp.asarray(v_pages, v.dtype), jnp.asarray(page_BxM, jnp.int32)


# 5 pages of 64 slots (320). Rows as STARTS, LENGTHS: the spans cross pages, end mid-page and on page boundaries.
PAGED_STARTS = jnp.array([0, 0, 0, 64, 130, 5, 200, 90, -4], jnp.int32)
PAGED_LENGTHS = jnp.array([320, 1, 0, 256, 330, 77, 200, 60, 140], jnp.int32)


@pytest.mark.parametrize("n,kv,dtype,rtol,block_pages", [
    pytest.param(12, 2, jnp.float32, 1e-5, 2, id="qwen-groups-of-6-f32-2-pages-a-step"),
    pytest.param(12, 2, jnp.bfloat16, 2e-2, 4, id="qwen-groups-of-6-bf16-4-pages-a-step"),
    pytest.param(3, 1, jnp.float32, 1e-5, 1, id="mqa-3-a-page-a-step"),
])
def test_paged_kernel_matches_reference_in_the_tpu_interpreter(n, kv, dtype, rtol, block_pages):
  q, k, v = _inputs(len(PAGED_LENGTHS), n, kv, 16, 320, dtype, seed=5)
  k_pages, v_pages, table = _paged(q, k, v, PAGED_STARTS, PAGED_LENGTHS, 64)
  got = paged_decode_attention_mosaic(q, k_pages, v_pages, table, PAGED_LENGTHS, PAGED_STARTS,
                                      block_pages=block_pages, interpret=True)
  want = decode_attention_reference(q, k, v, PAGED_LENGTHS, PAGED_STARTS)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert np.isfinite(np.asarray(got, np.float32)).all()
  assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol)
  np.testing.assert_array_equal(np.asarray(got, np.float32)[EMPTY], 0.0)
  assert_close(paged_decode_attention_reference(q, k_pages, v_pages, table, PAGED_LENGTHS, PAGED_STARTS)
               .astype(jnp.float32), np.asarray(want, np.float32), rtol)


@pytest.mark.slow
def test_paged_kernel_on_a_mesh_without_starts():
  # tensor = 2 splits the pool's 2 kv heads; rows over data = 4; the pool is not split by rows (rows share pages).
  mesh = sharding.make_mesh(data=4, fsdp=1, tensor=2, devices=jax.devices()[:8])
  q, k, v = _inputs(4, 4, 2, 16, 128, seed=6)
  lengths = jnp.array([128, 70, 0, 33], jnp.int32)
  k_pages, v_pages, table = _paged(q, k, v, jnp.zeros(4, jnp.int32), lengths, 32, seed=6)
  with jax.set_mesh(mesh):
    got = paged_decode_attention_mosaic(q, k_pages, v_pages, table, lengths, interpret=True)
  assert_close(got, decode_attention_reference(q, k, v, lengths), 2e-5)


@pytest.mark.slow
def test_paged_compiles_for_v5p_reading_only_the_pages_it_is_told(v5p):
  # qwen2.5-1.5b's attention over a pool of 128-slot pages on one chip: the kernel's cost is one read of the pages the
  # table names (every row at full length), the pool read in place; the XLA form gathers the pages first.
  b, n, kv, h, c, m = 8, 12, 2, 128, 128, 8
  p = b * m + 5
  sds = jax.ShapeDtypeStruct
  sharded = NamedSharding(sharding.make_mesh(1, 1, 1, devices=v5p[:1]), P())
  args = (sds((b, n, h), jnp.bfloat16, sharding=sharded), sds((p, kv, h, c), jnp.bfloat16, sharding=sharded),
          sds((p, kv, c, h), jnp.bfloat16, sharding=sharded), sds((b, m), jnp.int32, sharding=sharded),
          sds((b,), jnp.int32, sharding=sharded), sds((b,), jnp.int32, sharding=sharded))
  compiled = jax.jit(lambda *a: paged_decode_attention(*a, backend="pallas")).lower(*args).compile()
  text = compiled.as_text()
  assert text.count("custom-call(") == 1 and " gather(" not in text
  pages = 2 * b * m * kv * h * c * 2  # keys and values of the pages named, bf16
  assert pages <= compiled.cost_analysis()["bytes accessed"] <= 1.1 * pages
  xla = jax.jit(paged_decode_attention_xla).lower(*args).compile()
  assert xla.cost_analysis()["bytes accessed"] > 5 * pages


@pytest.mark.parametrize("start,length", [(0, 1000), (130, 700), (5, 77), (512, 513), (200, 200), (0, 0), (0, 1024)])
def test_each_page_operand_names_its_live_pages_once_and_no_other(start, length):
  # 8 pages of 128 slots, 3 pages a grid step (3 steps, the last one short): operand j reads logical pages j, j + 3,
  # ...; a page it names at consecutive steps is fetched once. The operands together read exactly the live pages,
  # but an operand none of whose pages is live still names (and fetches) one page.
  c, per_step, m = 128, 3, 8
  first, end = start // c, -(-length // c) if length > start else start // c
  live = set(range(first, end))
  read = set()
  for j in range(per_step):
    pages = [int(_live_page(j, i, jnp.int32(start), jnp.int32(length), c, per_step, m)) for i in range(3)]
    assert pages == sorted(pages) and all(0 <= p < m for p in pages)
    mine = {p for p in range(first, end) if p % per_step == j}
    assert set(pages) == mine or (not mine and len(set(pages)) == 1)
    read |= set(pages) & mine
  assert read == live


@pytest.mark.slow
@pytest.mark.usefixtures("v5p")
def test_benchmark_tables_both_backends_per_concurrency(tmp_path):
  cmd = [sys.executable, "-m", "launch.bench_decode_attention", "--concurrency=2", "--slots=256", "--tensor=2",
         f"--out={tmp_path}/bench.json"]
  done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "xla/pallas" in done.stdout
  with open(tmp_path / "bench.json") as f:
    out = json.load(f)
  assert (out["device_kind"], out["tensor"]) == ("TPU v5", 2)
  assert [(r["cache"], r["concurrency"]) for r in out["rows"]] == [("slot", 2), ("paged", 2)]
  for row in out["rows"]:  # tensor = 2 splits the 2 kv heads: a chip must read one kv head of 2 rows of 256 slots.
    assert row["roofline_bytes"] == 2 * 2 * 256 * 128 * 2
    assert row["roofline_bytes"] <= row["pallas"]["bytes_accessed"] < row["xla"]["bytes_accessed"]
