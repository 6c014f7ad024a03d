"""LoRA (model.lora): the adapted forward against plain weights computed in numpy, the update against the chain rule
through full fine-tuning's gradient, what trains and what the optimizer holds, the reference policy, and a run."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.base import algo_config
from jaxrl_batch.model import Transformer, causal_mask, compute_copy, positions_from_valid
from jaxrl_batch.model import lora
from jaxrl_batch.rl.forward import ModelDefs
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding
from jaxrl_batch.train import rundir, sft
from jaxrl_batch.train.trainer import Trainer
from tests.close import assert_close
from tests.helpers import ONE_DEVICE, UPDATE_CFG, debug_config, make_batch, straight_and_resumed, tiny_config

LORA = lora.LoRAConfig(rank=3, alpha=6.0)
MESH = sharding.make_mesh(1, 1, 1, devices=ONE_DEVICE)


def lora_model(cfg, lora_cfg=LORA, seed=0, b_scale=0.3):
  """(graphdef, params) of `cfg` with adapters whose `b` is random (scale `b_scale`; 0 keeps the zero init)."""
  graphdef, params = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(seed), lora=lora_cfg), MESH,
                                             sharding.DEFAULT_RULES)
  keys = iter(jax.random.split(jax.random.key(seed + 1), 1000))
  def leaf(path, x):
    is_b = lora.is_adapter(path) and path[-1].key == "b"
    return b_scale * jax.random.normal(next(keys), x.shape, x.dtype) if is_b and b_scale else x
  return graphdef, jax.tree_util.tree_map_with_path(leaf, params)


def plain_model(cfg):
  return sharding.abstract_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), MESH, sharding.DEFAULT_RULES)[0]


def logits(graphdef, params, tokens_BxT):
  valid = jnp.ones(tokens_BxT.shape, bool)
  return nnx.merge(graphdef, params)(tokens_BxT, positions_from_valid(valid), causal_mask(valid))[0]


def numpy_merged(params, scale):
  """Each adapted weight W + scale * A B, computed in numpy from the tree's leaves (the adapters dropped)."""
  def fold(node):
    out = {k: fold(v) if isinstance(v, dict) else np.asarray(v) for k, v in node.items()
           if not str(k).endswith(lora.SUFFIX)}
    for key, child in node.items():
      if str(key).endswith(lora.SUFFIX):
        a, b = np.asarray(child["a"], np.float64), np.asarray(child["b"], np.float64)
        w = out[key[:-len(lora.SUFFIX)]]
        out[key[:-len(lora.SUFFIX)]] = (w + scale * np.tensordot(a, b, axes=([a.ndim - 1], [0]))).astype(w.dtype)
    return out
  return fold(params)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 32, (2, 9)), jnp.int32)


def test_config_refuses_what_it_cannot_train():
  for bad, word in [(dict(rank=-1), "rank"), (dict(rank=4, targets=("q", "lm_head")), "targets"),
                    (dict(rank=4, dropout=0.1), "dropout"), (dict(rank=4, alpha=0.0), "alpha")]:
    with pytest.raises(ValueError, match=word):
      lora.LoRAConfig(**bad)
  with pytest.raises(ValueError, match="Unknown lora config keys"):
    lora.LoRAConfig.from_config(dict(rank=4, lora_alpha=8))
  assert lora.LoRAConfig.from_config(dict(rank=0)) is None and lora.LoRAConfig.from_config(None) is None


@pytest.mark.parametrize("targets", [LORA.targets, ("q", "v"), ("o", "down")])
def test_adapted_logits_equal_numpy_merged_weights(targets):
  cfg = tiny_config(qkv_bias=True)
  lora_cfg = dataclasses.replace(LORA, targets=targets)
  graphdef, params = lora_model(cfg, lora_cfg)
  adapters, _ = lora.split(params)
  weights = {key[:-len(lora.SUFFIX)] for block in adapters["blocks"].values() for module in block.values()
             for key in module}
  assert weights == {lora.TARGETS[t][1] for t in targets}
  want = logits(plain_model(cfg), numpy_merged(params, lora_cfg.scale), TOKENS)
  got = logits(graphdef, params, TOKENS)
  assert float(jnp.max(jnp.abs(got - logits(plain_model(cfg), lora.split(params)[1], TOKENS)))) > 0.1
  assert_close(got, want, 5e-5)
  assert_close(logits(plain_model(cfg), lora.merged(params, lora_cfg), TOKENS), want, 2e-5)


