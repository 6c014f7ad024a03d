"""The KV cache's layout on a tensor-parallel mesh (kv heads repeated to split over `tensor`, per-row writes in
place) and the decode step's roofline (`aot.decode_roofline`): rollouts equal the single-device ones, the cache
holds only each chip's heads, and the compiled step's figures."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import KVCache, Transformer
from jaxrl_batch.model.kv_cache import cache_heads
from jaxrl_batch.runtime import sharding
from jaxrl_batch.sampling import EngineSettings, Strategy, continuous, generate_continuous
from jaxrl_batch.aot import decode_roofline
from tests.close import assert_close
from tests.helpers import assert_same_rollout, one_device_model, tiny_config

V, EOS, PAD, N = 24, 2, 0, 10
CFG = tiny_config(vocab_size=V)  # 4 query heads, 2 kv heads


@pytest.mark.parametrize("heads,kv,tensor,expected", [
    (4, 2, 1, 2),  # no tensor axis: K
    (4, 2, 2, 2),  # K splits evenly
    (4, 2, 4, 4),  # 2 kv heads on 4 chips: each repeated twice
    (8, 4, 8, 8),
    (6, 2, 4, 2),  # 4 copies would not divide the 6 query heads: K, replicated
    (12, 2, 4, 4),  # qwen2.5-1.5b on tensor=4
])
def test_cache_heads(heads, kv, tensor, expected):
  cfg = tiny_config(num_heads=heads, num_kv_heads=kv)
  mesh = sharding.make_mesh(8 // tensor, 1, tensor)
  with jax.set_mesh(mesh):
    assert cache_heads(cfg) == expected
  assert cache_heads(cfg) == kv  # without a mesh


def test_per_row_writes_match_numpy():
  cfg = tiny_config(num_layers=1)
  b, s, h = 3, 6, cfg.head_dim
  rng = np.random.default_rng(0)
  cache = KVCache(tuple([jnp.asarray(rng.normal(size=(b, 2, h, s)), jnp.float32)]),
                  tuple([jnp.asarray(rng.normal(size=(b, 2, s, h)), jnp.float32)]))
  k_new, v_new = rng.normal(size=(b, 1, 2, h)), rng.normal(size=(b, 1, 2, h))
  index = np.array([0, 5, 2])
  got = jax.jit(lambda c, k, v, i: c.write(0, i, k, v))(cache, jnp.asarray(k_new, jnp.float32),
                                                       jnp.asarray(v_new, jnp.float32), jnp.asarray(index))
  k_ref, v_ref = np.array(cache.k_layers[0]), np.array(cache.v_layers[0])
  for row, slot in enumerate(index):
    k_ref[row, :, :, slot] = k_new[row, 0]
    v_ref[row, :, slot, :] = v_new[row, 0]
  assert_close(np.asarray(got.k_layers[0]), k_ref, 1e-6)
  assert_close(np.asarray(got.v_layers[0]), v_ref, 1e-6)


@pytest.mark.slow
def test_tensor_mesh_repeats_kv_heads_and_gives_the_single_device_rollout():
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(3, V, (8, 5)), jnp.int32)
  valid = jnp.ones((8, 5), bool)
  budget = jnp.asarray(rng.integers(2, N + 1, 8), jnp.int32)
  sampling, engine = Strategy(temperature=1.0), EngineSettings(engine="continuous", chunk=3, attention_backend="xla")
  kwargs = dict(max_new_tokens=N, eos_id=EOS, pad_id=PAD, sampling=sampling, engine=engine, group_size=2, slots=4,
                budget_B=budget)
  expected, _ = generate_continuous(*one_device_model(CFG, seed=5), prompt, valid, jax.random.key(0), **kwargs)
  mesh = sharding.make_mesh(2, 1, 4)
  graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(5)), mesh, sharding.DEFAULT_RULES)
  rows = sharding.batch_sharding(mesh, 2)
  with jax.set_mesh(mesh):
    prefix = continuous.prefill_prompts(graphdef, params, prompt[::2], valid[::2])
    got, _ = generate_continuous(graphdef, params, jax.device_put(prompt, rows), jax.device_put(valid, rows),
                                 jax.random.key(0), row_sharding=lambda ndim: sharding.batch_sharding(mesh, ndim),
                                 **kwargs)
  keys = prefix.cache.k_layers[0]
  assert keys.shape[1] == 4  # 2 kv heads, each twice
  assert keys.sharding.shard_shape(keys.shape)[1] == 1  # one head per chip
  assert_same_rollout(got, expected, rtol=2e-5)


def _tiny_qwen():
  from configs import grpo_gsm8k_qwen  # pylint: disable=import-outside-toplevel
  config = grpo_gsm8k_qwen.get_config("model=tiny_random,mesh=1x1x4")
  with config.unlocked():
    config.group_size = 1
    config.rl.estimator = "reinforce_pp"
  return config


def test_roofline_bytes_count_each_chips_weights_and_heads(compile_only_tpu):
  topo = compile_only_tpu("v5p:2x2x1")
  config = _tiny_qwen()
  with config.unlocked():
    config.sampling.slots = 8
  from jaxrl_batch import aot  # pylint: disable=import-outside-toplevel
  step = aot.AbstractStep.build(aot.abstract_experiment(config, topo.devices, 16, 48))
  cfg = step.exp.model_cfg  # 4 query heads, 2 kv heads of 16, 2 layers, tied embeddings
  weights, kv = decode_roofline.roofline_bytes(step, rows=8, length=63)
  itemsize = jnp.dtype(cfg.param_dtype).itemsize
  held = sum(math.prod(x.sharding.shard_shape(x.shape)) for x in jax.tree.leaves(step.state["params"]))
  assert weights == held * itemsize  # tied embeddings: every shard is read
  assert kv == 2 * cfg.num_layers * 8 * 63 * 1 * cfg.head_dim * jnp.dtype(cfg.compute_dtype).itemsize  # one head


def test_hbm_bytes_counts_hbm_operands_and_results_not_on_chip_copies():
  hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %y = f32[4]{0} negate(%x)
}

ENTRY %main (a: f32[256,4], b: f32[4]) -> f32[256,4] {
  %a = f32[256,4]{1,0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %s = (f32[256,4]{1,0:S(1)}, f32[256,4]{1,0}, u32[]{:S(2)}) copy-start(%a)
  %d = f32[256,4]{1,0:S(1)} copy-done(%s)
  %e = f32[256,4]{1,0} exponential(%d)
  %u = f32[256,4]{1,0} dynamic-update-slice(%e, %b, %b)
  %w = (s32[], f32[4]) while(%t), condition=%c, body=%body
}
"""
  # copy-start reads a (4 KiB) once; exponential reads on-chip memory and writes 4 KiB to HBM; the update writes and
  # reads its 16 bytes; the loop body's negate reads and writes 16 bytes each.
  assert decode_roofline.hbm_bytes(hlo) == 4096 + 4096 + 32 + 32


