"""Paged decode attention: the reference against `decode_attention_reference` on the dense cache the pages spell out;
both backends (gathered pages through XLA, and the Pallas kernel) against the reference on ragged spans over shared,
NaN-filled pages; the dispatch; and lowering for cuda (the Triton kernel, reading the pool in place) and TPU (the
Mosaic kernel, also in place; run by the TPU interpreter in test_tpu_decode_attention.py).

The kernel runs in interpret mode unless JAXRL_PALLAS_INTERPRET=0 (on a GPU); every shape the kernel runs at here
(H and C powers of two >= 16) is one Triton compiles.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.kernels.decode_attention import BACKENDS, decode_attention_reference
from jaxrl_batch.kernels.paged_attention import (
  paged_decode_attention,
  paged_decode_attention_pallas,
  paged_decode_attention_reference,
  paged_decode_attention_xla,
)
from tests.close import assert_close

INTERPRET = os.environ.get("JAXRL_PALLAS_INTERPRET", "1") != "0"
RTOL_F32 = 3e-6 if INTERPRET else 1e-4  # of the output's magnitude; compiled GPU dots may use TF32
TRITON = "__gpu$xla.gpu.triton"
WHILE = "stablehlo.while"  # interpret mode lowers the kernel's grid and page loops to these
MOSAIC = "tpu_custom_call"


def _backend(backend, *args):
  """Paged decode attention by one backend, jitted; the kernel in this run's mode."""
  if backend == "xla":
    return jax.jit(paged_decode_attention_xla)(*args)
  return paged_decode_attention_pallas(*args, interpret=INTERPRET)


def _q(b, n, h, seed=0, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(b, n, h)), dtype)


def _pool(p, kv, h, c, seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(p, kv, h, c)), dtype), jnp.asarray(rng.normal(size=(p, kv, c, h)), dtype))


def test_reference_reads_the_dense_cache_the_pages_spell_out():
  # A dense cache scattered into a pool through a random permutation of its pages, with spare pages of NaN: the
  # paged reference must read each logical slot from the page and offset the table names.
  b, n, kv, h, c, m = 4, 6, 2, 8, 4, 3
  rng = np.random.default_rng(1)
  q = _q(b, n, h, seed=1)
  k_BxKxHxS = rng.normal(size=(b, kv, h, m * c)).astype(np.float32)
  v_BxKxSxH = rng.normal(size=(b, kv, m * c, h)).astype(np.float32)
  p = b * m + 2
  page_BxM = rng.permutation(p)[:b * m].reshape(b, m)
  k_pages, v_pages = np.full((p, kv, h, c), np.nan, np.float32), np.full((p, kv, c, h), np.nan, np.float32)
  k_pages[page_BxM] = k_BxKxHxS.reshape(b, kv, h, m, c).transpose(0, 3, 1, 2, 4)
  v_pages[page_BxM] = v_BxKxSxH.reshape(b, kv, m, c, h).transpose(0, 2, 1, 3, 4)
  starts, lengths = jnp.array([0, 2, 5, 0], jnp.int32), jnp.array([12, 7, 9, 20], jnp.int32)
  got = paged_decode_attention_reference(q, k_pages, v_pages, jnp.asarray(page_BxM, jnp.int32), lengths, starts)
  want = decode_attention_reference(q, k_BxKxHxS, v_BxKxSxH, lengths, starts)
  assert_close(got, want, 1e-6)


