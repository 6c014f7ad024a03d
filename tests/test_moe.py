"""The mixture-of-experts block: routing, the grouped (ragged) dispatch against a dense all-experts reference,
routing replay, config rules, and the same losses and gradients on 1 and 8 fake devices with experts sharded."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import KVCache, ModelConfig, Transformer, moe, sequence_logits
from jaxrl_batch.model.layers import SwiGLU
from jaxrl_batch.model.masks import DecodeSpan, causal_mask, positions_from_valid
from jaxrl_batch.runtime import sharding
from tests.close import assert_close, assert_trees_close
from tests.helpers import next_token_loss, one_device_model

CFG = ModelConfig(vocab_size=64, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  qk_norm=True, tie_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_d_ff=8,
                  mlp_only_layers=(1,))
ONE = jax.devices()[:1]


def _dense_reference(x_NxD, experts_NxK, weights_NxK, w_gate, w_up, w_down):
  """Every expert on every token, then each token's chosen experts mixed by their weights."""
  all_ExNxD = jnp.einsum("enf,efd->end", jax.nn.silu(jnp.einsum("nd,edf->enf", x_NxD, w_gate)) *
                         jnp.einsum("nd,edf->enf", x_NxD, w_up), w_down)
  mix_NxE = jnp.zeros((x_NxD.shape[0], w_gate.shape[0])).at[jnp.arange(x_NxD.shape[0])[:, None], experts_NxK].add(
      weights_NxK)
  return jnp.einsum("end,ne->nd", all_ExNxD, mix_NxE)


def _weights(seed, e=8, d=16, f=8):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(k1, (e, d, f)) / 4, jax.random.normal(k2, (e, d, f)) / 4,
          jax.random.normal(k3, (e, f, d)) / 3)


@pytest.mark.parametrize("dispatch, n", [(moe.grouped_swiglu, 40), (moe.looped_swiglu, 40), (moe.looped_swiglu, 2)])
def test_grouped_and_gathered_dispatch_match_dense_reference(dispatch, n):
  x = jax.random.normal(jax.random.key(0), (n, 16))
  experts = jax.random.randint(jax.random.key(1), (n, 3), 0, 8)  # skewed counts; some experts may get none
  weights = jax.random.uniform(jax.random.key(2), (n, 3))
  w = _weights(3)
  assert_close(dispatch(x, experts, weights, *w), _dense_reference(x, experts, weights, *w), 5e-6)
  # Experts 4..7 held here: the others contribute nothing, and the two halves sum to the whole.
  part = [dispatch(x, experts, weights, *(a[lo:lo + 4] for a in w), first_expert=lo) for lo in (0, 4)]
  assert_close(part[0] + part[1], _dense_reference(x, experts, weights, *w), 5e-6)
  held = jnp.where((experts >= 4), weights, 0.0)
  assert_close(part[1], _dense_reference(x, experts, held, *w), 1e-5)


@pytest.mark.parametrize("chunk", [0, 16, 40, 64])
def test_chunked_experts_give_the_dense_reference_values_and_gradients(chunk):
  """40 tokens 16 at a time (the last chunk padded), in one chunk, or whole; experts 4..7 held here. The sum does
  not depend on the chunks, and the backward pass through the checkpointed loop gives the reference's gradients."""
  x = jax.random.normal(jax.random.key(0), (40, 16))
  experts = jax.random.randint(jax.random.key(1), (40, 3), 0, 8)
  weights = jax.random.uniform(jax.random.key(2), (40, 3))
  w = _weights(3)
  held = jnp.where(experts >= 4, weights, 0.0)

  def loss(fn, x, w):
    return jnp.sum(jnp.sin(fn(x, w)))

  chunked = lambda x, w: moe.chunked_swiglu(x, experts, weights, *(a[4:] for a in w), first_expert=4, chunk=chunk)
  reference = lambda x, w: _dense_reference(x, experts, held, *w)
  assert_close(chunked(x, w), reference(x, w), 1e-5)
  got, want = (jax.grad(functools.partial(loss, fn), argnums=(0, 1))(x, w) for fn in (chunked, reference))
  assert_close(got[0], want[0], 5e-6)
  for g, r in zip(got[1], want[1]):
    assert_close(g, r, 2e-6)  # experts 0..3 are not held here: zero gradients in both


