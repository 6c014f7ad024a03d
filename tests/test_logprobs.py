"""Memory settings that change no value: log-probs and entropies in chunks of positions (`model.logits_chunk`) and
rematerialised blocks (`model.remat`) give the dense forward's values and gradients, padded and packed; a numpy
log-softmax of the dense logits is the reference; the chunked program's temporaries are a chunk's, not (B, T, V)."""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import layout, sequence_logits, token_stats
from tests.close import assert_close, assert_trees_close
from tests.helpers import one_device_model, tiny_config

CFG = tiny_config(vocab_size=37, d_model=16, head_dim=4, d_ff=32)
MOE = dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2, moe_d_ff=8)
B, T, TEMPERATURE = 3, 23, 0.7


def graphdef_and_params(cfg, **settings):
  return one_device_model(dataclasses.replace(cfg, **settings))


def inputs(packed: bool):
  """Left/right-padded rows, or packed rows of two sequences each (segment ids 1, 2 and padding 0)."""
  rng = np.random.default_rng(1)
  tokens = rng.integers(0, CFG.vocab_size, (B, T)).astype(np.int32)
  if not packed:
    valid = np.ones((B, T), bool)
    valid[0, :4], valid[1, -6:] = False, False
    return jnp.asarray(tokens), jnp.asarray(valid), None, None
  segments = np.zeros((B, T), np.int32)
  for row, (a, b) in enumerate([(9, 20), (12, 23), (5, 11)]):
    segments[row, :a], segments[row, a:b] = 1, 2
  positions = np.zeros((B, T), np.int32)
  for row in range(B):
    for seg in (1, 2):
      where = segments[row] == seg
      positions[row, where] = np.arange(where.sum())
  return jnp.asarray(tokens), jnp.asarray(segments > 0), jnp.asarray(segments), jnp.asarray(positions)


def objective(graphdef, params, tokens, valid, segments, positions):
  """A loss that uses both outputs: sum(logp) + 0.3 sum(entropy) over valid targets."""
  model = nnx.merge(graphdef, params)
  hidden, _, _ = model.forward(tokens, *layout(valid, segments, positions))
  logp, entropy = token_stats(model, hidden, tokens, TEMPERATURE, entropy=True)
  weight = valid.at[:, 0].set(False)
  return jnp.sum(jnp.where(weight, logp + 0.3 * entropy, 0.0)), (logp, entropy)


def run(cfg, packed, **settings):
  graphdef, params = graphdef_and_params(cfg, **settings)
  fn = jax.jit(jax.value_and_grad(lambda p, *x: objective(graphdef, p, *x), has_aux=True))
  (loss, (logp, entropy)), grads = fn(params, *inputs(packed))
  return params, graphdef, float(loss), np.asarray(logp), np.asarray(entropy), grads


def numpy_reference(graphdef, params, packed):
  """log p(token t | prefix) and the entropy at t - 1, from a float64 log-softmax of the dense logits."""
  tokens, valid, segments, positions = inputs(packed)
  logits = np.asarray(sequence_logits(graphdef, params, tokens, valid, segments, positions), np.float64)
  logits = logits / TEMPERATURE
  logq = logits - logits.max(-1, keepdims=True)
  logq -= np.log(np.exp(logq).sum(-1, keepdims=True))
  logp = np.take_along_axis(logq[:, :-1], np.asarray(tokens)[:, 1:, None], -1)[..., 0]
  entropy = -(np.exp(logq) * logq).sum(-1)[:, :-1]
  return np.pad(logp, ((0, 0), (1, 0))), np.pad(entropy, ((0, 0), (1, 0)))


@functools.cache
def dense(cfg, packed):
  """The dense forward (no chunks, no remat) and the numpy reference of its log-probs and entropies."""
  params, graphdef, loss, logp, entropy, grads = run(cfg, packed, logits_chunk=0, remat="none")
  want_logp, want_entropy = numpy_reference(graphdef, params, packed)
  return loss, logp, entropy, grads, want_logp, want_entropy


@pytest.mark.parametrize("cfg, packed", [(CFG, False), (MOE, True)], ids=["dense_padded", "moe_packed"])
@pytest.mark.slow
def test_dense_form_equals_numpy_reference(cfg, packed):
  _, logp, entropy, _, want_logp, want_entropy = dense(cfg, packed)
  assert_close(logp, want_logp, 5e-6)
  assert_close(entropy, want_entropy, 1e-5)
  assert np.abs(logp).max() > 1 and entropy.max() > 1  # Not trivially equal.


# Chunks that divide T - 1 = 22, that do not (a padded last chunk), of one position; each remat policy.
@pytest.mark.parametrize("cfg, packed, settings", [
    (CFG, False, dict(logits_chunk=5)),
    (CFG, False, dict(logits_chunk=1, remat="block")),
    (CFG, False, dict(logits_chunk=11, remat="dots")),
    (CFG, True, dict(logits_chunk=5, remat="block")),
    (MOE, True, dict(logits_chunk=7, remat="block")),
], ids=["chunk5", "chunk1_block", "chunk11_dots", "packed_chunk5_block", "moe_packed_chunk7_block"])
@pytest.mark.slow
def test_chunks_and_remat_leave_values_and_gradients_unchanged(cfg, packed, settings):
  loss, logp, entropy, grads, want_logp, _ = dense(cfg, packed)
  _, _, loss2, logp2, entropy2, grads2 = run(cfg, packed, **settings)
  assert_close(logp2, logp, 2e-7)
  assert_close(entropy2, entropy, 2e-6)
  assert_close(loss2, loss, 1e-6, scale=np.abs(want_logp).sum())
  assert_trees_close(grads2, grads, 1e-5)  # sums of many products, at each leaf's largest entry


