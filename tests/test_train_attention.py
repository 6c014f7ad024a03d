"""`kernels.train_attention`: the splash (TPU) and flash_gpu (Pallas GPU) backends against the dense reference,
forward and gradients, alone and under a mesh; the `masks.Segments` path of the model's attention; and splash compiled
for a TPU slice (libtpu's compile-only devices) holding a small fraction of the dense form's temporaries.

The kernels run in interpret mode unless JAXRL_PALLAS_INTERPRET=0 (then each runs only on its own platform).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.kernels import train_attention
from jaxrl_batch.model import KVCache, layout
from jaxrl_batch.model.layers import Attention
from jaxrl_batch.model.masks import Segments, segments, training_layout
from jaxrl_batch.runtime import sharding
from tests.close import assert_close
from tests.helpers import compiled_attention, tiny_config

INTERPRET = os.environ.get("JAXRL_PALLAS_INTERPRET", "1") != "0"
RTOL = 1e-5 if INTERPRET else 2e-2  # of the magnitude; compiled kernels' f32 dots may run in TF32 / bf16 passes
_PLATFORM = {"splash": ("tpu",), "flash_gpu": ("gpu", "cuda", "rocm")}

# T = 24 (no kernel block divides it): left padding, right padding, three packed segments and padding, two segments.
SEGMENT_IDS_BxT = np.array([
    [0] * 5 + [1] * 19,
    [1] * 17 + [0] * 7,
    [1] * 6 + [2] * 9 + [3] * 5 + [0] * 4,
    [1] * 11 + [2] * 13,
], np.int32)


def _skip_unless_runnable(backend):
  if not INTERPRET and jax.default_backend() not in _PLATFORM[backend]:
    pytest.skip(f"{backend} compiles only for {_PLATFORM[backend]}; set JAXRL_PALLAS_INTERPRET=1 to interpret it")


def _qkv(n, kv, h=16, seed=0):
  b, t = SEGMENT_IDS_BxT.shape
  rng = np.random.default_rng(seed)
  return tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in
               ((b, t, n, h), (b, t, kv, h), (b, t, kv, h), (b, t, n, h)))


def _forward_and_grads(backend):
  """jit of (q, k, v, segment ids, cotangent) -> (out, (dq, dk, dv)); the cotangent is zero on padding queries."""
  def run(q, k, v, ids, ct):
    attend = lambda q, k, v: train_attention.segment_attention(q, k, v, ids, backend=backend, interpret=INTERPRET)
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(ct * (ids != 0)[:, :, None, None])
  return jax.jit(run)


def _check_against_dense(backend, q, k, v, ct):
  ids = jnp.asarray(SEGMENT_IDS_BxT)
  want, want_grads = _forward_and_grads("dense")(q, k, v, ids, ct)
  got, got_grads = _forward_and_grads(backend)(q, k, v, ids, ct)
  real = SEGMENT_IDS_BxT != 0
  assert np.isfinite(np.asarray(got)).all()
  assert_close(np.asarray(got)[real], np.asarray(want)[real], RTOL)
  for name, g, w in zip(("dq", "dk", "dv"), got_grads, want_grads):
    assert_close(np.asarray(g), np.asarray(w), RTOL, err_msg=name)


@pytest.mark.parametrize("backend,n,kv", [
    pytest.param("splash", 4, 2, id="splash-gqa"),
    pytest.param("flash_gpu", 4, 2, id="flash_gpu-gqa"),
])
def test_backend_matches_dense(backend, n, kv):
  _skip_unless_runnable(backend)
  _check_against_dense(backend, *_qkv(n, kv))


@pytest.mark.parametrize("backend", ["splash", "flash_gpu"])
def test_backend_under_mesh_with_fewer_kv_heads_than_tensor(backend):
  """Qwen2.5-1.5B's heads (12 query, 2 kv) on tensor=4, rows over data=2: kv heads repeated to 4 for the shard_map,
  each shard 3 query heads over 1 kv head."""
  _skip_unless_runnable(backend)
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  with jax.set_mesh(sharding.make_mesh(data=2, fsdp=1, tensor=4, devices=jax.devices()[:8])):
    _check_against_dense(backend, *_qkv(12, 2, seed=1))


def _cfg(attention):
  return tiny_config(num_layers=1, head_dim=16, attention=attention)


def test_attention_layer_segments_match_dense_mask():
  """The model's `Attention` fed `masks.Segments` (backend splash) gives the output of its dense masks at every real
  token: of `layout(valid)` on the padded rows (the first two: ids 0 and 1, what `segments(valid)` gives them) and
  of the packed layout on all rows."""
  _skip_unless_runnable("splash")
  with nnx.use_eager_sharding(False):  # its shapes only: running the initialisers would cost seconds of compiles
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Attention(_cfg("splash"), nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  attention = nnx.merge(graphdef, jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape) * 0.3, a.dtype), state))
  ids = jnp.asarray(SEGMENT_IDS_BxT)
  x_BxTxD = jnp.asarray(rng.normal(size=ids.shape + (32,)), jnp.float32)
  starts = np.argmax(SEGMENT_IDS_BxT[:, :, None] == SEGMENT_IDS_BxT[:, None, :], axis=-1)
  positions = jnp.asarray(np.arange(ids.shape[1])[None] - starts)

  @jax.jit
  def outputs(ids):
    valid = ids != 0
    padded = attention(x_BxTxD[:2], *layout(valid[:2]))[0]
    packed = attention(x_BxTxD, *layout(valid, ids, positions))[0]
    return padded, packed, attention(x_BxTxD, *segments(valid, ids, positions))[0]

  padded, packed, kernel = outputs(ids)
  real = SEGMENT_IDS_BxT != 0
  assert_close(np.asarray(kernel)[:2][real[:2]], np.asarray(padded)[real[:2]], 2e-5)
  assert_close(np.asarray(kernel)[real], np.asarray(packed)[real], 2e-5)
  with pytest.raises(ValueError, match="without a KV cache"):
    attention(x_BxTxD, positions, Segments(ids), cache=KVCache.zeros(_cfg("splash"), 4, 24), cache_index=0)


def test_training_layout_is_the_dense_layout_on_cpu():
  """"auto" on CPU (no mesh) keeps the dense mask, bit for bit; a kernel backend gets `Segments`."""
  if jax.default_backend() != "cpu":
    pytest.skip("checks the CPU default")
  ids = jnp.asarray(SEGMENT_IDS_BxT)
  valid = ids != 0
  positions = jnp.zeros_like(ids)
  for args in ((valid,), (valid, ids, positions)):
    got, want = training_layout("auto", *args), layout(*args)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
  _, mask = training_layout("splash", valid)
  assert isinstance(mask, Segments) and np.array_equal(mask.segment_ids_BxT, valid.astype(np.int32))


def test_resolve_and_config():
  assert [train_attention.resolve("auto", p) for p in ("cpu", "tpu", "gpu", "cuda")] == [
      "dense", "splash", "flash_gpu", "flash_gpu"]
  assert train_attention.resolve("splash", "cpu") == "splash"
  with pytest.raises(ValueError, match="unknown training attention backend"):
    train_attention.resolve("flash")
  with pytest.raises(ValueError, match="model.attention"):
    _cfg("flash")


@pytest.fixture(scope="module")
def v5e_mesh(compile_only_tpu):
  """A (data 1, fsdp 1, expert 1, tensor 4) mesh over libtpu's compile-only v5e:2x2 devices; skips where libtpu
  cannot load."""
  return sharding.make_mesh(data=1, fsdp=1, tensor=4, devices=compile_only_tpu("v5e:2x2").devices)


@pytest.mark.slow
def test_splash_compiled_for_tpu_needs_a_fraction_of_dense_temporaries(v5e_mesh):
  """Forward + backward at Qwen2.5-1.5B's heads (12 query, 2 kv, head_dim 128), bf16, B=2, T=2048 on v5e:2x2 with
  tensor=4. Measured (libtpu 0.0.42.1): dense 53,011,456 temporary bytes per chip, splash 0 (its blocks live in
  VMEM); at T=4096: 638,598,656 and 0."""
  splash_hlo, splash_temp = compiled_attention(v5e_mesh, "auto")  # auto on a TPU mesh: splash, as a Mosaic kernel
  dense_hlo, dense_temp = compiled_attention(v5e_mesh, "dense")
  assert "tpu_custom_call" in splash_hlo and "tpu_custom_call" not in dense_hlo
  assert dense_temp >= 32 * 2**20, dense_temp  # B x 3 local heads x T x T bf16 probabilities: 48 MiB
  assert splash_temp <= dense_temp // 20, (splash_temp, dense_temp)
