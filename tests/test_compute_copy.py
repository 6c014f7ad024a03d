"""`model.compute_copy`: float32 master weights under bfloat16 compute are cast once for the decode engines and the
reference policy. The forward reads the same values (logits, rollouts and a trained run's rows equal the master
weights'), every weight is cast but the RMSNorm scales, and the AOT check compiles the engines on the copy with the
master weights resident."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from configs import grpo_gsm8k_qwen
from jaxrl_batch.model import compute_copy, lora, masks
from jaxrl_batch.sampling import EngineSettings, Strategy, generate_continuous
from jaxrl_batch import aot
from jaxrl_batch.aot.abstract_step import rollout_resident
from jaxrl_batch.train import collector, partial, rundir, step_builder
from jaxrl_batch.train import trainer as trainer_module
from jaxrl_batch.train.trainer import Trainer
from tests.helpers import ONE_DEVICE, assert_same_rollout, debug_config, one_device_model, tiny_config

V, EOS, PAD = 24, 2, 0
# A mixture-of-experts decoder with QK-norm (RMSNorm scales in the attention too) and an untied head.
MOE = tiny_config(vocab_size=V, dtype="bfloat16", num_experts=4, num_experts_per_tok=2, moe_d_ff=16,
                  decoder_sparse_step=1, qk_norm=True, tie_embeddings=False)


def _scales_off_one(params, seed=0):
  """`params` with every RMSNorm scale drawn away from 1 (initialised at 1, a bfloat16 cast would keep them)."""
  rng = np.random.default_rng(seed)
  def leaf(path, x):
    if path[-1].key != "scale":
      return x
    return jax.device_put(jnp.asarray(1 + 0.3 * rng.standard_normal(x.shape), x.dtype), x.sharding)
  return jax.tree_util.tree_map_with_path(leaf, params)


@pytest.fixture(scope="module")
def moe():
  graphdef, params = one_device_model(MOE, seed=1)
  return graphdef, _scales_off_one(params)


def test_every_weight_is_cast_once_but_the_norm_scales(moe):
  _, params = moe
  copy = compute_copy(params, jnp.bfloat16)
  flat = jax.tree_util.tree_leaves_with_path(params)
  assert len(flat) == len(jax.tree.leaves(copy))
  scales = 0
  for (path, x), y in zip(flat, jax.tree.leaves(copy)):
    assert x.dtype == jnp.float32 and y.sharding == x.sharding, path
    if path[-1].key == "scale":
      scales += 1
      assert y is x, path  # read in float32: the master's own array
    else:
      assert y.dtype == jnp.bfloat16, path
      np.testing.assert_array_equal(np.asarray(y), np.asarray(x).astype(ml_dtypes.bfloat16))
  assert scales == 2 * 4 + 1  # per layer: attention, MLP, q and k norms; the final norm
  # Already in the compute dtype: the same arrays, or fresh copies of them (what an asynchronous publish needs).
  assert all(a is b for a, b in zip(jax.tree.leaves(compute_copy(copy, jnp.bfloat16)), jax.tree.leaves(copy)))
  copied = compute_copy(copy, jnp.bfloat16, copy=True)
  for a, b in zip(jax.tree.leaves(copied), jax.tree.leaves(copy)):
    assert a is not b and a.unsafe_buffer_pointer() != b.unsafe_buffer_pointer()
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_copy_computes_the_master_weights_logits_and_rollouts(moe):
  graphdef, params = moe
  copy = compute_copy(params, jnp.bfloat16)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, V, (3, 7)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(7), (3, 7))
  mask = masks.causal_mask(jnp.ones((3, 7), bool))
  logits = [nnx.merge(graphdef, p)(tokens, positions, mask)[0] for p in (params, copy)]
  np.testing.assert_array_equal(np.asarray(logits[0]), np.asarray(logits[1]))
  prompt = jnp.asarray(rng.integers(3, V, (4, 5)), jnp.int32)
  valid = jnp.asarray(np.arange(5)[None, :] >= rng.integers(0, 4, 4)[:, None])
  engine = EngineSettings(engine="continuous", chunk=4, attention_backend="xla")
  # 5 + 4 - 1 = 8 cache slots: one bucket, its chunk program compiled once a dtype (the copy's values are what is
  # checked, not the cache's growth).
  rollouts = [generate_continuous(graphdef, p, prompt, valid, jax.random.key(0), max_new_tokens=4, eos_id=EOS,
                                  pad_id=PAD, sampling=Strategy(temperature=1.0), engine=engine, slots=2)[0]
              for p in (params, copy)]
  assert_same_rollout(rollouts[1], rollouts[0], rtol=0)


def test_the_aot_check_compiles_the_engines_on_the_copy_with_the_master_resident():
  """CPU devices, no compile: the engines' policy, the reference policy and what stays resident meanwhile."""
  config = grpo_gsm8k_qwen.get_config("model=tiny_moe,mesh=1x-1x1")
  config.model.update(dtype="bfloat16", param_dtype="float32")
  config.rl.kl_coef = 0.01
  exp = aot.abstract_experiment(config, jax.devices(), 32, 32)
  step = aot.AbstractStep.build(exp)
  master, sampler = step.state["params"], step.sampler_params
  for (path, m), s, r in zip(jax.tree_util.tree_leaves_with_path(master), jax.tree.leaves(sampler),
                             jax.tree.leaves(step.ref_params)):
    want = jnp.float32 if path[-1].key == "scale" else jnp.bfloat16
    assert s.dtype == r.dtype == want and s.sharding == m.sharding, path
  master_bytes, sampler_bytes = (aot.per_chip_bytes(t) for t in (master, sampler))
  assert 0.5 * master_bytes < sampler_bytes < 0.51 * master_bytes
  others = step.resident("opt_state", "ref")
  cast = [m for path, m in jax.tree_util.tree_leaves_with_path(master) if path[-1].key != "scale"]
  # The master leaves the copy casts stay resident; the norm scales are the copy's own arrays.
  assert rollout_resident(step) == others + aot.per_chip_bytes(cast) < others + master_bytes
  config.model.dtype = "float32"  # Nothing to cast: the engines read the master weights themselves.
  same = aot.AbstractStep.build(aot.abstract_experiment(config, jax.devices(), 32, 32))
  assert all(s is m for s, m in zip(jax.tree.leaves(same.sampler_params), jax.tree.leaves(same.state["params"])))
  assert rollout_resident(same) == same.resident("opt_state", "ref")
  # LoRA on a bfloat16 base: the copy casts only the float32 adapters, the base is shared, not resident twice.
  config.model.update(dtype="bfloat16", param_dtype="bfloat16")
  config.lora.rank = 4
  lora_step = aot.AbstractStep.build(aot.abstract_experiment(config, jax.devices(), 32, 32))
  adapters = [m for path, m in jax.tree_util.tree_leaves_with_path(lora_step.state["params"]) if lora.is_adapter(path)]
  assert lora_step.ref_params is None and {m.dtype for m in adapters} == {jnp.dtype(jnp.float32)}
  assert rollout_resident(lora_step) == lora_step.resident("opt_state") + aot.per_chip_bytes(adapters)