def _ragged_case(n, kv, h=16, c=16, p=13, m=5, seed=3):
  """q, a clean pool, the same pool with NaN in every slot no row attends, table_BxM, lengths_B, starts_B.

  M = 5 logical pages of C = 16 slots (80 slots), P = 13 pages: the table draws live pages at random from the first
  P - 1 (so rows share pages, at the same logical page or at different ones); entries for logical pages wholly
  outside a row's span name either page P - 1 (never live, all NaN) or any page. The rows: full; start and length
  in the middle of pages; start and length at page boundaries; empty (length 0); start == length (empty); start
  and length in one page; a length past M * C (clipped) with a start mid-page; both ends in the first page; a start
  past the length (clipped to it: empty); a negative start (clipped to 0)."""
  rng = np.random.default_rng(seed)
  starts_B = np.array([0, 5, 16, 0, 20, 40, 33, 3, 30, -4])
  lengths_B = np.array([80, 37, 48, 0, 20, 44, 90, 9, 25, 12])
  b = len(starts_B)
  table_BxM = rng.integers(0, p - 1, size=(b, m))
  page_M = np.arange(m)
  length_B = np.minimum(lengths_B, m * c)
  start_B = np.clip(starts_B, 0, length_B)
  live_BxM = (page_M[None] * c < length_B[:, None]) & ((page_M[None] + 1) * c > start_B[:, None])
  table_BxM = np.where(live_BxM | (rng.random((b, m)) < 0.5), table_BxM, p - 1)
  table_BxM[1, :2] = table_BxM[0, :2]  # a shared prompt
  k_pages, v_pages = _pool(p, kv, h, c, seed=seed)
  live_PxC = np.zeros((p, c), bool)
  for row in range(b):
    for slot in range(start_B[row], length_B[row]):
      live_PxC[table_BxM[row, slot // c], slot % c] = True
  assert not live_PxC[p - 1].any() and (live_PxC.any(axis=1) & ~live_PxC.all(axis=1)).any()  # partly NaN pages
  live_Px1x1xC = jnp.asarray(live_PxC)[:, None, None, :]
  k_nan = jnp.where(live_Px1x1xC, k_pages, jnp.nan)
  v_nan = jnp.where(jnp.swapaxes(live_Px1x1xC, 2, 3), v_pages, jnp.nan)
  args = jnp.asarray(table_BxM, jnp.int32), jnp.asarray(lengths_B, jnp.int32), jnp.asarray(starts_B, jnp.int32)
  return _q(b, n, h, seed=seed), (k_pages, v_pages), (k_nan, v_nan), *args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,kv", [pytest.param(8, 2, id="gqa"), pytest.param(2, 2, id="mha"),
                                  pytest.param(7, 1, id="mqa-G-not-a-power-of-two")])
