"""Lowering for TPU and GPU from this CPU machine (`jax.export`, nothing run): a cached decode step, the static
engine, the continuous engine's chunk and re-prefill, and an RL update lower for both with the decode backend "auto"
picks there; the pallas decode becomes the Triton kernel for cuda, the Mosaic kernel for TPU, interpreted loops only
for cpu."""
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from configs.base import algo_config
from jaxrl_batch.kernels.decode_attention import backend_for
from jaxrl_batch.model import DecodeSpan, KVCache, Transformer
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.forward import ModelDefs
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import Strategy, continuous, generate
from tests.helpers import tiny_config

# H = 16: Triton's dot wants dimensions >= 16.
CFG = tiny_config(num_layers=1, head_dim=16)
B, P, N = 2, 8, 9  # the pallas engine decodes over one cache of P + N - 1 = 16 slots
PLATFORMS = ("tpu", "cuda")
TRITON = "__gpu$xla.gpu.triton"
WHILE = "stablehlo.while"  # interpret mode lowers the kernel's grid and block loops to these
MOSAIC = "tpu_custom_call"


def _lowers(fn, args, platform: str) -> str:
  """The StableHLO text of jax.jit(fn)(*args) lowered for `platform`; args are arrays or `jax.ShapeDtypeStruct`s.
  Triton kernels are let through (jax.export refuses custom calls without a compatibility guarantee)."""
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON)]
  return jax.export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(*args).mlir_module()


def _sds(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def model():
  """(graphdef, abstract params) of CFG on a one-device mesh: nothing allocated."""
  mesh = sharding.make_mesh(1, 1, 1, jax.devices()[:1])
  return sharding.abstract_sharded(lambda: Transformer(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)


def _decode_step(model, platform: str, backend: str) -> str:
  """One cached decode step of B rows at slot 9 of a 16-slot cache, lowered for `platform`."""
  graphdef, params = model

  def step(params, token_B, position_B, cache, starts_B, slot):
    span = DecodeSpan(starts_B, jnp.full((B,), slot + 1))
    return nnx.merge(graphdef, params)(token_B[:, None], position_B[:, None], span, cache, slot,
                                       decode_backend=backend)

  cache = jax.eval_shape(lambda: KVCache.zeros(CFG, B, 16))
  ints = _sds((B,), jnp.int32)
  return _lowers(step, (params, ints, ints, cache, ints, _sds((), jnp.int32)), platform)


def test_auto_backend_per_platform():
  assert [backend_for(p) for p in ("cpu", "tpu", "gpu", "cuda", "rocm")] == ["xla", "pallas", "pallas", "pallas",
                                                                             "pallas"]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_cached_decode_step_lowers_with_the_auto_backend(model, platform):
  text = _decode_step(model, platform, backend_for(platform))
  assert (TRITON in text, MOSAIC in text) == (platform == "cuda", platform == "tpu") and WHILE not in text


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_the_pallas_form_follows_the_platform_lowered_for(model, platform):
  """On this CPU machine, the kernel interprets only when lowered for cpu."""
  text = _decode_step(model, platform, "pallas")
  assert (TRITON in text) == (platform == "cuda")
  assert (WHILE in text) == (platform == "cpu")


def test_the_pallas_backend_lowers_to_one_mosaic_kernel_per_layer_for_tpu(model):
  text = _decode_step(model, "tpu", "pallas")
  assert text.count(MOSAIC) == CFG.num_layers and TRITON not in text and WHILE not in text


@pytest.mark.parametrize("platform,backend", [("tpu", "xla"), ("cuda", "xla"), ("cuda", "pallas")])
def test_the_static_engine_lowers(model, platform, backend):
  graphdef, params = model
  sampling = Strategy(temperature=1.0, top_k=4)

  def rollout(params, prompt_BxP, valid_BxP, rng):
    return generate(graphdef, params, prompt_BxP, valid_BxP, rng, max_new_tokens=N, eos_id=2, pad_id=0,
                    sampling=sampling, attention_backend=backend)

  args = (params, _sds((B, P), jnp.int32), _sds((B, P), jnp.bool_), jax.eval_shape(lambda: jax.random.key(0)))
  text = _lowers(rollout, args, platform)
  assert (TRITON in text) == (backend == "pallas")
  if backend == "pallas":
    assert text.count(WHILE) == 1  # the decode loop's one segment; no interpreted kernel inside it


@pytest.mark.parametrize("platform,backend", [("tpu", "xla"), ("cuda", "xla"), ("cuda", "pallas")])
def test_the_continuous_engine_lowers(model, platform, backend):
  """Its per-chunk program (admissions, then decode steps of slots at their own cache slots) and the re-prefill of
  carried-over sequences, at S = 2 slots, R = 4 requests, Q = 2 prompts."""
  graphdef, params = model
  s, r, q = 2, 4, 2
  prefix = jax.eval_shape(lambda prompt, valid: continuous.prefill_prompts(graphdef, params, prompt, valid),
                          _sds((q, P), jnp.int32), _sds((q, P), jnp.bool_))
  requests = jax.eval_shape(lambda: continuous.new_requests(r, group_size=2, max_new_tokens=N, pad_id=0))
  state, outputs = jax.eval_shape(lambda p, q: continuous._start(p, q, slots=s, length=P + N - 1), prefix, requests)
  key = jax.eval_shape(lambda: jax.random.key(0))

  def chunk(params, state, outputs, prefix, requests, admit_S, key):
    return continuous.decode_chunk(graphdef, params, state, outputs, prefix, requests, admit_S, key, steps=4, eos_id=2,
                             sampling=Strategy(temperature=1.0), attention_backend=backend)

  text = _lowers(chunk, (params, state, outputs, prefix, requests, _sds((s,), jnp.int32), key), platform)
  assert (TRITON in text) == (backend == "pallas")

  def resume(params, state, outputs, prefix, requests, resume_S):
    return continuous.resume_slots(graphdef, params, state, outputs, prefix, requests, resume_S, fed=N - 1)

  _lowers(resume, (params, state, outputs, prefix, requests, _sds((s,), jnp.int32)), platform)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_an_rl_update_lowers(model, platform):
  graphdef, params = model
  tx = optax.adamw(1e-3)
  models, cfg = ModelDefs(graphdef, tx), algo_config()
  state = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
  t = P + N
  batch = TrainBatch(_sds((B, t), jnp.int32), _sds((B, t), jnp.bool_), _sds((B, t), jnp.bool_),
                     *[_sds((B, t))] * (len(TrainBatch._fields) - 3))

  def step(state, batch, kl_coef):
    return update(state, batch, kl_coef, models=models, cfg=cfg, num_micro=2)

  text = _lowers(step, (state, batch, _sds(())), platform)
  assert TRITON not in text and MOSAIC not in text