def test_decode_loops_over_the_chosen_experts_and_accelerators_group_larger_calls():
  x, w = jnp.ones((2, 16)), _weights(3)
  experts, weights = jnp.array([[1, 2, 3], [1, 5, 6]]), jnp.full((2, 3), 0.5)  # 6 assignments <= 8 experts
  text = jax.jit(moe.expert_swiglu).lower(x, experts, weights, *w).as_text()
  assert "ragged" not in text and "while" in text and "case" in text  # a loop that skips unchosen experts
  # On TPU the grouped kernel, which reads only the groups with rows (tests/test_decode_step_bytes.py); on GPU the loop.
  few = jax.export.export(jax.jit(moe.expert_swiglu), platforms=("tpu",))(x, experts, weights, *w).mlir_module()
  assert "ragged_dot" in few and "while" not in few
  few = jax.export.export(jax.jit(moe.expert_swiglu), platforms=("cuda",))(x, experts, weights, *w).mlir_module()
  assert "ragged_dot" not in few and "while" in few
  # 9 assignments > 8 experts: grouped matmuls on GPU and TPU; on CPU, where ragged_dot is a masked dense product
  # over every expert, the loop again.
  many = (jnp.ones((3, 16)), jnp.zeros((3, 3), jnp.int32), jnp.ones((3, 3)), *w)
  assert "while" in jax.jit(moe.expert_swiglu).lower(*many).as_text()
  for platform in ("tpu", "cuda"):
    text = jax.export.export(jax.jit(moe.expert_swiglu), platforms=(platform,))(*many).mlir_module()
    assert "ragged_dot" in text and "while" not in text, platform


def test_rows_that_are_not_live_go_to_no_expert():
  layer = _model().blocks[0].mlp
  x = jax.random.normal(jax.random.key(6), (4, 1, CFG.d_model))
  live = jnp.array([True, False, True, False])[:, None]
  y, routing = layer(x)
  masked, masked_routing = layer(x, live_BxT=live)
  np.testing.assert_array_equal(masked[live[:, 0]], y[live[:, 0]])
  assert np.all(np.asarray(masked[~live[:, 0]]) == 0) and np.abs(np.asarray(y[~live[:, 0]])).min() > 0
  np.testing.assert_array_equal(masked_routing.experts_NxK, routing.experts_NxK)  # as the router chose


def test_a_decode_step_routes_its_empty_spans_to_no_expert(monkeypatch):
  """The engines' finished and free slots (an empty span) reach no expert: a step reads the live rows' experts."""
  model, computed = _model(), []
  original = moe.sharded_swiglu
  monkeypatch.setattr(moe, "sharded_swiglu", lambda x, routing, *a, **k: (computed.append(routing.experts_NxK),
                                                                           original(x, routing, *a, **k))[1])
  span = DecodeSpan(jnp.array([0, 3, 1, 0]), jnp.array([5, 0, 4, 0]))  # rows 1 and 3 empty
  tokens = jnp.array([[3], [4], [5], [6]])
  _, _, experts_Bx1xLxK = model.step(tokens, jnp.array([[4], [0], [3], [0]]), span, KVCache.zeros(CFG, 4, 8), 0,
                                     decode_backend="xla")
  assert len(computed) == len(CFG.moe_layers)
  for layer, experts_NxK in enumerate(computed):
    np.testing.assert_array_equal(experts_NxK[1::2], -1)
    np.testing.assert_array_equal(experts_NxK[0::2], experts_Bx1xLxK[0::2, 0, layer])  # the live rows as chosen


@pytest.mark.parametrize("norm", [True, False])
def test_route_takes_top_k_of_the_softmax(norm):
  logits = jax.random.normal(jax.random.key(4), (10, 8)) * 3
  r = moe.route(logits, 3, norm)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  want = np.argsort(-probs, axis=-1)[:, :3]
  np.testing.assert_array_equal(r.experts_NxK, want)
  top = np.take_along_axis(probs, want, axis=-1)
  assert_close(r.weights_NxK, top / top.sum(-1, keepdims=True) if norm else top, 1e-6)


def _model(cfg=CFG):
  return nnx.merge(*one_device_model(cfg))


