"""LoRA on the experts of an MoE layer (the target "experts"): an adapter per expert beside each expert stack, sharded
with its experts; every expert path (grouped, looped, chunked, sharded, replayed) gives the merged weights' output,
checked against a per-token numpy reference and against `lora.merged`; gradients reach the adapters."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import ModelConfig, Transformer, lora, moe, sequence_logits
from jaxrl_batch.model.masks import causal_mask, positions_from_valid
from jaxrl_batch.runtime import sharding
from tests.close import assert_close, assert_trees_close
from tests.helpers import next_token_loss

CFG = ModelConfig(vocab_size=64, d_model=16, num_layers=3, num_heads=2, num_kv_heads=1, head_dim=8, d_ff=32,
                  qk_norm=True, tie_embeddings=False, num_experts=8, num_experts_per_tok=2, moe_d_ff=8,
                  mlp_only_layers=(1,))
LORA = lora.LoRAConfig(rank=4, alpha=8.0, targets=("q", "gate", "experts"))
ONE = jax.devices()[:1]


def _model(mesh, cfg=CFG, lora_cfg=LORA):
  """(graphdef, params) of the tiny MoE model with adapters, created sharded on `mesh`."""
  return sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(0), lora_cfg), mesh, sharding.DEFAULT_RULES)


def _random_adapters(params, seed=1, scale=0.3):
  """`params` with every adapter leaf (a and b) drawn at random, so each adapter changes its weight."""
  adapters, base = lora.split(params)
  leaves, tree = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  drawn = [scale * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  return lora.merge(base, jax.tree.unflatten(tree, drawn))


def _stacks(seed, e=8, d=16, f=8, r=3):
  """Random expert weights (w_gate, w_up, w_down) and their adapters ((a, b) each, nonzero)."""
  ks = jax.random.split(jax.random.key(seed), 9)
  w = (jax.random.normal(ks[0], (e, d, f)) / 4, jax.random.normal(ks[1], (e, d, f)) / 4,
       jax.random.normal(ks[2], (e, f, d)) / 3)
  adapters = tuple((jax.random.normal(ks[3 + 2 * i], (e, w_.shape[1], r)) / 3,
                    jax.random.normal(ks[4 + 2 * i], (e, r, w_.shape[2])) / 3) for i, w_ in enumerate(w))
  return w, adapters


def _per_token_reference(x, experts, weights, w, adapters):
  """float64 numpy, token by token: each chosen expert's SwiGLU with its merged weights W_e + a_e b_e, mixed."""
  x, experts, weights = (np.asarray(v, np.float64) for v in (x, experts, weights))
  merged = [np.asarray(w_, np.float64) + np.asarray(a, np.float64) @ np.asarray(b, np.float64)
            for w_, (a, b) in zip(w, adapters)]
  y = np.zeros_like(x)
  for n in range(x.shape[0]):
    for e, mix in zip(experts[n].astype(int), weights[n]):
      gate = x[n] @ merged[0][e]
      h = gate / (1 + np.exp(-gate)) * (x[n] @ merged[1][e])
      y[n] += mix * (h @ merged[2][e])
  return y


def _dense_reference(x, experts, weights, w, adapters):
  """jnp, differentiable: every expert's merged weights on every token, then each token's chosen experts mixed."""
  wg, wu, wd = (w_ + jnp.einsum("eir,ero->eio", a, b) for w_, (a, b) in zip(w, adapters))
  all_ExNxD = jnp.einsum("enf,efd->end", jax.nn.silu(jnp.einsum("nd,edf->enf", x, wg)) *
                         jnp.einsum("nd,edf->enf", x, wu), wd)
  mix_NxE = jnp.zeros((x.shape[0], wg.shape[0])).at[jnp.arange(x.shape[0])[:, None], experts].add(weights)
  return jnp.einsum("end,ne->nd", all_ExNxD, mix_NxE)


