"""Sampler: exact tokens from a fake model, EOS handling, and agreement with a full forward pass."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_batch import sharding
from jaxrl_batch.model import ModelConfig, Transformer, sequence_logits
from jaxrl_batch.sampling import SamplingParams, generate
from jaxrl_batch.sampling.strategies import truncate

V, EOS, PAD = 12, 2, 0
FAKE_CFG = ModelConfig(vocab_size=V, d_model=4, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=2, d_ff=4)


class CountingModel(nnx.Module):
  """Deterministic fake: the next token is (current token + 1) mod V, with overwhelming confidence."""

  def __init__(self):
    self.cfg = FAKE_CFG
    self.unused = nnx.Param(jnp.zeros(()))

  def __call__(self, tokens_BxT, positions_BxT, mask_BxTxS, cache=None, cache_index=None):
    return 50.0 * jax.nn.one_hot((tokens_BxT + 1) % V, V), cache


def _fake():
  return nnx.split(CountingModel())


def test_fake_model_gives_exact_tokens_and_stops_at_eos():
  graphdef, params = _fake()
  prompt = jnp.array([[PAD, 5, 6], [3, 4, 9]], jnp.int32)
  valid = prompt != PAD
  out = generate(graphdef, params, prompt, valid, jax.random.key(0), max_new_tokens=6, eos_id=EOS, pad_id=PAD,
                 sampling=SamplingParams(temperature=0.0))
  # Row 0 counts 7, 8, 9, 10, 11, 0 (no EOS); row 1 counts 10, 11, 0, 1, 2=EOS, then padding.
  np.testing.assert_array_equal(out.tokens_BxN, [[7, 8, 9, 10, 11, 0], [10, 11, 0, 1, 2, PAD]])
  np.testing.assert_array_equal(out.mask_BxN, [[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0]])
  np.testing.assert_array_equal(out.lengths_B, [6, 5])
  np.testing.assert_array_equal(out.truncated_B, [True, False])
  np.testing.assert_allclose(out.logprobs_BxN[:, :5], 0.0, atol=1e-6)  # confident fake: log p ~ 0


def test_sampling_at_temperature_follows_a_confident_model():
  graphdef, params = _fake()
  prompt = jnp.array([[3]], jnp.int32)
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(1), max_new_tokens=3, eos_id=EOS,
                 pad_id=PAD, sampling=SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
  np.testing.assert_array_equal(out.tokens_BxN, [[4, 5, 6]])


def test_loop_ends_when_all_rows_stopped():
  graphdef, params = _fake()
  prompt = jnp.array([[0 + 1]], jnp.int32)  # next token is 2 = EOS
  out = generate(graphdef, params, prompt, prompt != PAD, jax.random.key(0), max_new_tokens=5, eos_id=EOS,
                 pad_id=PAD, sampling=SamplingParams(temperature=0.0))
  np.testing.assert_array_equal(out.tokens_BxN, [[EOS, PAD, PAD, PAD, PAD]])
  np.testing.assert_array_equal(out.lengths_B, [1])


def test_truncate_top_k_and_top_p_keep_expected_sets():
  logp = jnp.log(jnp.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
  kept = lambda x: np.asarray(x[0] > -1e29)
  np.testing.assert_array_equal(kept(truncate(logp, 2, 1.0)), [1, 1, 0, 0, 0])
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.6)), [1, 1, 0, 0, 0])  # 0.5 < 0.6 -> need 2nd
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.5)), [1, 0, 0, 0, 0])
  np.testing.assert_array_equal(kept(truncate(logp, 0, 0.86)), [1, 1, 1, 1, 0])


def test_invalid_sampling_params_are_refused():
  with pytest.raises(ValueError, match="top_p"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    SamplingParams(temperature=-1.0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_generated_tokens_and_logprobs_match_full_forward(temperature):
  cfg = ModelConfig(vocab_size=V, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, d_ff=64)
  mesh = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
  graphdef, params = sharding.create_sharded(lambda: Transformer(cfg, nnx.Rngs(1)), mesh, sharding.DEFAULT_RULES)
  prompt = jnp.array([[PAD, PAD, 5, 6], [3, 4, 9, 7]], jnp.int32)
  valid = prompt != PAD
  out = generate(graphdef, params, prompt, valid, jax.random.key(2), max_new_tokens=6, eos_id=EOS, pad_id=PAD,
                 sampling=SamplingParams(temperature=temperature))
  seq = jnp.concatenate([prompt, out.tokens_BxN], axis=1)
  seq_valid = jnp.concatenate([valid, out.mask_BxN], axis=1)
  logits = sequence_logits(graphdef, params, seq, seq_valid)[:, 3:-1]  # logits that predicted each new token
  logp = jax.nn.log_softmax(logits / (temperature or 1.0))
  want = jnp.take_along_axis(logp, out.tokens_BxN[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(jnp.where(out.mask_BxN, want, 0.0), out.logprobs_BxN, atol=1e-4)
  if temperature == 0.0:
    greedy = jnp.argmax(logits, axis=-1)
    np.testing.assert_array_equal(jnp.where(out.mask_BxN, greedy, PAD), out.tokens_BxN)