def test_backend_matches_reference_on_ragged_spans_over_nan_pages(backend, n, kv):
  q, (k_pages, v_pages), (k_nan, v_nan), table, lengths, starts = _ragged_case(n, kv)
  want = paged_decode_attention_reference(q, k_pages, v_pages, table, lengths, starts)
  got = _backend(backend, q, k_nan, v_nan, table, lengths, starts)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert np.isfinite(np.asarray(got)).all()
  assert_close(got, want, RTOL_F32)
  empty = np.array([3, 4, 8])  # length 0, start == length, start past the length
  np.testing.assert_array_equal(got[empty], 0.0)
  np.testing.assert_array_equal(want[empty], 0.0)
  assert_close(paged_decode_attention_reference(q, k_nan, v_nan, table, lengths, starts), want, 1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_without_starts_and_in_bf16(backend):
  q, (k_pages, v_pages), _, table, lengths, _ = _ragged_case(4, 2)
  want = paged_decode_attention_reference(q, k_pages, v_pages, table, lengths)
  assert_close(_backend(backend, q, k_pages, v_pages, table, lengths), want, RTOL_F32)
  q16, k16, v16 = q.astype(jnp.bfloat16), k_pages.astype(jnp.bfloat16), v_pages.astype(jnp.bfloat16)
  got = _backend(backend, q16, k16, v16, table, lengths)
  assert got.dtype == jnp.bfloat16
  assert_close(got.astype(jnp.float32), want, 2e-2)


def _dispatch(backend):
  """paged_decode_attention by `backend`, as a function of the arrays."""
  return lambda *args: paged_decode_attention(*args, backend=backend)


def test_dispatch_under_jit():
  # "pallas" on this machine's platform: interpret mode on CPU (the Triton kernel on a GPU).
  q, (k_pages, v_pages), (k_nan, v_nan), table, lengths, starts = _ragged_case(4, 2, seed=3)
  want = paged_decode_attention_reference(q, k_pages, v_pages, table, lengths, starts)
  for backend in BACKENDS:
    got = jax.jit(_dispatch(backend))(q, k_nan, v_nan, table, lengths, starts)
    assert_close(got, want, RTOL_F32)
  with pytest.raises(ValueError, match="'pallas', 'xla'"):
    paged_decode_attention(q, k_nan, v_nan, table, lengths, backend="triton")


def _lowers(backend, platform, q, k_pages, v_pages, table, with_starts=True):
  """The StableHLO text of paged_decode_attention(backend) for these shape structs, exported for `platform`."""
  b = q.shape[0]
  rows = [jax.ShapeDtypeStruct((b,), jnp.int32)] * (2 if with_starts else 1)
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
  fn = jax.jit(_dispatch(backend))
  return jax.export.export(fn, platforms=(platform,), disabled_checks=checks)(q, k_pages, v_pages, table,
                                                                              *rows).mlir_module()


def _shapes(b, n, kv, h, c, p, m, dtype=jnp.bfloat16):
  sds = jax.ShapeDtypeStruct
  return sds((b, n, h), dtype), sds((p, kv, h, c), dtype), sds((p, kv, c, h), dtype), sds((b, m), jnp.int32)


@pytest.mark.parametrize("with_starts", [True, False])
def test_pallas_backend_lowers_to_one_triton_kernel_reading_the_pool_in_place(with_starts):
  # Lowering needs no GPU: it checks Triton's constraints (power-of-two loads, supported ops) and that the pool
  # reaches the kernel as it is: no gather, transpose or slice of the pages, no interpreted loops. A Qwen-like group
  # (G = 7 query heads), and P, M not powers of two (Triton only needs that of what a program loads).
  text = _lowers("pallas", "cuda", *_shapes(3, 14, 2, 64, 16, p=37, m=5), with_starts=with_starts)
  assert text.count(TRITON) == 1 and WHILE not in text
  assert "stablehlo.gather" not in text and "stablehlo.transpose" not in text
  assert not any("slice" in line and "37x2x" in line for line in text.splitlines())


def test_triton_needs_power_of_two_heads_and_pages():
  for h, c in ((24, 16), (16, 24)):
    with pytest.raises(ValueError, match="power of 2"):
      _lowers("pallas", "cuda", *_shapes(2, 4, 2, h, c, p=5, m=3))


def test_pallas_backend_lowers_to_one_mosaic_kernel_for_tpu():
  # The TPU branch is the Mosaic kernel (`kernels.tpu_decode_attention`), reading the pool in place: no gather,
  # transpose or slice of the pages, no interpreted loops. Pages of 128 slots (the keys' lanes), G = 6.
  text = _lowers("pallas", "tpu", *_shapes(3, 12, 2, 128, 128, p=37, m=5))
  assert text.count(MOSAIC) == 1 and TRITON not in text and WHILE not in text
  assert "stablehlo.gather" not in text and "stablehlo.transpose" not in text
  assert not any("slice" in line and "37x2x" in line for line in text.splitlines())


def test_xla_backend_lowers_for_tpu():
  text = _lowers("xla", "tpu", *_shapes(2, 4, 2, 16, 16, p=5, m=3))
  assert TRITON not in text and MOSAIC not in text


def test_refuses_bad_shapes():
  q, (k_pages, v_pages), _, table, lengths, _ = _ragged_case(3, 2)
  for fn in (paged_decode_attention_reference, paged_decode_attention_xla,
             lambda *a: paged_decode_attention_pallas(*a, interpret=True)):
    with pytest.raises(ValueError, match="kv heads"):
      fn(q, k_pages, v_pages, table, lengths)
    for k_bad, v_bad, table_bad in ((k_pages, v_pages, table[:3]), (k_pages, v_pages[:, :, :8], table),
                                    (k_pages[:, :, :8], v_pages, table), (k_pages, v_pages, table[:, 0])):
      with pytest.raises(ValueError, match="do not match"):
        fn(q[:, :2], k_bad, v_bad, table_bad, lengths)