def test_fresh_adapters_and_the_base_policy_are_the_base():
  cfg = tiny_config()
  graphdef, fresh = lora_model(cfg, b_scale=0.0)
  base_logits = logits(plain_model(cfg), lora.split(fresh)[1], TOKENS)
  np.testing.assert_array_equal(logits(graphdef, fresh, TOKENS), base_logits)
  _, trained = lora_model(cfg)
  reference = lora.base_policy(trained)
  np.testing.assert_array_equal(logits(graphdef, reference, TOKENS), base_logits)
  for path, x in jax.tree_util.tree_leaves_with_path(reference):  # The base arrays themselves: no copy.
    if not lora.is_adapter(path):
      assert x is dict(jax.tree_util.tree_leaves_with_path(trained))[path]


def test_split_merge_and_what_trains():
  _, params = lora_model(tiny_config())
  adapters, base = lora.split(params)
  assert all(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(adapters))
  assert not any(lora.is_adapter(p) for p, _ in jax.tree_util.tree_leaves_with_path(base))
  assert jax.tree.structure(lora.merge(base, adapters)) == jax.tree.structure(params)
  assert lora.trainable(params) is not params and lora.trainable(base) is base
  doubled = jax.tree.map(lambda x: 2 * x, adapters)
  again, kept = lora.split(lora.with_trained(params, doubled))
  jax.tree.map(np.testing.assert_array_equal, again, doubled)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), kept, base)


def _contract_out(g, b, in_axes):
  """dL/dA = scale * G . B^T: G (in..., out...) with B (r, out...) over the out axes -> (in..., r)."""
  out_axes = list(range(in_axes, g.ndim))
  return np.tensordot(g, b, axes=(out_axes, list(range(1, b.ndim))))


def _contract_in(a, g, in_axes):
  """dL/dB = scale * A^T . G: A (in..., r) with G (in..., out...) over the in axes -> (r, out...)."""
  return np.tensordot(a, g, axes=(list(range(in_axes)), list(range(in_axes))))


def test_update_trains_adapters_by_the_chain_rule_through_the_merged_weights():
  """One SGD step of the adapters: each adapter's step is -lr * scale * (G B^T, A^T G), with G the gradient of the same
  loss with respect to the merged weight (measured by a full fine-tuning step of the merged policy); the base weights
  come back bit for bit, and the optimizer holds state for the adapters only."""
  cfg, lr, rl_cfg = UPDATE_CFG, 0.05, algo_config(entropy_coef=0.01)
  batch = make_batch(3)
  graphdef, params = lora_model(cfg)
  merged = jax.tree.map(jnp.asarray, numpy_merged(params, LORA.scale))
  plain = plain_model(cfg)
  with jax.set_mesh(MESH):
    full_state = dict(params=merged, opt_state=optax.sgd(lr).init(merged))
    full_before = jax.tree.map(np.asarray, merged)
    full, _ = update(full_state, batch, jnp.float32(0.0), models=ModelDefs(plain, optax.sgd(lr)),
                     cfg=rl_cfg, num_micro=1)
    before = jax.tree.map(np.asarray, params)
    state = dict(params=params, opt_state=optax.sgd(lr).init(lora.trainable(params)))
    after, metrics = update(state, batch, jnp.float32(0.0), models=ModelDefs(graphdef, optax.sgd(lr)), cfg=rl_cfg,
                            num_micro=1)
  after = jax.tree.map(np.asarray, after["params"])
  adapters_before, base_before = lora.split(before)
  adapters_after, base_after = lora.split(after)
  jax.tree.map(np.testing.assert_array_equal, base_after, base_before)
  grad_sq = 0.0
  for i, block in adapters_before["blocks"].items():
    for module, node in block.items():
      for key, ab in node.items():
        weight = key[:-len(lora.SUFFIX)]
        g = (full_before["blocks"][i][module][weight] - np.asarray(full["params"]["blocks"][i][module][weight])) / lr
        in_axes = ab["a"].ndim - 1
        want_a = LORA.scale * _contract_out(g, ab["b"], in_axes)
        want_b = LORA.scale * _contract_in(ab["a"], g, in_axes)
        got = adapters_after["blocks"][i][module][key]
        for name, want in (("a", want_a), ("b", want_b)):
          step = (ab[name] - got[name]) / lr
          assert_close(step, want, 2e-4, err_msg=f"{i} {key} {name}")
          grad_sq += float((want**2).sum())
  assert_close(metrics["grad_norm"], np.sqrt(grad_sq), 1e-3)


