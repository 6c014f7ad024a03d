"""Decode attention: both backends (the XLA implementation and the Pallas kernel) against the jnp reference, the
reference against `attend`.

The kernel runs in interpret mode unless JAXRL_PALLAS_INTERPRET=0 (on a GPU: `launch/gpu_checks.sh`); then the
kernel cases whose H or block are not powers of two >= 16 (Triton's constraint) are skipped.
"""
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.kernels import (BACKENDS, decode_attention, decode_attention_pallas, decode_attention_reference,
                                 decode_attention_triton, decode_attention_xla, default_backend)
from jaxrl_batch.runtime import sharding
from jaxrl_batch.model import KVCache, cache_mask
from jaxrl_batch.model.layers import attend
from tests.close import assert_close


INTERPRET = os.environ.get("JAXRL_PALLAS_INTERPRET", "1") != "0"
RTOL_F32 = 3e-6 if INTERPRET else 1e-4  # of the output's magnitude; compiled GPU dots may use TF32


def _pallas(q, k, v, lengths, starts=None, *, block_s):
  """The kernel in this run's mode; skips shapes Triton cannot compile when not interpreting."""
  s = k.shape[-1]
  block = block_s if block_s <= s else 1 << (s.bit_length() - 1)
  if not INTERPRET and not all(x >= 16 and x & (x - 1) == 0 for x in (q.shape[-1], block)):
    pytest.skip("Triton needs H and block_s powers of two >= 16")
  return decode_attention_pallas(q, k, v, lengths, starts, block_s=block_s, interpret=INTERPRET)


def _backend(backend, q, k, v, lengths, starts=None, *, block_s):
  """Decode attention by one backend; `block_s` is the kernel's."""
  if backend == "xla":
    return jax.jit(decode_attention_xla)(q, k, v, lengths, starts)
  return _pallas(q, k, v, lengths, starts, block_s=block_s)


def _inputs(b, n, kv, h, s, q_dtype=jnp.float32, cache_dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, n, h)), q_dtype),
          jnp.asarray(rng.normal(size=(b, kv, h, s)), cache_dtype),
          jnp.asarray(rng.normal(size=(b, kv, s, h)), cache_dtype))


