"""Gradient noise scale: the unbiased estimators and the EMA ratio, against hand-computed values."""
import math

import numpy as np
import pytest

from jaxrl_batch.rl.noise_scale import NoiseScale, unbiased_estimates


def test_unbiased_estimates_invert_the_expected_norms():
  # |G|^2 = 4, tr(Sigma) = 64: E|G_8|^2 = 4 + 64/8 = 12 and E|G_32|^2 = 4 + 64/32 = 6.
  assert unbiased_estimates(12.0, 6.0, 8, 32) == (pytest.approx(4.0), pytest.approx(64.0))


def test_ema_ratio_converges_to_b_simple_on_noisy_gradients():
  rng = np.random.default_rng(0)
  g_true, sigma, dim, small, big = np.full(50, 0.1), 1.0, 50, 4, 16  # |G|^2 = 0.5, tr = 50: B_simple = 100
  estimate = NoiseScale(decay=0.99)
  for _ in range(3000):
    samples = g_true + sigma * rng.normal(size=(big, dim))
    small_sq = np.mean([np.sum(samples[i * small:(i + 1) * small].mean(0) ** 2) for i in range(big // small)])
    value = estimate.update(small_sq, np.sum(samples.mean(0) ** 2), small, big)
  assert value == pytest.approx(100.0, rel=0.25)


def test_needs_two_batch_sizes():
  with pytest.raises(ValueError, match="0 < small < big"):
    unbiased_estimates(1.0, 1.0, 8, 8)
  assert math.isnan(NoiseScale().update(10.0, 1.0, 4, 8))  # |G|^2 estimate (8 - 40) / 4 < 0: no value yet