@pytest.mark.slow
def test_compiled_step_on_a_tensor_mesh_holds_one_kv_head_per_chip(compile_only_tpu):
  compile_only_tpu("v5p:2x2x1")
  chip, points = decode_roofline.measure(_tiny_qwen(), "v5p:2x2x1", [1, 8], 16, 48)
  assert chip["mesh"]["tensor"] == 4 and chip["attention_backend"] in ("pallas", "xla")
  for point in points:
    assert not point.error, point.error
    # 16 + 48 - 1 = 63 slots, in whole TPU tiles for the kernel (`cache_buckets`), 63 for the xla form.
    assert point.cache_length == (128 if chip["attention_backend"] == "pallas" else 63)
    assert point.bytes_accessed > 0 and point.hbm_bytes > 0
    # 2 kv heads of the tiny model repeated to 4: each chip holds one head of each of 2 layers' keys and values.
    assert point.cache_bytes_held == point.cache_bytes
  assert points[1].roofline_seconds > points[0].roofline_seconds


@pytest.mark.slow
def test_concurrency_below_the_data_parallel_size_is_one_slot_a_shard_with_that_many_live(compile_only_tpu):
  """A mixture of experts on expert = 4: concurrency 1 compiles the 4-slot step (one slot a chip) and reads, in the
  roofline and at the grouped matmuls, the experts of one token, not of four."""
  compile_only_tpu("v5p:2x2x1")
  from configs import grpo_gsm8k_qwen  # pylint: disable=import-outside-toplevel
  config = grpo_gsm8k_qwen.get_config("model=tiny_moe,mesh=1x1x1x4")
  with config.unlocked():
    config.group_size = 1
    config.rl.estimator = "reinforce_pp"
  _, (one, four) = decode_roofline.measure(config, "v5p:2x2x1", [1, 4], 16, 48)
  assert not one.error and not four.error, (one.error, four.error)
  assert (one.concurrency, one.slots) == (1, 4) and (four.concurrency, four.slots) == (4, 4)
  assert one.groups_read == pytest.approx(2 / 8) and four.groups_read == pytest.approx(1 - (1 - 2 / 8) ** 4)
  assert one.cache_bytes == four.cache_bytes  # one row a chip either way
  assert one.weight_bytes < four.weight_bytes