def test_the_optimizer_holds_state_for_the_adapters_only():
  _, params = lora_model(UPDATE_CFG)
  adam = optax.adam(1e-3).init(lora.trainable(params))
  adapter_values = sum(x.size for x in jax.tree.leaves(lora.split(params)[0]))
  held = sum(x.size for x in jax.tree.leaves(adam) if x.ndim)
  assert held == 2 * adapter_values < sum(x.size for x in jax.tree.leaves(params))


def test_a_lora_run_learns_under_a_kl_term_and_resumes_to_the_same_result(tmp_path, base_cache, monkeypatch):
  """The debug member with rank-8 adapters (lr 1e-2: LoRA's ~10x full fine-tuning's) and a KL term against the base:
  it learns, the KL grows from 0 (the reference is the policy without adapters), and a run killed at step 3 resumes
  to the same rows (adapters, their optimizer state and the frozen base restored)."""
  config = lambda: debug_config(base_cache, **{"lora.rank": 8, "optim.base_lr": 1e-2, "rl.kl_coef": 0.05})
  a, b = straight_and_resumed(tmp_path, monkeypatch, config)
  train = [r for r in a if "reward_mean" in r]
  held_out = [r["eval_accuracy"] for r in a if r.get("eval_accuracy") is not None]
  assert held_out[0] == 0.0 and max(held_out) >= 0.25, held_out
  assert train[0]["kl"] == 0.0 and train[-1]["kl"] > 0.01 and all(r["grad_norm"] > 0 for r in train), train
  assert rundir.rows_mismatch(a, b) is None
  trainer = Trainer(config(), str(tmp_path / "straight"), devices=ONE_DEVICE)
  state, _ = trainer.start()  # The last checkpoint, restored.
  trainer.lock.release()
  adapters, base = lora.split(state["params"])
  moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim]
  trained = sum(x.size for x in jax.tree.leaves(adapters))
  assert sum(x.size for x in moments) == 2 * trained
  derived = rundir.read_config(str(tmp_path / "straight"))["derived"]
  assert derived["trainable_params"] == trained < derived["num_params"]
  _, warm_start, _ = sft.load_or_train(trainer.exp)
  jax.tree.map(np.testing.assert_array_equal, base, warm_start)  # Frozen through six updates.


def test_the_samplers_bfloat16_copy_computes_the_trainers_logits():
  """Under bfloat16 compute the engines read the policy cast once (`model.compute_copy`), float32 adapters
  included: its logits equal the trainer's forward of the float32 adapters bit for bit (logp_gap_mean stays 0)."""
  cfg = tiny_config(dtype="bfloat16", param_dtype="bfloat16")
  graphdef, params = lora_model(cfg, lora.LoRAConfig(rank=3, alpha=5.0))  # a scale that rounds in bfloat16
  assert {x.dtype for x in jax.tree.leaves(lora.split(params)[0])} == {jnp.dtype(jnp.float32)}
  sampler = compute_copy(params, cfg.compute_dtype)
  assert {x.dtype for x in jax.tree.leaves(lora.split(sampler)[0])} == {jnp.dtype(jnp.bfloat16)}
  np.testing.assert_array_equal(logits(graphdef, sampler, TOKENS), logits(graphdef, params, TOKENS))
