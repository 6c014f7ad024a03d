"""The trainer's MoE routing figures against hand-computed values, and routing replay inside the RL update."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs.base import algo_config
from jaxrl_batch.model import ModelConfig, Transformer, moe
from jaxrl_batch.model.masks import causal_mask, positions_from_valid
from jaxrl_batch.rl import routing
from jaxrl_batch.rl.batch import TrainBatch
from jaxrl_batch.rl.forward import ModelDefs, logprobs_and_values
from jaxrl_batch.rl.update import update
from jaxrl_batch.runtime import sharding
from tests.close import assert_close


def _routing(experts, probs):
  experts, probs = jnp.asarray(experts, jnp.int32), jnp.asarray(probs, jnp.float32)
  return moe.Routing(experts, jnp.take_along_axis(probs, experts, axis=-1), probs)


def test_load_cv_mismatch_and_balancing_loss_by_hand():
  # 1 x 4 tokens (the last is padding), E = 4, k = 2.
  valid = jnp.array([[True, True, True, False]])
  uniform = np.full((4, 4), 0.25)
  r = _routing([[0, 1], [0, 2], [0, 1], [3, 2]], uniform)
  load = routing.expert_load([r], valid)
  np.testing.assert_array_equal(load, [[3, 2, 1, 0]])  # the padding token's experts are not counted
  assert_close(routing.expert_load_cv(load), np.std([3, 2, 1, 0]) / 1.5, 1e-6)
  assert_close(routing.expert_load_cv(jnp.array([[2.0, 2, 2, 2]])), 0.0, 1e-6, scale=1.0)
  # E x sum_e f_e P_e with f = load / 3 tokens and P = 1/4: 4 x (6/3) x 1/4 = 2 = k.
  assert_close(routing.load_balancing_loss([r], valid), 2.0, 1e-6)
  skewed = np.array([[0.7, 0.1, 0.1, 0.1]] * 4)
  r2 = _routing([[0, 1], [0, 2], [0, 3], [0, 1]], skewed)
  f = np.array([3, 1, 1, 1]) / 3
  assert_close(routing.load_balancing_loss([r, r2], valid), (2.0 + 4 * f @ skewed[0]) / 2, 1e-6)

  # Mismatch compares sets of the trainer's own top-k (from its probabilities) with the recorded ones.
  probs = np.array([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.3, 0.4], [0.4, 0.1, 0.4, 0.1], [0.25] * 4])
  own = _routing([[0, 1], [3, 2], [0, 2], [0, 1]], probs)
  recorded = jnp.array([[[1, 0], [3, 1], [-1, -1], [0, 1]]], jnp.int16)[:, :, None]  # (1, 4, L=1, 2)
  differ, counted = routing.mismatched([own], valid, recorded)
  assert (float(differ), float(counted)) == (1.0, 2.0)  # token 0 same set, token 1 differs, 2 unrecorded, 3 pad


CFG = ModelConfig(vocab_size=32, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  num_experts=4, num_experts_per_tok=2, moe_d_ff=8, mlp_only_layers=(1,))


def _batch(graphdef, params, seed=0):
  rng = np.random.default_rng(seed)
  b, p, n = 4, 3, 5
  tokens = jnp.asarray(rng.integers(3, CFG.vocab_size, (b, p + n)), jnp.int32)
  valid = jnp.ones((b, p + n), bool)
  loss_mask = jnp.concatenate([jnp.zeros((b, p), bool), jnp.ones((b, n), bool)], axis=1)
  _, _, routings = nnx.merge(graphdef, params).forward(tokens, positions_from_valid(valid), causal_mask(valid))
  experts = moe.stacked_experts(routings, b, p + n)
  zeros = jnp.zeros((b, p + n), jnp.float32)
  adv = jnp.where(loss_mask, jnp.asarray(rng.normal(size=(b, 1)), jnp.float32), 0.0)
  return TrainBatch(tokens, valid, loss_mask, zeros, zeros, zeros, adv, zeros, zeros, experts), experts


@pytest.fixture(scope="module")
def models():
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  out = {}
  for replay in (False, True):
    cfg = ModelConfig(**{**CFG.__dict__, "routing_replay": replay})
    out[replay] = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  return out


def _update(graphdef, params, batch, algo=algo_config()):
  tx = optax.adam(1e-2)
  params = jax.tree.map(jnp.copy, params)  # the update donates its state
  state = dict(params=params, opt_state=tx.init(params))
  return update(state, batch, jnp.float32(0.0), models=ModelDefs(graphdef, tx), cfg=algo, num_micro=2)


@pytest.mark.slow
def test_update_logs_router_figures_and_mismatch_counts_changed_decisions(models):
  graphdef, params = models[False]
  batch, experts = _batch(graphdef, params)
  _, metrics = _update(graphdef, params, batch)
  assert float(metrics["router_mismatch_frac"]) == 0.0  # the sampler's routing is the trainer's own
  assert 0 < float(metrics["expert_load_cv"]) < np.sqrt(4 / 2 - 1)
  assert_close(metrics["router_aux_loss"], 2.0, 0.5)  # near k for a roughly uniform router
  # Recording a different expert set for 5 of the 32 token decisions: 5 / 32 mismatched.
  # Recording another expert set ({a, b} -> {a + 1, b + 1} mod 4) for 5 of the 32 token decisions: 5 / 32.
  changed = experts.at[0, :5, 0].set((experts[0, :5, 0] + 1) % CFG.num_experts)
  _, metrics = _update(graphdef, params, batch._replace(experts_BxTxLxK=changed))
  assert_close(metrics["router_mismatch_frac"], 5 / 32, 1e-6)
  _, metrics = _update(graphdef, params, batch._replace(experts_BxTxLxK=None))
  assert "router_mismatch_frac" not in metrics and "expert_load_cv" in metrics


@pytest.mark.slow
def test_routing_replay_uses_the_recorded_experts_and_aux_loss_moves_the_router(models):
  graphdef, params = models[True]
  batch, experts = _batch(graphdef, params)
  other = (experts + 1) % CFG.num_experts
  algo = algo_config(old_logp="trainer")
  args = (batch.tokens_BxT, batch.valid_BxT, batch.loss_mask_BxT)
  own, _ = logprobs_and_values(params, None, *args, experts, models=ModelDefs(graphdef), cfg=algo)
  replayed, _ = logprobs_and_values(params, None, *args, other, models=ModelDefs(graphdef), cfg=algo)
  plain, _ = logprobs_and_values(*models[False][1:], None, *args, other, models=ModelDefs(models[False][0]),
                                 cfg=algo)
  assert_close(plain, own, 5e-7)  # replay off: the recorded experts are not used
  assert np.abs(np.asarray(replayed - own)).max() > 1e-3

  def router_after(coef):
    state, metrics = _update(graphdef, params, batch, algo_config(router_aux_loss_coef=coef))
    return np.asarray(nnx.merge(graphdef, state["params"]).blocks[0].mlp.router[...]), metrics

  (without, m0), (with_aux, m1) = router_after(0.0), router_after(10.0)
  assert np.abs(with_aux - without).max() > 1e-4
  assert float(m1["loss"]) > float(m0["loss"])  # the loss includes 10 x the (positive) balancing loss


def test_negative_aux_loss_coef_is_refused():
  with pytest.raises(ValueError, match="router_aux_loss_coef"):
    algo_config(router_aux_loss_coef=-1.0).check(8)


# Under `-n 2` both engines' runs are in one worker (`--dist=loadgroup`), where the second reuses the update and the
# evaluation compiled for the first.
@pytest.mark.xdist_group("moe_member")
@pytest.mark.parametrize("engine", ["static", "continuous"])
def test_moe_member_trains_with_routing_replay_and_logs_router_figures(tmp_path, base_cache, engine):
  import json
  import os

  from configs import grpo_arith
  from jaxrl_batch.train.trainer import Trainer
  c = grpo_arith.get_config("debug,moe")
  c.sft.update(cache_dir=base_cache, steps=50)  # the router figures need no skill
  c.sample_budget = 64  # 2 steps of 32 rollouts
  c.mesh.data = 1
  c.model.routing_replay = True
  c.sampling.engine = engine
  workdir = str(tmp_path / "run")
  Trainer(c, workdir, devices=jax.devices()[:1]).run()
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    train = [r for r in map(json.loads, f) if "reward_mean" in r]
  assert len(train) == 2
  for row in train:
    assert 0.0 <= row["router_mismatch_frac"] < 0.01  # float32 on CPU: the sampler's routing is the trainer's
    assert 0.0 < row["expert_load_cv"] < np.sqrt(8 / 2 - 1)
    assert row["router_aux_loss"] > 0


def test_routing_replay_with_partial_rollouts_is_refused(tmp_path, base_cache):
  from configs import grpo_arith
  from jaxrl_batch.train.trainer import Trainer
  c = grpo_arith.get_config("debug,moe")
  c.sft.update(cache_dir=base_cache, steps=50)
  c.mesh.data = 1
  c.model.routing_replay = True
  c.sampling.engine = "continuous"
  c.rollout.partial = True
  with pytest.raises(ValueError, match="routing_replay=True with rollout.partial=True"):
    Trainer(c, str(tmp_path / "run"), devices=jax.devices()[:1]).run()