@pytest.mark.slow
def test_a_run_trains_the_same_with_the_copy_as_with_the_master_weights(tmp_path, monkeypatch):
  """bfloat16 compute, float32 master weights, a KL term, a warm start that earns rewards (150 SFT steps): the
  rollouts decode from (and the reference policy is) the copy; every row equals the run's whose engines read the
  master weights."""
  seen = []
  original = collector.sample_round

  def spy(graphdef, params, *args, **kwargs):
    seen.append({x.dtype for x in jax.tree.leaves(params)})
    return original(graphdef, params, *args, **kwargs)
  monkeypatch.setattr(collector, "sample_round", spy)
  config = lambda: debug_config(str(tmp_path / "base"), **{"sft.steps": 150, "sample_budget": 96, "model.dtype":
                                                           "bfloat16", "rl.kl_coef": 0.05})
  trainer = Trainer(config(), str(tmp_path / "copy"), devices=ONE_DEVICE)
  trainer.run()
  assert seen and all(dtypes == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)} for dtypes in seen)
  assert {x.dtype for x in jax.tree.leaves(trainer.ref_params)} == {jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)}
  master = lambda params, dtype, copy=False: jax.tree.map(jnp.copy, params) if copy else params
  for module in (collector, partial, step_builder, trainer_module):
    monkeypatch.setattr(module, "compute_copy", master)
  Trainer(config(), str(tmp_path / "master"), devices=ONE_DEVICE).run()
  timing = lambda k: k.endswith("_s") or "per_s" in k or k in ("time", "overlap_frac")
  rows = [[{k: v for k, v in r.items() if not timing(k)} for r in rundir.read_metrics(str(tmp_path / d))]
          for d in ("copy", "master")]
  assert len(rows[0]) == 6 and rows[0] == rows[1]  # 3 steps, 3 evaluations
  trained = [r for r in rows[0] if "reward_mean" in r]
  assert all(r["reward_mean"] > 0 and r["grad_norm"] > 0.1 for r in trained)  # the policy learns: the update moves it
  assert trained[-1]["kl"] > 0  # away from the reference policy the KL term reads (step 3 follows an update at lr > 0)