def test_experts_target_gives_each_stack_a_per_expert_adapter_sharded_with_its_experts():
  model = nnx.merge(*_model(sharding.make_mesh(1, 1, 1, devices=ONE)))
  e, d, f, r = CFG.num_experts, CFG.d_model, CFG.moe_d_ff, LORA.rank
  names = {"w_gate": ("embed", "mlp"), "w_up": ("embed", "mlp"), "w_down": ("mlp", "embed")}
  shapes = {"w_gate": (d, f), "w_up": (d, f), "w_down": (f, d)}
  for layer in CFG.moe_layers:
    mlp = model.blocks[layer].mlp
    for stack, (in_name, out_name) in names.items():
      adapter = getattr(mlp, stack + "_lora")
      fan_in, fan_out = shapes[stack]
      assert adapter.a[...].shape == (e, fan_in, r) and adapter.b[...].shape == (e, r, fan_out)
      assert adapter.a[...].dtype == adapter.b[...].dtype == jnp.float32
      assert not np.any(adapter.b[...]) and np.all(np.abs(adapter.a[...]).sum(axis=(1, 2)) > 0)
      assert adapter.a.get_metadata()["out_sharding"] == ("expert", in_name, None)
      assert adapter.b.get_metadata()["out_sharding"] == ("expert", None, out_name)
  # The dense layer's MLP has its "gate" adapter only; without "experts" an MoE layer has none.
  assert {k for k in vars(model.blocks[1].mlp) if k.endswith("_lora")} == {"w_gate_lora"}
  plain = nnx.merge(*_model(sharding.make_mesh(1, 1, 1, devices=ONE), lora_cfg=lora.LoRAConfig(rank=4)))
  assert not any(k.endswith("_lora") for k in vars(plain.blocks[0].mlp))
  # Adapters are their own parameters in the tree: split takes them all and nothing else, merge puts them back.
  params = nnx.to_pure_dict(nnx.state(model))
  adapters, base = lora.split(params)
  assert sorted(adapters["blocks"][0]["mlp"]) == ["w_down_lora", "w_gate_lora", "w_up_lora"]
  assert not lora.has_adapters(base) and set(base["blocks"][0]["mlp"]) == {"router", "w_gate", "w_up", "w_down"}
  jax.tree.map(np.testing.assert_array_equal, lora.merge(base, adapters), params)
  with pytest.raises(ValueError, match="lora.targets"):
    lora.LoRAConfig(rank=4, targets=("expert",))


@pytest.mark.parametrize("path, n, chunk", [("grouped", 40, 0), ("looped", 40, 0), ("looped", 2, 0),
                                            ("chunked", 40, 16)])
def test_every_expert_path_adds_each_experts_own_low_rank_update(path, n, chunk):
  """Values against a per-token numpy reference on the merged weights, with all experts here and with experts 4..7
  held here (the halves sum to the whole); gradients of the adapters and the input against a dense jnp reference."""
  fn = {"grouped": moe.grouped_swiglu, "looped": moe.looped_swiglu,
        "chunked": lambda *a, **kw: moe.chunked_swiglu(*a, chunk=chunk, **kw)}[path]
  x = jax.random.normal(jax.random.key(0), (n, 16))
  experts = jax.random.randint(jax.random.key(1), (n, 3), 0, 8)
  weights = jax.random.uniform(jax.random.key(2), (n, 3))
  w, adapters = _stacks(3)
  want = _per_token_reference(x, experts, weights, w, adapters)
  assert_close(fn(x, experts, weights, *w, adapters=adapters), want, 5e-6)
  assert np.abs(want - _per_token_reference(x, experts, weights, w, [(a, 0 * b) for a, b in adapters])).max() > 0.1
  halves = [fn(x, experts, weights, *(s[lo:lo + 4] for s in w), first_expert=lo,
               adapters=tuple((a[lo:lo + 4], b[lo:lo + 4]) for a, b in adapters)) for lo in (0, 4)]
  assert_close(halves[0] + halves[1], want, 5e-6)

  def loss(f, x, adapters):
    return jnp.sum(jnp.sin(f(x, experts, weights, w, adapters)))

  got = jax.grad(loss, argnums=(1, 2))(lambda x, e, m, w, ad: fn(x, e, m, *w, adapters=ad), x, adapters)
  ref = jax.grad(loss, argnums=(1, 2))(_dense_reference, x, adapters)
  assert_trees_close(got, ref, 2e-5)


