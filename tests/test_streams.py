"""Named random streams: refill rounds never draw another stream's problems, and the historical streams keep
their values (cached base policies and measured figures depend on them)."""
import jax
import numpy as np

from jaxrl_batch.runtime import streams


def test_refill_rounds_draw_their_own_problems():
  seeds = range(50)
  round0 = {streams.rl_prompt_seed(s, 0) for s in seeds}
  sft = {streams.sft_prompt_seed(s) for s in seeds}
  refills = [streams.rl_prompt_seed(s, r) for s in seeds for r in range(1, 6)]
  assert len(set(refills)) == len(refills)
  assert not set(refills) & (round0 | sft)
  # Before the streams were named, round 1 of seed s drew SFT's problems of seed s.
  assert all(streams.rl_prompt_seed(s, 1) != streams.sft_prompt_seed(s) for s in seeds)


def test_historical_streams_keep_their_values():
  assert streams.rl_prompt_seed(7, 0) == 7 and streams.sft_prompt_seed(7) == 7 + 1_000_003
  np.testing.assert_array_equal(streams.shuffle_rng(3, 5).permutation(16),
                                np.random.default_rng([3, 5, 1]).permutation(16))
  np.testing.assert_array_equal(streams.sft_format_rng(3, 5).integers(0, 100, 8),
                                np.random.default_rng([3 + 1_000_003, 5, 1]).integers(0, 100, 8))


def test_sampling_keys_are_built_on_the_device_as_before():
  make = jax.jit(streams.sampling_key)
  base = jax.random.fold_in(jax.random.key(3), 11)
  for round_, expected in ((0, base), (2, jax.random.fold_in(base, 2))):
    got = make(jax.numpy.asarray(streams.sampling_key_data(3, 11, round_)))
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(expected))