def _lengths(s):
  """Full, one slot, empty, a partial last block, and past S (clipped to S)."""
  return jnp.array([s, 1, 0, s - 3, s + 7], jnp.int32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n,kv,h,s,block_s", [
    pytest.param(4, 2, 16, 32, 8, id="gqa"),
    pytest.param(3, 3, 16, 24, 16, id="mha-S-not-a-multiple"),
    pytest.param(4, 1, 8, 20, 8, id="mqa-S-not-a-multiple"),
    pytest.param(6, 2, 8, 5, 16, id="block-longer-than-S"),
    pytest.param(8, 8, 16, 64, 16, id="gpu-mha"),
    pytest.param(14, 2, 64, 300, 64, id="gpu-qwen-S-not-a-multiple"),
])
def test_backend_matches_reference(backend, n, kv, h, s, block_s):
  q, k, v = _inputs(5, n, kv, h, s)
  lengths = _lengths(s)
  got = _backend(backend, q, k, v, lengths, block_s=block_s)
  want = decode_attention_reference(q, k, v, lengths)
  assert got.shape == q.shape and got.dtype == q.dtype
  assert_close(got, want, RTOL_F32)
  np.testing.assert_array_equal(got[2], 0.0)  # length 0
  np.testing.assert_array_equal(want[2], 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype,rtol", [(jnp.bfloat16, 1e-2), (jnp.float32, RTOL_F32)])
def test_bf16_cache(backend, q_dtype, rtol):
  q, k, v = _inputs(5, 4, 2, 16, 32, q_dtype=q_dtype, cache_dtype=jnp.bfloat16, seed=1)
  lengths = _lengths(32)
  got = _backend(backend, q, k, v, lengths, block_s=16)
  want = decode_attention_reference(q, k, v, lengths)
  assert got.dtype == q_dtype
  assert_close(got.astype(jnp.float32), want.astype(jnp.float32), rtol)


@pytest.mark.parametrize("backend,block_s", [("xla", 0), ("pallas", 8), ("pallas", 16)])
def test_slots_outside_the_span_are_ignored(backend, block_s):
  # Ragged spans, left padding included (starts > 0), GQA, and NaN in every slot before the start or at or past the
  # length: XLA reads those slots and must mask both scores and values. For the kernel, whole blocks of NaN pass
  # only if skipped, since whole blocks are not masked: row 0 (length 16) has two after it, row 4 (start 24) three
  # before it at block 8. The others leave NaN in the masked part of the block holding their start or length: row 1
  # [3, 9), row 2 [7, 8), and row 3 [16, 16) is empty (its output is zeros).
  q, k, v = _inputs(5, 4, 2, 16, 64, seed=2)
  starts, lengths = jnp.array([0, 3, 7, 16, 24], jnp.int32), jnp.array([16, 9, 8, 16, 70], jnp.int32)
  slot_1xS = jnp.arange(64)[None, :]
  outside_Bx1xSx1 = ((slot_1xS < starts[:, None]) | (slot_1xS >= lengths[:, None]))[:, None, :, None]
  k_nan = jnp.where(jnp.swapaxes(outside_Bx1xSx1, 2, 3), jnp.nan, k)
  v_nan = jnp.where(outside_Bx1xSx1, jnp.nan, v)
  want = decode_attention_reference(q, k, v, lengths, starts)
  got = _backend(backend, q, k_nan, v_nan, lengths, starts, block_s=block_s)
  assert np.isfinite(np.asarray(got)).all()
  assert_close(got, want, RTOL_F32)
  np.testing.assert_array_equal(got[3], 0.0)
  assert_close(decode_attention_reference(q, k_nan, v_nan, lengths, starts), want, 5e-7)


def test_kernel_under_jit_on_a_cache_layer():
  q, k, v = _inputs(5, 4, 2, 16, 32, seed=3)
  cache = KVCache((jnp.swapaxes(v, 2, 3), k), (jnp.swapaxes(k, 2, 3), v))

  @jax.jit
  def layer_attention(q, cache, lengths, starts):
    return decode_attention_pallas(q, cache.k_layers[1], cache.v_layers[1], lengths, starts, block_s=16,
                                   interpret=INTERPRET)

  for lengths, starts in ((_lengths(32), jnp.zeros(5, jnp.int32)),
                          (jnp.array([3, 32, 17, 8, 0], jnp.int32), jnp.array([0, 20, 1, 7, 0], jnp.int32))):
    want = decode_attention_reference(q, k, v, lengths, starts)
    assert_close(layer_attention(q, cache, lengths, starts), want, RTOL_F32)


def test_kernel_lowers_to_triton_for_gpu():
  # Lowering needs no GPU: it checks Triton's constraints (power-of-two tiles, supported ops) and that the cache
  # reaches the kernel as it is: no transpose, no slice, one kernel for every layer of a cache. A Qwen-like group
  # (G = 7 query heads) and S not a multiple of block_s.
  q = jax.ShapeDtypeStruct((3, 14, 64), jnp.bfloat16)
  k_layer = jax.ShapeDtypeStruct((3, 2, 64, 300), jnp.bfloat16)
  v_layer = jax.ShapeDtypeStruct((3, 2, 300, 64), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)
  cache = KVCache((k_layer,) * 4, (v_layer,) * 4)

  def all_layers(q, cache, lengths):
    return [decode_attention_pallas(q, k, v, lengths, lengths, block_s=64) for k, v in zip(*cache)]

  hlo = jax.jit(all_layers).trace(q, cache, lengths).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in hlo and "stablehlo.transpose" not in hlo
  assert not any("slice" in line and ("3x2x300x64" in line or "3x2x64x300" in line) for line in hlo.splitlines())
  assert hlo.count("__gpu$xla.gpu.triton") == 1 and hlo.count("call @decode_attention_pallas") == 4


@pytest.mark.parametrize("n,kv", [pytest.param(8, 4, id="kv-heads-split"), pytest.param(12, 2, id="one-kv-head-a-shard")])
def test_on_a_mesh_the_gpu_form_runs_per_shard(n, kv):
  """Under a mesh the Triton form runs in a `shard_map` (run here by the interpreter on 8 CPU devices): rows over
  data = 2, kv heads over tensor = 4 where they split, else each shard's query heads with their one kv head."""
  mesh = sharding.make_mesh(data=2, fsdp=1, tensor=4, devices=jax.devices()[:8])
  q, k, v = _inputs(4, n, kv, 16, 40, seed=3)
  lengths, starts = jnp.array([40, 1, 0, 23], jnp.int32), jnp.array([0, 0, 0, 5], jnp.int32)
  with jax.set_mesh(mesh):
    got = jax.jit(functools.partial(decode_attention_triton, interpret=True))(q, k, v, lengths, starts)
  assert_close(got, decode_attention_reference(q, k, v, lengths, starts), 1e-5)


def test_reference_matches_attend_with_a_span_mask():
  b, n, kv, h, s = 4, 6, 2, 8, 12
  q, k, v = _inputs(b, n, kv, h, s, seed=4)
  lengths, starts = jnp.array([12, 1, 7, 5], jnp.int32), jnp.array([0, 0, 3, 4], jnp.int32)
  slot_1xS = jnp.arange(s)[None, :]
  valid_BxS = (slot_1xS < lengths[:, None]) & (slot_1xS >= starts[:, None])
  mask_Bx1xS = cache_mask(valid_BxS, s - 1, 1)  # the query sits at the last slot
  want = attend(q[:, None], k, v, mask_Bx1xS)[:, 0]
  assert_close(decode_attention_reference(q, k, v, lengths, starts), want, 5e-6)


def test_backend_dispatch():
  q, k, v = _inputs(5, 4, 2, 16, 32, seed=5)
  lengths, starts = _lengths(32), jnp.array([0, 0, 0, 4, 9], jnp.int32)
  want = decode_attention_reference(q, k, v, lengths, starts)
  xla = decode_attention(q, k, v, lengths, starts, backend="xla")
  np.testing.assert_array_equal(xla, decode_attention_xla(q, k, v, lengths, starts))
  assert_close(xla, want, RTOL_F32)
  assert_close(decode_attention(q, k, v, lengths, starts, backend="pallas"), want, RTOL_F32)
  with pytest.raises(ValueError, match="'pallas', 'xla'"):
    decode_attention(q, k, v, lengths, backend="triton")
  # The kernels on GPU (Triton) and TPU (Mosaic); on CPU Pallas only interprets.
  assert default_backend() == ("xla" if jax.default_backend() == "cpu" else "pallas")


def test_kernel_refuses_bad_shapes():
  q, k, v = _inputs(2, 3, 2, 8, 8)
  with pytest.raises(ValueError, match="kv heads"):
    decode_attention_pallas(q, k, v, jnp.array([8, 8]), interpret=True)
  q, k, v = _inputs(2, 4, 2, 8, 8)
  with pytest.raises(ValueError, match="block_s"):
    decode_attention_pallas(q, k, v, jnp.array([8, 8]), block_s=0, interpret=True)
