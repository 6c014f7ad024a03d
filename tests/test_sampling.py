"""Sampler: exact tokens from a fake model, EOS handling, cache buckets and early exit, the decode backend handed
to the model, agreement with a full forward pass, the Pallas backend, group prefix sharing and no recompiles."""
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch.model import ModelConfig, sequence_logits
from jaxrl_batch.sampling import EngineSettings, Strategy, engine_settings, generate
from jaxrl_batch.sampling.generate import cache_buckets
from jaxrl_batch.sampling.strategies import argmax, sample, truncate
from tests.close import assert_close
from tests.helpers import one_device_model, tiny_config

V, EOS, PAD = 12, 2, 0
FAKE_CFG = ModelConfig(vocab_size=V, d_model=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, d_ff=4)
TINY_CFG = tiny_config(vocab_size=V)
GREEDY = Strategy(temperature=0.0)


class StepLog:
  """(cache slot written, cache slots read) of each decode step run, and the decode backends the model was handed;
  hashable by identity (static model metadata)."""

  def __init__(self):
    self.steps = []
    self.backends = set()
    self.cache_lengths = set()


class CountingModel(nnx.Module):
  """Deterministic fake: the next token is (current token + 1) mod V, with overwhelming confidence.

  Each decode step (a `step`; the prefill uses `forward`) is recorded in `log` when one is given; it ignores the
  span and the decode backend it is handed. A dense model: no routing.
  """

  def __init__(self, log=None):
    self.cfg = FAKE_CFG
    self.unused = nnx.Param(jnp.zeros(()))
    self.log = log

  def forward(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None):
    return tokens_BxT, cache, ()  # the "hidden state" is the token

  def logits(self, hidden_BxT):
    return 50.0 * jax.nn.one_hot((hidden_BxT + 1) % V, V)

  def step(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None, decode_backend=None):
    if self.log is not None:
      self.log.backends.add(decode_backend)
      size = mask_BxTxS.window or cache.length  # the slots a step reads
      self.log.cache_lengths.add(cache.length)
      jax.debug.callback(lambda slot: self.log.steps.append((int(slot), size)), cache_index)
    return self.logits(tokens_BxT), cache, None


def _fake(log=None):
  return nnx.split(CountingModel(log))


@pytest.fixture(scope="module")
def tiny():
  return one_device_model(TINY_CFG, seed=1)


def _group_prompts(seed):
  """3 random prompts of 4, 3 and 2 tokens (no EOS, no PAD), left-padded to 4, each repeated twice: 6 rows.

  The tests below share this shape and 12 new tokens, so they share compiles."""
  prompt = np.random.default_rng(seed).integers(3, V, size=(3, 4))
  valid = np.arange(4)[None, :] >= np.arange(3)[:, None]
  return jnp.repeat(jnp.asarray(np.where(valid, prompt, PAD), jnp.int32), 2, axis=0), jnp.repeat(valid, 2, axis=0)


def test_fake_model_gives_exact_tokens_and_stops_at_eos():
  graphdef, params = _fake()
  prompt = jnp.array([[PAD, 5, 6], [3, 4, 9]], jnp.int32)
  valid = prompt != PAD
  out = generate(graphdef, params, prompt, valid, jax.random.key(0), max_new_tokens=6, eos_id=EOS, pad_id=PAD,
                 sampling=GREEDY)
  # Row 0 counts 7, 8, 9, 10, 11, 0 (no EOS); row 1 counts 10, 11, 0, 1, 2=EOS, then padding.
  np.testing.assert_array_equal(out.tokens_BxN, [[7, 8, 9, 10, 11, 0], [10, 11, 0, 1, 2, PAD]])
  np.testing.assert_array_equal(out.mask_BxN, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(out.lengths_B, [6, 5])
  np.testing.assert_array_equal(out.truncated_B, [True, False])
  assert_close(out.logprobs_BxN[:, :5], 0.0, 1e-7, scale=50.0)  # confident fake: log p ~ 0


def test_sampling_at_temperature_follows_a_confident_model():
  graphdef, params = _fake()
  prompt = jnp.array([[3]], jnp.int32)
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(1), max_new_tokens=3, eos_id=EOS,
                 pad_id=PAD, sampling=Strategy(temperature=1.0, top_k=3, top_p=0.9))
  np.testing.assert_array_equal(out.tokens_BxN, [[4, 5, 6]])


