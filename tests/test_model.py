"""Decoder: causality, padding, cache equivalence, GQA attention vs a plain numpy reference, sharding."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.runtime import sharding
from jaxrl_batch.model import (DecodeSpan, KVCache, ModelConfig, Transformer, cache_mask, positions_from_valid,
                               sequence_logits)
from jaxrl_batch.model.layers import apply_rope, attend
from tests.close import assert_close, assert_trees_close
from tests.helpers import next_token_loss, one_device_model, tiny_config

CFG = tiny_config(vocab_size=40, tie_embeddings=False)


@pytest.fixture(scope="module")
def model():
  return one_device_model(CFG)


def _tokens(b, t, seed=0):
  return jax.random.randint(jax.random.key(seed), (b, t), 0, CFG.vocab_size)


@pytest.mark.parametrize("t,s", [(3, 3), (1, 6)])  # a causal block, and one decode query over a left-padded span
def test_attend_matches_numpy_reference(t, s):
  rng = np.random.default_rng(0)
  b, n, k, h = 2, 4, 2, 5
  q = rng.normal(size=(b, t, n, h)).astype(np.float32)
  key = rng.normal(size=(b, k, h, s)).astype(np.float32)  # the cache layout: keys (B, K, H, S)
  val = rng.normal(size=(b, k, s, h)).astype(np.float32)  # values (B, K, S, H)
  if t == s:
    mask = np.tril(np.ones((t, t), bool))[None].repeat(b, 0)
  else:
    mask = (np.arange(s)[None, None] >= np.array([0, 2])[:, None, None]).repeat(t, 1)
  want = np.zeros((b, t, n, h), np.float32)
  for bi in range(b):
    for head in range(n):
      kv = head // (n // k)  # query heads 0,1 share kv head 0; 2,3 share kv head 1
      s = q[bi, :, head] @ key[bi, kv] / np.sqrt(h)
      s = np.where(mask[bi], s, -np.inf)
      p = np.exp(s - s.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      want[bi, :, head] = p @ val[bi, kv]
  assert_close(attend(q, key, val, mask), want, 5e-6)


def test_rope_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 1, 8)), jnp.float32)
  def score(m, n):
    return float(jnp.sum(apply_rope(q, jnp.array([[m]]), 1e4) * apply_rope(k, jnp.array([[n]]), 1e4)))
  # A dot product, a sum that can cancel: compared to its terms' magnitude, at most |q| |k|.
  terms = float(jnp.linalg.norm(q) * jnp.linalg.norm(k))
  assert_close(score(7, 3), score(14, 10), 1e-5, scale=terms)
  assert abs(score(7, 3) - score(7, 4)) > 1e-3 * terms
  # Position 0 is the identity rotation.
  assert_close(apply_rope(q, jnp.array([[0]]), 1e4), q, 2e-7)


def test_causal(model):
  graphdef, params = model
  tokens = _tokens(2, 6)
  valid = jnp.ones((2, 6), bool)
  changed = tokens.at[:, 4:].set((tokens[:, 4:] + 1) % CFG.vocab_size)
  a = sequence_logits(graphdef, params, tokens, valid)
  b = sequence_logits(graphdef, params, changed, valid)
  assert_close(a[:, :4], b[:, :4], 5e-7)
  assert np.abs(a[:, 4:] - b[:, 4:]).max() > 1e-3 * np.abs(b[:, 4:]).max()


@pytest.mark.slow
def test_left_padding_does_not_change_logits(model):
  graphdef, params = model
  tokens = _tokens(1, 5)
  padded = jnp.concatenate([jnp.zeros((1, 3), jnp.int32), tokens], axis=1)
  valid = jnp.arange(8)[None] >= 3
  plain = sequence_logits(graphdef, params, tokens, jnp.ones((1, 5), bool))
  shifted = sequence_logits(graphdef, params, padded, valid)
  assert_close(shifted[:, 3:], plain, 5e-6)


@pytest.mark.parametrize("decode_backend", ["xla", "pallas"])
@pytest.mark.slow
def test_cached_decode_equals_full_forward(model, decode_backend):
  # A dense-mask prefill, then one-token steps that describe their keys by the span from each row's first real
  # token to its own slot.
  graphdef, params = model
  b, p, n = 2, 5, 4
  tokens = _tokens(b, p + n, seed=3)
  valid = jnp.ones((b, p + n), bool).at[0, :2].set(False)  # row 0 is left-padded by 2
  full = sequence_logits(graphdef, params, tokens, valid)

  net = nnx.merge(graphdef, params)
  cache = KVCache.zeros(CFG, b, p + n)
  positions = positions_from_valid(valid)
  logits, cache = net(tokens[:, :p], positions[:, :p], cache_mask(valid.at[:, p:].set(False), 0, p), cache, 0)
  assert_close(logits[1], full[1, :p], 5e-6)
  assert_close(logits[0, 2:], full[0, 2:p], 5e-6)
  starts = jnp.array([2, 0])
  for i in range(p, p + n):
    span = DecodeSpan(starts, jnp.full((b,), i + 1))
    step_logits, cache = net(tokens[:, i:i + 1], positions[:, i:i + 1], span, cache, i,
                             decode_backend=decode_backend)
    assert_close(step_logits[:, 0], full[:, i], 1e-5)


@pytest.mark.parametrize("decode_backend", ["xla", "pallas"])
def test_decode_backend_picks_the_attention(model, decode_backend):
  # Each layer runs the kernel under "pallas" and never under "xla" (the logits alone would not tell them apart).
  net = nnx.merge(*model)
  span = DecodeSpan(jnp.zeros(2, jnp.int32), jnp.full((2,), 3))
  jaxpr = str(jax.make_jaxpr(lambda cache: net(_tokens(2, 1), jnp.full((2, 1), 2), span, cache, 2,
                                               decode_backend=decode_backend))(KVCache.zeros(CFG, 2, 4)))
  calls = jaxpr.count("platform_index[")  # per layer, the kernel's forms by platform (interpret, Triton)
  assert (calls, "pallas_call" in jaxpr) == ((CFG.num_layers, True) if decode_backend == "pallas" else (0, False))


def test_decode_backend_is_refused_outside_a_cached_one_token_step(model):
  net = nnx.merge(*model)
  span = DecodeSpan(jnp.zeros(2, jnp.int32), jnp.full((2,), 3))
  with pytest.raises(ValueError, match="T = 2"):
    net(_tokens(2, 2), jnp.zeros((2, 2), jnp.int32), span, KVCache.zeros(CFG, 2, 4), 0, decode_backend="xla")
  with pytest.raises(ValueError, match="no cache"):
    net(_tokens(2, 1), jnp.zeros((2, 1), jnp.int32), span, decode_backend="xla")


def test_decode_step_reads_the_cache_in_place(model):
  # The only ops of an XLA decode step whose result has a cache layer's shape are the in-place writes of the new
  # token (a dynamic-update-slice, alone or as a fusion's root): no copy, transpose, slice or concatenate of the
  # cache.
  graphdef, params = model
  b, s = 3, 24
  k_shape, v_shape = f"f32[{b},2,8,{s}]", f"f32[{b},2,{s},8]"  # (B, K, H, S) and (B, K, S, H) of CFG

  def step(params, cache, token_B):
    span = DecodeSpan(jnp.array([0, 2, 5]), jnp.full((b,), 11))
    return nnx.merge(graphdef, params)(token_B[:, None], jnp.full((b, 1), 10), span, cache, 10, decode_backend="xla")

  cache = KVCache.zeros(CFG, b, s)
  hlo = jax.jit(step, donate_argnums=1).lower(params, cache, jnp.zeros((b,), jnp.int32)).compile().as_text()
  opcode = lambda line: re.search(r" ([a-z][a-z0-9_-]*)\(", line.split(" = ", 1)[1]).group(1)
  roots = {}  # fused computation -> opcode of its root
  for computation in hlo.split("\n\n"):
    root = [line for line in computation.splitlines() if " ROOT " in line]
    if root:
      roots[computation.split()[0].lstrip("%")] = opcode(root[0])
  ops = []
  for line in hlo.splitlines():
    if " = " not in line or " ROOT %tuple" in line or not any(f"= {shape}" in line for shape in (k_shape, v_shape)):
      continue
    op = opcode(line)
    if op == "fusion":
      op = "fusion:" + roots[re.search(r"calls=%([\w.-]+)", line).group(1)]
    ops.append(op)
  assert ops and set(ops) <= {"parameter", "bitcast", "dynamic-update-slice", "fusion:dynamic-update-slice"}, ops


def test_jit_equals_eager(model):
  graphdef, params = model
  tokens, valid = _tokens(2, 4), jnp.ones((2, 4), bool)
  eager = sequence_logits(graphdef, params, tokens, valid)
  jitted = jax.jit(sequence_logits, static_argnums=0)(graphdef, params, tokens, valid)
  assert_close(eager, jitted, 5e-6)


def test_num_params_matches_created_tree(model):
  _, params = model
  assert sum(x.size for x in jax.tree.leaves(params)) == CFG.num_params()


def test_invalid_config_is_refused():
  with pytest.raises(ValueError, match="multiple of model.num_kv_heads"):
    ModelConfig(vocab_size=8, d_model=8, num_layers=1, num_heads=3, num_kv_heads=2, head_dim=4, d_ff=8)
  with pytest.raises(ValueError, match="Unknown model config keys"):
    ModelConfig.from_config(dict(vocab_size=8, d_model=8, num_layers=1, num_heads=2, num_kv_heads=2, head_dim=4,
                                 d_ff=8, hidden=3))


@pytest.mark.slow
def test_eight_device_mesh_gives_same_loss_and_grads():
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices (tests/conftest.py fakes them on CPU)")
  tokens = _tokens(8, 6, seed=5)
  valid = jnp.ones((8, 6), bool).at[::2, :2].set(False)
  results = []
  for mesh in (sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]), sharding.make_mesh(2, 2, 2)):
    graphdef, params = sharding.create_sharded(lambda: Transformer(CFG, nnx.Rngs(0)), mesh, sharding.DEFAULT_RULES)
    batch = jax.device_put((tokens, valid), sharding.batch_sharding(mesh))
    with jax.set_mesh(mesh):
      loss, grads = jax.jit(jax.value_and_grad(next_token_loss, argnums=1), static_argnums=0)(graphdef, params, *batch)
    results.append((loss, grads, params))
  (loss1, grads1, params1), (loss8, grads8, params8) = results
  assert len(params8["embedding"].sharding.device_set) == 8
  assert params8["blocks"][0]["mlp"]["w_up"].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  assert_trees_close(params8, params1, 2e-6)
  assert_close(loss1, loss8, 1e-5)
  assert_trees_close(grads8, grads1, 5e-5)
