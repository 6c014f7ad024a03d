"""Decode attention: the Pallas kernel (interpret mode) against the jnp reference, the reference against `attend`."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.kernels import decode_attention, decode_attention_pallas, decode_attention_reference, default_backend
from jaxrl_batch.model import cache_mask
from jaxrl_batch.model.layers import attend


def _inputs(b, n, kv, h, s, q_dtype=jnp.float32, cache_dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.normal(size=(b, n, h)), q_dtype),
          jnp.asarray(rng.normal(size=(b, s, kv, h)), cache_dtype),
          jnp.asarray(rng.normal(size=(b, s, kv, h)), cache_dtype))


def _lengths(s):
  """Full, one slot, empty, a partial last block, and past S (clipped to S)."""
  return jnp.array([s, 1, 0, s - 3, s + 7], jnp.int32)


@pytest.mark.parametrize("n,kv,h,s,block_s", [
    pytest.param(4, 2, 16, 32, 8, id="gqa"),
    pytest.param(3, 3, 16, 24, 16, id="mha-S-not-a-multiple"),
    pytest.param(4, 1, 8, 20, 8, id="mqa-S-not-a-multiple"),
    pytest.param(6, 2, 8, 5, 16, id="block-longer-than-S"),
])
def test_kernel_matches_reference(n, kv, h, s, block_s):
  q, k, v = _inputs(5, n, kv, h, s)
  lengths = _lengths(s)
  got = decode_attention_pallas(q, k, v, lengths, block_s=block_s, interpret=True)
  want = decode_attention_reference(q, k, v, lengths)
  assert got.shape == q.shape and got.dtype == q.dtype
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(got[2], 0.0)  # length 0
  np.testing.assert_array_equal(want[2], 0.0)


@pytest.mark.parametrize("q_dtype,atol", [(jnp.bfloat16, 2e-2), (jnp.float32, 1e-5)])
def test_kernel_bf16_cache(q_dtype, atol):
  q, k, v = _inputs(5, 4, 2, 16, 32, q_dtype=q_dtype, cache_dtype=jnp.bfloat16, seed=1)
  lengths = _lengths(32)
  got = decode_attention_pallas(q, k, v, lengths, block_s=8, interpret=True)
  want = decode_attention_reference(q, k, v, lengths)
  assert got.dtype == q_dtype
  np.testing.assert_allclose(got.astype(jnp.float32), want.astype(jnp.float32), atol=atol)


def test_slots_past_the_length_are_ignored():
  # NaN in every slot at or past the length. Length 16 leaves two whole blocks of NaN after it: they pass only if
  # skipped, since whole blocks are not masked; lengths 9 and 1 leave NaN in the masked tail of their last block.
  q, k, v = _inputs(5, 4, 2, 16, 32, seed=2)
  lengths = jnp.array([16, 9, 1, 0, 31], jnp.int32)
  past_BxSx1x1 = (jnp.arange(32)[None, :] >= lengths[:, None])[:, :, None, None]
  k_nan, v_nan = jnp.where(past_BxSx1x1, jnp.nan, k), jnp.where(past_BxSx1x1, jnp.nan, v)
  want = decode_attention_reference(q, k, v, lengths)
  got = decode_attention_pallas(q, k_nan, v_nan, lengths, block_s=8, interpret=True)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_allclose(decode_attention_reference(q, k_nan, v_nan, lengths), want, atol=1e-6)


def test_kernel_under_jit_on_a_cache_layer():
  q, k, v = _inputs(5, 4, 2, 16, 32, seed=3)
  k_LxBxSxKxH, v_LxBxSxKxH = jnp.stack([v, k]), jnp.stack([k, v])

  @jax.jit
  def layer_attention(q, k_LxBxSxKxH, v_LxBxSxKxH, layer, lengths):
    return decode_attention_pallas(q, k_LxBxSxKxH[layer], v_LxBxSxKxH[layer], lengths, block_s=8, interpret=True)

  for lengths in (_lengths(32), jnp.array([3, 32, 17, 8, 0], jnp.int32)):
    got = layer_attention(q, k_LxBxSxKxH, v_LxBxSxKxH, 1, lengths)
    np.testing.assert_allclose(got, decode_attention_reference(q, k, v, lengths), atol=1e-5)


def test_kernel_lowers_to_triton_for_gpu():
  # Lowering needs no GPU: it checks Triton's constraints (power-of-two tiles, supported ops) and that the cache
  # reaches the kernel untransposed. A Qwen-like group (G = 7 query heads) and S not a multiple of block_s.
  q = jax.ShapeDtypeStruct((3, 14, 64), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((3, 300, 2, 64), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((3,), jnp.int32)
  hlo = decode_attention_pallas.trace(q, k, k, lengths, block_s=64).lower(lowering_platforms=("cuda",)).as_text()
  assert "triton" in hlo and "stablehlo.transpose" not in hlo


def test_reference_matches_attend_with_a_length_mask():
  b, n, kv, h, s = 4, 6, 2, 8, 12
  q, k, v = _inputs(b, n, kv, h, s, seed=4)
  lengths = jnp.array([12, 1, 7, 5], jnp.int32)
  mask_Bx1xS = cache_mask(jnp.arange(s)[None, :] < lengths[:, None], s - 1, 1)  # the query sits at the last slot
  want = attend(q[:, None], k, v, mask_Bx1xS)[:, 0]
  np.testing.assert_allclose(decode_attention_reference(q, k, v, lengths), want, atol=1e-5)


def test_backend_dispatch():
  q, k, v = _inputs(5, 4, 2, 16, 32, seed=5)
  lengths = _lengths(32)
  want = decode_attention_reference(q, k, v, lengths)
  np.testing.assert_array_equal(decode_attention(q, k, v, lengths, backend="xla"), want)
  np.testing.assert_allclose(decode_attention(q, k, v, lengths, backend="pallas"), want, atol=1e-5)
  with pytest.raises(ValueError, match="'pallas', 'xla'"):
    decode_attention(q, k, v, lengths, backend="triton")
  assert default_backend() == "xla"  # tests run on CPU


def test_kernel_refuses_bad_shapes():
  q, k, v = _inputs(2, 3, 2, 8, 8)
  with pytest.raises(ValueError, match="kv heads"):
    decode_attention_pallas(q, k, v, jnp.array([8, 8]), interpret=True)
  q, k, v = _inputs(2, 4, 2, 8, 8)
  with pytest.raises(ValueError, match="block_s"):
    decode_attention_pallas(q, k, v, jnp.array([8, 8]), block_s=0, interpret=True)
