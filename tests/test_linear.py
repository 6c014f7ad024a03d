"""`linear` against numpy matmuls, on the one-row split path and the plain path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_batch.model.linear import SPLIT_K, linear
from tests.close import assert_close


@pytest.mark.parametrize("batch_shape", [(1, 1), (1,), (3, 1), (2, 5)])
@pytest.mark.parametrize("in_shape,out_shape", [((16,), (24,)), ((4, 8), (12,)), ((16,), (3, 8))])
def test_linear_matches_numpy(batch_shape, in_shape, out_shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((*batch_shape, *in_shape)).astype(np.float32)
  w = rng.standard_normal((*in_shape, *out_shape)).astype(np.float32)
  want = (x.reshape(*batch_shape, -1) @ w.reshape(-1, int(np.prod(out_shape)))).reshape(*batch_shape, *out_shape)
  got = jax.jit(linear, static_argnums=2)(jnp.asarray(x), jnp.asarray(w), len(in_shape))
  assert got.shape == want.shape
  assert_close(got, want, 2e-5)


def test_one_row_runs_as_a_batched_product_of_slabs():
  x, w = jnp.ones((1, 1, 32)), jnp.ones((32, 8))
  hlo = jax.jit(linear).lower(x, w).compile().as_text()
  assert f"f32[{SPLIT_K},1,8]" in hlo  # the per-slab partial products
  np.testing.assert_array_equal(linear(x, w), jnp.full((1, 1, 8), 32.0))
  two_rows = jax.jit(linear).lower(jnp.ones((2, 1, 32)), w).compile().as_text()
  assert f"f32[{SPLIT_K},2,8]" not in two_rows


def test_preferred_element_type_is_kept_on_both_paths():
  w = jnp.ones((8, 4), jnp.bfloat16)
  for rows in (1, 3):
    out = linear(jnp.ones((rows, 8), jnp.bfloat16), w, preferred_element_type=jnp.float32)
    assert out.dtype == jnp.float32