def _without_expert_updates(params):
  """`params` with the MoE layers' adapters' b zero (their updates off), the other adapters kept."""
  def leaf(path, x):
    keys = [getattr(p, "key", None) for p in path] + [None] * 5
    expert = keys[1] in CFG.moe_layers and keys[2] == "mlp" and str(keys[3]).endswith("_lora") and keys[4] == "b"
    return jnp.zeros_like(x) if expert else x
  return jax.tree_util.tree_map_with_path(leaf, params)


def _logits(graphdef, params, tokens, valid):
  """`sequence_logits` jitted afresh (a new function each call, so a patched expert path is traced anew)."""
  return jax.jit(lambda p: sequence_logits(graphdef, p, tokens, valid))(params)


@pytest.mark.slow
@pytest.mark.parametrize("path", ["looped", "grouped"])
def test_moe_model_with_expert_adapters_gives_its_merged_weights_logits(path, monkeypatch):
  """Logits (and the hidden states under replayed routing) of the model with random adapters equal those of a model
  without adapters holding `lora.merged`; the base policy's equal the base weights'. The grouped case runs
  `grouped_swiglu` wherever the loop would run (on CPU, every call)."""
  if path == "grouped":
    monkeypatch.setattr(moe, "looped_swiglu", moe.grouped_swiglu)
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE)
  graphdef, params = _model(mesh)
  params = _random_adapters(params)
  plain, _ = _model(mesh, lora_cfg=None)
  tokens = jax.random.randint(jax.random.key(5), (3, 7), 0, CFG.vocab_size)
  valid = jnp.ones((3, 7), bool).at[0, :2].set(False)
  text = jax.jit(lambda p: sequence_logits(graphdef, p, tokens, valid)).lower(params).as_text()
  assert ("stablehlo.while" in text) == (path == "looped")  # on CPU ragged_dot lowers to masked dot_generals
  got = _logits(graphdef, params, tokens, valid)
  assert_close(got, _logits(plain, lora.merged(params, LORA), tokens, valid), 1e-5)
  # Only the expert adapters differ from the merged model's: without them the logits move.
  assert np.abs(np.asarray(_logits(graphdef, _without_expert_updates(params), tokens, valid) - got)).max() > 1e-2
  base = lora.base_policy(params)
  assert_close(_logits(graphdef, base, tokens, valid), _logits(plain, lora.split(base)[1], tokens, valid), 5e-7)
  # Routing replay (another expert for every token): the adapters follow the replayed experts.
  args = tokens, positions_from_valid(valid), causal_mask(valid)
  replay = (moe.stacked_experts(nnx.merge(graphdef, params).forward(*args)[2], 3, 7) + 3) % CFG.num_experts
  hidden = jax.jit(lambda p: nnx.merge(graphdef, p).forward(*args, replay_BxTxLxK=replay)[0])(params)
  want = jax.jit(lambda p: nnx.merge(plain, p).forward(*args, replay_BxTxLxK=replay)[0])(lora.merged(params, LORA))
  assert_close(hidden, want, 2e-5)


@pytest.mark.slow
def test_adapter_gradients_reach_every_expert_adapter_and_equal_the_merged_weights_chain_rule():
  """jax.grad of the loss in the adapters only (`lora.split`, merged back with `lora.merge`): a gradient for each
  adapter and no base weight, equal to differentiating a model without adapters through `lora.merged`. At init
  (b = 0) the gradient reaches b, not a."""
  mesh = sharding.make_mesh(1, 1, 1, devices=ONE)
  graphdef, fresh = _model(mesh)
  plain, _ = _model(mesh, lora_cfg=None)
  tokens = jax.random.randint(jax.random.key(6), (4, 6), 0, CFG.vocab_size)
  valid = jnp.ones((4, 6), bool)

  def adapter_grads(params):
    adapters, base = lora.split(params)
    return jax.jit(jax.grad(lambda ad: next_token_loss(graphdef, lora.merge(base, ad), tokens, valid)))(adapters)

  params = _random_adapters(fresh)
  adapters, base = lora.split(params)
  grads = adapter_grads(params)
  assert jax.tree.structure(grads) == jax.tree.structure(adapters)  # adapters only: no base weight is differentiated
  via_merged = jax.jit(jax.grad(lambda ad: next_token_loss(plain, lora.merged(lora.merge(base, ad), LORA), tokens,
                                                           valid)))(adapters)
  assert_trees_close(grads, via_merged, 5e-5)
  for layer in CFG.moe_layers:
    for stack in moe.STACKS:
      node = grads["blocks"][layer]["mlp"][stack + "_lora"]
      norms = [float(jnp.abs(node[leaf]).sum(axis=(1, 2)).min()) for leaf in ("a", "b")]
      assert min(norms) > 0, (layer, stack, norms)  # every expert's a and b (each routed to by some token)
  at_init = adapter_grads(fresh)["blocks"][0]["mlp"]["w_up_lora"]
  assert not np.any(at_init["a"]) and np.abs(at_init["b"]).max() > 0