def test_cache_buckets():
  assert cache_buckets(32, 64, "xla") == (64, 95)  # the last fed slot is P + N - 2 = 94
  assert cache_buckets(32, 4064, "xla") == (64, 128, 256, 512, 1024, 2048, 4095)
  assert cache_buckets(3, 6, "xla") == (4, 8)
  assert cache_buckets(4, 1, "xla") == (4,)  # no decode step: the prefill's P slots
  assert cache_buckets(32, 64, "pallas") == (128,)  # whole TPU tiles: 95 rounded up to a multiple of 128


def test_each_step_reads_the_smallest_bucket_and_the_loop_ends_with_the_last_row():
  # One prompt token (slot 0); the buckets are 2, 4, 8, 16, 32, 40 slots. Row 0 reaches EOS at its 8th token (7
  # decode steps, feeding slots 1..7), row 1 at its 5th: the loop stops after slot 7, skipping the 16-, 32- and
  # 40-slot segments.
  log = StepLog()
  graphdef, params = _fake(log)
  prompt = jnp.array([[6], [9]], jnp.int32)
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(0), max_new_tokens=40, eos_id=EOS,
                 pad_id=PAD, sampling=GREEDY)
  jax.effects_barrier()
  np.testing.assert_array_equal(out.lengths_B, [8, 5])
  assert sorted(log.steps) == [(1, 2), (2, 4), (3, 4), (4, 8), (5, 8), (6, 8), (7, 8)]
  assert log.backends == {"xla"}  # "auto" on CPU


def test_the_pallas_backend_is_handed_to_the_model_and_decodes_over_the_full_cache():
  # As above, but one segment of 128 slots (P + N - 1 = 40 rounded up to whole TPU tiles): the kernel reads only the
  # live blocks, so the cache does not grow.
  log = StepLog()
  graphdef, params = _fake(log)
  prompt = jnp.array([[6], [9]], jnp.int32)
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(0), max_new_tokens=40, eos_id=EOS,
                 pad_id=PAD, sampling=GREEDY, attention_backend="pallas")
  jax.effects_barrier()
  np.testing.assert_array_equal(out.lengths_B, [8, 5])
  assert sorted(log.steps) == [(slot, 128) for slot in range(1, 8)]
  assert log.backends == {"pallas"}


def test_no_decode_step_when_every_row_stops_at_once():
  log = StepLog()
  graphdef, params = _fake(log)
  prompt = jnp.array([[1]], jnp.int32)  # next token is 2 = EOS
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(0), max_new_tokens=5, eos_id=EOS,
                 pad_id=PAD, sampling=GREEDY)
  jax.effects_barrier()
  np.testing.assert_array_equal(out.tokens_BxN, [[EOS, PAD, PAD, PAD, PAD]])
  np.testing.assert_array_equal(out.lengths_B, [1])
  assert log.steps == []


def test_truncate_top_k_and_top_p_keep_expected_sets():
  logp = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  kept = lambda x: np.asarray(x[0] > -1e29)
  np.testing.assert_array_equal(kept(truncate(logp, 2, 1.0)), [1, 1, 0, 0, 0])
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.6)), [1, 1, 0, 0, 0])  # 0.5 < 0.6 -> need 2nd
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.5)), [1, 0, 0, 0, 0])
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.86)), [1, 1, 1, 1, 0])


def test_chunked_argmax_is_jnp_argmax():
  # 300 tokens: two whole chunks of 128 and a padded one; ties resolve to the first maximum, as jnp.argmax.
  x = jnp.asarray(np.random.default_rng(0).normal(size=(6, 300)), jnp.float32)
  x = x.at[1, 299].set(9.0).at[2, 5].set(9.0).at[2, 200].set(9.0).at[3].set(1.0).at[4, 130].set(9.0)
  np.testing.assert_array_equal(argmax(x), jnp.argmax(x, axis=-1))