@pytest.mark.slow
def test_replaying_own_routing_is_exact_and_other_routing_changes_output_but_trains_the_router():
  model = _model()
  tokens = jax.random.randint(jax.random.key(5), (2, 7), 0, CFG.vocab_size)
  valid = jnp.ones((2, 7), bool)
  args = tokens, positions_from_valid(valid), causal_mask(valid)
  hidden, _, routings = model.forward(*args)
  assert len(routings) == len(CFG.moe_layers) == 2
  replay = moe.stacked_experts(routings, 2, 7)
  assert replay.shape == (2, 7, 2, CFG.num_experts_per_tok) and replay.dtype == jnp.int16
  np.testing.assert_array_equal(model.forward(*args, replay_BxTxLxK=replay)[0], hidden)
  other = (replay + 1) % CFG.num_experts
  assert np.abs(model.forward(*args, replay_BxTxLxK=other)[0] - hidden).max() > 1e-4 * np.abs(hidden).max()
  # Unrecorded tokens (-1) keep the router's own choice: replaying only the last token's moves only that token.
  partial = jnp.where(jnp.arange(7)[None, :, None, None] == 6, other, -1)
  moved = np.abs(np.asarray(model.forward(*args, replay_BxTxLxK=partial)[0] - hidden)).max(axis=(0, 2))
  assert np.all(moved[:6] == 0) and moved[6] > 1e-4

  def loss(m):
    return jnp.sum(m.forward(*args, replay_BxTxLxK=other)[0] ** 2)

  grads = nnx.grad(loss)(model)
  assert float(jnp.abs(grads.blocks[0].mlp.router[...]).max()) > 0


@pytest.mark.slow
def test_moe_layers_follow_sparse_step_and_dense_layers_and_param_count_is_exact():
  assert CFG.moe_layers == (0, 2)
  assert ModelConfig(**{**CFG.__dict__, "mlp_only_layers": (), "decoder_sparse_step": 2}).moe_layers == (1,)
  model = _model()
  params = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params()
  per_expert = 3 * CFG.d_model * CFG.moe_d_ff
  assert CFG.num_params() - CFG.num_params(active=True) == 2 * (8 - 2) * per_expert
  assert isinstance(model.blocks[1].mlp, SwiGLU) and isinstance(model.blocks[0].mlp, moe.MoE)


def test_bad_moe_configs_are_refused_by_name():
  base = {**CFG.__dict__}
  with pytest.raises(ValueError, match="num_experts_per_tok=9"):
    ModelConfig(**{**base, "num_experts_per_tok": 9})
  with pytest.raises(ValueError, match=r"mlp_only_layers=\[5\]"):
    ModelConfig(**{**base, "mlp_only_layers": (5,)})
  with pytest.raises(ValueError, match="routing_replay needs a mixture-of-experts"):
    ModelConfig(**{**base, "num_experts": 0, "routing_replay": True})
  assert ModelConfig.from_config({**base, "mlp_only_layers": [1]}) == CFG  # a JSON list reads back as the tuple


@functools.cache
def _loss_and_grads(mesh, rows: int, moe_chunk: int = CFG.moe_chunk):
  """(loss, grads, params) of `rows` fixed random rows on `mesh` (cached: the 1-device reference serves every case)."""
  cfg = dataclasses.replace(CFG, moe_chunk=moe_chunk)
  tokens = jax.random.randint(jax.random.key(6), (rows, 6), 0, cfg.vocab_size)
  valid = jnp.ones((rows, 6), bool).at[::2, :2].set(False)
  graphdef, params = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  rows_sharding = sharding.batch_sharding(mesh) if rows % sharding.data_parallel_size(mesh) == 0 else \
      sharding.replicated(mesh)
  batch = jax.device_put((tokens, valid), rows_sharding)
  with jax.set_mesh(mesh):
    loss, grads = jax.jit(jax.value_and_grad(next_token_loss, argnums=1), static_argnums=0)(graphdef, params, *batch)
  return loss, grads, params


@pytest.mark.parametrize("mesh_shape, rows, moe_chunk", [((2, 1, 2, 2), 8, CFG.moe_chunk),
                                                         ((1, 1, 1, 8), 8, CFG.moe_chunk),
                                                         ((1, 1, 2, 4), 2, CFG.moe_chunk), ((1, 1, 1, 8), 8, 5)])