@pytest.mark.slow
def test_without_entropy_only_log_probs():
  graphdef, params = graphdef_and_params(CFG, logits_chunk=5)
  tokens, valid, _, _ = inputs(False)
  model = nnx.merge(graphdef, params)
  hidden, _, _ = model.forward(tokens, *layout(valid))
  logp, entropy = token_stats(model, hidden, tokens, TEMPERATURE)
  assert entropy is None and logp.shape == (B, T) and np.all(np.asarray(logp)[:, 0] == 0)


def test_chunked_program_holds_one_chunk_of_logits():
  """The compiled gradient of `token_stats` (head and hidden states): the dense form holds the float32 (B, T, V)
  logits and more than as much again; with 64-position chunks the temporaries are a few chunks' logits (measured:
  8.5 MB against 67 MB)."""
  cfg = dataclasses.replace(CFG, vocab_size=4096)
  tokens = jnp.zeros((2, 513), jnp.int32)
  hidden = jnp.ones((2, 513, cfg.d_model), jnp.float32)

  def temps(chunk):
    graphdef, params = graphdef_and_params(cfg, logits_chunk=chunk)

    def loss(p, h):
      logp, entropy = token_stats(nnx.merge(graphdef, p), h, tokens, TEMPERATURE, entropy=True)
      return jnp.sum(logp + entropy)

    return jax.jit(jax.grad(loss, (0, 1))).lower(params, hidden).compile().memory_analysis().temp_size_in_bytes

  logits_bytes, chunk_bytes = 2 * 512 * 4096 * 4, 2 * 64 * 4096 * 4
  dense_temps, chunked_temps = temps(0), temps(64)
  assert dense_temps > 2 * logits_bytes, dense_temps
  assert chunked_temps < 5 * chunk_bytes, (chunked_temps, dense_temps)


def test_settings_are_checked():
  with pytest.raises(ValueError, match="model.remat='all' must be one of"):
    dataclasses.replace(CFG, remat="all")
  with pytest.raises(ValueError, match="model.logits_chunk=-1 must be >= 0"):
    dataclasses.replace(CFG, logits_chunk=-1)


def test_scoring_in_micro_batches_equals_one_forward():
  """`logprobs_and_values` of the policy and of a reference policy (`reference_cfg`) with score_num_micro = 3
  (forwards of one row) give the one-forward values, to a few float32 ulps (other batch shapes, other code)."""
  from configs.base import algo_config
  from jaxrl_batch.rl.forward import ModelDefs, logprobs_and_values, reference_cfg

  graphdef, params = graphdef_and_params(CFG)
  tokens, valid, _, _ = inputs(False)
  mask = valid.at[:, :T // 2].set(False)
  models, cfg = ModelDefs(graphdef), algo_config(old_logp="trainer", temperature=TEMPERATURE)
  ref = lambda n: logprobs_and_values(params, None, tokens, valid, mask, models=models, cfg=reference_cfg(cfg),
                                      num_micro=n)[0]
  old = lambda n: logprobs_and_values(params, None, tokens, valid, mask, models=models, cfg=cfg, num_micro=n)[0]
  assert_close(ref(3), ref(1), 2e-6)
  assert_close(old(3), old(1), 2e-6)
  assert_close(old(1), ref(1), 2e-6)
  assert np.abs(np.asarray(ref(1))).max() > 1


@pytest.mark.parametrize("settings", [dict(logits_chunk=4, remat="block"), dict(logits_chunk=7, remat="dots")],
                         ids=["chunk4_block", "chunk7_dots"])
@pytest.mark.slow
def test_update_under_memory_settings_equals_the_dense_update(settings):
  """One GRPO update (entropy bonus, 2 micro-batches) with chunked logits and remat: the dense update's loss,
  metrics and parameters."""
  import optax
  from configs.base import algo_config
  from jaxrl_batch.rl.batch import TrainBatch
  from jaxrl_batch.rl.forward import ModelDefs
  from jaxrl_batch.rl.update import update

  tokens, valid, _, _ = inputs(False)
  rng = np.random.default_rng(4)
  mask = valid.at[:, :T // 2].set(False)
  per_token = lambda x: jnp.where(mask, jnp.asarray(x, jnp.float32), 0.0)
  old = per_token(-rng.uniform(0.5, 3.0, (B, T)))
  zeros = jnp.zeros((B, T), jnp.float32)
  batch = TrainBatch(tokens, valid, mask, old, old, zeros, per_token(rng.normal(size=(B, 1)) * np.ones((1, T))),
                     zeros, zeros)
  cfg, tx = algo_config(entropy_coef=0.01), optax.sgd(0.1)

  def step(**model_settings):
    graphdef, params = graphdef_and_params(CFG, **model_settings)
    state, metrics = update(dict(params=params, opt_state=tx.init(params)), batch, jnp.float32(0.0),
                            models=ModelDefs(graphdef, tx), cfg=cfg, num_micro=3)
    return jax.tree.map(np.asarray, state["params"]), jax.tree.map(np.asarray, metrics)

  want_params, want = step(logits_chunk=0)
  got_params, got = step(**settings)
  assert want["grad_norm"] > 0.1 and want["entropy"] > 1
  for key in want:  # Sums of O(1) terms (weights sum to 1, |advantage| ~ 1): at least that size where they cancel.
    assert_close(got[key], want[key], 1e-5, scale=max(abs(float(want[key])), 1.0), err_msg=key)
  assert_trees_close(got_params, want_params, 1e-5)