def test_inverse_cdf_sampling_follows_the_distribution():
  # 300 tokens, mass in three chunks; truncated (-1e30) and -inf tokens are never drawn.
  probs = np.zeros(300)
  probs[[0, 2, 130, 131, 299]] = [0.1, 0.2, 0.3, 0.15, 0.25]
  logp = jnp.asarray(np.where(probs > 0, np.log(np.maximum(probs, 1e-30)), -1e30), jnp.float32)[None]
  logp = logp.at[0, 7].set(-jnp.inf)
  tokens = jax.jit(jax.vmap(lambda k: sample(logp + 3.0, k)[0]))(jax.random.split(jax.random.key(0), 40_000))
  freq = np.bincount(np.asarray(tokens), minlength=300) / 40_000
  assert_close(freq, probs, 0.01, scale=1.0)
  assert freq[probs == 0].sum() == 0


def test_invalid_sampling_settings_are_refused():
  with pytest.raises(ValueError, match="top_p"):
    Strategy(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    Strategy(temperature=-1.0)
  with pytest.raises(ValueError, match="attention_backend"):
    EngineSettings(attention_backend="triton")
  assert EngineSettings().backend == "xla"  # "auto" on CPU
  assert EngineSettings(attention_backend="pallas").backend == "pallas"


def test_the_sampling_config_group_splits_into_a_strategy_and_engine_settings():
  strategy, engine = engine_settings.from_config(dict(temperature=0.5, top_k=3, engine="continuous", chunk=4))
  assert strategy == Strategy(temperature=0.5, top_k=3)
  assert engine == EngineSettings(engine="continuous", chunk=4)
  assert hash(strategy) == hash(Strategy(temperature=0.5, top_k=3))  # a static jit argument: one compile per value
  with pytest.raises(ValueError, match=r"Unknown sampling config keys \['temprature'\]"):
    engine_settings.from_config(dict(temprature=0.5))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
@pytest.mark.slow
def test_generated_tokens_and_logprobs_match_full_forward(tiny, temperature):
  # 14 new tokens after 4 prompt slots cross three cache buckets (8, 16, 17 slots).
  graphdef, params = tiny
  prompt = jnp.array([[PAD, PAD, 5, 6], [3, 4, 9, 7]], jnp.int32)
  valid = prompt != PAD
  out = generate(graphdef, params, prompt, valid, jax.random.key(2), max_new_tokens=14, eos_id=EOS, pad_id=PAD,
                 sampling=Strategy(temperature=temperature))
  seq = jnp.concatenate([prompt, out.tokens_BxN], axis=1)
  seq_valid = jnp.concatenate([valid, out.mask_BxN], axis=1)
  logits = sequence_logits(graphdef, params, seq, seq_valid)[:, 3:-1]  # logits that predicted each new token
  logp = jax.nn.log_softmax(logits / (temperature or 1.0))
  want = jnp.take_along_axis(logp, out.tokens_BxN[..., None], axis=-1)[..., 0]
  assert_close(jnp.where(out.mask_BxN, want, 0.0), out.logprobs_BxN, 2e-5)
  if temperature == 0.0:
    greedy = jnp.argmax(logits, axis=-1)
    np.testing.assert_array_equal(jnp.where(out.mask_BxN, greedy, PAD), out.tokens_BxN)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_pallas_backend_gives_the_xla_tokens(tiny, temperature):
  # Left-padded rows of 4, 3 and 2 prompt tokens: the kernel must skip the padding slots (starts_B).
  graphdef, params = tiny
  prompt, valid = _group_prompts(0)
  outs = [generate(graphdef, params, prompt, valid, jax.random.key(3), max_new_tokens=12, eos_id=EOS, pad_id=PAD,
                   sampling=Strategy(temperature=temperature), attention_backend=backend)
          for backend in ("xla", "pallas")]
  np.testing.assert_array_equal(outs[0].tokens_BxN, outs[1].tokens_BxN)
  np.testing.assert_array_equal(outs[0].mask_BxN, outs[1].mask_BxN)
  assert_close(outs[0].logprobs_BxN, outs[1].logprobs_BxN, 5e-6)


@pytest.fixture
def in_place_generate(monkeypatch):
  """`generate` as traced for an accelerator: segments read growing windows of one full-size cache. JAX's caches
  are cleared around each call, so that it reuses no trace of the CPU path, nor the CPU path one of its traces."""
  module = importlib.import_module("jaxrl_batch.sampling.generate")

  def run(*args, **kwargs):
    jax.clear_caches()
    with monkeypatch.context() as patch:
      patch.setattr(module, "grows_in_place", lambda: True)
      out = jax.block_until_ready(module.generate(*args, **kwargs))
    jax.clear_caches()
    return out

  return run


def test_windows_of_one_full_cache_are_read_as_the_copied_buckets_were(in_place_generate):
  # As the bucket test above: the same slots, each step reading the same number of slots, of one 40-slot cache.
  log = StepLog()
  graphdef, params = _fake(log)
  prompt = jnp.array([[6], [9]], jnp.int32)
  out = in_place_generate(graphdef, params, prompt, prompt != PAD, jax.random.key(0), max_new_tokens=40, eos_id=EOS,
                          pad_id=PAD, sampling=GREEDY)
  jax.effects_barrier()
  np.testing.assert_array_equal(out.lengths_B, [8, 5])
  assert sorted(log.steps) == [(1, 2), (2, 4), (3, 4), (4, 8), (5, 8), (6, 8), (7, 8)]
  assert log.cache_lengths == {40}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.slow
def test_in_place_windows_give_the_copied_caches_tokens(tiny, in_place_generate, temperature):
  graphdef, params = tiny
  prompt, valid = _group_prompts(0)
  # No row stops (no token is V): every segment runs, windows of 8, 16, 32 and 43 slots.
  kwargs = dict(max_new_tokens=40, eos_id=V, pad_id=PAD, sampling=Strategy(temperature=temperature))
  copied = generate(graphdef, params, prompt, valid, jax.random.key(3), **kwargs)
  in_place = in_place_generate(graphdef, params, prompt, valid, jax.random.key(3), **kwargs)
  np.testing.assert_array_equal(copied.tokens_BxN, in_place.tokens_BxN)
  np.testing.assert_array_equal(copied.mask_BxN, in_place.mask_BxN)
  assert_close(copied.logprobs_BxN, in_place.logprobs_BxN, 5e-7)


def test_group_prefix_sharing_matches_the_unshared_path(tiny):
  # 3 prompts x 2 samples at temperature 1: the same per-row random stream, so the same samples.
  graphdef, params = tiny
  prompt, valid = _group_prompts(1)
  kwargs = dict(max_new_tokens=12, eos_id=EOS, pad_id=PAD, sampling=Strategy(temperature=1.0))
  unshared = generate(graphdef, params, prompt, valid, jax.random.key(4), **kwargs)
  shared = generate(graphdef, params, prompt, valid, jax.random.key(4), group_size=2, **kwargs)
  np.testing.assert_array_equal(shared.tokens_BxN, unshared.tokens_BxN)
  np.testing.assert_array_equal(shared.mask_BxN, unshared.mask_BxN)
  assert_close(shared.logprobs_BxN, unshared.logprobs_BxN, 5e-7)
  assert len({tuple(row) for row in np.asarray(shared.tokens_BxN)}) > 3  # the samples of a group differ
  with pytest.raises(ValueError, match="group_size=4"):
    generate(graphdef, params, prompt, valid, jax.random.key(4), group_size=4, **kwargs)


def test_new_prompts_of_the_same_shape_do_not_recompile(tiny):
  graphdef, params = tiny
  kwargs = dict(max_new_tokens=12, eos_id=EOS, pad_id=PAD, sampling=Strategy(temperature=1.0), group_size=2)
  jax.block_until_ready(generate(graphdef, params, *_group_prompts(5), jax.random.key(5), **kwargs))
  compiled = generate._cache_size()
  for seed in (6, 7):
    jax.block_until_ready(generate(graphdef, params, *_group_prompts(seed), jax.random.key(seed), **kwargs))
  assert generate._cache_size() == compiled