@pytest.mark.slow
@pytest.mark.xdist_group("moe_expert_mesh")  # one worker: its _loss_and_grads cache computes each reference once
def test_expert_parallel_mesh_gives_same_loss_and_grads(mesh_shape, rows, moe_chunk):
  """(data, fsdp, tensor, expert): tokens gathered over the expert axis; with 2 rows on 4 expert devices the
  tokens are replicated over it instead; moe_chunk=5: a device's 48 gathered tokens 5 at a time."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  assert moe.TOKEN_AXES == sharding.BATCH_AXES
  data, fsdp, tensor, expert = mesh_shape
  loss1, grads1, _ = _loss_and_grads(sharding.make_mesh(1, 1, 1, devices=ONE), rows)
  loss8, grads8, params8 = _loss_and_grads(sharding.make_mesh(data, fsdp, tensor, expert=expert), rows, moe_chunk)
  w_gate = params8["blocks"][0]["mlp"]["w_gate"]
  assert w_gate.addressable_shards[0].data.shape[0] == CFG.num_experts // expert
  assert_close(loss1, loss8, 1e-5)
  assert_trees_close(grads8, grads1, 5e-5)


@pytest.mark.slow
def test_expert_count_not_divisible_by_expert_axis_is_refused():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  cfg = ModelConfig(**{**CFG.__dict__, "num_experts": 6})
  mesh = sharding.make_mesh(1, 1, 1, expert=8)
  graphdef, params = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
  tokens = jnp.zeros((8, 4), jnp.int32)
  with jax.set_mesh(mesh), pytest.raises(ValueError, match="num_experts=6 is not a multiple"):
    jax.jit(sequence_logits, static_argnums=0)(graphdef, params, tokens, jnp.ones((8, 4), bool))


@pytest.mark.parametrize("engine,page_size", [("static", 0), ("continuous", 0), ("continuous", 4)])
@pytest.mark.slow
def test_engines_record_the_routing_the_trainer_recomputes(engine, page_size):
  """The sampler's experts per fed token (prefill and decode steps) are the full-sequence forward's, in float32;
  -1 at padding and at each response's last token, which is never fed."""
  from jaxrl_batch.sampling import EngineSettings, Strategy, rollout
  graphdef, params = one_device_model(CFG)
  rng = np.random.default_rng(0)
  lengths = np.array([1, 4, 6])
  valid = np.arange(6)[None, :] >= 6 - lengths[:, None]
  prompt, valid = (np.repeat(x, 2, axis=0) for x in (np.where(valid, rng.integers(3, CFG.vocab_size, (3, 6)), 0),
                                                     valid))
  settings = EngineSettings(attention_backend="xla", engine=engine, chunk=3, page_size=page_size)
  out, _ = rollout(graphdef, params, jnp.asarray(prompt, jnp.int32), jnp.asarray(valid), jax.random.key(1),
                   max_new_tokens=9, eos_id=2, pad_id=0, sampling=Strategy(temperature=1.0), engine=settings,
                   group_size=2, slots=3 if engine == "continuous" else 0, budget_B=jnp.array([9, 3, 9, 5, 9, 2]))
  tokens = jnp.concatenate([jnp.asarray(prompt, jnp.int32), out.tokens_BxN], axis=1)
  full_valid = jnp.concatenate([jnp.asarray(valid), out.mask_BxN], axis=1)
  _, _, routings = nnx.merge(graphdef, params).forward(tokens, positions_from_valid(full_valid),
                                                       causal_mask(full_valid))
  trainer = np.asarray(moe.stacked_experts(routings, *tokens.shape))
  fed = np.concatenate([valid, np.arange(9)[None, :] < np.asarray(out.lengths_B)[:, None] - 1], axis=1)
  recorded = np.asarray(out.experts_BxTxLxK)
  assert recorded.shape == trainer.shape == (6, 15, 2, 2) and recorded.dtype == np.int16
  np.testing.assert_array_equal(recorded[fed], trainer[fed])
  assert np.all(recorded[~fed] == -1) and fed[:, 6:].sum() > 10