ROWS = 8  # rows of the expert-parallel test's batch: 4 per data shard on (2, 1, 2, 2)


def _loss_and_adapter_grads(graphdef, params, mesh, tokens, valid):
  """The next-token loss and its gradients in the adapters of `params` (rows over the mesh's batch axes)."""
  adapters, base = lora.split(params)
  batch = jax.device_put((tokens, valid), sharding.batch_sharding(mesh))
  with jax.set_mesh(mesh):
    return jax.jit(jax.value_and_grad(lambda ad, t, v: next_token_loss(graphdef, lora.merge(base, ad), t, v)))(
        adapters, *batch)


@pytest.fixture(name="one_device_reference", scope="module")
def _one_device_reference():
  """The expert-parallel test's batch, the one-device model with random adapters, its loss and adapter gradients,
  and the loss of a model without adapters holding `lora.merged`: computed once for both meshes."""
  tokens = jax.random.randint(jax.random.key(7), (ROWS, 6), 0, CFG.vocab_size)
  valid = jnp.ones((ROWS, 6), bool).at[::2, :2].set(False)
  one = sharding.make_mesh(1, 1, 1, devices=ONE)
  graphdef1, params1 = _model(one)
  params1 = _random_adapters(params1)
  plain, _ = _model(one, lora_cfg=None)
  loss1, grads1 = _loss_and_adapter_grads(graphdef1, params1, one, tokens, valid)
  merged_loss = jax.jit(lambda p: next_token_loss(plain, p, tokens, valid))(lora.merged(params1, LORA))
  return tokens, valid, params1, loss1, grads1, merged_loss


@pytest.mark.slow
@pytest.mark.xdist_group("lora_moe_expert_mesh")  # one worker computes the one-device reference for both meshes
# (1, 1, 1, 8) adds no path these two leave out (25 s of the suite): expert 4 with tensor 2 and chunks, and data 2.
@pytest.mark.parametrize("mesh_shape, moe_chunk", [((1, 1, 2, 4), 5), ((2, 1, 2, 2), CFG.moe_chunk)])
def test_expert_parallel_mesh_gives_the_merged_weights_loss_and_the_same_adapter_grads(mesh_shape, moe_chunk,
                                                                                       one_device_reference):
  """(data, fsdp, tensor, expert): the adapters split over `expert` with their experts (and w_down's a over
  `tensor`); the loss is the one-device merged model's and the adapters' gradients the one-device model's."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  data, fsdp, tensor, expert = mesh_shape
  tokens, valid, params1, loss1, grads1, merged_loss = one_device_reference
  mesh = sharding.make_mesh(data, fsdp, tensor, expert=expert)
  graphdef8, params8 = _model(mesh, dataclasses.replace(CFG, moe_chunk=moe_chunk))
  params8 = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding), params1, params8)
  adapter = params8["blocks"][0]["mlp"]["w_down_lora"]
  assert adapter["a"].addressable_shards[0].data.shape == (CFG.num_experts // expert, CFG.moe_d_ff // tensor, 4)
  assert adapter["b"].addressable_shards[0].data.shape == (CFG.num_experts // expert, 4, CFG.d_model)
  loss8, grads8 = _loss_and_adapter_grads(graphdef8, params8, mesh, tokens, valid)
  assert_close(loss8, merged_loss, 1e-5)
  assert_close(loss8, loss1, 1e-5)
  assert_trees_close(grads8, grads1, 1e-4)
